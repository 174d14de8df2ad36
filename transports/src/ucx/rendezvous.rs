//! The streams of a `ucx://` connection: frames go through the mux (over
//! the UCP stream, see `stream`), except that a large uncompressed chunk's payload is
//! handed to UCX as a tagged message and its frame travels without payload,
//! naming the tag ([`Chunk::ucx_tag`](tensorwire_proto::v1::Chunk)).
//!
//! ```text
//!   sender                                          receiver
//!   ucp_tag_send_nbx(tag, payload)  ── RTS ──►   (UCX: unexpected until posted)
//!   frame {chunk, ucx_tag: tag} ─── mux ───────►  recv(): allocate raw_len,
//!                                                 ucp_tag_recv_nbx(tag) ── GET/PUT (rendezvous)
//!   send completes ◄──────────── ATS ──────────── receive completes: Payload::Bytes
//! ```
//!
//! The frame order on the stream is kept (the receiver posts the receive
//! when the frame comes up in order); UCX chooses the protocol per message
//! size and transport (eager copy for small ones, rendezvous with zero-copy
//! get or put where the transport has it). Sends are pipelined: up to
//! [`UcxConfig::max_in_flight`] bytes per stream, all awaited at the end of
//! the stream so that a delivery error reaches the sender.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_proto::v1::{self, frame_header::Kind};
use tokio::sync::oneshot;

use super::worker::{Landed, LockedRegion, RecvTarget, WorkerHandle};
use crate::config::UcxConfig;
use crate::{Frame, Payload, Placement, Received, RecvStream, SendStream, StreamError};

/// What the streams of one connection share.
pub(crate) struct Rendezvous {
    pub(crate) worker: Arc<WorkerHandle>,
    pub(crate) next_tag: AtomicU64,
    pub(crate) cfg: UcxConfig,
    pub(crate) peer: String,
    /// Largest chunk payload this side accepts from the peer.
    pub(crate) max_payload: u64,
}

impl Rendezvous {
    fn closed(&self, what: &str, e: String) -> StreamError {
        let reason = self.worker.failure().unwrap_or(e);
        StreamError::ConnectionClosed { peer: self.peer.clone(), reason: format!("UCX {what} failed: {reason}") }
    }

    fn timeout(&self, what: &str) -> StreamError {
        StreamError::Io {
            peer: self.peer.clone(),
            kind: std::io::ErrorKind::TimedOut,
            reason: format!("UCX {what} not completed within {:?}", self.cfg.rendezvous_timeout),
        }
    }
}

/// Sending half: diverts large payloads to UCX.
pub(crate) struct UcxSend {
    pub(crate) inner: Box<dyn SendStream>,
    pub(crate) rv: Arc<Rendezvous>,
    pub(crate) in_flight: VecDeque<(usize, oneshot::Receiver<Result<(), String>>)>,
    pub(crate) in_flight_bytes: usize,
}

impl UcxSend {
    pub(crate) fn new(inner: Box<dyn SendStream>, rv: Arc<Rendezvous>) -> Self {
        Self { inner, rv, in_flight: VecDeque::new(), in_flight_bytes: 0 }
    }

    /// Hands a large chunk payload to UCX and returns the frame to send in
    /// its place; other frames pass unchanged.
    fn convert(&mut self, mut frame: Frame) -> Frame {
        let big = match &frame.header.kind {
            Some(Kind::Chunk(c)) => {
                c.compression == v1::Compression::None as i32
                    && c.shm_segment == 0
                    && frame.payload.len() as u64 == c.raw_len
                    && frame.payload.len() >= self.rv.cfg.min_chunk_bytes.max(1)
            }
            _ => false,
        };
        if !big || self.rv.worker.failure().is_some() {
            return frame;
        }
        let tag = self.rv.next_tag.fetch_add(1, Ordering::Relaxed);
        let payload = std::mem::take(&mut frame.payload);
        let n = payload.len();
        let rx = self.rv.worker.send(tag, payload);
        if let Some(Kind::Chunk(c)) = &mut frame.header.kind {
            c.ucx_tag = tag;
        }
        self.in_flight.push_back((n, rx));
        self.in_flight_bytes += n;
        frame
    }

    async fn wait_oldest(&mut self) -> Result<(), StreamError> {
        let Some((n, rx)) = self.in_flight.pop_front() else { return Ok(()) };
        self.in_flight_bytes -= n;
        match tokio::time::timeout(self.rv.cfg.rendezvous_timeout, rx).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(self.rv.closed("send", e)),
            Ok(Err(_)) => Err(self.rv.closed("send", "connection closed".into())),
            Err(_) => Err(self.rv.timeout("send")),
        }
    }

    /// Waits while more than the in-flight budget is with UCX.
    async fn throttle(&mut self) -> Result<(), StreamError> {
        while self.in_flight_bytes > self.rv.cfg.max_in_flight {
            self.wait_oldest().await?;
        }
        Ok(())
    }

    async fn drain(&mut self) -> Result<(), StreamError> {
        while !self.in_flight.is_empty() {
            self.wait_oldest().await?;
        }
        Ok(())
    }
}

