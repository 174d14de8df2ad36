//! `tensorwire bench --link RATE,RTT[,LOSS]`: transports × compressions ×
//! data kinds over an emulated WAN link ([`link`]), with the raw TCP
//! socket's figure over the same link measured in the same run as the
//! ceiling.
//!
//! - [`link`]: two network namespaces, TUN devices, `tbf` for the rate and
//!   a userspace relay for delay and loss.
//! - [`data`]: what the rows send (a tiny MLP trained here for the weight
//!   kinds, its activations, int8 weights, random bytes).
//! - [`plot`]: the `--plot FILE.svg` chart (hand-written SVG).
//!
//! The server runs on threads inside namespace b, the client inside a;
//! each row connects anew, warms the connection up with an uncompressed
//! transfer (which also gives `auto` its measured link rate), then times one
//! `send` of the row's tensor (until the server's summary arrives). Bytes
//! on the wire are the relay's IP byte count a → b (headers included).
//!
//! Part of the CLI; may import `harness` and the library, nothing else of
//! the CLI.

pub mod data;
pub mod link;
pub mod plot;

use std::io::{Read, Write};
use std::time::Instant;

use clap::Args as ClapArgs;
use tensorwire::{Client, ClientConfig, CompressionMode, Encoding, Server, StoreService, Tensor};

use crate::harness::ServerThread;
use data::{DataKind, Mlp};
use link::{Link, LinkSpec, Side};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every connection's first transfer, untimed (rows and ceilings alike):
/// 16 MiB, the least the client's link estimate takes.
const WARM_UP_BYTES: usize = 16 << 20;

/// The short transfer the ceilings time right after their bulk one.
const SHORT_BYTES: usize = 1 << 20;

/// ZipNN's published lossless ratios (arXiv 2411.05239), printed beside ours.
const ZIPNN_BF16: f64 = 1.5;
const ZIPNN_FP32: f64 = 1.2;

/// Options of `tensorwire bench --link`.
#[derive(ClapArgs, Debug, Clone)]
pub struct WanArgs {
    /// Run the WAN benchmark over an emulated link RATE,RTT[,LOSS]
    /// (e.g. 100mbit,40ms,0.1%) instead of the loopback benchmark. Needs root.
    #[arg(long)]
    pub link: Option<LinkSpec>,
    /// WAN: transports (tcp, quic-cubic, quic-bbr, grpc; tcp uses --tcp-congestion, grpc the system default).
    #[arg(long, value_delimiter = ',', default_value = "tcp,quic-cubic,quic-bbr,grpc")]
    pub link_transports: Vec<String>,
    /// WAN: compressions (none, lz4, zstd, zstd+shuffle, lz4+shuffle, planes, auto).
    #[arg(long = "compress", value_delimiter = ',', default_value = "none,zstd+shuffle,planes,auto")]
    pub compress: Vec<String>,
    /// WAN: data kinds.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "random,bf16-trained,fp32-trained,relu-activations,int8-weights"
    )]
    pub data: Vec<DataKind>,
    /// WAN: hidden width of the trained MLP (fp32 weights ≈ 4·(256·H + H²) bytes; 2048: 18 MiB).
    #[arg(long, default_value_t = 2048)]
    pub mlp_hidden: usize,
    /// WAN: SGD steps before the checkpoint (the delta row sends the one 100 steps later).
    #[arg(long, default_value_t = 300)]
    pub train_steps: usize,
    /// WAN: bytes of random data and of activations per row (K, M suffixes).
    #[arg(long, default_value = "16M")]
    pub link_size: String,
    /// WAN: also run the delta row (checkpoint 100 steps later vs the previous).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub delta: bool,
    /// WAN: TCP congestion controller of the tcp rows (`tcp://…?congestion=`:
    /// cubic, bbr, reno; gRPC's sockets keep the system default).
    #[arg(long, default_value = "cubic")]
    pub tcp_congestion: String,
    /// WAN: draw the table as an SVG chart to this file.
    #[arg(long)]
    pub plot: Option<std::path::PathBuf>,
}

