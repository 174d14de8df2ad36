//! Entry points for the cargo-fuzz targets in `fuzz/` (compiled only with
//! the non-default `fuzzing` feature, which `fuzz/` and the corpus replay
//! test turn on), kept here so the
//! committed seed corpus also runs through them in the normal test suite
//! (`tests/fuzz_corpus.rs`). Each takes arbitrary bytes and must return
//! without panicking, hanging or allocating more than the limits allow.

use bytes::{Bytes, BytesMut};
use prost::Message;
use tensorwire_codecs::compress::{Compression, Decompressor};
use tensorwire_codecs::{DecodeLimits, safetensors, torch};
use tensorwire_proto::v1::{FrameHeader, frame_header::Kind};
use tensorwire_transports::mux::frame::{Decoder, FrameLimits};

use crate::pipeline::budget::MemoryBudget;
use crate::pipeline::chunk::{Assembly, ReassemblyLimits, Step};

/// Limits small enough that a fuzzer cannot exhaust memory through them.
fn limits() -> DecodeLimits {
    DecodeLimits {
        max_tensor_bytes: 64 << 20,
        max_pickle_bytes: 1 << 20,
        max_entries: 10_000,
        max_tensors: 10_000,
        ..DecodeLimits::default()
    }
}

/// The torch.save reader (zip + safe pickle).
pub fn torch_load(data: &[u8]) {
    if let Ok(v) = torch::load(Bytes::copy_from_slice(data), &limits()) {
        for (_, t) in v.tensors() {
            let _ = t.crc32c();
        }
    }
}

/// The pickle interpreter alone.
pub fn pickle(data: &[u8]) {
    let _ = torch::pickle::load(data, &limits());
}

/// The safetensors reader.
pub fn safetensors_load(data: &[u8]) {
    if let Ok(l) = safetensors::load(Bytes::copy_from_slice(data), &limits()) {
        for (_, t) in &l.tensors {
            let _ = t.crc32c();
        }
    }
}

/// One decompressor: the first 3 bytes pick the declared output size
/// (up to 1 MiB) and the shuffle element size; the rest is the input.
fn decompress(data: &[u8], c: Compression) {
    let [a, b, s, rest @ ..] = data else { return };
    let size = (usize::from(*a) << 12 | usize::from(*b) << 4) % (1 << 20);
    let mut out = vec![0u8; size];
    let _ = Decompressor::new().decompress(c, u32::from(*s % 17), rest, &mut out);
}

/// lz4 block decompression into a declared size.
pub fn lz4(data: &[u8]) {
    decompress(data, Compression::Lz4);
}

/// zstd decompression into a declared size.
pub fn zstd(data: &[u8]) {
    decompress(data, Compression::Zstd(3));
}

/// The float-plane decoder: the first 3 bytes are the declared output
/// size (little-endian, below 1 MiB), the 4th the element size from the
/// chunk header; the rest is the planes payload.
pub fn planes(data: &[u8]) {
    let [a, b, c, s, rest @ ..] = data else { return };
    let size = (usize::from(*a) | usize::from(*b) << 8 | usize::from(*c) << 16) % (1 << 20);
    let mut out = vec![0u8; size];
    let _ = Decompressor::new().decompress(Compression::Planes, u32::from(*s), rest, &mut out);
}

/// The delta header parser and [`delta::apply`](tensorwire_codecs::delta::apply):
/// byte 0 is the length of a `key=value` line block that becomes the
/// delta's metadata, byte 1 picks the dtype (bits 0–1) and whether the
/// base hash is set to the real one (bit 2, to get past the hash check);
/// the rest is the delta payload, and the base is that payload reversed.
pub fn delta(data: &[u8]) {
    use tensorwire_codecs::delta::{self, ContentHash, KEY_BASE};
    use tensorwire_codecs::{DType, Tensor};
    let [m, sel, rest @ ..] = data else { return };
    let (meta, payload) = rest.split_at(usize::from(*m).min(rest.len()));
    let dtype = [DType::UInt8, DType::Float32, DType::BFloat16, DType::Float64][usize::from(*sel & 3)];
    let n = payload.len() / dtype.itemsize();
    let payload = &payload[..n * dtype.itemsize()];
    let base_bytes: Vec<u8> = payload.iter().rev().copied().collect();
    let (Ok(mut d), Ok(base)) =
        (Tensor::new(dtype, [n], Bytes::copy_from_slice(payload)), Tensor::new(dtype, [n], Bytes::from(base_bytes)))
    else {
        return;
    };
    for line in String::from_utf8_lossy(meta).lines() {
        if let Some((k, v)) = line.split_once('=') {
            d.metadata_mut().insert(k.to_string(), v.to_string());
        }
    }
    if *sel & 4 != 0
        && let Ok(h) = ContentHash::of(&base)
    {
        d.metadata_mut().insert(KEY_BASE.to_string(), h.to_string());
    }
    if let Ok(t) = delta::apply(&d, &base) {
        assert_eq!(t.nbytes(), base.nbytes());
    }
}

