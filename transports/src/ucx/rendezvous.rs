//! The streams of a `ucx://` connection: frames go through the mux (over
//! the UCP stream, see `stream`), except that a large uncompressed chunk's payload is
//! handed to UCX as a tagged message and its frame travels without payload,
//! naming the tag ([`Chunk::ucx_tag`](tensorwire_proto::v1::Chunk)).
//!
//! ```text
//!   sender                                          receiver
//!   frame {chunk, ucx_tag: tag} ─── mux ───────►  recv(): allocate raw_len,
//!   (once the connection took it)                 ucp_tag_recv_nbx(tag) (posted: expected)
//!   ucp_tag_send_nbx(tag, payload)  ── RTS ──►    ── GET/PUT (rendezvous)
//!   send completes ◄──────────── ATS ──────────── receive completes: Payload::Bytes
//! ```
//!
//! A payload goes to UCX only after the connection accepted its frame: a
//! send the receiver cannot know about (its frame refused because the peer
//! stopped reading) would wait until the connection closes, as UCX cannot
//! cancel a send. Frames the receiver drops unread still get their
//! payloads received, into scratch memory ([`Rendezvous::discard`]).
//!
//! Where the connection's UCX context has only shared-memory transports,
//! a large tensor goes by **puts** after its first chunk: the sender asks
//! for memory with that chunk, the receiver's reader places the tensor and
//! the receiver answers with a grant of its buffer (made UCX memory, see
//! [`grant`](super::grant)), and the sender puts the remaining chunks
//! straight into it, flushes, and only then sends their frames
//! (`ucx_put`): one copy where the tagged rendezvous makes two.
//!
//! The frame order on the stream is kept (the receiver posts the receive
//! when the frame comes up in order); UCX chooses the protocol per message
//! size and transport (eager copy for small ones, rendezvous with zero-copy
//! get or put where the transport has it). Sends are pipelined: up to
//! [`UcxConfig::max_in_flight`] bytes per stream, all awaited at the end of
//! the stream so that a delivery error reaches the sender.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use bytes::Bytes;
use tensorwire_proto::v1::{self, frame_header::Kind};
use tokio::sync::oneshot;

use super::answer::{Answer, Grant};
use super::grant::{GRANT_BIT, GRANT_MAX, Region};
use super::worker::{Landed, LockedRegion, Put, RecvTarget, WorkerHandle};
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
    /// Bytes of scratch receives of payloads nobody reads (see
    /// [`Rendezvous::discard`]) not completed yet.
    pub(crate) scratch: Arc<AtomicUsize>,
}

