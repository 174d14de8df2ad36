//! GPU tensors (cargo feature `cuda`; cudarc with the driver loaded at run
//! time, so the crate builds and runs on machines without CUDA).
//!
//! - [`available`] says whether a driver and devices exist, **without
//!   panicking** when `libcuda` is absent (cudarc would, on first use).
//! - [`Gpu`] owns a context, a copy stream and a pool of **pinned host
//!   buffers** (`cuMemHostAlloc` with flags 0: cached, fast for the CPU to
//!   read, unlike cudarc's write-combined default), reused across calls.
//! - **Send from GPU** ([`Client::send_gpu`](crate::Client::send_gpu)):
//!   the tensor is copied device→host chunk by chunk with async copies,
//!   double-buffered, and each chunk leaves on the network while the next
//!   one is being copied.
//! - **Receive to GPU**: chunk by chunk as they arrive
//!   ([`TensorStream::next_to_gpu`](crate::TensorStream::next_to_gpu) in a
//!   server handler, [`Client::fetch_to_gpu`](crate::Client::fetch_to_gpu)),
//!   through an [`Upload`] ([`Gpu::begin_upload`]): bytes are staged through
//!   the pinned buffers as they come, the DMA of one buffer running while
//!   the next fills. [`Gpu::upload`] does the same for a whole host tensor.
//! - **CUDA IPC** ([`Gpu::ipc_export`], [`Gpu::ipc_import`]): a 64-byte
//!   handle lets another process on the host read a device buffer with no
//!   host copy. Lifetime rule: the exporter keeps the [`IpcExport`] (and so
//!   the allocation) alive until the importer has dropped its
//!   [`IpcImport`] (which closes the mapping) and said so.
//! - [`HostRegistration`] page-locks a buffer the caller already owns
//!   (`cuMemHostRegister`), for callers with large host buffers of their own.
//!
//! Asking for a `cuda:N` tensor where there is no CUDA gives
//! [`GpuError::NoDriver`] or [`GpuError::NoDevice`], never a panic.

mod error;
mod pinned;

use std::sync::Arc;

use bytes::Bytes;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
pub use error::GpuError;
use error::check;
pub use pinned::PinnedBuffer;
use pinned::StagingPool;
use tensorwire_codecs::{DType, Device, Tensor};

/// Number of CUDA devices, or why there are none. Never panics: the driver
/// library is looked for before cudarc touches it.
pub fn available() -> Result<usize, GpuError> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError::NoDriver("libcuda.so (the NVIDIA driver) was not found".into()));
    }
    let n = CudaContext::device_count().map_err(|e| GpuError::NoDriver(format!("cuInit failed: {e}")))?;
    Ok(n.max(0) as usize)
}

/// Bytes of a contiguous tensor of `dtype` and `shape`, or why it cannot be.
fn tensor_bytes(dtype: DType, shape: &[usize]) -> Result<usize, GpuError> {
    shape
        .iter()
        .try_fold(dtype.itemsize(), |n, &d| n.checked_mul(d))
        .ok_or_else(|| GpuError::Invalid(format!("a {dtype:?} tensor of shape {shape:?} overflows the address space")))
}

/// Copies `src` into `dst` (same length) on up to four threads: one core's
/// memcpy into pinned memory runs well below the bus (measured on an H100
/// host: ~7 GiB/s against 50 GiB/s of DMA), so staging a large upload is
/// the CPU's copy, not the transfer.
#[cfg(test)]
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    parallel_copy_parts(dst, &[src]);
}

