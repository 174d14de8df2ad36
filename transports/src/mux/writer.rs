//! The write side of a mux connection.
//!
//! Frames leave in one of two ways, always in the order they were handed in:
//!
//! * **Direct**: when nothing is queued and the writer task is idle, the
//!   calling task encodes its small frames (a whole small call: request,
//!   tensor chunk and end of stream) into one buffer and writes it with a
//!   single non-blocking syscall. No task is woken; this is what keeps small
//!   calls fast. What the socket does not take is kept as the first bytes
//!   the writer task sends.
//! * **Queued**: otherwise frames go onto a queue. The writer task drains it
//!   in batches, copying headers and small payloads into a scratch buffer
//!   and passing large payloads by reference, in one vectored write. Woken
//!   by a frame, it first yields once, so that the tasks already ready
//!   (other calls in flight) queue theirs into the same write.
//!
//! The socket itself sits in a slot that either the writer task (while it
//! writes a batch) or a direct writer (for one syscall) holds, and a count of
//! queued frames tells direct writers when they would jump the queue.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::frame::{FLAG_FIN, HEAD_LEN, Head, Kind};
use crate::FrameHeader;
use crate::sync::lock;

/// Payloads up to this size are copied into the scratch buffer, so a batch
/// of small frames is one contiguous write.
/// (Writers without syscalls take every payload by reference instead:
/// copying it into the scratch buffer first would copy it twice.)
const INLINE_PAYLOAD: usize = 8 << 10;
/// Payloads a direct write passes by reference (the rest are copied).
const DIRECT_REFS: usize = 4;
/// Largest group of frames written directly by the caller's task.
const DIRECT_MAX: usize = 64 << 10;
/// Direct writes only while at most this many streams are open: with more
/// calls in flight, queueing lets the writer send many of them per syscall
/// (unless writes cost no syscall: [`MuxWrite::syscall_free`]).
const DIRECT_STREAMS: usize = 4;

/// A socket's write half that can also be written without waiting.
pub trait MuxWrite: AsyncWrite + Unpin + Send + 'static {
    /// Writes what the socket accepts right now; `WouldBlock` when nothing.
    fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;

    /// True when a write is a copy into memory the peer reads (a
    /// shared-memory ring), not a system call: then there is nothing to
    /// save by queueing frames for one batched write, and each caller
    /// writes its small frames at once however many streams are open, so
    /// the peer starts on them while this side prepares the next (default
    /// false).
    fn syscall_free(&self) -> bool {
        false
    }

    /// True when the connection's reader should spin — keep polling for
    /// [`TransportConfig::spin`](crate::TransportConfig::spin) after the
    /// connection last moved bytes — rather than sleep at once: a kernel
    /// socket, whose readiness the runtime checks with no blocking call.
    /// False (the default) for transports that spin on their own (the
    /// shared-memory rings, UCX's progress thread).
    fn spins(&self) -> bool {
        false
    }
}

impl MuxWrite for tokio::net::tcp::OwnedWriteHalf {
    fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.try_write_vectored(bufs)
    }

    fn spins(&self) -> bool {
        true
    }
}

impl MuxWrite for tokio::net::unix::OwnedWriteHalf {
    fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.try_write_vectored(bufs)
    }

    fn spins(&self) -> bool {
        true
    }
}

/// Adapts any `AsyncWrite` to [`MuxWrite`], for byte-stream transports of
/// your own (a pipe, a tunnel, a TLS stream): every write then goes through
/// the connection's writer task, never the direct path, and the reader
/// spins after activity as a socket's does ([`MuxWrite::spins`]).
#[derive(Debug)]
pub struct QueuedWrite<W>(pub W);

impl<W: AsyncWrite + Unpin> AsyncWrite for QueuedWrite<W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<W: AsyncWrite + Unpin + Send + 'static> MuxWrite for QueuedWrite<W> {
    fn try_write_now(&self, _bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        Err(io::ErrorKind::WouldBlock.into())
    }

    fn spins(&self) -> bool {
        true
    }
}

