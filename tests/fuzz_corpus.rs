//! Runs the committed fuzz seed corpus (fuzz/corpus/TARGET/*) through the
//! same entry points the cargo-fuzz targets use, so every CI run replays it.

use std::path::Path;

type Target = fn(&[u8]);

const TARGETS: &[(&str, Target)] = &[
    ("torch_load", tensorwire::fuzzing::torch_load),
    ("pickle", tensorwire::fuzzing::pickle),
    ("safetensors_load", tensorwire::fuzzing::safetensors_load),
    ("lz4", tensorwire::fuzzing::lz4),
    ("zstd", tensorwire::fuzzing::zstd),
    ("planes", tensorwire::fuzzing::planes),
    ("delta", tensorwire::fuzzing::delta),
    ("mux_frames", tensorwire::fuzzing::mux_frames),
    ("reassembly", tensorwire::fuzzing::reassembly),
    ("compat_chunks", tensorwire::fuzzing::compat_chunks),
    ("jsonrpc", tensorwire::fuzzing::jsonrpc),
    ("shm_side_channel", tensorwire::fuzzing::shm_side_channel),
    ("shm_ring", tensorwire::fuzzing::shm_ring),
    ("handshake", tensorwire::fuzzing::handshake),
    ("grpc_messages", tensorwire::fuzzing::grpc_messages),
    ("ucx_grant", tensorwire::fuzzing::ucx_grant),
];

fn corpus(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(name)
}

#[test]
fn seed_corpus_replays_without_panics() {
    for (name, target) in TARGETS {
        let dir = corpus(name);
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let data = std::fs::read(entry.unwrap().path()).unwrap();
            target(&data);
            // Every truncation of a seed must be handled too.
            for cut in (0..data.len()).step_by(data.len().div_ceil(64).max(1)) {
                target(&data[..cut]);
            }
            n += 1;
        }
        assert!(n > 0, "no seeds for {name}");
    }
}

