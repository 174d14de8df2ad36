//! Throughput of one tensor sent over TCP and Unix sockets (1, 64, 256 MiB)
//! and the round trip of a 4 KiB call, each next to its ceiling in the same
//! run (a raw socket copy into a warm, reused receive buffer); and 1 GiB over QUIC next to a raw quinn stream. The
//! server runs on its own thread and runtime; the client on the bench thread.
//! 256 MiB over gRPC in both directions next to raw TCP.
//! `cargo bench --bench transport -- quic` runs the QUIC group alone;
//! `-- grpc` the gRPC group; `-- shm` shared memory next to the Unix
//! socket and memcpy; `--features ucx -- ucx` 256 MiB over `ucx://` next to
//! `ucx_perftest`.

// The measurement helpers are the CLI's (`tensorwire bench`), not the
// library's: included by path so both run the same code.
#[path = "../src/bin/tensorwire/harness/mod.rs"]
mod harness;
mod ratio;

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use harness::{
    RawSocket, ServerThread, bench_server, call_round_trips, fetch_time, raw_copy, raw_round_trips, send_time,
};
use tensorwire::Client;

fn server(scheme: &str) -> ServerThread {
    let url = match scheme {
        "unix" => {
            format!("unix://{}", std::env::temp_dir().join(format!("tw-bench-{}.sock", std::process::id())).display())
        }
        s => format!("{s}://127.0.0.1:0"),
    };
    ServerThread::start(&url, 1, bench_server).expect("bench server starts")
}