/// One outgoing item.
// Nearly every item is a frame; boxing frames to shrink the rare control
// items would cost an allocation per frame.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Out {
    Data {
        id: u32,
        header: Option<FrameHeader>,
        /// `header`'s encoded length, computed once by whoever made the
        /// item (it is also part of the frame's flow-control cost): prost
        /// computes nested lengths again as it encodes, so each pass is not
        /// cheap.
        meta_len: u32,
        payload: Bytes,
        fin: bool,
    },
    Window {
        id: u32,
        inc: u32,
    },
    Reset {
        id: u32,
        code: u32,
    },
    Stop {
        id: u32,
        code: u32,
    },
    GoAway {
        code: u32,
        reason: String,
    },
    Pong(u32),
    /// A keep-alive probe.
    Ping(u32),
    /// Nothing to encode: wakes the writer to send what a direct write left over.
    Flush,
}

impl Out {
    /// A DATA item: `header`'s length is computed here, once.
    pub(crate) fn data(id: u32, header: Option<FrameHeader>, payload: Bytes, fin: bool) -> Out {
        let meta_len = header.as_ref().map_or(0, tensorwire_proto::header::encoded_len) as u32;
        Out::Data { id, header, meta_len, payload, fin }
    }

    /// Sets a DATA item's stream (assigned when its first frame leaves).
    pub(crate) fn set_stream(&mut self, stream: u32) {
        if let Out::Data { id, .. } = self {
            *id = stream;
        }
    }

    /// A DATA item with a header back as the frame it was made from (None
    /// for other items).
    pub(crate) fn into_frame(self) -> Option<crate::Frame> {
        match self {
            Out::Data { header: Some(header), payload, .. } => Some(crate::Frame { header, payload }),
            _ => None,
        }
    }

    /// Whether a DATA item ends its stream's direction.
    pub(crate) fn is_fin(&self) -> bool {
        matches!(self, Out::Data { fin: true, .. })
    }

    /// A DATA item's flow-control cost: its header and payload bytes.
    pub(crate) fn cost(&self) -> u64 {
        match self {
            Out::Data { meta_len, payload, .. } => u64::from(*meta_len) + payload.len() as u64,
            _ => 0,
        }
    }

    fn direct_size(&self) -> Option<usize> {
        match self {
            Out::Data { meta_len, payload, .. } if payload.len() <= INLINE_PAYLOAD => {
                Some(HEAD_LEN + *meta_len as usize + payload.len())
            }
            Out::Window { .. } | Out::Reset { .. } | Out::Stop { .. } | Out::Pong(_) | Out::Ping(_) => Some(HEAD_LEN),
            _ => None,
        }
    }

    /// Encodes into `scratch`, copying payloads up to `inline` bytes; returns
    /// a larger payload to send by reference right after, and whether this
    /// item ends the connection.
    fn encode(self, scratch: &mut BytesMut, inline: usize) -> (Option<Bytes>, bool) {
        let head = |stream, kind, meta_len, value| Head { stream, kind, flags: 0, meta_len, value };
        match self {
            Out::Data { id, header, meta_len, payload, fin } => {
                Head {
                    stream: id,
                    kind: Kind::Data,
                    flags: if fin { FLAG_FIN } else { 0 },
                    meta_len,
                    value: payload.len() as u32,
                }
                .encode(scratch);
                if let Some(h) = header {
                    scratch.reserve(meta_len as usize);
                    let before = scratch.len();
                    // Without a length check: `meta_len` was computed once, above.
                    tensorwire_proto::header::encode(&h, &mut Bytewise(scratch));
                    debug_assert_eq!(scratch.len() - before, meta_len as usize, "meta_len is the header's length");
                }
                if payload.len() <= inline {
                    scratch.put_slice(&payload);
                    return (None, false);
                }
                return (Some(payload), false);
            }
            Out::Window { id, inc } => head(id, Kind::Window, 0, inc).encode(scratch),
            Out::Reset { id, code } => head(id, Kind::Reset, 0, code).encode(scratch),
            Out::Stop { id, code } => head(id, Kind::Stop, 0, code).encode(scratch),
            Out::Pong(v) => head(0, Kind::Pong, 0, v).encode(scratch),
            Out::Ping(v) => head(0, Kind::Ping, 0, v).encode(scratch),
            Out::GoAway { code, reason } => {
                let r = &reason.as_bytes()[..reason.len().min(1024)];
                head(0, Kind::GoAway, r.len() as u32, code).encode(scratch);
                scratch.put_slice(r);
                return (None, true);
            }
            Out::Flush => {}
        }
        (None, false)
    }
}

