//! The safetensors codec and file helpers, built on the `safetensors` crate.
//!
//! The header (JSON with dtypes, shapes, offsets and the `__metadata__`
//! string map) is built and validated with the crate's own types; tensor
//! data is passed through as [`Bytes`] segments when writing and sliced from
//! the input when reading, so neither direction copies tensor bytes
//! (non-contiguous tensors are made contiguous first: the format has no strides).

use std::collections::HashMap;

use bytes::Bytes;
use safetensors::tensor::{Metadata, TensorInfo as StInfo};
use safetensors::{Dtype, SafeTensors};

use crate::codec::{Codec, CodecKind, Encoded, TensorInfo};
use crate::dtype::DType;
use crate::error::{DecodeError, EncodeError};
use crate::limits::{DecodeLimits, check_shape};
use crate::tensor::{Tensor, aligned};

fn to_st(d: DType) -> Option<Dtype> {
    Some(match d {
        DType::Bool => Dtype::BOOL,
        DType::UInt8 => Dtype::U8,
        DType::Int8 => Dtype::I8,
        DType::Int16 => Dtype::I16,
        DType::Int32 => Dtype::I32,
        DType::Int64 => Dtype::I64,
        DType::UInt16 => Dtype::U16,
        DType::UInt32 => Dtype::U32,
        DType::UInt64 => Dtype::U64,
        DType::Float16 => Dtype::F16,
        DType::BFloat16 => Dtype::BF16,
        DType::Float32 => Dtype::F32,
        DType::Float64 => Dtype::F64,
        DType::Complex64 => Dtype::C64,
        DType::Float8E4M3Fn => Dtype::F8_E4M3,
        DType::Float8E5M2 => Dtype::F8_E5M2,
        // The format defines no complex128.
        DType::Complex128 => return None,
    })
}

fn from_st(d: Dtype) -> Result<DType, DecodeError> {
    Ok(match d {
        Dtype::BOOL => DType::Bool,
        Dtype::U8 => DType::UInt8,
        Dtype::I8 => DType::Int8,
        Dtype::I16 => DType::Int16,
        Dtype::I32 => DType::Int32,
        Dtype::I64 => DType::Int64,
        Dtype::U16 => DType::UInt16,
        Dtype::U32 => DType::UInt32,
        Dtype::U64 => DType::UInt64,
        Dtype::F16 => DType::Float16,
        Dtype::BF16 => DType::BFloat16,
        Dtype::F32 => DType::Float32,
        Dtype::F64 => DType::Float64,
        Dtype::C64 => DType::Complex64,
        Dtype::F8_E4M3 => DType::Float8E4M3Fn,
        Dtype::F8_E5M2 => DType::Float8E5M2,
        other => {
            return Err(DecodeError::UnsupportedDType { format: "safetensors", dtype: format!("{other:?}") });
        }
    })
}

