//! The receive pool: large receive buffers are recycled instead of being
//! allocated per tensor, so that steady traffic (a server receiving tensor
//! after tensor, a client fetching) pays no page faults (on these VMs fresh
//! memory faults in at ~1 GiB/s, a warm buffer takes socket reads at the
//! socket's speed).
//!
//! Accounting is one with the [`MemoryBudget`]: a buffer is reserved from
//! the budget before it is allocated and keeps its reservation for as long
//! as it lives, in use or idle in the pool, so the budget counts what the
//! process really holds. A reservation that does not fit first drops idle
//! pooled buffers (the pool is the budget's first reclaimer), then asks the
//! other reclaimers; if it still does not fit, the receive fails with
//! `RESOURCE_EXHAUSTED` before any byte of the tensor is read.
//!
//! ```text
//!  acquire(n) ──► idle buffer with n ≤ capacity ≤ 2n? ── hit ──► Lease
//!                      │ miss                                     │ into_bytes()
//!                      ▼                                          ▼
//!           reserve from the budget, allocate           Bytes views (tensor)
//!                                                                  │ last view drops
//!   idle list (≤ max_idle_bytes, dropped after idle_timeout) ◄────┘
//! ```
//!
//! A buffer goes back to the pool only when the last `Bytes` view of it is
//! dropped (the lease is the `Bytes` owner), so a buffer still viewed is
//! never handed out again. Sans-IO: a mutex, counters and `Instant`s.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_transports::RecvBuf;

use super::budget::{MemoryBudget, OverBudget, Reservation};

/// How the receive pool is sized (defaults in [`crate::config`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Most bytes kept idle in the pool (0: no pooling).
    pub max_idle_bytes: u64,
    /// Receives smaller than this are not pooled (the allocator recycles
    /// small buffers well on its own).
    pub min_bytes: usize,
    /// An idle buffer unused this long is freed.
    pub idle_timeout: Duration,
}

impl PoolConfig {
    /// A pool keeping at most `max_idle_bytes` idle, at most a quarter of
    /// `budget_limit`; the other settings at their defaults.
    pub fn sized(max_idle_bytes: u64, budget_limit: u64) -> Self {
        Self {
            max_idle_bytes: max_idle_bytes.min(budget_limit / 4),
            min_bytes: crate::config::DEFAULT_RECV_POOL_MIN_BYTES,
            idle_timeout: crate::config::DEFAULT_RECV_POOL_IDLE,
        }
    }
}

/// Counters of a [`RecvPool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Receives served by a recycled buffer.
    pub hits: u64,
    /// Receives that allocated a new buffer.
    pub misses: u64,
    /// Bytes of buffers idle in the pool now.
    pub idle_bytes: u64,
    /// Buffers idle in the pool now.
    pub idle_buffers: u64,
    /// Bytes of pooled buffers lent out now (being received into or viewed).
    pub leased_bytes: u64,
}

impl PoolStats {
    /// Hits over all pooled receives (0 before the first).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub fn hit_rate(&self) -> f64 {
        let all = self.hits + self.misses;
        if all == 0 { 0.0 } else { self.hits as f64 / all as f64 }
    }
}

struct Idle {
    buf: RecvBuf,
    reservation: Reservation,
    since: Instant,
}

struct Inner {
    cfg: PoolConfig,
    budget: MemoryBudget,
    idle: Mutex<Vec<Idle>>,
    hits: AtomicU64,
    misses: AtomicU64,
    idle_bytes: AtomicU64,
    leased_bytes: AtomicU64,
}

/// A bounded pool of recycled, already-faulted, page-aligned receive
/// buffers, reserved from a [`MemoryBudget`]. Cheap to clone: clones share
/// the pool.
#[derive(Clone)]
pub struct RecvPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RecvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvPool").field("cfg", &self.inner.cfg).field("stats", &self.stats()).finish()
    }
}

