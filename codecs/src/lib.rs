//! # tensorwire-codecs
//!
//! The tensor model of tensorwire and the codecs that turn tensors into bytes:
//!
//! ```text
//!  Tensor (dtype, shape, strides, Bytes storage)
//!     │ Codec::encode                     ▲ Codec::decode
//!     ▼                                   │
//!  Encoded { info, segments: [Bytes] }  payload Bytes (one buffer)
//!     │ per chunk: compress::Compressor   ▲ per chunk: compress::Decompressor
//!     ▼                                   │
//!  chunks on the wire ───────────────────►┘
//! ```
//!
//! | codec | module | payload |
//! |---|---|---|
//! | raw | [`raw`] | the element bytes; strided views travel with their strides |
//! | torch | `torch` | a `torch.save()` zip (read by a safe pickle interpreter) |
//! | safetensors | `safetensors` | a safetensors file |
//!
//! Compression ([`compress`]) is per chunk and composes with every codec.
//!
//! The tensor model lives here rather than in `tensorwire` because the codecs
//! need it and `tensorwire` depends on this crate; `tensorwire` re-exports it.
//!
//! ## Feature flags
//!
//! | feature | default | enables |
//! |---|---|---|
//! | `lz4` | yes | lz4 compression (lz4_flex) |
//! | `zstd` | yes | zstd compression (the zstd C library) |
//! | `torch` | yes | the torch.save-compatible codec |
//! | `safetensors` | yes | the safetensors codec |
#![warn(missing_docs)]

pub mod codec;
pub mod compress;
pub mod dtype;
pub mod raw;
#[cfg(feature = "safetensors")]
pub mod safetensors;
pub mod tensor;
#[cfg(feature = "torch")]
pub mod torch;

pub use codec::{
    Codec, CodecKind, DecodeError, DecodeLimits, EncodeError, Encoded, TensorInfo, available_codecs, codec,
};
pub use compress::{Compression, CompressionMode};
pub use dtype::{Complex, DType, Element, F8E4M3, F8E5M2};
pub use tensor::{AlignedBuf, Device, DeviceBuffer, Storage, Tensor, TensorError};