/// One measured row.
#[derive(Clone, Debug)]
pub struct Row {
    /// Transport label (tcp, quic-bbr, ...).
    pub transport: String,
    /// Data kind label (or `fp32-trained-delta`).
    pub data: String,
    /// Compression label.
    pub compress: String,
    /// Tensor bytes.
    pub bytes: u64,
    /// Seconds for the send (until the server's summary).
    pub seconds: f64,
    /// IP bytes a → b during the send.
    pub wire_bytes: u64,
    /// Compression ratio on the wire: the `none` row's wire bytes over this row's.
    pub compression_ratio: f64,
    /// The `none` row's seconds over this row's.
    pub speedup_vs_none: f64,
    /// Wire bytes per second over the link rate.
    pub link_utilisation: f64,
}

fn parse_size(s: &str) -> Result<usize, BoxError> {
    let t = s.trim().to_ascii_uppercase();
    let (num, mul) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        _ => (t.as_str(), 1),
    };
    Ok(num.parse::<usize>().map_err(|_| format!("bad size {s:?}"))? * mul)
}

/// How a row compresses: the mode and shuffle flag.
fn encoding_of(label: &str) -> Result<(CompressionMode, bool), BoxError> {
    let (name, shuffle) = match label.strip_suffix("+shuffle") {
        Some(n) => (n, true),
        None => (label, false),
    };
    Ok((name.parse::<CompressionMode>()?, shuffle))
}

/// The server side: one store per transport, inside namespace b.
struct Servers {
    urls: Vec<(String, String)>,
    _threads: Vec<ServerThread>,
}

/// The system's default TCP congestion controller (new namespaces start with it).
fn default_tcp_congestion() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map_or_else(|_| "?".into(), |s| s.trim().into())
}

/// Starts one server per transport; TCP-based rows are labelled with their
/// congestion controller (`tcp-cubic`; gRPC: the system default, `grpc-bbr`).
fn start_servers(link: &Link, transports: &[String], tcp_cc: &str) -> Result<Servers, BoxError> {
    let tcp_cc = tcp_cc.to_string();
    let addr = link.addr(Side::B).to_string();
    let transports = transports.to_vec();
    let h = link.spawn_in(Side::B, move || -> Result<Servers, String> {
        let (mut urls, mut threads) = (vec![], vec![]);
        for (i, t) in transports.iter().enumerate() {
            let scheme = match t.as_str() {
                "tcp" => "tcp",
                "grpc" => "grpc",
                q if q.starts_with("quic") => "quic",
                other => return Err(format!("unknown WAN transport {other:?} (tcp, quic-cubic, quic-bbr, grpc)")),
            };
            let mut url = format!("{scheme}://{addr}:{}", 7300 + i);
            if scheme == "tcp" {
                url = format!("{url}?congestion={tcp_cc}");
            }
            let st = ServerThread::start(&url, 2, || {
                Server::builder().service(StoreService::new(tensorwire::DEFAULT_MAX_STORE_BYTES))
            })
            .map_err(|e| format!("{url}: {e}"))?;
            let mut client_url = st.url().to_string();
            if let Some(cc) = t.strip_prefix("quic-") {
                let sep = if client_url.contains('?') { '&' } else { '?' };
                client_url = format!("{client_url}{sep}congestion={cc}");
            }
            let label = match scheme {
                "quic" => t.clone(),
                "tcp" => format!("tcp-{tcp_cc}"),
                _ => format!("{t}-{}", default_tcp_congestion()),
            };
            if scheme == "tcp" && !client_url.contains("congestion=") {
                let sep = if client_url.contains('?') { '&' } else { '?' };
                client_url = format!("{client_url}{sep}congestion={tcp_cc}");
            }
            urls.push((label, client_url));
            threads.push(st);
        }
        Ok(Servers { urls, _threads: threads })
    });
    Ok(h.join().map_err(|_| "server thread panicked")???)
}

