//! Dynamic batching: concurrent callers each send one example; a batcher
//! stacks them along a new leading dimension, runs the function once, and
//! splits the results back (the TensorFlow seed's batched functions).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorwire_codecs::{AlignedBuf, DType, Tensor};
use tokio::sync::{mpsc, oneshot};

use crate::error::Status;
use crate::observe::stats::FunctionStats;
use crate::rpc::call::{Call, Output};
use crate::rpc::value::{Args, Value};
use crate::util::sync::lock;

/// When a batch runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// Run as soon as this many examples wait (default 8).
    pub max_batch: usize,
    /// Run a partial batch once its first example waited this long (default 2 ms).
    pub max_wait: Duration,
    /// Examples that may wait at once; more are refused (default 65,536).
    pub max_queue: usize,
    /// Run the function on the runtime thread instead of the blocking pool
    /// (default false). Only for functions that finish in microseconds: it
    /// saves a thread hand-off per batch, but a slow function would stall
    /// every call on that runtime thread.
    pub inline: bool,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self { max_batch: 8, max_wait: Duration::from_millis(2), max_queue: 65_536, inline: false }
    }
}

type BatchFn = Arc<dyn Fn(Vec<Tensor>, &Args) -> Result<Vec<Tensor>, Status> + Send + Sync>;

struct Pending {
    call: Call,
    /// 0: one example; N: N examples stacked along a leading dimension.
    stacked: usize,
    reply: oneshot::Sender<Result<Output, Status>>,
}

impl Pending {
    fn examples(&self) -> usize {
        self.stacked.max(1)
    }
}

/// Queues examples for one batched function.
pub(crate) struct Batcher {
    name: String,
    config: BatchConfig,
    tx: mpsc::Sender<Pending>,
    /// Taken by the batching task, started on the first call (the function
    /// may be registered before a runtime exists).
    rx: Mutex<Option<(mpsc::Receiver<Pending>, BatchFn, FunctionStats)>>,
}

impl Batcher {
    pub(crate) fn start(name: String, config: BatchConfig, f: BatchFn, stats: FunctionStats) -> Arc<Self> {
        let config = BatchConfig { max_batch: config.max_batch.max(1), max_queue: config.max_queue.max(1), ..config };
        let (tx, rx) = mpsc::channel(config.max_queue);
        Arc::new(Self { name, config, tx, rx: Mutex::new(Some((rx, f, stats))) })
    }

    pub(crate) fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// One example.
    pub(crate) async fn submit(&self, call: Call) -> Result<Output, Status> {
        self.submit_stacked(call, 0).await
    }

    /// `stacked` examples (0: one, unstacked) in each input's leading
    /// dimension; outputs come back stacked the same way.
    pub(crate) async fn submit_stacked(&self, call: Call, stacked: usize) -> Result<Output, Status> {
        if stacked > 0 {
            for t in &call.inputs {
                if t.shape().first() != Some(&stacked) {
                    return Err(Status::invalid_argument(format!(
                        "{}: {stacked} stacked examples need inputs with leading dimension {stacked}, got {:?}",
                        self.name,
                        t.shape()
                    )));
                }
            }
        }
        if let Some((rx, f, stats)) = lock(&self.rx).take() {
            tokio::spawn(run(self.name.clone(), self.config.clone(), rx, f, stats));
        }
        let (reply, wait) = oneshot::channel();
        self.tx.try_send(Pending { call, stacked, reply }).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                Status::resource_exhausted(format!("{}: {} examples already waiting", self.name, self.config.max_queue))
            }
            mpsc::error::TrySendError::Closed(_) => Status::unavailable(format!("{}: batcher stopped", self.name)),
        })?;
        wait.await.unwrap_or_else(|_| Err(Status::internal(format!("{}: the batch was dropped", self.name))))
    }
}