impl Rendezvous {
    /// A chunk frame this side will never read whose payload comes by tag:
    /// its sender waits for the receive (UCX cannot cancel a send), so it
    /// gets one, into a scratch buffer dropped once it lands, and a chunk
    /// that asks for a grant gets its refusal. Scratch receives of the
    /// connection hold at most `UcxConfig::max_in_flight` bytes at a time
    /// (what one sender keeps in flight); past that a payload is left to
    /// the sender, which stops on this side's STOP (or a reset refusing
    /// the stream), and its send stays with its worker until the
    /// connection closes. A scratch receive whose message has not come
    /// within `UcxConfig::rendezvous_timeout` is cancelled, so a peer that
    /// announces payloads it never sends cannot keep the room (one whose
    /// message UCX has started to match keeps it until that message lands
    /// or the connection closes; a payload sent after its receive was
    /// cancelled is never received, and its send stays with the peer's
    /// worker until the connection closes).
    pub(crate) fn discard(&self, header: &v1::FrameHeader) {
        let Some(Kind::Chunk(c)) = &header.kind else { return };
        if c.ucx_tag == 0 || c.ucx_tag & GRANT_BIT != 0 || c.ucx_put || c.raw_len > self.max_payload {
            return;
        }
        if c.ucx_grant {
            drop(self.worker.send(GRANT_BIT | c.ucx_tag, Bytes::from(Answer::Refused.encode())));
        }
        let len = c.raw_len as usize;
        // The receive's completion gives its room back (and drops the
        // buffer at once): a task of the runtime waits for it. Without a
        // runtime the payload is left to the sender.
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let held = &self.scratch;
        if held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                (h + len <= self.cfg.max_in_flight).then_some(h + len)
            })
            .is_err()
        {
            return;
        }
        let done = self.worker.recv(c.ucx_tag, RecvTarget::Owned(vec![0; len]));
        super::worker::PAYLOADS_DISCARDED.fetch_add(1, Ordering::Relaxed);
        let held = held.clone();
        self.reap_later(&rt, c.ucx_tag, done, move || {
            held.fetch_sub(len, Ordering::AcqRel);
        });
    }

    /// Waits, in a task of `rt`, for a receive nobody reads: until it lands
    /// (its buffer then drops) or, when its message has not come within
    /// `UcxConfig::rendezvous_timeout` (a peer that announced a payload and
    /// never sent it), until UCX has cancelled it; then runs `after`.
    fn reap_later(
        &self,
        rt: &tokio::runtime::Handle,
        tag: u64,
        mut done: oneshot::Receiver<super::worker::RecvResult>,
        after: impl FnOnce() + Send + 'static,
    ) {
        let (worker, limit) = (Arc::downgrade(&self.worker), self.cfg.rendezvous_timeout);
        // `after` runs even if the task is dropped unfinished (its runtime
        // shut down).
        let after = OnDrop(Some(after));
        rt.spawn(async move {
            let _after = after;
            if tokio::time::timeout(limit, &mut done).await.is_err() {
                if let Some(w) = worker.upgrade() {
                    w.cancel_recv(tag);
                }
                // The cancel's completion (or the message's, had it just
                // been matched; or the connection's end).
                drop(done.await);
            }
        });
    }

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

/// Runs its function when dropped.
struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// A posted receive its reader waits for: if the wait is dropped before
/// the payload landed (the caller gave up on `recv`), the receive goes to
/// [`Rendezvous::reap_later`] instead of staying posted until the
/// connection closes.
struct Unlanded {
    rv: Arc<Rendezvous>,
    tag: u64,
    rx: Option<oneshot::Receiver<super::worker::RecvResult>>,
}

impl Unlanded {
    /// Gives the receive up now (its wait timed out): UCX cancels it.
    fn cancel(mut self) {
        self.rx = None;
        self.rv.worker.cancel_recv(self.tag);
    }
}

impl Drop for Unlanded {
    fn drop(&mut self) {
        if let (Some(rx), Ok(rt)) = (self.rx.take(), tokio::runtime::Handle::try_current()) {
            self.rv.reap_later(&rt, self.tag, rx, || {});
        }
    }
}

/// Put frames held back until a flush says their bytes are at the peer,
/// at most this many payload bytes.
const PUT_BATCH: usize = 16 << 20;

/// A grant the sender asked for with a tensor's first chunk.
struct Asked {
    tensor_id: u64,
    total: u64,
    tag: u64,
    /// The receive of the answer, posted once the asking frame is sent.
    answer: Option<oneshot::Receiver<super::worker::RecvResult>>,
}

/// Memory the receiver granted for the rest of one tensor.
struct Granted {
    tensor_id: u64,
    grant: Grant,
    rkey: Arc<[u8]>,
}

/// Sending half: diverts large payloads to UCX.
pub(crate) struct UcxSend {
    pub(crate) inner: Box<dyn SendStream>,
    pub(crate) rv: Arc<Rendezvous>,
    pub(crate) in_flight: VecDeque<(usize, oneshot::Receiver<Result<(), String>>)>,
    pub(crate) in_flight_bytes: usize,
    asked: Option<Asked>,
    granted: Option<Granted>,
    /// Frames of chunks already put, waiting for the flush.
    held: Vec<Frame>,
    /// The puts of the held frames.
    puts: Vec<oneshot::Receiver<Result<(), String>>>,
    held_bytes: usize,
    /// Payloads (and their tags) of converted chunk frames not yet accepted
    /// by the connection, in frame order: handed to UCX only once their
    /// frames are (`send_out`), so that a send never waits for a receiver
    /// that cannot know its tag (a stream stopped by its peer before the
    /// frame left).
    unposted: VecDeque<(u64, Bytes)>,
}