/// Copies `parts`, one after the other, into `dst` (their total length) on
/// up to four threads, each taking an equal share of `dst` from whichever
/// parts cover it (see `parallel_copy`).
fn parallel_copy_parts(dst: &mut [u8], parts: &[&[u8]]) {
    const PART: usize = 2 << 20;
    // Read once: `available_parallelism` reads cgroup files on Linux.
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    debug_assert_eq!(dst.len(), parts.iter().map(|p| p.len()).sum::<usize>());
    // Copies the parts' bytes `start..start + d.len()` into `d`.
    let copy_span = |d: &mut [u8], start: usize| {
        let (mut at, mut written) = (0, 0);
        for p in parts {
            let end = at + p.len();
            if end > start && written < d.len() {
                let from = start + written - at;
                let n = (p.len() - from).min(d.len() - written);
                d[written..written + n].copy_from_slice(&p[from..from + n]);
                written += n;
            }
            at = end;
        }
    };
    let threads = cores.min(4).min(dst.len() / PART).max(1);
    if threads == 1 {
        return copy_span(dst, 0);
    }
    let share = dst.len().div_ceil(threads);
    std::thread::scope(|s| {
        let mut spans = dst.chunks_mut(share).enumerate();
        let first = spans.next();
        for (i, d) in spans {
            s.spawn(move || copy_span(d, i * share));
        }
        if let Some((_, d)) = first {
            copy_span(d, 0);
        }
    });
}

/// Device names for service info (`cuda:0`, ...), empty without CUDA.
pub(crate) fn device_names() -> Vec<String> {
    available().map(|n| (0..n).map(|i| format!("cuda:{i}")).collect()).unwrap_or_default()
}

/// A tensor in GPU memory (contiguous, row-major).
pub struct DeviceTensor {
    /// At least one byte (CUDA allocates no empty buffers); `nbytes` says
    /// how many hold the tensor.
    data: CudaSlice<u8>,
    nbytes: usize,
    dtype: DType,
    shape: Vec<usize>,
    ordinal: usize,
    name: Option<String>,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("device", &format!("cuda:{}", self.ordinal))
            .finish()
    }
}

impl DeviceTensor {
    /// Wraps device memory the caller filled (a kernel's output, say) as a
    /// tensor of `dtype` and `shape`, row-major and contiguous, so it can be
    /// sent with [`Client::send_gpu`](crate::Client::send_gpu). The slice
    /// must hold exactly the tensor's bytes. Reads of it wait for the work
    /// queued on the slice's own stream when they start (work queued on
    /// other streams is the caller's to finish first).
    pub fn from_cuda(data: CudaSlice<u8>, dtype: DType, shape: Vec<usize>) -> Result<Self, GpuError> {
        let nbytes = tensor_bytes(dtype, &shape)?;
        if data.len() != nbytes {
            return Err(GpuError::Invalid(format!(
                "{} bytes of device memory do not hold a {dtype:?} tensor of shape {shape:?} ({nbytes} bytes)",
                data.len()
            )));
        }
        let ordinal = data.stream().context().ordinal();
        Ok(Self { data, nbytes, dtype, shape, ordinal, name: None })
    }

    /// The device memory: [`DeviceTensor::nbytes`] long, or one byte for an
    /// empty tensor made by [`Gpu::upload`] (CUDA allocates no empty
    /// buffers).
    pub fn cuda_slice(&self) -> &CudaSlice<u8> {
        &self.data
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Bytes of data.
    pub fn nbytes(&self) -> usize {
        self.nbytes
    }
    /// The device (`cuda:N`).
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal as u32)
    }
    /// Optional name.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
    /// Builder form: sets the name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }
}

/// A GPU with a copy stream and a pool of pinned staging buffers.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    pool: Arc<StagingPool>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("ordinal", &self.ordinal).field("chunk", &self.pool.chunk()).finish()
    }
}

/// Copies into pinned buffers that may still be running: dropped (however
/// the download ends), it waits for them, so their buffers are never freed
/// under a DMA.
struct InFlight<'a> {
    copies: std::collections::VecDeque<(pinned::Pinned, usize, cudarc::driver::CudaEvent)>,
    stream: &'a Arc<CudaStream>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.copies.is_empty() {
            let _ = self.stream.synchronize();
        }
    }
}

