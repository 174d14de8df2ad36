//! [`TorchCodec`]: the torch.save format as a pipeline [`Codec`], one
//! tensor per payload.

use bytes::Bytes;

use crate::codec::{Codec, CodecKind, Encoded, TensorInfo};
use crate::error::{DecodeError, EncodeError};
use crate::limits::DecodeLimits;
use crate::tensor::{Storage, Tensor};
use crate::torch::file::{SaveOptions, load, save};
use crate::torch::object::Object;

/// The torch codec for the pipeline: one tensor per payload, as the Python
/// skytorch server sends (`torch.save(tensor)` bytes).
#[derive(Debug, Clone, Copy, Default)]
pub struct TorchCodec;

impl Codec for TorchCodec {
    fn kind(&self) -> CodecKind {
        CodecKind::Torch
    }

    fn encode(&self, tensor: &Tensor) -> Result<Encoded, EncodeError> {
        // Send only the tensor's own elements, not a whole shared storage.
        let compact = if tensor.is_contiguous() {
            tensor.contiguous()?
        } else if let Some(span) = tensor.dense_span() {
            Tensor::from_strided(tensor.dtype(), tensor.shape(), tensor.strides(), 0, Storage::Host(span))?
        } else {
            tensor.contiguous()?
        };
        let segments = save(&Object::Tensor(compact), &SaveOptions::default())?;
        Ok(Encoded { info: TensorInfo::of(tensor), segments })
    }

    fn decode(&self, info: &TensorInfo, payload: Bytes, limits: &DecodeLimits) -> Result<Tensor, DecodeError> {
        match load(payload, limits)? {
            Object::Tensor(t) => Ok(info.apply_names(t)),
            other => Err(DecodeError::Malformed {
                format: "torch payload",
                reason: format!("expected one tensor, found {}", other.type_name()),
            }),
        }
    }
}