/// A `BytesMut` whose one-byte writes are plain stores: prost writes each
/// varint a byte at a time, and `BytesMut::put_u8` goes through
/// `extend_from_slice` and a `memcpy` call for every byte (about a tenth of
/// the instructions of a small call, measured with callgrind).
struct Bytewise<'a>(&'a mut BytesMut);

// SAFETY: every method forwards to the `BytesMut`, except `put_u8`, which
// writes one byte into spare capacity it checked and then counts it.
unsafe impl BufMut for Bytewise<'_> {
    fn remaining_mut(&self) -> usize {
        self.0.remaining_mut()
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.0.advance_mut(cnt) }
    }

    fn chunk_mut(&mut self) -> &mut bytes::buf::UninitSlice {
        self.0.chunk_mut()
    }

    #[inline]
    fn put_u8(&mut self, n: u8) {
        match self.0.spare_capacity_mut().first_mut() {
            Some(slot) => {
                slot.write(n);
                // SAFETY: the byte after the initialized ones was just written.
                unsafe { self.0.set_len(self.0.len() + 1) };
            }
            None => self.0.put_u8(n),
        }
    }

    fn put_slice(&mut self, src: &[u8]) {
        self.0.extend_from_slice(src);
    }
}

struct Slot {
    /// The socket; None while the writer task is writing a batch.
    io: Option<Box<dyn MuxWrite>>,
    /// Bytes a direct write could not finish: sent before anything else.
    leftover: BytesMut,
    /// Reused buffer for direct writes.
    scratch: BytesMut,
}

/// The connection's outgoing side: the queue and the socket slot.
pub(crate) struct Writer {
    slot: Mutex<Slot>,
    queued: AtomicUsize,
    /// Items the writer task has written so far.
    written: AtomicU64,
    tx: mpsc::UnboundedSender<Out>,
    /// Streams open on the connection (kept by the connection).
    pub(crate) open_streams: AtomicUsize,
    /// Direct writes while at most this many streams are open.
    direct_streams: usize,
    /// Payloads up to this size are copied next to their headers.
    inline_payload: usize,
}

