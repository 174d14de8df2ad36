//! `shm://name`, and `unix://` upgraded to shared memory: the mux runs over
//! two shared-memory rings (one per direction) instead of the Unix socket,
//! and a tensor of at least
//! [`ShmConfig::min_tensor_bytes`](crate::config::ShmConfig) and at most
//! `max_in_flight` (the segment pool's size) travels in a memfd segment
//! instead of the rings when a warm one fits (see **Warm segments only**).
//!
//! ```text
//!   client                                   server
//!   connect(unix socket) ── "TWSHM\x01\x01" + SCM_RIGHTS(side channel end,
//!                           ring region memfd, 4 doorbell ends) ────────►  checks, maps the rings
//!   mux preface ◄══════════════ rings ══════════════════════════► mux preface
//!   headers, small tensors ◄══ rings (spin, then sleep on a doorbell) ══►
//!   tensor ≥ 256 KiB: copy into a pooled segment (warmed ones: side channel NEW id + fd first)
//!                     one chunk frame {shm_segment: id, raw_len} ══► view of the mapping
//!                     ◄────────────── side channel TAKEN id, later RELEASED id
//!   the socket carries nothing more: its end of stream says the peer is gone
//! ```
//!
//! - **Rings.** See the `ring` module: a small call is two memory copies and,
//!   while traffic flows, no system call; a side with nothing to do spins
//!   for [`TransportConfig::spin`](crate::TransportConfig::spin) after the last bytes
//!   moved, then sleeps until the other side rings its doorbell (a Unix
//!   datagram socket pair; it never blocks the ringer, whatever the peer
//!   does with its end). With
//!   `ring_bytes = 0` or `?ring=0` the mux runs over the socket as before
//!   (the offer's seventh byte says which).
//! - **One copy.** The sender copies the tensor into a segment chunk by
//!   chunk as the pipeline hands it over; the receiver's tensor bytes *are*
//!   its mapping of the segment (writable, so that a torch tensor made
//!   from it may be changed in place). No socket carries the payload.
//! - **Reuse.** A segment goes back to the sender's pool when the receiver
//!   has dropped every view of it (RELEASED), so steady traffic pays no page
//!   faults; the pool holds at most `max_in_flight` bytes.
//! - **Warm segments only.** A new segment is faulted in page by page (~1
//!   GiB/s on the VMs this was measured on), slower than the rings (or the
//!   socket) into the receiver's warm receive pool (4–10 GiB/s). So a
//!   tensor no pooled segment fits goes through the rings; from the second
//!   such tensor of a size on, a segment of that size is made on a
//!   low-priority thread for the next one. A one-shot sender from a new
//!   process never waits for page faults (nor competes with a warming
//!   thread); steady traffic moves to segments from its third tensor on.
//!   Tensors too large to pool (over `max_in_flight`) always go through
//!   the rings: a segment of their own would be fresh memory each time, and
//!   the sender would hold the tensor twice.
//! - **Backpressure.** Segments sent and not yet viewed (TAKEN) by the
//!   receiver hold at most `max_in_flight` bytes of budget, however long
//!   the receiver takes to read them; a frame the receiver drops unread
//!   (its stream reset, its receiver gone) is reported RELEASED by the mux
//!   connection's discard hook, so its budget and segment come back.
//! - **Cleanup.** Segments and ring regions are anonymous memfds: nothing is
//!   ever created in `/dev/shm`, and the kernel frees them with their last
//!   descriptor or mapping, also when a peer crashes.
//! - **Safety.** See the `segment` module: size-sealed segments, sizes checked
//!   against `fstat` and the receiver's limit before mapping, a frame can
//!   only name a segment passed on its own connection and bytes inside it,
//!   and a bounded number of segments per connection. A ring region must be
//!   size-sealed and of an allowed shape, its wake-up descriptors Unix
//!   datagram sockets;
//!   ring positions are checked on every read and write.
//!
//! `shm://name` listens on the abstract Unix socket `@tensorwire-shm-name`
//! (no file; Linux only). The server side of `unix://` accepts clients that
//! offer shared memory (with or without rings) and clients that do not.
//!
//! Files: this file holds the transport (connect, listen, the connection
//! and its streams over the mux); `segment` holds the memfd segments, their
//! mappings and the side channel; `ring` the rings and their async halves.
//! Neither imports anything from this file (only `crate::` types), so the
//! dependency goes one way.

#[cfg(feature = "fuzzing")]
pub mod fuzz;
pub(crate) mod ring;
pub(crate) mod segment;

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use tensorwire_proto::v1::{self, frame_header::Kind};
use tokio::net::UnixStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use self::segment::{
    MAGIC, MAX_SEGMENTS, Owner, SegmentWriter, SideChannel, SideMsg, recv_with_fds, send_with_fds, seqpacket_pair,
};
use crate::config::ShmConfig;
use crate::copy::STREAMED_DESTINATIONS_FROM;
use crate::mux::{DiscardHook, MuxConnection, MuxRecv, MuxSend};
use crate::sync::{lock, spawn_bounded};
use crate::{
    Connection, ConnectionInfo, Frame, FrameHeader, Incoming, Payload, Placement, Received, RecvStream, SendStream,
    StreamError, StreamKind,
};

/// Most threads making segments in the background at once, process-wide.
const MAX_WARMERS: usize = 2;
static WARMERS: AtomicUsize = AtomicUsize::new(0);

