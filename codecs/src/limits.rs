//! [`DecodeLimits`], the bounds every decoder checks before allocating, and
//! [`check_shape`], the shape check the codecs share.

use crate::dtype::DType;
use crate::error::DecodeError;

/// Limits a decoder enforces before allocating anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest tensor, in bytes of elements (default 16 GiB).
    pub max_tensor_bytes: u64,
    /// Most dimensions (default 64).
    pub max_dims: usize,
    /// Largest pickle program in a torch file, in bytes (default 64 MiB).
    pub max_pickle_bytes: u64,
    /// Deepest nesting of containers in a pickle or value (default 64).
    pub max_depth: usize,
    /// Most tensors in one file (default 1,000,000).
    pub max_tensors: usize,
    /// Most zip entries in a torch file (default 1,000,000).
    pub max_entries: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_tensor_bytes: 16 << 30,
            max_dims: 64,
            max_pickle_bytes: 64 << 20,
            max_depth: 64,
            max_tensors: 1_000_000,
            max_entries: 1_000_000,
        }
    }
}

/// Checks a header's shape against the limits: rank, and element bytes.
pub fn check_shape(dtype: DType, shape: &[usize], limits: &DecodeLimits) -> Result<u64, DecodeError> {
    if shape.len() > limits.max_dims {
        return Err(DecodeError::TooManyDims { dims: shape.len(), limit: limits.max_dims });
    }
    let bytes = crate::tensor::byte_size(dtype, shape)? as u64;
    if bytes > limits.max_tensor_bytes {
        return Err(DecodeError::TooLarge { what: "tensor", size: bytes, limit: limits.max_tensor_bytes });
    }
    Ok(bytes)
}