/// A tensor on its way to a GPU piece by piece ([`Gpu::begin_upload`]).
/// Dropped before [`Upload::finish`] (an error, an abandoned transfer), it
/// waits for the copies it queued before freeing anything they touch.
pub struct Upload<'g> {
    gpu: &'g Gpu,
    /// The device allocation (taken by `finish`).
    dst: Option<CudaSlice<u8>>,
    base: sys::CUdeviceptr,
    nbytes: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// Two pinned staging buffers, taken from the pool as needed.
    bufs: [Option<pinned::Pinned>; 2],
    /// The event of each buffer's last DMA, until it is known to be done.
    done: [Option<cudarc::driver::CudaEvent>; 2],
    /// The buffer being filled, and how full it is.
    cur: usize,
    fill: usize,
    /// Bytes whose DMA is queued.
    queued: usize,
}

impl std::fmt::Debug for Upload<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upload")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("received", &self.received())
            .field("nbytes", &self.nbytes)
            .finish()
    }
}

impl Upload<'_> {
    /// Bytes pushed so far.
    pub fn received(&self) -> usize {
        self.queued + self.fill
    }

    /// The tensor's next `data.len()` bytes. Fails when they run past the
    /// tensor's size (nothing of them is copied then).
    pub fn push(&mut self, data: &[u8]) -> Result<(), GpuError> {
        self.push_parts(&[data])
    }

    /// The tensor's next bytes, given as `parts` one after the other (the
    /// pieces that arrived meanwhile): copied into the staging buffers on
    /// several threads when they add up to a few MiB, so a consumer that
    /// fell behind catches up. Fails when they run past the tensor's size
    /// (nothing of them is copied then).
    pub fn push_parts(&mut self, parts: &[&[u8]]) -> Result<(), GpuError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > self.nbytes - self.received() {
            return Err(GpuError::Invalid(format!(
                "{total} bytes more do not fit: the tensor has {} bytes and {} arrived",
                self.nbytes,
                self.received()
            )));
        }
        // Raw driver calls follow, and an upload may have moved threads
        // since `begin_upload` (it is `Send`).
        self.gpu.ctx.bind_to_thread()?;
        let chunk = self.gpu.pool.chunk();
        // What is left to copy: parts[k][at..], then the parts after it.
        let (mut k, mut at) = (0, 0);
        let mut left = total;
        while left > 0 {
            let i = self.cur;
            if self.bufs[i].is_none() {
                self.bufs[i] = Some(self.gpu.pool.take()?);
            }
            if self.fill == 0 {
                // This buffer's previous DMA (two buffers ago) must be done
                // before it is written; the other one's keeps running.
                if let Some(e) = self.done[i].take() {
                    e.synchronize()?;
                }
            }
            // The parts' next `n` bytes fill this buffer as far as they go.
            let n = (chunk - self.fill).min(left);
            let mut span: Vec<&[u8]> = Vec::with_capacity(parts.len() - k);
            let mut need = n;
            while need > 0 {
                let p = &parts[k][at..];
                let take = p.len().min(need);
                span.push(&p[..take]);
                need -= take;
                if take == p.len() {
                    (k, at) = (k + 1, 0);
                } else {
                    at += take;
                }
            }
            let buf = self.bufs[i].as_mut().expect("taken above");
            parallel_copy_parts(&mut buf.bytes_mut(self.fill + n)[self.fill..], &span);
            self.fill += n;
            left -= n;
            if self.fill == chunk || self.received() == self.nbytes {
                self.flush()?;
            }
        }
        Ok(())
    }

    /// Queues the DMA of the buffer being filled and switches buffers.
    fn flush(&mut self) -> Result<(), GpuError> {
        let i = self.cur;
        let buf = self.bufs[i].as_ref().ok_or_else(|| GpuError::Invalid("no staging buffer".into()))?;
        // SAFETY: `fill` bytes of a live pinned buffer into the device
        // allocation at `queued` (`queued + fill <= nbytes`, checked by
        // `push`); the buffer is not written again before the event
        // recorded next completes, nor freed before (`Drop`).
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.base + self.queued as u64,
                    buf.ptr().cast(),
                    self.fill,
                    self.gpu.stream.cu_stream(),
                )
            },
            "cuMemcpyHtoDAsync",
        )?;
        self.done[i] = Some(self.gpu.stream.record_event(None)?);
        self.queued += self.fill;
        self.fill = 0;
        self.cur ^= 1;
        Ok(())
    }

    /// Waits for the last copies and returns the tensor; fails when fewer
    /// bytes arrived than the tensor has.
    pub fn finish(mut self) -> Result<DeviceTensor, GpuError> {
        if self.received() != self.nbytes {
            return Err(GpuError::Invalid(format!(
                "the upload ended after {} of the tensor's {} bytes",
                self.received(),
                self.nbytes
            )));
        }
        self.gpu.stream.synchronize()?;
        self.done = [None, None];
        Ok(DeviceTensor {
            data: self.dst.take().expect("taken once"),
            nbytes: self.nbytes,
            dtype: self.dtype,
            shape: std::mem::take(&mut self.shape),
            ordinal: self.gpu.ordinal,
            name: None,
        })
    }
}

