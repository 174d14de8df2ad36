//! Every codec and compression on 64 MiB of float32 — random values and a
//! smooth ramp — reporting encode and decode throughput and the compression
//! ratio, next to a memcpy of the same bytes in the same run.

mod ratio;

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tensorwire::builtins::random_tensor;
use tensorwire::codecs::compress::{Compressor, Decompressor};
use tensorwire::codecs::{CodecKind, Compression, DType, DecodeLimits, Tensor, codec};

const N: usize = 16 << 20; // 64 MiB of f32
const CHUNK: usize = 1 << 20;

fn inputs() -> Vec<(&'static str, Tensor)> {
    let ramp: Vec<f32> = (0..N).map(|i| i as f32 * 1e-3).collect();
    vec![("random", random_tensor(DType::Float32, &[N], 1).unwrap()), ("ramp", Tensor::from_vec([N], ramp).unwrap())]
}

fn memcpy_and_codecs(c: &mut Criterion) {
    let ratios = ratio::Ratios::default();
    let bytes = (N * 4) as u64;
    let mut g = c.benchmark_group("codec-64MiB-f32");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).throughput(Throughput::Bytes(bytes));
    let src = random_tensor(DType::Float32, &[N], 2).unwrap();
    let src = src.as_bytes().unwrap().to_vec();
    // The ceiling is a copy into a warm buffer (the bare copy); a copy into
    // a fresh buffer (what a receiver without a pool pays, page faults
    // included) is measured for reference only, never a ratio's base.
    g.bench_function("memcpy-fresh", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                let mut dst = vec![0u8; src.len()];
                dst.copy_from_slice(&src);
                std::hint::black_box(&dst);
            }
            ratios.record("memcpy-fresh", iters, t.elapsed())
        })
    });
    let mut warm = vec![0u8; src.len()];
    g.bench_function("memcpy-warm", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                warm.copy_from_slice(&src);
                std::hint::black_box(&warm);
            }
            ratios.record("memcpy-warm", iters, t.elapsed())
        })
    });
    let limits = DecodeLimits::default();
    for kind in [CodecKind::Raw, CodecKind::Torch, CodecKind::Safetensors] {
        let codec = codec(kind).unwrap();
        let (_, t) = &inputs()[0];
        let name = kind.name();
        g.bench_function(format!("{name}/encode"), |b| {
            b.iter_custom(|iters| {
                let s = Instant::now();
                for _ in 0..iters {
                    std::hint::black_box(codec.encode(t).unwrap());
                }
                ratios.record(&format!("{name}/encode"), iters, s.elapsed())
            })
        });
        let enc = codec.encode(t).unwrap();
        let payload = enc.to_bytes();
        g.bench_function(format!("{name}/decode"), |b| {
            b.iter_custom(|iters| {
                let s = Instant::now();
                for _ in 0..iters {
                    // From the buffer the transport filled (no copy).
                    std::hint::black_box(codec.decode(&enc.info, payload.clone(), &limits).unwrap());
                }
                ratios.record(&format!("{name}/decode"), iters, s.elapsed())
            })
        });
    }
    g.finish();
    for k in ["raw", "torch", "safetensors"] {
        ratios.print_speed(&format!("{k} encode"), &format!("{k}/encode"), "memcpy-warm");
        ratios.print_speed(&format!("{k} decode"), &format!("{k}/decode"), "memcpy-warm");
    }

    let mut g = c.benchmark_group("compress-64MiB-f32");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).throughput(Throughput::Bytes(bytes));
    for (data_name, t) in inputs() {
        let data = t.as_bytes().unwrap().to_vec();
        for (cname, comp, shuffle) in [
            ("lz4", Compression::Lz4, 0u32),
            ("lz4+shuffle", Compression::Lz4, 4),
            ("zstd1", Compression::Zstd(1), 0),
            ("zstd1+shuffle", Compression::Zstd(1), 4),
            ("zstd3+shuffle", Compression::Zstd(3), 4),
            ("planes", Compression::Planes, 4),
        ] {
            let mut cz = Compressor::new();
            let packed: Vec<Option<Vec<u8>>> =
                data.chunks(CHUNK).map(|ch| cz.compress(comp, shuffle, ch).unwrap()).collect();
            let wire: usize =
                packed.iter().zip(data.chunks(CHUNK)).map(|(p, ch)| p.as_ref().map_or(ch.len(), Vec::len)).sum();
            println!(
                "RATIO compression {cname} on {data_name}: {:.1}x ({} -> {wire} bytes)",
                data.len() as f64 / wire as f64,
                data.len()
            );
            g.bench_function(format!("{data_name}/{cname}/encode"), |b| {
                b.iter(|| {
                    for ch in data.chunks(CHUNK) {
                        std::hint::black_box(cz.compress(comp, shuffle, ch).unwrap());
                    }
                })
            });
            let mut dz = Decompressor::new();
            let mut out = vec![0u8; CHUNK];
            g.bench_function(format!("{data_name}/{cname}/decode"), |b| {
                b.iter(|| {
                    for (p, ch) in packed.iter().zip(data.chunks(CHUNK)) {
                        match p {
                            Some(p) => dz.decompress(comp, shuffle, p, &mut out[..ch.len()]).unwrap(),
                            None => out[..ch.len()].copy_from_slice(ch),
                        }
                    }
                    std::hint::black_box(&out);
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, memcpy_and_codecs);
criterion_main!(benches);