/// The abstract socket name of `shm://name`.
pub(crate) fn socket_path(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("@tensorwire-shm-{name}"))
}

/// Byte of the offer's magic that says rings follow (1) or not (0).
const RING_FLAG: usize = 6;

/// The rings of a connection, once offered or accepted: the mapping and
/// this side's doorbell ends (see [`ring::EVENTFDS`]).
pub(crate) type RingParts = (Arc<ring::Region>, [OwnedFd; ring::EVENTFDS]);

/// What a client offered: its end of the side channel, and rings for the
/// mux's frames when it asked for them.
pub(crate) struct Offer {
    /// The side channel.
    pub(crate) side: OwnedFd,
    /// The rings, when offered.
    pub(crate) ring: Option<RingParts>,
}

/// Client side: offers shared memory on a fresh socket (before the mux
/// preface): the side channel, and rings of `ring_bytes` per direction for
/// the mux's frames unless that is 0.
pub(crate) async fn offer(s: &UnixStream, ring_bytes: usize) -> std::io::Result<Offer> {
    let (ours, theirs) = seqpacket_pair()?;
    let rings = if ring_bytes > 0 { Some(ring::RingOffer::new(ring_bytes)?) } else { None };
    let mut magic = *MAGIC;
    let mut fds = vec![theirs.as_raw_fd()];
    if let Some(r) = &rings {
        magic[RING_FLAG] = 1;
        fds.push(r.memfd.as_raw_fd());
        fds.extend(r.events.iter().map(|e| e.as_raw_fd()));
    }
    loop {
        s.writable().await?;
        match s.try_io(tokio::io::Interest::WRITABLE, || send_with_fds(s.as_raw_fd(), &magic, &fds)) {
            Ok(n) if n == magic.len() => break,
            Ok(_) => return Err(std::io::Error::other("short write of the shared-memory offer")),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(Offer { side: ours, ring: rings.map(ring::offered) })
}

/// Whether `buf` (8 bytes) is an offer: the magic, with or without rings.
fn is_offer(buf: &[u8; 8]) -> Option<bool> {
    let ring = buf[RING_FLAG];
    let mut plain = *buf;
    plain[RING_FLAG] = 0;
    (&plain == MAGIC && ring <= 1).then_some(ring == 1)
}

/// Server side: if the client's first bytes are the offer, consumes them
/// and returns what it passed (checked: a ring region of allowed size and
/// doorbells); otherwise leaves the socket as it was (a plain mux client).
pub(crate) async fn accept_offer(s: &UnixStream) -> std::io::Result<Option<Offer>> {
    let mut buf = [0u8; 8];
    // A partial offer (a client sends it whole, so only a hostile or stalled
    // one leaves it partial) is looked at again after a growing pause, not
    // every millisecond until the handshake times out.
    let mut pause = std::time::Duration::from_millis(1);
    let with_ring = loop {
        s.readable().await?;
        let peeked = s.try_io(tokio::io::Interest::READABLE, || {
            // SAFETY: recv with MSG_PEEK into an 8-byte buffer on our socket.
            let n =
                unsafe { libc::recv(s.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), libc::MSG_PEEK) };
            if n < 0 { Err(std::io::Error::last_os_error()) } else { Ok(n as usize) }
        });
        match peeked {
            Ok(0) => return Ok(None),
            Ok(n) if n < MAGIC.len() && buf[..n.min(RING_FLAG)] == MAGIC[..n.min(RING_FLAG)] => {
                // The offer is sent whole; wait for the rest of it.
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(100));
                continue;
            }
            Ok(n) if n == MAGIC.len() => match is_offer(&buf) {
                Some(ring) => break ring,
                // An offer of another version or with other options: say so
                // now rather than let the mux wait for a preface.
                None if buf[..5] == MAGIC[..5] => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("unknown shared-memory offer {:?} (a client of another version?)", &buf[5..]),
                    ));
                }
                None => return Ok(None),
            },
            Ok(_) => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    let (n, fds) = s.try_io(tokio::io::Interest::READABLE, || recv_with_fds(s.as_raw_fd(), &mut buf, 0))?;
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let want = if with_ring { 2 + ring::EVENTFDS } else { 1 };
    if n != MAGIC.len() || fds.len() != want {
        return Err(bad(format!(
            "shared-memory offer with {} descriptors attached, {want} expected (side channel{})",
            fds.len(),
            if with_ring { ", ring region and doorbells" } else { "" }
        )));
    }
    let mut fds = fds.into_iter();
    let side = fds.next().expect("counted");
    let ring = match with_ring {
        true => {
            let memfd = fds.next().expect("counted");
            let events: [OwnedFd; ring::EVENTFDS] =
                fds.collect::<Vec<_>>().try_into().map_err(|_| bad("counted".into()))?;
            Some(ring::accept(memfd, events).map_err(bad)?)
        }
        false => None,
    };
    Ok(Some(Offer { side, ring }))
}

/// The mux's byte stream over the rings of `parts`, with the socket `s`
/// kept for liveness only.
pub(crate) fn ring_halves(
    end: ring::End,
    parts: RingParts,
    s: UnixStream,
    spin: std::time::Duration,
) -> std::io::Result<(ring::RingReader, ring::RingWriter)> {
    let sock = OwnedFd::from(s.into_std()?);
    let (region, events) = parts;
    ring::halves(end, region, events, sock, spin)
}

