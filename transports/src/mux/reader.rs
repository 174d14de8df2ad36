//! The read side of a mux connection, a thin async driver: it reads the
//! socket into a buffer, lets the sans-IO [`Decoder`] (the one the tests
//! and the fuzz target run) cut frames out of it, asks the
//! [`state`](super::state) machine what each frame means, and carries that
//! out. Limits and credit are checked before anything is allocated.
//!
//! Payloads go straight into a stream's [`Placement`] buffer when one is
//! registered for their tensor, and large ones are read into their own
//! allocation past the buffer (the decoder's two-step API), so no payload
//! is copied twice. The reader stops reading the socket while more than the
//! connection window sits unconsumed, so memory is bounded per connection
//! too.
//!
//! [`Placement`]: crate::Placement

use std::cell::Cell;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;

use super::frame::{Decoder, FrameStart, HEAD_LEN, Head, Kind, code};
use super::handles::{MuxRecv, MuxSend};
use super::shared::{Event, Shared, StreamInner, StreamShared};
use super::state::{Admit, Route, Violation, goaway_reason};
use super::writer::Out;
use crate::sync::lock;
use crate::{FrameHeader, Payload, Received, StreamError};

/// Read buffer size: many small frames per read; payloads above this are
/// read into their own allocation, past the buffer.
const READ_BUF: usize = 64 << 10;

/// Full read buffers kept for reuse once every frame cut from them is
/// dropped (see [`Reader::make_room`]): a connection holds at most this
/// many more than the one it reads into (512 KiB), enough for 64 calls in
/// flight whose 4 KiB answers wait in their streams. Those no frame holds
/// go when a read finds the current buffer free again (the load has
/// passed); a connection that goes quiet right after a burst keeps them
/// until its next reads.
const SPARE_BUFS: usize = 8;

/// How long a connection closed on this side keeps reading (and dropping)
/// what the peer still sends, waiting for the peer to close its side.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

pub(crate) async fn run<R: AsyncRead + Unpin>(shared: Arc<Shared>, mut rd: R, accept: Accepted) {
    // `accept` lives until the connection has failed with its reason: a
    // waiting `accept` that saw the channel end first would report a bare
    // "closed" instead.
    let result = tokio::select! {
        r = read_frames(&shared, &mut rd, &accept) => r,
        _ = shared.wait_closed() => {
            drain(&mut rd).await;
            return;
        }
    };
    let err = match result {
        Ok(()) => {
            StreamError::ConnectionClosed { peer: shared.peer.clone(), reason: "the peer closed the connection".into() }
        }
        Err(e) => {
            if let StreamError::Protocol { reason, .. } = &e {
                tracing::warn!(peer = %shared.peer, %reason, "closing connection: protocol violation");
                let _ = shared.writer.push(Out::GoAway { code: code::PROTOCOL, reason: reason.clone() });
            }
            e
        }
    };
    shared.fail(err);
    drop(accept);
}

/// After a close on this side (a GOAWAY, then the writer's FIN after the
/// frames still queued): reads and drops what the peer still sends until it
/// closes its side, at most [`LINGER`]. A TCP socket closed with unread
/// bytes (the peer's window updates, say) makes the kernel send a reset,
/// which throws away what was still queued for the peer: the end of a reply
/// that a graceful shutdown let finish. (A Unix socket's peer reads what was
/// queued, then gets `ECONNRESET` instead of a clean end.)
async fn drain<R: AsyncRead + Unpin>(rd: &mut R) {
    let mut buf = vec![0u8; 16 << 10];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(n) = rd.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// Where the reader hands the streams the peer opens, for `accept`.
pub(crate) type Accepted = mpsc::UnboundedSender<(MuxSend, MuxRecv)>;

/// The socket, its read buffer and the decoder cutting frames out of it.
struct Reader<'a, R> {
    shared: &'a Arc<Shared>,
    rd: R,
    buf: BytesMut,
    /// Earlier read buffers, some of their frames perhaps still held.
    spare: Vec<BytesMut>,
    dec: Decoder,
    accept: &'a Accepted,
    /// Answers to the peer's frames (pongs, refusals) queued since the
    /// writer last caught up or wrote anything, and its written count then.
    owed: Cell<(usize, u64)>,
}

