//! Spinning before sleeping, shared by the transports whose reads the
//! runtime can poll without blocking (kernel sockets under the mux, the
//! shared-memory rings).
//!
//! A side with nothing to read keeps polling for
//! [`TransportConfig::spin`](crate::TransportConfig::spin) after the
//! connection last moved bytes, then sleeps until the runtime wakes it. A
//! reply that comes within the spin costs no thread wake-up — on a VM, tens
//! of microseconds each way — and an idle connection costs nothing.
//!
//! - **No clock on the data path.** Each side counts its own reads and
//!   writes ([`Activity`]); a [`Spin`] reads the clock only once the
//!   counters stopped moving, and then once every few polls.
//! - **A write restarts a reader's spin, once.** A reader that went to
//!   sleep registers its waker; the next write on the connection (a
//!   request, say) wakes it, so that it spins for the reply instead of
//!   sleeping through it. Reads keep a reader spinning; writes alone start
//!   one more spin and no more, so a long one-way send does not keep its
//!   own reader busy (the writing half waiting for room, on the rings, does
//!   count its writes).
//! - **Fair to the runtime.** A spinning task defers its re-poll until the
//!   runtime has run its other ready tasks and checked its timers and I/O
//!   ([`spin_again`]).
//!
//! Missing a wake-up here only costs latency, never a frame: the sleeping
//! side is still woken by its socket or doorbell when bytes arrive.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::sync::{bump, lock};

/// Reads and writes that moved bytes on a connection, so either half can
/// tell whether the connection is busy: each half counts its own (no clock
/// on the data path) and spins, instead of sleeping, for `spin` after the
/// last one it saw.
pub(crate) struct Activity {
    reads: AtomicU64,
    writes: AtomicU64,
    spin: Duration,
    /// Set while the reading half sleeps with its waker in `sleeper`.
    asleep: AtomicBool,
    sleeper: Mutex<Option<Waker>>,
}

impl Activity {
    /// A connection's counters; `spin` zero turns spinning off.
    pub(crate) fn new(spin: Duration) -> Self {
        Self {
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            spin,
            asleep: AtomicBool::new(false),
            sleeper: Mutex::new(None),
        }
    }

    /// The reading half read bytes (only it calls this): it is awake.
    pub(crate) fn read(&self) {
        bump(&self.reads);
        if self.asleep.load(Ordering::Relaxed) {
            self.asleep.store(false, Ordering::Relaxed);
        }
    }

    /// The writing half wrote bytes (one writer at a time): wakes a reader
    /// that sleeps, so that it spins for the answer.
    pub(crate) fn wrote(&self) {
        bump(&self.writes);
        // Relaxed first: a lost race only means the reader sleeps on.
        if self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::AcqRel) {
            // The waker stays for the next sleep (no clone then); waking
            // only schedules the task, it runs nothing under this lock.
            if let Some(w) = &*lock(&self.sleeper) {
                w.wake_by_ref();
            }
        }
    }

    /// The reading half is about to sleep: the next write wakes `waker`
    /// (nothing when spinning is off).
    pub(crate) fn sleep(&self, waker: &Waker) {
        if self.spin.is_zero() {
            return;
        }
        let mut slot = lock(&self.sleeper);
        match &*slot {
            Some(w) if w.will_wake(waker) => {}
            _ => *slot = Some(waker.clone()),
        }
        self.asleep.store(true, Ordering::Release);
    }

    /// Whether spinning is on (a non-zero spin).
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    pub(crate) fn spins(&self) -> bool {
        !self.spin.is_zero()
    }

    fn moves(&self) -> u64 {
        self.reads.load(Ordering::Relaxed).wrapping_add(self.writes.load(Ordering::Relaxed))
    }
}

/// What a [`Spin`] watches: every move, or (a reader) reads, plus one
/// restart for the first write after them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Watch {
    // Only the shared-memory ring's writer watches every move.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    Moves,
    Reads,
}

/// One half's view of [`Activity`]: the moves it last saw and when.
pub(crate) struct Spin {
    seen: u64,
    /// A reader's write count at its last read, and whether a write since
    /// has restarted its spin (once per quiet spell).
    seen_writes: u64,
    write_restarted: bool,
    /// When `seen` was first seen unchanged (None: not yet looked at the
    /// clock since it changed).
    since: Option<Instant>,
    /// Polls since the clock was last read.
    polls: u32,
}

/// Polls between two clock reads while spinning (a poll takes well under
/// a microsecond; the spin lasts tens of them).
const POLLS_PER_CLOCK_READ: u32 = 8;

impl Spin {
    pub(crate) fn new() -> Self {
        Self { seen: 0, seen_writes: 0, write_restarted: false, since: None, polls: 0 }
    }