/// Regenerates the Rust-made seeds: `cargo test --test fuzz_corpus -- --ignored`.
#[test]
#[ignore]
fn write_seed_corpus() {
    use bytes::BytesMut;
    use prost::Message;
    use tensorwire::codecs::compress::{Compression, Compressor};
    use tensorwire::codecs::torch::{self, Object, SaveOptions};
    use tensorwire::codecs::{DType, Tensor, safetensors};
    use tensorwire_proto::v1::{self, FrameHeader, frame_header::Kind};
    use tensorwire_transports::mux::frame::{self, Head, Kind as MuxKind};

    let put = |target: &str, name: &str, data: &[u8]| {
        std::fs::create_dir_all(corpus(target)).unwrap();
        std::fs::write(corpus(target).join(name), data).unwrap();
    };
    let join = |segs: Vec<bytes::Bytes>| segs.iter().flat_map(|s| s.iter().copied()).collect::<Vec<u8>>();
    let t = Tensor::from_vec([2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let sd = Object::state_dict([
        ("w", t.clone()),
        ("wt", t.transpose(0, 1).unwrap()),
        ("u", Tensor::from_vec([2], vec![1u16, 2]).unwrap()),
    ]);
    let file = join(torch::save(&sd, &SaveOptions::default()).unwrap());
    put("torch_load", "rust_state_dict.pt", &file);
    let entries = torch::zip::read_entries(&bytes::Bytes::from(file), &Default::default()).unwrap();
    put("pickle", "rust_state_dict.pkl", &entries[0].data);
    put(
        "safetensors_load",
        "rust.safetensors",
        &join(
            safetensors::save(&[("w".into(), t.clone()), ("b".into(), Tensor::zeros(DType::Bool, [3]).unwrap())], None)
                .unwrap(),
        ),
    );
    let ramp: Vec<u8> = (0..4096u32).flat_map(|i| ((i / 16) as f32 * 0.5).to_le_bytes()).collect();
    let mut c = Compressor::new();
    for (name, comp) in [("lz4", Compression::Lz4), ("zstd", Compression::Zstd(3))] {
        for sh in [0u32, 4] {
            let z = c.compress(comp, sh, &ramp).unwrap().unwrap();
            let n = ramp.len();
            let mut seed = vec![(n >> 12) as u8, ((n >> 4) & 0xff) as u8, sh as u8];
            seed.extend_from_slice(&z);
            put(name, &format!("ramp_shuffle{sh}"), &seed);
        }
    }
    // Float planes: weight-like f32, its bf16 top halves, f64, with a tail.
    let mut x = 0x2545f4914f6cdd1du64;
    let w: Vec<f32> = (0..3000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
        .collect();
    let f32b: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).chain([1, 2, 3]).collect();
    let bf16b: Vec<u8> = w.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
    let f64b: Vec<u8> = w.iter().take(500).flat_map(|&v| (v as f64).to_le_bytes()).collect();
    for (name, bytes, elem) in [("f32_tail", &f32b, 4u8), ("bf16", &bf16b, 2), ("f64", &f64b, 8)] {
        let z = c.compress(Compression::Planes, u32::from(elem), bytes).unwrap().unwrap();
        let n = bytes.len();
        let mut seed = vec![n as u8, (n >> 8) as u8, (n >> 16) as u8, elem];
        seed.extend_from_slice(&z);
        put("planes", name, &seed);
    }
    // Deltas: real ones (their headers as metadata lines) that apply: the
    // fuzz entry's base is the payload P reversed, so the new version is
    // P XOR reverse(P).
    for (sel, dtype) in [(0u8, DType::UInt8), (1, DType::Float32), (2, DType::BFloat16)] {
        let n = 64 / dtype.itemsize();
        let p: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37)).collect();
        let base_bytes: Vec<u8> = p.iter().rev().copied().collect();
        let new_bytes: Vec<u8> = p.iter().zip(&base_bytes).map(|(a, b)| a ^ b).collect();
        let base = Tensor::new(dtype, [n], base_bytes).unwrap();
        let d = tensorwire::codecs::delta::encode(&Tensor::new(dtype, [n], new_bytes).unwrap(), &base).unwrap();
        assert_eq!(d.as_bytes().unwrap(), &p[..]);
        let meta: String = d.metadata().iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        let mut seed = vec![meta.len() as u8, sel | 4];
        seed.extend_from_slice(meta.as_bytes());
        seed.extend_from_slice(&p);
        put("delta", &format!("{dtype}"), &seed);
    }
    let chunk = |tid: u64, index: u32, offset: u64, total: u64, raw_len: u64, last: bool, info: bool| {
        FrameHeader::new(Kind::Chunk(v1::Chunk {
            tensor_id: tid,
            index,
            offset,
            total_bytes: total,
            last,
            compression: v1::Compression::None as i32,
            raw_len,
            info: info.then(|| {
                Box::new(v1::TensorInfo { dtype: v1::Dtype::Uint8 as i32, shape: vec![total], ..Default::default() })
            }),
            ..Default::default()
        }))
    };
    let mut wire = BytesMut::new();
    for (i, h) in [chunk(1, 0, 0, 8, 4, false, true), chunk(1, 1, 4, 8, 4, true, false)].iter().enumerate() {
        let meta = h.encode_to_vec();
        frame::encode_frame(
            &Head {
                stream: 1,
                kind: MuxKind::Data,
                flags: (i as u8) & frame::FLAG_FIN,
                meta_len: meta.len() as u32,
                value: 4,
            },
            &meta,
            &[7; 4],
            &mut wire,
        );
    }
    frame::encode_frame(
        &Head { stream: 1, kind: MuxKind::Window, flags: 0, meta_len: 0, value: 4096 },
        &[],
        &[],
        &mut wire,
    );
    put("mux_frames", "two_chunks_and_window", &wire);
    let mut seq = Vec::new();
    for h in [chunk(1, 0, 0, 8, 4, false, true), chunk(1, 1, 4, 8, 4, true, false)] {
        let m = h.encode_to_vec();
        seq.push(m.len() as u8);
        seq.extend_from_slice(&m);
        seq.extend_from_slice(&[9; 4]);
    }
    // A mode byte first: even assembles, odd hands pieces on.
    put("reassembly", "two_chunks", &[&[0u8][..], &seq].concat());
    put("reassembly", "two_chunks_as_pieces", &[&[1u8][..], &seq].concat());

    // shm_side_channel: records of tag + fields (see transports/src/shm/fuzz.rs).
    let msg = |id: u64, op: u64| [id.to_le_bytes(), op.to_le_bytes()].concat();
    let mut side = Vec::new();
    let new_segment = |side: &mut Vec<u8>, id: u64, kind: u8, size_64: u16| {
        side.push(0);
        side.extend_from_slice(&msg(id, 1));
        side.push(kind);
        side.extend_from_slice(&size_64.to_le_bytes());
    };
    new_segment(&mut side, 1, 1, 16); // a sealed 1 KiB segment
    side.push(1); // a frame naming 1000 of its bytes, then 2000 (refused)
    side.push(1);
    side.extend_from_slice(&1000u32.to_le_bytes());
    side.push(1);
    side.push(1);
    side.extend_from_slice(&2000u32.to_le_bytes());
    let shm_chunk = v1::Chunk {
        tensor_id: 1,
        last: true,
        total_bytes: 512,
        raw_len: 512,
        shm_segment: 1,
        compression: v1::Compression::None as i32,
        ..Default::default()
    }
    .encode_to_vec();
    side.push(2);
    side.push(shm_chunk.len() as u8);
    side.push(0);
    side.extend_from_slice(&shm_chunk);
    for op in [2u64, 3, 4] {
        side.push(0);
        side.extend_from_slice(&msg(1, op));
        side.extend_from_slice(&[0, 0, 0]);
    }
    put("shm_side_channel", "new_view_taken_released_forget", &side);
    let mut refused = Vec::new();
    new_segment(&mut refused, 2, 2, 16); // unsealed: refused
    put("shm_side_channel", "unsealed_segment", &refused);
    let mut oversized = Vec::new();
    new_segment(&mut oversized, 3, 1, u16::MAX); // 4 MiB > the 1 MiB limit
    put("shm_side_channel", "oversized_segment", &oversized);
    let mut pipe = Vec::new();
    new_segment(&mut pipe, 4, 3, 1); // a pipe, not a memfd
    put("shm_side_channel", "pipe_descriptor", &pipe);

    // shm_ring: records of tag + fields (see transports/src/shm/fuzz.rs, `ring`).
    let op = |tag: u8, n: u16| [vec![tag], n.to_le_bytes().to_vec()].concat();
    let mut ring = [op(0, 3000), op(1, 1000), op(0, 4000), op(1, 9000), op(0, 12000), op(1, 12000)].concat();
    ring.extend_from_slice(&[3, 5, 0]);
    ring.extend_from_slice(&100u16.to_le_bytes());
    ring.extend_from_slice(&[5, 4, 1]);
    ring.extend_from_slice(&100u16.to_le_bytes());
    put("shm_ring", "writes_reads_across_the_wrap_and_wakeups", &ring);
    let mut hostile = op(0, 100);
    hostile.extend_from_slice(&[2, 0]);
    hostile.extend_from_slice(&u64::MAX.to_le_bytes());
    hostile.extend(op(1, 100));
    hostile.extend_from_slice(&[2, 2]);
    hostile.extend_from_slice(&5000u64.to_le_bytes());
    hostile.extend(op(0, 100));
    put("shm_ring", "a_peer_scribbles_head_and_tail", &hostile);

    // grpc_messages: DATA frame size byte, then gRPC messages of Frame.
    let mut grpc = vec![6u8];
    for h in [chunk(1, 0, 0, 8, 4, false, true), chunk(1, 1, 4, 8, 4, true, false)] {
        let m = v1::Frame { header: Some(h), payload: bytes::Bytes::from_static(&[9; 4]) }.encode_to_vec();
        grpc.push(0);
        grpc.extend_from_slice(&(m.len() as u32).to_be_bytes());
        grpc.extend_from_slice(&m);
    }
    put("grpc_messages", "two_chunks_in_7_byte_data_frames", &grpc);
    put("grpc_messages", "compressed_flag", &[255, 1, 0, 0, 0, 2, 0x12, 0]);
    put("grpc_messages", "oversized_prefix", &[255, 0, 0xff, 0xff, 0xff, 0xff]);

    // handshake: side byte, mux preface, Hello or Welcome frame header.
    let mut preface = BytesMut::new();
    frame::Preface { version: frame::MUX_VERSION, stream_window: 8 << 20, max_frame_payload: 1 << 20 }
        .encode(&mut preface);
    let limits = v1::Limits { max_tensor_bytes: 1 << 30, max_chunk_bytes: 1 << 20, ..Default::default() };
    let hello = FrameHeader::new(Kind::Hello(Box::new(v1::Hello {
        version: 1,
        codecs: vec![v1::Codec::Raw as i32, v1::Codec::Torch as i32],
        compressions: vec![v1::Compression::Lz4 as i32],
        chunk_size: 1 << 20,
        limits: Some(limits),
        auth_token: "secret".into(),
        agent: "seed".into(),
        host_id: "host".into(),
    })));
    let welcome = FrameHeader::new(Kind::Welcome(Box::new(v1::Welcome {
        version: 1,
        codecs: vec![v1::Codec::Raw as i32],
        compressions: vec![v1::Compression::Zstd as i32],
        chunk_size: 1 << 20,
        limits: Some(limits),
        agent: "seed".into(),
        ..Default::default()
    })));
    for (name, side, h) in [("hello", 0u8, hello), ("welcome", 1, welcome)] {
        let mut seed = vec![side];
        seed.extend_from_slice(&preface);
        seed.extend_from_slice(&h.encode_to_vec());
        put("handshake", name, &seed);
    }
}
