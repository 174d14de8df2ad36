//! `tensorwire bench`: every enabled transport on loopback, next to its
//! ceiling measured in the same run (a raw socket copy into a warm, reused
//! buffer; the faster of memcpy and, for large tensors, a non-temporal copy between
//! warm buffers for shared memory; a raw quinn
//! stream for QUIC), with the fresh-buffer copy as a labelled extra column. The server runs on its own thread and
//! runtime, the client on this thread, as two processes would; each figure
//! alternates with its baseline over several rounds and reports medians,
//! because loopback timings on shared machines are noisy.

#[cfg(feature = "grpc")]
use crate::harness::tonic_peer::TonicPeer;
#[cfg(feature = "ucx")]
use crate::harness::ucx_perftest_on;
use crate::harness::{
    RawSocket, Receive, ServerThread, batching_functions, bench_client_config, bench_server, bench_server_with,
    call_round_trips, calls_per_second, fetch_time, function_calls_per_second, gib_per_s, raw_copy, raw_copy_into,
    raw_round_trips, ring_exchanges_per_second, send_time, ucx_perftest, wake_round_trips,
};
use clap::Args as ClapArgs;
use tensorwire::{Client, Server};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const DEFAULT_TRANSPORTS: &str = if cfg!(all(feature = "quic", feature = "grpc", feature = "shm")) {
    "tcp,unix,shm,quic,grpc"
} else if cfg!(feature = "quic") {
    "tcp,unix,quic"
} else {
    "tcp,unix"
};

/// Options of `tensorwire bench`.
#[derive(ClapArgs, Debug)]
pub struct BenchArgs {
    /// Transports to measure; one may carry client URL options after `?`
    /// (`shm?ring=0`: shared memory with frames through the socket).
    #[arg(long, value_delimiter = ',', default_value = DEFAULT_TRANSPORTS)]
    transports: Vec<String>,
    /// Tensor sizes for throughput (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', default_value = "1M,64M,256M")]
    sizes: Vec<String>,
    /// Rough time budget per throughput measurement, in seconds.
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
    /// Rounds per figure (each alternates with its baseline); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 2000)]
    round_trips: usize,
    /// Calls per round of the calls-per-second figure (64 in flight on one
    /// connection; the median of the rounds, after a warm-up of a tenth); 0
    /// skips that figure and its shared-memory ring ceiling.
    #[arg(long, default_value_t = 50_000)]
    calls: usize,
    /// Examples for the batching figure (256 callers, 4 KiB inputs, over Unix); 0 skips it.
    #[arg(long, default_value_t = 300_000)]
    batch_examples: usize,
    /// QUIC only: also measure throughput with the connection striped over
    /// this many QUIC connections (server and client then get 2 runtime
    /// threads each, so that the stripes can use more than one core); 1 skips it.
    #[arg(long, default_value_t = 2)]
    stripes: usize,
    /// How long each side of a connection keeps polling after traffic
    /// before it sleeps (`TransportConfig::spin`), in microseconds, for
    /// the bench's servers and clients (default: the library's, 50); 0
    /// measures transports that sleep at once, as the raw ping-pong does.
    #[arg(long)]
    spin_us: Option<u64>,
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// `--link RATE,RTT[,LOSS]`: the WAN benchmark instead (`wan/`).
    #[command(flatten)]
    wan: crate::wan::WanArgs,
}

fn parse_size(s: &str) -> Result<usize, BoxError> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mul) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t.as_str(), 1),
    };
    Ok(num.parse::<usize>().map_err(|_| format!("bad size {s:?}"))? * mul)
}

fn listen_url(scheme: &str) -> String {
    let tmp = std::env::temp_dir().join(format!("tensorwire-bench-{}-{scheme}.sock", std::process::id()));
    match scheme {
        "unix" | "grpc+unix" => format!("{scheme}://{}", tmp.display()),
        "unix+shm" => format!("unix://{}", tmp.display()),
        // A same-host tcp:// client, upgraded to shared memory.
        "tcp+shm" => "tcp://127.0.0.1:0".to_string(),
        "shm" => format!("shm://tensorwire-bench-{}", std::process::id()),
        other => format!("{other}://127.0.0.1:0"),
    }
}

