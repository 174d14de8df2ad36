//! The ceiling for many small calls over shared memory: two threads
//! exchanging fixed-size messages through two single-producer rings in
//! memory both can reach, with many requests outstanding and both sides
//! busy-polling. Each request is copied into a ring and out of it, echoed
//! back the same way, and nothing else happens: no framing, no headers, no
//! scheduling. What is left is the cost of moving the bytes from one core's
//! cache to the other's and back, and the hand-off of the ring positions,
//! which on a VM moves with the host (seen here: 0.4 to 1.6 million
//! exchanges a second between minutes), so a calls/s figure means something
//! only beside this one, measured in the same rounds. It is a ceiling, a
//! little kinder than the transport's rings: its messages fill whole slots
//! (no frame headers, no wrap-around), and the producer never checks
//! whether the consumer sleeps.

use std::cell::UnsafeCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// One single-producer, single-consumer ring of `slots` messages of `size`
/// bytes; `head` counts messages written, `tail` messages read (each on a
/// cache line of its own).
struct Ring {
    data: Box<[UnsafeCell<u8>]>,
    size: usize,
    slots: usize,
    head: Padded,
    tail: Padded,
}

#[repr(align(128))]
struct Padded(AtomicUsize);

// SAFETY: with one producer and one consumer (what `try_push` and `try_pop`
// require of their callers), a slot's bytes are written only by the producer
// while the slot is free (`head - tail < slots`) and read only by the
// consumer once published (`tail < head`, Acquire after the producer's
// Release): never both at once.
unsafe impl Sync for Ring {}

impl Ring {
    fn new(size: usize, slots: usize) -> Result<Self, String> {
        let bytes = size.checked_mul(slots).ok_or_else(|| format!("{slots} slots of {size} bytes"))?;
        // Written once before timing: warm pages, as a live ring's are.
        let data = (0..bytes).map(|_| UnsafeCell::new(0u8)).collect();
        Ok(Self { data, size, slots, head: Padded(AtomicUsize::new(0)), tail: Padded(AtomicUsize::new(0)) })
    }

    /// The first byte of message `n`'s slot, as a pointer into the whole
    /// data area (so that `size` bytes from it may be accessed).
    fn slot(&self, n: usize) -> *mut u8 {
        // SAFETY: the offset lies inside the data area (`n % slots` slots
        // of `size` bytes); `UnsafeCell<u8>` has the layout of `u8`.
        UnsafeCell::raw_get(unsafe { self.data.as_ptr().add((n % self.slots) * self.size) })
    }

    /// Writes `msg` as message number `n` once there is room; returns false
    /// without waiting when there is none.
    ///
    /// # Safety
    /// One thread only pushes to a ring, `n` counting its pushes from 0,
    /// and `msg` is `size` bytes.
    unsafe fn try_push(&self, n: usize, msg: &[u8]) -> bool {
        if n - self.tail.0.load(Ordering::Acquire) >= self.slots {
            return false;
        }
        // SAFETY: slot `n` is free (see `Sync`) and `size` bytes long;
        // `msg` is `size` bytes (checked by the caller).
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), self.slot(n), self.size) };
        self.head.0.store(n + 1, Ordering::Release);
        true
    }

    /// Copies message number `n` into `out` once it is there; returns false
    /// without waiting when it is not.
    ///
    /// # Safety
    /// One thread only pops from a ring, `n` counting its pops from 0, and
    /// `out` is `size` bytes.
    unsafe fn try_pop(&self, n: usize, out: &mut [u8]) -> bool {
        if self.head.0.load(Ordering::Acquire) <= n {
            return false;
        }
        // SAFETY: slot `n` is published (see `Sync`); `out` is `size` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.slot(n), out.as_mut_ptr(), self.size) };
        self.tail.0.store(n + 1, Ordering::Release);
        true
    }
}

