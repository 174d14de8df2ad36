//! Shared-memory rings that carry the mux's byte stream between two
//! processes on one host, in place of the Unix socket: a small call costs
//! two memory copies and, while traffic flows, no system call at all.
//!
//! ```text
//!   memfd (client-made, size sealed, mapped by both):
//!   [ ring 0: client → server ][ ring 1: server → client ]
//!   each ring: head, busy until (producer) | tail (consumer) | consumer waiting | producer waiting, closed | data (2^k bytes)
//! ```
//!
//! - **Sans-IO core.** [`Producer`] and [`Consumer`] hold the index
//!   arithmetic and the checks; the async halves ([`RingReader`],
//!   [`RingWriter`]) only decide when to wait. The fuzz entry drives the
//!   same core with a hostile peer scribbling over the shared words.
//! - **Untrusted indices.** Each side keeps its own position privately
//!   and only reads the peer's: a peer position that claims more bytes
//!   than the ring holds is a [`Corrupt`] error; every copy is masked into
//!   the data area, so a hostile peer cannot make this side read or write
//!   outside the mapping (it can only garble its own stream, which the
//!   mux's frame decoder then rejects).
//! - **Waking.** A side that finds nothing to do first spins (see
//!   [`crate::spin`]) for [`TransportConfig::spin`] after the
//!   connection's last activity, then sets its "waiting" word and sleeps
//!   on a doorbell (a Unix datagram socket pair) that the other side rings
//!   only when it sees that word (a store, a full fence, a load on each
//!   side: no lost wake-ups). A sender about to copy a tensor into a
//!   shared segment (nothing on the ring meanwhile) announces until when
//!   it will be busy ([`Busy`]), and the peer's reader spins until then
//!   instead of sleeping through a copy of a MiB or so and paying a wake-up
//!   when its frame comes. An idle connection costs nothing; a busy one
//!   rings no doorbells (the runtime's non-blocking I/O check between
//!   spins is its only system call). Each side owns its ends' file
//!   descriptions and never blocks on them (see `doorbell`).
//! - **Liveness.** The Unix socket stays open beside the rings and carries
//!   nothing: its end of stream tells a reader that the peer closed or
//!   died, and its hang-up tells a writer waiting for room that nobody
//!   will make any.
//!
//! [`TransportConfig::spin`]: crate::TransportConfig::spin

use std::cell::Cell;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::segment::{cvt, unix_pair};
use crate::spin::{Activity, Spin, spin_again};

/// Producer position (bytes ever written), written by the producer only.
const HEAD: usize = 0;
/// Until when (CLOCK_MONOTONIC nanoseconds; 0: no such time) the producer
/// expects to publish again soon, written by the producer only (see [`Busy`]).
const BUSY_UNTIL: usize = 8;
/// Consumer position (bytes ever read), written by the consumer only.
const TAIL: usize = 64;
/// Non-zero while the consumer sleeps or is about to (cleared by the producer that wakes it).
const CONSUMER_WAITING: usize = 128;
/// Non-zero while the producer waits for room (cleared by the consumer that wakes it).
const PRODUCER_WAITING: usize = 192;
/// Non-zero once the producer has closed its direction.
const CLOSED: usize = 196;
/// Start of the data area, after the control words (one cache line each).
const DATA: usize = 256;

/// The longest a [`Busy`] announcement keeps the peer's reader spinning.
pub(crate) const MAX_BUSY: Duration = Duration::from_millis(2);

/// What a [`Busy`] announcement assumes a copy of a tensor into a segment
/// takes, per byte: slower than any copy measured (6 GiB/s and up, warm),
/// so that the peer spins until the frame comes.
const BUSY_COPY_BYTES_PER_SEC: u64 = 4 << 30;

/// Slack on top of the estimated copy ([`Busy::announce`]).
const BUSY_SLACK: Duration = Duration::from_micros(100);

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every process of a
/// host (outside time namespaces, where [`MAX_BUSY`] bounds the damage).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// A producer's announcement that bytes follow soon, for the peer's
/// reader to keep spinning instead of sleeping: a sender copying a tensor
/// into a shared segment writes nothing on the ring until the copy is done
/// (about 60 to 170 µs for a MiB on the VMs measured), longer than the
/// reader spins after its last read, and a reader that sleeps costs a
/// thread wake-up (tens of microseconds on a VM) when the frame naming the
/// segment comes.
///
/// One word per direction, shared by the connection's streams: each
/// announcement raises it (`fetch_max`) and each stream clears only its own
/// (compare-and-swap), so one stream's end does not cut another's short.
/// Misses (a frame queued but not yet on the ring when cleared) cost a
/// wake-up, as before; the reader never spins for it more than
/// [`MAX_BUSY`] without reading (see `RingReader`), whatever the peer writes.
pub(crate) struct Busy(Ring);

impl Busy {
    /// A copy of `bytes` starts: the peer's reader spins until it should be
    /// done (estimated at [`BUSY_COPY_BYTES_PER_SEC`], plus [`BUSY_SLACK`]).
    /// Returns the time announced, for [`Self::clear`]; None (nothing
    /// announced) when that is more than [`MAX_BUSY`] away: a long copy
    /// pays one wake-up at its end and no spinning meanwhile.
    pub(crate) fn announce(&self, bytes: u64) -> Option<u64> {
        let copy_ns = bytes.saturating_mul(1_000_000_000) / BUSY_COPY_BYTES_PER_SEC;
        let ns = copy_ns.saturating_add(BUSY_SLACK.as_nanos() as u64);
        if ns > MAX_BUSY.as_nanos() as u64 {
            return None;
        }
        let until = monotonic_ns().saturating_add(ns);
        self.0.word(BUSY_UNTIL).fetch_max(until, Ordering::Relaxed);
        Some(until)
    }