fn baseline_for(scheme: &str) -> RawSocket {
    match scheme {
        #[cfg(feature = "quic")]
        "quic" => RawSocket::Quic,
        "shm" | "unix+shm" | "tcp+shm" => RawSocket::Memcpy,
        s if s.contains("unix") => RawSocket::Unix,
        _ => RawSocket::Tcp,
    }
}

/// The URL a bench client uses: `unix` and `tcp` are the plain sockets
/// (`unix+shm` is the same listener with the shared-memory upgrade, the
/// default, as same-host `tcp://` clients also get).
fn client_url(scheme: &str, server_url: &str) -> String {
    match scheme {
        "unix" | "tcp" => format!("{server_url}?shm=0"),
        _ => server_url.to_string(),
    }
}

/// QUIC striped over `a.stripes` connections, against the same single raw
/// quinn stream, with two runtime threads on each side.
#[cfg(feature = "quic")]
fn striped_rows(a: &BenchArgs, sizes: &[usize], raw: RawSocket) -> Result<(), BoxError> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let server = ServerThread::start(&listen_url("quic"), 2, bench_server)?;
    let mut cfg = bench_client_config();
    cfg.transport.quic.stripes = a.stripes;
    let client = rt.block_on(Client::connect_with(server.url(), cfg))?;
    let label = format!("quic×{}", a.stripes);
    for &size in sizes {
        let reps = ((a.seconds * 1.5e9 / size as f64) as usize).clamp(3, 200);
        let (mut ours, mut base) = (vec![], vec![]);
        for _ in 0..a.rounds.max(1) {
            base.push(gib_per_s(size, raw_copy(raw, size, reps)?));
            ours.push(gib_per_s(size, rt.block_on(send_time(&client, size, reps))?));
        }
        let (g, b) = (median(ours), median(base));
        if a.json {
            println!(
                "{}",
                serde_json::json!({"transport": "quic", "stripes": a.stripes, "size": size, "gib_per_s": g, "raw_gib_per_s": b, "ratio": g / b})
            );
        } else {
            println!("{:<9} {:<5} {:>8} {:>10.2} {:>10.2} {:>7.2}", label, "send", human(size), g, b, g / b);
        }
    }
    drop(client);
    Ok(())
}

/// Runs a blocking baseline (a `ucx_perftest` pair can take a minute over
/// UCX's tcp) on a blocking thread while `rt` keeps driving the client's
/// connection: its keep-alive pings are answered meanwhile instead of the
/// connection timing out on a runtime nobody polls.
fn beside<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    f: impl FnOnce() -> Result<T, BoxError> + Send + 'static,
) -> Result<T, BoxError> {
    rt.block_on(rt.spawn_blocking(f))?
}