fn set_tcp_congestion(s: &std::net::TcpStream, cc: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: TCP_CONGESTION reads `len` bytes of the name from a valid pointer.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            cc.as_ptr().cast(),
            cc.len() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Raw TCP over the link: a plain socket writing in 1 MiB writes, read by
/// the other side, which answers one byte per transfer. The transfers of
/// `sizes` go in order on one connection (the first warms up, as a row's
/// warm-up does); returns each one's seconds until its answer arrives (the
/// same end point as a `send`).
fn raw_tcp(link: &Link, sizes: Vec<usize>, cc: &str) -> Result<Vec<f64>, BoxError> {
    let cc = cc.to_string();
    let addr = format!("{}:7299", link.addr(Side::B));
    let listen = addr.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server_sizes = sizes.clone();
    let server = link.spawn_in(Side::B, move || -> std::io::Result<()> {
        let l = std::net::TcpListener::bind(&listen)?;
        let _ = ready_tx.send(());
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        for bytes in server_sizes {
            let mut left = bytes;
            while left > 0 {
                let n = s.read(&mut buf[..left.min(1 << 20)])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                left -= n;
            }
            s.write_all(&[1])?;
        }
        Ok(())
    });
    ready_rx.recv().map_err(|_| "raw TCP server failed to start")?;
    let client = link.spawn_in(Side::A, move || -> std::io::Result<Vec<f64>> {
        // A warm source of the largest size, read through as a tensor is
        // (as the loopback ceilings do, `harness::raw_copy_into`).
        let buf = crate::harness::warm_buffer(sizes.iter().copied().max().unwrap_or(0));
        let mut s = std::net::TcpStream::connect(&addr)?;
        s.set_nodelay(true)?;
        set_tcp_congestion(&s, &cc)?;
        let mut times = vec![];
        for bytes in sizes {
            let t = Instant::now();
            for piece in buf[..bytes].chunks(1 << 20) {
                s.write_all(piece)?;
            }
            let mut one = [0u8; 1];
            s.read_exact(&mut one)?;
            times.push(t.elapsed().as_secs_f64());
        }
        Ok(times)
    });
    let times = client.join().map_err(|_| "raw TCP client panicked")???;
    server.join().map_err(|_| "raw TCP server panicked")???;
    Ok(times)
}

/// A raw quinn stream over the link (quinn with tensorwire's QUIC settings
/// and congestion controller `cc`, no framing or codec): the QUIC
/// ceiling. Transfers `sizes` in order on one connection (the first warms
/// up, as the rows do); returns each one's seconds (stream opened →
/// acknowledgement).
#[cfg(feature = "quic")]
fn raw_quinn(link: &Link, cc: &str, sizes: Vec<usize>) -> Result<Vec<f64>, BoxError> {
    use crate::harness::{Receive, raw_quic};
    let mut cfg = tensorwire::TransportConfig::default();
    cfg.quic.congestion = cc.parse()?;
    let server_ns = link.netns(Side::B).to_string();
    let at = raw_quic::Placement {
        server_bind: format!("{}:0", link.addr(Side::B)).parse()?,
        client_bind: format!("{}:0", link.addr(Side::A)).parse()?,
        enter_server: Box::new(move || link::enter(&server_ns)),
    };
    let h = link.spawn_in(Side::A, move || raw_quic::transfers(&cfg, at, sizes, Receive::Warm));
    let times = h.join().map_err(|_| "raw quinn client panicked")???;
    Ok(times.iter().map(|d| d.as_secs_f64()).collect())
}

/// The ceilings over the link, measured before the rows: a raw TCP socket
/// with the tcp rows' congestion controller, and a raw quinn stream per
/// QUIC congestion controller among the transports. Each moves a warm-up
/// transfer, then `--link-size` bytes (the bulk ceiling, with its link
/// utilisation), then [`SHORT_BYTES`] right after it: what a short send
/// such as a checkpoint delta can take on a connection that has just
/// carried a bulk one (a congestion controller that overshoots shows here).
fn ceilings(link: &Link, a: &WanArgs, json: bool) -> Result<(), BoxError> {
    let spec = link.spec();
    let bytes = parse_size(&a.link_size)?;
    let sizes = vec![WARM_UP_BYTES, bytes, SHORT_BYTES];
    let report = |what: &str, times: &[f64], wire: u64| {
        // The wire bytes of the bulk transfer: its share of the three.
        let wire = wire as f64 * bytes as f64 / sizes.iter().sum::<usize>() as f64;
        let util = wire / times[1] / spec.bytes_per_sec();
        let ideal = SHORT_BYTES as f64 / spec.bytes_per_sec() + spec.rtt.as_secs_f64();
        if json {
            println!(
                "{}",
                serde_json::json!({"link": spec.to_string(), "ceiling": what, "bytes": bytes,
                    "seconds": times[1], "link_utilisation": util,
                    "short_bytes": SHORT_BYTES, "short_seconds": times[2], "short_ideal_seconds": ideal})
            );
        } else {
            println!(
                "  {what:<26} {} MiB: {:.2} s, link utilisation {:.0}%; then {} MiB: {:.3} s (rate + one RTT: {ideal:.3} s)",
                bytes >> 20,
                times[1],
                util * 100.0,
                SHORT_BYTES >> 20,
                times[2],
            );
        }
    };
    if !json {
        println!("link {spec} (netns + TUN relay + tbf); ceilings over the same link, same run:");
    }
    let before = link.stats().bytes_a_to_b();
    let times = raw_tcp(link, sizes.clone(), &a.tcp_congestion)?;
    report(&format!("raw tcp socket ({})", a.tcp_congestion), &times, link.stats().bytes_a_to_b() - before);
    for t in &a.link_transports {
        let Some(cc) = t.strip_prefix("quic-") else { continue };
        #[cfg(feature = "quic")]
        {
            let before = link.stats().bytes_a_to_b();
            let times = raw_quinn(link, cc, sizes.clone())?;
            report(&format!("raw quinn stream ({cc})"), &times, link.stats().bytes_a_to_b() - before);
        }
        #[cfg(not(feature = "quic"))]
        let _ = cc;
    }
    Ok(())
}

/// The tensors of each data kind, and the delta pair.
struct Dataset {
    tensors: Vec<(DataKind, Tensor)>,
    /// (label, previous checkpoint, checkpoint 100 steps later), fp32 and bf16.
    delta: Vec<(&'static str, Tensor, Tensor)>,
}

fn make_data(a: &WanArgs) -> Result<Dataset, BoxError> {
    let size = parse_size(&a.link_size)?;
    let needs_mlp = a.delta || a.data.iter().any(|d| !matches!(d, DataKind::Random));
    let mut mlp = Mlp::new(256, a.mlp_hidden, 10, 42);
    let (mut w, mut later) = (None, None);
    if needs_mlp {
        let t = Instant::now();
        let l0 = mlp.train(10);
        let l1 = mlp.train(a.train_steps.saturating_sub(10));
        w = Some(mlp.weights_f32());
        eprintln!(
            "trained a 256-{h}-{h}-10 MLP for {} steps in {:.1} s (loss {l0:.3} → {l1:.3}); {} fp32 parameters",
            mlp.steps,
            t.elapsed().as_secs_f64(),
            w.as_ref().map_or(0, Tensor::numel),
            h = a.mlp_hidden
        );
        if a.delta {
            mlp.train(100);
            later = Some(mlp.weights_f32());
        }
    }
    let weights = || w.clone().ok_or("no weights");
    let mut tensors = vec![];
    for &d in &a.data {
        let t = match d {
            DataKind::Random => data::random_bytes(size, 7),
            DataKind::Fp32Trained => weights()?,
            DataKind::Bf16Trained => data::to_bf16(&weights()?),
            DataKind::Int8Weights => data::to_int8(&weights()?),
            DataKind::ReluActivations => mlp.activations((size / 4 / a.mlp_hidden).max(1)),
        };
        tensors.push((d, t.with_name("x")));
    }
    let delta = match (w.clone(), later) {
        (Some(prev), Some(next)) => vec![
            ("fp32-ckpt+100", prev.clone().with_name("ckpt"), next.clone().with_name("ckpt")),
            ("bf16-ckpt+100", data::to_bf16(&prev).with_name("ckpt"), data::to_bf16(&next).with_name("ckpt")),
        ],
        _ => vec![],
    };
    Ok(Dataset { tensors, delta })
}

async fn connect(url: &str, compress: &str) -> Result<Client, BoxError> {
    let (compression, shuffle) = encoding_of(compress)?;
    let mut config =
        ClientConfig { encoding: Encoding { compression, shuffle, ..Encoding::default() }, ..ClientConfig::default() };
    config.transport.tls.insecure_skip_verify_dangerous = !url.contains("pin-sha256") && url.starts_with("quic");
    Ok(Client::connect_with(url, config).await?)
}

/// A warm-up transfer of random bytes ([`WARM_UP_BYTES`]), so that the
/// congestion window is open and `auto` has a measured link rate.
async fn warm_up(c: &Client) -> Result<(), BoxError> {
    let t = data::random_bytes(WARM_UP_BYTES, 99).with_name("warm-up");
    c.send([t]).await?;
    Ok(())
}

fn measure_rows(link: &Link, servers: &Servers, ds: &Dataset, a: &WanArgs) -> Result<Vec<Row>, BoxError> {
    let urls = servers.urls.clone();
    let tensors = ds.tensors.clone();
    let delta = ds.delta.clone();
    let mut compress = a.compress.clone();
    compress.retain(|c| c != "none");
    compress.insert(0, "none".to_string());
    let stats = link.stats_arc();
    let rate = link.spec().bytes_per_sec();
    let h = link.spawn_in(Side::A, move || -> Result<Vec<Row>, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async move {
            let mut rows = vec![];
            let timed = |c: Client, t: Tensor, base: Option<Tensor>| {
                let stats = stats.clone();
                async move {
                    let before = stats.bytes_a_to_b();
                    let start = Instant::now();
                    match &base {
                        None => c.send([t.clone()]).await.map(|_| ())?,
                        Some(b) => c.send_delta(&t, b).await.map(|_| ())?,
                    }
                    let secs = start.elapsed().as_secs_f64();
                    Ok::<_, BoxError>((secs, stats.bytes_a_to_b() - before))
                }
            };
            for (transport, url) in &urls {
                // One connection per compression, warmed up once; `none` first
                // (every row's speed-up and ratio are against it).
                let mut measured: Vec<(usize, usize, f64, u64)> = vec![];
                for (ci, comp) in compress.iter().enumerate() {
                    let c = connect(url, comp).await.map_err(|e| format!("{transport}: {e}"))?;
                    warm_up(&c).await.map_err(|e| format!("{transport} warm-up: {e}"))?;
                    for (ki, (kind, t)) in tensors.iter().enumerate() {
                        let (secs, wire) = timed(c.clone(), t.clone(), None)
                            .await
                            .map_err(|e| format!("{transport} {kind} {comp}: {e}"))?;
                        measured.push((ki, ci, secs, wire));
                    }
                }
                measured.sort_by_key(|m| (m.0, m.1));
                for &(ki, ci, secs, wire) in &measured {
                    let none = measured.iter().find(|m| m.0 == ki && m.1 == 0).map(|m| (m.2, m.3));
                    let (kind, t) = &tensors[ki];
                    rows.push(row(transport, kind.name(), &compress[ci], t.nbytes() as u64, secs, wire, none, rate));
                }
                for (label, prev, next) in &delta {
                    // The server holds `prev`; `next` goes whole (none), then,
                    // after `prev` is stored again, as a delta (auto).
                    let err = |e: BoxError| format!("{transport} delta row: {e}");
                    let whole_c = connect(url, "none").await.map_err(err)?;
                    warm_up(&whole_c).await.map_err(err)?;
                    whole_c.send([prev.clone()]).await.map_err(|e| err(e.into()))?;
                    let whole = timed(whole_c, next.clone(), None).await.map_err(err)?;
                    let n = next.nbytes() as u64;
                    rows.push(row(transport, label, "none", n, whole.0, whole.1, Some(whole), rate));
                    let c = connect(url, "auto").await.map_err(err)?;
                    warm_up(&c).await.map_err(err)?;
                    c.send([prev.clone()]).await.map_err(|e| err(e.into()))?;
                    let d = timed(c.clone(), next.clone(), Some(prev.clone())).await.map_err(err)?;
                    rows.push(row(transport, label, "delta+auto", n, d.0, d.1, Some(whole), rate));
                    let back = c.fetch_one("ckpt").await.map_err(|e| e.to_string())?;
                    if back.crc32c().map_err(|e| e.to_string())? != next.crc32c().map_err(|e| e.to_string())? {
                        return Err("the delta row's stored checkpoint differs (CRC-32C)".into());
                    }
                }
            }
            Ok(rows)
        })
        .map_err(|e: String| e)
    });
    Ok(h.join().map_err(|_| "client thread panicked")???)
}