impl UcxSend {
    pub(crate) fn new(inner: Box<dyn SendStream>, rv: Arc<Rendezvous>) -> Self {
        Self {
            inner,
            rv,
            in_flight: VecDeque::new(),
            in_flight_bytes: 0,
            asked: None,
            granted: None,
            held: Vec::new(),
            puts: Vec::new(),
            held_bytes: 0,
            unposted: VecDeque::new(),
        }
    }

    /// Sends `frames` (with `fin`, ends the stream), each chunk frame that
    /// names a tag ending a batch of its own, whose payload (and, for the
    /// chunk that asks for a grant, the answer's receive) goes to UCX as
    /// soon as the connection accepted the batch. A refused batch leaves
    /// nothing with UCX (and no frame after it is sent).
    async fn send_out(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        let sent = self.send_out_inner(frames, fin).await;
        if sent.is_err() {
            self.unposted.clear();
            if self.asked.as_ref().is_some_and(|a| a.answer.is_none()) {
                self.asked = None;
            }
        }
        sent
    }

    async fn send_out_inner(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        if frames.is_empty() {
            return if fin { self.inner.finish().await } else { Ok(()) };
        }
        let n = frames.len();
        let mut batch = Vec::with_capacity(n);
        for (i, f) in frames.into_iter().enumerate() {
            let tag = match &f.header.kind {
                Some(Kind::Chunk(c)) if c.ucx_tag != 0 => c.ucx_tag,
                _ => 0,
            };
            batch.push(f);
            let last = i + 1 == n;
            if tag == 0 && !last {
                continue;
            }
            self.inner.send_batch(std::mem::take(&mut batch), fin && last).await?;
            if tag != 0 {
                self.post(tag);
            }
        }
        Ok(())
    }

    /// Hands the payload of the sent chunk frame naming `tag` to UCX (and
    /// posts the receive of the answer to its grant ask, if it asked).
    fn post(&mut self, tag: u64) {
        if let Some(a) = self.asked.as_mut().filter(|a| a.tag == tag && a.answer.is_none()) {
            a.answer = Some(self.rv.worker.recv(GRANT_BIT | tag, RecvTarget::Owned(vec![0; GRANT_MAX])));
        }
        // A frame that came with a tag of its own (not made by `convert`)
        // has no payload here.
        if self.unposted.front().is_none_or(|(t, _)| *t != tag) {
            return;
        }
        let Some((_, payload)) = self.unposted.pop_front() else { return };
        let n = payload.len();
        let rx = self.rv.worker.send(tag, payload);
        self.in_flight.push_back((n, rx));
        self.in_flight_bytes += n;
    }

    /// True when `frame` is a chunk of the tensor whose grant was asked.
    fn awaits_answer(&self, frame: &Frame) -> bool {
        matches!((&self.asked, &frame.header.kind), (Some(a), Some(Kind::Chunk(c))) if c.tensor_id == a.tensor_id)
    }