    /// The bytes announced with `until` were published: nothing more to
    /// spin for, unless another announcement has raised the word since.
    pub(crate) fn clear(&self, until: u64) {
        let _ = self.0.word(BUSY_UNTIL).compare_exchange(until, 0, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// Smallest data area of one direction.
pub(crate) const MIN_RING: usize = 4 << 10;
/// Largest data area of one direction a peer may offer.
pub(crate) const MAX_RING: usize = 16 << 20;

/// The peer wrote ring positions that no correct peer writes.
#[derive(Debug, thiserror::Error)]
#[error("the peer corrupted the shared-memory ring: {0}")]
pub struct Corrupt(&'static str);

impl From<Corrupt> for io::Error {
    fn from(c: Corrupt) -> Self {
        io::Error::new(io::ErrorKind::InvalidData, c)
    }
}

/// The shared mapping of both rings.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    cap: usize,
}

// SAFETY: the mapping lives as long as this value; everything shared in it
// is accessed through atomics or copied with bounds masked to the mapping.
unsafe impl Send for Region {}
// SAFETY: see Send.
unsafe impl Sync for Region {}

impl Region {
    /// Bytes of a region whose rings hold `cap` data bytes each.
    fn size(cap: usize) -> usize {
        2 * (DATA + cap)
    }

    /// A new region (a sealed memfd) with `cap` data bytes per direction,
    /// rounded to a power of two within [`MIN_RING`]..=[`MAX_RING`]; returns
    /// it and the descriptor to pass to the peer.
    pub fn create(cap: usize) -> io::Result<(Arc<Self>, OwnedFd)> {
        let cap = cap.clamp(MIN_RING, MAX_RING).next_power_of_two();
        let len = Self::size(cap);
        let fd = super::segment::sealed_memfd(c"tensorwire-ring", len)?;
        let region = Self::map(&fd, len, cap)?;
        Ok((Arc::new(region), fd))
    }

    /// Maps a region the peer made, after checking that its size is sealed
    /// and describes two rings of an allowed power-of-two size.
    pub fn map_peer(fd: &OwnedFd) -> Result<Arc<Self>, String> {
        let size = super::segment::sealed_size(fd, "ring")?;
        let cap = (size / 2).saturating_sub(DATA as u64);
        let ok = size % 2 == 0
            && cap.is_power_of_two()
            && (MIN_RING as u64..=MAX_RING as u64).contains(&cap)
            && size == Self::size(cap as usize) as u64;
        if !ok {
            return Err(format!(
                "a ring region of {size} bytes is not two rings of a power of two between {MIN_RING} and {MAX_RING} bytes"
            ));
        }
        Self::map(fd, size as usize, cap as usize).map(Arc::new).map_err(|e| format!("mmap of the ring failed: {e}"))
    }

    fn map(fd: &OwnedFd, len: usize, cap: usize) -> io::Result<Self> {
        // SAFETY: mapping exactly the sealed size of the file, shared.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { ptr: ptr as *mut u8, len, cap })
    }

    /// Ring `i` (0: client → server, 1: server → client).
    fn ring(self: &Arc<Self>, i: usize) -> Ring {
        debug_assert!(i < 2);
        Ring { region: self.clone(), base: i * (DATA + self.cap) }
    }

    /// The producer side of ring `i`.
    pub fn producer(self: &Arc<Self>, i: usize) -> Producer {
        let ring = self.ring(i);
        let head = ring.word(HEAD).load(Ordering::Acquire);
        Producer { ring, head: Cell::new(head) }
    }

    /// The consumer side of ring `i`.
    pub fn consumer(self: &Arc<Self>, i: usize) -> Consumer {
        let ring = self.ring(i);
        let tail = ring.word(TAIL).load(Ordering::Acquire);
        Consumer { ring, tail: Cell::new(tail) }
    }

    /// Overwrites a 64-bit control word of ring `i` as a hostile peer
    /// could (`which`: 0 head, 1 tail, 2 the flags, 3 the busy time).
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn scribble(self: &Arc<Self>, i: usize, which: u8, value: u64) {
        let ring = self.ring(i);
        let off = match which % 4 {
            0 => HEAD,
            1 => TAIL,
            2 => PRODUCER_WAITING,
            _ => BUSY_UNTIL,
        };
        ring.word(off).store(value, Ordering::SeqCst);
        ring.flag(CONSUMER_WAITING).store(value as u32, Ordering::SeqCst);
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: ptr/len is the mapping made in map(), unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// One direction of a region.
struct Ring {
    region: Arc<Region>,
    base: usize,
}

impl Ring {
    fn word(&self, off: usize) -> &AtomicU64 {
        // SAFETY: base + off is inside the mapping (control words precede
        // DATA) and 8-aligned (the mapping is page-aligned; base is a
        // multiple of 64); the mapping outlives &self.
        unsafe { &*(self.region.ptr.add(self.base + off) as *const AtomicU64) }
    }

    fn flag(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as in word(); 4-aligned.
        unsafe { &*(self.region.ptr.add(self.base + off) as *const AtomicU32) }
    }

    fn cap(&self) -> usize {
        self.region.cap
    }

    /// Pointer to data byte `off` (`off < cap`).
    fn data(&self, off: usize) -> *mut u8 {
        debug_assert!(off < self.cap());
        // SAFETY: off < cap, so the byte is inside this ring's data area.
        unsafe { self.region.ptr.add(self.base + DATA + off) }
    }
}

/// The writing side of one ring (sans-IO): copies bytes in and publishes them.
pub struct Producer {
    ring: Ring,
    /// Our position; the shared head is only ever written from it.
    head: Cell<u64>,
}

impl Producer {
    /// Free bytes in the ring, checking the consumer's position.
    fn free(&self) -> Result<usize, Corrupt> {
        let tail = self.ring.word(TAIL).load(Ordering::Acquire);
        let used = self.head.get().wrapping_sub(tail);
        if used > self.ring.cap() as u64 {
            return Err(Corrupt("the consumer's position is ahead of what was written"));
        }
        Ok(self.ring.cap() - used as usize)
    }

    /// Copies as much of `bufs` as fits and publishes it; returns how many
    /// bytes (0 when the ring is full).
    pub fn write(&self, bufs: &[IoSlice<'_>]) -> Result<usize, Corrupt> {
        let mut free = self.free()?;
        let cap = self.ring.cap();
        let mut pos = self.head.get();
        let start = pos;
        for b in bufs {
            if free == 0 {
                break;
            }
            let k = b.len().min(free);
            let off = (pos as usize) & (cap - 1);
            let first = k.min(cap - off);
            // SAFETY: both ranges lie inside the data area (off + first <= cap,
            // k - first <= cap) and do not overlap the source slice, which is
            // this process's memory.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), self.ring.data(off), first);
                if k > first {
                    std::ptr::copy_nonoverlapping(b.as_ptr().add(first), self.ring.data(0), k - first);
                }
            }
            pos = pos.wrapping_add(k as u64);
            free -= k;
        }
        if pos != start {
            self.head.set(pos);
            self.ring.word(HEAD).store(pos, Ordering::Release);
        }
        Ok(pos.wrapping_sub(start) as usize)
    }

    /// After publishing: whether the consumer sleeps (or is about to) and
    /// must be woken; clears its waiting word.
    pub fn consumer_asleep(&self) -> bool {
        fence(Ordering::SeqCst);
        let w = self.ring.flag(CONSUMER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::SeqCst) != 0
    }

    /// Announces that this side waits for room. True: there is room
    /// already (the announcement is withdrawn; write again).
    pub fn arm(&self) -> Result<bool, Corrupt> {
        let w = self.ring.flag(PRODUCER_WAITING);
        w.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let room = self.free()? > 0;
        if room {
            w.store(0, Ordering::Relaxed);
        }
        Ok(room)
    }

    /// Marks this direction closed (after the last byte).
    pub fn close(&self) {
        self.ring.flag(CLOSED).store(1, Ordering::Release);
    }
}

/// The reading side of one ring (sans-IO): copies published bytes out.
pub struct Consumer {
    ring: Ring,
    /// Our position; the shared tail is only ever written from it.
    tail: Cell<u64>,
}

impl Consumer {
    /// Published bytes not yet read, checking the producer's position.
    pub fn available(&self) -> Result<usize, Corrupt> {
        let head = self.ring.word(HEAD).load(Ordering::Acquire);
        let n = head.wrapping_sub(self.tail.get());
        if n > self.ring.cap() as u64 {
            return Err(Corrupt("the producer claims more bytes than the ring holds"));
        }
        Ok(n as usize)
    }

    /// Copies up to `dst.len()` published bytes into `dst` and frees their
    /// room; returns how many (0: nothing published).
    pub fn read(&self, dst: &mut [MaybeUninit<u8>]) -> Result<usize, Corrupt> {
        let n = self.available()?.min(dst.len());
        if n == 0 {
            return Ok(0);
        }
        let cap = self.ring.cap();
        let pos = self.tail.get();
        let off = (pos as usize) & (cap - 1);
        let first = n.min(cap - off);
        // SAFETY: the sources lie inside the data area (off + first <= cap,
        // n - first <= cap); dst holds at least n bytes and is this
        // process's memory, so the ranges do not overlap.
        unsafe {
            let out = dst.as_mut_ptr() as *mut u8;
            std::ptr::copy_nonoverlapping(self.ring.data(off), out, first);
            if n > first {
                std::ptr::copy_nonoverlapping(self.ring.data(0), out.add(first), n - first);
            }
        }
        // Positions wrap (the peer chose where they start).
        let end = pos.wrapping_add(n as u64);
        self.tail.set(end);
        self.ring.word(TAIL).store(end, Ordering::Release);
        Ok(n)
    }

    /// After freeing room: whether the producer waits for it and must be
    /// woken; clears its waiting word.
    pub fn producer_asleep(&self) -> bool {
        fence(Ordering::SeqCst);
        let w = self.ring.flag(PRODUCER_WAITING);
        w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::SeqCst) != 0
    }

    /// Announces that this side is going to sleep. True: bytes (or the
    /// close) arrived meanwhile (the announcement is withdrawn; read again).
    pub fn arm(&self) -> Result<bool, Corrupt> {
        let w = self.ring.flag(CONSUMER_WAITING);
        w.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let ready = self.available()? > 0 || self.closed();
        if ready {
            w.store(0, Ordering::Relaxed);
        }
        Ok(ready)
    }

    /// Whether the producer announced that it publishes again soon (see
    /// [`Busy`]): until the time it gave, and only if that is at most
    /// [`MAX_BUSY`] away (a stale or hostile word keeps nobody spinning).
    /// (The reader asks [`Self::peer_busy_at`] with the time it read.)
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn peer_busy(&self) -> bool {
        self.peer_busy_at(monotonic_ns())
    }

    /// [`Self::peer_busy`] at `now` (CLOCK_MONOTONIC nanoseconds).
    fn peer_busy_at(&self, now: u64) -> bool {
        let until = self.ring.word(BUSY_UNTIL).load(Ordering::Relaxed);
        until > now && until - now <= MAX_BUSY.as_nanos() as u64
    }

    /// Whether the producer has closed this direction.
    pub fn closed(&self) -> bool {
        self.ring.flag(CLOSED).load(Ordering::Acquire) != 0
    }
}

/// A doorbell: a connected pair of Unix datagram sockets, `(sleeper,
/// ringer)`. The sleeping side waits for its end to become readable and
/// drains it; the other side sends one byte to wake it. Unlike an eventfd,
/// whose single file description both processes would share (a peer could
/// clear `O_NONBLOCK` on it and fill its counter, so that a wake-up blocks
/// this side's thread), each end here is its own description, and every
/// send and receive passes `MSG_DONTWAIT`: nothing the peer does with its
/// end, or with a duplicate of ours, can make either call block.
fn doorbell() -> io::Result<(OwnedFd, OwnedFd)> {
    unix_pair(libc::SOCK_DGRAM)
}

/// Rings the doorbell whose ringing end is `fd`. Errors are ignored: a
/// full socket means the sleeper has wake-ups it has not read yet, and any
/// other error is a peer that is gone (the liveness socket tells).
fn signal(fd: &OwnedFd) {
    let one = 1u8;
    // SAFETY: sends one byte from a live u8 on our descriptor.
    unsafe {
        libc::send(fd.as_raw_fd(), &one as *const u8 as *const libc::c_void, 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
    };
}

/// Wake-ups one poll drains from a doorbell at most before it yields (a
/// peer ringing without pause must not keep this task from returning).
const DRAIN_MAX: usize = 64;

/// Reads the wake-ups waiting on a doorbell's sleeping end; true when it is
/// empty now (its readiness may be cleared).
fn drain(fd: &OwnedFd) -> bool {
    let mut buf = [0u8; 16];
    for _ in 0..DRAIN_MAX {
        // SAFETY: receives into a live buffer on our descriptor.
        let n =
            unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            // EAGAIN: empty. Any other error will not go away by reading.
            return true;
        }
    }
    false
}

/// Whether a descriptor the peer passed is a Unix datagram socket (a
/// doorbell's end).
fn is_doorbell(fd: &OwnedFd) -> bool {
    let get = |opt| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into a live int of the right length.
        let r = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &mut v as *mut libc::c_int as *mut libc::c_void,
                &mut len,
            )
        };
        (r == 0).then_some(v)
    };
    get(libc::SO_DOMAIN) == Some(libc::AF_UNIX) && get(libc::SO_TYPE) == Some(libc::SOCK_DGRAM)
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = cvt(libc::fcntl(fd, libc::F_GETFL))?;
        cvt(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK))?;
    }
    Ok(())
}

