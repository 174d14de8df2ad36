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
//! ## Layout
//!
//! No file imports a file that imports it back (`tools/import_cycles.py`):
//! the trait sits below its implementations, the registry above them.
//!
//! | file | holds |
//! |---|---|
//! | `lib.rs` | these docs, module declarations, re-exports |
//! | `codec.rs` | the [`Codec`] trait and the types of its signature: [`CodecKind`], [`TensorInfo`], [`Encoded`] |
//! | `registry.rs` | the built-in codecs by kind: [`codec()`], [`available_codecs`] |
//! | `error.rs` | [`EncodeError`], [`DecodeError`] |
//! | `limits.rs` | [`DecodeLimits`] and the shared shape check [`limits::check_shape`] |
//! | `raw.rs` | [`raw::RawCodec`] |
//! | `torch/` | the torch.save codec: `mod.rs` says which file holds what |
//! | `safetensors.rs` | the safetensors codec and file reader/writer |
//! | `checksum.rs` | CRC-32C ([`checksum::crc32c`]) and the zip CRC-32, SIMD where the CPU has it |
//! | `compress.rs` | lz4/zstd per chunk, byte-shuffle, [`compress::choose_auto`] |
//! | `dtype.rs` | [`DType`], [`Element`], [`Complex`], the float8 types |
//! | `tensor/` | the tensor model ([`Tensor`], [`Storage`], [`Device`], [`AlignedBuf`], [`TensorError`]): `mod.rs` says which file holds what |
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

pub mod checksum;
pub mod codec;
pub mod compress;
pub mod delta;
pub mod dtype;
pub mod error;
pub mod limits;
pub mod planes;
pub mod raw;
mod registry;
#[cfg(feature = "safetensors")]
pub mod safetensors;
mod scratch;
pub mod tensor;
#[cfg(feature = "torch")]
pub mod torch;

pub use codec::{Codec, CodecKind, Encoded, TensorInfo};
pub use compress::{Compression, CompressionMode};
pub use dtype::{Complex, DType, Element, F8E4M3, F8E5M2};
pub use error::{DecodeError, EncodeError};
pub use limits::DecodeLimits;
pub use registry::{available_codecs, codec};
pub use tensor::{AlignedBuf, Device, DeviceBuffer, Storage, Tensor, TensorError};