/// `ucx://` send and fetch of `size` bytes against `ucx_perftest -t
/// ucp_put_bw` of the same size, run now (same UCX_* environment): the
/// ratio's denominator (on shared memory `ucx://` puts large tensors into
/// receiver-granted memory as that test does). Two `ucx_perftest -t
/// tag_bw` figures (the tagged rendezvous `ucx://` uses elsewhere) are
/// printed beside it as extra columns: with the same environment, and on
/// the transports `ucx://` actually uses for this same-host peer (with `UCX_TLS` unset those are
/// `sysv,posix,self`: cma needs peer failure mode, which UCX 1.13's
/// shared-memory transports lack; see `tensorwire_transports::ucx`).
#[cfg(feature = "ucx")]
fn ucx_rows(a: &BenchArgs, rt: &tokio::runtime::Runtime, size: usize, sent: f64, fetched: f64) -> Result<(), BoxError> {
    let iters = ((a.seconds * 4e9 / size as f64) as usize).clamp(3, 2000);
    let put = beside(rt, move || ucx_perftest("ucp_put_bw", size, iters))?.gib_per_s;
    let tag = beside(rt, move || ucx_perftest("tag_bw", size, iters))?.gib_per_s;
    let ours_tls = tensorwire_transports::ucx::ucx_transports(true)?;
    let tls = ours_tls.clone();
    let tag_ours = beside(rt, move || ucx_perftest_on("tag_bw", size, iters, Some(&tls)))?.gib_per_s;
    for (dir, g) in [("send", sent), ("fetch", fetched)] {
        if a.json {
            println!(
                "{}",
                serde_json::json!({"transport": "ucx", "direction": dir, "size": size, "gib_per_s": g,
                    "ucx_perftest_put_bw_gib_per_s": put, "ratio": g / put, "ucx_perftest_tag_bw_gib_per_s": tag,
                    "ucx_transports": ours_tls, "ucx_perftest_tag_bw_same_transports_gib_per_s": tag_ours})
            );
        } else {
            println!(
                "{:<9} {:<5} {:>8} {:>10.2} {:>10.2} {:>7.2}   vs ucx_perftest -t ucp_put_bw{} (extra: -t tag_bw {:.2} GiB/s, {:.2}x; -t tag_bw on {} as ucx:// uses {:.2} GiB/s, {:.2}x)",
                "ucx",
                dir,
                human(size),
                g,
                put,
                g / put,
                // UCX emulates RMA in software where no transport has it
                // (tcp): then put is no ceiling, the raw TCP row is.
                if put < tag { " [emulated RMA: see the raw TCP row]" } else { "" },
                tag,
                g / tag,
                ours_tls,
                tag_ours,
                g / tag_ours
            );
        }
    }
    Ok(())
}

/// `scheme`'s send and fetch against the plain tonic stream (1 MiB `bytes`
/// messages over the same tuned HTTP/2, into a warm buffer) of the same
/// size, measured in the same rounds.
#[cfg(feature = "grpc")]
fn peer_row(a: &BenchArgs, scheme: &str, size: usize, ours: [f64; 2], tonic: [f64; 2]) {
    for ((dir, g), t) in ["send", "fetch"].into_iter().zip(ours).zip(tonic) {
        if a.json {
            println!(
                "{}",
                serde_json::json!({"transport": scheme, "direction": dir, "size": size, "gib_per_s": g,
                    "tonic_peer_gib_per_s": t, "tonic_peer_ratio": g / t})
            );
        } else {
            println!(
                "{:<9} {:<5} {:>8} {:>10.2} {:>10.2} {:>7.2}   vs a plain tonic stream (1 MiB messages, 16 MiB windows, 1 MiB frames)",
                scheme,
                dir,
                human(size),
                g,
                t,
                g / t
            );
        }
    }
}

/// What a [`RawSocket`] ceiling is, for the JSON rows.
fn ceiling_name(raw: RawSocket) -> &'static str {
    match raw {
        RawSocket::Tcp => "raw TCP into a warm buffer",
        RawSocket::Unix => "raw Unix socket into a warm buffer",
        #[cfg(feature = "quic")]
        RawSocket::Quic => "raw quinn stream into a warm buffer",
        RawSocket::Memcpy => "the faster of memcpy and, for large tensors, a non-temporal copy between warm buffers",
    }
}

