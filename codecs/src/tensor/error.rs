//! [`TensorError`]: what can go wrong building, viewing or reading a tensor.

use crate::dtype::DType;
use crate::tensor::device::Device;

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
