//! Named functions (the seeds' compute functions and shared functions):
//! tensors and scalar arguments in, tensors and values out; optional input
//! signatures checked before the function runs; sync, inline, async and
//! batched execution.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures_util::FutureExt;
use tensorwire_codecs::{DType, Tensor};
use tensorwire_proto::v1;

use super::batch::{BatchConfig, Batcher};
use super::call::{Call, Output};
use super::value::Args;
use crate::error::Status;
use crate::observe::stats::FunctionStats;
use crate::pipeline::wire::{dtype_from_wire, dtype_to_wire};

/// Expected dtype and shape of one input. Shape entries of `-1` match any size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The argument's name, used in error messages.
    pub name: String,
    /// Required dtype (None: any).
    pub dtype: Option<DType>,
    /// Required shape, `-1` as wildcard (None: any rank and sizes).
    pub shape: Option<Vec<i64>>,
}

impl TensorSpec {
    /// Any tensor, named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self { name: name.into(), dtype: None, shape: None }
    }

    /// Requires `dtype`.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// Requires `shape` (`-1` for any size in that dimension).
    pub fn shape(mut self, shape: impl Into<Vec<i64>>) -> Self {
        self.shape = Some(shape.into());
        self
    }

    /// Checks a tensor; the error names the argument and what differs.
    pub fn check(&self, t: &Tensor) -> Result<(), Status> {
        if let Some(d) = self.dtype
            && t.dtype() != d
        {
            return Err(Status::invalid_argument(format!("argument {:?} must be {d}, got {}", self.name, t.dtype())));
        }
        if let Some(shape) = &self.shape {
            let ok = shape.len() == t.dim()
                && shape.iter().zip(t.shape()).all(|(&want, &got)| want < 0 || want as usize == got);
            if !ok {
                return Err(Status::invalid_argument(format!(
                    "argument {:?} must have shape {}, got {:?}",
                    self.name,
                    fmt_shape(shape),
                    t.shape()
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn to_wire(&self) -> v1::TensorSpec {
        v1::TensorSpec {
            name: self.name.clone(),
            dtype: self.dtype.map_or(v1::Dtype::Unspecified, dtype_to_wire) as i32,
            shape: self.shape.clone().unwrap_or_default(),
            has_shape: self.shape.is_some(),
        }
    }

    pub(crate) fn from_wire(w: &v1::TensorSpec) -> Self {
        Self {
            name: w.name.clone(),
            dtype: dtype_from_wire(w.dtype).ok().flatten(),
            shape: w.has_shape.then(|| w.shape.clone()),
        }
    }
}

fn fmt_shape(s: &[i64]) -> String {
    let parts: Vec<String> = s.iter().map(|&d| if d < 0 { "*".to_string() } else { d.to_string() }).collect();
    format!("[{}]", parts.join(", "))
}

type SyncFn = dyn Fn(Call) -> Result<Output, Status> + Send + Sync;
type BoxFut = Pin<Box<dyn Future<Output = Result<Output, Status>> + Send>>;
type AsyncFn = dyn Fn(Call) -> BoxFut + Send + Sync;

#[derive(Clone)]
pub(crate) enum Exec {
    /// On the blocking thread pool: sync code never stalls the runtime.
    Blocking(Arc<SyncFn>),
    /// On the runtime thread: for functions that take microseconds.
    Inline(Arc<SyncFn>),
    Async(Arc<AsyncFn>),
    Batched(Arc<Batcher>),
}

/// A named function ready to register on a server.
pub struct Function {
    pub(crate) name: String,
    pub(crate) doc: String,
    pub(crate) inputs: Option<Vec<TensorSpec>>,
    pub(crate) arg_names: Vec<String>,
    pub(crate) exec: Exec,
    pub(crate) stats: FunctionStats,
}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Function").field("name", &self.name).field("inputs", &self.inputs).finish_non_exhaustive()
    }
}

impl Function {
    fn with_exec(name: impl Into<String>, exec: Exec) -> Self {
        Self {
            name: name.into(),
            doc: String::new(),
            inputs: None,
            arg_names: Vec::new(),
            exec,
            stats: FunctionStats::default(),
        }
    }

    /// A sync function, run on the blocking thread pool (off the async runtime).
    pub fn new(name: impl Into<String>, f: impl Fn(Call) -> Result<Output, Status> + Send + Sync + 'static) -> Self {
        Self::with_exec(name, Exec::Blocking(Arc::new(f)))
    }

    /// A sync function cheap enough to run on the runtime thread (microseconds):
    /// saves the hand-off to the blocking pool.
    pub fn inline(name: impl Into<String>, f: impl Fn(Call) -> Result<Output, Status> + Send + Sync + 'static) -> Self {
        Self::with_exec(name, Exec::Inline(Arc::new(f)))
    }

    /// An async function.
    pub fn new_async<F, Fut>(name: impl Into<String>, f: F) -> Self
    where
        F: Fn(Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Output, Status>> + Send + 'static,
    {
        Self::with_exec(name, Exec::Async(Arc::new(move |c| Box::pin(f(c)) as BoxFut)))
    }

    /// A batched function (the TensorFlow seed): callers send one example
    /// each; the server stacks up to `config.max_batch` examples along a new
    /// leading dimension (waiting at most `config.max_wait`), calls `f` once
    /// with the stacked inputs and the first caller's arguments, and splits
    /// each output along its leading dimension back to the callers. Runs on
    /// the blocking pool.
    pub fn batched(
        name: impl Into<String>,
        config: BatchConfig,
        f: impl Fn(Vec<Tensor>, &Args) -> Result<Vec<Tensor>, Status> + Send + Sync + 'static,
    ) -> Self {
        let name = name.into();
        let stats = FunctionStats::default();
        let batcher = Batcher::start(name.clone(), config, Arc::new(f), stats.clone());
        Self { name, doc: String::new(), inputs: None, arg_names: Vec::new(), exec: Exec::Batched(batcher), stats }
    }

    /// Declares the inputs; calls with other dtypes, shapes or counts are
    /// refused before the function runs.
    pub fn inputs(mut self, specs: impl IntoIterator<Item = TensorSpec>) -> Self {
        self.inputs = Some(specs.into_iter().collect());
        self
    }

    /// Names the scalar arguments in positional order: callers that pass
    /// arguments by position (JSON-RPC `"params": [10, 20]`) reach the
    /// function as `args` of these names. Shown by `list_functions`.
    pub fn arg_names<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.arg_names = names.into_iter().map(Into::into).collect();
        self
    }

    /// A one-line description shown by `list_functions`.
    pub fn doc(mut self, doc: impl Into<String>) -> Self {
        self.doc = doc.into();
        self
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn check(&self, inputs: &[Tensor]) -> Result<(), Status> {
        let Some(specs) = &self.inputs else { return Ok(()) };
        if specs.len() != inputs.len() {
            let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
            return Err(Status::invalid_argument(format!(
                "{} takes {} tensor(s) ({}), got {}",
                self.name,
                specs.len(),
                names.join(", "),
                inputs.len()
            )));
        }
        specs.iter().zip(inputs).try_for_each(|(s, t)| s.check(t))
    }

    pub(crate) fn info(&self) -> v1::FunctionInfo {
        let (max_batch, max_wait_us) = match &self.exec {
            Exec::Batched(b) => (b.config().max_batch as u32, b.config().max_wait.as_micros() as u64),
            _ => (0, 0),
        };
        v1::FunctionInfo {
            name: self.name.clone(),
            inputs: self.inputs.iter().flatten().map(TensorSpec::to_wire).collect(),
            doc: self.doc.clone(),
            max_batch,
            max_wait_us,
            is_async: matches!(self.exec, Exec::Async(_)),
            arg_names: self.arg_names.clone(),
        }
    }

    /// For batched functions, the largest batch.
    pub fn batch_limit(&self) -> Option<usize> {
        match &self.exec {
            Exec::Batched(b) => Some(b.config().max_batch),
            _ => None,
        }
    }

    /// Runs a batched function on `examples` examples stacked in each
    /// input's leading dimension (a client coalescing calls).
    pub(crate) async fn run_stacked(&self, call: Call, examples: usize) -> Result<Output, Status> {
        match &self.exec {
            Exec::Batched(b) => b.submit_stacked(call, examples).await,
            _ => Err(Status::invalid_argument(format!("{} is not batched: it takes one example per call", self.name))),
        }
    }

    /// Checks stacked inputs against the signature, per example.
    pub(crate) fn check_stacked(&self, inputs: &[Tensor]) -> Result<(), Status> {
        let rows: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.narrow(0, 0, 1).and_then(|r| r.reshape(t.shape()[1..].to_vec())))
            .collect::<Result<_, _>>()?;
        self.check(&rows)
    }

    /// Runs the function on `call` (signature already checked).
    pub(crate) async fn run(&self, call: Call) -> Result<Output, Status> {
        self.run_timed(call).await.0
    }

    /// [`Self::run`], and how long the function took (the server reports
    /// it to the caller; one pair of clock reads serves both).
    pub(crate) async fn run_timed(&self, call: Call) -> (Result<Output, Status>, std::time::Duration) {
        let started = Instant::now();
        let name = &self.name;
        let panicked = |p: Box<dyn std::any::Any + Send>| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Status::internal(format!("function {name} panicked: {msg}"))
        };
        let r = match &self.exec {
            Exec::Inline(f) => {
                std::panic::catch_unwind(AssertUnwindSafe(|| f(call))).unwrap_or_else(|p| Err(panicked(p)))
            }
            Exec::Blocking(f) => {
                let f = f.clone();
                match tokio::task::spawn_blocking(move || f(call)).await {
                    Ok(r) => r,
                    Err(e) if e.is_panic() => Err(panicked(e.into_panic())),
                    Err(e) => Err(Status::internal(format!("function {} did not finish: {e}", self.name))),
                }
            }
            Exec::Async(f) => AssertUnwindSafe(f(call)).catch_unwind().await.unwrap_or_else(|p| Err(panicked(p))),
            Exec::Batched(b) => b.submit(call).await,
        };
        let took = started.elapsed();
        if !matches!(self.exec, Exec::Batched(_)) {
            self.stats.record(took, r.is_ok(), 1);
        }
        (r, took)
    }
}

/// The server's functions, by name, in registration order.
#[derive(Default)]
pub(crate) struct Registry {
    order: Vec<Arc<Function>>,
    by_name: HashMap<String, Arc<Function>>,
}

impl Registry {
    pub(crate) fn insert(&mut self, f: Function) {
        let f = Arc::new(f);
        if let Some(old) = self.by_name.insert(f.name.clone(), f.clone()) {
            self.order.retain(|x| !Arc::ptr_eq(x, &old));
        }
        self.order.push(f);
    }

    pub(crate) fn get(&self, name: &str) -> Result<&Arc<Function>, Status> {
        self.by_name.get(name).ok_or_else(|| {
            let names: Vec<&str> = self.order.iter().map(|f| f.name.as_str()).collect();
            Status::not_found(format!(
                "no function named {name:?}; this server has: {}",
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            ))
        })
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arc<Function>> {
        self.order.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_the_argument() {
        let s = TensorSpec::new("x").dtype(DType::Float32).shape([-1, 3]);
        assert!(s.check(&Tensor::zeros(DType::Float32, [5, 3]).unwrap()).is_ok());
        let e = s.check(&Tensor::zeros(DType::Float32, [5, 4]).unwrap()).unwrap_err();
        assert!(e.message.contains("\"x\"") && e.message.contains("[*, 3]"), "{e}");
        let e = s.check(&Tensor::zeros(DType::Int64, [5, 3]).unwrap()).unwrap_err();
        assert!(e.message.contains("must be float32, got int64"), "{e}");
        assert_eq!(TensorSpec::from_wire(&s.to_wire()), s);
    }

    #[test]
    fn unknown_names_list_what_exists() {
        let mut r = Registry::default();
        r.insert(Function::inline("a", |c| Ok(c.inputs.into())));
        r.insert(Function::inline("b", |c| Ok(c.inputs.into())));
        let e = r.get("zz").err().unwrap();
        assert_eq!(e.code, crate::Code::NotFound);
        assert!(e.message.contains("this server has: a, b"), "{e}");
    }
}