struct Shared {
    side: Arc<SideChannel>,
    budget: Arc<Semaphore>,
    /// Budget units (1 MiB each) in all.
    budget_units: u32,
    next_segment: AtomicU64,
    /// Numbers loans of segments ([`Lent::loan`]).
    next_loan: AtomicU64,
    cfg: ShmConfig,
    peer: String,
    /// Our segments free for the next tensor.
    pool: Mutex<Vec<(u64, SegmentWriter)>>,
    /// Our segments the peer holds views of.
    lent: Mutex<HashMap<u64, Lent>>,
    /// Segments dropped from the pool, to tell the peer about.
    forget: Mutex<Vec<u64>>,
    /// Segments being filled by a stream right now.
    filling: AtomicUsize,
    /// A segment made and faulted in by the background warmer, not yet
    /// passed to the peer (see [`Shared::acquire`]).
    warmed: Arc<Mutex<Option<SegmentWriter>>>,
    /// True while the background warmer runs (one at a time).
    warming: Arc<AtomicBool>,
    /// Segment size of the last tensor no ready segment fitted.
    last_miss: Mutex<Option<u64>>,
    /// Announces copies into segments to the peer's ring reader (None:
    /// frames go through the socket, whose reader has no such word).
    busy: Option<ring::Busy>,
}

struct Lent {
    seg: SegmentWriter,
    /// Budget held until the peer reports the segment taken.
    permit: Option<OwnedSemaphorePermit>,
    /// This loan's number (a segment is lent again after it comes back).
    loan: u64,
    /// Since when the frame that names the segment may not have left (its
    /// send failed or was dropped before it returned): it may never reach
    /// the peer, and expires after `segment_timeout`. None while it is being
    /// sent and once it left: the peer reports the segment taken when it
    /// is read, or released when the frame is dropped unread, however long
    /// that takes.
    unsent_since: Option<Instant>,
}

impl Owner for Shared {
    fn taken(&self, id: u64) {
        if let Some(l) = lock(&self.lent).get_mut(&id) {
            l.permit = None;
        }
    }

    fn released(&self, id: u64) {
        let Some(l) = lock(&self.lent).remove(&id) else { return };
        self.give_back(id, l.seg);
    }
}

/// Segments are sized in whole MiB so that they fit the next tensors too.
fn segment_size(n: u64) -> u64 {
    n.div_ceil(1 << 20).max(1) << 20
}

/// Whether a segment of `len` bytes serves a tensor of `n` bytes (large
/// enough, and not wastefully larger).
fn fits(len: usize, n: u64) -> bool {
    len as u64 >= n && len as u64 <= segment_size(n).max(4 * n)
}

impl Shared {
    /// A protocol error from this connection's peer.
    fn protocol(&self, reason: String) -> StreamError {
        StreamError::Protocol { peer: self.peer.clone(), reason }
    }

    fn new(side: Arc<SideChannel>, cfg: &ShmConfig, peer: String) -> Self {
        let units = u32::try_from(cfg.max_in_flight.div_ceil(1 << 20)).unwrap_or(u32::MAX >> 4).clamp(1, u32::MAX >> 4);
        Shared {
            side,
            budget: Arc::new(Semaphore::new(units as usize)),
            budget_units: units,
            next_segment: AtomicU64::new(1),
            next_loan: AtomicU64::new(1),
            cfg: cfg.clone(),
            peer,
            pool: Mutex::new(Vec::new()),
            lent: Mutex::new(HashMap::new()),
            forget: Mutex::new(Vec::new()),
            filling: AtomicUsize::new(0),
            warmed: Arc::new(Mutex::new(None)),
            warming: Arc::new(AtomicBool::new(false)),
            last_miss: Mutex::new(None),
            busy: None,
        }
    }

    /// The frames naming these loans (segment id, loan) did not leave:
    /// their segments may expire.
    fn unsent(&self, loans: &[(u64, u64)]) {
        let mut lent = lock(&self.lent);
        for (id, loan) in loans {
            if let Some(l) = lent.get_mut(id)
                && l.loan == *loan
            {
                l.unsent_since.get_or_insert_with(Instant::now);
            }
        }
    }

    /// Returns a segment to the pool (most recent last), dropping the
    /// oldest pooled ones beyond `max_in_flight` bytes.
    fn give_back(&self, id: u64, seg: SegmentWriter) {
        let limit = self.cfg.max_in_flight;
        let mut dropped = Vec::new();
        {
            let mut pool = lock(&self.pool);
            if seg.len() as u64 > limit {
                dropped.push(id);
            } else {
                let mut pooled: u64 = pool.iter().map(|(_, s)| s.len() as u64).sum();
                while pooled + seg.len() as u64 > limit && !pool.is_empty() {
                    let (old, s) = pool.remove(0);
                    pooled -= s.len() as u64;
                    dropped.push(old);
                }
                pool.push((id, seg));
            }
        }
        lock(&self.forget).extend(dropped);
    }