impl Drop for Upload<'_> {
    fn drop(&mut self) {
        // Not finished (an error, an abandoned transfer): a copy may be
        // running even where no event says so (one that was queued before
        // recording its event failed), so wait for the whole stream.
        let unfinished = self.dst.is_some() && (self.queued > 0 || self.bufs.iter().any(Option::is_some));
        if unfinished && self.gpu.stream.synchronize().is_err() {
            // A copy may still be running: leak the buffers rather than
            // free memory under a DMA.
            self.bufs.iter_mut().for_each(|b| std::mem::forget(b.take()));
            return;
        }
        for b in self.bufs.iter_mut().filter_map(Option::take) {
            self.gpu.pool.put(b);
        }
    }
}

/// Default staging chunk: large enough for full-speed DMA, small enough
/// that two of them overlap well with the network.
pub const DEFAULT_STAGING_CHUNK: usize = 8 << 20;

impl Gpu {
    /// Opens device `ordinal` with [`DEFAULT_STAGING_CHUNK`] staging buffers.
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        Self::with_staging(ordinal, DEFAULT_STAGING_CHUNK)
    }

    /// Opens device `ordinal` with pinned staging buffers of `chunk` bytes
    /// (at least 4 KiB), kept for reuse.
    pub fn with_staging(ordinal: usize, chunk: usize) -> Result<Self, GpuError> {
        let count = available()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        let pool = StagingPool::new(ctx.clone(), chunk.max(4096));
        Ok(Self { ctx, stream, ordinal, pool })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Copies a host tensor to this GPU through the pinned buffers, the
    /// host copy of one chunk overlapping the DMA of the previous one.
    pub fn upload(&self, t: &Tensor) -> Result<DeviceTensor, GpuError> {
        let t = t.contiguous().map_err(|e| GpuError::Invalid(e.to_string()))?;
        let src = t.as_bytes().map_err(|e| GpuError::Invalid(e.to_string()))?;
        let mut up = self.begin_upload(t.dtype(), t.shape().to_vec())?;
        up.push(src)?;
        let d = up.finish()?;
        Ok(match t.name() {
            Some(n) => d.with_name(n),
            None => d,
        })
    }

    /// Starts copying a tensor of `dtype` and `shape` to this GPU whose
    /// bytes arrive in order, piece by piece ([`Upload::push`]: chunks off
    /// the network, say), so the copy runs while the rest arrives: each
    /// piece is copied into a pinned staging buffer, and each full buffer
    /// goes to the device by DMA while the next one fills (two buffers).
    /// [`Upload::finish`] waits for the last copy and returns the tensor.
    pub fn begin_upload(&self, dtype: DType, shape: Vec<usize>) -> Result<Upload<'_>, GpuError> {
        let nbytes = tensor_bytes(dtype, &shape)?;
        // Raw driver calls follow on this thread.
        self.ctx.bind_to_thread()?;
        // SAFETY: every byte is written by the upload's copies before the
        // tensor is handed out (`finish` checks that all arrived).
        let mut dst = unsafe { self.stream.alloc::<u8>(nbytes.max(1)) }?;
        // The copies are waited for in `finish` (or on drop), so the
        // allocation's own write record is not needed past here.
        let base = dst.device_ptr_mut(&self.stream).0;
        Ok(Upload {
            gpu: self,
            dst: Some(dst),
            base,
            nbytes,
            dtype,
            shape,
            bufs: [None, None],
            done: [None, None],
            cur: 0,
            fill: 0,
            queued: 0,
        })
    }

    /// A page-locked host buffer of `len` bytes (zeroed), to receive
    /// tensors into and upload with [`Gpu::upload_pinned`].
    pub fn pinned(&self, len: usize) -> Result<PinnedBuffer, GpuError> {
        let mut b = PinnedBuffer::new(&self.ctx, len)?;
        b.fill(0);
        Ok(b)
    }

    /// Copies `src` (a whole tensor of `dtype` and `shape`, row-major) to
    /// this GPU in one DMA, with no staging copy; returns once it is there.
    pub fn upload_pinned(&self, src: &PinnedBuffer, dtype: DType, shape: Vec<usize>) -> Result<DeviceTensor, GpuError> {
        let nbytes = tensor_bytes(dtype, &shape)?;
        if nbytes != src.len() {
            return Err(GpuError::Invalid(format!(
                "{} bytes of pinned memory do not hold a {dtype:?} tensor of shape {shape:?} ({nbytes} bytes)",
                src.len()
            )));
        }
        // SAFETY: fully written by the copy below before it is used.
        let mut dst = unsafe { self.stream.alloc::<u8>(nbytes.max(1)) }?;
        {
            let (dptr, _record) = dst.device_ptr_mut(&self.stream);
            // SAFETY: `nbytes` of a live pinned buffer into a device
            // allocation of at least that size; the buffer is borrowed until
            // the copy has completed (synchronized below).
            check(
                unsafe { sys::cuMemcpyHtoDAsync_v2(dptr, src.buf.ptr().cast(), nbytes, self.stream.cu_stream()) },
                "cuMemcpyHtoDAsync",
            )?;
        }
        self.stream.synchronize()?;
        Ok(DeviceTensor { data: dst, nbytes, dtype, shape, ordinal: self.ordinal, name: None })
    }

    /// Copies a device tensor to host memory chunk by chunk (the next
    /// chunk's DMA runs while `each` handles this one). Each chunk is a view
    /// of a pinned staging buffer, not a copy: the buffer returns to the
    /// pool when the last view drops, so a caller that keeps chunks keeps
    /// pinned memory (and the pool allocates more meanwhile).
    pub fn download_chunks(
        &self,
        d: &DeviceTensor,
        mut each: impl FnMut(Bytes) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let n = d.nbytes();
        let chunk = self.pool.chunk();
        // Raw driver calls below: this thread needs the context, and this
        // stream must wait for whatever the tensor's own stream still has
        // queued (a caller's kernel filling a `from_cuda` tensor).
        self.ctx.bind_to_thread()?;
        self.stream.join(d.data.stream())?;
        let (base, _record) = d.data.device_ptr(&self.stream);
        let issue = |off: usize| -> Result<_, GpuError> {
            let len = chunk.min(n - off);
            let buf = self.pool.take()?;
            // SAFETY: `len` bytes inside the device allocation into a free
            // pinned buffer of at least `len` bytes, read only after the
            // event recorded next completes.
            let r = check(
                unsafe { sys::cuMemcpyDtoHAsync_v2(buf.ptr().cast(), base + off as u64, len, self.stream.cu_stream()) },
                "cuMemcpyDtoHAsync",
            )
            .and_then(|()| Ok(self.stream.record_event(None)?));
            match r {
                Ok(e) => Ok((buf, len, e)),
                Err(e) => {
                    // The copy may have been queued: let it finish before
                    // the buffer is freed.
                    let _ = self.stream.synchronize();
                    Err(e)
                }
            }
        };
        // Up to two copies in flight: (buffer, length, its copy's event).
        // However this ends (an error, `each` failing or panicking), the
        // guard waits for them before their buffers are freed.
        let mut in_flight = InFlight { copies: std::collections::VecDeque::with_capacity(2), stream: &self.stream };
        let mut offsets = (0..n).step_by(chunk);
        for off in offsets.by_ref().take(2) {
            in_flight.copies.push_back(issue(off)?);
        }
        while let Some((buf, len, event)) = in_flight.copies.pop_front() {
            event.synchronize()?;
            if let Some(off) = offsets.next() {
                in_flight.copies.push_back(issue(off)?);
            }
            each(self.pool.hand_out(buf, len))?;
        }
        Ok(())
    }

    /// Copies a device tensor to a host [`Tensor`] (labelled `cpu`).
    pub fn download(&self, d: &DeviceTensor) -> Result<Tensor, GpuError> {
        let mut out = Vec::with_capacity(d.nbytes());
        self.download_chunks(d, |c| {
            out.extend_from_slice(&c);
            Ok(())
        })?;
        let t =
            Tensor::with_shape(d.dtype, &d.shape, Bytes::from(out)).map_err(|e| GpuError::Invalid(e.to_string()))?;
        Ok(match &d.name {
            Some(n) => t.with_name(n.clone()),
            None => t,
        })
    }

    /// Exports a device tensor for another process on this host. Keep the
    /// returned guard until the importer has dropped its [`IpcImport`].
    ///
    /// Memory from CUDA's stream-ordered allocator (which [`Gpu::upload`]
    /// uses) cannot be exported itself: when the driver refuses the
    /// tensor's own memory, it is copied device to device into a plain
    /// allocation that the guard owns, and the importer sees that copy (a
    /// snapshot: later writes on either side are not shared).
    pub fn ipc_export(&self, d: Arc<DeviceTensor>) -> Result<IpcExport, GpuError> {
        self.ctx.bind_to_thread()?;
        self.stream.join(d.data.stream())?;
        let (ptr, sync) = d.data.device_ptr(&self.stream);
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: ptr is a live allocation of this context; handle is plain data.
        let copy = if unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) } == sys::CUresult::CUDA_SUCCESS {
            None
        } else {
            let copy = DeviceAlloc::new(&self.ctx, d.nbytes.max(1))?;
            // SAFETY: both are live device allocations of at least `nbytes`.
            check(
                unsafe { sys::cuMemcpyDtoDAsync_v2(copy.ptr, ptr, d.nbytes, self.stream.cu_stream()) },
                "cuMemcpyDtoDAsync",
            )?;
            self.stream.synchronize()?;
            // SAFETY: as above, for the plain allocation.
            check(unsafe { sys::cuIpcGetMemHandle(&mut handle, copy.ptr) }, "cuIpcGetMemHandle")?;
            Some(copy)
        };
        drop(sync);
        let bytes: [u8; 64] = handle.reserved.map(|c| c as u8);
        Ok(IpcExport { handle: bytes, tensor: d, _copy: copy })
    }

    /// Opens a tensor another process exported (same host, device-to-device).
    pub fn ipc_import(
        &self,
        handle: &[u8; 64],
        dtype: DType,
        shape: Vec<usize>,
        nbytes: usize,
    ) -> Result<IpcImport, GpuError> {
        if tensor_bytes(dtype, &shape)? != nbytes {
            return Err(GpuError::Invalid(format!("{nbytes} bytes do not hold a {dtype:?} tensor of shape {shape:?}")));
        }
        self.ctx.bind_to_thread()?;
        let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as core::ffi::c_char) };
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: ptr is written by the driver; the handle came from cuIpcGetMemHandle.
        check(unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags) }, "cuIpcOpenMemHandle")?;
        Ok(IpcImport { ptr, nbytes, dtype, shape, ctx: self.ctx.clone() })
    }

    /// Copies an imported tensor into a new allocation of this GPU (device
    /// to device, no host copy).
    pub fn copy_imported(&self, i: &IpcImport) -> Result<DeviceTensor, GpuError> {
        // SAFETY: fully overwritten by the copy below.
        let mut dst = unsafe { self.stream.alloc::<u8>(i.nbytes.max(1)) }?;
        {
            let (dptr, _sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dst, &self.stream);
            // SAFETY: both ranges are live device allocations of `nbytes`.
            check(
                unsafe { sys::cuMemcpyDtoDAsync_v2(dptr, i.ptr, i.nbytes, self.stream.cu_stream()) },
                "cuMemcpyDtoDAsync",
            )?;
        }
        self.stream.synchronize()?;
        Ok(DeviceTensor {
            data: dst,
            nbytes: i.nbytes,
            dtype: i.dtype,
            shape: i.shape.clone(),
            ordinal: self.ordinal,
            name: None,
        })
    }

    /// Page-locks `buf` (which the caller owns) so copies to and from it
    /// run at DMA speed; unregistered when the guard drops.
    pub fn register_host<'a>(&self, buf: &'a mut [u8]) -> Result<HostRegistration<'a>, GpuError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: buf is a live, exclusively borrowed host range.
        check(
            unsafe {
                sys::cuMemHostRegister_v2(
                    buf.as_mut_ptr() as *mut core::ffi::c_void,
                    buf.len(),
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                )
            },
            "cuMemHostRegister",
        )?;
        Ok(HostRegistration { buf, ctx: self.ctx.clone() })
    }
}