#[async_trait]
impl SendStream for UcxSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        let f = self.convert(frame);
        self.inner.send(f).await?;
        self.throttle().await
    }

    async fn send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        let out: Vec<Frame> = frames.into_iter().map(|f| self.convert(f)).collect();
        if out.is_empty() {
            if fin {
                self.inner.finish().await?;
            }
        } else {
            self.inner.send_batch(out, fin).await?;
        }
        if fin { self.drain().await } else { self.throttle().await }
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        self.inner.finish().await?;
        self.drain().await
    }

    fn reset(&mut self, code: u32) {
        // Payloads already with UCX stay owned by the worker until UCX is
        // done with them (or the connection closes).
        self.in_flight.clear();
        self.in_flight_bytes = 0;
        self.inner.reset(code)
    }

    fn id(&self) -> u64 {
        self.inner.id()
    }
}

/// How many UCX receives a stream keeps posted: while one chunk arrives,
/// the next chunks of the same tensor are already posted into their place,
/// so UCX moves them back to back instead of waiting for each frame.
const RECV_AHEAD: usize = 4;

/// A frame the receiver has read ahead of the one it returns.
enum Ahead {
    /// A UCX chunk whose receive is posted (into the placement buffer).
    Posted(Posted),
    /// A frame not handled yet (handled in order: it stops the read-ahead).
    Frame(Received),
    /// The end of the stream, or its error.
    End(Result<Option<Received>, StreamError>),
}

/// A UCX chunk frame whose payload is on its way.
struct Posted {
    frame: Received,
    tag: u64,
    len: usize,
    offset: u64,
    rx: oneshot::Receiver<super::worker::RecvResult>,
}

/// Receiving half: fetches diverted payloads from UCX, straight into the
/// stream's placement buffer when the reader gave one (the tensor's own
/// memory: no second copy), else into a buffer of their own.
pub(crate) struct UcxRecv {
    pub(crate) inner: Box<dyn RecvStream>,
    pub(crate) rv: Arc<Rendezvous>,
    pub(crate) placement: Option<Placement>,
    /// Frames read ahead, in stream order.
    ahead: VecDeque<Ahead>,
    /// The placement buffer while receives posted into it are pending.
    region: Weak<LockedRegion>,
    /// End offset of the last receive posted into the current placement
    /// (a chunk is posted ahead only past it: ranges never overlap).
    posted_end: u64,
}

impl UcxRecv {
    pub(crate) fn new(inner: Box<dyn RecvStream>, rv: Arc<Rendezvous>) -> Self {
        Self { inner, rv, placement: None, ahead: VecDeque::new(), region: Weak::new(), posted_end: 0 }
    }

    /// The UCX tag, length and offset of a chunk frame whose payload comes
    /// through UCX (None for other frames), checked.
    fn ucx_chunk(&self, r: &Received) -> Result<Option<(u64, u64, usize, u64)>, StreamError> {
        let Some(Kind::Chunk(c)) = &r.header.kind else { return Ok(None) };
        if c.ucx_tag == 0 {
            return Ok(None);
        }
        let peer = || self.rv.peer.clone();
        if !r.payload.is_empty() || c.compression != v1::Compression::None as i32 || c.shm_segment != 0 {
            let reason = "a UCX chunk frame must be uncompressed and carry no payload".into();
            return Err(StreamError::Protocol { peer: peer(), reason });
        }
        if c.raw_len > self.rv.max_payload {
            return Err(StreamError::LimitExceeded {
                peer: peer(),
                what: "UCX chunk payload",
                size: c.raw_len,
                limit: self.rv.max_payload,
            });
        }
        Ok(Some((c.ucx_tag, c.tensor_id, c.raw_len as usize, c.offset)))
    }

    /// The placement buffer, locked for UCX (shared with the receives
    /// already posted into it).
    async fn region(&mut self, p: &Placement) -> Arc<LockedRegion> {
        if let Some(r) = self.region.upgrade() {
            return r;
        }
        let r = Arc::new(LockedRegion::new(p.lock_owned().await));
        self.region = Arc::downgrade(&r);
        r
    }