    /// Waits for the receiver's answer to the grant asked for.
    async fn take_answer(&mut self) -> Result<(), StreamError> {
        let Some(a) = self.asked.take() else { return Ok(()) };
        // Not posted: the asking frame never left (its send failed).
        let Some(answer) = a.answer else { return Ok(()) };
        // A receiver that stopped reading may never answer.
        let answered = tokio::select! {
            biased;
            r = tokio::time::timeout(self.rv.cfg.rendezvous_timeout, answer) => r,
            e = self.inner.stopped() => return Err(e),
        };
        let landed = match answered {
            Ok(Ok(Ok(l))) => l,
            Ok(Ok(Err(e))) => return Err(self.rv.closed("grant", e)),
            Ok(Err(_)) => return Err(self.rv.closed("grant", "connection closed".into())),
            Err(_) => return Err(self.rv.timeout("grant")),
        };
        let Landed::Owned(bytes) = landed else {
            return Err(self.rv.closed("grant", "landed in a placement buffer".into()));
        };
        match Answer::decode(&bytes, a.total) {
            Ok(Answer::Grant(grant)) => {
                let rkey: Arc<[u8]> = grant.rkey.clone().into();
                self.granted = Some(Granted { tensor_id: a.tensor_id, grant, rkey });
            }
            Ok(Answer::Refused) => {}
            Err(reason) => {
                let reason = format!("{reason} (answer to UCX message {})", a.tag);
                return Err(StreamError::Protocol { peer: self.rv.peer.clone(), reason });
            }
        }
        Ok(())
    }

    /// Puts the payload of a chunk of the granted tensor into the granted
    /// memory and returns its frame (held until the flush), or gives the
    /// frame back when it is not such a chunk.
    fn put(&mut self, mut frame: Frame) -> Result<(), Frame> {
        let Some(g) = &self.granted else { return Err(frame) };
        let fits = match &frame.header.kind {
            Some(Kind::Chunk(c)) => {
                c.tensor_id == g.tensor_id
                    && c.compression == v1::Compression::None as i32
                    && c.shm_segment == 0
                    && frame.payload.len() as u64 == c.raw_len
                    && !frame.payload.is_empty()
                    && c.offset.checked_add(c.raw_len).is_some_and(|end| end <= g.grant.len)
            }
            _ => false,
        };
        if !fits || self.rv.worker.failure().is_some() {
            return Err(frame);
        }
        let Some(Kind::Chunk(c)) = &mut frame.header.kind else { return Err(frame) };
        let last = c.last;
        c.ucx_put = true;
        let put = Put {
            region: g.grant.region,
            rkey: g.rkey.clone(),
            addr: g.grant.addr + c.offset,
            data: std::mem::take(&mut frame.payload),
        };
        self.held_bytes += put.data.len();
        self.puts.push(self.rv.worker.put(put));
        self.held.push(frame);
        if last {
            self.granted = None;
        }
        Ok(())
    }

