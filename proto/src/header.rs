//! Frame headers on the hot path, encoded by hand: the chunk header (with
//! the tensor's [`TensorInfo`] on a first chunk) that every tensor of every
//! call carries.
//!
//! prost's generated code computes a nested message's length once per
//! enclosing level: for a `TensorInfo` in a `Chunk` in a `FrameHeader`,
//! three times per encode (four with the writer's own `encoded_len`).
//! Measured on a 4 KiB tensor's first chunk header: prost's
//! `encoded_len` + `encode_raw` 84–88 ns, these 39–42 ns. Decoding stays
//! with prost: a hand-written reader was no faster (the allocations of the
//! boxed `TensorInfo` and its shape dominate).
//!
//! The contract, checked by the property tests below against prost itself:
//! [`encoded_len`] and [`encode`] give exactly prost's length and bytes for
//! every header. Chunks are written here; other kinds, and chunks whose
//! tensor carries metadata (a map, which prost writes in its own order), go
//! to prost.

use bytes::BufMut;
use prost::Message;

use crate::v1::{Chunk, FrameHeader, TensorInfo, frame_header::Kind};

/// Field number of `FrameHeader.chunk`.
const FRAME_HEADER_CHUNK: u32 = 4;
/// Field number of `Chunk.info`.
const CHUNK_INFO: u32 = 9;

const VARINT: u32 = 0;
const LEN: u32 = 2;

/// Bytes of `v` as a varint.
#[inline]
fn varint_len(v: u64) -> usize {
    // 1 byte per 7 bits, at least one: (bits * 9 + 73) / 64, as prost.
    ((((v | 1).leading_zeros() ^ 63) * 9 + 73) / 64) as usize
}

#[inline]
fn put_varint(buf: &mut impl BufMut, mut v: u64) {
    while v >= 0x80 {
        buf.put_u8(v as u8 | 0x80);
        v >>= 7;
    }
    buf.put_u8(v as u8);
}

#[inline]
fn key_len(tag: u32) -> usize {
    varint_len(u64::from(tag << 3))
}

#[inline]
fn put_key(buf: &mut impl BufMut, tag: u32, wire: u32) {
    put_varint(buf, u64::from(tag << 3 | wire));
}

/// A varint field's length when it is not its default (proto3 writes no
/// default scalar).
#[inline]
fn uint_len(tag: u32, v: u64) -> usize {
    if v == 0 { 0 } else { key_len(tag) + varint_len(v) }
}

#[inline]
fn put_uint(buf: &mut impl BufMut, tag: u32, v: u64) {
    if v != 0 {
        put_key(buf, tag, VARINT);
        put_varint(buf, v);
    }
}

/// An `int32` (enum) as prost writes it: negative values sign-extended.
#[inline]
fn enum_value(v: i32) -> u64 {
    i64::from(v) as u64
}

#[inline]
fn bytes_len(tag: u32, n: usize) -> usize {
    if n == 0 { 0 } else { key_len(tag) + varint_len(n as u64) + n }
}

#[inline]
fn put_bytes(buf: &mut impl BufMut, tag: u32, b: &[u8]) {
    if !b.is_empty() {
        put_key(buf, tag, LEN);
        put_varint(buf, b.len() as u64);
        buf.put_slice(b);
    }
}

fn packed_body_len(v: &[u64]) -> usize {
    v.iter().map(|&x| varint_len(x)).sum()
}

fn packed_len(tag: u32, v: &[u64]) -> usize {
    if v.is_empty() { 0 } else { bytes_len(tag, packed_body_len(v)) }
}

fn put_packed(buf: &mut impl BufMut, tag: u32, v: &[u64]) {
    if !v.is_empty() {
        put_key(buf, tag, LEN);
        put_varint(buf, packed_body_len(v) as u64);
        for &x in v {
            put_varint(buf, x);
        }
    }
}

/// The chunk of `h` when this module writes it (prost writes the rest).
fn by_hand(h: &FrameHeader) -> Option<&Chunk> {
    match &h.kind {
        Some(Kind::Chunk(c)) if c.info.as_ref().is_none_or(|i| i.metadata.is_empty()) => Some(c),
        _ => None,
    }
}

// The writers below destructure `Chunk` and `TensorInfo` without `..`: a
// field added to the schema fails to compile here until it is written.

