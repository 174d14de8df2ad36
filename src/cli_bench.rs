//! `tensorwire bench`: every enabled transport on loopback, next to its raw
//! baseline measured in the same run.

use std::time::Duration;

use clap::Args as ClapArgs;
use tensorwire::bench::{RawSocket, calls_per_second, call_round_trips, gib_per_s, raw_copy, raw_round_trips, send_time};
use tensorwire::builtins::builtin_functions;
use tensorwire::{Client, ClientConfig, Histogram, Server, ServerConfig};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Options of `tensorwire bench`.
#[derive(ClapArgs, Debug)]
pub struct BenchArgs {
    /// Transports to measure (default: tcp and unix).
    #[arg(long, value_delimiter = ',', default_value = "tcp,unix")]
    transports: Vec<String>,
    /// Tensor sizes for throughput (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', default_value = "1M,64M,256M")]
    sizes: Vec<String>,
    /// Rough time budget per throughput point, in seconds.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Round trips measured for latency.
    #[arg(long, default_value_t = 2000)]
    round_trips: usize,
    /// Calls for the calls-per-second point (64 in flight).
    #[arg(long, default_value_t = 20_000)]
    calls: usize,
    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
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

fn listen_url(scheme: &str) -> (String, Option<std::path::PathBuf>) {
    let tmp = std::env::temp_dir().join(format!("tensorwire-bench-{}-{scheme}.sock", std::process::id()));
    match scheme {
        "unix" | "grpc+unix" => (format!("{scheme}://{}", tmp.display()), Some(tmp)),
        "shm" => (format!("shm://tensorwire-bench-{}", std::process::id()), None),
        other => (format!("{other}://127.0.0.1:0"), None),
    }
}

fn baseline_for(scheme: &str) -> RawSocket {
    if scheme.contains("unix") || scheme == "shm" { RawSocket::Unix } else { RawSocket::Tcp }
}

fn ms(h: &Histogram) -> (f64, f64) {
    (h.quantile_ms(0.5), h.quantile_ms(0.99))
}

pub async fn run(a: BenchArgs) -> Result<(), BoxError> {
    let sizes: Vec<usize> = a.sizes.iter().map(|s| parse_size(s)).collect::<Result<_, _>>()?;
    if !a.json {
        println!("{:<8} {:>8} {:>10} {:>10} {:>7}   (throughput: send one tensor; baseline: raw socket, same run)", "transport", "size", "GiB/s", "raw GiB/s", "ratio");
    }
    let mut latency_rows = Vec::new();
    for scheme in &a.transports {
        let (url, cleanup) = listen_url(scheme);
        let mut builder = Server::builder().config(ServerConfig::default());
        for f in builtin_functions() {
            builder = builder.function(f);
        }
        let server = builder.build().start([url]).await.map_err(|e| format!("{scheme}: {e}"))?;
        let mut cfg = ClientConfig::default();
        cfg.transport.tls.insecure_skip_verify_dangerous = true; // loopback, self-signed
        let client = Client::connect_with(&server.url(), cfg).await?;
        let raw = baseline_for(scheme);
        for &size in &sizes {
            let reps = ((a.seconds * 1.5e9 / size as f64) as usize).clamp(3, 200);
            let ours = send_time(&client, size, reps).await?;
            let base = tokio::task::spawn_blocking(move || raw_copy(raw, size, reps)).await??;
            let (g, b) = (gib_per_s(size, ours), gib_per_s(size, base));
            if a.json {
                println!("{}", serde_json::json!({"transport": scheme, "size": size, "gib_per_s": g, "raw_gib_per_s": b, "ratio": g / b}));
            } else {
                println!("{:<8} {:>8} {:>10.2} {:>10.2} {:>7.2}", scheme, human(size), g, b, g / b);
            }
        }
        let rt = a.round_trips;
        let ours = call_round_trips(&client, 4096, rt).await?;
        let base = tokio::task::spawn_blocking(move || raw_round_trips(raw, 4096, rt)).await??;
        let cps = calls_per_second(&client, 4096, 64, a.calls).await?;
        latency_rows.push((scheme.clone(), ms(&ours), ms(&base), cps));
        drop(client);
        server.shutdown().await;
        if let Some(p) = cleanup {
            let _ = std::fs::remove_file(p);
        }
    }
    if !a.json {
        println!();
        println!("{:<8} {:>11} {:>11} {:>11} {:>11} {:>7} {:>12}", "transport", "p50 ms", "p99 ms", "raw p50", "raw p99", "ratio", "calls/s@64");
    }
    for (scheme, (p50, p99), (b50, b99), cps) in latency_rows {
        if a.json {
            println!(
                "{}",
                serde_json::json!({"transport": scheme, "rtt_4k_p50_ms": p50, "rtt_4k_p99_ms": p99, "raw_p50_ms": b50, "raw_p99_ms": b99, "p50_ratio": p50 / b50, "calls_per_s_64_in_flight": cps})
            );
        } else {
            println!("{:<8} {:>11.4} {:>11.4} {:>11.4} {:>11.4} {:>7.2} {:>12.0}", scheme, p50, p99, b50, b99, p50 / b50, cps);
        }
    }
    let _ = Duration::ZERO;
    Ok(())
}

fn human(n: usize) -> String {
    if n >= 1 << 30 && n % (1 << 30) == 0 {
        format!("{}GiB", n >> 30)
    } else if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}KiB", n >> 10)
    } else {
        format!("{n}B")
    }
}
