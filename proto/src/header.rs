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
fn key_len(tag: u32) -> usize {
    varint_len(u64::from(tag << 3))
}

/// An `int32` (enum) as prost writes it: negative values sign-extended.
#[inline]
fn enum_value(v: i32) -> u64 {
    i64::from(v) as u64
}

/// Where a message's fields go: [`Len`] counts their bytes, [`Put`] writes
/// them. One walk over the fields ([`chunk_fields`], [`info_fields`])
/// serves both, so the length and the bytes cannot disagree. Every method
/// skips what proto3 does not write (default scalars, empty strings and
/// repeated fields).
trait Sink {
    fn uint(&mut self, tag: u32, v: u64);
    /// An `optional uint32`: written whenever present, zero included.
    fn opt(&mut self, tag: u32, v: Option<u32>);
    fn bytes(&mut self, tag: u32, b: &[u8]);
    /// A packed `repeated uint64`.
    fn packed(&mut self, tag: u32, v: &[u64]);
    /// A nested message of `len` bytes, whose fields `body` puts.
    fn message(&mut self, tag: u32, len: usize, body: impl FnOnce(&mut Self));
}

struct Len(usize);

impl Sink for Len {
    #[inline]
    fn uint(&mut self, tag: u32, v: u64) {
        if v != 0 {
            self.0 += key_len(tag) + varint_len(v);
        }
    }

    #[inline]
    fn opt(&mut self, tag: u32, v: Option<u32>) {
        if let Some(v) = v {
            self.0 += key_len(tag) + varint_len(u64::from(v));
        }
    }

    #[inline]
    fn bytes(&mut self, tag: u32, b: &[u8]) {
        self.delimited(tag, b.len());
    }

    fn packed(&mut self, tag: u32, v: &[u64]) {
        self.delimited(tag, packed_body_len(v));
    }

    fn message(&mut self, tag: u32, len: usize, _: impl FnOnce(&mut Self)) {
        self.0 += key_len(tag) + varint_len(len as u64) + len;
    }
}

impl Len {
    /// A length-delimited field of `n` bytes; none when empty.
    #[inline]
    fn delimited(&mut self, tag: u32, n: usize) {
        if n > 0 {
            self.0 += key_len(tag) + varint_len(n as u64) + n;
        }
    }
}

struct Put<'a, B>(&'a mut B);

impl<B: BufMut> Put<'_, B> {
    #[inline]
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.put_u8(v as u8 | 0x80);
            v >>= 7;
        }
        self.0.put_u8(v as u8);
    }

    #[inline]
    fn key(&mut self, tag: u32, wire: u32) {
        self.varint(u64::from(tag << 3 | wire));
    }
}

impl<B: BufMut> Sink for Put<'_, B> {
    #[inline]
    fn uint(&mut self, tag: u32, v: u64) {
        if v != 0 {
            self.key(tag, VARINT);
            self.varint(v);
        }
    }

    #[inline]
    fn opt(&mut self, tag: u32, v: Option<u32>) {
        if let Some(v) = v {
            self.key(tag, VARINT);
            self.varint(u64::from(v));
        }
    }

    #[inline]
    fn bytes(&mut self, tag: u32, b: &[u8]) {
        if !b.is_empty() {
            self.key(tag, LEN);
            self.varint(b.len() as u64);
            self.0.put_slice(b);
        }
    }

    fn packed(&mut self, tag: u32, v: &[u64]) {
        if !v.is_empty() {
            self.key(tag, LEN);
            self.varint(packed_body_len(v) as u64);
            for &x in v {
                self.varint(x);
            }
        }
    }

    fn message(&mut self, tag: u32, len: usize, body: impl FnOnce(&mut Self)) {
        self.key(tag, LEN);
        self.varint(len as u64);
        body(self);
    }
}

fn packed_body_len(v: &[u64]) -> usize {
    v.iter().map(|&x| varint_len(x)).sum()
}

/// The chunk of `h` when this module writes it (prost writes the rest).
fn by_hand(h: &FrameHeader) -> Option<&Chunk> {
    match &h.kind {
        Some(Kind::Chunk(c)) if c.info.as_ref().is_none_or(|i| i.metadata.is_empty()) => Some(c),
        _ => None,
    }
}

// The walks destructure `Chunk` and `TensorInfo` without `..`: a field
// added to the schema fails to compile here until it is written. Fields
// go in field-number order, as prost writes them.

fn info_fields(i: &TensorInfo, s: &mut impl Sink) {
    let TensorInfo { dtype, shape, strides, storage_offset, device, name, metadata: _, codec, storage_id } = i;
    s.uint(1, enum_value(*dtype));
    s.packed(2, shape);
    s.packed(3, strides);
    s.uint(4, *storage_offset);
    s.bytes(5, device.as_bytes());
    s.bytes(6, name.as_bytes());
    s.uint(8, enum_value(*codec));
    s.uint(9, *storage_id);
}

/// The chunk's fields, its info (if any) being `info_len` bytes.
fn chunk_fields<S: Sink>(c: &Chunk, info_len: usize, s: &mut S) {
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
    s.uint(1, *tensor_id);
    s.uint(2, u64::from(*index));
    s.uint(3, *offset);
    s.uint(4, *total_bytes);
    s.uint(5, u64::from(*last));
    s.uint(6, enum_value(*compression));
    s.uint(7, u64::from(*shuffle));
    s.uint(8, *raw_len);
    if let Some(i) = info {
        s.message(CHUNK_INFO, info_len, |s| info_fields(i, s));
    }
    s.opt(10, *crc32c);
    s.uint(11, *shm_segment);
    s.uint(12, *ucx_tag);
    s.uint(13, u64::from(*ucx_grant));
    s.uint(14, u64::from(*ucx_put));
    s.opt(20, *chunk_crc32c);
}

/// The chunk's body length and its info's (0 without one).
fn chunk_body_len(c: &Chunk) -> (usize, usize) {
    let info_len = c.info.as_deref().map_or(0, |i| {
        let mut n = Len(0);
        info_fields(i, &mut n);
        n.0
    });
    let mut n = Len(0);
    chunk_fields(c, info_len, &mut n);
    (n.0, info_len)
}

/// `h.encoded_len()`, faster for chunk headers.
pub fn encoded_len(h: &FrameHeader) -> usize {
    match by_hand(h) {
        Some(c) => {
            let mut n = Len(0);
            n.message(FRAME_HEADER_CHUNK, chunk_body_len(c).0, |_| {});
            n.0
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
    Put(buf).message(FRAME_HEADER_CHUNK, body, |s| chunk_fields(c, info_len, s));
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
