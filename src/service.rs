//! What a server does with calls: the [`TensorService`] trait for the three
//! streaming modes (send, fetch, exchange) and the [`CallContext`] every
//! handler gets.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use async_trait::async_trait;
use tensorwire_codecs::Tensor;
use tokio::sync::Notify;

use crate::error::Status;
use crate::stream::{TensorSink, TensorStream};

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

/// Facts about a call, for handlers.
#[derive(Clone, Debug)]
pub struct CallContext {
    pub(crate) peer: Arc<str>,
    pub(crate) transport: &'static str,
    pub(crate) function: String,
    pub(crate) deadline: Option<Instant>,
    pub(crate) cancel: Cancellation,
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
        }
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
    /// sync handlers should check this and return early.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled() || self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Resolves when the call is cancelled.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await;
    }
}

/// The streaming modes of the first seed. Every method has a default, so an
/// implementation overrides only what it serves; [`TensorService::process`]
/// is the override point of the default `exchange` (the seed's
/// `_process_tensor`).
#[async_trait]
pub trait TensorService: Send + Sync + 'static {
    /// Client → server stream. The default reads and counts everything.
    async fn send(&self, ctx: &CallContext, tensors: &mut TensorStream) -> Result<SendSummary, Status> {
        let _ = ctx;
        let mut s = SendSummary::default();
        while let Some(t) = tensors.next().await {
            let t = t.map_err(Status::from)?;
            s.received += 1;
            s.bytes += t.nbytes() as u64;
        }
        s.message = format!("received {} tensors", s.received);
        Ok(s)
    }

    /// Server → client stream. The default serves nothing.
    async fn fetch(&self, ctx: &CallContext, request: &FetchRequest, out: &mut TensorSink<'_>) -> Result<(), Status> {
        let _ = (ctx, request, out);
        Err(Status::unimplemented("this server does not serve fetch"))
    }

    /// Both directions: each input becomes zero or more outputs through
    /// [`TensorService::process`].
    async fn exchange(
        &self,
        ctx: &CallContext,
        input: &mut TensorStream,
        out: &mut TensorSink<'_>,
    ) -> Result<(), Status> {
        while let Some(t) = input.next().await {
            for o in self.process(ctx, t.map_err(Status::from)?).await? {
                out.send(o).await?;
            }
        }
        Ok(())
    }

    /// Maps one exchanged tensor to outputs. The default echoes it.
    async fn process(&self, ctx: &CallContext, tensor: Tensor) -> Result<Vec<Tensor>, Status> {
        let _ = ctx;
        Ok(vec![tensor])
    }
}

/// A service that counts what it is sent, serves no fetch, and echoes exchanges.
#[derive(Debug, Default, Clone, Copy)]
pub struct EchoService;

#[async_trait]
impl TensorService for EchoService {}