/// An exported device tensor: the handle to give the importer, and the
/// allocation kept alive while this lives.
pub struct IpcExport {
    /// The 64-byte `cudaIpcMemHandle_t`.
    pub handle: [u8; 64],
    tensor: Arc<DeviceTensor>,
    /// The exportable copy, where the tensor's own memory was not.
    _copy: Option<DeviceAlloc>,
}

/// A plain (`cuMemAlloc`) device allocation, which CUDA IPC can export.
struct DeviceAlloc {
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl DeviceAlloc {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, GpuError> {
        ctx.bind_to_thread()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the driver writes the address of a new allocation.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
        Ok(Self { ptr, ctx: ctx.clone() })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemAlloc, freed once, after the copy into
        // it was synchronized.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

impl IpcExport {
    /// The exported tensor.
    pub fn tensor(&self) -> &DeviceTensor {
        &self.tensor
    }
}

/// A device buffer of another process, mapped into this one; the mapping
/// is closed when this drops.
pub struct IpcImport {
    ptr: sys::CUdeviceptr,
    nbytes: usize,
    dtype: DType,
    shape: Vec<usize>,
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for IpcImport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcImport").field("dtype", &self.dtype).field("shape", &self.shape).finish()
    }
}

impl std::fmt::Debug for IpcExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcExport").field("tensor", &self.tensor).finish()
    }
}