/// The doorbells of a connection's rings, in this order: client → server
/// data and room, server → client data and room. Each side holds one end
/// of each: the sleeping end of those it waits on, the ringing end of the
/// others.
pub(crate) const EVENTFDS: usize = 4;

/// What a client makes to offer rings: the region, its descriptor and the
/// doorbells' ends for the server.
pub(crate) struct RingOffer {
    region: Arc<Region>,
    /// The region's descriptor (closed once passed: both sides keep only the mapping).
    pub(crate) memfd: OwnedFd,
    /// The server's ends, passed with the offer (see [`EVENTFDS`]).
    pub(crate) events: [OwnedFd; EVENTFDS],
    /// The client's ends.
    mine: [OwnedFd; EVENTFDS],
}

impl RingOffer {
    /// A new region of `cap` bytes per direction and its doorbells.
    pub(crate) fn new(cap: usize) -> io::Result<Self> {
        let (region, memfd) = Region::create(cap)?;
        // (sleeper, ringer) of each; the server sleeps on c2s data and s2c room.
        let (c2s_data, c2s_room, s2c_data, s2c_room) = (doorbell()?, doorbell()?, doorbell()?, doorbell()?);
        Ok(Self {
            region,
            memfd,
            events: [c2s_data.0, c2s_room.1, s2c_data.1, s2c_room.0],
            mine: [c2s_data.1, c2s_room.0, s2c_data.0, s2c_room.1],
        })
    }
}