/// Writes named tensors and an optional metadata map as a safetensors file,
/// returned as segments (header, then each tensor's bytes). Tensors are laid
/// out by descending element size, then name, so each is aligned.
pub fn save(
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<Bytes>, EncodeError> {
    let mut items: Vec<&(String, Tensor)> = tensors.iter().collect();
    items.sort_by(|a, b| b.1.dtype().itemsize().cmp(&a.1.dtype().itemsize()).then_with(|| a.0.cmp(&b.0)));
    let layout: Vec<(String, DType, Vec<usize>)> =
        items.iter().map(|(n, t)| (n.clone(), t.dtype(), t.shape().to_vec())).collect();
    let mut segments = vec![header(&layout, metadata)?];
    for (_, t) in items {
        segments.push(t.to_contiguous_bytes()?);
    }
    Ok(segments)
}

/// The header of a safetensors file holding tensors of these names, dtypes
/// and shapes, their data laid out in this order right after it (the
/// 8-byte length, then the JSON padded to 8 bytes). For writing a file as
/// its tensors arrive: the header first, then each tensor's contiguous
/// bytes in order.
pub fn header(
    layout: &[(String, DType, Vec<usize>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Bytes, EncodeError> {
    let mut infos = Vec::with_capacity(layout.len());
    let mut offset = 0usize;
    for (name, dtype, shape) in layout {
        let dt = to_st(*dtype).ok_or_else(|| EncodeError::Unsupported {
            codec: "safetensors",
            reason: format!("{dtype} has no safetensors dtype"),
        })?;
        let end = offset + crate::tensor::byte_size(*dtype, shape)?;
        infos.push((name.clone(), StInfo { dtype: dt, shape: shape.clone(), data_offsets: (offset, end) }));
        offset = end;
    }
    let bad = |e: String| EncodeError::Unsupported { codec: "safetensors", reason: e };
    let meta = Metadata::new(metadata, infos).map_err(|e| bad(e.to_string()))?;
    let mut header = serde_json::to_vec(&meta).map_err(|e| bad(e.to_string()))?;
    // Pad with spaces so tensor data starts 8-byte aligned, as the crate does.
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut first = Vec::with_capacity(8 + header.len());
    first.extend_from_slice(&(header.len() as u64).to_le_bytes());
    first.extend_from_slice(&header);
    Ok(Bytes::from(first))
}

/// Tensors and metadata read from a safetensors file.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    /// Tensors in file order; their data are slices of the input.
    pub tensors: Vec<(String, Tensor)>,
    /// The `__metadata__` map.
    pub metadata: HashMap<String, String>,
}

/// Reads a safetensors file, checking every tensor against `limits`.
pub fn load(file: Bytes, limits: &DecodeLimits) -> Result<Loaded, DecodeError> {
    let st = SafeTensors::deserialize(&file)
        .map_err(|e| DecodeError::Malformed { format: "safetensors", reason: e.to_string() })?;
    let (_, meta) = SafeTensors::read_metadata(&file)
        .map_err(|e| DecodeError::Malformed { format: "safetensors", reason: e.to_string() })?;
    if st.len() > limits.max_tensors {
        return Err(DecodeError::LimitExceeded {
            what: "tensors in file",
            count: st.len() as u64,
            limit: limits.max_tensors as u64,
        });
    }
    let base = file.as_ptr() as usize;
    let mut tensors = Vec::with_capacity(st.len());
    for name in meta.offset_keys() {
        let view =
            st.tensor(&name).map_err(|e| DecodeError::Malformed { format: "safetensors", reason: e.to_string() })?;
        let dtype = from_st(view.dtype())?;
        check_shape(dtype, view.shape(), limits)?;
        let start = view.data().as_ptr() as usize - base;
        let data = aligned(file.slice(start..start + view.data().len()), dtype.align());
        tensors.push((name, Tensor::with_shape(dtype, view.shape(), data)?));
    }
    Ok(Loaded { tensors, metadata: meta.metadata().clone().unwrap_or_default() })
}

/// The safetensors codec for the pipeline: one tensor per payload, named by
/// the tensor's name (or `"tensor"`), its metadata map in `__metadata__`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SafetensorsCodec;

impl Codec for SafetensorsCodec {
    fn kind(&self) -> CodecKind {
        CodecKind::Safetensors
    }

    fn encode(&self, tensor: &Tensor) -> Result<Encoded, EncodeError> {
        let name = tensor.name().unwrap_or("tensor").to_string();
        let meta = (!tensor.metadata().is_empty())
            .then(|| tensor.metadata().iter().map(|(k, v)| (k.clone(), v.clone())).collect());
        let segments = save(&[(name, tensor.clone())], meta)?;
        Ok(Encoded { info: TensorInfo::of(tensor), segments })
    }

    fn decode(&self, info: &TensorInfo, payload: Bytes, limits: &DecodeLimits) -> Result<Tensor, DecodeError> {
        let loaded = load(payload, limits)?;
        let n = loaded.tensors.len();
        let Some((name, mut t)) = loaded.tensors.into_iter().next().filter(|_| n == 1) else {
            return Err(DecodeError::Malformed {
                format: "safetensors payload",
                reason: format!("expected one tensor, found {n}"),
            });
        };
        t.set_name(name);
        t.metadata_mut().extend(loaded.metadata);
        Ok(info.apply_names(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::concat;

    #[test]
    fn file_round_trip_with_metadata() {
        let a = Tensor::from_vec([2, 2], vec![1.0f64, 2.0, 3.0, 4.0]).unwrap();
        let b = Tensor::from_vec([3], vec![1u8, 2, 3]).unwrap();
        let c = Tensor::from_vec([2, 3], (0..6i32).collect::<Vec<_>>()).unwrap().transpose(0, 1).unwrap();
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let file = concat(
            &save(&[("b".into(), b.clone()), ("a".into(), a.clone()), ("c".into(), c.clone())], Some(meta.clone()))
                .unwrap(),
        );
        let back = load(file, &DecodeLimits::default()).unwrap();
        assert_eq!(back.metadata, meta);
        let names: Vec<_> = back.tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "c", "b"]);
        assert!(back.tensors[0].1.data_eq(&a));
        assert!(back.tensors[1].1.data_eq(&c));
        assert!(back.tensors[2].1.data_eq(&b));
        assert!(back.tensors[0].1.as_slice::<f64>().is_ok());
    }

    #[test]
    fn codec_and_bad_input() {
        let t = Tensor::from_vec([4], vec![1.5f32; 4]).unwrap().with_name("w").with_metadata("k", "v");
        let e = SafetensorsCodec.encode(&t).unwrap();
        let back = SafetensorsCodec.decode(&e.info, e.to_bytes(), &DecodeLimits::default()).unwrap();
        assert!(back.data_eq(&t));
        assert_eq!(back.metadata().get("k").map(String::as_str), Some("v"));
        let c128 = Tensor::zeros(DType::Complex128, [1]).unwrap();
        assert!(matches!(SafetensorsCodec.encode(&c128), Err(EncodeError::Unsupported { .. })));
        let bytes = e.to_bytes();
        for cut in 0..bytes.len() {
            assert!(load(bytes.slice(..cut), &DecodeLimits::default()).is_err());
        }
        let mut lying = bytes.to_vec();
        lying[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(load(Bytes::from(lying), &DecodeLimits::default()).is_err());
        let l = DecodeLimits { max_tensor_bytes: 8, ..Default::default() };
        assert!(matches!(load(bytes, &l), Err(DecodeError::TooLarge { .. })));
    }
}