/// Same-host transports (shm) next to UCX's own same-host figure,
/// `ucx_perftest -t ucp_put_bw` (cma/sm), run now when it is installed.
fn perftest_row(a: &BenchArgs, rt: &tokio::runtime::Runtime, scheme: &str, size: usize, sent: &[f64], fetched: &[f64]) {
    let (s, f) = (median(sent.to_vec()), median(fetched.to_vec()));
    let iters = ((a.seconds * 4e9 / size as f64) as usize).clamp(3, 2000);
    match beside(rt, move || ucx_perftest("ucp_put_bw", size, iters)) {
        Ok(p) => {
            let put = p.gib_per_s;
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"transport": scheme, "size": size, "send_gib_per_s": s, "fetch_gib_per_s": f,
                        "ucx_perftest_put_bw_gib_per_s": put, "send_ratio": s / put, "fetch_ratio": f / put})
                );
            } else {
                println!(
                    "{:<9} {:<5} {:>8} {:>10} {:>10.2} {:>7}   vs ucx_perftest -t ucp_put_bw (same host): send {:.2}x, fetch {:.2}x",
                    scheme,
                    "",
                    human(size),
                    "",
                    put,
                    "",
                    s / put,
                    f / put
                );
            }
        }
        Err(e) if !a.json => println!("{scheme:<9} {:<5} {:>8}   no ucx_perftest row: {e}", "", human(size)),
        Err(_) => {}
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// Runs the benchmark (on its own runtimes: call it outside any runtime).
pub fn run(a: BenchArgs) -> Result<(), BoxError> {
    if let Some(spec) = a.wan.link {
        return crate::wan::run(a.wan, spec, a.json);
    }
    let sizes: Vec<usize> = a.sizes.iter().map(|s| parse_size(s)).collect::<Result<_, _>>()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let rounds = a.rounds.max(1);
    if !a.json {
        println!(
            "{:<9} {:<5} {:>8} {:>10} {:>10} {:>7} {:>10}   one tensor client→server (send) and server→client (fetch) vs the ceiling: a raw socket copy into a warm reused buffer (QUIC: raw quinn stream; gRPC, ucx: raw TCP, and for ucx also ucx_perftest; shm: the faster of memcpy and, for large tensors, a non-temporal copy between warm buffers), median of {rounds} alternating rounds; \"fresh\": the same raw copy (shm: memcpy) into a new buffer per tensor (page faults; not a ratio's denominator)",
            "transport", "dir", "size", "GiB/s", "ceiling", "ratio", "fresh"
        );
    }
    let mut latency_rows = Vec::new();
    // The rings' size the ring ceiling uses: the transport's own.
    let ring_bytes = tensorwire::TransportConfig::default().shm.ring_bytes;
    // The plain tonic stream the gRPC and tcp transports are compared with.
    #[cfg(feature = "grpc")]
    let mut peer = None;
    for label in &a.transports {
        // `shm?ring=0`: the transport `shm` with the client URL's options.
        let (scheme, options) = label.split_once('?').map_or((label.as_str(), None), |(s, o)| (s, Some(o)));
        let spin = a.spin_us.map(std::time::Duration::from_micros);
        let tune = move |t: &mut tensorwire::TransportConfig| {
            if let Some(s) = spin {
                t.spin = s;
            }
        };
        let server = ServerThread::start(&listen_url(scheme), 1, move || bench_server_with(tune))
            .map_err(|e| format!("{label}: {e}"))?;
        // The server's URL pins its generated certificate (QUIC, grpcs).
        let mut url = client_url(scheme, server.url());
        if let Some(o) = options {
            url.push(if url.contains('?') { '&' } else { '?' });
            url.push_str(o);
        }
        let mut cfg = bench_client_config();
        tune(&mut cfg.transport);
        let client = rt.block_on(Client::connect_with(&url, cfg))?;
        let raw = baseline_for(scheme);
        // Latency against a real socket even where throughput compares to a copy in memory.
        let raw_rtt = if raw == RawSocket::Memcpy { RawSocket::Unix } else { raw };
        for &size in &sizes {
            let reps = ((a.seconds * 1.5e9 / size as f64) as usize).clamp(3, 200);
            let (mut sent, mut fetched, mut base, mut fresh) = (vec![], vec![], vec![], vec![]);
            #[cfg(feature = "grpc")]
            let with_peer = matches!(scheme, "grpc" | "tcp");
            #[cfg(feature = "grpc")]
            let (mut peer_sent, mut peer_fetched) = (vec![], vec![]);
            for _ in 0..rounds {
                base.push(gib_per_s(size, raw_copy(raw, size, reps)?));
                sent.push(gib_per_s(size, rt.block_on(send_time(&client, size, reps))?));
                fetched.push(gib_per_s(size, rt.block_on(fetch_time(&client, size, reps))?));
                #[cfg(feature = "grpc")]
                if with_peer {
                    let max = sizes.iter().copied().max().unwrap_or(size);
                    let p = match &mut peer {
                        Some(p) => p,
                        None => peer.insert(TonicPeer::start(&rt, max)?),
                    };
                    peer_sent.push(gib_per_s(size, rt.block_on(p.push_time(size, reps))?));
                    peer_fetched.push(gib_per_s(size, rt.block_on(p.pull_time(size, reps))?));
                }
            }
            // The fresh-buffer copy, for its labelled column (a few copies: it is slow).
            for _ in 0..rounds {
                fresh.push(gib_per_s(size, raw_copy_into(raw, size, reps.min(5), Receive::Fresh)?));
            }
            let (b, f) = (median(base), median(fresh));
            #[cfg(feature = "ucx")]
            if scheme == "ucx" {
                ucx_rows(&a, &rt, size, median(sent.clone()), median(fetched.clone()))?;
            }
            for (dir, g) in [("send", median(sent.clone())), ("fetch", median(fetched.clone()))] {
                if a.json {
                    println!(
                        "{}",
                        serde_json::json!({"transport": label, "direction": dir, "size": size, "gib_per_s": g,
                            "ceiling_gib_per_s": b, "ceiling": ceiling_name(raw), "ratio": g / b, "fresh_buffer_gib_per_s": f})
                    );
                } else {
                    println!(
                        "{:<9} {:<5} {:>8} {:>10.2} {:>10.2} {:>7.2} {:>10.2}",
                        label,
                        dir,
                        human(size),
                        g,
                        b,
                        g / b,
                        f
                    );
                }
            }
            #[cfg(feature = "grpc")]
            if with_peer {
                peer_row(
                    &a,
                    scheme,
                    size,
                    [median(sent.clone()), median(fetched.clone())],
                    [median(peer_sent), median(peer_fetched)],
                );
            }
            if raw == RawSocket::Memcpy && size >= 1 << 20 {
                perftest_row(&a, &rt, label, size, &sent, &fetched);
            }
        }
        let (mut p50, mut p99, mut b50, mut b99, mut s50) = (vec![], vec![], vec![], vec![], vec![]);
        // Spinning needs a core for each side (see `wake_floor`); QUIC has
        // no spinning raw peer.
        let spin_raw = cores() >= 2 && matches!(raw_rtt, RawSocket::Tcp | RawSocket::Unix);
        for _ in 0..rounds {
            let h = raw_round_trips(raw_rtt, 4096, a.round_trips, false)?;
            b50.push(h.quantile_ms(0.5));
            b99.push(h.quantile_ms(0.99));
            if spin_raw {
                s50.push(raw_round_trips(raw_rtt, 4096, a.round_trips, true)?.quantile_ms(0.5));
            }
            let h = rt.block_on(call_round_trips(&client, 4096, a.round_trips))?;
            p50.push(h.quantile_ms(0.5));
            p99.push(h.quantile_ms(0.99));
        }
        if scheme == "ucx" {
            // tag_lat reports one-way latency: twice that is its round trip.
            let n = a.round_trips.max(1000);
            let t = beside(&rt, move || ucx_perftest("tag_lat", 4096, n))?;
            let rtt_ms = 2.0 * t.p50_us / 1000.0;
            let ours = median(p50.clone());
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"transport": "ucx", "rtt_4k_p50_ms": ours, "ucx_perftest_tag_lat_rtt_p50_ms": rtt_ms, "ratio": ours / rtt_ms})
                );
            } else {
                println!(
                    "ucx       4 KiB call p50 {ours:.4} ms vs ucx_perftest -t tag_lat -s 4096 p50 round trip {rtt_ms:.4} ms: ratio {:.1}",
                    ours / rtt_ms
                );
            }
        }
        // The median of the rounds, after a warm-up (the first calls fault in
        // the rings' pages and fill the allocator's caches).
        if a.calls > 0 {
            rt.block_on(calls_per_second(&client, 4096, 64, (a.calls / 10).max(64)))?;
        }
        // Where the calls go through shared-memory rings, their ceiling
        // (two threads exchanging the same messages through two rings of
        // the transport's size) alternates with them.
        // (Whether the connection agreed on rings is not reported: a
        // shared-memory connection has them unless its URL says `ring=0`.)
        let on_shm = matches!(client.transport(), Some("shm" | "unix+shm"));
        let rings_off = options.is_some_and(|o| o.split('&').any(|kv| kv == "ring=0"));
        let rings = on_shm && !rings_off && cores() >= 2 && a.calls > 0;
        let (mut cps, mut ring_cps) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
        for _ in 0..rounds {
            if rings {
                ring_cps.push(ring_exchanges_per_second(4096, 64, ring_bytes, a.calls)?);
            }
            if a.calls > 0 {
                cps.push(rt.block_on(calls_per_second(&client, 4096, 64, a.calls))?);
            }
        }
        let cps = (a.calls > 0).then(|| median(cps));
        let ring_cps = rings.then(|| median(ring_cps));
        // (After the latency figures: this client's runtime sleeps meanwhile.)
        #[cfg(feature = "quic")]
        if scheme == "quic" && a.stripes > 1 {
            striped_rows(&a, &sizes, raw)?;
        }
        let s50 = spin_raw.then(|| median(s50));
        latency_rows.push((label.clone(), median(p50), median(p99), median(b50), median(b99), s50, cps, ring_cps));
        drop(client);
        drop(server);
    }
    if !a.json {
        let spin = format!("{} µs", spin_us(&a));
        println!();
        println!(
            "{:<8} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>7} {:>12} {:>12} {:>7}   4 KiB identity call (connections spin {spin} after traffic) vs raw ping-pong: each side sleeps in a blocking read; \"spin\": both sides busy-poll non-blocking sockets (the floor; QUIC: one raw stream per round trip, no spinning peer); calls/s@64: median of {rounds} rounds of {} calls, after a warm-up; \"ring/s\" (calls over shared-memory rings): two spinning threads exchanging 4 KiB messages through two {} KiB rings, 64 in flight, alternating with those rounds (the ceiling: the copies and the hand-off alone)",
            "transport",
            "p50 ms",
            "p99 ms",
            "raw p50",
            "raw p99",
            "ratio",
            "spin p50",
            "ratio",
            "calls/s@64",
            "ring/s",
            "ratio",
            a.calls,
            ring_bytes >> 10
        );
    }
    let latency_rows_empty = latency_rows.is_empty();
    for (scheme, p50, p99, b50, b99, s50, cps, ring_cps) in latency_rows {
        if a.json {
            println!(
                "{}",
                serde_json::json!({"transport": scheme, "rtt_4k_p50_ms": p50, "rtt_4k_p99_ms": p99, "raw_p50_ms": b50,
                    "raw_p99_ms": b99, "p50_ratio": p50 / b50, "raw_spinning_p50_ms": s50,
                    "p50_ratio_spinning": s50.map(|s| p50 / s), "spin_us": spin_us(&a),
                    "calls_per_s_64_in_flight": cps, "ring_exchanges_per_s_64_in_flight": ring_cps,
                    "calls_ratio_to_ring": cps.zip(ring_cps).map(|(c, r)| c / r)})
            );
        } else {
            let (s, r) = s50
                .map_or_else(|| ("-".to_string(), "-".to_string()), |s| (format!("{s:.4}"), format!("{:.2}", p50 / s)));
            let (rc, rr) = ring_cps.map_or_else(
                || ("-".to_string(), "-".to_string()),
                |x| (format!("{x:.0}"), cps.map_or_else(|| "-".to_string(), |c| format!("{:.2}", c / x))),
            );
            let cps = cps.map_or_else(|| "-".to_string(), |c| format!("{c:.0}"));
            println!(
                "{:<8} {:>10.4} {:>10.4} {:>10.4} {:>10.4} {:>7.2} {:>10} {:>7} {:>12} {:>12} {:>7}",
                scheme,
                p50,
                p99,
                b50,
                b99,
                p50 / b50,
                s,
                r,
                cps,
                rc,
                rr
            );
        }
    }
    if !latency_rows_empty {
        wake_floor(&a)?;
    }
    if a.batch_examples > 0 {
        batching(&a, &rt)?;
    }
    Ok(())
}