/// Which end of the rings a process holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    /// Writes ring 0, reads ring 1.
    Client,
    /// Writes ring 1, reads ring 0.
    Server,
}

/// The two halves of a ring connection, over `sock` (kept open for
/// liveness only) with `spin` as [`TransportConfig::spin`](crate::TransportConfig::spin).
pub(crate) fn halves(
    end: End,
    region: Arc<Region>,
    events: [OwnedFd; EVENTFDS],
    sock: OwnedFd,
    spin: Duration,
) -> io::Result<(RingReader, RingWriter)> {
    let [c2s_data, c2s_room, s2c_data, s2c_room] = events;
    let (write_ring, read_ring, my_data, my_room, peer_data, peer_room) = match end {
        End::Client => (0, 1, s2c_data, c2s_room, c2s_data, s2c_room),
        End::Server => (1, 0, c2s_data, s2c_room, s2c_data, c2s_room),
    };
    let activity = Arc::new(Activity::new(spin));
    let sock2 = sock.try_clone()?;
    let register_as = |fd: OwnedFd, interest| -> io::Result<AsyncFd<OwnedFd>> {
        // SAFETY: an OwnedFd's descriptor stays open and the same until it
        // is dropped, which only happens with the AsyncFd.
        unsafe { AsyncFd::register_with_interest(fd, interest) }.map_err(io::Error::from)
    };
    let register = |fd: OwnedFd| register_as(fd, tokio::io::Interest::READABLE);
    let reader = RingReader {
        rx: region.consumer(read_ring),
        activity: activity.clone(),
        spin: Spin::new(),
        data: register(my_data)?,
        wake_room: peer_room,
        sock: register(sock)?,
        peer_closed: false,
        ended: false,
        busy_since: None,
    };
    let writer = RingWriter {
        tx: region.producer(write_ring),
        activity,
        spin: Spin::new(),
        room: register(my_room)?,
        wake_data: peer_data,
        // Writable interest: a peer's hang-up marks it closed for good, while
        // a half-close (which tokio keeps as read-closed) is one wake-up.
        sock: register_as(sock2, tokio::io::Interest::WRITABLE)?,
        gone: Cell::new(false),
    };
    Ok((reader, writer))
}

