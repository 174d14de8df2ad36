//! What one call carries: a function's [`Call`] (inputs, arguments,
//! context) and [`Output`]; the [`CallContext`] and [`Cancellation`] every
//! handler gets; a fetch's [`FetchRequest`] and a send's [`SendSummary`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tensorwire_codecs::Tensor;
use tokio::sync::Notify;

use super::value::{Args, Value};
use crate::pipeline::budget::MemoryBudget;

/// The inputs of one call.
#[derive(Debug, Clone)]
pub struct Call {
    /// Input tensors, in order.
    pub inputs: Vec<Tensor>,
    /// Scalar arguments.
    pub args: Args,
    /// Who called, deadline, cancellation.
    pub ctx: CallContext,
}

/// What a function returns.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// Output tensors.
    pub tensors: Vec<Tensor>,
    /// Scalar results (a map, or a single value).
    pub values: Value,
}

impl Output {
    /// Tensors only.
    pub fn tensors(tensors: Vec<Tensor>) -> Self {
        Self { tensors, values: Value::None }
    }

    /// A scalar result only.
    pub fn value(v: impl Into<Value>) -> Self {
        Self { tensors: vec![], values: v.into() }
    }
}

impl From<Vec<Tensor>> for Output {
    fn from(tensors: Vec<Tensor>) -> Self {
        Output::tensors(tensors)
    }
}

impl From<Tensor> for Output {
    fn from(t: Tensor) -> Self {
        Output::tensors(vec![t])
    }
}

/// What the server says after a `send` call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SendSummary {
    /// Tensors received.
    pub received: u64,
    /// Payload bytes received.
    pub bytes: u64,
    /// A message for the caller.
    pub message: String,
}

/// Parameters of a `fetch` call (the seed's `TensorRequest.parameters`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchRequest {
    /// String parameters, e.g. `name` → tensor name.
    pub params: BTreeMap<String, String>,
}

impl FetchRequest {
    /// A request for the tensor named `name`.
    pub fn name(name: impl Into<String>) -> Self {
        Self::default().param("name", name)
    }

    /// Builder form: adds a parameter.
    pub fn param(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.params.insert(key.into(), value.into());
        self
    }

    /// A parameter.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.params.get(key).map(String::as_str)
    }
}

/// A cancellation flag a handler can poll or await.
#[derive(Clone, Debug, Default)]
pub struct Cancellation {
    inner: Arc<(AtomicBool, Notify)>,
}

impl Cancellation {
    /// Marks cancelled and wakes waiters.
    pub fn cancel(&self) {
        self.inner.0.store(true, Ordering::Release);
        self.inner.1.notify_waiters();
    }

    /// True once cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.inner.0.load(Ordering::Acquire)
    }

    /// Resolves once cancelled.
    pub async fn cancelled(&self) {
        loop {
            let n = self.inner.1.notified();
            let mut n = std::pin::pin!(n);
            n.as_mut().enable();
            if self.is_cancelled() {
                return;
            }
            n.await;
        }
    }
}

/// What a call's work keeps alive until it is dropped: the server counts
/// the call against its connection until then (a sync handler's thread,
/// which owns its context, may run on after its client went away).
#[derive(Clone)]
pub(crate) struct Held {
    _slot: Arc<dyn Send + Sync>,
}

impl Held {
    pub(crate) fn new(slot: Arc<dyn Send + Sync>) -> Self {
        Self { _slot: slot }
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Held")
    }
}

/// Facts about a call, for handlers. A clone is a copy of the facts: it
/// does not hold the call's place on its connection.
#[derive(Debug)]
pub struct CallContext {
    pub(crate) peer: Arc<str>,
    pub(crate) transport: &'static str,
    pub(crate) function: String,
    pub(crate) deadline: Option<Instant>,
    pub(crate) cancel: Cancellation,
    pub(crate) max_tensor_bytes: u64,
    pub(crate) budget: Option<MemoryBudget>,
    pub(crate) params: BTreeMap<String, String>,
    /// The call's place on its connection (see [`Held`]).
    pub(crate) held: Option<Held>,
}

impl Clone for CallContext {
    fn clone(&self) -> Self {
        Self {
            peer: self.peer.clone(),
            transport: self.transport,
            function: self.function.clone(),
            deadline: self.deadline,
            cancel: self.cancel.clone(),
            max_tensor_bytes: self.max_tensor_bytes,
            budget: self.budget.clone(),
            params: self.params.clone(),
            held: None,
        }
    }
}

impl CallContext {
    /// A context for calling handlers directly (tests, in-process use).
    pub fn local() -> Self {
        Self {
            peer: Arc::from("local"),
            transport: "local",
            function: String::new(),
            deadline: None,
            cancel: Cancellation::default(),
            max_tensor_bytes: crate::config::DEFAULT_MAX_TENSOR_BYTES,
            budget: None,
            params: BTreeMap::new(),
            held: None,
        }
    }

    /// The largest tensor the server accepts (`Limits::max_tensor_bytes`):
    /// what a handler that makes tensors from a caller's parameters should
    /// check before allocating.
    pub fn max_tensor_bytes(&self) -> u64 {
        self.max_tensor_bytes
    }

    /// The server's memory budget, for handlers that hold memory of their
    /// own on a caller's behalf (None outside a server).
    pub fn budget(&self) -> Option<&MemoryBudget> {
        self.budget.as_ref()
    }

    /// Builder form: a request parameter, as a client attaches them (e.g.
    /// `state_dict` on a send; for calling handlers directly).
    pub fn with_param(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.params.insert(key.into(), value.into());
        self
    }

    /// A parameter the client attached to the call's request (a send's
    /// `state_dict` name, a fetch's parameters).
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params.get(key).map(String::as_str)
    }

    /// The caller's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The transport the call came over (`"tcp"`, `"unix"`, `"quic"`, ...).
    pub fn transport(&self) -> &'static str {
        self.transport
    }

    /// The function name (named calls).
    pub fn function(&self) -> &str {
        &self.function
    }

    /// When the caller stops waiting.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// True once the caller gave up or the deadline passed: long-running
    /// sync handlers should check this and return early (a function made
    /// with `Function::inline` runs to its end without a chance to). The
    /// caller gave up when it dropped the call or its connection failed,
    /// over transports that tell the server (tcp, tcps, unix, shm, QUIC,
    /// UCX, gRPC; HTTP calls are not told, they end at their deadline if
    /// any); async handlers are then dropped as well.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled() || self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Resolves when the call is cancelled.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await;
    }
}
