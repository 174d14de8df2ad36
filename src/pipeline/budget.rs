//! One memory budget for everything a peer can make a process hold.
//!
//! Every receive buffer is reserved from the budget *before* it is
//! allocated: a tensor in flight from its first chunk (the declared total),
//! a finished tensor for as long as any view of it lives (the reservation
//! rides inside its `Bytes`, so it is released when the store, a batch
//! queue, a task result or the handler drops the last view), skytorch
//! compat reassembly (with its per-chunk overhead), and task results. A
//! reservation that does not fit first asks the budget's reclaimer (the
//! store's eviction policy) to free memory; if it still does not fit, the
//! caller gets `RESOURCE_EXHAUSTED` before a byte of the tensor is read.
//!
//! Sans-IO: counters and a callback, no tokio.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;

/// Asks an owner of memory (a store) to free about `wanted` bytes; returns
/// how many it released.
pub type Reclaimer = Arc<dyn Fn(u64) -> u64 + Send + Sync>;

/// A byte budget shared by every reservation of one server (or client).
/// Cheap to clone: clones share the count.
#[derive(Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    limit: u64,
    used: AtomicU64,
    peak: AtomicU64,
    refused: AtomicU64,
    reclaimers: std::sync::Mutex<Vec<Reclaimer>>,
}

impl fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBudget")
            .field("limit", &self.limit())
            .field("used", &self.used())
            .field("peak", &self.peak())
            .finish()
    }
}

/// A reservation over the budget's limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} of {size} bytes does not fit the memory budget ({used} of {limit} bytes in use)")]
pub struct OverBudget {
    /// What was being reserved.
    pub what: &'static str,
    /// Bytes asked for.
    pub size: u64,
    /// Bytes in use when it was refused.
    pub used: u64,
    /// The budget.
    pub limit: u64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self {
            inner: Arc::new(Inner {
                limit,
                used: AtomicU64::new(0),
                peak: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                reclaimers: std::sync::Mutex::new(Vec::new()),
            }),
        }
    }

    /// A budget that never refuses (still counts).
    pub fn unlimited() -> Self {
        Self::new(u64::MAX)
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Acquire)
    }

    /// The most bytes ever reserved at once.
    pub fn peak(&self) -> u64 {
        self.inner.peak.load(Ordering::Acquire)
    }

    /// Reservations refused so far.
    pub fn refused(&self) -> u64 {
        self.inner.refused.load(Ordering::Acquire)
    }

    /// Adds an owner of memory that can free some when a reservation does
    /// not fit (called without any lock of the budget held).
    pub fn add_reclaimer(&self, r: Reclaimer) {
        crate::util::sync::lock(&self.inner.reclaimers).push(r);
    }

    /// Adds an owner of memory that is asked before the others (the
    /// receive pool: idle buffers are the cheapest memory to give back).
    pub fn add_first_reclaimer(&self, r: Reclaimer) {
        crate::util::sync::lock(&self.inner.reclaimers).insert(0, r);
    }

    fn try_add(&self, n: u64) -> bool {
        let i = &self.inner;
        let mut cur = i.used.load(Ordering::Acquire);
        loop {
            let Some(next) = cur.checked_add(n).filter(|&v| v <= i.limit) else { return false };
            match i.used.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    i.peak.fetch_max(next, Ordering::AcqRel);
                    return true;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Reserves `n` bytes for `what`, asking the reclaimers to free memory
    /// when they do not fit.
    pub fn try_reserve(&self, n: u64, what: &'static str) -> Result<Reservation, OverBudget> {
        if !self.try_add(n) {
            let reclaimers: Vec<Reclaimer> = crate::util::sync::lock(&self.inner.reclaimers).clone();
            let mut fitted = false;
            for r in reclaimers {
                let short = self.used().saturating_add(n).saturating_sub(self.limit());
                if r(short.max(1)) > 0 && self.try_add(n) {
                    fitted = true;
                    break;
                }
            }
            if !fitted {
                self.inner.refused.fetch_add(1, Ordering::AcqRel);
                return Err(OverBudget { what, size: n, used: self.used(), limit: self.limit() });
            }
        }
        Ok(Reservation { budget: self.clone(), bytes: n })
    }
}

/// Bytes held against a [`MemoryBudget`]; released when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: MemoryBudget,
    bytes: u64,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Grows the reservation by `n` bytes (refused like a new reservation).
    pub fn grow(&mut self, n: u64, what: &'static str) -> Result<(), OverBudget> {
        let extra = self.budget.try_reserve(n, what)?;
        self.bytes += extra.bytes;
        std::mem::forget(extra);
        Ok(())
    }

    /// Releases `n` of the bytes held (at most all of them).
    pub fn shrink(&mut self, n: u64) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        self.budget.inner.used.fetch_sub(n, Ordering::AcqRel);
    }

    /// Ties the reservation to `data`: it is released when the last view of
    /// the returned bytes is dropped.
    pub fn attach(self, data: impl AsRef<[u8]> + Send + 'static) -> Bytes {
        Bytes::from_owner(Held { data, _reservation: self })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.inner.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Bytes that keep their reservation alive.
struct Held<T> {
    data: T,
    _reservation: Reservation,
}

impl<T: AsRef<[u8]>> AsRef<[u8]> for Held<T> {
    fn as_ref(&self) -> &[u8] {
        self.data.as_ref()
    }
}

/// Half of this machine's memory (or of the cgroup's limit, if lower): the
/// default budget.
pub fn default_limit() -> u64 {
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| {
                l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).map(|kb| kb.saturating_mul(1024))
            })
        })
        .unwrap_or(16 << 30);
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(u64::MAX);
    mem.min(cgroup) / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_and_release_with_the_last_view() {
        let b = MemoryBudget::new(100);
        let r = b.try_reserve(60, "a").unwrap();
        assert_eq!(b.used(), 60);
        let e = b.try_reserve(50, "b").unwrap_err();
        assert_eq!((e.size, e.used, e.limit), (50, 60, 100));
        assert_eq!(b.refused(), 1);
        let bytes = r.attach(vec![7u8; 60]);
        let view = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(b.used(), 60, "a view still holds the memory");
        drop(view);
        assert_eq!(b.used(), 0);
        assert_eq!(b.peak(), 60);
    }

    #[test]
    fn a_reclaimer_frees_room() {
        let b = MemoryBudget::new(100);
        let held = std::sync::Arc::new(std::sync::Mutex::new(vec![b.try_reserve(90, "old").unwrap()]));
        let h = held.clone();
        b.add_reclaimer(Arc::new(move |_| h.lock().unwrap().drain(..).map(|r| r.bytes()).sum()));
        let r = b.try_reserve(50, "new").unwrap();
        assert_eq!(b.used(), 50);
        assert!(held.lock().unwrap().is_empty());
        let mut r = r;
        r.grow(40, "more").unwrap();
        assert_eq!((r.bytes(), b.used()), (90, 90));
        assert!(r.grow(20, "too much").is_err());
        drop(r);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn sizes_that_overflow_are_refused() {
        let b = MemoryBudget::unlimited();
        let _r = b.try_reserve(u64::MAX - 1, "huge").unwrap();
        assert!(b.try_reserve(2, "more").is_err());
    }
}
