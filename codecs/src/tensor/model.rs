//! The [`Tensor`] type: its fields, constructors and accessors. Reading
//! elements is in `data.rs`, views (permute, narrow, ...) in `view.rs`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use crate::dtype::{DType, Element};
use crate::tensor::device::{Device, DeviceBuffer};
use crate::tensor::error::TensorError;
use crate::tensor::layout::{Dims, byte_size, contiguous_dims, dims_from_vec, view_extent};
use crate::tensor::storage::{AlignedBuf, Storage, VecOwner};

/// A tensor: element type, shape, strides, storage offset, storage, and an
/// optional name and string metadata.
///
/// Clone is cheap: the storage is reference counted.
#[derive(Clone)]
pub struct Tensor {
    pub(super) dtype: DType,
    pub(super) shape: Dims,
    pub(super) strides: Dims,
    pub(super) offset: usize,
    pub(super) storage: Storage,
    pub(super) name: Option<String>,
    pub(super) metadata: BTreeMap<String, String>,
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

impl Tensor {
    /// A contiguous host tensor over `data`, which must hold exactly
    /// `numel × itemsize` bytes.
    pub fn new(dtype: DType, shape: impl Into<Vec<usize>>, data: impl Into<Bytes>) -> Result<Self, TensorError> {
        Self::contiguous_over(dtype, dims_from_vec(shape.into()), Storage::Host(data.into()))
    }

    /// [`Tensor::new`] with a borrowed shape, what decoders use: a shape of
    /// up to four dimensions is kept inline, with no allocation for it or
    /// its strides (longer ones are copied to the heap).
    pub fn with_shape(dtype: DType, shape: &[usize], data: impl Into<Bytes>) -> Result<Self, TensorError> {
        Self::contiguous_over(dtype, Dims::from_slice(shape), Storage::Host(data.into()))
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
        let (shape, strides) = (dims_from_vec(shape.into()), dims_from_vec(strides.into()));
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
        Self::contiguous_over(dtype, dims_from_vec(shape.into()), Storage::Device(buffer))
    }

    /// A contiguous tensor over all of `storage`, which must hold exactly
    /// `numel × itemsize` bytes.
    fn contiguous_over(dtype: DType, shape: Dims, storage: Storage) -> Result<Self, TensorError> {
        let expected = byte_size(dtype, &shape)?;
        if expected != storage.len() {
            return Err(TensorError::SizeMismatch { dtype, shape: shape.into_vec(), expected, actual: storage.len() });
        }
        let strides = contiguous_dims(&shape);
        Ok(Self::from_parts_unchecked(dtype, shape, strides, 0, storage))
    }

    pub(super) fn from_parts_unchecked(
        dtype: DType,
        shape: Dims,
        strides: Dims,
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
}
