//! The C allocator's policy for processes that move large tensors.
//!
//! glibc serves a request above its *mmap threshold* (128 KiB at start,
//! raised as large blocks are freed, up to 32 MiB) with a fresh mapping,
//! and gives freed heap memory above its *trim threshold* back to the
//! kernel. HTTP/2 (hyper's h2, under `grpc://` and every tonic service)
//! reads each 1 MiB DATA frame into a buffer of its own, freed when the
//! frame has been consumed: depending on what the process allocated before,
//! those buffers are either recycled from the heap or mapped, zero-filled
//! and unmapped again one by one — then every received byte first costs a
//! page fault (~1 GiB/s on the project's VMs). Measured with `tensorwire
//! bench --transports unix,grpc --sizes 256M`: gRPC fetch 1.7 GiB/s after
//! the unix rows had moved glibc's thresholds, 5.3 GiB/s with them fixed
//! as below; a plain tonic stream in the same process went from 1.3 to 4.2.

/// Requests below this come from the heap (and are recycled there).
const MMAP_THRESHOLD: i32 = 4 << 20;
/// Freed heap memory is kept up to this much (the HTTP/2 connection
/// window of [`GrpcConfig`](tensorwire_transports::config::GrpcConfig),
/// twice) before it is given back to the kernel.
const TRIM_THRESHOLD: i32 = 128 << 20;

/// Fixes the C allocator's thresholds so that buffers up to 4 MiB
/// (HTTP/2 frames, chunks) are recycled from the heap instead of being
/// mapped and faulted in anew each time, and up to 128 MiB of freed heap is
/// kept for reuse. Process-wide: the `tensorwire` CLI calls it at start;
/// a program embedding tensorwire may call it once early in `main` (it is
/// never called for you). Returns false where it does nothing (not glibc).
pub fn tune_allocator() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's tuning parameters; valid
        // parameters and values, no memory is touched.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn glibc_takes_the_thresholds() {
        assert_eq!(super::tune_allocator(), cfg!(all(target_os = "linux", target_env = "gnu")));
    }
}