    /// A segment of at least `n` bytes and the budget for it: a pooled one
    /// when one fits, or the one warmed in the background, passed to the
    /// peer before use. None sends the tensor through the socket: when no
    /// ready segment fits (on a repeated miss of a size one is then made in
    /// the background for the next tensor), or when this connection already
    /// has as many live segments as the peer accepts, or when the tensor is
    /// too large to pool (over `max_in_flight`).
    async fn acquire(&self, n: u64) -> Option<(u64, SegmentWriter, OwnedSemaphorePermit)> {
        match self.acquire_or_fail(n).await {
            Ok(r) => r,
            // The side channel failed (the peer closed it, stopped reading
            // it, or broke its protocol): it is ended, as its reader ends it
            // on such errors; this tensor and the next go through the socket.
            Err(e) => {
                tracing::debug!(peer = %self.peer, error = %e, "shared-memory side channel failed");
                self.side.end();
                self.budget.close();
                None
            }
        }
    }

    async fn acquire_or_fail(
        &self,
        n: u64,
    ) -> Result<Option<(u64, SegmentWriter, OwnedSemaphorePermit)>, std::io::Error> {
        self.expire_stale();
        let forget = std::mem::take(&mut *lock(&self.forget));
        for id in forget {
            self.side.send(SideMsg::Forget(id), None).await?;
        }
        let size = segment_size(n);
        if size > self.cfg.max_in_flight {
            // Too large to pool: through the rings, every time, without
            // waiting for the budget. A segment of its own would be fresh
            // memory for each such tensor (see below), on top of the tensor,
            // so the sender would hold it twice; through the rings the
            // receiver's buffer is faulted in beside the copy.
            return Ok(None);
        }
        let units = u32::try_from(n.div_ceil(1 << 20)).unwrap_or(u32::MAX).clamp(1, self.budget_units);
        let permit = loop {
            match tokio::time::timeout(self.cfg.segment_timeout, self.budget.clone().acquire_many_owned(units)).await {
                Ok(Ok(p)) => break p,
                // The side channel ended: no segments any more.
                Ok(Err(_closed)) => return Ok(None),
                Err(_) => self.expire_stale(),
            }
        };
        let pool_fits = |pool: &Vec<(u64, SegmentWriter)>| pool.iter().any(|(_, s)| fits(s.len(), n));
        if !pool_fits(&lock(&self.pool)) {
            // A release may be waiting in the socket: take it in first.
            self.side.drain_now(self).map_err(std::io::Error::other)?;
        }
        let reuse = {
            let mut pool = lock(&self.pool);
            let best = pool
                .iter()
                .enumerate()
                .filter(|(_, (_, s))| fits(s.len(), n))
                .min_by_key(|(_, (_, s))| s.len())
                .map(|(i, _)| i);
            best.map(|i| pool.swap_remove(i))
        };
        if let Some((id, seg)) = reuse {
            return Ok(Some((id, seg, permit)));
        }
        // Stay below the peer's limit on live segments: drop pooled ones
        // first; if what the peer holds is already at the limit, use the socket.
        let evicted = {
            let mut pool = lock(&self.pool);
            let live = pool.len() + lock(&self.lent).len() + self.filling.load(Ordering::Acquire);
            let over = (live + 1).saturating_sub(MAX_SEGMENTS - 1);
            let k = over.min(pool.len());
            pool.drain(..k).map(|(id, _)| id).collect::<Vec<_>>()
        };
        for id in &evicted {
            self.side.send(SideMsg::Forget(*id), None).await?;
        }
        let live = lock(&self.pool).len() + lock(&self.lent).len() + self.filling.load(Ordering::Acquire);
        if live + 1 >= MAX_SEGMENTS {
            return Ok(None);
        }
        // A segment made in the background (by an earlier miss) is passed
        // to the peer now; it serves this tensor if it fits, else the pool.
        let warmed = lock(&self.warmed).take();
        if let Some(seg) = warmed {
            let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
            self.side.send(SideMsg::New(id), Some(seg.fd())).await?;
            if fits(seg.len(), n) {
                return Ok(Some((id, seg, permit)));
            }
            self.give_back(id, seg);
        }
        // A new segment costs a page fault per page (~1 GiB/s on the VMs
        // this was measured on; memfd pages ~0.5 GiB/s), several times what
        // the rings (or the socket) cost into the receiver's warm pool:
        // this tensor goes through them. From the second such miss of a
        // size on (steady traffic, not a one-shot sender), a segment of
        // that size is made off the hot path for the next tensor.
        let repeat = lock(&self.last_miss).replace(size) == Some(size);
        if repeat {
            self.warm_in_background(size as usize);
        }
        Ok(None)
    }

    /// Makes (and faults in) a segment of `size` bytes on a thread of its
    /// own at a lower CPU priority (nice 10), unless one is being made;
    /// the next [`acquire`](Self::acquire) passes it to the peer.
    fn warm_in_background(&self, size: usize) {
        if self.warming.swap(true, Ordering::AcqRel) {
            return;
        }
        // Process-wide, at most MAX_WARMERS threads fault segments in at
        // once (a server with many shm clients); a miss while all are busy
        // tries again on its next repeat.
        let (slot, flag) = (self.warmed.clone(), self.warming.clone());
        let spawned = spawn_bounded(&WARMERS, MAX_WARMERS, "tw-shm-warm", move || {
            // SAFETY: setpriority on this thread's own id (Linux: per thread).
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
            match SegmentWriter::new(size) {
                Ok(seg) => *lock(&slot) = Some(seg),
                Err(e) => tracing::debug!(size, error = %e, "could not make a shared-memory segment"),
            }
            flag.store(false, Ordering::Release);
        });
        if spawned.is_none() {
            self.warming.store(false, Ordering::Release);
        }
    }