/// The mux frame decoder, driven two ways: whole frames from a buffer fed
/// in two arbitrary splits ([`Decoder::decode`]), and the way the
/// connection's reader drives it (`transports/src/mux/reader.rs`): heads
/// from the buffer, payload bytes partly taken from the buffer and partly
/// "read past it" straight into their destination.
pub fn mux_frames(data: &[u8]) {
    let limits = FrameLimits { max_meta: 1 << 16, max_payload: 1 << 20 };
    let mut dec = Decoder::new(limits);
    let split = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let mut buf = BytesMut::new();
    for part in [&data[..split], &data[split..]] {
        buf.extend_from_slice(part);
        while let Ok(Some(f)) = dec.decode(&mut buf) {
            let _ = FrameHeader::decode(f.meta);
        }
    }
    let (mut buf, mut rest) = (BytesMut::from(&data[..split]), &data[split..]);
    let mut dec = Decoder::new(limits);
    loop {
        match dec.decode_head(&mut buf) {
            Ok(Some(f)) => {
                let _ = FrameHeader::decode(f.meta);
                let _ = dec.take_payload(&mut buf);
                let n = dec.payload_remaining().min(rest.len());
                rest = &rest[n..];
                dec.payload_read(n);
            }
            Ok(None) if !rest.is_empty() => {
                let n = rest.len().min(4096);
                buf.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
            }
            _ => break,
        }
    }
}

/// Chunk headers from the wire through the [`Assembly`] the frame reader
/// drives: a mode byte (odd: chunks handed on piece by piece with
/// `Assembly::push_out`, as the GPU receive path does; even: assembled
/// with `Assembly::push`), then a length-prefixed sequence of
/// `FrameHeader`s, each followed by a payload of the declared length.
pub fn reassembly(data: &[u8]) {
    let [mode, data @ ..] = data else { return };
    let pieces = mode & 1 == 1;
    let mut a = Assembly::new(ReassemblyLimits { max_tensor_bytes: 1 << 20 }, Some(MemoryBudget::new(4 << 20)));
    // Pieces: where the next one must start.
    let mut next = 0;
    let mut rest = data;
    while let [len, tail @ ..] = rest {
        let n = usize::from(*len).min(tail.len());
        let (head, tail) = tail.split_at(n);
        rest = tail;
        let Ok(h) = FrameHeader::decode(head) else { continue };
        let Some(Kind::Chunk(mut c)) = h.kind else { continue };
        let plen = (c.raw_len as usize).min(rest.len()).min(1 << 20);
        let (payload, tail) = rest.split_at(plen);
        rest = tail;
        if pieces {
            match a.push_out(&mut c, Bytes::copy_from_slice(payload)) {
                Ok(p) => {
                    assert_eq!(p.offset, next, "pieces come in order");
                    assert_eq!(p.bytes.len() as u64, c.raw_len, "a piece is its chunk's decoded bytes");
                    next += p.bytes.len();
                    if p.last {
                        next = 0;
                        let _ = a.finished();
                    }
                }
                Err(_) => return,
            }
            continue;
        }
        match a.push(&mut c, Bytes::copy_from_slice(payload)) {
            Ok(Step::Done(_)) => {
                let _ = a.finished();
            }
            Ok(Step::More) => {}
            Err(_) => return,
        }
    }
}

/// The skytorch chunk reassembler and the torch decoder behind it: the
/// input is a sequence of protobuf `TensorChunk`s, each prefixed by a
/// 2-byte little-endian length.
#[cfg(feature = "grpc")]
pub fn compat_chunks(data: &[u8]) {
    use tensorwire_proto::compat::TensorChunk;
    let limits = crate::Limits { max_tensor_bytes: 64 << 20, ..Default::default() };
    let mut asm = crate::grpc::chunks::Assembler::new(limits.max_tensor_bytes, Some(&MemoryBudget::new(128 << 20)));
    let mut rest = data;
    while rest.len() >= 2 {
        let n = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let (msg, tail) = rest[2..].split_at(n);
        rest = tail;
        let Ok(c) = TensorChunk::decode(msg) else { continue };
        match asm.push(c) {
            Ok(Some(a)) => {
                if let Ok(t) = crate::grpc::chunks::decode_tensor(a.bytes, &limits) {
                    let _ = t.crc32c();
                }
            }
            Ok(None) => {}
            Err(_) => return,
        }
    }
    let _ = asm.finish();
}