/// The spin the bench's connections use, in microseconds.
fn spin_us(a: &BenchArgs) -> u64 {
    a.spin_us.unwrap_or_else(|| tensorwire::TransportConfig::default().spin.as_micros() as u64)
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The machine's wake-up cost, printed under the latency table: what any
/// round trip whose sides sleep while waiting pays twice.
fn wake_floor(a: &BenchArgs) -> Result<(), BoxError> {
    let sleeping = wake_round_trips(false, a.round_trips)?.0.quantile_ms(0.5);
    // Spinning needs a core for each side: on one, each hand-off waits for
    // a time slice and measures the scheduler instead.
    let spinning = if cores() >= 2 { Some(wake_round_trips(true, a.round_trips)?.1.as_secs_f64() * 1e3) } else { None };
    if a.json {
        println!(
            "{}",
            serde_json::json!({"wake_floor_sleeping_p50_ms": sleeping, "wake_floor_spinning_mean_ms": spinning})
        );
    } else {
        let spun = spinning.map_or_else(|| "not measured (one CPU)".to_string(), |ms| format!("{ms:.5} ms"));
        println!(
            "wake floor: two threads handing a word back and forth, round trip p50 {sleeping:.4} ms when each sleeps until woken (futex); mean {spun} when both spin"
        );
    }
    Ok(())
}

/// Examples per second of a cheap function (×2 on 1024 float32) with 256
/// concurrent callers on one Unix connection: one call per example, and the
/// same function batched (up to 64 per run; the client stacks concurrent calls).
fn batching(a: &BenchArgs, rt: &tokio::runtime::Runtime) -> Result<(), BoxError> {
    let server = ServerThread::start(&listen_url("unix"), 1, || {
        let mut b = Server::builder();
        for f in batching_functions(64, std::time::Duration::from_millis(1)) {
            b = b.function(f);
        }
        b
    })?;
    let client = rt.block_on(Client::connect(server.url()))?;
    let x = tensorwire::Tensor::zeros(tensorwire::DType::Float32, [1024])?;
    let rounds = a.rounds.max(1);
    let (mut plain, mut batched) = (vec![], vec![]);
    for _ in 0..rounds {
        plain.push(rt.block_on(function_calls_per_second(&client, "double", x.clone(), 256, a.batch_examples / 3))?);
        batched.push(rt.block_on(function_calls_per_second(
            &client,
            "double_batched",
            x.clone(),
            256,
            a.batch_examples,
        ))?);
    }
    let (p, b) = (median(plain), median(batched));
    if a.json {
        println!(
            "{}",
            serde_json::json!({"batching_unbatched_per_s": p, "batching_batched_per_s": b, "callers": 256, "input_bytes": 4096})
        );
    } else {
        println!();
        println!(
            "batching, 256 callers x 4 KiB over unix: unbatched {p:.0} examples/s, batched {b:.0} examples/s ({:.1}x)",
            b / p
        );
    }
    Ok(())
}

fn human(n: usize) -> String {
    if n >= 1 << 30 && n.is_multiple_of(1 << 30) {
        format!("{}GiB", n >> 30)
    } else if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}MiB", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}KiB", n >> 10)
    } else {
        format!("{n}B")
    }
}
