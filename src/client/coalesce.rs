//! Client-side coalescing of calls to batched functions.
//!
//! When many tasks of one client call the same batched function at once,
//! each call would pay the full cost of a round trip for one example. The
//! client instead queues them and sends up to `max_batch` examples stacked
//! along a new leading dimension in one call (`Request.examples`); the
//! server's batcher treats them as that many examples (merging them with
//! other clients' examples as usual) and returns stacked outputs, which the
//! client splits back, one row per caller. Callers still use the plain
//! `call`, and an error reaches every caller of the failed batch.
//!
//! At most [`IN_FLIGHT`] stacked calls per function are outstanding: while
//! one is being served, the next batch fills up.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use tensorwire_codecs::{AlignedBuf, DType, Tensor};
use tokio::sync::oneshot;

use crate::error::{CallError, Status};
use crate::rpc::call::Output;
use crate::rpc::value::{Args, Value};
use crate::util::sync::lock;

/// What the coalescer needs from a client: one wire call that is not
/// coalesced again (`examples` > 0: the inputs hold that many stacked
/// examples), and a way to count each caller's logical call.
pub(crate) trait WireCall: Clone + Send + Sync + 'static {
    /// One wire call of `function`.
    fn call_raw(
        &self,
        function: &str,
        inputs: Vec<Tensor>,
        args: Args,
        examples: usize,
    ) -> impl Future<Output = Result<Output, CallError>> + Send;
    /// Counts one logical call (coalesced calls share wire calls).
    fn record_logical_call(&self, ok: bool, took: Duration);
}

/// Stacked calls outstanding per function.
pub(crate) const IN_FLIGHT: usize = 2;

struct Waiting {
    inputs: Vec<Tensor>,
    args: Args,
    reply: oneshot::Sender<Result<Output, CallError>>,
}

impl Waiting {
    fn signature(&self) -> Vec<(DType, &[usize])> {
        self.inputs.iter().map(|t| (t.dtype(), t.shape())).collect()
    }
}

/// The queue of one batched function.
pub(crate) struct FnQueue {
    function: String,
    max_batch: usize,
    items: Mutex<VecDeque<Waiting>>,
    in_flight: AtomicUsize,
}

/// Per-client coalescing state.
#[derive(Default)]
pub(crate) struct Coalescer {
    queues: Mutex<HashMap<String, Arc<FnQueue>>>,
}

impl Coalescer {
    fn queue(&self, function: &str, max_batch: usize) -> Arc<FnQueue> {
        lock(&self.queues)
            .entry(function.to_string())
            .or_insert_with(|| {
                Arc::new(FnQueue {
                    function: function.to_string(),
                    max_batch: max_batch.max(1),
                    items: Mutex::new(VecDeque::new()),
                    in_flight: AtomicUsize::new(0),
                })
            })
            .clone()
    }

    /// Queues one call and waits for its result.
    pub(crate) async fn call<C: WireCall>(
        &self,
        client: &C,
        function: &str,
        max_batch: usize,
        inputs: Vec<Tensor>,
        args: Args,
    ) -> Result<Output, CallError> {
        let started = Instant::now();
        let q = self.queue(function, max_batch);
        let (reply, wait) = oneshot::channel();
        lock(&q.items).push_back(Waiting { inputs, args, reply });
        if q.in_flight.fetch_add(1, Ordering::AcqRel) < IN_FLIGHT {
            tokio::spawn(flush(client.clone(), q));
        } else {
            q.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        let r =
            wait.await.unwrap_or_else(|_| Err(CallError::Remote(Status::internal("the coalesced call was dropped"))));
        client.record_logical_call(r.is_ok(), started.elapsed());
        r
    }
}

/// Sends batches until the queue is empty.
///
/// A caller queues its item and then claims a flusher slot; a flusher that
/// finds the queue empty gives its slot back and looks once more, so an item
/// queued while it was leaving (whose caller saw every slot taken) is sent.
async fn flush<C: WireCall>(client: C, q: Arc<FnQueue>) {
    let mut slot = Slot { q: &q, held: true };
    loop {
        let batch = take_batch(&q);
        if batch.is_empty() {
            slot.give_back();
            if lock(&q.items).is_empty() {
                return;
            }
            if q.in_flight.fetch_add(1, Ordering::AcqRel) >= IN_FLIGHT {
                // Another flusher is active and will take it.
                q.in_flight.fetch_sub(1, Ordering::AcqRel);
                return;
            }
            slot.held = true;
            continue;
        }
        // A panic in one batch's call fails that batch's callers (their
        // replies are dropped), not the calls queued behind it.
        let sent = std::panic::AssertUnwindSafe(send(&client, &q.function, batch)).catch_unwind().await;
        if sent.is_err() {
            tracing::warn!(function = %q.function, "a coalesced call panicked; its callers get an error");
        }
    }
}

/// A flusher's slot, given back however the flusher ends (also when a
/// call panics or the runtime drops the task): a slot lost for good would
/// leave the function's later calls queued with nobody to send them.
struct Slot<'a> {
    q: &'a FnQueue,
    held: bool,
}

