//! Logical streams over gRPC calls: each tensorwire stream is one call of
//! `tensorwire.v1.TensorService`, its frames the call's messages.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use tensorwire_proto::v1;
use tokio::sync::{mpsc, oneshot};
use tonic::{Code, Status};

use super::body::{Abandoned, Item, MessageSource};
use super::wire::Decoded;
use crate::{Frame, Payload, Placement, Received, RecvStream, SendStream, StopSignal, StreamError};

/// Frames queued per direction of a call before the sender waits (on top of
/// HTTP/2's flow-control windows, which bound what is in flight).
pub(crate) const QUEUE: usize = 4;

/// A stream's two halves, as [`Connection::open`](crate::Connection::open) returns them.
pub(crate) type Halves = (Box<dyn SendStream>, Box<dyn RecvStream>);

static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

/// Stream ids for messages (gRPC calls have no number of their own).
pub(crate) fn next_id() -> u64 {
    NEXT_STREAM.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn to_wire(frame: Frame) -> v1::Frame {
    v1::Frame { header: Some(frame.header), payload: frame.payload }
}

/// The message a reset carries, so the peer can recover the code.
fn reset_status(code: u32) -> Status {
    Status::cancelled(format!("stream reset by the sender (code {code})"))
}

/// A gRPC status as a stream error.
pub(crate) fn status_error(peer: &str, stream: u64, s: &Status) -> StreamError {
    let peer = peer.to_string();
    match s.code() {
        Code::Cancelled if s.message().starts_with("stream reset by the sender") => {
            let code =
                s.message().rsplit_once("(code ").and_then(|(_, c)| c.trim_end_matches(')').parse().ok()).unwrap_or(0);
            StreamError::Reset { peer, stream, code }
        }
        // Not our reset: hyper's reason (a TLS alert, a broken connection)
        // is the cause to report.
        Code::Cancelled => StreamError::ConnectionClosed { peer, reason: s.message().to_string() },
        Code::Unavailable => StreamError::ConnectionClosed { peer, reason: s.message().to_string() },
        // h2's own ENHANCE_YOUR_CALM (a GOAWAY for the whole connection)
        // comes as this code too, with its error as the source.
        Code::ResourceExhausted if std::error::Error::source(s).is_some() || s.message().starts_with("h2 ") => {
            StreamError::ConnectionClosed { peer, reason: s.message().to_string() }
        }
        Code::ResourceExhausted => StreamError::ResourceExhausted { peer, reason: s.message().to_string() },
        c => StreamError::Protocol { peer, reason: format!("gRPC status {c:?}: {}", s.message()) },
    }
}

/// Set by [`SendStream::reset`] on a client call: the request body then ends
/// with an error (an HTTP/2 RST_STREAM) instead of a clean end of stream, so
/// the server never mistakes an abandoned call for a complete one.
#[derive(Clone, Default, Debug)]
pub(crate) struct ResetFlag(pub(crate) Arc<AtomicBool>);

impl ResetFlag {
    pub(crate) fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Where a call's incoming messages come from.
pub(crate) enum Source {
    /// A client's response not yet arrived (the call is being made).
    Pending(oneshot::Receiver<Result<Source, Status>>),
    /// The call's body.
    Wire(Box<MessageSource>),
    Done,
}

pub(crate) struct GrpcRecv {
    pub(crate) source: Source,
    pub(crate) id: u64,
    pub(crate) peer: Arc<str>,
    /// Where chunk payloads of the tensor being received go.
    pub(crate) placement: Option<Placement>,
}

impl GrpcRecv {
    pub(crate) fn new(source: Source, id: u64, peer: Arc<str>) -> Self {
        Self { source, id, peer, placement: None }
    }

    /// A decoded message as a received frame: a chunk of the placed
    /// tensor is copied straight from the DATA frames into its place.
    async fn received(&self, m: Decoded) -> Result<Received, StreamError> {
        let Some(header) = m.header else {
            let reason = "a gRPC frame without a header".into();
            return Err(StreamError::Protocol { peer: self.peer.to_string(), reason });
        };
        let len = m.payload.len();
        let place = match (&self.placement, header.placement_offset()) {
            (Some(p), Some((tid, off))) if p.accepts(tid, off, len) => Some((p, off)),
            _ => None,
        };
        let payload = match place {
            Some((p, off)) => {
                let mut g = p.lock().await;
                m.payload.copy_to(&mut g[off as usize..off as usize + len]);
                Payload::Placed { offset: off, len }
            }
            None => Payload::Bytes(m.payload.into_bytes()),
        };
        Ok(Received { header, payload })
    }
}

#[async_trait]
impl RecvStream for GrpcRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        loop {
            match &mut self.source {
                Source::Pending(rx) => match rx.await {
                    Ok(Ok(s)) => self.source = s,
                    Ok(Err(status)) => {
                        self.source = Source::Done;
                        return Err(status_error(&self.peer, self.id, &status));
                    }
                    // The call was never made: nothing was sent on it.
                    Err(_) => self.source = Source::Done,
                },
                Source::Wire(s) => {
                    return match s.next().await {
                        Ok(Some(m)) => self.received(m).await.map(Some),
                        Ok(None) => {
                            self.source = Source::Done;
                            Ok(None)
                        }
                        Err(status) => {
                            self.source = Source::Done;
                            Err(status_error(&self.peer, self.id, &status))
                        }
                    };
                }
                Source::Done => return Ok(None),
            }
        }
    }

    fn place(&mut self, target: Option<Placement>) {
        self.placement = target;
    }

    fn id(&self) -> u64 {
        self.id
    }
}

