//! Small concurrency helpers: a poison-tolerant lock, a single-writer
//! counter, and background threads bounded process-wide.
//!
//! The data behind every lock in this crate stays consistent across a panic
//! while it is held (tables and slots updated in one step), so a later
//! caller takes the lock anyway instead of panicking in turn.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Locks `m`, ignoring poisoning.
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Adds one to a counter that only the caller's task writes (others only
/// read it): a plain load and store, no locked instruction.
pub(crate) fn bump(counter: &AtomicU64) {
    counter.store(counter.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
}

/// Spawns `f` on a thread named `name` unless `max` threads counted by
/// `running` already run; None then (or when the OS refuses a thread). The
/// slot is freed when `f` returns or panics.
pub(crate) fn spawn_bounded(
    running: &'static AtomicUsize,
    max: usize,
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> Option<JoinHandle<()>> {
    struct Slot(&'static AtomicUsize);
    impl Drop for Slot {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    if running.fetch_add(1, Ordering::AcqRel) >= max {
        running.fetch_sub(1, Ordering::AcqRel);
        return None;
    }
    let slot = Slot(running);
    // On a spawn error the closure (and the slot in it) is dropped: freed.
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _slot = slot;
            f();
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_threads_free_their_slot_when_done_or_panicking() {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let first = spawn_bounded(&RUNNING, 1, "t1", move || {
            let _ = go_rx.recv();
        })
        .expect("a free slot");
        assert!(spawn_bounded(&RUNNING, 1, "t2", || {}).is_none(), "over the bound");
        go_tx.send(()).unwrap();
        first.join().unwrap();
        assert_eq!(RUNNING.load(Ordering::Acquire), 0);
        let panicking = spawn_bounded(&RUNNING, 1, "t3", || panic!("boom")).expect("a free slot");
        assert!(panicking.join().is_err());
        assert_eq!(RUNNING.load(Ordering::Acquire), 0);
    }
}