impl RecvPool {
    /// A pool whose buffers are reserved from `budget`; it registers itself
    /// as the budget's first reclaimer (idle buffers are the cheapest
    /// memory to give back).
    pub fn new(budget: MemoryBudget, cfg: PoolConfig) -> Self {
        let inner = Arc::new(Inner {
            cfg,
            budget: budget.clone(),
            idle: Mutex::new(Vec::new()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            idle_bytes: AtomicU64::new(0),
            leased_bytes: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        budget.add_first_reclaimer(Arc::new(move |wanted| match weak.upgrade() {
            Some(inner) => RecvPool { inner }.release_idle(wanted),
            None => 0,
        }));
        Self { inner }
    }

    /// The budget its buffers are reserved from.
    pub fn budget(&self) -> &MemoryBudget {
        &self.inner.budget
    }

    /// True when a receive of `n` bytes is served by the pool.
    pub fn pools(&self, n: usize) -> bool {
        self.inner.cfg.max_idle_bytes > 0 && n >= self.inner.cfg.min_bytes
    }

    /// The counters now.
    pub fn stats(&self) -> PoolStats {
        let i = &self.inner;
        PoolStats {
            hits: i.hits.load(Ordering::Relaxed),
            misses: i.misses.load(Ordering::Relaxed),
            idle_bytes: i.idle_bytes.load(Ordering::Relaxed),
            idle_buffers: crate::util::sync::lock(&i.idle).len() as u64,
            leased_bytes: i.leased_bytes.load(Ordering::Relaxed),
        }
    }

    /// A buffer of `n` bytes (contents unspecified: every byte is written
    /// by the receive) reserved from the budget: a recycled one when an
    /// idle buffer fits (capacity between `n` and `2n`), else a new one.
    /// Fails before allocating when the budget (after freeing idle buffers
    /// and asking the other reclaimers) has not got room.
    pub fn acquire(&self, n: usize, what: &'static str) -> Result<Lease, AcquireError> {
        self.trim();
        let i = &self.inner;
        let reused = {
            let mut idle = crate::util::sync::lock(&i.idle);
            let best = idle
                .iter()
                .enumerate()
                .filter(|(_, b)| b.buf.capacity() >= n && b.buf.capacity() / 2 <= n)
                .min_by_key(|(_, b)| b.buf.capacity())
                .map(|(k, _)| k);
            best.map(|k| idle.swap_remove(k))
        };
        let (mut buf, reservation) = match reused {
            Some(b) => {
                i.idle_bytes.fetch_sub(b.buf.capacity() as u64, Ordering::AcqRel);
                i.hits.fetch_add(1, Ordering::Relaxed);
                (b.buf, b.reservation)
            }
            None => {
                i.misses.fetch_add(1, Ordering::Relaxed);
                let cap = (n as u64).next_multiple_of(4096);
                let reservation = i.budget.try_reserve(cap, what)?;
                let buf = RecvBuf::try_zeroed(n).ok_or(AcquireError::OutOfMemory { size: n as u64 })?;
                (buf, reservation)
            }
        };
        buf.set_len(n);
        let leased = buf.capacity() as u64;
        i.leased_bytes.fetch_add(leased, Ordering::AcqRel);
        Ok(Lease { buf, reservation: Some(reservation), home: Some(Arc::downgrade(&self.inner)), leased })
    }

    /// Frees buffers idle longer than the idle timeout; returns the bytes freed.
    pub fn trim(&self) -> u64 {
        let timeout = self.inner.cfg.idle_timeout;
        self.release_where(u64::MAX, |b| b.since.elapsed() >= timeout)
    }

    /// Frees every idle buffer; returns the bytes freed.
    #[cfg(test)]
    pub fn clear(&self) -> u64 {
        self.release_where(u64::MAX, |_| true)
    }

    /// Frees idle buffers, oldest first, until about `wanted` bytes are freed.
    fn release_idle(&self, wanted: u64) -> u64 {
        self.release_where(wanted, |_| true)
    }

    fn release_where(&self, wanted: u64, pick: impl Fn(&Idle) -> bool) -> u64 {
        let dropped: Vec<Idle> = {
            let mut idle = crate::util::sync::lock(&self.inner.idle);
            idle.sort_by_key(|b| b.since);
            let mut freed = 0u64;
            let mut out = Vec::new();
            let mut k = 0;
            while k < idle.len() && freed < wanted {
                if pick(&idle[k]) {
                    let b = idle.remove(k);
                    freed += b.buf.capacity() as u64;
                    out.push(b);
                } else {
                    k += 1;
                }
            }
            out
        };
        let freed: u64 = dropped.iter().map(|b| b.buf.capacity() as u64).sum();
        self.inner.idle_bytes.fetch_sub(freed, Ordering::AcqRel);
        // The buffers and their reservations are released here, no lock held.
        drop(dropped);
        freed
    }
}

impl Inner {
    /// Takes a buffer back from a lease whose last view dropped.
    fn give_back(&self, buf: RecvBuf, reservation: Reservation) {
        let cap = buf.capacity() as u64;
        let mut idle = crate::util::sync::lock(&self.idle);
        let held = self.idle_bytes.load(Ordering::Acquire);
        if held.saturating_add(cap) > self.cfg.max_idle_bytes {
            drop(idle);
            // Over the pool's size: freed (with its reservation) right here.
            drop((buf, reservation));
            return;
        }
        self.idle_bytes.fetch_add(cap, Ordering::AcqRel);
        idle.push(Idle { buf, reservation, since: Instant::now() });
    }
}

/// A receive buffer on loan: from the pool (it goes back there when the
/// lease, or the last `Bytes` view made by [`Lease::into_bytes`], drops) or
/// unpooled (freed then). Holds the buffer's budget reservation.
pub struct Lease {
    buf: RecvBuf,
    reservation: Option<Reservation>,
    home: Option<Weak<Inner>>,
    /// Bytes counted in the pool's `leased_bytes` for this lease.
    leased: u64,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("len", &self.buf.len()).field("pooled", &self.home.is_some()).finish()
    }
}

impl Lease {
    /// An unpooled buffer of `n` zero bytes, reserved from `budget` when
    /// there is one.
    pub fn unpooled(n: usize, budget: Option<&MemoryBudget>, what: &'static str) -> Result<Self, AcquireError> {
        let reservation = budget.map(|b| b.try_reserve(n as u64, what)).transpose()?;
        let buf = RecvBuf::try_zeroed(n).ok_or(AcquireError::OutOfMemory { size: n as u64 })?;
        Ok(Self { buf, reservation, home: None, leased: 0 })
    }

    /// The buffer.
    pub fn buf(&mut self) -> &mut RecvBuf {
        &mut self.buf
    }

    /// Takes the buffer out (to lend it to a transport); [`Lease::put`]
    /// puts it back.
    pub fn take(&mut self) -> RecvBuf {
        std::mem::take(&mut self.buf)
    }

    /// Puts back the buffer [`Lease::take`] took.
    pub fn put(&mut self, buf: RecvBuf) {
        self.buf = buf;
    }

    /// The buffer's contents as `Bytes`: the lease rides inside, so the
    /// buffer goes back to the pool (or is freed) when the last view drops.
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(home) = self.home.take().and_then(|w| w.upgrade()) else { return };
        home.leased_bytes.fetch_sub(self.leased, Ordering::AcqRel);
        let buf = std::mem::take(&mut self.buf);
        // A buffer taken and never put back (a failed placement) is gone;
        // its reservation is released with the lease.
        // Nor does one a peer may still write into (see `RecvBuf::reusable`).
        if let (Some(r), true) = (self.reservation.take(), buf.capacity() > 0 && buf.reusable()) {
            home.give_back(buf, r);
        }
    }
}

/// Why a receive buffer could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AcquireError {
    /// The memory budget has not got room (checked before allocating).
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
    /// Within the budget, but the allocator has not got the memory.
    #[error("cannot allocate {size} bytes for a receive buffer")]
    OutOfMemory {
        /// Bytes asked for.
        size: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(limit: u64, idle: u64) -> RecvPool {
        RecvPool::new(
            MemoryBudget::new(limit),
            PoolConfig { max_idle_bytes: idle, min_bytes: 4096, idle_timeout: Duration::from_secs(3600) },
        )
    }

    #[test]
    fn buffers_return_on_the_last_drop_and_are_reused() {
        let p = pool(64 << 20, 16 << 20);
        let mut l = p.acquire(1 << 20, "t").unwrap();
        l.buf().fill(3);
        let addr = l.buf().as_ptr() as usize;
        assert_eq!(addr % 4096, 0, "page-aligned");
        let bytes = l.into_bytes();
        let view = bytes.slice(10..20);
        drop(bytes);
        // Still viewed: never handed out again; a new buffer is allocated.
        let mut other = p.acquire(1 << 20, "t").unwrap();
        assert_ne!(other.buf().as_ptr() as usize, addr);
        assert_eq!(p.stats().hits, 0);
        assert_eq!(&view[..], &[3u8; 10]);
        drop(view);
        assert_eq!(p.stats().idle_buffers, 1);
        let mut again = p.acquire((1 << 20) - 100, "t").unwrap();
        assert_eq!(again.buf().as_ptr() as usize, addr, "the returned buffer is recycled");
        assert_eq!(again.buf().len(), (1 << 20) - 100);
        let s = p.stats();
        assert_eq!((s.hits, s.misses), (1, 2));
        assert_eq!(s.leased_bytes, 2 << 20);
        drop((again, other));
        assert_eq!(p.stats().leased_bytes, 0);
        assert_eq!(p.budget().used(), p.stats().idle_bytes, "idle buffers keep their reservations");
        p.clear();
        assert_eq!(p.budget().used(), 0);
    }

    #[test]
    fn sizes_far_from_a_buffer_do_not_reuse_it_and_the_pool_is_bounded() {
        let p = pool(64 << 20, 3 << 20);
        drop(p.acquire(4 << 20, "t").unwrap()); // over max_idle_bytes: freed
        assert_eq!(p.stats().idle_buffers, 0);
        assert_eq!(p.budget().used(), 0);
        drop(p.acquire(2 << 20, "t").unwrap());
        assert_eq!(p.stats().idle_bytes, 2 << 20);
        // 2 MiB is more than twice 512 KiB: not reused.
        drop(p.acquire(512 << 10, "t").unwrap());
        assert_eq!(p.stats().hits, 0);
        assert_eq!((p.stats().idle_buffers, p.stats().idle_bytes), (2, 5 << 19));
        // 768 KiB fits neither (2 MiB is too big, 512 KiB too small); kept,
        // it would make 3.25 MiB idle: freed instead.
        drop(p.acquire(768 << 10, "t").unwrap());
        assert_eq!((p.stats().hits, p.stats().misses), (0, 4));
        assert_eq!(p.stats().idle_buffers, 2, "bounded by max_idle_bytes");
        assert_eq!(p.budget().used(), 5 << 19, "the freed one gave its reservation back");
    }

    #[test]
    fn a_full_budget_frees_idle_buffers_then_refuses_before_allocating() {
        let p = pool(8 << 20, 8 << 20);
        drop(p.acquire(6 << 20, "t").unwrap());
        assert_eq!(p.budget().used(), 6 << 20);
        // A 6 MiB buffer serves 4 MiB (capacity at most twice the size).
        let l = p.acquire(4 << 20, "t").unwrap();
        assert_eq!(p.stats().hits, 1);
        drop(l);
        // 7 MiB needs room: the idle 6 MiB buffer is dropped to make it.
        let big = p.acquire(7 << 20, "t").unwrap();
        assert_eq!(p.budget().used(), 7 << 20);
        let e = p.acquire(2 << 20, "tensor").unwrap_err();
        assert!(matches!(e, AcquireError::OverBudget(_)), "{e}");
        assert!(e.to_string().contains("does not fit the memory budget"), "{e}");
        drop(big);
        p.clear();
        assert_eq!(p.budget().used(), 0);
    }

    #[test]
    fn idle_buffers_are_trimmed_after_the_timeout() {
        let p = RecvPool::new(
            MemoryBudget::new(64 << 20),
            PoolConfig { max_idle_bytes: 16 << 20, min_bytes: 4096, idle_timeout: Duration::ZERO },
        );
        drop(p.acquire(1 << 20, "t").unwrap());
        assert_eq!(p.trim(), 1 << 20);
        assert_eq!((p.stats().idle_buffers, p.budget().used()), (0, 0));
    }
}