/// Server side: frames become the messages of the call's response stream.
pub(crate) struct ResponseSend {
    pub(crate) tx: Option<mpsc::Sender<Result<v1::Frame, Status>>>,
    pub(crate) id: u64,
    pub(crate) peer: Arc<str>,
    /// Set when the response's body goes before it ended.
    pub(crate) abandoned: Arc<Abandoned>,
}

#[async_trait]
impl SendStream for ResponseSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        let Some(tx) = &self.tx else {
            return Err(StreamError::Finished { peer: self.peer.to_string(), stream: self.id });
        };
        tx.send(Ok(to_wire(frame))).await.map_err(|_| StreamError::Stopped {
            peer: self.peer.to_string(),
            stream: self.id,
            code: 0,
        })
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        self.tx = None;
        Ok(())
    }

    fn stop_signal(&self) -> Option<Arc<dyn StopSignal>> {
        Some(self.abandoned.clone())
    }

    fn reset(&mut self, code: u32) {
        if let Some(tx) = self.tx.take()
            && let Err(mpsc::error::TrySendError::Full(item)) = tx.try_send(Err(reset_status(code)))
        {
            tokio::spawn(async move {
                let _ = tx.send(item).await;
            });
        }
    }

    fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for ResponseSend {
    fn drop(&mut self) {
        // Dropped without finish (a handler that failed or panicked): the
        // caller must see an abandoned call, not a complete one.
        if self.tx.is_some() {
            self.reset(0);
        }
    }
}

/// Client side: frames become the messages of the call's request stream
/// (or, for unary requests, its one message).
pub(crate) struct RequestSend {
    pub(crate) tx: Option<mpsc::Sender<Item>>,
    pub(crate) reset: ResetFlag,
    /// The call takes exactly one request message.
    pub(crate) unary: bool,
    pub(crate) sent: bool,
    pub(crate) id: u64,
    pub(crate) peer: Arc<str>,
}

impl Drop for RequestSend {
    fn drop(&mut self) {
        // Dropped without finish (a timed-out or cancelled call): end the
        // request body with an error, never a clean end of stream.
        if self.tx.is_some() {
            self.reset.0.store(true, Ordering::Release);
        }
    }
}

#[async_trait]
impl SendStream for RequestSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        let peer = || self.peer.to_string();
        if self.unary && self.sent {
            return Err(StreamError::Protocol {
                peer: peer(),
                reason: "this gRPC method takes one request message".into(),
            });
        }
        let Some(tx) = &self.tx else {
            return Err(StreamError::Finished { peer: peer(), stream: self.id });
        };
        self.sent = true;
        tx.send(Ok(to_wire(frame))).await.map_err(|_| StreamError::Stopped {
            peer: peer(),
            stream: self.id,
            code: 0,
        })?;
        if self.unary {
            self.tx = None;
        }
        Ok(())
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        self.tx = None;
        Ok(())
    }

    fn reset(&mut self, _code: u32) {
        self.reset.0.store(true, Ordering::Release);
        self.tx = None;
    }

    fn id(&self) -> u64 {
        self.id
    }
}
