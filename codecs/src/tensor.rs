//! The tensor model: a dtype, a shape, strides and a storage of bytes.
//!
//! A [`Tensor`] is a strided view (shape, strides in elements, storage offset)
//! into a [`Storage`]: host bytes held as [`bytes::Bytes`] (so chunking and
//! slicing never copy) or a device buffer (GPU memory, see [`DeviceBuffer`]).
//! Views made by [`Tensor::permute`], [`Tensor::transpose`] and
//! [`Tensor::narrow`] share the storage; [`Tensor::contiguous`] copies only
//! when the layout needs it.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;

use crate::dtype::{DType, Element};

/// Where a tensor's elements live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory.
    #[default]
    Cpu,
    /// GPU memory of CUDA device N.
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A device string that is neither `cpu` nor `cuda[:N]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown device {0:?}: expected \"cpu\", \"cuda\" or \"cuda:N\"")]
pub struct UnknownDevice(pub String);

impl FromStr for Device {
    type Err = UnknownDevice;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t == "cpu" {
            return Ok(Device::Cpu);
        }
        if t == "cuda" {
            return Ok(Device::Cuda(0));
        }
        if let Some(n) = t.strip_prefix("cuda:")
            && let Ok(n) = n.parse()
        {
            return Ok(Device::Cuda(n));
        }
        Err(UnknownDevice(s.to_string()))
    }
}

/// Memory on an accelerator, implemented by the `tensorwire` crate's `cuda`
/// feature. The codecs never touch device memory: they ask for host bytes,
/// and the pipeline stages device tensors through pinned host buffers.
pub trait DeviceBuffer: Send + Sync + fmt::Debug + 'static {
    /// The device holding the buffer.
    fn device(&self) -> Device;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when the buffer holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes starting at `offset` into host memory.
    fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<(), String>;
    /// For downcasting to the concrete buffer type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// The bytes behind a tensor.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Host memory, shared by reference count.
    Host(Bytes),
    /// Device memory.
    Device(Arc<dyn DeviceBuffer>),
}

impl Storage {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Storage::Host(b) => b.len(),
            Storage::Device(d) => d.len(),
        }
    }

    /// True when the storage holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes live.
    pub fn device(&self) -> Device {
        match self {
            Storage::Host(_) => Device::Cpu,
            Storage::Device(d) => d.device(),
        }
    }
}

/// Errors from building or viewing a tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// `numel × itemsize` differs from the data length.
    #[error("shape {shape:?} of {dtype} needs {expected} bytes, but the data has {actual}")]
    SizeMismatch {
        /// Element type.
        dtype: DType,
        /// Requested shape.
        shape: Vec<usize>,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
    /// The element count or byte size does not fit in `usize`.
    #[error("shape {shape:?} of {dtype} is too large: its byte size overflows")]
    Overflow {
        /// Element type.
        dtype: DType,
        /// Requested shape.
        shape: Vec<usize>,
    },
    /// Strides and shape have different lengths.
    #[error("{strides} strides given for a tensor of {dims} dimensions")]
    StridesLength {
        /// Number of dimensions.
        dims: usize,
        /// Number of strides.
        strides: usize,
    },
    /// The strided view reaches past the end of its storage.
    #[error("the view needs {needed} bytes of storage, but the storage has {available}")]
    OutOfBounds {
        /// Bytes the view reaches.
        needed: usize,
        /// Bytes the storage has.
        available: usize,
    },
    /// A typed view asked for another dtype.
    #[error("the tensor holds {actual}, not {requested}")]
    DTypeMismatch {
        /// The tensor's dtype.
        actual: DType,
        /// The dtype asked for.
        requested: DType,
    },
    /// A borrowed view needs a contiguous tensor.
    #[error("the tensor is not contiguous (strides {strides:?}); call contiguous() or to_vec()")]
    NotContiguous {
        /// The tensor's strides.
        strides: Vec<usize>,
    },
    /// A borrowed typed view needs aligned data.
    #[error("the data of this {dtype} tensor is not {align}-byte aligned; use to_vec() to copy it")]
    Misaligned {
        /// Element type.
        dtype: DType,
        /// Alignment needed.
        align: usize,
    },
    /// The operation needs host memory.
    #[error("the tensor lives on {device}; copy it to the host first")]
    NotOnHost {
        /// Where the tensor lives.
        device: Device,
    },
    /// A dimension index past the tensor's rank.
    #[error("dimension {dim} is out of range for a tensor of {dims} dimensions")]
    InvalidDim {
        /// The dimension asked for.
        dim: usize,
        /// The tensor's rank.
        dims: usize,
    },
    /// `permute` was given something other than a permutation of `0..dims`.
    #[error("{perm:?} is not a permutation of the {dims} dimensions")]
    InvalidPermutation {
        /// The argument.
        perm: Vec<usize>,
        /// The tensor's rank.
        dims: usize,
    },
    /// `narrow` past the end of a dimension.
    #[error("narrow({dim}, {start}, {len}) is out of range for size {size}")]
    Narrow {
        /// Dimension.
        dim: usize,
        /// Start index.
        start: usize,
        /// Length.
        len: usize,
        /// The dimension's size.
        size: usize,
    },
    /// `reshape` to a shape with another element count.
    #[error("cannot reshape {from:?} into {to:?}: element counts differ")]
    Reshape {
        /// Current shape.
        from: Vec<usize>,
        /// Requested shape.
        to: Vec<usize>,
    },
    /// A bool tensor holds a byte other than 0 or 1.
    #[error("bool tensor holds {value} at element {index}; only 0 and 1 are valid")]
    InvalidBool {
        /// Element index.
        index: usize,
        /// The byte found.
        value: u8,
    },
    /// A device copy failed.
    #[error("device copy failed: {0}")]
    Device(String),
}

/// Number of elements of `shape`, or None on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Row-major (C order) strides of `shape`, in elements.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d.max(1));
    }
    strides
}

/// A tensor: element type, shape, strides, storage offset, storage, and an
/// optional name and string metadata.
///
/// Clone is cheap: the storage is reference counted.
#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    storage: Storage,
    name: Option<String>,
    metadata: BTreeMap<String, String>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Tensor");
        d.field("dtype", &self.dtype).field("shape", &self.shape);
        if !self.is_contiguous() {
            d.field("strides", &self.strides);
        }
        if self.offset != 0 {
            d.field("storage_offset", &self.offset);
        }
        d.field("device", &self.device());
        if let Some(n) = &self.name {
            d.field("name", n);
        }
        if !self.metadata.is_empty() {
            d.field("metadata", &self.metadata);
        }
        d.finish()
    }
}

/// Keeps a `Vec<T>` alive as the owner of a [`Bytes`] without copying it.
struct VecOwner<T: Element>(Vec<T>);

impl<T: Element> AsRef<[u8]> for VecOwner<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl Tensor {
    /// A contiguous host tensor over `data`, which must hold exactly
    /// `numel × itemsize` bytes.
    pub fn new(dtype: DType, shape: impl Into<Vec<usize>>, data: impl Into<Bytes>) -> Result<Self, TensorError> {
        let shape = shape.into();
        let data = data.into();
        let expected = byte_size(dtype, &shape)?;
        if expected != data.len() {
            return Err(TensorError::SizeMismatch { dtype, shape, expected, actual: data.len() });
        }
        let strides = contiguous_strides(&shape);
        Ok(Self::from_parts_unchecked(dtype, shape, strides, 0, Storage::Host(data)))
    }

    /// A contiguous tensor copied from a typed slice.
    pub fn from_slice<T: Element>(shape: impl Into<Vec<usize>>, values: &[T]) -> Result<Self, TensorError> {
        Self::new(T::DTYPE, shape, AlignedBuf::from_slice(bytemuck::cast_slice(values)).freeze())
    }

    /// A contiguous tensor that takes ownership of `values` without copying.
    pub fn from_vec<T: Element>(shape: impl Into<Vec<usize>>, values: Vec<T>) -> Result<Self, TensorError> {
        Self::new(T::DTYPE, shape, Bytes::from_owner(VecOwner(values)))
    }

    /// A bool tensor (one byte per element, 0 or 1).
    pub fn from_bools(shape: impl Into<Vec<usize>>, values: &[bool]) -> Result<Self, TensorError> {
        let bytes: Vec<u8> = values.iter().map(|&b| u8::from(b)).collect();
        Self::new(DType::Bool, shape, bytes)
    }

    /// A contiguous tensor of zeros.
    pub fn zeros(dtype: DType, shape: impl Into<Vec<usize>>) -> Result<Self, TensorError> {
        let shape = shape.into();
        let n = byte_size(dtype, &shape)?;
        Self::new(dtype, shape, AlignedBuf::zeroed(n).freeze())
    }

    /// A strided view into `storage`: `strides` and `offset` in elements.
    /// Fails when the view reaches past the storage.
    pub fn from_strided(
        dtype: DType,
        shape: impl Into<Vec<usize>>,
        strides: impl Into<Vec<usize>>,
        offset: usize,
        storage: Storage,
    ) -> Result<Self, TensorError> {
        let shape = shape.into();
        let strides = strides.into();
        if strides.len() != shape.len() {
            return Err(TensorError::StridesLength { dims: shape.len(), strides: strides.len() });
        }
        let needed = view_extent(dtype, &shape, &strides, offset)?;
        if needed > storage.len() {
            return Err(TensorError::OutOfBounds { needed, available: storage.len() });
        }
        Ok(Self::from_parts_unchecked(dtype, shape, strides, offset, storage))
    }

    /// A contiguous tensor in device memory.
    pub fn from_device(
        dtype: DType,
        shape: impl Into<Vec<usize>>,
        buffer: Arc<dyn DeviceBuffer>,
    ) -> Result<Self, TensorError> {
        let shape = shape.into();
        let expected = byte_size(dtype, &shape)?;
        if expected != buffer.len() {
            return Err(TensorError::SizeMismatch { dtype, shape, expected, actual: buffer.len() });
        }
        let strides = contiguous_strides(&shape);
        Ok(Self::from_parts_unchecked(dtype, shape, strides, 0, Storage::Device(buffer)))
    }

    fn from_parts_unchecked(
        dtype: DType,
        shape: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
        storage: Storage,
    ) -> Self {
        Self { dtype, shape, strides, offset, storage, name: None, metadata: BTreeMap::new() }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Size of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Stride of each dimension, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the storage, in elements.
    pub fn storage_offset(&self) -> usize {
        self.offset
    }

    /// Number of dimensions.
    pub fn dim(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        // Checked at construction.
        self.shape.iter().product()
    }

    /// Bytes of the elements (`numel × itemsize`), not of the storage.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.itemsize()
    }

    /// Where the elements live.
    pub fn device(&self) -> Device {
        self.storage.device()
    }

    /// The storage behind the view.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The optional name.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Sets the name.
    pub fn set_name(&mut self, name: impl Into<String>) {
        self.name = Some(name.into());
    }

    /// Builder form of [`Tensor::set_name`].
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.set_name(name);
        self
    }

    /// User metadata (string → string).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Mutable user metadata.
    pub fn metadata_mut(&mut self) -> &mut BTreeMap<String, String> {
        &mut self.metadata
    }

    /// Builder form: adds one metadata entry.
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// True when elements are laid out in row-major order with no gaps
    /// (dimensions of size 1 may have any stride, as in torch).
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut expected = 1usize;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 {
                if s != expected {
                    return false;
                }
                expected *= d;
            }
        }
        true
    }

    /// True when the view covers `numel` consecutive storage elements in some
    /// order (a permutation of a contiguous layout, such as a transpose):
    /// such a tensor travels as its storage span plus strides, with no copy.
    pub fn is_dense(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut dims: Vec<(usize, usize)> =
            self.shape.iter().zip(&self.strides).filter(|(d, _)| **d != 1).map(|(&d, &s)| (s, d)).collect();
        dims.sort_unstable();
        let mut expected = 1usize;
        for (s, d) in dims {
            if s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }

    /// The host storage, or an error for device tensors.
    pub fn host_storage(&self) -> Result<&Bytes, TensorError> {
        match &self.storage {
            Storage::Host(b) => Ok(b),
            Storage::Device(d) => Err(TensorError::NotOnHost { device: d.device() }),
        }
    }

    /// For a dense tensor (see [`Tensor::is_dense`]) on the host: the storage
    /// bytes its elements occupy, without copying. None otherwise.
    pub fn dense_span(&self) -> Option<Bytes> {
        let Storage::Host(b) = &self.storage else {
            return None;
        };
        if !self.is_dense() {
            return None;
        }
        let it = self.dtype.itemsize();
        let start = self.offset * it;
        Some(b.slice(start..start + self.nbytes()))
    }

    /// The elements' bytes in row-major order: a slice of the storage when
    /// contiguous, otherwise a copy.
    pub fn to_contiguous_bytes(&self) -> Result<Bytes, TensorError> {
        let storage = self.host_storage()?;
        let it = self.dtype.itemsize();
        if self.is_contiguous() {
            let start = self.offset * it;
            return Ok(storage.slice(start..start + self.nbytes()));
        }
        let mut out = AlignedBuf::zeroed(self.nbytes());
        let dst = out.as_mut_slice();
        let mut at = 0;
        self.for_each_run(|off, len| {
            dst[at..at + len].copy_from_slice(&storage[off..off + len]);
            at += len;
        });
        Ok(out.freeze())
    }

    /// A contiguous tensor with the same elements (no copy when already
    /// contiguous). Keeps name and metadata.
    pub fn contiguous(&self) -> Result<Tensor, TensorError> {
        let data = self.to_contiguous_bytes()?;
        let mut t = Tensor::new(self.dtype, self.shape.clone(), data)?;
        t.name = self.name.clone();
        t.metadata = self.metadata.clone();
        Ok(t)
    }

    /// The elements' bytes, borrowed; the tensor must be contiguous and on the host.
    pub fn as_bytes(&self) -> Result<&[u8], TensorError> {
        let storage = self.host_storage()?;
        if !self.is_contiguous() {
            return Err(TensorError::NotContiguous { strides: self.strides.clone() });
        }
        let start = self.offset * self.dtype.itemsize();
        Ok(&storage[start..start + self.nbytes()])
    }

    /// A borrowed typed view. Needs matching dtype, a contiguous host tensor
    /// and aligned data (buffers tensorwire allocates always are).
    pub fn as_slice<T: Element>(&self) -> Result<&[T], TensorError> {
        self.check_dtype(T::DTYPE)?;
        let bytes = self.as_bytes()?;
        bytemuck::try_cast_slice(bytes)
            .map_err(|_| TensorError::Misaligned { dtype: self.dtype, align: self.dtype.align() })
    }

    /// The elements copied into a `Vec<T>`, in row-major order; works for any
    /// layout and alignment.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, TensorError> {
        self.check_dtype(T::DTYPE)?;
        let bytes = self.to_contiguous_bytes()?;
        let mut out = vec![T::zeroed(); self.numel()];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&bytes);
        Ok(out)
    }

    /// The elements of a bool tensor; fails on bytes other than 0 or 1.
    pub fn to_bools(&self) -> Result<Vec<bool>, TensorError> {
        self.check_dtype(DType::Bool)?;
        let bytes = self.to_contiguous_bytes()?;
        bytes
            .iter()
            .enumerate()
            .map(|(index, &value)| match value {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(TensorError::InvalidBool { index, value }),
            })
            .collect()
    }

    fn check_dtype(&self, requested: DType) -> Result<(), TensorError> {
        if self.dtype != requested {
            return Err(TensorError::DTypeMismatch { actual: self.dtype, requested });
        }
        Ok(())
    }

    /// A view with dimensions reordered: dimension `i` of the result is
    /// dimension `perm[i]` of `self`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor, TensorError> {
        let dims = self.dim();
        let mut seen = vec![false; dims];
        if perm.len() != dims || perm.iter().any(|&p| p >= dims || std::mem::replace(&mut seen[p], true)) {
            return Err(TensorError::InvalidPermutation { perm: perm.to_vec(), dims });
        }
        let mut t = self.clone();
        t.shape = perm.iter().map(|&p| self.shape[p]).collect();
        t.strides = perm.iter().map(|&p| self.strides[p]).collect();
        Ok(t)
    }

    /// A view with dimensions `a` and `b` swapped.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor, TensorError> {
        let dims = self.dim();
        for d in [a, b] {
            if d >= dims {
                return Err(TensorError::InvalidDim { dim: d, dims });
            }
        }
        let mut perm: Vec<usize> = (0..dims).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// A view of `len` indices of dimension `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor, TensorError> {
        let dims = self.dim();
        if dim >= dims {
            return Err(TensorError::InvalidDim { dim, dims });
        }
        let size = self.shape[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(TensorError::Narrow { dim, start, len, size });
        }
        let mut t = self.clone();
        if len > 0 {
            t.offset += start * self.strides[dim];
        }
        t.shape[dim] = len;
        Ok(t)
    }

    /// The same elements with another shape; copies when not contiguous.
    pub fn reshape(&self, shape: impl Into<Vec<usize>>) -> Result<Tensor, TensorError> {
        let shape = shape.into();
        if checked_numel(&shape) != Some(self.numel()) {
            return Err(TensorError::Reshape { from: self.shape.clone(), to: shape });
        }
        let mut t = if self.is_contiguous() { self.clone() } else { self.contiguous()? };
        t.strides = contiguous_strides(&shape);
        t.shape = shape;
        Ok(t)
    }

    /// CRC-32C of the elements' bytes in row-major order (what the CLI prints,
    /// so that sender and receiver agree whatever the layout).
    pub fn crc32c(&self) -> Result<u32, TensorError> {
        let storage = self.host_storage()?;
        let mut crc = 0u32;
        self.for_each_run(|off, len| crc = crc32c::crc32c_append(crc, &storage[off..off + len]));
        Ok(crc)
    }

    /// True when both tensors have the same dtype, shape and element bytes
    /// (layouts may differ). Names and metadata are not compared.
    pub fn data_eq(&self, other: &Tensor) -> bool {
        if self.dtype != other.dtype || self.shape != other.shape {
            return false;
        }
        match (self.to_contiguous_bytes(), other.to_contiguous_bytes()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }

    /// Calls `f(byte_offset, byte_len)` for each run of storage bytes that
    /// holds consecutive elements, in row-major element order.
    fn for_each_run(&self, mut f: impl FnMut(usize, usize)) {
        let it = self.dtype.itemsize();
        if self.numel() == 0 {
            return;
        }
        // Drop size-1 dimensions, then merge neighbours that are contiguous
        // with each other, so a contiguous tensor is one run.
        let mut dims: Vec<(usize, usize)> = Vec::with_capacity(self.dim());
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            if d == 1 {
                continue;
            }
            if let Some(last) = dims.last_mut()
                && last.1 == s * d
            {
                last.0 *= d;
                last.1 = s;
                continue;
            }
            dims.push((d, s));
        }
        let base = self.offset * it;
        let (run_elems, outer) = match dims.last() {
            None => (1, &dims[..0]),
            Some(&(d, 1)) => (d, &dims[..dims.len() - 1]),
            Some(_) => (1, &dims[..]),
        };
        let run = run_elems * it;
        if outer.is_empty() {
            f(base, run);
            return;
        }
        let mut idx = vec![0usize; outer.len()];
        let mut off = base;
        loop {
            f(off, run);
            // Odometer increment over the outer dimensions.
            let mut k = outer.len();
            loop {
                if k == 0 {
                    return;
                }
                k -= 1;
                idx[k] += 1;
                off += outer[k].1 * it;
                if idx[k] < outer[k].0 {
                    break;
                }
                off -= outer[k].0 * outer[k].1 * it;
                idx[k] = 0;
            }
        }
    }
}

