//! The [`Codec`] trait: tensor ⇄ payload bytes, with the header information
//! ([`TensorInfo`]) that travels in a tensor's first chunk.
//!
//! A codec turns one tensor into an [`Encoded`] payload: a list of byte
//! segments (slices of the tensor's storage where possible, so encoding is
//! zero-copy) and decodes a payload back. Compression is not a codec: it is
//! applied per chunk on top of any codec (see [`crate::compress`]), so whole-file
//! formats (torch.save zip, safetensors) and raw bytes all stream compressed.
//!
//! This file holds the trait and the types in its signature only; the
//! implementations live in [`crate::raw`], `crate::torch` and
//! `crate::safetensors`, and the lookup by [`CodecKind`] in `registry.rs`
//! ([`crate::codec()`], [`crate::available_codecs`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use bytes::Bytes;

use crate::dtype::DType;
use crate::error::{DecodeError, EncodeError};
use crate::limits::DecodeLimits;
use crate::tensor::{Device, Tensor};

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
            many => concat(many),
        }
    }
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

/// The segments joined into one buffer (always a copy).
pub(crate) fn concat(segments: &[Bytes]) -> Bytes {
    let mut v = Vec::with_capacity(segments.iter().map(Bytes::len).sum());
    for s in segments {
        v.extend_from_slice(s);
    }
    Bytes::from(v)
}
