//! The built-in codecs by [`CodecKind`]: [`codec`] and [`available_codecs`].
//! It sits apart from the [`Codec`] trait because it depends on every
//! implementation, which all depend on the trait.

use crate::codec::{Codec, CodecKind};
use crate::error::DecodeError;

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