impl Slot<'_> {
    fn give_back(&mut self) {
        if std::mem::take(&mut self.held) {
            self.q.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.give_back();
    }
}

/// Takes up to `max_batch` calls from the front of the queue that can be
/// stacked together (same dtypes, shapes and arguments).
fn take_batch(q: &FnQueue) -> Vec<Waiting> {
    let mut items = lock(&q.items);
    // Callers that gave up (their future dropped) are not sent for.
    items.retain(|w| !w.reply.is_closed());
    let Some(first) = items.pop_front() else { return vec![] };
    let mut batch = vec![first];
    let mut i = 0;
    while batch.len() < q.max_batch && i < items.len() {
        if items[i].signature() == batch[0].signature() && items[i].args == batch[0].args {
            batch.push(items.remove(i).expect("in range"));
        } else {
            i += 1;
        }
    }
    batch
}

async fn send<C: WireCall>(client: &C, function: &str, batch: Vec<Waiting>) {
    if batch.len() == 1 {
        let w = batch.into_iter().next().expect("one");
        let r = client.call_raw(function, w.inputs, w.args, 0).await;
        let _ = w.reply.send(r);
        return;
    }
    let n = batch.len();
    let stacked = match stack(&batch) {
        Ok(s) => s,
        Err(e) => {
            for w in batch {
                let _ = w.reply.send(Err(CallError::InvalidArgument(e.to_string())));
            }
            return;
        }
    };
    let args = batch[0].args.clone();
    match client.call_raw(function, stacked, args, n).await {
        Ok(out) => match split(&out.tensors, n) {
            Ok(rows) => {
                for (w, tensors) in batch.into_iter().zip(rows) {
                    let _ = w.reply.send(Ok(Output { tensors, values: Value::None }));
                }
            }
            Err(e) => {
                for w in batch {
                    let _ = w.reply.send(Err(e.duplicate()));
                }
            }
        },
        Err(e) => {
            for w in batch {
                let _ = w.reply.send(Err(e.duplicate()));
            }
        }
    }
}

fn stack(batch: &[Waiting]) -> Result<Vec<Tensor>, tensorwire_codecs::TensorError> {
    let n = batch.len();
    (0..batch[0].inputs.len())
        .map(|i| {
            let first = &batch[0].inputs[i];
            let each = first.nbytes();
            let mut buf = AlignedBuf::zeroed(each * n);
            for (j, w) in batch.iter().enumerate() {
                buf.as_mut_slice()[j * each..(j + 1) * each].copy_from_slice(&w.inputs[i].to_contiguous_bytes()?);
            }
            let mut shape = vec![n];
            shape.extend_from_slice(first.shape());
            Tensor::new(first.dtype(), shape, buf.freeze())
        })
        .collect()
}

