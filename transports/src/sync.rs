//! Poison-tolerant lock helper. The data behind every lock in this crate
//! stays consistent across a panic while it is held (tables and slots
//! updated in one step), so a later caller takes the lock anyway instead of
//! panicking in turn.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning.
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
