//! The [`Codec`] trait: tensor ⇄ payload bytes, with the header information
//! ([`TensorInfo`]) that travels in a tensor's first chunk.
//!
//! A codec turns one tensor into an [`Encoded`] payload: a list of byte
//! segments (slices of the tensor's storage where possible, so encoding is
//! zero-copy) and decodes a payload back. Compression is not a codec: it is
//! applied per chunk on top of any codec (see [`crate::compress`]), so whole-file
//! formats (torch.save zip, safetensors) and raw bytes all stream compressed.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use bytes::Bytes;

use crate::dtype::DType;
use crate::tensor::{Device, Tensor, TensorError};

/// Which codec produced a payload. Travels in each tensor's header, so a
/// receiver decodes without out-of-band configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[non_exhaustive]
pub enum CodecKind {
    /// The element bytes as they are.
    #[default]
    Raw,
    /// A `torch.save()` zip archive.
    Torch,
    /// A safetensors file.
    Safetensors,
}

impl CodecKind {
    /// Every codec kind.
    pub const ALL: [CodecKind; 3] = [CodecKind::Raw, CodecKind::Torch, CodecKind::Safetensors];

    /// `"raw"`, `"torch"` or `"safetensors"`.
    pub const fn name(self) -> &'static str {
        match self {
            CodecKind::Raw => "raw",
            CodecKind::Torch => "torch",
            CodecKind::Safetensors => "safetensors",
        }
    }
}

impl fmt::Display for CodecKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CodecKind {
    type Err = DecodeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "raw" => Ok(CodecKind::Raw),
            "torch" | "pt" | "torch.save" => Ok(CodecKind::Torch),
            "safetensors" | "st" => Ok(CodecKind::Safetensors),
            _ => Err(DecodeError::UnknownCodec(s.to_string())),
        }
    }
}

/// What a tensor's first chunk says about it.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TensorInfo {
    /// Element type (for whole-file codecs: informational, the file decides).
    pub dtype: Option<DType>,
    /// Shape.
    pub shape: Vec<usize>,
    /// Strides in elements; None for row-major contiguous.
    pub strides: Option<Vec<usize>>,
    /// Offset of the first element in the payload, in elements (raw codec).
    pub storage_offset: usize,
    /// Where the tensor lived at the sender.
    pub device: Device,
    /// The tensor's name.
    pub name: Option<String>,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
}

impl TensorInfo {
    /// The header for `tensor` as it is (shape, dtype, name, metadata; contiguous strides).
    pub fn of(tensor: &Tensor) -> Self {
        Self {
            dtype: Some(tensor.dtype()),
            shape: tensor.shape().to_vec(),
            strides: None,
            storage_offset: 0,
            device: tensor.device(),
            name: tensor.name().map(str::to_string),
            metadata: tensor.metadata().clone(),
        }
    }

    /// Copies name and metadata onto a decoded tensor.
    pub fn apply_names(&self, mut tensor: Tensor) -> Tensor {
        if let Some(n) = &self.name {
            tensor.set_name(n.clone());
        }
        if !self.metadata.is_empty() {
            tensor.metadata_mut().extend(self.metadata.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        tensor
    }
}

/// An encoded payload: segments sent back to back, and the header.
#[derive(Clone, Debug, Default)]
pub struct Encoded {
    /// Header information for the first chunk.
    pub info: TensorInfo,
    /// Payload bytes, in order. Large segments are slices of the tensor's
    /// storage (no copy); small ones are codec-written headers.
    pub segments: Vec<Bytes>,
}

impl Encoded {
    /// Total payload length in bytes.
    pub fn len(&self) -> u64 {
        self.segments.iter().map(|s| s.len() as u64).sum()
    }

    /// True when the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.segments.iter().all(Bytes::is_empty)
    }

    /// The payload as one buffer (copies unless there is a single segment).
    pub fn to_bytes(&self) -> Bytes {
        match self.segments.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => {
                let mut v = Vec::with_capacity(self.len() as usize);
                for s in many {
                    v.extend_from_slice(s);
                }
                Bytes::from(v)
            }
        }
    }
}

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

/// Turns tensors into payload bytes and back.
///
/// Implementations must never trust sizes in the payload: check them against
/// [`DecodeLimits`] before allocating, and return [`DecodeError`] rather than panic.
pub trait Codec: Send + Sync + fmt::Debug {
    /// Which codec this is (travels in the header).
    fn kind(&self) -> CodecKind;

    /// Encodes one host tensor. The segments should borrow the tensor's
    /// storage where the format allows.
    fn encode(&self, tensor: &Tensor) -> Result<Encoded, EncodeError>;

    /// Decodes one tensor from its whole payload. `info` is what the sender's
    /// first chunk declared; whole-file codecs may treat it as a hint.
    fn decode(&self, info: &TensorInfo, payload: Bytes, limits: &DecodeLimits) -> Result<Tensor, DecodeError>;
}

/// The built-in codec for `kind`, if its cargo feature is enabled.
pub fn codec(kind: CodecKind) -> Result<&'static dyn Codec, DecodeError> {
    match kind {
        CodecKind::Raw => Ok(&crate::raw::RawCodec),
        #[cfg(feature = "torch")]
        CodecKind::Torch => Ok(&crate::torch::TorchCodec),
        #[cfg(not(feature = "torch"))]
        CodecKind::Torch => Err(DecodeError::NotEnabled("torch")),
        #[cfg(feature = "safetensors")]
        CodecKind::Safetensors => Ok(&crate::safetensors::SafetensorsCodec),
        #[cfg(not(feature = "safetensors"))]
        CodecKind::Safetensors => Err(DecodeError::NotEnabled("safetensors")),
    }
}

/// Codecs compiled into this build.
pub fn available_codecs() -> Vec<CodecKind> {
    CodecKind::ALL.into_iter().filter(|k| codec(*k).is_ok()).collect()
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

/// Returns `data` if its address suits `align`, otherwise a 16-byte aligned copy.
pub fn aligned(data: Bytes, align: usize) -> Bytes {
    if (data.as_ptr() as usize).is_multiple_of(align.max(1)) {
        data
    } else {
        crate::tensor::AlignedBuf::from_slice(&data).freeze()
    }
}