fn transports(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for (scheme, raw) in [("tcp", RawSocket::Tcp), ("unix", RawSocket::Unix)] {
        let srv = server(scheme);
        // The plain socket transport (unix:// would upgrade to shared memory).
        // (and tcp:// on the same host would upgrade the same way).
        let url = format!("{}?shm=0", srv.url());
        let client = rt.block_on(Client::connect(&url)).unwrap();
        let ratios = ratio::Ratios::default();
        let mut g = c.benchmark_group(format!("throughput/{scheme}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
        for (label, size) in [("1MiB", 1usize << 20), ("64MiB", 64 << 20), ("256MiB", 256 << 20)] {
            g.throughput(Throughput::Bytes(size as u64));
            let raw_id = format!("raw/{label}");
            let tw_id = format!("tensorwire/{label}");
            g.bench_with_input(BenchmarkId::new("raw-socket", label), &size, |b, &size| {
                b.iter_custom(|iters| {
                    ratios.record(&raw_id, iters, raw_copy(raw, size, iters as usize).unwrap() * iters as u32)
                })
            });
            g.bench_with_input(BenchmarkId::new("tensorwire", label), &size, |b, &size| {
                b.iter_custom(|iters| {
                    let d = rt.block_on(send_time(&client, size, iters as usize)).unwrap() * iters as u32;
                    ratios.record(&tw_id, iters, d)
                })
            });
        }
        g.finish();
        for label in ["1MiB", "64MiB", "256MiB"] {
            ratios.print_speed(&format!("{scheme} {label}"), &format!("tensorwire/{label}"), &format!("raw/{label}"));
        }
        let mut g = c.benchmark_group(format!("round-trip-4KiB/{scheme}"));
        g.sample_size(20).measurement_time(Duration::from_secs(3));
        g.bench_function("raw-socket", |b| {
            b.iter_custom(|iters| {
                let h = raw_round_trips(raw, 4096, iters as usize, false).unwrap();
                ratios.record("raw/rtt", iters, Duration::from_secs_f64(h.mean_ms() / 1e3 * iters as f64))
            })
        });
        // Both sides busy-polling: the floor for a transport that spins.
        g.bench_function("raw-socket-spinning", |b| {
            b.iter_custom(|iters| {
                let h = raw_round_trips(raw, 4096, iters as usize, true).unwrap();
                ratios.record("raw-spin/rtt", iters, Duration::from_secs_f64(h.mean_ms() / 1e3 * iters as f64))
            })
        });
        g.bench_function("tensorwire-identity-call", |b| {
            b.iter_custom(|iters| {
                let h = rt.block_on(call_round_trips(&client, 4096, iters as usize)).unwrap();
                ratios.record("tw/rtt", iters, Duration::from_secs_f64(h.mean_ms() / 1e3 * iters as f64))
            })
        });
        g.finish();
        ratios.print_latency(&format!("{scheme} 4KiB round trip"), "tw/rtt", "raw/rtt");
        ratios.print_latency(&format!("{scheme} 4KiB round trip vs spinning raw"), "tw/rtt", "raw-spin/rtt");
        drop(client);
        drop(srv);
    }
}

/// 1 GiB over QUIC on loopback: a raw quinn stream (same certificates,
/// windows and congestion control), tensorwire over one connection, and
/// tensorwire striped over two (with two runtime threads per side).
#[cfg(feature = "quic")]
fn quic_1gib(c: &mut Criterion) {
    const GIB: usize = 1 << 30;
    let single = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let srv = server("quic");
    let striped_srv = ServerThread::start("quic://127.0.0.1:0", 2, bench_server).unwrap();
    let striped_url = format!("{}&stripes=2", striped_srv.url());
    let ratios = ratio::Ratios::default();
    let mut g = c.benchmark_group("throughput-1GiB/quic");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(20));
    g.throughput(Throughput::Bytes(GIB as u64));
    g.bench_function("raw-quinn-stream", |b| {
        b.iter_custom(|iters| {
            ratios.record("raw", iters, raw_copy(RawSocket::Quic, GIB, iters as usize).unwrap() * iters as u32)
        })
    });
    // Clients connect per sample: a client whose runtime is not driven
    // (while the baseline runs) sends no keep-alives and is timed out.
    g.bench_function("tensorwire", |b| {
        let client = single.block_on(Client::connect(srv.url())).unwrap();
        b.iter_custom(|iters| {
            ratios.record("tw", iters, single.block_on(send_time(&client, GIB, iters as usize)).unwrap() * iters as u32)
        })
    });
    g.bench_function("tensorwire-2-stripes", |b| {
        let striped = multi.block_on(Client::connect(&striped_url)).unwrap();
        b.iter_custom(|iters| {
            ratios.record(
                "tw2",
                iters,
                multi.block_on(send_time(&striped, GIB, iters as usize)).unwrap() * iters as u32,
            )
        })
    });
    g.finish();
    ratios.print_speed("quic 1GiB", "tw", "raw");
    ratios.print_speed("quic 1GiB, 2 stripes", "tw2", "raw");
}

#[cfg(not(feature = "quic"))]
fn quic_1gib(_: &mut Criterion) {}

/// 256 MiB over `scheme`, sent (`names[0]`) and fetched (`names[1]`), next
/// to a raw TCP socket copy into a warm buffer, as one criterion group; the
/// mean times come back as "raw", "send" and "fetch".
#[cfg(any(feature = "grpc", feature = "ucx"))]
fn send_fetch_256mib(c: &mut Criterion, scheme: &str, names: [&str; 2], measurement: Duration) -> ratio::Ratios {
    const SIZE: usize = 256 << 20;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let srv = server(scheme);
    let client = rt.block_on(Client::connect(srv.url())).unwrap();
    let ratios = ratio::Ratios::default();
    let mut g = c.benchmark_group(format!("throughput-256MiB/{scheme}"));
    g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(measurement);
    g.throughput(Throughput::Bytes(SIZE as u64));
    g.bench_function("raw-tcp", |b| {
        b.iter_custom(|iters| {
            ratios.record("raw", iters, raw_copy(RawSocket::Tcp, SIZE, iters as usize).unwrap() * iters as u32)
        })
    });
    g.bench_function(names[0], |b| {
        b.iter_custom(|iters| {
            ratios.record("send", iters, rt.block_on(send_time(&client, SIZE, iters as usize)).unwrap() * iters as u32)
        })
    });
    g.bench_function(names[1], |b| {
        b.iter_custom(|iters| {
            let d = rt.block_on(fetch_time(&client, SIZE, iters as usize)).unwrap() * iters as u32;
            ratios.record("fetch", iters, d)
        })
    });
    g.finish();
    ratios
}

/// 256 MiB over gRPC (default settings) client→server and server→client,
/// next to a raw TCP socket copy.
#[cfg(feature = "grpc")]
fn grpc_256mib(c: &mut Criterion) {
    let ratios = send_fetch_256mib(c, "grpc", ["grpc-send", "grpc-fetch"], Duration::from_secs(6));
    ratios.print_speed("grpc 256MiB client->server", "send", "raw");
    ratios.print_speed("grpc 256MiB server->client", "fetch", "raw");
}

#[cfg(not(feature = "grpc"))]
fn grpc_256mib(_: &mut Criterion) {}

/// 256 MiB over shared memory next to the plain Unix socket transport, a
/// raw Unix socket copy into a warm buffer and memcpy between warm buffers
/// (the ceiling), in one run.
#[cfg(feature = "shm")]
fn shm_256mib(c: &mut Criterion) {
    const SIZE: usize = 256 << 20;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let srv = server("unix");
    let shm = rt.block_on(Client::connect(srv.url())).unwrap();
    let plain = rt.block_on(Client::connect(&format!("{}?shm=0", srv.url()))).unwrap();
    let ratios = ratio::Ratios::default();
    let mut g = c.benchmark_group("throughput-256MiB/shm");
    g.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(4));
    g.throughput(Throughput::Bytes(SIZE as u64));
    g.bench_function("memcpy-warm-buffers", |b| {
        b.iter_custom(|iters| {
            ratios.record("memcpy", iters, raw_copy(RawSocket::Memcpy, SIZE, iters as usize).unwrap() * iters as u32)
        })
    });
    g.bench_function("raw-unix-socket", |b| {
        b.iter_custom(|iters| {
            ratios.record("raw", iters, raw_copy(RawSocket::Unix, SIZE, iters as usize).unwrap() * iters as u32)
        })
    });
    g.bench_function("tensorwire-unix", |b| {
        b.iter_custom(|iters| {
            ratios.record("unix", iters, rt.block_on(send_time(&plain, SIZE, iters as usize)).unwrap() * iters as u32)
        })
    });
    g.bench_function("tensorwire-shm", |b| {
        b.iter_custom(|iters| {
            ratios.record("shm", iters, rt.block_on(send_time(&shm, SIZE, iters as usize)).unwrap() * iters as u32)
        })
    });
    g.finish();
    ratios.print_speed("shm 256MiB vs the Unix socket transport", "shm", "unix");
    ratios.print_speed("shm 256MiB vs memcpy between warm buffers", "shm", "memcpy");
    ratios.print_speed("unix 256MiB vs raw Unix socket", "unix", "raw");
}

