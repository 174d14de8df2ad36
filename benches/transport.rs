//! Throughput of one tensor sent over TCP and Unix sockets (1, 64, 256 MiB)
//! and the round trip of a 4 KiB call, each next to its raw-socket baseline
//! in the same run. The server runs on its own thread and runtime; the
//! client on the bench thread.

mod ratio;

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tensorwire::bench::{RawSocket, ServerThread, call_round_trips, raw_copy, raw_round_trips, send_time};
use tensorwire::builtins::builtin_functions;
use tensorwire::{Client, Server};

fn server(scheme: &str) -> ServerThread {
    let url = match scheme {
        "unix" => {
            format!("unix://{}", std::env::temp_dir().join(format!("tw-bench-{}.sock", std::process::id())).display())
        }
        s => format!("{s}://127.0.0.1:0"),
    };
    ServerThread::start(&url, 1, || {
        let mut b = Server::builder();
        for f in builtin_functions() {
            b = b.function(f);
        }
        b
    })
    .expect("bench server starts")
}

fn transports(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for (scheme, raw) in [("tcp", RawSocket::Tcp), ("unix", RawSocket::Unix)] {
        let srv = server(scheme);
        let client = rt.block_on(Client::connect(srv.url())).unwrap();
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
                let h = raw_round_trips(raw, 4096, iters as usize).unwrap();
                ratios.record("raw/rtt", iters, Duration::from_secs_f64(h.mean_ms() / 1e3 * iters as f64))
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
        drop(client);
        drop(srv);
    }
}

criterion_group!(benches, transports);
criterion_main!(benches);