    /// Waits until the held frames' bytes are at the peer (their puts
    /// done, then a flush of the endpoint), and moves the frames to `out`.
    async fn release(&mut self, out: &mut Vec<Frame>) -> Result<(), StreamError> {
        if self.held.is_empty() {
            return Ok(());
        }
        let limit = self.rv.cfg.rendezvous_timeout;
        let puts = std::mem::take(&mut self.puts);
        let wait = async {
            for p in puts {
                p.await.map_err(|_| "connection closed".to_string())??;
            }
            self.rv.worker.flush().await.map_err(|_| "connection closed".to_string())?
        };
        match tokio::time::timeout(limit, wait).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(self.rv.closed("put", e)),
            Err(_) => return Err(self.rv.timeout("put")),
        }
        self.held_bytes = 0;
        out.append(&mut self.held);
        Ok(())
    }

    /// Sends `frames` in order: chunks of a granted tensor by put (their
    /// frames after the flush), large chunks by tag, the rest as they are;
    /// waits for a grant's answer before the chunk after the one that asked.
    async fn send_frames(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        // Left by a call that failed or was cancelled before its frames
        // left: never to be sent.
        self.unposted.clear();
        let mut out: Vec<Frame> = Vec::with_capacity(frames.len());
        for f in frames {
            if self.awaits_answer(&f) {
                // The chunk that asked must reach the receiver first.
                self.release(&mut out).await?;
                if !out.is_empty() {
                    self.send_out(std::mem::take(&mut out), false).await?;
                }
                self.take_answer().await?;
            }
            let f = match self.put(f) {
                Ok(()) => {
                    if self.held_bytes >= PUT_BATCH || self.granted.is_none() {
                        self.release(&mut out).await?;
                    }
                    continue;
                }
                Err(f) => f,
            };
            self.release(&mut out).await?;
            out.push(self.convert(f));
        }
        if fin {
            self.release(&mut out).await?;
        }
        self.send_out(out, fin).await?;
        if fin { self.drain().await } else { self.throttle().await }
    }

    /// Takes a large chunk's payload (for UCX, once the frame is sent:
    /// `send_out`) and returns the frame to send in its place; other frames
    /// pass unchanged.
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
        self.unposted.push_back((tag, payload));
        if let Some(Kind::Chunk(c)) = &mut frame.header.kind {
            c.ucx_tag = tag;
            // A large tensor's first chunk asks for memory for the rest.
            if self.rv.worker.ctx.puts
                && c.offset == 0
                && !c.last
                && c.total_bytes >= self.rv.cfg.min_put_bytes.max(1)
                && self.asked.is_none()
            {
                c.ucx_grant = true;
                self.asked = Some(Asked { tensor_id: c.tensor_id, total: c.total_bytes, tag, answer: None });
            }
        }
        frame
    }

    /// Waits for the oldest tagged send to complete. A peer that stopped
    /// reading this stream ends the wait at once with the stream's error:
    /// it receives the payloads of the frames it drops only into scratch
    /// memory ([`Rendezvous::discard`], bounded), and UCX cannot cancel a
    /// send, so a payload it leaves stays with the worker until the
    /// connection closes.
    async fn wait_oldest(&mut self) -> Result<(), StreamError> {
        let Some((n, rx)) = self.in_flight.pop_front() else { return Ok(()) };
        self.in_flight_bytes -= n;
        let done = tokio::select! {
            biased;
            r = tokio::time::timeout(self.rv.cfg.rendezvous_timeout, rx) => r,
            e = self.inner.stopped() => return Err(e),
        };
        match done {
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
        self.send_frames(vec![frame], false).await
    }

    async fn send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        self.send_frames(frames, fin).await
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        self.send_frames(Vec::new(), true).await
    }

    fn reset(&mut self, code: u32) {
        // Payloads already with UCX stay owned by the worker until UCX is
        // done with them (or the connection closes). Puts into a grant are
        // copies done by the worker when it takes them (shared memory), so
        // none lands after the reset, which the same worker sends later.
        self.in_flight.clear();
        self.in_flight_bytes = 0;
        self.asked = None;
        self.granted = None;
        self.held.clear();
        self.puts.clear();
        self.held_bytes = 0;
        self.unposted.clear();
        self.inner.reset(code)
    }

    fn id(&self) -> u64 {
        self.inner.id()
    }

    async fn stopped(&mut self) -> StreamError {
        self.inner.stopped().await
    }

    fn stop_signal(&self) -> Option<Arc<dyn crate::StopSignal>> {
        self.inner.stop_signal()
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
    /// A grant the sender asked for and this side has not answered yet:
    /// (the asking chunk's tag, its tensor, the bytes it brought).
    wanted: Option<(u64, u64, u64)>,
    /// The tensor whose buffer the sender may put into, its length, and
    /// the region's poison flag (set should the grant end before the
    /// tensor's last chunk: the sender may still write, so the region is
    /// then never recycled). The buffer is not locked meanwhile: the reader
    /// may write inline chunks or check checksums of other ranges.
    granted: Option<(u64, u64, Arc<AtomicBool>)>,
}

impl UcxRecv {
    pub(crate) fn new(inner: Box<dyn RecvStream>, rv: Arc<Rendezvous>) -> Self {
        Self {
            inner,
            rv,
            placement: None,
            ahead: VecDeque::new(),
            region: Weak::new(),
            posted_end: 0,
            wanted: None,
            granted: None,
        }
    }