#[cfg(not(feature = "shm"))]
fn shm_256mib(_: &mut Criterion) {}

/// 256 MiB over `ucx://` (send and fetch) next to UCX's own
/// `ucx_perftest -t ucp_put_bw` of the same size (its ceiling: one copy by
/// `cma` on one host) and a raw TCP copy, in one run. Needs feature `ucx`
/// and `ucx_perftest` (package `ucx-utils`); says so and skips otherwise.
#[cfg(feature = "ucx")]
fn ucx_256mib(c: &mut Criterion) {
    const SIZE: usize = 256 << 20;
    let perftest = match harness::ucx_perftest("ucp_put_bw", SIZE, 20) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("ucx group skipped: {e}");
            return;
        }
    };
    let ratios = send_fetch_256mib(c, "ucx", ["send", "fetch"], Duration::from_secs(4));
    println!("ucx_perftest -t ucp_put_bw -s {SIZE}: {:.2} GiB/s (measured before the group)", perftest.gib_per_s);
    for dir in ["send", "fetch"] {
        if let Some(t) = ratios.mean(dir) {
            let gib = SIZE as f64 / t / (1u64 << 30) as f64;
            println!("RATIO ucx 256MiB {dir} vs ucx_perftest: {:.2}x ({gib:.2} GiB/s)", gib / perftest.gib_per_s);
        }
    }
    ratios.print_speed("ucx 256MiB client->server vs raw TCP", "send", "raw");
    ratios.print_speed("ucx 256MiB server->client vs raw TCP", "fetch", "raw");
}

#[cfg(not(feature = "ucx"))]
fn ucx_256mib(_: &mut Criterion) {}

criterion_group!(benches, transports, quic_1gib, grpc_256mib, shm_256mib, ucx_256mib);
criterion_main!(benches);
