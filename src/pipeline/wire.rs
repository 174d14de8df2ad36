//! Conversions between the codec crate's types and the wire schema.

use tensorwire_codecs::{CodecKind, Compression, DType, Device, TensorInfo};
use tensorwire_proto::v1;

/// The handshake feature (`Welcome.features`) of a service that applies
/// delta tensors (`tensorwire_codecs::delta`).
pub(crate) const FEATURE_DELTA: &str = "delta";

/// The wire protocol version.
pub const PROTOCOL_VERSION: u32 = tensorwire_proto::PROTOCOL_VERSION;

/// Wire value of a dtype.
pub fn dtype_to_wire(d: DType) -> v1::Dtype {
    use v1::Dtype as W;
    match d {
        DType::Bool => W::Bool,
        DType::UInt8 => W::Uint8,
        DType::Int8 => W::Int8,
        DType::Int16 => W::Int16,
        DType::Int32 => W::Int32,
        DType::Int64 => W::Int64,
        DType::UInt16 => W::Uint16,
        DType::UInt32 => W::Uint32,
        DType::UInt64 => W::Uint64,
        DType::Float16 => W::Float16,
        DType::BFloat16 => W::Bfloat16,
        DType::Float32 => W::Float32,
        DType::Float64 => W::Float64,
        DType::Complex64 => W::Complex64,
        DType::Complex128 => W::Complex128,
        DType::Float8E4M3Fn => W::Float8E4m3fn,
        DType::Float8E5M2 => W::Float8E5m2,
        #[allow(unreachable_patterns)]
        _ => W::Unspecified,
    }
}

/// The dtype of a wire value; None for unspecified, Err for unknown values.
pub fn dtype_from_wire(v: i32) -> Result<Option<DType>, String> {
    use v1::Dtype as W;
    let w = W::try_from(v).map_err(|_| format!("unknown dtype value {v}"))?;
    Ok(Some(match w {
        W::Unspecified => return Ok(None),
        W::Bool => DType::Bool,
        W::Uint8 => DType::UInt8,
        W::Int8 => DType::Int8,
        W::Int16 => DType::Int16,
        W::Int32 => DType::Int32,
        W::Int64 => DType::Int64,
        W::Uint16 => DType::UInt16,
        W::Uint32 => DType::UInt32,
        W::Uint64 => DType::UInt64,
        W::Float16 => DType::Float16,
        W::Bfloat16 => DType::BFloat16,
        W::Float32 => DType::Float32,
        W::Float64 => DType::Float64,
        W::Complex64 => DType::Complex64,
        W::Complex128 => DType::Complex128,
        W::Float8E4m3fn => DType::Float8E4M3Fn,
        W::Float8E5m2 => DType::Float8E5M2,
    }))
}

/// Wire value of a codec.
pub fn codec_to_wire(c: CodecKind) -> v1::Codec {
    match c {
        CodecKind::Raw => v1::Codec::Raw,
        CodecKind::Torch => v1::Codec::Torch,
        CodecKind::Safetensors => v1::Codec::Safetensors,
        #[allow(unreachable_patterns)]
        _ => v1::Codec::Unspecified,
    }
}

/// The codec of a wire value (unspecified means raw).
pub fn codec_from_wire(v: i32) -> Result<CodecKind, String> {
    match v1::Codec::try_from(v) {
        Ok(v1::Codec::Raw | v1::Codec::Unspecified) => Ok(CodecKind::Raw),
        Ok(v1::Codec::Torch) => Ok(CodecKind::Torch),
        Ok(v1::Codec::Safetensors) => Ok(CodecKind::Safetensors),
        Err(_) => Err(format!("unknown codec value {v} (known: raw=1, torch=2, safetensors=3)")),
    }
}

/// Wire value of a compression (the zstd level is not needed to decompress).
pub fn compression_to_wire(c: Compression) -> v1::Compression {
    match c {
        Compression::None => v1::Compression::None,
        Compression::Lz4 => v1::Compression::Lz4,
        Compression::Zstd(_) => v1::Compression::Zstd,
        Compression::Planes => v1::Compression::Planes,
    }
}

/// The compression of a wire value (unspecified means none).
pub fn compression_from_wire(v: i32) -> Result<Compression, String> {
    match v1::Compression::try_from(v) {
        Ok(v1::Compression::None | v1::Compression::Unspecified) => Ok(Compression::None),
        Ok(v1::Compression::Lz4) => Ok(Compression::Lz4),
        Ok(v1::Compression::Zstd) => Ok(Compression::Zstd(3)),
        Ok(v1::Compression::Planes) => Ok(Compression::Planes),
        Err(_) => Err(format!("unknown compression value {v} (known: none=1, lz4=2, zstd=3, planes=4)")),
    }
}

/// The wire header of a tensor.
pub fn info_to_wire(info: TensorInfo, codec: CodecKind) -> v1::TensorInfo {
    // By value: the shape's `Vec<usize>` becomes the `Vec<u64>` in place
    // (64-bit targets: same size and alignment), and name and metadata move.
    v1::TensorInfo {
        dtype: info.dtype.map_or(v1::Dtype::Unspecified, dtype_to_wire) as i32,
        shape: info.shape.into_iter().map(|d| d as u64).collect(),
        strides: info.strides.map(|s| s.into_iter().map(|x| x as u64).collect()).unwrap_or_default(),
        storage_offset: info.storage_offset as u64,
        // Empty for the CPU (every receiver reads it so): most tensors
        // are, and a string formatted per tensor costs an allocation.
        device: if info.device == Device::Cpu { String::new() } else { info.device.to_string() },
        name: info.name.unwrap_or_default(),
        metadata: info.metadata.into_iter().collect(),
        codec: codec_to_wire(codec) as i32,
        storage_id: 0,
    }
}

/// A tensor header from the wire, checked for sizes that overflow.
pub fn info_from_wire(w: v1::TensorInfo) -> Result<(TensorInfo, CodecKind), String> {
    // By value: the shape's `Vec<u64>` becomes the `Vec<usize>` in place
    // (64-bit targets: same size and alignment), and name and metadata move.
    let usize_of = |x: u64| usize::try_from(x).map_err(|_| format!("{x} does not fit in memory"));
    let shape = w.shape.into_iter().map(usize_of).collect::<Result<Vec<_>, _>>()?;
    let strides = if w.strides.is_empty() {
        None
    } else {
        Some(w.strides.into_iter().map(usize_of).collect::<Result<Vec<_>, _>>()?)
    };
    if let Some(s) = &strides
        && s.len() != shape.len()
    {
        return Err(format!("{} strides for {} dimensions", s.len(), shape.len()));
    }
    let info = TensorInfo {
        dtype: dtype_from_wire(w.dtype)?,
        shape,
        strides,
        storage_offset: usize_of(w.storage_offset)?,
        device: if w.device.is_empty() { Device::Cpu } else { w.device.parse().unwrap_or(Device::Cpu) },
        name: (!w.name.is_empty()).then_some(w.name),
        metadata: w.metadata.into_iter().collect(),
    };
    Ok((info, codec_from_wire(w.codec)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_round_trip() {
        for d in DType::ALL {
            assert_eq!(dtype_from_wire(dtype_to_wire(d) as i32).unwrap(), Some(d));
        }
        assert!(dtype_from_wire(999).unwrap_err().contains("999"));
        assert!(codec_from_wire(77).unwrap_err().contains("unknown codec"));
        assert!(compression_from_wire(9).is_err());
    }
}