    /// Whether to poll again rather than sleep: the connection moved bytes
    /// within about the last `spin`. The clock is read once every
    /// [`POLLS_PER_CLOCK_READ`] polls of a quiet connection, and never
    /// while bytes keep moving.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    pub(crate) fn spinning(&mut self, a: &Activity) -> bool {
        self.check(a, Watch::Moves)
    }

    /// [`Self::spinning`] for a reading half: reads keep it spinning, and
    /// the first write after a quiet spell starts one more spin (a request
    /// waiting for its reply), but writes alone do not keep it spinning.
    pub(crate) fn reading(&mut self, a: &Activity) -> bool {
        self.check(a, Watch::Reads)
    }

    fn check(&mut self, a: &Activity, watch: Watch) -> bool {
        if a.spin.is_zero() {
            return false;
        }
        let restart = match watch {
            Watch::Moves => {
                let moves = a.moves();
                let changed = moves != self.seen;
                self.seen = moves;
                changed
            }
            Watch::Reads => {
                let (reads, writes) = (a.reads.load(Ordering::Relaxed), a.writes.load(Ordering::Relaxed));
                if reads != self.seen {
                    (self.seen, self.seen_writes, self.write_restarted) = (reads, writes, false);
                    true
                } else if !self.write_restarted && writes != self.seen_writes {
                    // The first write since the last read: one more spin, from now.
                    self.write_restarted = true;
                    true
                } else {
                    false
                }
            }
        };
        if restart {
            self.since = None;
            self.polls = 0;
            return true;
        }
        self.polls = self.polls.wrapping_add(1);
        match self.since {
            None => {
                self.since = Some(Instant::now());
                true
            }
            Some(_) if !self.polls.is_multiple_of(POLLS_PER_CLOCK_READ) => true,
            Some(since) if since.elapsed() < a.spin => true,
            Some(_) => {
                // Over: the next poll reads the clock again at once rather
                // than spinning a few more polls on a quiet connection.
                self.polls = POLLS_PER_CLOCK_READ - 1;
                false
            }
        }
    }
}

impl Default for Spin {
    fn default() -> Self {
        Self::new()
    }
}

/// Polls again soon: after the tasks that are ready to run, and after the
/// runtime has looked at its timers and I/O (tokio's `yield_now`, whose
/// wake-up is deferred until then). Waking itself instead would keep a
/// spinning task always in the run queue, and a current-thread runtime polls
/// its `block_on` future only when the queue runs dry or every 61 tasks: a
/// caller waiting there would wait microseconds for every reply.
pub(crate) fn spin_again<T>(cx: &mut Context<'_>) -> Poll<T> {
    // The first poll registers the deferred wake-up; the future itself is
    // not needed after it.
    let y = std::pin::pin!(tokio::task::yield_now());
    if std::future::Future::poll(y, cx).is_ready() {
        // Not reached (a fresh yield is pending once): poll again anyway.
        cx.waker().wake_by_ref();
    }
    Poll::Pending
}

/// A waker that counts its wakes, for the tests of spinning here and in
/// the mux.
#[cfg(test)]
pub(crate) struct WakeCount(std::sync::atomic::AtomicUsize);

#[cfg(test)]
impl WakeCount {
    pub(crate) fn new() -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self(std::sync::atomic::AtomicUsize::new(0)))
    }

    pub(crate) fn waker(self: &std::sync::Arc<Self>) -> Waker {
        Waker::from(self.clone())
    }

    /// Wakes so far.
    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
impl std::task::Wake for WakeCount {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_after_moves_then_stops_after_the_spin() {
        let a = Activity::new(Duration::from_millis(20));
        let mut s = Spin::new();
        a.read();
        assert!(s.spinning(&a), "bytes just moved");
        let t = Instant::now();
        while s.spinning(&a) {
            assert!(t.elapsed() < Duration::from_secs(5), "never stopped spinning");
        }
        assert!(t.elapsed() >= Duration::from_millis(20), "stopped before the spin ended");
        a.wrote();
        assert!(s.spinning(&a), "a write starts the spin again");
    }

    /// Spins until the spin is over; panics if it never ends.
    fn until_quiet(s: &mut Spin, a: &Activity) {
        let t = Instant::now();
        while s.reading(a) {
            assert!(t.elapsed() < Duration::from_secs(5), "never stopped spinning");
        }
    }

    #[test]
    fn a_reader_spins_on_reads_and_once_more_for_a_write() {
        let a = Activity::new(Duration::from_millis(5));
        let mut s = Spin::new();
        a.read();
        assert!(s.reading(&a));
        until_quiet(&mut s, &a);
        assert!(!s.reading(&a), "quiet: stays asleep, and reads the clock at once");
        // A request after the quiet spell: one more spin, from the write.
        a.wrote();
        assert!(s.reading(&a), "the first write after a read restarts the spin");
        until_quiet(&mut s, &a);
        // Writes alone (a long one-way send) restart nothing more.
        for _ in 0..3 {
            a.wrote();
            assert!(!s.reading(&a), "a second write in the same quiet spell kept the reader spinning");
        }
        // A read (the reply) starts over.
        a.read();
        assert!(s.reading(&a));
        until_quiet(&mut s, &a);
        a.wrote();
        assert!(s.reading(&a), "after a read, a write restarts the spin again");
    }

    #[test]
    fn reading_clears_the_sleeper_so_a_write_wakes_nobody() {
        let a = Activity::new(Duration::from_micros(50));
        let count = WakeCount::new();
        a.sleep(&count.waker());
        a.read();
        a.wrote();
        assert_eq!(count.get(), 0, "a reader that read is awake: nothing to wake");
    }

    #[test]
    fn zero_spin_never_spins_and_never_registers_a_sleeper() {
        let a = Activity::new(Duration::ZERO);
        let mut s = Spin::new();
        a.read();
        assert!(!s.spinning(&a));
        let count = WakeCount::new();
        a.sleep(&count.waker());
        a.wrote();
        assert_eq!(count.get(), 0);
    }

    #[test]
    fn a_write_wakes_a_sleeping_reader_once() {
        let a = Activity::new(Duration::from_micros(50));
        let count = WakeCount::new();
        a.sleep(&count.waker());
        a.wrote();
        a.wrote();
        assert_eq!(count.get(), 1, "one wake per sleep");
        a.sleep(&count.waker());
        a.wrote();
        assert_eq!(count.get(), 2);
    }
}