impl std::fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration").field("bytes", &self.buf.len()).finish()
    }
}

impl Drop for IpcImport {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: ptr came from cuIpcOpenMemHandle and is closed once.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

/// A caller's host buffer page-locked for DMA until this drops.
pub struct HostRegistration<'a> {
    buf: &'a mut [u8],
    ctx: Arc<CudaContext>,
}

impl HostRegistration<'_> {
    /// The registered buffer.
    pub fn buffer(&mut self) -> &mut [u8] {
        self.buf
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered in register_host and unregistered once.
        let _ = unsafe { sys::cuMemHostUnregister(self.buf.as_mut_ptr() as *mut core::ffi::c_void) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens cuda:0 or prints why GPU tests skip.
    fn gpu() -> Option<Gpu> {
        match Gpu::open(0) {
            Ok(g) => Some(g),
            Err(e) => {
                eprintln!("skipping GPU test: {e}");
                None
            }
        }
    }

    #[test]
    fn parallel_copy_is_exact_at_every_split() {
        for n in [0usize, 1, (2 << 20) - 1, 2 << 20, (4 << 20) + 1, (8 << 20) + 3, 24 << 20] {
            let src: Vec<u8> = (0..n).map(|i| (i * 31 + i / 4099) as u8).collect();
            let mut dst = vec![0u8; n];
            parallel_copy(&mut dst, &src);
            assert!(dst == src, "{n} bytes");
        }
        // In parts of every shape (as pieces off the network arrive),
        // empty ones too.
        let src: Vec<u8> = (0..(9 << 20) + 7).map(|i: usize| (i * 13 + i / 65537) as u8).collect();
        for cuts in [&[][..], &[0, 0, 5], &[1 << 20, 1 << 20, 3 << 20], &[7, (4 << 20) + 1, (4 << 20) + 1, 9 << 20]] {
            let mut parts = Vec::new();
            let mut at = 0;
            for &c in cuts.iter().chain([&src.len()]) {
                let c = c.clamp(at, src.len());
                parts.push(&src[at..c]);
                at = c;
            }
            let mut dst = vec![0u8; src.len()];
            parallel_copy_parts(&mut dst, &parts);
            assert!(dst == src, "cuts {cuts:?}");
        }
    }

    #[test]
    fn no_cuda_is_a_clear_error_not_a_panic() {
        match available() {
            Ok(n) => eprintln!("CUDA present with {n} device(s)"),
            Err(e) => assert!(e.to_string().contains("not available") || e.to_string().contains("cuInit"), "{e}"),
        }
        let e = Gpu::open(1 << 20).unwrap_err();
        assert!(matches!(e, GpuError::NoDriver(_) | GpuError::NoDevice { .. }), "{e}");
    }

    #[test]
    fn upload_download_round_trip_through_the_pinned_pool() {
        let Some(g) = gpu() else { return };
        let small = Gpu::with_staging(g.ordinal(), 1 << 20).unwrap();
        for n in [1usize, (1 << 20) - 1, 1 << 20, (5 << 20) + 3] {
            let t = crate::rpc::builtins::random_tensor(DType::UInt8, &[n], n as u64).unwrap();
            let d = small.upload(&t).unwrap();
            let back = small.download(&d).unwrap();
            assert!(back.data_eq(&t), "{n} bytes");
        }
        // Default chunks: each staged by several threads (parallel_copy).
        let n = (3 * DEFAULT_STAGING_CHUNK) + 12345;
        let t = crate::rpc::builtins::random_tensor(DType::UInt8, &[n], 9).unwrap();
        assert!(g.download(&g.upload(&t).unwrap()).unwrap().data_eq(&t));
    }

    #[test]
    fn ipc_round_trip_in_one_process() {
        let Some(g) = gpu() else { return };
        let t = crate::rpc::builtins::random_tensor(DType::Float32, &[1024, 256], 3).unwrap();
        let d = Arc::new(g.upload(&t).unwrap());
        let e = match g.ipc_export(d.clone()) {
            Ok(e) => e,
            Err(e) => return eprintln!("skipping: IPC not supported here: {e}"),
        };
        // Importing in the exporting process is refused by CUDA; the
        // cross-process path is exercised by the GPU bench (see README).
        assert_eq!(e.tensor().nbytes(), t.nbytes());
    }
}
