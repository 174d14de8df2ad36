//! Dynamic batching: concurrent callers each send one example; a batcher
//! stacks them along a new leading dimension, runs the function once, and
//! splits the results back (the TensorFlow seed's batched functions).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorwire_codecs::{AlignedBuf, DType, Tensor};
use tokio::sync::{mpsc, oneshot};

use crate::error::Status;
use crate::function::{Call, FunctionStats, Output};
use crate::value::Args;

/// When a batch runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// Run as soon as this many examples wait (default 8).
    pub max_batch: usize,
    /// Run a partial batch once its first example waited this long (default 2 ms).
    pub max_wait: Duration,
    /// Examples that may wait at once; more are refused (default 65,536).
    pub max_queue: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self { max_batch: 8, max_wait: Duration::from_millis(2), max_queue: 65_536 }
    }
}

type BatchFn = Arc<dyn Fn(Vec<Tensor>, &Args) -> Result<Vec<Tensor>, Status> + Send + Sync>;

struct Pending {
    call: Call,
    reply: oneshot::Sender<Result<Output, Status>>,
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

    pub(crate) async fn submit(&self, call: Call) -> Result<Output, Status> {
        if let Some((rx, f, stats)) = self.rx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            tokio::spawn(run(self.name.clone(), self.config.clone(), rx, f, stats));
        }
        let (reply, wait) = oneshot::channel();
        self.tx.try_send(Pending { call, reply }).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                Status::resource_exhausted(format!("{}: {} examples already waiting", self.name, self.config.max_queue))
            }
            mpsc::error::TrySendError::Closed(_) => Status::unavailable(format!("{}: batcher stopped", self.name)),
        })?;
        wait.await.unwrap_or_else(|_| Err(Status::internal(format!("{}: the batch was dropped", self.name))))
    }
}

async fn run(name: String, config: BatchConfig, mut rx: mpsc::Receiver<Pending>, f: BatchFn, stats: FunctionStats) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + config.max_wait;
        while batch.len() < config.max_batch {
            tokio::select! {
                p = rx.recv() => match p {
                    Some(p) => batch.push(p),
                    None => break,
                },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
        // Callers that gave up are not computed for.
        batch.retain(|p| !p.reply.is_closed() && !p.call.ctx.is_cancelled());
        // Examples of different shapes cannot be stacked: one run per shape.
        while !batch.is_empty() {
            let key = signature(&batch[0].call.inputs);
            let (group, rest): (Vec<Pending>, Vec<Pending>) =
                batch.into_iter().partition(|p| signature(&p.call.inputs) == key);
            batch = rest;
            run_group(&name, group, &f, &stats).await;
        }
    }
}

fn signature(inputs: &[Tensor]) -> Vec<(DType, Vec<usize>)> {
    inputs.iter().map(|t| (t.dtype(), t.shape().to_vec())).collect()
}

async fn run_group(name: &str, group: Vec<Pending>, f: &BatchFn, stats: &FunctionStats) {
    let n = group.len();
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
    let args = group[0].call.args.clone();
    let f = f.clone();
    let result = match tokio::task::spawn_blocking(move || f(stacked, &args)).await {
        Ok(r) => r,
        Err(e) => Err(Status::internal(format!("batched function {name} failed: {e}"))),
    };
    let result = result.and_then(|outs| split(name, outs, n));
    stats.record(started.elapsed(), result.is_ok(), n as u64);
    match result {
        Ok(per_example) => {
            for (p, tensors) in group.into_iter().zip(per_example) {
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

/// Stacks the i-th input of every example into one tensor with a leading batch dimension.
fn stack(group: &[Pending]) -> Result<Vec<Tensor>, Status> {
    let n = group.len();
    let arity = group[0].call.inputs.len();
    (0..arity)
        .map(|i| {
            let first = &group[0].call.inputs[i];
            let each = first.nbytes();
            let mut buf = AlignedBuf::zeroed(each * n);
            for (j, p) in group.iter().enumerate() {
                let bytes = p.call.inputs[i].to_contiguous_bytes()?;
                buf.as_mut_slice()[j * each..(j + 1) * each].copy_from_slice(&bytes);
            }
            let mut shape = vec![n];
            shape.extend_from_slice(first.shape());
            Ok(Tensor::new(first.dtype(), shape, buf.freeze())?)
        })
        .collect()
}

/// Splits each output along its leading dimension into per-example tensors.
fn split(name: &str, outs: Vec<Tensor>, n: usize) -> Result<Vec<Vec<Tensor>>, Status> {
    let mut per: Vec<Vec<Tensor>> = (0..n).map(|_| Vec::with_capacity(outs.len())).collect();
    for o in outs {
        if o.shape().first() != Some(&n) {
            return Err(Status::internal(format!(
                "batched function {name} returned shape {:?} for a batch of {n}: the leading dimension must be the batch",
                o.shape()
            )));
        }
        let o = o.contiguous()?;
        let inner: Vec<usize> = o.shape()[1..].to_vec();
        for (j, slot) in per.iter_mut().enumerate() {
            slot.push(o.narrow(0, j, 1)?.reshape(inner.clone())?);
        }
    }
    Ok(per)
}
