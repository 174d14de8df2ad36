//! [`RecvBuf`]: an owned, zero-initialised receive buffer, page-aligned when
//! large, whose length can be set anywhere up to its capacity (a recycled
//! buffer serves any tensor that fits). Transports write placed chunks into
//! it ([`Placement`](crate::Placement)); the `tensorwire` crate's receive
//! pool recycles it.

use std::alloc::Layout;
use std::ptr::NonNull;

/// Buffers of at least this many bytes are page-aligned (smaller ones are
/// aligned to a cache line, enough for every dtype).
pub const PAGE_ALIGNED_FROM: usize = 64 << 10;
const PAGE: usize = 4096;
const LINE: usize = 64;

/// An owned byte buffer: `capacity` zero-initialised bytes from the global
/// allocator (aligned to a page from [`PAGE_ALIGNED_FROM`] bytes up), of
/// which the first `len` are the buffer's contents.
pub struct RecvBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    /// The alignment it was allocated with (freed with the same).
    align: usize,
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
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(Self { ptr: NonNull::new(p)?, len, cap: layout.size(), align: layout.align() })
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
        Self { ptr: NonNull::dangling(), len: 0, cap: 0, align: 1 }
    }
}

impl Drop for RecvBuf {
    fn drop(&mut self) {
        if self.cap > 0
            && let Ok(layout) = Layout::from_size_align(self.cap, self.align)
        {
            // SAFETY: allocated in `try_zeroed` with exactly this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
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
}