fn split(outs: &[Tensor], n: usize) -> Result<Vec<Vec<Tensor>>, CallError> {
    let mut rows: Vec<Vec<Tensor>> = (0..n).map(|_| Vec::with_capacity(outs.len())).collect();
    for o in outs {
        if o.shape().first() != Some(&n) {
            return Err(CallError::Protocol {
                peer: String::new(),
                reason: format!("a batch of {n} came back with shape {:?}", o.shape()),
            });
        }
        let inner: Vec<usize> = o.shape()[1..].to_vec();
        for (j, slot) in rows.iter_mut().enumerate() {
            let r = o.narrow(0, j, 1).and_then(|r| r.reshape(inner.clone()));
            slot.push(r.map_err(|e| CallError::InvalidArgument(e.to_string()))?);
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    /// A wire call that records each batch's first input byte per row and
    /// echoes its inputs; it waits for a permit before it answers, and
    /// panics on an input whose first byte is 0xFF.
    #[derive(Clone)]
    struct Recorder {
        seen: Arc<Mutex<Vec<Vec<u8>>>>,
        gate: Arc<Semaphore>,
    }

    impl WireCall for Recorder {
        async fn call_raw(&self, _: &str, inputs: Vec<Tensor>, _: Args, examples: usize) -> Result<Output, CallError> {
            let bytes = inputs[0].to_contiguous_bytes().expect("bytes").to_vec();
            lock(&self.seen).push(bytes.clone());
            self.gate.acquire().await.expect("gate").forget();
            assert!(bytes[0] != 0xFF, "the wire call panics");
            let _ = examples;
            Ok(Output { tensors: inputs, values: Value::None })
        }
        fn record_logical_call(&self, _: bool, _: Duration) {}
    }

    fn one(v: u8) -> Vec<Tensor> {
        vec![Tensor::new(DType::UInt8, vec![1], bytes::Bytes::from(vec![v])).expect("tensor")]
    }

    /// A caller that gives up before its call is sent is not sent for, and
    /// a flusher whose call panics gives its slot back: later calls still go.
    #[tokio::test(flavor = "current_thread")]
    async fn abandoned_callers_are_skipped_and_a_panicking_flush_frees_its_slot() {
        let c = Arc::new(Coalescer::default());
        let r = Recorder { seen: Arc::default(), gate: Arc::new(Semaphore::new(0)) };
        // Two calls take both flusher slots and wait at the gate.
        let a = tokio::spawn({
            let (c, r) = (c.clone(), r.clone());
            async move { c.call(&r, "f", 1, one(1), Args::new()).await }
        });
        let b = tokio::spawn({
            let (c, r) = (c.clone(), r.clone());
            async move { c.call(&r, "f", 1, one(2), Args::new()).await }
        });
        while lock(&r.seen).len() < 2 {
            tokio::task::yield_now().await;
        }
        // A third caller queues behind them, then gives up.
        let gone = tokio::spawn({
            let (c, r) = (c.clone(), r.clone());
            async move { c.call(&r, "f", 1, one(3), Args::new()).await }
        });
        tokio::task::yield_now().await;
        gone.abort();
        let _ = gone.await;
        r.gate.add_permits(2);
        assert!(a.await.expect("a").is_ok());
        assert!(b.await.expect("b").is_ok());
        assert_eq!(*lock(&r.seen), [vec![1], vec![2]], "the abandoned call was sent");
        // A wire call that panics: its caller gets an error, and the slot
        // comes back (a call after it is still sent).
        r.gate.add_permits(8);
        for _ in 0..IN_FLIGHT {
            let failed = c.call(&r, "f", 1, one(0xFF), Args::new()).await;
            assert!(failed.is_err());
        }
        // Calls queued behind a panicking one are still sent.
        r.gate.add_permits(8);
        let calls: Vec<_> = [0xFF, 0xFF, 0xFF, 40, 41, 42]
            .into_iter()
            .map(|v| {
                let (c, r) = (c.clone(), r.clone());
                tokio::spawn(async move { c.call(&r, "f", 1, one(v), Args::new()).await })
            })
            .collect();
        for (i, call) in calls.into_iter().enumerate() {
            let out = tokio::time::timeout(Duration::from_secs(10), call).await.expect("not stuck").expect("task");
            assert_eq!(out.is_ok(), i >= 3, "call {i}");
        }
        for v in 4..8 {
            let out = tokio::time::timeout(Duration::from_secs(10), c.call(&r, "f", 1, one(v), Args::new())).await;
            assert!(out.expect("not stuck").is_ok());
        }
    }
}