/// Server side: checks and maps what a client offered.
pub(crate) fn accept(
    memfd: OwnedFd,
    events: [OwnedFd; EVENTFDS],
) -> Result<(Arc<Region>, [OwnedFd; EVENTFDS]), String> {
    let region = Region::map_peer(&memfd)?;
    for e in &events {
        if !is_doorbell(e) {
            return Err("a ring wake-up descriptor is not a Unix datagram socket (a peer of another version?)".into());
        }
        set_nonblocking(e.as_raw_fd()).map_err(|e| format!("fcntl: {e}"))?;
    }
    Ok((region, events))
}

/// Client side: the region and doorbell ends to build halves from, once offered.
pub(crate) fn offered(offer: RingOffer) -> (Arc<Region>, [OwnedFd; EVENTFDS]) {
    (offer.region, offer.mine)
}

/// The reading half: the mux reader's byte stream.
pub struct RingReader {
    rx: Consumer,
    activity: Arc<Activity>,
    spin: Spin,
    /// Written by the peer when it published bytes we sleep for.
    data: AsyncFd<OwnedFd>,
    /// Wakes the peer's writer when it waits for room.
    wake_room: OwnedFd,
    /// The connection's socket: its end of stream means the peer is gone.
    sock: AsyncFd<OwnedFd>,
    /// The peer closed its socket (or died): what the ring holds is all.
    peer_closed: bool,
    /// End of stream was returned.
    ended: bool,
    /// When (CLOCK_MONOTONIC ns) this reader began spinning for a busy
    /// peer without reading since (None: it has read since).
    busy_since: Option<u64>,
}

/// Peeks at the socket: Ok(true) when the peer closed it.
fn peer_closed(fd: &OwnedFd) -> io::Result<bool> {
    let mut b = [0u8; 1];
    // SAFETY: recv with MSG_PEEK into a 1-byte buffer on our socket.
    let n = unsafe {
        libc::recv(fd.as_raw_fd(), b.as_mut_ptr() as *mut libc::c_void, 1, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    match n {
        0 => Ok(true),
        n if n > 0 => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer wrote to the socket of a shared-memory ring connection",
        )),
        _ => {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::ConnectionReset => Ok(true),
                _ => Err(e),
            }
        }
    }
}

impl RingReader {
    /// Whether to keep spinning for a peer that announced it is busy
    /// ([`Busy`]): spinning is on, the announcement holds, and this reader
    /// has not spun for such announcements more than [`MAX_BUSY`] since it
    /// last read (a peer that keeps announcing and sends nothing is slept on).
    fn spin_for_busy_peer(&mut self) -> bool {
        if !self.activity.spins() {
            return false;
        }
        let now = monotonic_ns();
        if !self.rx.peer_busy_at(now) {
            return false;
        }
        let since = *self.busy_since.get_or_insert(now);
        now.saturating_sub(since) <= MAX_BUSY.as_nanos() as u64
    }
}