    /// Segments whose frame did not leave (its send failed or was
    /// cancelled) within the timeout: budget back, segment forgotten. (A
    /// frame that left is never expired: a slow receiver reads it late, and
    /// one dropped unread is reported released by the peer's discard hook.)
    fn expire_stale(&self) {
        let timeout = self.cfg.segment_timeout;
        let mut lent = lock(&self.lent);
        let stale: Vec<u64> = lent
            .iter()
            .filter(|(_, l)| l.permit.is_some() && l.unsent_since.is_some_and(|t| t.elapsed() >= timeout))
            .map(|(id, _)| *id)
            .collect();
        for id in &stale {
            lent.remove(id);
        }
        drop(lent);
        lock(&self.forget).extend(stale);
    }
}

/// A mux connection whose large payloads travel in shared memory.
pub(crate) struct ShmConnection {
    inner: Arc<MuxConnection>,
    shared: Arc<Shared>,
    reader: JoinHandle<()>,
    transport: &'static str,
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// The side channel on `fd` (the peer's segments up to the configured
/// size), and the discard hook to establish the mux connection with.
pub(crate) fn side_channel(fd: OwnedFd, cfg: &ShmConfig) -> std::io::Result<(Arc<SideChannel>, DiscardHook)> {
    let side = Arc::new(SideChannel::new(fd, cfg.max_segment_bytes)?);
    let hook = discard_hook(&side);
    Ok((side, hook))
}

/// Wraps a mux connection, established with [`side_channel`]'s discard
/// hook, with that side channel.
pub(crate) fn wrap(
    inner: Arc<MuxConnection>,
    side: Arc<SideChannel>,
    cfg: &ShmConfig,
    transport: &'static str,
    busy: Option<ring::Busy>,
) -> Arc<dyn Connection> {
    let shared = Arc::new(Shared { busy, ..Shared::new(side, cfg, inner.info().peer) });
    let s = shared.clone();
    let reader = tokio::spawn(async move {
        // When the side channel ends (the peer closed its connection, or
        // broke the side-channel protocol), the socket may still hold frames
        // the peer sent before: they are delivered. Frames naming segments
        // fail from now on, and this side sends everything through the socket.
        let why = s.side.run(&*s).await;
        tracing::debug!(peer = %s.peer, reason = %why, "shared-memory side channel ended");
        // Nothing lent comes back now: senders waiting for budget send
        // through the socket instead of waiting forever.
        s.budget.close();
    });
    Arc::new(ShmConnection { inner, shared, reader, transport })
}

#[async_trait]
impl Connection for ShmConnection {
    async fn open(&self, _kind: StreamKind) -> Result<(Box<dyn SendStream>, Box<dyn RecvStream>), StreamError> {
        let (tx, rx) = self.inner.open_halves()?;
        Ok((
            Box::new(ShmSend {
                inner: tx,
                shared: self.shared.clone(),
                pending: None,
                sending: Vec::new(),
                announced: None,
            }),
            Box::new(ShmRecv::new(rx, self.shared.clone())),
        ))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        let (send, recv) = self.inner.accept_halves().await?;
        Ok(Incoming {
            kind: None,
            send: Box::new(ShmSend {
                inner: send,
                shared: self.shared.clone(),
                pending: None,
                sending: Vec::new(),
                announced: None,
            }),
            recv: Box::new(ShmRecv::new(recv, self.shared.clone())),
            peer: None,
        })
    }

    fn info(&self) -> ConnectionInfo {
        ConnectionInfo { transport: self.transport, ..self.inner.info() }
    }

    fn close(&self, reason: &str) {
        self.inner.close(reason);
        self.reader.abort();
    }

    fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }

    async fn closed(&self) {
        self.inner.closed().await
    }
}

/// What [`ShmSend`] needs to know of a chunk header.
#[derive(Clone, Copy)]
struct ChunkFacts {
    tensor_id: u64,
    uncompressed: bool,
    /// The first chunk of a tensor that a segment should carry.
    starts_segment: bool,
    offset: u64,
    total_bytes: u64,
    last: bool,
    crc32c: Option<u32>,
}

/// A tensor being copied into a segment, chunk by chunk.
struct Filling {
    id: u64,
    seg: SegmentWriter,
    permit: OwnedSemaphorePermit,
    first: v1::Chunk,
    /// Headers of the chunks copied so far, to fall back to the socket.
    headers: Vec<FrameHeader>,
}

struct ShmSend {
    /// The mux stream itself, not boxed: calls into it make no boxed futures.
    inner: MuxSend,
    shared: Arc<Shared>,
    pending: Option<Filling>,
    /// Loans (segment id, loan) whose frames are being sent: if the send
    /// fails or is dropped before it returns, they did not leave.
    sending: Vec<(u64, u64)>,
    /// A copy into a segment announced to the peer ([`ring::Busy`]), by
    /// the time announced: cleared once its frame was sent (or the stream
    /// gave up).
    announced: Option<u64>,
}

/// Marks the loans of a send that did not return Ok as unsent (also when
/// its future is dropped); [`Sending::done`] forgets them once they left.
struct Sending<'a>(&'a mut ShmSend);

impl Sending<'_> {
    fn done(self, r: Result<(), StreamError>) -> Result<(), StreamError> {
        if r.is_ok() {
            self.0.sending.clear();
        }
        r
    }
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        if !self.0.sending.is_empty() {
            let loans = std::mem::take(&mut self.0.sending);
            self.0.shared.unsent(&loans);
        }
    }
}

