//! [`RecvBuf`]: an owned, zero-initialised receive buffer, page-aligned when
//! large, whose length can be set anywhere up to its capacity (a recycled
//! buffer serves any tensor that fits). Transports write placed chunks into
//! it ([`Placement`](crate::Placement)); the `tensorwire` crate's receive
//! pool recycles it.
//!
//! Fresh memory is the cost of a large receive on a VM (each page faulted
//! in and zeroed by the kernel: ~1 GiB/s on this project's machines, more
//! than the socket takes to fill it). So a large buffer is mapped straight
//! from the kernel, whose pages are already zero (no `memset` pass that
//! would fault everything in before the first byte is read), and from
//! [`PREFAULT_FROM`] bytes up a helper thread faults its pages in from the
//! back while the receiver fills it from the front, so the two cores share
//! the faults. The helper stops when the buffer is dropped.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::sync::spawn_bounded;

/// Buffers of at least this many bytes are page-aligned (smaller ones are
/// aligned to a cache line, enough for every dtype).
pub const PAGE_ALIGNED_FROM: usize = 64 << 10;
const PAGE: usize = 4096;
const LINE: usize = 64;
/// Buffers of at least this many bytes are mapped from the kernel (zero
/// pages, unmapped on drop) rather than taken from the allocator.
pub const MAPPED_FROM: usize = 2 << 20;
/// Buffers of at least this many bytes get a helper thread that faults
/// their pages in ahead of the receiver (see the module docs).
pub const PREFAULT_FROM: usize = 32 << 20;
/// Most helper threads faulting at once (process-wide); a buffer allocated
/// while all are busy simply gets none.
const MAX_PREFAULTERS: usize = 2;
/// Bytes one helper step faults in before checking whether to stop.
const PREFAULT_STEP: usize = 4 << 20;
/// `madvise` advice: fault pages in writable without writing them (Linux
/// 5.14); older kernels answer EINVAL and the helper stops.
const MADV_POPULATE_WRITE: libc::c_int = 23;

static PREFAULTERS: AtomicUsize = AtomicUsize::new(0);

/// An owned byte buffer: `capacity` zero-initialised bytes (from the global
/// allocator, aligned to a page from [`PAGE_ALIGNED_FROM`] bytes up; mapped
/// from the kernel from [`MAPPED_FROM`] up), of which the first `len` are
/// the buffer's contents.
pub struct RecvBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    /// How it was allocated (and is freed).
    backing: Backing,
    /// The helper faulting pages in, if any (stopped and joined before the
    /// mapping goes).
    prefault: Option<Prefaulter>,
}

enum Backing {
    /// The global allocator, with this alignment.
    Heap(usize),
    /// An anonymous private mapping of `cap` bytes.
    Mapped,
    /// Memory a transport allocated (UCX's registered memory): the owner
    /// frees it when dropped.
    Foreign(Box<dyn Foreign>),
}

/// The owner of a transport's memory behind a [`RecvBuf`].
pub(crate) trait Foreign: std::any::Any + Send + Sync {
    /// False once the memory must not be handed out again (a peer may
    /// still write into it): the receive pool then frees it instead.
    fn reusable(&self) -> bool {
        true
    }
    /// For downcasting.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl std::fmt::Debug for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backing::Heap(a) => write!(f, "Heap({a})"),
            Backing::Mapped => f.write_str("Mapped"),
            Backing::Foreign(_) => f.write_str("Foreign"),
        }
    }
}

/// A helper thread populating a mapping's pages from the back.
struct Prefaulter {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prefaulter {
    /// Starts one over `cap` bytes at `ptr`, unless [`MAX_PREFAULTERS`] run.
    fn start(ptr: NonNull<u8>, cap: usize) -> Option<Prefaulter> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let base = ptr.as_ptr() as usize;
        let thread = spawn_bounded(&PREFAULTERS, MAX_PREFAULTERS, "tw-prefault", move || {
            let mut end = cap;
            while end > 0 && !flag.load(Ordering::Relaxed) {
                let start = end.saturating_sub(PREFAULT_STEP);
                // SAFETY: [base+start, base+end) lies inside the mapping,
                // which outlives this thread (the owner joins it before
                // unmapping). MADV_POPULATE_WRITE only faults pages in; it
                // never changes bytes already written by the receiver.
                let rc =
                    unsafe { libc::madvise((base + start) as *mut libc::c_void, end - start, MADV_POPULATE_WRITE) };
                if rc != 0 {
                    break;
                }
                end = start;
            }
        })?;
        Some(Prefaulter { stop, thread: Some(thread) })
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// SAFETY: `RecvBuf` owns its allocation exclusively (like `Vec<u8>`).
unsafe impl Send for RecvBuf {}
// SAFETY: shared references only read the bytes.
unsafe impl Sync for RecvBuf {}

impl RecvBuf {
    fn layout(cap: usize) -> Option<Layout> {
        let align = if cap >= PAGE_ALIGNED_FROM { PAGE } else { LINE };
        Layout::from_size_align(cap.checked_next_multiple_of(align)?, align).ok()
    }