async fn run(name: String, config: BatchConfig, mut rx: mpsc::Receiver<Pending>, f: BatchFn, stats: FunctionStats) {
    let inline = config.inline;
    // A stacked group that would overfill a batch waits for the next one.
    let mut carry: Option<Pending> = None;
    loop {
        let first = match carry.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        let mut n = first.examples();
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + config.max_wait;
        while n < config.max_batch {
            tokio::select! {
                p = rx.recv() => match p {
                    Some(p) if n + p.examples() > config.max_batch => {
                        carry = Some(p);
                        break;
                    }
                    Some(p) => {
                        n += p.examples();
                        batch.push(p);
                    }
                    None => break,
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        // Callers that gave up are not computed for.
        batch.retain(|p| !p.reply.is_closed() && !p.call.ctx.is_cancelled());
        // Examples of different shapes cannot be stacked, and the function
        // sees one set of arguments per run: one run per shape and arguments.
        while !batch.is_empty() {
            let head = batch.remove(0);
            let key = signature(&head);
            let (mut group, rest): (Vec<Pending>, Vec<Pending>) =
                batch.into_iter().partition(|p| signature(p) == key && same_args(&p.call.args, &head.call.args));
            // The head leads its own group whatever its arguments hold (a
            // NaN equals nothing, itself included).
            group.insert(0, head);
            batch = rest;
            run_group(&name, group, &f, &stats, inline).await;
        }
    }
}

/// Whether two callers passed the same arguments, bit for bit: floats by
/// their bits (a NaN matches the same NaN; 0.0 and -0.0 differ).
fn same_args(a: &Args, b: &Args) -> bool {
    fn same(a: &Value, b: &Value) -> bool {
        match (a, b) {
            (Value::Float(x), Value::Float(y)) => x.to_bits() == y.to_bits(),
            (Value::List(x), Value::List(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y)),
            (Value::Map(x), Value::Map(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|((kx, vx), (ky, vy))| kx == ky && same(vx, vy))
            }
            (x, y) => x == y,
        }
    }
    a.0.len() == b.0.len() && a.0.iter().zip(&b.0).all(|((ka, va), (kb, vb))| ka == kb && same(va, vb))
}

/// dtype and per-example shape of each input.
fn signature(p: &Pending) -> Vec<(DType, Vec<usize>)> {
    let skip = usize::from(p.stacked > 0);
    p.call.inputs.iter().map(|t| (t.dtype(), t.shape()[skip..].to_vec())).collect()
}

async fn run_group(name: &str, group: Vec<Pending>, f: &BatchFn, stats: &FunctionStats, inline: bool) {
    let n: usize = group.iter().map(Pending::examples).sum();
    let started = Instant::now();
    let stacked = match stack(&group) {
        Ok(s) => s,
        Err(e) => {
            for p in group {
                let _ = p.reply.send(Err(e.clone()));
            }
            return;
        }
    };
    // Every caller of a group passed these same arguments.
    let args = group[0].call.args.clone();
    let result = if inline {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(stacked, &args)))
            .unwrap_or_else(|_| Err(Status::internal(format!("batched function {name} panicked"))))
    } else {
        let f = f.clone();
        match tokio::task::spawn_blocking(move || f(stacked, &args)).await {
            Ok(r) => r,
            Err(e) => Err(Status::internal(format!("batched function {name} failed: {e}"))),
        }
    };
    let result = result.and_then(|outs| split(name, outs, &group));
    stats.record(started.elapsed(), result.is_ok(), n as u64);
    match result {
        Ok(per_caller) => {
            for (p, tensors) in group.into_iter().zip(per_caller) {
                let _ = p.reply.send(Ok(Output::tensors(tensors)));
            }
        }
        Err(e) => {
            for p in group {
                let _ = p.reply.send(Err(e.clone()));
            }
        }
    }
}

/// Stacks the i-th input of every example into one tensor with a leading
/// batch dimension (a single pre-stacked caller passes through uncopied).
fn stack(group: &[Pending]) -> Result<Vec<Tensor>, Status> {
    if let [only] = group
        && only.stacked > 0
    {
        return Ok(only.call.inputs.clone());
    }
    let n: usize = group.iter().map(Pending::examples).sum();
    let arity = group[0].call.inputs.len();
    (0..arity)
        .map(|i| {
            let first = &group[0].call.inputs[i];
            let inner: &[usize] = if group[0].stacked > 0 { &first.shape()[1..] } else { first.shape() };
            let each = tensorwire_codecs::tensor::byte_size(first.dtype(), inner)?;
            let mut buf = AlignedBuf::zeroed(each * n);
            let mut at = 0;
            for p in group {
                let bytes = p.call.inputs[i].to_contiguous_bytes()?;
                let len = each * p.examples();
                buf.as_mut_slice()[at..at + len].copy_from_slice(&bytes);
                at += len;
            }
            let mut shape = vec![n];
            shape.extend_from_slice(inner);
            Ok(Tensor::new(first.dtype(), shape, buf.freeze())?)
        })
        .collect()
}

/// Splits each output along its leading dimension back to the callers:
/// one row each, or a stacked block for callers that sent several.
fn split(name: &str, outs: Vec<Tensor>, group: &[Pending]) -> Result<Vec<Vec<Tensor>>, Status> {
    let n: usize = group.iter().map(Pending::examples).sum();
    let mut per: Vec<Vec<Tensor>> = (0..group.len()).map(|_| Vec::with_capacity(outs.len())).collect();
    for o in outs {
        if o.shape().first() != Some(&n) {
            return Err(Status::internal(format!(
                "batched function {name} returned shape {:?} for a batch of {n}: the leading dimension must be the batch",
                o.shape()
            )));
        }
        let o = o.contiguous()?;
        let inner: Vec<usize> = o.shape()[1..].to_vec();
        let mut at = 0;
        for (p, slot) in group.iter().zip(per.iter_mut()) {
            let k = p.examples();
            let rows = o.narrow(0, at, k)?;
            slot.push(if p.stacked > 0 { rows } else { rows.reshape(inner.clone())? });
            at += k;
        }
    }
    Ok(per)
}