impl Writer {
    fn slot(&self) -> MutexGuard<'_, Slot> {
        // Nothing panics while holding the slot; ignore poison like the other mux locks.
        lock(&self.slot)
    }

    pub(crate) fn new(io: Box<dyn MuxWrite>) -> (Self, mpsc::UnboundedReceiver<Out>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (direct_streams, inline_payload) =
            if io.syscall_free() { (usize::MAX, 0) } else { (DIRECT_STREAMS, INLINE_PAYLOAD) };
        let slot = Slot { io: Some(io), leftover: BytesMut::new(), scratch: BytesMut::with_capacity(DIRECT_MAX) };
        let open_streams = AtomicUsize::new(0);
        let queued = AtomicUsize::new(0);
        let written = AtomicU64::new(0);
        (Self { slot: Mutex::new(slot), queued, written, tx, open_streams, direct_streams, inline_payload }, rx)
    }

    /// Queues one item for the writer task.
    /// Frames queued for the writer task (0: it has caught up), and how
    /// many it has written so far (a count that does not move while the
    /// backlog stays: the peer is not reading).
    pub(crate) fn backlog(&self) -> (usize, u64) {
        (self.queued.load(Ordering::Acquire), self.written.load(Ordering::Acquire))
    }

    pub(crate) fn push(&self, o: Out) -> Result<(), ()> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        self.tx.send(o).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::AcqRel);
        })
    }

    /// Writes `items` from the calling task if they are small and nothing
    /// waits ahead of them; queues them otherwise. Err: the connection is gone.
    pub(crate) fn write_or_push(&self, items: impl AsRef<[Out]> + IntoIterator<Item = Out>) -> Result<(), io::Error> {
        let gone = || io::Error::new(io::ErrorKind::BrokenPipe, "connection closed");
        let size: Option<usize> = items.as_ref().iter().try_fold(0usize, |acc, o| Some(acc + o.direct_size()?));
        if let Some(size) = size.filter(|&s| s <= DIRECT_MAX)
            && self.open_streams.load(Ordering::Relaxed) <= self.direct_streams
            && let Ok(mut slot) = self.slot.try_lock()
            && slot.io.is_some()
            && slot.leftover.is_empty()
            && self.queued.load(Ordering::Acquire) == 0
        {
            let Slot { io, leftover, scratch } = &mut *slot;
            scratch.clear();
            scratch.reserve(size);
            // Payloads passed by reference, and where in `scratch` each goes.
            let mut refs: [(usize, Bytes); DIRECT_REFS] = Default::default();
            let mut n = 0;
            for o in items {
                let inline = if n < DIRECT_REFS { self.inline_payload } else { INLINE_PAYLOAD };
                if let (Some(p), _) = o.encode(scratch, inline) {
                    refs[n] = (scratch.len(), p);
                    n += 1;
                }
            }
            let mut slices = [IoSlice::new(&[]); 2 * DIRECT_REFS + 1];
            let mut start = 0;
            for (i, (at, p)) in refs[..n].iter().enumerate() {
                slices[2 * i] = IoSlice::new(&scratch[start..*at]);
                slices[2 * i + 1] = IoSlice::new(p);
                start = *at;
            }
            slices[2 * n] = IoSlice::new(&scratch[start..]);
            let slices = &slices[..2 * n + 1];
            let io = io.as_ref().expect("checked");
            let written = match io.try_write_now(slices) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                Err(e) => return Err(e),
            };
            let total: usize = slices.iter().map(|s| s.len()).sum();
            if written < total {
                // What the socket did not take leaves first, through the writer task.
                let mut skip = written;
                for s in slices {
                    let taken = skip.min(s.len());
                    leftover.extend_from_slice(&s[taken..]);
                    skip -= taken;
                }
                drop(slot);
                self.push(Out::Flush).map_err(|_| gone())?;
            }
            return Ok(());
        }
        for o in items {
            self.push(o).map_err(|_| gone())?;
        }
        Ok(())
    }
}