/// Most answers the peer's own frames ask for (a PONG per PING, a RESET
/// per stream over the limit) queued behind a writer that writes nothing:
/// a peer that keeps asking while it reads nothing would otherwise grow
/// the writer's queue without bound (HTTP/2's ping and reset floods).
const MAX_OWED_REPLIES: usize = 1024;

/// Once the peer has stopped `stream` (STOP, or a refusing RESET), its
/// stop signal fires with the error a send gets.
fn note_stopped(shared: &Shared, stream: u32, inner: &mut StreamInner) {
    if let Some(code) = inner.state.peer_stopped() {
        inner.set_gone(|| StreamError::Stopped { peer: shared.peer.clone(), stream: stream.into(), code });
    }
}

async fn read_frames<R: AsyncRead + Unpin>(shared: &Arc<Shared>, rd: R, accept: &Accepted) -> Result<(), StreamError> {
    let mut r = Reader {
        shared,
        rd,
        buf: BytesMut::with_capacity(READ_BUF),
        spare: Vec::new(),
        dec: Decoder::new(shared.limits),
        accept,
        owed: Cell::new((0, 0)),
    };
    while let Some(FrameStart { head, meta }) = r.next_head().await? {
        match head.kind {
            Kind::Data => r.on_data(head, meta).await?,
            Kind::Window => {
                if let Some(s) = lookup(shared, head.stream) {
                    let granted = lock(&s.inner).state.on_window(head.value);
                    granted.map_err(|v| violation(shared, head.stream, v))?;
                    s.send_notify.notify_waiters();
                }
            }
            Kind::Reset => {
                if let Some(s) = lookup(shared, head.stream) {
                    {
                        let inner = &mut *lock(&s.inner);
                        if inner.state.on_reset(head.value) {
                            inner.reset = Some(head.value);
                            if let Some(ev) = &mut inner.events {
                                ev.send(Event::Reset(head.value));
                            }
                        }
                        // A refused stream's sender is stopped too.
                        note_stopped(shared, head.stream, inner);
                    }
                    // A refused stream's sender stops (see `on_reset`).
                    if head.value == code::REFUSED {
                        s.send_notify.notify_waiters();
                    }
                }
            }
            Kind::Stop => {
                if let Some(s) = lookup(shared, head.stream) {
                    {
                        let inner = &mut *lock(&s.inner);
                        inner.state.on_stop(head.value);
                        note_stopped(shared, head.stream, inner);
                    }
                    s.send_notify.notify_waiters();
                }
            }
            Kind::GoAway => {
                let reason = goaway_reason(head.value, &meta);
                return Err(StreamError::ConnectionClosed { peer: shared.peer.clone(), reason });
            }
            Kind::Ping => r.answer(Out::Pong(head.value))?,
            Kind::Pong => {}
        }
    }
    Ok(())
}

fn lookup(shared: &Shared, id: u32) -> Option<Arc<StreamShared>> {
    lock(&shared.state).streams.get(id).cloned()
}

fn violation(shared: &Shared, id: u32, v: Violation) -> StreamError {
    match v {
        Violation::DataOnStreamZero => shared.protocol(v.to_string()),
        v => shared.protocol(format!("stream {id}: {v}")),
    }
}

fn eof_in_payload(shared: &Shared) -> StreamError {
    shared.protocol("connection closed in the middle of a payload")
}