#[allow(clippy::too_many_arguments)]
fn row(
    transport: &str,
    data: &str,
    compress: &str,
    bytes: u64,
    seconds: f64,
    wire_bytes: u64,
    none: Option<(f64, u64)>,
    rate: f64,
) -> Row {
    let (ns, nw) = none.unwrap_or((seconds, wire_bytes));
    Row {
        transport: transport.into(),
        data: data.into(),
        compress: compress.into(),
        bytes,
        seconds,
        wire_bytes,
        compression_ratio: nw as f64 / wire_bytes.max(1) as f64,
        speedup_vs_none: ns / seconds,
        link_utilisation: wire_bytes as f64 / seconds / rate,
    }
}

fn print_rows(rows: &[Row], json: bool) {
    if json {
        for r in rows {
            println!(
                "{}",
                serde_json::json!({"transport": r.transport, "data": r.data, "compress": r.compress, "bytes": r.bytes,
                    "seconds": r.seconds, "gib_per_s": r.bytes as f64 / r.seconds / (1u64 << 30) as f64,
                    "wire_bytes": r.wire_bytes, "compression_ratio": r.compression_ratio,
                    "speedup_vs_none": r.speedup_vs_none, "link_utilisation": r.link_utilisation})
            );
        }
        return;
    }
    println!(
        "{:<10} {:<17} {:<13} {:>8} {:>8} {:>9} {:>7} {:>7} {:>8}",
        "transport", "data", "compress", "MiB", "seconds", "GiB/s", "util", "ratio", "speedup"
    );
    for r in rows {
        println!(
            "{:<10} {:<17} {:<13} {:>8.1} {:>8.2} {:>9.4} {:>6.0}% {:>7.2} {:>8.2}",
            r.transport,
            r.data,
            r.compress,
            r.bytes as f64 / (1u64 << 20) as f64,
            r.seconds,
            r.bytes as f64 / r.seconds / (1u64 << 30) as f64,
            r.link_utilisation * 100.0,
            r.compression_ratio,
            r.speedup_vs_none
        );
    }
}