/// A zero-initialised byte buffer aligned to 16 bytes (enough for every
/// dtype), which freezes into [`Bytes`] without a copy. Receivers allocate
/// tensors with it, so typed views of received data never fail on alignment.
pub struct AlignedBuf {
    words: Vec<u128>,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes. Large buffers come from `calloc`, so untouched pages
    /// cost nothing until written.
    pub fn zeroed(len: usize) -> Self {
        Self { words: vec![0u128; len.div_ceil(16)], len }
    }

    /// A copy of `src`.
    pub fn from_slice(src: &[u8]) -> Self {
        let mut b = Self::zeroed(src.len());
        b.as_mut_slice().copy_from_slice(src);
        b
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// Converts into [`Bytes`] without copying.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish()
    }
}

/// Bytes needed for `shape` of `dtype`, checked for overflow.
pub fn byte_size(dtype: DType, shape: &[usize]) -> Result<usize, TensorError> {
    checked_numel(shape)
        .and_then(|n| n.checked_mul(dtype.itemsize()))
        .ok_or_else(|| TensorError::Overflow { dtype, shape: shape.to_vec() })
}

/// Storage bytes a strided view reaches: `(offset + Σ(dᵢ-1)·sᵢ + 1) × itemsize`,
/// or 0 for an empty view.
pub fn view_extent(dtype: DType, shape: &[usize], strides: &[usize], offset: usize) -> Result<usize, TensorError> {
    let overflow = || TensorError::Overflow { dtype, shape: shape.to_vec() };
    let n = checked_numel(shape).ok_or_else(overflow)?;
    n.checked_mul(dtype.itemsize()).ok_or_else(overflow)?;
    if n == 0 {
        return Ok(0);
    }
    let mut last = offset;
    for (&d, &s) in shape.iter().zip(strides) {
        last = (d - 1).checked_mul(s).and_then(|x| x.checked_add(last)).ok_or_else(overflow)?;
    }
    last.checked_add(1).and_then(|x| x.checked_mul(dtype.itemsize())).ok_or_else(overflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> Tensor {
        let n = checked_numel(shape).unwrap();
        Tensor::from_vec(shape.to_vec(), (0..n as i32).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn size_mismatch_is_an_error() {
        let e = Tensor::new(DType::Float32, [2, 3], vec![0u8; 20]).unwrap_err();
        assert_eq!(e, TensorError::SizeMismatch { dtype: DType::Float32, shape: vec![2, 3], expected: 24, actual: 20 });
        assert!(e.to_string().contains("needs 24 bytes"));
        assert!(matches!(Tensor::zeros(DType::Float64, [usize::MAX, 2]), Err(TensorError::Overflow { .. })));
    }

    #[test]
    fn typed_views() {
        let t = Tensor::from_slice([2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(matches!(t.as_slice::<i32>(), Err(TensorError::DTypeMismatch { .. })));
        // A view starting at an odd byte address: borrowed views refuse, to_vec copies.
        let raw = Bytes::from(vec![0u8; 17]);
        let t = Tensor::new(DType::Float32, [4], raw.slice(1..17)).unwrap();
        if !(raw.as_ptr() as usize + 1).is_multiple_of(4) {
            assert!(matches!(t.as_slice::<f32>(), Err(TensorError::Misaligned { .. })));
        }
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![0.0; 4]);
        let h = Tensor::from_slice([2], &[half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)]).unwrap();
        assert_eq!(h.dtype(), DType::BFloat16);
        assert_eq!(h.to_vec::<half::bf16>().unwrap()[1].to_f32(), -2.0);
        let b = Tensor::from_bools([3], &[true, false, true]).unwrap();
        assert_eq!(b.to_bools().unwrap(), vec![true, false, true]);
        let bad = Tensor::new(DType::Bool, [1], vec![7u8]).unwrap();
        assert_eq!(bad.to_bools().unwrap_err(), TensorError::InvalidBool { index: 0, value: 7 });
    }

    #[test]
    fn transpose_is_dense_and_gathers_correctly() {
        let t = iota(&[2, 3]);
        let tt = t.transpose(0, 1).unwrap();
        assert_eq!(tt.shape(), &[3, 2]);
        assert!(!tt.is_contiguous());
        assert!(tt.is_dense());
        assert_eq!(tt.to_vec::<i32>().unwrap(), vec![0, 3, 1, 4, 2, 5]);
        assert_eq!(tt.contiguous().unwrap().as_slice::<i32>().unwrap(), &[0, 3, 1, 4, 2, 5]);
    }

    #[test]
    fn narrow_is_not_dense() {
        let t = iota(&[4, 4]);
        let n = t.narrow(1, 1, 2).unwrap();
        assert!(!n.is_dense());
        assert_eq!(n.to_vec::<i32>().unwrap(), vec![1, 2, 5, 6, 9, 10, 13, 14]);
        let r = t.narrow(0, 2, 2).unwrap();
        assert!(r.is_contiguous());
        assert_eq!(r.as_slice::<i32>().unwrap(), &[8, 9, 10, 11, 12, 13, 14, 15]);
        assert!(t.narrow(0, 3, 2).is_err());
    }

    #[test]
    fn strided_bounds_are_checked() {
        let storage = Storage::Host(Bytes::from(vec![0u8; 16]));
        assert!(Tensor::from_strided(DType::Float32, [2, 2], [2, 1], 0, storage.clone()).is_ok());
        let e = Tensor::from_strided(DType::Float32, [2, 2], [2, 1], 1, storage.clone()).unwrap_err();
        assert_eq!(e, TensorError::OutOfBounds { needed: 20, available: 16 });
        assert!(Tensor::from_strided(DType::Float32, [2], [1, 1], 0, storage).is_err());
    }

    #[test]
    fn crc_ignores_layout() {
        let t = iota(&[5, 7]);
        let tt = t.transpose(0, 1).unwrap();
        let c = tt.contiguous().unwrap();
        assert_eq!(tt.crc32c().unwrap(), c.crc32c().unwrap());
        assert_eq!(t.crc32c().unwrap(), crc32c::crc32c(t.as_bytes().unwrap()));
        assert!(tt.data_eq(&c));
        assert!(!t.data_eq(&c));
    }

    #[test]
    fn three_d_permutation_matches_naive_gather() {
        let t = iota(&[3, 4, 5]);
        let p = t.permute(&[2, 0, 1]).unwrap();
        let v = p.to_vec::<i32>().unwrap();
        let src = t.as_slice::<i32>().unwrap();
        let mut expected = Vec::new();
        for k in 0..5 {
            for i in 0..3 {
                for j in 0..4 {
                    expected.push(src[i * 20 + j * 5 + k]);
                }
            }
        }
        assert_eq!(v, expected);
        let s = p.narrow(0, 1, 3).unwrap().narrow(2, 1, 2).unwrap();
        let sv = s.to_vec::<i32>().unwrap();
        let mut exp2 = Vec::new();
        for k in 1..4 {
            for i in 0..3 {
                for j in 1..3 {
                    exp2.push(src[i * 20 + j * 5 + k]);
                }
            }
        }
        assert_eq!(sv, exp2);
    }

    #[test]
    fn devices_parse() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert!("tpu".parse::<Device>().is_err());
    }
}
