//! Copies of large buffers that bypass the writer's caches.
//!
//! A tensor copied into a shared-memory segment is read (if at all) by
//! another process, later, and is larger than the caches: an ordinary copy
//! first reads every destination line into the cache (a read-for-ownership)
//! and then evicts it again, so the memory bus carries the destination
//! twice. Non-temporal stores write whole lines straight to memory. Measured
//! on this project's VMs (AMD EPYC, 256 MiB warm memfd destination, 1 MiB
//! pieces): `memcpy` 8.7 GiB/s, one 256 MiB `memcpy` 9.4 GiB/s, non-temporal
//! 15.3 GiB/s; on an Intel Xeon VM: `memcpy` of 1 MiB pieces 6.4 GiB/s, one
//! 256 MiB `memcpy` 10.2, non-temporal 1 MiB pieces reading four pages at
//! once 10.6 (one page at a time: 7.9).
//!
//! [`copy_streaming`] uses them on x86-64 (SSE2, part of the baseline) for
//! copies of at least [`STREAMING_FROM`] bytes and falls back to an ordinary
//! copy otherwise (and on other architectures). The streamed part is fenced
//! before it returns (the few bytes around it are ordinary stores, which
//! x86 keeps in order), so the bytes are visible to another core before
//! anything the caller publishes afterwards (a frame naming the segment).

/// Copies shorter than this are ordinary copies: the destination may well
/// be read soon, from the cache.
pub const STREAMING_FROM: usize = 256 << 10;

/// Destinations (a segment, a tensor's receive buffer) of at least this
/// many bytes are filled with [`copy_streaming`]: a tensor this large leaves
/// the caches anyway (a quarter of the 32 MiB L3 of the VMs this was
/// measured on), and streaming it to memory skips reading every destination
/// line first. Smaller ones are copied as usual, so that a reader soon
/// after finds them in the cache.
pub const STREAMED_DESTINATIONS_FROM: usize = 8 << 20;

/// Copies `src` into `dst` (same length), with non-temporal stores for
/// large copies on x86-64; see the module docs.
///
/// # Panics
/// When the lengths differ (as `copy_from_slice`).
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: destination and source lengths differ");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAMING_FROM {
        // Up to the first 64-byte boundary of the destination: ordinary.
        let head = dst.as_ptr().align_offset(64).min(src.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (src.len() - head) & !63;
        // SAFETY: both ranges lie inside their slices (head + body <= len),
        // the destination range starts 64-byte aligned, so each store is to
        // a 16-byte aligned address (or, with head clamped to the length,
        // body is 0 and nothing is stored), and `&mut`/`&` slices do not
        // overlap.
        unsafe { stream_lines(dst.as_mut_ptr().add(head), src.as_ptr().add(head), body) };
        let done = head + body;
        dst[done..].copy_from_slice(&src[done..]);
        return;
    }
    dst.copy_from_slice(src);
}

/// Each of the four streams [`stream_lines`] reads at once covers this
/// many bytes per round (a page).
#[cfg(target_arch = "x86_64")]
const BLOCK: usize = 4096;

/// Copies `len` bytes (a multiple of 64) from `src` to `dst` (64-byte
/// aligned) with non-temporal stores, then fences them.
///
/// Four pages at a time, a line of each in turn: four read streams keep
/// more of the memory system busy than one (glibc's copy of large buffers
/// reads the same way). Measured on an Intel Xeon VM (1 MiB pieces into a
/// warm 256 MiB memfd mapping): one stream 7.9 GiB/s, two 9.9, four 10.6,
/// eight 10.6, sixteen 9.4; glibc `memcpy` of the same pieces 6.4.
///
/// # Safety
/// `len` must be a multiple of 64, `src..src+len` readable, `dst..dst+len`
/// writable, the two must not overlap, and `dst` must be 16-byte aligned.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines(dst: *mut u8, src: *const u8, len: usize) {
    debug_assert!(len.is_multiple_of(64), "stream_lines copies whole lines");
    let mut done = 0;
    while len - done >= 4 * BLOCK {
        let mut off = 0;
        while off < BLOCK {
            for b in 0..4 {
                let at = done + b * BLOCK + off;
                // SAFETY: at + 64 <= done + 4 * BLOCK <= len: in bounds per
                // the caller; `at` is a multiple of 64 from `dst`.
                unsafe { stream_line(dst.add(at), src.add(at)) };
            }
            off += 64;
        }
        done += 4 * BLOCK;
    }
    while done < len {
        // SAFETY: done + 64 <= len (both multiples of 64).
        unsafe { stream_line(dst.add(done), src.add(done)) };
        done += 64;
    }
    // Non-temporal stores are weakly ordered: fence them before the caller
    // publishes what it copied (a release store does not order them).
    // SAFETY: SSE2 is part of the x86-64 baseline.
    unsafe { std::arch::x86_64::_mm_sfence() };
}

/// Copies one 64-byte line with non-temporal stores (not fenced).
///
/// # Safety
/// 64 bytes at `src` readable, 64 at `dst` writable and 16-byte aligned.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stream_line(dst: *mut u8, src: *const u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // SAFETY: per the caller; loads may be unaligned, stores are aligned.
    unsafe {
        let s = src.cast::<__m128i>();
        let d = dst.cast::<__m128i>();
        let (a, b, c, e) =
            (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
        _mm_stream_si128(d, a);
        _mm_stream_si128(d.add(1), b);
        _mm_stream_si128(d.add(2), c);
        _mm_stream_si128(d.add(3), e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_whatever_the_alignment_and_length() {
        let src: Vec<u8> = (0..STREAMING_FROM * 2 + 200).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut dst = vec![0xAAu8; STREAMING_FROM * 2 + 400];
        // Offsets into `dst` that make the streamed part start at once
        // (head 0) or after 63 bytes, whatever the allocator returned.
        let aligned = dst.as_ptr().align_offset(64);
        for (head, src_off, len) in [
            (0, 0, STREAMING_FROM),                         // head 0, tail 0
            (63, 0, STREAMING_FROM + 63),                   // head 63, tail 0
            (0, 7, STREAMING_FROM + 63),                    // head 0, tail 63
            (63, 3, STREAMING_FROM + 126),                  // head 63, tail 63
            (1, 5, STREAMING_FROM * 2 + 1),                 // head 1, tail 0
            (0, 9, STREAMING_FROM + 3 * 4096 + 5 * 64 + 7), // lines after the last four pages
            (0, 0, 100),                                    // short: an ordinary copy
            (3, 1, 0),                                      // empty
        ] {
            let at = aligned + (64 - head) % 64;
            dst.fill(0xAA);
            copy_streaming(&mut dst[at..at + len], &src[src_off..src_off + len]);
            assert_eq!(&dst[at..at + len], &src[src_off..src_off + len], "{head} {src_off} {len}");
            assert!(dst[..at].iter().all(|&b| b == 0xAA), "nothing written before");
            assert!(dst[at + len..].iter().all(|&b| b == 0xAA), "nothing written past");
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn refuses_slices_of_different_lengths() {
        copy_streaming(&mut [0u8; 4], &[1u8; 5]);
    }
}
