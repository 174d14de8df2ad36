//! The errors of encoding ([`EncodeError`]) and decoding ([`DecodeError`]),
//! shared by every codec and by compression.

use crate::tensor::TensorError;

/// Errors from encoding.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The tensor itself was unusable (e.g. on a device).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The codec cannot represent this tensor.
    #[error("the {codec} codec cannot encode this tensor: {reason}")]
    Unsupported {
        /// Codec name.
        codec: &'static str,
        /// Why.
        reason: String,
    },
    /// The codec was compiled out (cargo feature disabled).
    #[error("the {0} codec is not enabled in this build (cargo feature {0:?})")]
    NotEnabled(&'static str),
    /// Writing the encoded bytes out failed.
    #[error("writing failed: {0}")]
    Io(#[from] std::io::Error),
    /// Compression failed.
    #[error("{compression} compression failed: {reason}")]
    Compress {
        /// Compression name.
        compression: &'static str,
        /// Why.
        reason: String,
    },
}

/// Errors from decoding what a peer sent or a file held. Each names the limit
/// or the inconsistency found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The decoded tensor is inconsistent (sizes, strides).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A declared size is above the configured limit.
    #[error("{what} declares {size} bytes, above the limit of {limit}")]
    TooLarge {
        /// What declared the size.
        what: &'static str,
        /// The size declared.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Too many dimensions.
    #[error("tensor has {dims} dimensions, above the limit of {limit}")]
    TooManyDims {
        /// Dimensions declared.
        dims: usize,
        /// The limit.
        limit: usize,
    },
    /// A count above its limit (tensors in a file, zip entries, nesting depth).
    #[error("{what}: {count} is above the limit of {limit}")]
    LimitExceeded {
        /// What was counted.
        what: &'static str,
        /// The count.
        count: u64,
        /// The limit.
        limit: u64,
    },
    /// The input ended early.
    #[error("truncated {what}: needed {needed} bytes, {available} available")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        needed: u64,
        /// Bytes there were.
        available: u64,
    },
    /// The input is not in the codec's format.
    #[error("malformed {format}: {reason}")]
    Malformed {
        /// Format name.
        format: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A pickle referred to a global outside the allow-list. Nothing was run.
    #[error(
        "forbidden global {module}.{name} in pickle: only tensor rebuild functions, storage types and plain containers are allowed (nothing was executed)"
    )]
    ForbiddenGlobal {
        /// Module part.
        module: String,
        /// Name part.
        name: String,
    },
    /// A dtype the format or this build cannot represent.
    #[error("unsupported dtype {dtype} in {format}")]
    UnsupportedDType {
        /// Format name.
        format: &'static str,
        /// The dtype as the format named it.
        dtype: String,
    },
    /// A codec name or id nobody knows.
    #[error("unknown codec {0:?} (known: raw, torch, safetensors)")]
    UnknownCodec(String),
    /// The codec was compiled out.
    #[error("the {0} codec is not enabled in this build (cargo feature {0:?})")]
    NotEnabled(&'static str),
    /// Decompression failed or produced another size than declared.
    #[error("{compression} decompression failed: {reason}")]
    Decompress {
        /// Compression name.
        compression: &'static str,
        /// Why.
        reason: String,
    },
    /// A checksum did not match.
    #[error("{what} checksum mismatch: expected {expected:#010x}, computed {actual:#010x}")]
    Checksum {
        /// What was checked.
        what: &'static str,
        /// Declared.
        expected: u32,
        /// Computed.
        actual: u32,
    },
}