/// Request–response exchanges per second: `total` requests of `size` bytes
/// (at least 16: each carries its number at both ends, checked when it
/// comes back), up to `in_flight` outstanding, through rings of
/// `ring_bytes` each way (at least `in_flight` slots), echoed by a second
/// thread. Both threads spin; it needs two cores to mean anything.
pub fn ring_exchanges_per_second(
    size: usize,
    in_flight: usize,
    ring_bytes: usize,
    total: usize,
) -> Result<f64, String> {
    if total == 0 {
        return Err("no exchanges to time".into());
    }
    let size = size.max(16);
    let in_flight = in_flight.max(1);
    let slots = (ring_bytes / size).max(in_flight);
    let (to, back) = (Arc::new(Ring::new(size, slots)?), Arc::new(Ring::new(size, slots)?));
    let (to2, back2) = (to.clone(), back.clone());
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; size];
        for n in 0..total {
            let mut waited = 0u32;
            // SAFETY: this thread alone pops `to` and pushes `back`, in
            // order; `buf` is `size` bytes.
            while !unsafe { to2.try_pop(n, &mut buf) } {
                pause(&mut waited);
            }
            while !unsafe { back2.try_push(n, &buf) } {
                pause(&mut waited);
            }
        }
    });
    let mut msg = vec![1u8; size];
    let mut reply = vec![0u8; size];
    let (mut sent, mut got, mut waited) = (0usize, 0usize, 0u32);
    let mut wrong = None;
    let start = Instant::now();
    while got < total {
        let before = got + sent;
        while sent < total && sent - got < in_flight {
            stamp(&mut msg, sent);
            // SAFETY: this thread alone pushes `to` and pops `back`, in
            // order; `msg` and `reply` are `size` bytes.
            if !unsafe { to.try_push(sent, &msg) } {
                break;
            }
            sent += 1;
        }
        // SAFETY: as above.
        while unsafe { back.try_pop(got, &mut reply) } {
            if wrong.is_none() && !stamped(&reply, got) {
                wrong = Some(got);
            }
            got += 1;
        }
        if got + sent == before {
            if echo.is_finished() {
                break;
            }
            pause(&mut waited);
        }
    }
    let rate = total as f64 / start.elapsed().as_secs_f64();
    echo.join().map_err(|_| "the echo thread panicked".to_string())?;
    if got < total {
        return Err(format!("the echo thread stopped after {got} of {total} exchanges"));
    }
    match wrong {
        Some(n) => Err(format!("exchange {n} came back with another message's bytes")),
        None => Ok(rate),
    }
}

/// Writes `n` at both ends of `msg` (at least 16 bytes).
fn stamp(msg: &mut [u8], n: usize) {
    let b = (n as u64).to_le_bytes();
    let end = msg.len() - 8;
    msg[..8].copy_from_slice(&b);
    msg[end..].copy_from_slice(&b);
}

/// Whether `msg` carries `n` at both ends.
fn stamped(msg: &[u8], n: usize) -> bool {
    let b = (n as u64).to_le_bytes();
    msg[..8] == b && msg[msg.len() - 8..] == b
}

/// Waits a moment while the other side has not moved: spins, and after a
/// while also yields the core (a machine with one free core, or a loaded
/// one, would otherwise pay a whole time slice per hand-off).
fn pause(waited: &mut u32) {
    *waited = waited.wrapping_add(1);
    if waited.is_multiple_of(1 << 12) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    /// Every request comes back, in order, whatever the ring's size (each
    /// reply is checked against its request's number).
    #[test]
    fn every_exchange_comes_back_in_order() {
        use super::ring_exchanges_per_second;
        for (ring, in_flight) in [(4096, 1), (4096 * 3, 8), (1 << 16, 64), (100, 3)] {
            let rate = ring_exchanges_per_second(4096, in_flight, ring, 3000);
            assert!(rate.as_ref().is_ok_and(|r| r.is_finite() && *r > 0.0), "{ring} {in_flight}: {rate:?}");
        }
        assert!(ring_exchanges_per_second(4096, 64, 1 << 18, 0).is_err(), "nothing to time");
        assert!(ring_exchanges_per_second(1 << 20, usize::MAX / 2, 0, 1).is_err(), "a ring too large to allocate");
    }
}