impl ShmSend {
    /// Whether chunk `c` starts a tensor that goes into a segment: the
    /// first, uncompressed chunk of one large enough.
    fn starts_segment(&self, c: &v1::Chunk) -> bool {
        !self.shared.side.is_closed()
            && c.info.is_some()
            && c.compression == v1::Compression::None as i32
            && c.offset == 0
            && c.total_bytes >= self.shared.cfg.min_tensor_bytes.max(1)
            && c.total_bytes <= self.shared.cfg.max_segment_bytes
    }

    /// True when `frames` go to the socket as they are: no tensor is being
    /// copied into a segment and none of them starts one (a small call).
    fn passes_through(&self, frames: &[Frame]) -> bool {
        self.pending.is_none()
            && frames.iter().all(|f| match &f.header.kind {
                Some(Kind::Chunk(c)) => !self.starts_segment(c),
                _ => true,
            })
    }

    /// Turns a frame into zero or more frames to send on the socket.
    async fn convert(&mut self, frame: Frame) -> Result<Vec<Frame>, StreamError> {
        // The fields decided on (no clone of the header per frame).
        let chunk = match &frame.header.kind {
            Some(Kind::Chunk(c)) => Some(ChunkFacts {
                tensor_id: c.tensor_id,
                uncompressed: c.compression == v1::Compression::None as i32,
                starts_segment: self.starts_segment(c),
                offset: c.offset,
                total_bytes: c.total_bytes,
                last: c.last,
                crc32c: c.crc32c,
            }),
            _ => None,
        };
        let Some(c) = chunk else {
            // Control frames between tensors pass as they are.
            let mut out = self.fall_back()?;
            out.push(frame);
            return Ok(out);
        };
        if self.pending.is_none() {
            if !c.starts_segment {
                return Ok(vec![frame]);
            }
            // The wait for budget ends with the connection too: the peer
            // gives budget back only as it reads (or drops) what was lent.
            let mux = self.inner.shared.clone();
            let acquired = tokio::select! {
                a = self.shared.acquire(c.total_bytes) => a,
                _ = mux.wait_closed() => return Err(mux.error()),
            };
            let Some((id, seg, permit)) = acquired else { return Ok(vec![frame]) };
            // The peer's reader, waiting for this tensor, keeps spinning
            // through a short copy instead of sleeping through it.
            if let Some(b) = &self.shared.busy
                && let Some(until) = b.announce(c.total_bytes)
            {
                self.unannounce();
                self.announced = Some(until);
            }
            self.shared.filling.fetch_add(1, Ordering::AcqRel);
            let Some(Kind::Chunk(first)) = frame.header.kind.clone() else { return Ok(vec![frame]) };
            self.pending = Some(Filling { id, seg, permit, first, headers: Vec::new() });
        }
        let fits = match self.pending.as_mut() {
            Some(f) => {
                // A tensor too large to stay in the caches bypasses them.
                let stream = f.first.total_bytes >= STREAMED_DESTINATIONS_FROM as u64;
                c.tensor_id == f.first.tensor_id
                    && c.uncompressed
                    && f.seg.write(c.offset as usize, &frame.payload, stream)
            }
            None => false,
        };
        if !fits {
            // A compressed chunk (auto mode skips compression per chunk) or
            // another tensor: send what we hold through the socket.
            let mut out = self.fall_back()?;
            out.push(frame);
            return Ok(out);
        }
        if !c.last {
            if let Some(f) = self.pending.as_mut() {
                f.headers.push(frame.header);
            }
            return Ok(Vec::new());
        }
        let Some(f) = self.take_pending() else { return Ok(Vec::new()) };
        let total = f.first.total_bytes;
        let id = f.id;
        let loan = self.shared.next_loan.fetch_add(1, Ordering::Relaxed);
        let lent = Lent { seg: f.seg, permit: Some(f.permit), loan, unsent_since: None };
        lock(&self.shared.lent).insert(id, lent);
        self.sending.push((id, loan));
        let mut head = f.first;
        head.index = 0;
        head.offset = 0;
        head.last = true;
        head.raw_len = total;
        head.crc32c = c.crc32c;
        head.shm_segment = id;
        Ok(vec![Frame::header_only(FrameHeader::new(Kind::Chunk(head)))])
    }

    /// Withdraws the announcement of a copy (see [`Self::announced`]).
    fn unannounce(&mut self) {
        if let Some(until) = self.announced.take()
            && let Some(b) = &self.shared.busy
        {
            b.clear(until);
        }
    }

    fn take_pending(&mut self) -> Option<Filling> {
        let f = self.pending.take()?;
        self.shared.filling.fetch_sub(1, Ordering::AcqRel);
        Some(f)
    }

    /// The chunks held in a segment, as ordinary frames.
    fn fall_back(&mut self) -> Result<Vec<Frame>, StreamError> {
        let Some(f) = self.take_pending() else { return Ok(Vec::new()) };
        let mut out = Vec::with_capacity(f.headers.len());
        for header in f.headers {
            let Some(Kind::Chunk(c)) = &header.kind else { continue };
            let payload = f.seg.copy_out(c.offset as usize, c.raw_len as usize);
            out.push(Frame { header, payload });
        }
        self.shared.give_back(f.id, f.seg);
        Ok(out)
    }
}