impl AsyncRead for RingReader {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.ended || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            // SAFETY: read() writes only initialized bytes into the first n
            // and reports n; those are then marked initialized and filled.
            let n = this.rx.read(unsafe { buf.unfilled_mut() })?;
            if n > 0 {
                // SAFETY: read() initialized the first n unfilled bytes.
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                this.busy_since = None;
                this.activity.read();
                if this.rx.producer_asleep() {
                    signal(&this.wake_room);
                }
                return Poll::Ready(Ok(()));
            }
            if this.peer_closed || this.rx.closed() {
                // The close comes after the last byte: read once more.
                if this.rx.available()? == 0 {
                    this.ended = true;
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            if this.spin.reading(&this.activity) || this.spin_for_busy_peer() {
                return spin_again(cx);
            }
            if this.rx.arm()? {
                continue;
            }
            // Going to sleep: this side's next write wakes us to spin for
            // its answer.
            this.activity.sleep(cx.waker());
            match this.data.poll_read_ready(cx) {
                Poll::Ready(Ok(mut g)) => {
                    if drain(g.get_ref().get_ref()) {
                        g.clear_ready();
                    } else {
                        // A peer ringing without pause: let other tasks run.
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    continue;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
            match this.sock.poll_read_ready(cx) {
                Poll::Ready(Ok(mut g)) => {
                    if let Ok(closed) = g.try_io(|fd| match peer_closed(fd.get_ref()) {
                        Ok(false) => Err(io::ErrorKind::WouldBlock.into()),
                        other => other,
                    }) {
                        this.peer_closed = closed?;
                    }
                    continue;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The writing half: the mux writer's byte stream (and its direct path).
pub struct RingWriter {
    tx: Producer,
    activity: Arc<Activity>,
    spin: Spin,
    /// Written by the peer when it freed room we wait for.
    room: AsyncFd<OwnedFd>,
    /// Wakes the peer's reader when it sleeps.
    wake_data: OwnedFd,
    /// The connection's socket (a second descriptor): its hang-up means
    /// the peer is gone and will free no room.
    sock: AsyncFd<OwnedFd>,
    gone: Cell<bool>,
}

fn hung_up(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
    // SAFETY: poll on one valid pollfd with a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

impl RingWriter {
    /// This writer's [`Busy`] announcements.
    pub(crate) fn busy(&self) -> Busy {
        Busy(Ring { region: self.tx.ring.region.clone(), base: self.tx.ring.base })
    }

    /// Writes what fits now; `WouldBlock` when the ring is full.
    fn write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.gone.get() {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "the peer closed the shared-memory ring"));
        }
        if bufs.iter().all(|b| b.is_empty()) {
            return Ok(0);
        }
        let n = self.tx.write(bufs)?;
        if n == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.activity.wrote();
        if self.tx.consumer_asleep() {
            signal(&self.wake_data);
        }
        Ok(n)
    }
}

impl AsyncWrite for RingWriter {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        loop {
            match this.write_now(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                r => return Poll::Ready(r),
            }
            if this.spin.spinning(&this.activity) {
                return spin_again(cx);
            }
            if this.tx.arm()? {
                continue;
            }
            match this.room.poll_read_ready(cx) {
                Poll::Ready(Ok(mut g)) => {
                    if drain(g.get_ref().get_ref()) {
                        g.clear_ready();
                    } else {
                        // A peer ringing without pause: let other tasks run.
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    continue;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
            match this.sock.poll_write_ready(cx) {
                Poll::Ready(Ok(mut g)) => {
                    if hung_up(g.get_ref().get_ref()) {
                        this.gone.set(true);
                    } else {
                        // The socket is writable (it always is: nothing is
                        // written to it): wait for its next change.
                        g.clear_ready();
                    }
                    continue;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.tx.close();
        if self.tx.consumer_asleep() {
            signal(&self.wake_data);
        }
        // The peer's reader also learns it from the socket's end of stream.
        // SAFETY: shutdown on our socket descriptor.
        unsafe { libc::shutdown(self.sock.get_ref().as_raw_fd(), libc::SHUT_WR) };
        Poll::Ready(Ok(()))
    }
}

impl crate::mux::MuxWrite for RingWriter {
    fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.write_now(bufs)
    }

    fn syscall_free(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;
    use std::task::Waker;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    fn read_all(c: &Consumer, n: usize) -> Vec<u8> {
        let mut out = vec![MaybeUninit::new(0u8); n];
        let got = c.read(&mut out).unwrap();
        // SAFETY: MaybeUninit<u8> initialized above; same layout as u8.
        out[..got].iter().map(|b| unsafe { b.assume_init() }).collect()
    }

    #[test]
    fn bytes_cross_in_order_across_the_wrap() {
        let (region, _fd) = Region::create(MIN_RING).unwrap();
        let (p, c) = (region.producer(0), region.consumer(0));
        let data = pattern(5 * MIN_RING + 123, 7);
        let (mut sent, mut got) = (0, Vec::new());
        let mut step = 1usize;
        while got.len() < data.len() {
            // Uneven write and read sizes, split across two slices, so copies wrap.
            let end = (sent + step * 97).min(data.len());
            let mid = sent + (end - sent) / 3;
            sent += p.write(&[IoSlice::new(&data[sent..mid]), IoSlice::new(&data[mid..end])]).unwrap();
            got.extend(read_all(&c, step * 61));
            step = step % 50 + 1;
        }
        assert_eq!(got, data);
        // A full ring takes nothing more until the consumer reads.
        assert_eq!(p.write(&[IoSlice::new(&vec![1; 2 * MIN_RING])]).unwrap(), MIN_RING);
        assert_eq!(p.write(&[IoSlice::new(&[1])]).unwrap(), 0);
        assert_eq!(read_all(&c, 10).len(), 10);
        assert_eq!(p.write(&[IoSlice::new(&[1; 20])]).unwrap(), 10);
    }

    #[test]
    fn a_sleeping_side_is_woken_exactly_when_it_announced_it() {
        let (region, _fd) = Region::create(MIN_RING).unwrap();
        let (p, c) = (region.producer(1), region.consumer(1));
        assert!(!p.consumer_asleep(), "nobody waits yet");
        assert!(!c.arm().unwrap(), "nothing to read: the consumer may sleep");
        p.write(&[IoSlice::new(b"hello")]).unwrap();
        assert!(p.consumer_asleep(), "the consumer announced its sleep");
        assert!(!p.consumer_asleep(), "one wake-up per announcement");
        assert!(c.arm().unwrap(), "bytes arrived: arming withdraws");
        assert_eq!(read_all(&c, 64), b"hello");
        // Room: the producer fills the ring, arms, and is woken by a read.
        p.write(&[IoSlice::new(&vec![0; MIN_RING])]).unwrap();
        assert!(!p.arm().unwrap());
        assert_eq!(read_all(&c, 1).len(), 1);
        assert!(c.producer_asleep());
        assert!(!c.producer_asleep());
        assert!(!c.closed());
        p.close();
        assert!(c.closed());
    }

    #[test]
    fn positions_a_hostile_peer_writes_are_errors_not_wild_copies() {
        for (which, value) in [(0u8, (MIN_RING + 1) as u64), (0, u64::MAX), (1, 5), (1, u64::MAX - 2 * MIN_RING as u64)]
        {
            let (region, _fd) = Region::create(MIN_RING).unwrap();
            let (p, c) = (region.producer(0), region.consumer(0));
            region.scribble(0, which, value);
            if which == 0 {
                let mut out = vec![MaybeUninit::new(0u8); 16];
                assert!(c.read(&mut out).is_err(), "head {value} must be refused");
            } else {
                assert!(p.write(&[IoSlice::new(b"x")]).is_err(), "tail {value} must be refused");
            }
        }
        // Positions a peer starts near the end of u64 wrap like any other.
        let (region, _fd) = Region::create(MIN_RING).unwrap();
        region.scribble(0, 0, u64::MAX - 10);
        region.scribble(0, 1, u64::MAX - 10);
        let (p, c) = (region.producer(0), region.consumer(0));
        let data = pattern(3 * MIN_RING, 1);
        let mut got = Vec::new();
        for part in data.chunks(1000) {
            assert_eq!(p.write(&[IoSlice::new(part)]).unwrap(), part.len());
            got.extend(read_all(&c, 1000));
        }
        assert_eq!(got, data);
        // A head within the ring is believed: the bytes are garbage, not out of bounds.
        let (region, _fd) = Region::create(MIN_RING).unwrap();
        region.scribble(1, 0, MIN_RING as u64);
        assert_eq!(read_all(&region.consumer(1), 2 * MIN_RING).len(), MIN_RING);
    }

    #[test]
    fn regions_of_the_wrong_shape_or_unsealed_are_refused() {
        let (_, good) = Region::create(MIN_RING).unwrap();
        assert!(Region::map_peer(&good).is_ok());
        let memfd = |len: usize, seal: bool| {
            // SAFETY: as in Region::create.
            let fd = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
            // SAFETY: a new descriptor that we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: on our own descriptor.
            unsafe {
                libc::ftruncate(fd.as_raw_fd(), len as libc::off_t);
                if seal {
                    libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
                }
            }
            fd
        };
        let unsealed = Region::map_peer(&memfd(Region::size(MIN_RING), false)).err().unwrap();
        assert!(unsealed.contains("not sealed"), "{unsealed}");
        for len in [0, 100, Region::size(MIN_RING) + 2, Region::size(3 * MIN_RING), Region::size(2 * MAX_RING)] {
            let e = Region::map_peer(&memfd(len, true)).err().unwrap();
            assert!(e.contains("power of two"), "{len}: {e}");
        }
    }

    /// A wake-up never blocks this side: not when the sleeper never reads
    /// (its socket fills), nor when the peer clears `O_NONBLOCK` on a
    /// description it shares with us (an eventfd's weakness).
    #[test]
    fn a_doorbell_never_blocks_its_ringer_and_drains_in_bounded_steps() {
        let (sleeper, ringer) = doorbell().unwrap();
        assert!(is_doorbell(&sleeper) && is_doorbell(&ringer));
        // What a hostile peer holding the same description could do.
        // SAFETY: fcntl on our own descriptor.
        unsafe {
            let flags = libc::fcntl(ringer.as_raw_fd(), libc::F_GETFL);
            assert_eq!(libc::fcntl(ringer.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK), 0);
        }
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            // Far more than the socket buffer holds.
            for _ in 0..100_000 {
                signal(&ringer);
            }
            done_tx.send(()).unwrap();
            ringer
        });
        done_rx.recv_timeout(Duration::from_secs(20)).expect("a ring blocked");
        let ringer = t.join().unwrap();
        // Full: one drain takes at most DRAIN_MAX, so several are needed.
        assert!(!drain(&sleeper));
        let mut steps = 1;
        while !drain(&sleeper) {
            steps += 1;
            assert!(steps < 100_000, "the doorbell never emptied");
        }
        signal(&ringer);
        assert!(drain(&sleeper));
        // An eventfd (what an earlier version passed) is not a doorbell.
        assert!(!is_doorbell(&eventfd_for_test()));
    }

    fn eventfd_for_test() -> OwnedFd {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a new descriptor this test owns.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    /// Both ends of a ring connection in this process, over a socket pair.
    fn pair(cap: usize, spin: Duration) -> ((RingReader, RingWriter), (RingReader, RingWriter)) {
        let offer = RingOffer::new(cap).unwrap();
        let (server_region, server_events) = {
            let dup = |e: &OwnedFd| e.try_clone().unwrap();
            let events = [dup(&offer.events[0]), dup(&offer.events[1]), dup(&offer.events[2]), dup(&offer.events[3])];
            accept(offer.memfd.try_clone().unwrap(), events).unwrap()
        };
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        let (region, events) = offered(offer);
        let client = halves(End::Client, region, events, OwnedFd::from(a), spin).unwrap();
        let server = halves(End::Server, server_region, server_events, OwnedFd::from(b), spin).unwrap();
        (client, server)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_cross_both_ways_sleeping_and_spinning() {
        for spin in [Duration::ZERO, Duration::from_micros(50)] {
            let ((mut crd, mut cwr), (mut srd, mut swr)) = pair(MIN_RING, spin);
            let data = pattern(3 << 20, 3);
            let up = data.clone();
            // Client → server echo → client, through 4 KiB rings: every side
            // waits for room and for bytes many times.
            let writer = tokio::spawn(async move {
                cwr.write_all(&up).await.unwrap();
                cwr.shutdown().await.unwrap();
                cwr
            });
            let echo = tokio::spawn(async move {
                let mut buf = vec![0u8; 7000];
                loop {
                    let n = srd.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    swr.write_all(&buf[..n]).await.unwrap();
                }
                swr.shutdown().await.unwrap();
                (srd, swr)
            });
            let mut back = Vec::new();
            crd.read_to_end(&mut back).await.unwrap();
            assert!(back == data, "spin {spin:?}: {} bytes back of {}", back.len(), data.len());
            writer.await.unwrap();
            echo.await.unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_goes_away_ends_reads_and_fails_writes() {
        let ((mut crd, mut cwr), server) = pair(MIN_RING, Duration::ZERO);
        // Bytes published before the peer went are still read, then the end.
        let (srd, swr) = server;
        swr.write_now(&[IoSlice::new(b"last words")]).unwrap();
        drop((srd, swr));
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), crd.read_to_end(&mut got)).await;
        assert_eq!(read.expect("no hang").unwrap(), 10);
        assert_eq!(got, b"last words");
        // A writer waiting for room learns that nobody will make any.
        let full = vec![0u8; 4 * MIN_RING];
        let w = tokio::time::timeout(Duration::from_secs(10), cwr.write_all(&full)).await.expect("no hang");
        assert_eq!(w.unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    #[test]
    fn a_busy_announcement_holds_until_its_time_and_never_far_ahead() {
        let (region, _fd) = Region::create(MIN_RING).unwrap();
        let (busy, c) = (Busy(region.ring(0)), region.consumer(0));
        assert!(!c.peer_busy(), "nothing announced");
        let until = busy.announce(1 << 20).expect("a MiB copies well within MAX_BUSY");
        // (A test thread paused past the deadline sees it expired: fine.)
        assert!(c.peer_busy() || monotonic_ns() >= until);
        // A second stream's later announcement outlives the first's clear.
        let later = busy.announce(2 << 20).unwrap();
        assert!(later > until);
        busy.clear(until);
        assert!(c.peer_busy() || monotonic_ns() >= later, "the other stream's announcement stands");
        busy.clear(later);
        assert!(!c.peer_busy());
        assert!(busy.announce(1 << 30).is_none(), "a GiB is too long to spin for");
        assert!(!c.peer_busy());
        // A stale or hostile word keeps nobody spinning.
        let now = monotonic_ns();
        for v in [1, now.saturating_sub(1), now + 10 * MAX_BUSY.as_nanos() as u64, u64::MAX] {
            region.scribble(0, 3, v);
            assert!(!c.peer_busy(), "{v}");
        }
    }

    /// Polls `crd` once by hand: it must have nothing to return.
    fn poll_pending(crd: &mut RingReader) {
        let mut cx = Context::from_waker(Waker::noop());
        let mut space = [0u8; 16];
        let mut buf = ReadBuf::new(&mut space);
        assert!(Pin::new(crd).poll_read(&mut cx, &mut buf).is_pending());
    }

    /// Whether the reader of `swr`'s ring has armed its waiting word.
    fn armed(swr: &RingWriter) -> bool {
        swr.tx.ring.flag(CONSUMER_WAITING).load(Ordering::SeqCst) != 0
    }

    /// Polls `crd` (calling `before` ahead of each poll, pausing `pause`
    /// between) until it arms to sleep; false if it never does.
    async fn goes_to_sleep(crd: &mut RingReader, swr: &RingWriter, before: impl Fn(), pause: Duration) -> bool {
        for _ in 0..10_000 {
            before();
            poll_pending(crd);
            if armed(swr) {
                return true;
            }
            tokio::time::sleep(pause).await;
        }
        false
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_reader_spins_instead_of_sleeping_while_its_peer_is_busy() {
        let ((mut crd, _cwr), (_srd, swr)) = pair(MIN_RING, Duration::from_micros(1));
        let busy = swr.busy();
        let start = monotonic_ns();
        let mut spun = 0;
        for _ in 0..200 {
            let until = busy.announce(1 << 20).unwrap();
            poll_pending(&mut crd);
            let now = monotonic_ns();
            if now >= until || now - start > MAX_BUSY.as_nanos() as u64 {
                // The test thread was paused past a deadline: inconclusive
                // for this poll (the reader may have armed); start over.
                swr.tx.ring.flag(CONSUMER_WAITING).store(0, Ordering::SeqCst);
                break;
            }
            assert!(!armed(&swr), "a reader whose peer is busy spins: it never arms");
            spun += 1;
        }
        assert!(spun > 0, "not one poll within the announcement: the machine is too loaded to tell");
        swr.tx.ring.word(BUSY_UNTIL).store(0, Ordering::SeqCst);
        assert!(
            goes_to_sleep(&mut crd, &swr, || {}, Duration::from_micros(10)).await,
            "the reader never went to sleep once its peer was no longer busy"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_peer_that_keeps_announcing_and_sends_nothing_is_slept_on() {
        let ((mut crd, _cwr), (_srd, swr)) = pair(MIN_RING, Duration::from_micros(1));
        let busy = swr.busy();
        // Renewed before every poll, as a hostile peer could.
        let renew = || {
            busy.announce(1 << 20).unwrap();
        };
        assert!(
            goes_to_sleep(&mut crd, &swr, renew, Duration::from_micros(50)).await,
            "a reader spun for a peer that announced and sent nothing for good"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_writer_waiting_on_a_half_closed_peer_sleeps_instead_of_spinning() {
        let ((_crd, cwr), (srd, mut swr)) = pair(MIN_RING, Duration::ZERO);
        // The peer closes its direction but keeps reading nothing.
        swr.shutdown().await.unwrap();
        let mut cwr = cwr;
        let full = vec![0u8; 4 * MIN_RING];
        // On one thread, a spinning writer would starve the timer: the
        // timeout fires only if the writer waits.
        let w = tokio::time::timeout(Duration::from_millis(300), cwr.write_all(&full)).await;
        assert!(w.is_err(), "the write must wait for room, not fail or spin");
        drop((srd, swr));
    }
}
