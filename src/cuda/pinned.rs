//! Page-locked host buffers for staging copies between host and device,
//! kept in a small pool and handed out as `Bytes` views that return their
//! buffer to the pool when the last view drops (no copy out of the pinned
//! memory on the send path).

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use cudarc::driver::{CudaContext, sys};

use super::error::{GpuError, check};
use crate::util::sync::lock;

/// Staging buffers kept for reuse beyond those in use; more are allocated
/// while a consumer holds chunks, and freed when returned to a full pool.
const KEEP: usize = 8;

/// One page-locked host buffer (`cuMemHostAlloc`, flags 0: cached memory,
/// fast for the CPU to read, unlike write-combined).
pub(super) struct Pinned {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; who may
// touch it when (no DMA in flight) is ordered by the staging code's events.
unsafe impl Send for Pinned {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Pinned {}

impl Pinned {
    fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, GpuError> {
        ctx.bind_to_thread()?;
        let mut p: *mut core::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the driver writes the pointer of a new `len`-byte allocation.
        check(unsafe { sys::cuMemHostAlloc(&mut p, len, 0) }, "cuMemHostAlloc")?;
        Ok(Self { ptr: p.cast(), len, ctx: ctx.clone() })
    }

    /// The buffer's address, for the driver's copies.
    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The first `n` bytes. Only call with no copy into the buffer in flight
    /// (after the event of the last copy completed).
    pub(super) fn bytes(&self, n: usize) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes and `n` is
        // clamped to it; the caller ensures no DMA writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr, n.min(self.len)) }
    }

    /// The first `n` bytes, for filling. Same rule as [`Pinned::bytes`], for
    /// copies out of the buffer.
    pub(super) fn bytes_mut(&mut self, n: usize) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the view exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n.min(self.len)) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc and freed once; no copy is in
        // flight (buffers return to the pool only after their event).
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}

/// A page-locked host buffer of the caller's ([`Gpu::pinned`](super::Gpu::pinned)):
/// receive a tensor into it ([`TensorStream::next_into`](crate::TensorStream::next_into),
/// [`Client::fetch_into_bytes`](crate::Client::fetch_into_bytes)), then
/// [`Gpu::upload_pinned`](super::Gpu::upload_pinned) copies it to the device
/// in one DMA at the bus's speed, with no staging copy. Reuse it: making
/// one page-locks every page, which costs far more than a copy.
pub struct PinnedBuffer {
    pub(super) buf: Pinned,
}

impl PinnedBuffer {
    pub(super) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, GpuError> {
        let mut buf = Pinned::alloc(ctx, len.max(1))?;
        buf.len = len;
        Ok(Self { buf })
    }
}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer").field("len", &self.buf.len).finish()
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // No copy is in flight: `upload_pinned` waits for its DMA.
        self.buf.bytes(self.buf.len)
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        let n = self.buf.len;
        self.buf.bytes_mut(n)
    }
}

/// The pool of staging buffers of one [`Gpu`](super::Gpu).
pub(super) struct StagingPool {
    ctx: Arc<CudaContext>,
    chunk: usize,
    free: Mutex<Vec<Pinned>>,
}

impl StagingPool {
    pub(super) fn new(ctx: Arc<CudaContext>, chunk: usize) -> Arc<Self> {
        Arc::new(Self { ctx, chunk, free: Mutex::new(Vec::new()) })
    }

    /// Bytes per buffer.
    pub(super) fn chunk(&self) -> usize {
        self.chunk
    }

    /// A free buffer, or a new one.
    pub(super) fn take(&self) -> Result<Pinned, GpuError> {
        match lock(&self.free).pop() {
            Some(b) => Ok(b),
            None => Pinned::alloc(&self.ctx, self.chunk),
        }
    }

    /// Returns a buffer with no copy in flight.
    pub(super) fn put(&self, b: Pinned) {
        let mut free = lock(&self.free);
        if free.len() < KEEP {
            free.push(b);
        }
    }

    /// The first `len` bytes of `b` as `Bytes`; `b` returns to this pool
    /// when the last view drops. No copy may be in flight into `b`.
    pub(super) fn hand_out(self: &Arc<Self>, b: Pinned, len: usize) -> Bytes {
        Bytes::from_owner(Chunk { buf: Some(b), len, pool: self.clone() })
    }
}

/// The owner behind a handed-out chunk.
struct Chunk {
    buf: Option<Pinned>,
    len: usize,
    pool: Arc<StagingPool>,
}

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| b.bytes(self.len))
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.put(b);
        }
    }
}