    /// Where the chunk at `offset..offset + len` of `tensor_id` lands in the
    /// placement buffer, if it belongs there; a chunk read ahead only past
    /// the receives already posted (their ranges never overlap).
    async fn placed(&mut self, tensor_id: u64, offset: u64, len: usize, ahead: bool) -> Option<RecvTarget> {
        let p = self.placement.clone().filter(|p| p.accepts(tensor_id, offset, len))?;
        if ahead && offset < self.posted_end {
            return None;
        }
        self.posted_end = offset + len as u64;
        Some(RecvTarget::Placed { region: self.region(&p).await, offset: offset as usize, len })
    }

    /// Hands the receive of `frame`'s payload to the worker.
    fn submit(&self, frame: Received, tag: u64, len: usize, offset: u64, target: RecvTarget) -> Posted {
        let rx = self.rv.worker.recv(tag, target);
        Posted { frame, tag, len, offset, rx }
    }

    /// Posts the receive of the chunk the in-order frame `r` names.
    async fn post(&mut self, r: Received) -> Result<Result<Posted, Received>, StreamError> {
        let Some((tag, tensor_id, len, offset)) = self.ucx_chunk(&r)? else { return Ok(Err(r)) };
        let target = match self.placed(tensor_id, offset, len, false).await {
            Some(t) => t,
            None => RecvTarget::Owned(vec![0u8; len]),
        };
        Ok(Ok(self.submit(r, tag, len, offset, target)))
    }

    /// A frame read while a receive is pending: posted at once when it is
    /// the next chunk of the placed tensor, else kept for its turn.
    async fn read_ahead(&mut self, r: Result<Option<Received>, StreamError>) {
        let r = match r {
            Ok(Some(r)) => r,
            end => return self.ahead.push_back(Ahead::End(end)),
        };
        let Ok(Some((tag, tensor_id, len, offset))) = self.ucx_chunk(&r) else {
            return self.ahead.push_back(Ahead::Frame(r));
        };
        match self.placed(tensor_id, offset, len, true).await {
            Some(target) => {
                let posted = self.submit(r, tag, len, offset, target);
                self.ahead.push_back(Ahead::Posted(posted));
            }
            None => self.ahead.push_back(Ahead::Frame(r)),
        }
    }

    /// True while another frame may be read ahead: only chunks go ahead,
    /// at most [`RECV_AHEAD`] receives are pending.
    fn may_read_ahead(&self) -> bool {
        self.ahead.len() + 1 < RECV_AHEAD && self.ahead.iter().all(|a| matches!(a, Ahead::Posted(_)))
    }

    /// Waits for the payload of `p`, reading (and posting) the frames
    /// after it meanwhile.
    async fn land(&mut self, p: Posted) -> Result<Received, StreamError> {
        let Posted { mut frame, tag, len, offset, mut rx } = p;
        let limit = self.rv.cfg.rendezvous_timeout;
        let wait = async {
            loop {
                let more = self.may_read_ahead();
                tokio::select! {
                    biased;
                    r = &mut rx => break r,
                    // Cancel-safe: a stream's frames wait in a queue.
                    r = self.inner.recv(), if more => self.read_ahead(r).await,
                }
            }
        };
        let landed = match tokio::time::timeout(limit, wait).await {
            Ok(Ok(Ok(b))) => b,
            // UCX fails a message longer than the posted buffer with
            // "Message truncated": the peer lied about raw_len.
            Ok(Ok(Err(e))) => return Err(self.rv.closed("receive", e)),
            Ok(Err(_)) => return Err(self.rv.closed("receive", "connection closed".into())),
            Err(_) => return Err(self.rv.timeout("receive")),
        };
        let (got, payload) = match landed {
            Landed::Owned(b) => (b.len(), Payload::Bytes(Bytes::from(b))),
            Landed::Placed(n) => (n, Payload::Placed { offset, len: n }),
        };
        if got != len {
            return Err(StreamError::Protocol {
                peer: self.rv.peer.clone(),
                reason: format!("UCX message {tag} has {got} bytes, its frame declared {len}"),
            });
        }
        frame.payload = payload;
        Ok(frame)
    }
}

#[async_trait]
impl RecvStream for UcxRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        let next = match self.ahead.pop_front() {
            Some(a) => a,
            None => match self.inner.recv().await {
                Ok(Some(r)) => Ahead::Frame(r),
                end => Ahead::End(end),
            },
        };
        let posted = match next {
            Ahead::End(r) => return r,
            Ahead::Posted(p) => p,
            Ahead::Frame(r) => match self.post(r).await? {
                Ok(p) => p,
                Err(r) => return Ok(Some(r)),
            },
        };
        self.land(posted).await.map(Some)
    }

    fn place(&mut self, target: Option<Placement>) {
        // Chunks that come through the socket are placed by the mux.
        self.placement = target.clone();
        self.region = Weak::new();
        self.posted_end = 0;
        self.inner.place(target)
    }

    fn id(&self) -> u64 {
        self.inner.id()
    }
}
