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
//! - **Receive to GPU** ([`Gpu::upload`]): host bytes are staged through
//!   the pinned buffers, the host copy of chunk k+1 overlapping the DMA of
//!   chunk k.
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

use std::sync::{Arc, Mutex};

use crate::util::sync::lock;
use bytes::Bytes;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice, sys};
use tensorwire_codecs::{DType, Device, Tensor};

/// Why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No CUDA driver library on this machine.
    #[error("CUDA is not available: {0}")]
    NoDriver(String),
    /// The driver is there but the device is not.
    #[error("no CUDA device cuda:{ordinal} (this machine has {count})")]
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// Sizes or shapes that do not fit.
    #[error("{0}")]
    Invalid(String),
}

impl From<cudarc::driver::DriverError> for GpuError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        GpuError::Driver(e.to_string())
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<(), GpuError> {
    if r == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(GpuError::Driver(format!("{what}: {r:?}"))) }
}

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

/// Device names for service info (`cuda:0`, ...), empty without CUDA.
pub(crate) fn device_names() -> Vec<String> {
    available().map(|n| (0..n).map(|i| format!("cuda:{i}")).collect()).unwrap_or_default()
}

/// A tensor in GPU memory (contiguous, row-major).
pub struct DeviceTensor {
    data: CudaSlice<u8>,
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
        self.data.len()
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
    chunk: usize,
    pool: Mutex<Vec<PinnedHostSlice<u8>>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("ordinal", &self.ordinal).field("chunk", &self.chunk).finish()
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
    /// (two are used at a time per copy, and kept for reuse).
    pub fn with_staging(ordinal: usize, chunk: usize) -> Result<Self, GpuError> {
        let count = available()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        Ok(Self { ctx, stream, ordinal, chunk: chunk.max(4096), pool: Mutex::new(Vec::new()) })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn take_buffer(&self) -> Result<PinnedHostSlice<u8>, GpuError> {
        if let Some(b) = lock(&self.pool).pop() {
            return Ok(b);
        }
        // SAFETY: the buffer is written by a copy before it is read.
        // Flags 0: cached pinned memory (write-combined is slow to read).
        Ok(unsafe { self.ctx.alloc_pinned_with_flags::<u8>(self.chunk, 0) }?)
    }

    fn put_buffer(&self, b: PinnedHostSlice<u8>) {
        let mut pool = lock(&self.pool);
        if pool.len() < 4 {
            pool.push(b);
        }
    }

    /// Copies a host tensor to this GPU through the pinned buffers, the
    /// host copy of one chunk overlapping the DMA of the previous one.
    pub fn upload(&self, t: &Tensor) -> Result<DeviceTensor, GpuError> {
        let t = t.contiguous().map_err(|e| GpuError::Invalid(e.to_string()))?;
        let src = t.as_bytes().map_err(|e| GpuError::Invalid(e.to_string()))?;
        // SAFETY: every byte is written by the copies below before use.
        let mut dst = unsafe { self.stream.alloc::<u8>(src.len().max(1)) }?;
        let mut bufs = [self.take_buffer()?, self.take_buffer()?];
        let mut done: [Option<cudarc::driver::CudaEvent>; 2] = [None, None];
        for (k, off) in (0..src.len()).step_by(self.chunk).enumerate() {
            let end = (off + self.chunk).min(src.len());
            let i = k % 2;
            // Wait for this buffer's previous DMA (two chunks ago) only; the
            // other buffer's DMA keeps running while we fill this one.
            if let Some(e) = done[i].take() {
                e.synchronize()?;
            }
            let b = &mut bufs[i];
            b.as_mut_slice()?[..end - off].copy_from_slice(&src[off..end]);
            let staged: &[u8] = &b.as_slice()?[..end - off];
            self.stream.memcpy_htod(staged, &mut dst.slice_mut(off..end))?;
            done[i] = Some(self.stream.record_event(None)?);
        }
        self.stream.synchronize()?;
        for b in bufs {
            self.put_buffer(b);
        }
        Ok(DeviceTensor {
            data: dst,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            ordinal: self.ordinal,
            name: t.name().map(str::to_string),
        })
    }

    /// Copies a device tensor to host memory, chunk by chunk, handing each
    /// chunk to `each` while the next is being copied (double-buffered).
    pub fn download_chunks(
        &self,
        d: &DeviceTensor,
        mut each: impl FnMut(Bytes) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        let n = d.nbytes();
        let mut bufs = [self.take_buffer()?, self.take_buffer()?];
        let starts: Vec<usize> = (0..n).step_by(self.chunk).collect();
        let span = |off: usize| off..(off + self.chunk).min(n);
        if let Some(&first) = starts.first() {
            self.stream.memcpy_dtoh(&d.data.slice(span(first)), &mut bufs[0])?;
        }
        for (k, &off) in starts.iter().enumerate() {
            if let Some(&next) = starts.get(k + 1) {
                self.stream.memcpy_dtoh(&d.data.slice(span(next)), &mut bufs[(k + 1) % 2])?;
            }
            let r = span(off);
            // Waits for chunk k's copy only; chunk k+1's runs meanwhile.
            let chunk = Bytes::copy_from_slice(&bufs[k % 2].as_slice()?[..r.len()]);
            each(chunk)?;
        }
        for b in bufs {
            self.put_buffer(b);
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
            Tensor::new(d.dtype, d.shape.clone(), Bytes::from(out)).map_err(|e| GpuError::Invalid(e.to_string()))?;
        Ok(match &d.name {
            Some(n) => t.with_name(n.clone()),
            None => t,
        })
    }

    /// Exports a device tensor for another process on this host. Keep the
    /// returned guard until the importer has dropped its [`IpcImport`].
    pub fn ipc_export(&self, d: Arc<DeviceTensor>) -> Result<IpcExport, GpuError> {
        let (ptr, _sync) = d.data.device_ptr(&self.stream);
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: ptr is a live allocation of this context; handle is plain data.
        check(unsafe { sys::cuIpcGetMemHandle(&mut handle, ptr) }, "cuIpcGetMemHandle")?;
        let bytes: [u8; 64] = handle.reserved.map(|c| c as u8);
        Ok(IpcExport { handle: bytes, tensor: d.clone() })
    }

    /// Opens a tensor another process exported (same host, device-to-device).
    pub fn ipc_import(
        &self,
        handle: &[u8; 64],
        dtype: DType,
        shape: Vec<usize>,
        nbytes: usize,
    ) -> Result<IpcImport, GpuError> {
        if shape.iter().product::<usize>().checked_mul(dtype.itemsize()) != Some(nbytes) {
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
        Ok(DeviceTensor { data: dst, dtype: i.dtype, shape: i.shape.clone(), ordinal: self.ordinal, name: None })
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
        let g = Gpu::with_staging(g.ordinal(), 1 << 20).unwrap();
        for n in [1usize, (1 << 20) - 1, 1 << 20, (5 << 20) + 3] {
            let t = crate::rpc::builtins::random_tensor(DType::UInt8, &[n], n as u64).unwrap();
            let d = g.upload(&t).unwrap();
            let back = g.download(&d).unwrap();
            assert!(back.data_eq(&t), "{n} bytes");
        }
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