fn info_body_len(i: &TensorInfo) -> usize {
    let TensorInfo { dtype, shape, strides, storage_offset, device, name, metadata: _, codec, storage_id } = i;
    uint_len(1, enum_value(*dtype))
        + packed_len(2, shape)
        + packed_len(3, strides)
        + uint_len(4, *storage_offset)
        + bytes_len(5, device.len())
        + bytes_len(6, name.len())
        + uint_len(8, enum_value(*codec))
        + uint_len(9, *storage_id)
}

fn put_info(buf: &mut impl BufMut, i: &TensorInfo) {
    let TensorInfo { dtype, shape, strides, storage_offset, device, name, metadata: _, codec, storage_id } = i;
    put_uint(buf, 1, enum_value(*dtype));
    put_packed(buf, 2, shape);
    put_packed(buf, 3, strides);
    put_uint(buf, 4, *storage_offset);
    put_bytes(buf, 5, device.as_bytes());
    put_bytes(buf, 6, name.as_bytes());
    put_uint(buf, 8, enum_value(*codec));
    put_uint(buf, 9, *storage_id);
}

/// An `optional uint32` field: written whenever present, zero included.
#[inline]
fn opt_len(tag: u32, v: Option<u32>) -> usize {
    v.map_or(0, |v| key_len(tag) + varint_len(u64::from(v)))
}

#[inline]
fn put_opt(buf: &mut impl BufMut, tag: u32, v: Option<u32>) {
    if let Some(v) = v {
        put_key(buf, tag, VARINT);
        put_varint(buf, u64::from(v));
    }
}

/// The chunk's body length and its info's (0 without one).
fn chunk_body_len(c: &Chunk) -> (usize, usize) {
    let Chunk {
        tensor_id,
        index,
        offset,
        total_bytes,
        last,
        compression,
        shuffle,
        raw_len,
        info,
        crc32c,
        shm_segment,
        ucx_tag,
        ucx_grant,
        ucx_put,
        chunk_crc32c,
    } = c;
    let info_len = info.as_deref().map_or(0, info_body_len);
    let len = uint_len(1, *tensor_id)
        + uint_len(2, u64::from(*index))
        + uint_len(3, *offset)
        + uint_len(4, *total_bytes)
        + uint_len(5, u64::from(*last))
        + uint_len(6, enum_value(*compression))
        + uint_len(7, u64::from(*shuffle))
        + uint_len(8, *raw_len)
        + info.as_ref().map_or(0, |_| key_len(CHUNK_INFO) + varint_len(info_len as u64) + info_len)
        + opt_len(10, *crc32c)
        + uint_len(11, *shm_segment)
        + uint_len(12, *ucx_tag)
        + uint_len(13, u64::from(*ucx_grant))
        + uint_len(14, u64::from(*ucx_put))
        + opt_len(20, *chunk_crc32c);
    (len, info_len)
}

/// `h.encoded_len()`, faster for chunk headers.
pub fn encoded_len(h: &FrameHeader) -> usize {
    match by_hand(h) {
        Some(c) => {
            let (body, _) = chunk_body_len(c);
            key_len(FRAME_HEADER_CHUNK) + varint_len(body as u64) + body
        }
        None => h.encoded_len(),
    }
}