    /// `len` zero bytes, or None when the allocator has not got the memory
    /// (sizes come from peers: an error, never an abort). Large buffers get
    /// fresh pages from the kernel: untouched ones cost nothing until written.
    pub fn try_zeroed(len: usize) -> Option<Self> {
        if len == 0 {
            return Some(Self::default());
        }
        let layout = Self::layout(len)?;
        if layout.size() >= MAPPED_FROM {
            let cap = layout.size();
            // SAFETY: a fresh anonymous private mapping; no address hint.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return None;
            }
            let ptr = NonNull::new(p.cast::<u8>())?;
            let prefault = if cap >= PREFAULT_FROM { Prefaulter::start(ptr, cap) } else { None };
            return Some(Self { ptr, len, cap, backing: Backing::Mapped, prefault });
        }
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(Self {
            ptr: NonNull::new(p)?,
            len,
            cap: layout.size(),
            backing: Backing::Heap(layout.align()),
            prefault: None,
        })
    }

    /// A buffer over `cap` bytes at `ptr` that `owner` keeps alive (and
    /// frees when dropped), of which the first `len` are the contents.
    ///
    /// # Safety
    /// `ptr..ptr + cap` must be initialised memory, valid for reads and
    /// writes, used by nothing else, and alive until `owner` is dropped;
    /// `len <= cap`.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) unsafe fn from_foreign(ptr: NonNull<u8>, cap: usize, len: usize, owner: Box<dyn Foreign>) -> Self {
        Self { ptr, len: len.min(cap), cap, backing: Backing::Foreign(owner), prefault: None }
    }

    /// The owner of a buffer made by [`from_foreign`](Self::from_foreign),
    /// if it is a `T`.
    #[cfg_attr(not(feature = "ucx"), allow(dead_code))]
    pub(crate) fn foreign<T: 'static>(&self) -> Option<&T> {
        match &self.backing {
            Backing::Foreign(o) => o.as_any().downcast_ref::<T>(),
            _ => None,
        }
    }

    /// Whether the buffer may be recycled for another receive (false for
    /// transport memory a peer may still write into).
    pub fn reusable(&self) -> bool {
        match &self.backing {
            Backing::Foreign(o) => o.reusable(),
            _ => true,
        }
    }

    /// Bytes allocated (at least [`len`](Self::len)).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Length of the contents.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the contents are empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the length of the contents to `len` (at most the capacity: the
    /// bytes are always initialised, zero or left from an earlier use);
    /// returns false and changes nothing when `len` is above the capacity.
    pub fn set_len(&mut self, len: usize) -> bool {
        if len > self.cap {
            return false;
        }
        self.len = len;
        true
    }
}

impl Default for RecvBuf {
    fn default() -> Self {
        Self { ptr: NonNull::dangling(), len: 0, cap: 0, backing: Backing::Heap(1), prefault: None }
    }
}

impl Drop for RecvBuf {
    fn drop(&mut self) {
        // Stop and join the helper before its pages go.
        drop(self.prefault.take());
        if self.cap == 0 {
            return;
        }
        match &self.backing {
            Backing::Foreign(_) => {} // freed by its owner, dropped with self
            Backing::Mapped => {
                // SAFETY: mapped in `try_zeroed` with exactly this length;
                // nothing refers to it any more (the helper has been joined).
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
            }
            Backing::Heap(align) => {
                if let Ok(layout) = Layout::from_size_align(self.cap, *align) {
                    // SAFETY: allocated in `try_zeroed` with exactly this layout.
                    unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
                }
            }
        }
    }
}

impl std::ops::Deref for RecvBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= cap` bytes, all initialised, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for RecvBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for RecvBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for RecvBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl std::fmt::Debug for RecvBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBuf").field("len", &self.len).field("capacity", &self.cap).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_are_page_aligned_zeroed_and_resizable() {
        let mut b = RecvBuf::try_zeroed(1 << 20).unwrap();
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        assert!(b.iter().all(|&x| x == 0));
        b[5] = 9;
        assert!(b.set_len(100));
        assert_eq!(b.len(), 100);
        assert!(!b.set_len(b.capacity() + 1));
        assert_eq!(b.len(), 100);
        let small = RecvBuf::try_zeroed(10).unwrap();
        assert_eq!(small.as_ptr() as usize % LINE, 0);
        assert_eq!(small.capacity(), 64);
        assert!(RecvBuf::try_zeroed(usize::MAX - 10).is_none());
        assert!(RecvBuf::try_zeroed(0).unwrap().is_empty());
        // Just below the page-aligned size: rounded up across the threshold
        // and still freed with the alignment it was allocated with.
        let edge = RecvBuf::try_zeroed(PAGE_ALIGNED_FROM - 1).unwrap();
        assert_eq!(edge.capacity(), PAGE_ALIGNED_FROM);
        drop(edge);
    }

    #[test]
    fn mapped_buffers_are_zero_keep_what_is_written_while_prefaulted_and_free_on_drop() {
        let n = PREFAULT_FROM + 12345;
        let mut b = RecvBuf::try_zeroed(n).unwrap();
        assert!(matches!(b.backing, Backing::Mapped));
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        // Written from the front while the helper populates from the back:
        // nothing it does changes a byte.
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        let tail = b.capacity() - n;
        assert!(b.set_len(b.capacity()));
        assert!(b[n..].iter().all(|&x| x == 0) && tail < PAGE);
        // Dropping joins the helper, even mid-way.
        drop(b);
        let quick = RecvBuf::try_zeroed(n).unwrap();
        drop(quick);
        let mid = RecvBuf::try_zeroed(MAPPED_FROM).unwrap();
        assert!(matches!(mid.backing, Backing::Mapped));
        assert!(mid.prefault.is_none() && mid.iter().all(|&x| x == 0));
    }
}