/// The writer task: drains the queue in batches until `closed` completes
/// (or a GOAWAY is written), then shuts the socket down. Err: the socket
/// failed (the caller fails the connection).
pub(crate) async fn run(
    w: &Writer,
    mut rx: mpsc::UnboundedReceiver<Out>,
    closed: impl Future<Output = ()>,
) -> io::Result<()> {
    let mut closed = pin!(closed);
    let mut scratch = BytesMut::with_capacity(64 << 10);
    let mut batch: Vec<Out> = Vec::with_capacity(64);
    // Ranges of `scratch` interleaved with borrowed payloads, in write order.
    let mut parts: Vec<(usize, usize, Option<Bytes>)> = Vec::with_capacity(64);
    let mut closing = false;
    while !closing {
        // Queued frames go out first; once the connection is closed, what is
        // still queued (a GOAWAY, say) is written and the writer ends.
        let first = tokio::select! {
            biased;
            o = rx.recv() => o,
            _ = &mut closed => None,
        };
        match first {
            Some(o) => batch.push(o),
            None => closing = true,
        }
        if !closing {
            // Let the tasks that are ready run first: woken by the frame just
            // queued, this task would otherwise run right after the task that
            // queued it (a multi-thread runtime's LIFO slot) and write one
            // call per syscall. Calls queued meanwhile share this write
            // (64 calls in flight over unix://: writes per call 1.28 -> 0.07,
            // calls/s 147k -> 236k, medians of 5 alternating pairs).
            tokio::task::yield_now().await;
        }
        while batch.len() < 512 {
            match rx.try_recv() {
                Ok(o) => batch.push(o),
                Err(_) => break,
            }
        }
        if batch.is_empty() {
            break;
        }
        let n_items = batch.len();
        // Take the socket (and whatever a direct write left over) for this batch.
        let (mut io, leftover) = {
            let mut slot = w.slot();
            let Some(io) = slot.io.take() else { return Ok(()) };
            (io, std::mem::take(&mut slot.leftover))
        };
        scratch.clear();
        parts.clear();
        let mut start = 0;
        for o in batch.drain(..) {
            let (payload, ends) = o.encode(&mut scratch, w.inline_payload);
            closing |= ends;
            if let Some(p) = payload {
                parts.push((start, scratch.len(), Some(p)));
                start = scratch.len();
            }
        }
        parts.push((start, scratch.len(), None));
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() * 2 + 1);
        if !leftover.is_empty() {
            slices.push(IoSlice::new(&leftover));
        }
        for (a, b, p) in &parts {
            if b > a {
                slices.push(IoSlice::new(&scratch[*a..*b]));
            }
            if let Some(p) = p {
                slices.push(IoSlice::new(p));
            }
        }
        let result = write_all_vectored(&mut io, &mut slices).await;
        drop(slices);
        parts.clear();
        {
            let mut slot = w.slot();
            slot.io = Some(io);
            w.queued.fetch_sub(n_items, Ordering::AcqRel);
            w.written.fetch_add(n_items as u64, Ordering::AcqRel);
        }
        result?;
    }
    let io = w.slot().io.take();
    if let Some(mut io) = io {
        let _ = io.shutdown().await;
    }
    Ok(())
}