/// `h.encode_raw(buf)` (the caller made room for [`encoded_len`] bytes),
/// faster for chunk headers.
pub fn encode(h: &FrameHeader, buf: &mut impl BufMut) {
    let Some(c) = by_hand(h) else {
        h.encode_raw(buf);
        return;
    };
    let (body, info_len) = chunk_body_len(c);
    let Chunk {
        tensor_id,
        index,
        offset,
        total_bytes,
        last,
        compression,
        shuffle,
        raw_len,
        info,
        crc32c,
        shm_segment,
        ucx_tag,
        ucx_grant,
        ucx_put,
        chunk_crc32c,
    } = c;
    put_key(buf, FRAME_HEADER_CHUNK, LEN);
    put_varint(buf, body as u64);
    put_uint(buf, 1, *tensor_id);
    put_uint(buf, 2, u64::from(*index));
    put_uint(buf, 3, *offset);
    put_uint(buf, 4, *total_bytes);
    put_uint(buf, 5, u64::from(*last));
    put_uint(buf, 6, enum_value(*compression));
    put_uint(buf, 7, u64::from(*shuffle));
    put_uint(buf, 8, *raw_len);
    if let Some(i) = info {
        put_key(buf, CHUNK_INFO, LEN);
        put_varint(buf, info_len as u64);
        put_info(buf, i);
    }
    put_opt(buf, 10, *crc32c);
    put_uint(buf, 11, *shm_segment);
    put_uint(buf, 12, *ucx_tag);
    put_uint(buf, 13, u64::from(*ucx_grant));
    put_uint(buf, 14, u64::from(*ucx_put));
    put_opt(buf, 20, *chunk_crc32c);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Reply, Request};
    use proptest::prelude::*;

    fn info() -> impl Strategy<Value = TensorInfo> {
        (
            (any::<i32>(), prop::collection::vec(any::<u64>(), 0..5), prop::collection::vec(any::<u64>(), 0..3)),
            (any::<u64>(), "[a-z:0-9]{0,6}", "\\PC{0,8}"),
            (prop::collection::hash_map("[a-z]{1,3}", "[a-z]{0,3}", 0..2), any::<i32>(), any::<u64>()),
        )
            .prop_map(
                |((dtype, shape, strides), (storage_offset, device, name), (metadata, codec, storage_id))| TensorInfo {
                    dtype,
                    shape,
                    strides,
                    storage_offset,
                    device,
                    name,
                    metadata,
                    codec,
                    storage_id,
                },
            )
    }

    fn small() -> impl Strategy<Value = u64> {
        prop_oneof![Just(0u64), 0..300u64, any::<u64>()]
    }

    fn chunk() -> impl Strategy<Value = Chunk> {
        (
            (small(), any::<u32>(), small(), small(), any::<bool>(), -2..4i32, 0..9u32),
            (small(), prop::option::of(info()), prop::option::of(any::<u32>()), small(), small(), any::<bool>()),
            (any::<bool>(), prop::option::of(any::<u32>())),
        )
            .prop_map(
                |(
                    (tensor_id, index, offset, total_bytes, last, compression, shuffle),
                    (raw_len, info, crc32c, shm_segment, ucx_tag, ucx_grant),
                    (ucx_put, chunk_crc32c),
                )| Chunk {
                    tensor_id,
                    index,
                    offset,
                    total_bytes,
                    last,
                    compression,
                    shuffle,
                    raw_len,
                    info: info.map(Box::new),
                    crc32c,
                    shm_segment,
                    ucx_tag,
                    ucx_grant,
                    ucx_put,
                    chunk_crc32c,
                },
            )
    }

    fn header() -> impl Strategy<Value = FrameHeader> {
        prop_oneof![
            4 => chunk().prop_map(|c| FrameHeader::new(Kind::Chunk(c))),
            1 => "[a-z]{0,9}".prop_map(|f| FrameHeader::new(Kind::Request(Box::new(Request { function: f, method: 3, ..Default::default() })))),
            1 => any::<u64>().prop_map(|t| FrameHeader::new(Kind::Reply(Box::new(Reply { server_time_us: t, ..Default::default() })))),
            1 => Just(FrameHeader::default()),
        ]
    }

    fn ours(h: &FrameHeader) -> Vec<u8> {
        let mut b = Vec::with_capacity(encoded_len(h));
        encode(h, &mut b);
        b
    }

    proptest! {
        #[test]
        fn writes_what_prost_writes(h in header()) {
            let want = h.encode_to_vec();
            prop_assert_eq!(encoded_len(&h), want.len());
            let got = ours(&h);
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(FrameHeader::decode(&got[..]).unwrap(), h);
        }
    }

    #[test]
    fn writes_a_first_chunk_header_by_hand() {
        let info =
            TensorInfo { dtype: 3, shape: vec![4096, 1 << 40], codec: 1, name: "x".into(), ..Default::default() };
        let c = Chunk {
            tensor_id: 1,
            total_bytes: 4096,
            last: true,
            raw_len: 4096,
            info: Some(Box::new(info)),
            crc32c: Some(0),
            ..Default::default()
        };
        let h = FrameHeader::new(Kind::Chunk(c));
        assert!(by_hand(&h).is_some());
        assert_eq!(ours(&h), h.encode_to_vec());
        // With metadata, prost writes it.
        let mut m = h.clone();
        if let Some(Kind::Chunk(c)) = &mut m.kind {
            c.info.as_mut().unwrap().metadata.insert("k".into(), "v".into());
        }
        assert!(by_hand(&m).is_none());
        assert_eq!(ours(&m), m.encode_to_vec());
    }
}