    /// Ends the grant of the tensor in progress, if any, before its last
    /// chunk: its region is never recycled (the sender may still put).
    fn abandon_grant(&mut self) {
        if let Some((_, _, poisoned)) = self.granted.take() {
            poisoned.store(true, Ordering::Release);
        }
    }

    /// Answers the grant asked for, if any, with a refusal.
    fn refuse(&mut self) {
        if let Some((tag, _, _)) = self.wanted.take() {
            drop(self.rv.worker.send(GRANT_BIT | tag, Bytes::from(Answer::Refused.encode())));
        }
    }

    /// Answers the grant asked for by the first chunk of the tensor placed
    /// in `p`: its buffer becomes UCX memory (a recycled region as it is; a
    /// pool buffer is replaced by a new region, the first chunk copied
    /// over) and the sender gets the region's key. Refused when the buffer
    /// is in use or no region can be had.
    fn grant(&mut self, p: &Placement) {
        let Some((tag, tensor_id, first)) = self.wanted else { return };
        if tensor_id != p.tensor_id() || !self.rv.worker.ctx.puts {
            return self.refuse();
        }
        let Some(mut guard) = p.try_lock_owned() else { return self.refuse() };
        let ctx = &self.rv.worker.ctx;
        if Region::grant(&guard, ctx).is_none() {
            match Region::alloc(ctx, guard.len()) {
                Ok(mut region) => {
                    let n = (first as usize).min(guard.len());
                    region[..n].copy_from_slice(&guard[..n]);
                    *guard = region;
                }
                Err(e) => tracing::debug!(error = %e, "no UCX region for a grant; the tensor goes by tag"),
            }
        }
        let Some((grant, poisoned)) = Region::grant(&guard, ctx) else { return self.refuse() };
        drop(guard);
        self.wanted = None;
        self.abandon_grant();
        self.granted = Some((tensor_id, grant.len, poisoned));
        super::grant::GRANTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        drop(self.rv.worker.send(GRANT_BIT | tag, Bytes::from(Answer::Grant(grant).encode())));
    }

    /// A chunk frame whose payload was put into the granted buffer, checked
    /// against the grant (None for other frames).
    fn put_chunk(&mut self, r: &Received) -> Result<Option<Payload>, StreamError> {
        let Some(Kind::Chunk(c)) = &r.header.kind else { return Ok(None) };
        if !c.ucx_put {
            return Ok(None);
        }
        let bad = |reason: String| Err(StreamError::Protocol { peer: self.rv.peer.clone(), reason });
        let Some((tensor_id, len, _)) = &self.granted else {
            return bad(format!("a chunk of tensor {} says it was put, but no memory was granted for it", c.tensor_id));
        };
        let inside = c.offset.checked_add(c.raw_len).is_some_and(|end| end <= *len);
        if c.tensor_id != *tensor_id || !inside || c.raw_len == 0 {
            return bad(format!(
                "a chunk put at {}..+{} of tensor {} lies outside the {len} bytes granted for tensor {tensor_id}",
                c.offset, c.raw_len, c.tensor_id
            ));
        }
        if !r.payload.is_empty()
            || c.ucx_tag != 0
            || c.compression != v1::Compression::None as i32
            || c.shm_segment != 0
        {
            return bad("a put chunk frame must be uncompressed and carry no payload".into());
        }
        super::worker::count_put_received(c.raw_len);
        Ok(Some(Payload::Placed { offset: c.offset, len: c.raw_len as usize }))
    }