impl<R: AsyncRead + Unpin> Reader<'_, R> {
    /// The next frame's head and meta (skipping what is left of the previous
    /// payload). None: the peer closed the socket cleanly between frames.
    async fn next_head(&mut self) -> Result<Option<FrameStart>, StreamError> {
        loop {
            let decoded = self.dec.decode_head(&mut self.buf);
            if let Some(start) = decoded.map_err(|e| self.shared.protocol(e.to_string()))? {
                self.shared.heard();
                return Ok(Some(start));
            }
            if !self.read_more(HEAD_LEN).await? {
                if self.buf.is_empty() && self.dec.at_frame_boundary() {
                    return Ok(None);
                }
                return Err(self.shared.protocol("connection closed in the middle of a frame"));
            }
        }
    }

    /// Appends what the socket has to the buffer (room for at least `want`
    /// more bytes). Ok(false): end of stream.
    async fn read_more(&mut self, want: usize) -> Result<bool, StreamError> {
        let spare = self.buf.capacity() - self.buf.len();
        if spare < want || spare < 4096 {
            self.make_room(want.max(READ_BUF));
        }
        // Silent peers are found by the keep-alive task (conn.rs), which
        // closes the connection and so ends this read.
        let got = self.rd.read_buf(&mut self.buf).await.map_err(|e| StreamError::io(&self.shared.peer, &e))?;
        Ok(got > 0)
    }

    /// Gives the read buffer room for `need` more bytes. Frames cut from it
    /// are views of it, held by their streams until consumed, so a full
    /// buffer usually cannot be reused in place: reading then goes on in a
    /// spare whose frames have all been dropped (its pages already faulted
    /// in), else in a new buffer, and the full one becomes a spare. A new
    /// buffer for every 64 KiB read (what `BytesMut::reserve` does) cost
    /// more than the frames' copy: the allocator hands the freed buffer
    /// back to the system and faults fresh pages in for the next.
    fn make_room(&mut self, need: usize) {
        if self.buf.try_reclaim(need) {
            // Every frame read so far has been consumed: the load that
            // needed spares has passed, so those no frame holds go (kept
            // spares are idle memory).
            self.spare.retain_mut(|b| !b.try_reclaim(READ_BUF));
            return;
        }
        // A spare grown for a large frame header is not kept for reuse.
        self.spare.retain_mut(|b| !b.try_reclaim(READ_BUF) || b.capacity() <= 2 * READ_BUF);
        let reusable = self.spare.iter_mut().position(|b| b.try_reclaim(need));
        let mut next = match reusable {
            Some(i) => self.spare.swap_remove(i),
            None => BytesMut::with_capacity(need),
        };
        // The start of a frame not yet complete moves along.
        next.extend_from_slice(&self.buf);
        let mut full = std::mem::replace(&mut self.buf, next);
        full.clear();
        if self.spare.len() < SPARE_BUFS {
            self.spare.push(full);
        }
    }

    /// Reads the rest of the current payload from the socket straight into
    /// `dst`, past the buffer.
    async fn read_past(&mut self, mut dst: impl BufMut) -> Result<(), StreamError> {
        while self.dec.payload_remaining() > 0 {
            let mut limited = (&mut dst).limit(self.dec.payload_remaining());
            let got = self.rd.read_buf(&mut limited).await.map_err(|e| StreamError::io(&self.shared.peer, &e))?;
            if got == 0 {
                return Err(eof_in_payload(self.shared));
            }
            self.dec.payload_read(got);
        }
        Ok(())
    }

    /// The current payload as its own bytes: split off the buffer when it
    /// fits there, else read into one allocation of exactly its size (checked
    /// against the limits by the decoder).
    async fn read_payload(&mut self) -> Result<Bytes, StreamError> {
        let n = self.dec.payload_remaining();
        if n <= READ_BUF.max(self.buf.len()) {
            while self.buf.len() < self.dec.payload_remaining() {
                let want = self.dec.payload_remaining() - self.buf.len();
                if !self.read_more(want).await? {
                    return Err(eof_in_payload(self.shared));
                }
            }
            return Ok(self.dec.take_payload(&mut self.buf));
        }
        let mut dst = BytesMut::with_capacity(n);
        dst.extend_from_slice(&self.dec.take_payload(&mut self.buf));
        self.read_past(&mut dst).await?;
        Ok(dst.freeze())
    }

    /// Finds or opens the stream a DATA frame belongs to. None: discard the
    /// frame (the next head skips its payload).
    /// Queues `o`, an answer the peer's frame asks for; fails the
    /// connection past [`MAX_OWED_REPLIES`] answers queued while the writer
    /// wrote nothing (the peer is not reading).
    fn answer(&self, o: Out) -> Result<(), StreamError> {
        let w = &self.shared.writer;
        let (backlog, written) = w.backlog();
        let (owed, seen) = self.owed.get();
        // Counted only while the writer is stuck: a busy writer that keeps
        // writing (the peer reads) starts the count again.
        let owed = if backlog == 0 || written != seen { 1 } else { owed + 1 };
        if owed > MAX_OWED_REPLIES {
            return Err(self.shared.protocol(format!(
                "the peer sent {MAX_OWED_REPLIES} frames that ask for an answer (pings, streams over the limit) without reading the answers"
            )));
        }
        self.owed.set((owed, written));
        let _ = w.write_or_push([o]);
        Ok(())
    }

    fn stream_for_data(&self, id: u32) -> Result<Option<Arc<StreamShared>>, StreamError> {
        let shared = self.shared;
        let mut st = lock(&shared.state);
        if st.error.is_some() {
            // The connection failed (its writer, say) while this frame was
            // read: a stream opened now would never hear of it.
            return Ok(None);
        }
        let route = st.streams.route_data(id, || shared.new_stream(id));
        match route.map_err(|v| violation(shared, id, v))? {
            Route::Existing(s) => Ok(Some(s)),
            Route::Ignored => Ok(None),
            Route::Refused => {
                drop(st);
                self.answer(Out::Reset { id, code: code::REFUSED })?;
                Ok(None)
            }
            Route::Opened(s) => {
                shared.count_streams(&st);
                drop(st);
                let incoming =
                    (MuxSend { shared: shared.clone(), stream: s.clone() }, MuxRecv::new(shared.clone(), s.clone()));
                Ok(self.accept.send(incoming).is_ok().then_some(s))
            }
        }
    }

    async fn on_data(&mut self, head: Head, meta: Bytes) -> Result<(), StreamError> {
        let shared = self.shared;
        let plen = self.dec.payload_remaining();
        let header = if meta.is_empty() {
            if plen > 0 {
                return Err(shared.protocol(format!("stream {}: payload without a frame header", head.stream)));
            }
            None
        } else {
            Some(
                FrameHeader::decode(meta)
                    .map_err(|e| shared.protocol(format!("stream {}: undecodable frame header: {e}", head.stream)))?,
            )
        };
        // A frame nobody will read: its header goes to the transport's
        // discard hook (the reader skips its payload).
        let dropped = |header: Option<FrameHeader>| {
            if let Some(h) = &header {
                shared.discarded(h);
            }
            Ok(())
        };
        let Some(s) = self.stream_for_data(head.stream)? else {
            return dropped(header);
        };
        let cost = head.meta_len as u64 + plen as u64;
        let admitted = {
            let mut inner = lock(&s.inner);
            match inner.state.on_data_head(cost).map_err(|v| violation(shared, head.stream, v))? {
                Admit::Discard => None,
                Admit::Deliver => Some(match (&inner.placement, &header) {
                    (Some(p), Some(h)) => h
                        .placement_offset()
                        .filter(|&(id, off)| p.accepts(id, off, plen))
                        .map(|(_, off)| (p.clone(), off)),
                    _ => None,
                }),
            }
        };
        let Some(placement) = admitted else {
            return dropped(header);
        };
        let payload = match placement {
            Some((p, off)) => {
                let mut g = p.lock().await;
                let dst = &mut g[off as usize..off as usize + plen];
                let buffered = self.dec.take_payload(&mut self.buf);
                dst[..buffered.len()].copy_from_slice(&buffered);
                self.read_past(&mut dst[buffered.len()..]).await?;
                Payload::Placed { offset: off, len: plen }
            }
            None => Payload::Bytes(self.read_payload().await?),
        };
        let undelivered = {
            let inner = &mut *lock(&s.inner);
            let deliver = inner.state.on_data_end(head.fin());
            match &mut inner.events {
                Some(ev) if deliver => {
                    if let Some(header) = header {
                        shared.buffered.fetch_add(cost, Ordering::AcqRel);
                        ev.send(Event::Frame(Received { header, payload }, cost));
                    }
                    if head.fin() {
                        ev.send(Event::Fin);
                    }
                    None
                }
                // The receiver went away while the payload was read.
                _ => header,
            }
        };
        if let Some(h) = &undelivered {
            shared.discarded(h);
        }
        // Connection window: stop reading while too much sits unconsumed
        // (checked first without registering for a wake-up: the usual case).
        let room =
            || shared.buffered.load(Ordering::Acquire) <= shared.conn_window || shared.closed.load(Ordering::Acquire);
        if room() {
            return Ok(());
        }
        loop {
            let n = shared.budget_notify.notified();
            let mut n = pin!(n);
            n.as_mut().enable();
            if room() {
                return Ok(());
            }
            n.await;
        }
    }
}