async fn write_all_vectored<W: AsyncWrite + Unpin + ?Sized>(
    wr: &mut W,
    mut slices: &mut [IoSlice<'_>],
) -> io::Result<()> {
    // Stay below IOV_MAX (1024) per call.
    while !slices.is_empty() {
        let end = slices.len().min(1024);
        let n = wr.write_vectored(&slices[..end]).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use tensorwire_proto::v1::{Chunk, TensorInfo, frame_header::Kind as HeaderKind};

    /// A write half that takes at most `limit` bytes per direct write, with
    /// no syscalls (as a ring): what it took, in order.
    struct Trickle {
        took: std::sync::Arc<Mutex<Vec<u8>>>,
        limit: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<io::Result<usize>> {
            self.took.lock().unwrap().extend_from_slice(buf);
            std::task::Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    impl MuxWrite for Trickle {
        fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            let mut took = self.took.lock().unwrap();
            let mut n = 0;
            for b in bufs {
                let k = b.len().min(self.limit - n);
                took.extend_from_slice(&b[..k]);
                n += k;
            }
            Ok(n)
        }

        fn syscall_free(&self) -> bool {
            true
        }
    }

    fn frames(n: usize) -> Vec<Out> {
        (0..n)
            .map(|i| {
                let header =
                    FrameHeader { kind: Some(HeaderKind::Chunk(Chunk { tensor_id: i as u64, ..Default::default() })) };
                Out::data(1 + 2 * i as u32, Some(header), Bytes::from(vec![i as u8 + 1; 100 * i]), i % 2 == 0)
            })
            .collect()
    }

    #[test]
    fn direct_writes_pass_payloads_by_reference_and_keep_what_was_not_taken() {
        // More payloads than a direct write passes by reference, cut
        // anywhere: what the writer took, then what it kept, is the stream.
        for count in [1, 3, DIRECT_REFS + 3] {
            let mut want = BytesMut::new();
            for o in frames(count) {
                assert!(o.encode(&mut want, usize::MAX).0.is_none());
            }
            for limit in [0, 1, 17, want.len() / 2, want.len() - 1, want.len(), usize::MAX / 2] {
                let took = std::sync::Arc::new(Mutex::new(Vec::new()));
                let (w, mut rx) = Writer::new(Box::new(Trickle { took: took.clone(), limit }));
                w.write_or_push(frames(count)).unwrap();
                let mut got = took.lock().unwrap().clone();
                got.extend_from_slice(&w.slot().leftover);
                assert_eq!(got, &want[..], "{count} frames, {limit} bytes taken");
                let flush = rx.try_recv().ok();
                assert_eq!(flush.is_some(), limit < want.len(), "the writer task is woken only for leftovers");
            }
        }
    }

    #[test]
    fn a_data_item_carries_its_header_length_and_encodes_the_header_as_prost_does() {
        // The writer encodes with `tensorwire_proto::header::encode` and
        // trusts `meta_len`: both must agree with prost's own `encode` and
        // `encoded_len`.
        let header = FrameHeader {
            kind: Some(HeaderKind::Chunk(Chunk {
                tensor_id: 7,
                total_bytes: 1 << 33,
                last: true,
                info: Some(Box::new(TensorInfo { shape: vec![3, 1 << 20], name: "w".into(), ..Default::default() })),
                ..Default::default()
            })),
        };
        let mut want = BytesMut::new();
        header.encode(&mut want).unwrap();
        let o = Out::data(9, Some(header.clone()), Bytes::from_static(b"xyz"), true);
        assert_eq!(o.cost(), want.len() as u64 + 3);
        let mut got = BytesMut::new();
        assert!(o.encode(&mut got, usize::MAX).0.is_none());
        let limits = super::super::frame::FrameLimits { max_meta: 1 << 20, max_payload: 1 << 20 };
        let head = Head::decode(got[..HEAD_LEN].try_into().unwrap(), &limits);
        let head = head.unwrap();
        assert_eq!((head.stream, head.flags, head.meta_len as usize, head.value), (9, FLAG_FIN, want.len(), 3));
        assert_eq!(&got[HEAD_LEN..HEAD_LEN + want.len()], &want[..]);
        assert_eq!(&got[HEAD_LEN + want.len()..], b"xyz");
    }

    #[test]
    fn bytewise_encodes_what_bytes_mut_does_with_or_without_room() {
        let header = FrameHeader {
            kind: Some(HeaderKind::Chunk(Chunk {
                tensor_id: u64::MAX,
                offset: 300,
                total_bytes: 1 << 40,
                last: true,
                info: Some(Box::new(TensorInfo {
                    shape: vec![1, 127, 128, 16_384],
                    name: "x".repeat(200),
                    ..Default::default()
                })),
                ..Default::default()
            })),
        };
        let mut plain = BytesMut::new();
        header.encode(&mut plain).unwrap();
        // Enough room reserved, none at all, and room that runs out midway:
        // the same bytes each time.
        for capacity in [0, 1, 7, plain.len() / 2, plain.len(), plain.len() + 64] {
            let mut b = BytesMut::with_capacity(capacity);
            b.extend_from_slice(b"head");
            header.encode(&mut Bytewise(&mut b)).unwrap();
            assert_eq!(&b[..4], b"head");
            assert_eq!(&b[4..], &plain[..], "capacity {capacity}");
        }
    }
}