#[async_trait]
impl SendStream for ShmSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        let g = Sending(self);
        let frames = g.0.convert(frame).await?;
        let r = match frames.len() {
            0 => Ok(()),
            1 => g.0.inner.send_inner(frames.into_iter().next().unwrap_or_default(), false).await,
            _ => g.0.inner.send_frames(frames, false).await,
        };
        if g.0.pending.is_none() {
            g.0.unannounce();
        }
        g.done(r)
    }

    async fn send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        if self.passes_through(&frames) {
            return self.inner.send_frames(frames, fin).await;
        }
        let g = Sending(self);
        let mut out = Vec::with_capacity(frames.len());
        for f in frames {
            // A tensor that needs a segment waits for budget: what is
            // converted so far leaves first (it may hold the budget wanted).
            let needs_segment =
                matches!(&f.header.kind, Some(Kind::Chunk(c)) if g.0.pending.is_none() && g.0.starts_segment(c));
            if needs_segment && out.iter().any(names_segment) {
                let r = g.0.inner.send_frames(std::mem::take(&mut out), false).await;
                if r.is_err() {
                    g.0.unannounce();
                    return g.done(r);
                }
                g.0.sending.clear();
            }
            out.extend(g.0.convert(f).await?);
        }
        if fin {
            out.extend(g.0.fall_back()?);
        }
        if out.is_empty() {
            let r = if fin { g.0.inner.finish_now() } else { Ok(()) };
            return g.done(r);
        }
        let r = g.0.inner.send_frames(out, fin).await;
        if g.0.pending.is_none() {
            g.0.unannounce();
        }
        g.done(r)
    }

    fn try_send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<Result<(), StreamError>, Vec<Frame>> {
        if self.passes_through(&frames) { self.inner.try_send_frames(frames, fin) } else { Err(frames) }
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        self.unannounce();
        let held = self.fall_back()?;
        if held.is_empty() { self.inner.finish_now() } else { self.inner.send_frames(held, true).await }
    }

    fn reset(&mut self, code: u32) {
        self.unannounce();
        if let Some(f) = self.take_pending() {
            self.shared.give_back(f.id, f.seg);
        }
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

impl Drop for ShmSend {
    fn drop(&mut self) {
        self.unannounce();
        // A stream dropped in the middle of a tensor: the segment stays ours.
        if let Some(f) = self.take_pending() {
            self.shared.give_back(f.id, f.seg);
        }
    }
}

/// Whether `f` names a segment (carries a tensor in one).
fn names_segment(f: &Frame) -> bool {
    matches!(&f.header.kind, Some(Kind::Chunk(c)) if c.shm_segment != 0)
}

/// What the mux connection under a shared-memory one does with a frame
/// dropped unread (its stream reset, its receiver gone): a frame naming a
/// segment reports that segment released, so the peer gets its budget and
/// segment back now instead of never.
fn discard_hook(side: &Arc<SideChannel>) -> DiscardHook {
    let side = Arc::downgrade(side);
    Box::new(move |h: &FrameHeader| {
        if let Some(Kind::Chunk(c)) = &h.kind
            && c.shm_segment != 0
            && let Some(side) = side.upgrade()
        {
            side.release(c.shm_segment);
        }
    })
}

/// The segment and byte count a chunk frame names (None: an ordinary chunk
/// whose bytes came with the frame), checked: a shared-memory frame carries
/// a whole uncompressed tensor and no payload of its own.
pub(crate) fn segment_claim(c: &v1::Chunk, payload_len: usize) -> Result<Option<(u64, u64)>, String> {
    if c.shm_segment == 0 {
        return Ok(None);
    }
    if payload_len != 0 || !c.last || c.offset != 0 || c.compression != v1::Compression::None as i32 {
        return Err("a shared-memory frame must carry a whole uncompressed tensor and no payload".into());
    }
    if c.raw_len != c.total_bytes {
        return Err(format!("a shared-memory frame declares {} bytes of a {}-byte tensor", c.raw_len, c.total_bytes));
    }
    Ok(Some((c.shm_segment, c.raw_len)))
}

struct ShmRecv {
    /// The mux stream itself, not boxed (as [`ShmSend`]'s).
    inner: MuxRecv,
    shared: Arc<Shared>,
    /// A frame `try_recv` took that names a segment: `recv` maps it.
    waiting: Option<Received>,
}

impl ShmRecv {
    fn new(inner: MuxRecv, shared: Arc<Shared>) -> Self {
        Self { inner, shared, waiting: None }
    }

    /// The segment `r` names, checked (None: its bytes came with it).
    fn claim(&self, r: &Received) -> Result<Option<(u64, u64)>, StreamError> {
        match &r.header.kind {
            Some(Kind::Chunk(c)) => segment_claim(c, r.payload.len()).map_err(|e| self.shared.protocol(e)),
            _ => Ok(None),
        }
    }
}

impl Drop for ShmRecv {
    fn drop(&mut self) {
        // A frame taken from the stream and not handed on: dropped unread,
        // its segment goes back to the peer (as the discard hook does).
        if let Some(r) = self.waiting.take()
            && let Some(Kind::Chunk(c)) = &r.header.kind
            && c.shm_segment != 0
        {
            self.shared.side.release(c.shm_segment);
        }
    }
}

#[async_trait]
impl RecvStream for ShmRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        let r = match self.waiting.take() {
            Some(r) => r,
            None => match self.inner.recv_next().await? {
                Some(r) => r,
                None => return Ok(None),
            },
        };
        let Some((id, len)) = self.claim(&r)? else { return Ok(Some(r)) };
        // Kept here while its segment is awaited: a receive dropped
        // meanwhile (a caller's timeout, a select) loses no frame; the
        // next one maps the segment again.
        self.waiting = Some(r);
        let view = self.shared.side.view(id, len, self.shared.cfg.segment_timeout).await;
        let mut r = self.waiting.take().expect("kept above");
        let view = view.map_err(|e| {
            // Not read: the segment goes back (if it did arrive).
            self.shared.side.release(id);
            self.shared.protocol(e)
        })?;
        r.payload = Payload::Bytes(view);
        Ok(Some(r))
    }

    fn try_recv(&mut self) -> Option<Result<Option<Received>, StreamError>> {
        if self.waiting.is_some() {
            return None;
        }
        let r = match self.inner.try_recv()? {
            Ok(Some(r)) => r,
            other => return Some(other),
        };
        match self.claim(&r) {
            Ok(None) => Some(Ok(Some(r))),
            // Mapping a segment may wait for its descriptor: `recv` does it.
            Ok(Some(_)) => {
                self.waiting = Some(r);
                None
            }
            Err(e) => Some(Err(e)),
        }
    }

    fn place(&mut self, target: Option<Placement>) {
        self.inner.place(target)
    }

    fn id(&self) -> u64 {
        self.inner.id()
    }
}