/// A gRPC call's body through the decoder of `tensorwire.v1.Frame`
/// messages (split into DATA frames where the input says), each message
/// re-encoded and decoded again: see `tensorwire_transports::grpc::fuzz`.
#[cfg(feature = "grpc")]
pub fn grpc_messages(data: &[u8]) {
    tensorwire_transports::grpc::fuzz::messages(data);
}

/// A JSON-RPC request body through the envelope parser and, for each
/// request, the params conversion (base64 tensors, safetensors files,
/// scalars) with and without a declared signature; results back to JSON.
#[cfg(feature = "http")]
pub fn jsonrpc(data: &[u8]) {
    use crate::jsonrpc::convert::{Signature, call_params, tensor_to_json, value_to_json};
    use crate::jsonrpc::protocol::{Body, json_values, parse, response};
    use crate::rpc::value::Value;
    // The count the server reserves memory by bounds the values a parse makes.
    fn values_in(v: &serde_json::Value) -> u64 {
        1 + match v {
            serde_json::Value::Array(a) => a.iter().map(values_in).sum(),
            serde_json::Value::Object(o) => o.values().map(values_in).sum(),
            _ => 0,
        }
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        assert!(values_in(&v) <= json_values(data), "json_values undercounts");
    }
    let limits = limits();
    let entries = match parse(data, 64) {
        Body::Single(e) => vec![e],
        Body::Batch(v) => v,
        Body::Invalid(e) => {
            let _ = response(serde_json::Value::Null, Err(e));
            return;
        }
    };
    let sigs = [
        Signature::default(),
        Signature { inputs: Some(vec!["x".into(), "y".into()]), args: vec!["a".into(), "b".into()] },
    ];
    for e in entries {
        match e {
            Ok(r) => {
                for sig in &sigs {
                    if let Ok((inputs, args)) = call_params(&r.method, &r.params, sig, &limits) {
                        for t in &inputs {
                            let _ = tensor_to_json(t);
                        }
                        let _ = value_to_json(&Value::Map(args.0));
                    }
                }
            }
            Err(bad) => {
                let (id, e) = *bad;
                let _ = response(id, Err(e));
            }
        }
    }
}

/// The shared-memory side channel (messages with real memfds and other
/// descriptors attached, frames naming segments): see
/// `tensorwire_transports::shm::fuzz`.
pub fn shm_side_channel(data: &[u8]) {
    tensorwire_transports::shm::fuzz::side_channel(data);
}

/// The grant a `ucx://` receiver answers with (a sender's view of a
/// hostile answer): see `tensorwire_transports::ucx::fuzz_grant`.
pub fn ucx_grant(data: &[u8]) {
    tensorwire_transports::ucx::fuzz_grant(data);
}

/// A shared-memory ring between two processes, with a peer that
/// scribbles over its control words: see `tensorwire_transports::shm::fuzz::ring`.
pub fn shm_ring(data: &[u8]) {
    tensorwire_transports::shm::fuzz::ring(data);
}

/// The connection handshake as a peer shapes it: the first byte picks the
/// side; then the mux preface (16 bytes) and a frame header carrying the
/// Hello (checked as the server checks it) or the Welcome (as the client
/// does), and the decisions later calls make from what the peer announced.
pub fn handshake(data: &[u8]) {
    use tensorwire_codecs::{CodecKind, available_codecs};
    use tensorwire_transports::mux::frame::{PREFACE_LEN, Preface};

    let [side, rest @ ..] = data else { return };
    let (pre, rest) = rest.split_at(PREFACE_LEN.min(rest.len()));
    if let Ok(pre) = <&[u8; PREFACE_LEN]>::try_from(pre)
        && let Ok(p) = Preface::decode(pre)
    {
        assert!(p.stream_window >= 4096 && p.max_frame_payload >= 4096);
    }
    let Ok(h) = FrameHeader::decode(rest) else { return };
    let caps = match (side & 1, h.kind) {
        (0, Some(Kind::Hello(hello))) => crate::server::dispatch::accept_hello(&hello).ok(),
        (_, Some(Kind::Welcome(w))) => crate::client::session::accept_welcome(&w).ok(),
        _ => None,
    };
    let Some(caps) = caps else { return };
    let mut codecs = available_codecs();
    codecs.push(CodecKind::Raw);
    for c in codecs {
        let _ = caps.check_codec(c);
    }
    for c in Compression::available() {
        let _ = caps.accepts(c);
    }
    for total in [0, 1, 1 << 20, u64::MAX] {
        let _ = caps.check_tensor_bytes(total);
    }
}