    /// Frames this side read ahead and will never return: each goes to
    /// [`Rendezvous::discard`]. Those still queued by the connection, and
    /// those that arrive later, reach it through the connection's discard
    /// hook (when the inner stream drops).
    fn discard_unread(&mut self) {
        let rt = tokio::runtime::Handle::try_current();
        for a in std::mem::take(&mut self.ahead) {
            match a {
                Ahead::Frame(r) => self.rv.discard(&r.header),
                // Posted already: left to land, or cancelled should its
                // payload not come within the timeout (without a runtime:
                // left posted until the connection closes).
                Ahead::Posted(p) => {
                    if let Ok(rt) = &rt {
                        self.rv.reap_later(rt, p.tag, p.rx, || {});
                    }
                }
                Ahead::End(_) => {}
            }
        }
    }

    /// Notes a returned chunk that asks for a grant (answered by the next
    /// `place`, or refused).
    fn note_ask(&mut self, r: &Received) {
        if let Some(Kind::Chunk(c)) = &r.header.kind
            && c.ucx_grant
            && c.ucx_tag != 0
        {
            self.refuse();
            self.wanted = Some((c.ucx_tag, c.tensor_id, c.offset + r.payload.len() as u64));
        }
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
        if c.ucx_tag & GRANT_BIT != 0 {
            let reason = format!("UCX tag {:#x} lies in the range of grant answers", c.ucx_tag);
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
        let Posted { mut frame, tag, len, offset, rx } = p;
        let limit = self.rv.cfg.rendezvous_timeout;
        let mut pending = Unlanded { rv: self.rv.clone(), tag, rx: Some(rx) };
        let wait = async {
            let rx = pending.rx.as_mut().expect("set above");
            loop {
                let more = self.may_read_ahead();
                tokio::select! {
                    biased;
                    r = &mut *rx => break r,
                    // Cancel-safe: a stream's frames wait in a queue.
                    r = self.inner.recv(), if more => self.read_ahead(r).await,
                }
            }
        };
        let waited = tokio::time::timeout(limit, wait).await;
        if waited.is_ok() {
            // Landed or failed: nothing left with UCX.
            pending.rx = None;
        }
        let landed = match waited {
            Ok(Ok(Ok(b))) => b,
            // UCX fails a message longer than the posted buffer with
            // "Message truncated": the peer lied about raw_len.
            Ok(Ok(Err(e))) => return Err(self.rv.closed("receive", e)),
            Ok(Err(_)) => return Err(self.rv.closed("receive", "connection closed".into())),
            Err(_) => {
                // Nothing will read it: UCX lets go of the buffer.
                pending.cancel();
                return Err(self.rv.timeout("receive"));
            }
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
        // An ask the reader did not answer by placing the tensor.
        self.refuse();
        let r = self.recv_next().await?;
        if let Some(r) = &r {
            self.note_ask(r);
            // The tensor's last chunk, put or not: the sender flushed its
            // puts before it, and puts no more into this grant.
            if let (Some(Kind::Chunk(c)), Some((id, _, _))) = (&r.header.kind, &self.granted)
                && c.last
                && c.tensor_id == *id
            {
                self.granted = None;
            }
        }
        Ok(r)
    }

    fn place(&mut self, target: Option<Placement>) {
        // Chunks that come through the socket are placed by the mux.
        self.placement = target.clone();
        self.region = Weak::new();
        self.posted_end = 0;
        match &target {
            Some(p) => self.grant(p),
            None => {
                self.refuse();
                self.abandon_grant();
            }
        }
        self.inner.place(target)
    }

    fn id(&self) -> u64 {
        self.inner.id()
    }
}

impl Drop for UcxRecv {
    fn drop(&mut self) {
        self.refuse();
        self.abandon_grant();
        self.discard_unread();
    }
}

impl UcxRecv {
    async fn recv_next(&mut self) -> Result<Option<Received>, StreamError> {
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
            Ahead::Frame(mut r) => {
                if let Some(payload) = self.put_chunk(&r)? {
                    r.payload = payload;
                    return Ok(Some(r));
                }
                match self.post(r).await? {
                    Ok(p) => p,
                    Err(r) => return Ok(Some(r)),
                }
            }
        };
        self.land(posted).await.map(Some)
    }
}
