//! The raw codec: the payload is the tensor's element bytes.
//!
//! Encoding never copies a contiguous or dense tensor (a transpose, a
//! permutation): the payload is a slice of the storage and the header carries
//! the strides. Other views (narrowed, expanded) are gathered into a
//! contiguous copy first.

use bytes::Bytes;

use crate::codec::{Codec, CodecKind, Encoded, TensorInfo};
use crate::error::{DecodeError, EncodeError};
use crate::limits::{DecodeLimits, check_shape};
use crate::tensor::{Storage, Tensor, aligned, is_row_major, view_extent};

/// See the [module docs](self).
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    fn kind(&self) -> CodecKind {
        CodecKind::Raw
    }

    fn encode(&self, tensor: &Tensor) -> Result<Encoded, EncodeError> {
        let mut info = TensorInfo::of(tensor);
        let data = if tensor.is_contiguous() {
            tensor.to_contiguous_bytes()?
        } else if let Some(span) = tensor.dense_span() {
            // Strides stay as they are, relative to the span's first element.
            info.strides = Some(tensor.strides().to_vec());
            span
        } else {
            tensor.to_contiguous_bytes()?
        };
        Ok(Encoded { info, segments: vec![data] })
    }

    fn decode(&self, info: &TensorInfo, payload: Bytes, limits: &DecodeLimits) -> Result<Tensor, DecodeError> {
        let dtype = info
            .dtype
            .ok_or_else(|| DecodeError::Malformed { format: "raw tensor header", reason: "no dtype given".into() })?;
        let nbytes = check_shape(dtype, &info.shape, limits)?;
        if payload.len() as u64 != nbytes {
            return Err(DecodeError::Malformed {
                format: "raw payload",
                reason: format!(
                    "shape {:?} of {dtype} needs {nbytes} bytes, but {} arrived",
                    info.shape,
                    payload.len()
                ),
            });
        }
        let payload = aligned(payload, dtype.align());
        let tensor = match &info.strides {
            None => Tensor::with_shape(dtype, &info.shape, payload)?,
            Some(strides) if is_row_major(&info.shape, strides) => Tensor::with_shape(dtype, &info.shape, payload)?,
            Some(strides) => {
                // Only dense layouts travel strided: the payload must hold
                // exactly the view's elements, none twice (a zero stride would
                // let a small payload claim a huge logical size).
                let extent = view_extent(dtype, &info.shape, strides, 0)?;
                let t = Tensor::from_strided(dtype, info.shape.clone(), strides.clone(), 0, Storage::Host(payload))?;
                if extent as u64 != nbytes || !t.is_dense() {
                    return Err(DecodeError::Malformed {
                        format: "raw tensor header",
                        reason: format!("strides {strides:?} for shape {:?} are not a dense layout", info.shape),
                    });
                }
                t
            }
        };
        Ok(info.apply_names(tensor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn round_trip(t: &Tensor) -> Tensor {
        let e = RawCodec.encode(t).unwrap();
        RawCodec.decode(&e.info, e.to_bytes(), &DecodeLimits::default()).unwrap()
    }

    #[test]
    fn contiguous_is_zero_copy() {
        let t = Tensor::from_vec([3, 4], (0..12).map(|x| x as f32).collect::<Vec<_>>()).unwrap().with_name("w");
        let e = RawCodec.encode(&t).unwrap();
        assert_eq!(e.segments[0].as_ptr(), t.host_storage().unwrap().as_ptr());
        let back = round_trip(&t);
        assert!(back.data_eq(&t));
        assert_eq!(back.name(), Some("w"));
    }

    #[test]
    fn transpose_travels_strided_without_copy() {
        let t = Tensor::from_vec([3, 4], (0..12i64).collect::<Vec<_>>()).unwrap();
        let tt = t.transpose(0, 1).unwrap();
        let e = RawCodec.encode(&tt).unwrap();
        assert_eq!(e.info.strides, Some(vec![1, 4]));
        assert_eq!(e.segments[0].as_ptr(), t.host_storage().unwrap().as_ptr());
        let back = round_trip(&tt);
        assert_eq!(back.strides(), &[1, 4]);
        assert_eq!(back.to_vec::<i64>().unwrap(), tt.to_vec::<i64>().unwrap());
    }

    #[test]
    fn narrowed_view_is_gathered() {
        let t = Tensor::from_vec([4, 4], (0..16u8).collect::<Vec<_>>()).unwrap();
        let n = t.narrow(1, 1, 2).unwrap();
        let e = RawCodec.encode(&n).unwrap();
        assert_eq!(e.info.strides, None);
        assert_eq!(e.to_bytes().as_ref(), &[1, 2, 5, 6, 9, 10, 13, 14]);
        assert!(round_trip(&n).data_eq(&n));
    }

    #[test]
    fn lying_headers_are_refused() {
        let limits = DecodeLimits::default();
        let info = TensorInfo { dtype: Some(DType::Float32), shape: vec![2, 3], ..Default::default() };
        let e = RawCodec.decode(&info, Bytes::from(vec![0u8; 20]), &limits).unwrap_err();
        assert!(e.to_string().contains("needs 24 bytes, but 20 arrived"), "{e}");
        // A zero stride claiming 2^40 elements from 4 bytes.
        let info = TensorInfo {
            dtype: Some(DType::Float32),
            shape: vec![1 << 40],
            strides: Some(vec![0]),
            ..Default::default()
        };
        assert!(matches!(
            RawCodec.decode(&info, Bytes::from(vec![0u8; 4]), &limits),
            Err(DecodeError::TooLarge { .. })
        ));
        let info = TensorInfo { dtype: Some(DType::Float32), shape: vec![1; 65], ..Default::default() };
        assert!(matches!(
            RawCodec.decode(&info, Bytes::from(vec![0u8; 4]), &limits),
            Err(DecodeError::TooManyDims { dims: 65, limit: 64 })
        ));
        let info = TensorInfo {
            dtype: Some(DType::UInt8),
            shape: vec![2, 2],
            strides: Some(vec![1, 1]),
            ..Default::default()
        };
        assert!(RawCodec.decode(&info, Bytes::from(vec![0u8; 4]), &limits).is_err());
    }
}
