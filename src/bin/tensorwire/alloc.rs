//! The program's allocator: mimalloc, asked the way that keeps it on its
//! fast path.
//!
//! A call allocates and frees dozens of small objects (stream state, frame
//! buffers, boxed futures, a 4 KiB tensor) on two threads; mimalloc's
//! per-thread free lists serve them in a fraction of glibc malloc's time
//! (64 calls in flight over shm: ~15–25% more calls per second in A/B runs
//! of `tensorwire bench`). The library itself leaves the allocator to the
//! program that links it.
//!
//! `mimalloc::MiMalloc` passes every request to `mi_malloc_aligned`, whose
//! fast path (in mimalloc v3, the version `libmimalloc-sys` builds by
//! default) covers only blocks up to 1 KiB: a larger one (a boxed future
//! of a few KiB, made for every call) takes its generic path, which
//! over-allocates by the alignment and aligns inside the block — about five
//! times the instructions (callgrind, `tensorwire bench --calls`). Every
//! mimalloc block is aligned to at least 8 bytes, so requests that need no
//! more go to plain `mi_malloc`; the others to `MiMalloc`.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys::{mi_malloc, mi_realloc, mi_zalloc};
use mimalloc::MiMalloc;

/// Every block mimalloc hands out is aligned to this (its word size).
const PLAIN_ALIGN: usize = std::mem::size_of::<usize>();

/// mimalloc, with plain (unaligned) calls for word-aligned requests.
pub struct Allocator;

// SAFETY: every request goes to mimalloc: `mi_malloc`, `mi_zalloc` and
// `mi_realloc` return blocks aligned to at least `PLAIN_ALIGN` (mimalloc
// rounds sizes up to whole words and starts its pages aligned), used only
// when the layout asks for no more; the rest to `MiMalloc`, whose blocks
// `mi_free` and `mi_realloc_aligned` take as well. Null is returned on
// failure, as `GlobalAlloc` requires. (mimalloc's guarded-page debug mode,
// `MI_GUARDED` with the `debug` features, can place a block at a page's end,
// unaligned: this crate does not enable those features.)
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= PLAIN_ALIGN {
            // SAFETY: any size is valid for `mi_malloc` (zero gives a unique pointer).
            unsafe { mi_malloc(layout.size()).cast() }
        } else {
            // SAFETY: the caller's layout, passed on.
            unsafe { MiMalloc.alloc(layout) }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= PLAIN_ALIGN {
            // SAFETY: as in `alloc`.
            unsafe { mi_zalloc(layout.size()).cast() }
        } else {
            // SAFETY: the caller's layout, passed on.
            unsafe { MiMalloc.alloc_zeroed(layout) }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, i.e. from mimalloc.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= PLAIN_ALIGN {
            // SAFETY: `ptr` is a mimalloc block; the result keeps word alignment.
            unsafe { mi_realloc(ptr.cast::<c_void>(), new_size).cast() }
        } else {
            // SAFETY: the caller's arguments, passed on.
            unsafe { MiMalloc.realloc(ptr, layout, new_size) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_keep_their_alignment_and_contents() {
        // Sizes around mimalloc's small-block limit and beyond, alignments
        // both sides of the plain path; realloc keeps the bytes.
        for align in [1, 2, 4, 8, 16, 64, 128, 4096] {
            for size in [1, 7, 24, 1000, 1024, 1025, 2728, 5000, 70_000, 1 << 20] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero size; each block is freed with its layout.
                unsafe {
                    let p = Allocator.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    p.write_bytes(0xAB, size);
                    let q = Allocator.realloc(p, layout, size * 2);
                    assert_eq!(q as usize % align, 0, "realloc: size {size} align {align}");
                    assert!(std::slice::from_raw_parts(q, size).iter().all(|&b| b == 0xAB));
                    Allocator.dealloc(q, Layout::from_size_align(size * 2, align).unwrap());
                    let z = Allocator.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0);
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    Allocator.dealloc(z, layout);
                }
            }
        }
    }
}