/// Prints what bounds the ratios: per delta pair, the best delta ratio
/// measured next to the estimated limit of any lossless XOR delta; per
/// trained-weights kind, the best ratio measured next to ZipNN's published one.
fn print_bounds(rows: &[Row], ds: &Dataset, json: bool) {
    for (label, prev, next) in &ds.delta {
        let Some(limit) = data::xor_delta_limit(prev, next) else { continue };
        let best = rows
            .iter()
            .filter(|r| r.data == *label && r.compress.starts_with("delta"))
            .map(|r| r.compression_ratio)
            .fold(0.0, f64::max);
        if json {
            println!(
                "{}",
                serde_json::json!({"data": label, "best_delta_ratio": best, "xor_delta_entropy_limit": limit})
            );
        } else {
            println!(
                "{label}: delta ratio on the wire {best:.2}x; estimated limit of any lossless XOR delta {limit:.2}x (entropy of each element's highest changed bit + the bits below it)"
            );
        }
    }
    for (data, zipnn) in [("bf16-trained", ZIPNN_BF16), ("fp32-trained", ZIPNN_FP32)] {
        let best = rows
            .iter()
            .filter(|r| r.data == data && r.compress != "none")
            .map(|r| r.compression_ratio)
            .fold(0.0, f64::max);
        if best == 0.0 {
            continue;
        }
        if json {
            println!(
                "{}",
                serde_json::json!({"data": data, "best_compression_ratio": best, "zipnn_published_ratio": zipnn})
            );
        } else {
            println!(
                "{data}: best ratio on the wire {best:.2}x; ZipNN's published figure ~{zipnn}x (arXiv 2411.05239)"
            );
        }
    }
}

/// Runs the WAN benchmark.
pub fn run(a: WanArgs, spec: LinkSpec, json: bool) -> Result<(), BoxError> {
    if let Some(why) = link::unavailable() {
        println!("skipping the WAN benchmark: {why}");
        return Ok(());
    }
    for c in &a.compress {
        encoding_of(c)?;
    }
    let ds = make_data(&a)?;
    let link = Link::up(spec).map_err(|e| format!("cannot set up the emulated link: {e}"))?;
    let servers = start_servers(&link, &a.link_transports, &a.tcp_congestion)?;
    ceilings(&link, &a, json)?;
    let rows = measure_rows(&link, &servers, &ds, &a)?;
    print_rows(&rows, json);
    print_bounds(&rows, &ds, json);
    if let Some(path) = &a.plot {
        std::fs::write(path, plot::svg(&rows, &spec.to_string()))?;
        if !json {
            println!("chart written to {}", path.display());
        }
    }
    drop(servers);
    drop(link);
    Ok(())
}