#[cfg(test)]
mod tests {
    use super::segment::recv_with_fd;
    use super::*;
    use std::time::Duration;

    async fn warmed(shared: &Shared) {
        // A bounded wait for the background thread (not a timing assertion).
        for _ in 0..2000 {
            if lock(&shared.warmed).is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no segment warmed within 20 s");
    }

    fn announced(peer: &OwnedFd) -> u64 {
        let mut buf = [0u8; 64];
        let (n, fd) = recv_with_fd(peer.as_raw_fd(), &mut buf, 0).unwrap();
        match SideMsg::decode(&buf[..n], fd.is_some()) {
            Ok(SideMsg::New(id)) => id,
            other => panic!("expected NEW with a descriptor, got {:?}", other.map(|_| ())),
        }
    }

    #[tokio::test]
    async fn misses_go_through_the_socket_and_a_repeated_one_warms_a_segment_for_the_next_tensor() {
        let (ours, theirs) = seqpacket_pair().unwrap();
        let side = Arc::new(SideChannel::new(ours, 1 << 40).unwrap());
        let shared = Shared::new(side, &ShmConfig::default(), "test".into());
        let n = 3 << 20;
        assert!(shared.acquire(n).await.is_none(), "the first tensor goes through the socket");
        assert!(!shared.warming.load(Ordering::Acquire) && lock(&shared.warmed).is_none(), "a one-shot warms nothing");
        assert!(shared.acquire(n).await.is_none(), "so does the second");
        warmed(&shared).await;
        let (id, seg, permit) = shared.acquire(n).await.expect("the warmed segment");
        assert!(seg.len() as u64 >= n);
        assert_eq!(announced(&theirs), id, "passed to the peer before use");
        drop(permit);
        shared.give_back(id, seg);
        let (again, _, _) = shared.acquire(n).await.expect("the pooled segment");
        assert_eq!(again, id);

        // A warmed segment that does not fit the next tensor goes to the
        // pool (announced) and another is warmed for the new size.
        assert!(shared.acquire(64 << 20).await.is_none());
        assert!(shared.acquire(64 << 20).await.is_none());
        warmed(&shared).await;
        assert!(shared.acquire(1 << 20).await.is_none());
        let big = announced(&theirs);
        assert!(lock(&shared.pool).iter().any(|(id, s)| *id == big && s.len() == 64 << 20));
    }

    #[tokio::test]
    async fn a_tensor_too_large_to_pool_goes_through_the_rings_every_time() {
        let (ours, theirs) = seqpacket_pair().unwrap();
        let cfg = ShmConfig { max_in_flight: 2 << 20, ..ShmConfig::default() };
        let side = Arc::new(SideChannel::new(ours, 1 << 40).unwrap());
        let shared = Shared::new(side, &cfg, "test".into());
        // Repeated, as steady traffic of one large size would be: never a
        // segment (each would be fresh memory beside the sender's tensor),
        // never one warmed, and no budget held while deciding.
        for _ in 0..3 {
            assert!(shared.acquire(5 << 20).await.is_none());
        }
        assert!(!shared.warming.load(Ordering::Acquire) && lock(&shared.warmed).is_none());
        assert_eq!(shared.budget.available_permits(), shared.budget_units as usize);
        let mut buf = [0u8; 64];
        let nothing = recv_with_fd(theirs.as_raw_fd(), &mut buf, libc::MSG_DONTWAIT);
        assert!(nothing.is_err(), "no segment may be announced to the peer");
        // A poolable size still gets segments once it repeats.
        assert!(shared.acquire(1 << 20).await.is_none());
        assert!(shared.acquire(1 << 20).await.is_none());
        warmed(&shared).await;
        let (id, seg, _permit) = shared.acquire(1 << 20).await.expect("the warmed segment");
        assert!(seg.len() >= 1 << 20);
        assert_eq!(announced(&theirs), id);
    }
}
