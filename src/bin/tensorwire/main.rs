//! `tensorwire`: serve, send, fetch, ls, rm, call, info, health and bench.

mod alloc;
mod bench;
mod files;
mod harness;
mod store;
mod wan;

/// The program's allocator: mimalloc ([`alloc::Allocator`]).
#[global_allocator]
static ALLOCATOR: alloc::Allocator = alloc::Allocator;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Args as ClapArgs, Parser, Subcommand};
use tensorwire::builtins::{builtin_functions, random_tensor};
use tensorwire::{
    Args, Client, ClientConfig, CodecKind, CompressionMode, DType, Encoding, Server, ServerConfig, Tensor,
    TransportConfig,
};
use tensorwire::{StoreService, parse_shape};

#[derive(Parser, Debug)]
#[command(name = "tensorwire", version, about = "Move tensors between processes and machines", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log level: error, warn, info, debug, trace (or a tracing filter).
    /// Default: info, and warn for `bench` (so no log line lands between
    /// the rows of its table).
    #[arg(long, global = true, env = "TENSORWIRE_LOG")]
    log_level: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve: store tensors sent by name, return them from fetch, echo
    /// exchanges, and run the built-in functions (identity, scale, sum, add).
    Serve(ServeArgs),
    /// Send tensors (from a file or random) to a server; a state dict file
    /// with --name is stored as one state dict.
    Send(SendArgs),
    /// Fetch a tensor, or a whole state dict, by name.
    Fetch(FetchArgs),
    /// List what the server stores: name, dtype, shape, bytes, state dict, age.
    Ls(store::LsArgs),
    /// Delete a stored tensor, a whole state dict, or everything under a prefix.
    Rm(store::RmArgs),
    /// Call a named function.
    Call(CallArgs),
    /// Print the server's name, version, transports, codecs and totals.
    Info(ConnArgs),
    /// Exit 0 when the server is serving, 1 otherwise.
    Health(ConnArgs),
    /// Benchmark every enabled transport on loopback against raw sockets
    /// (`--link RATE,RTT[,LOSS]`: over an emulated WAN link instead).
    Bench(bench::BenchArgs),
}

#[derive(ClapArgs, Debug)]
struct ServeArgs {
    /// URL to listen on (repeatable): tcp://HOST:PORT, unix:///PATH, quic://..., grpc://..., shm://NAME,
    /// http://HOST:PORT (JSON-RPC 2.0 at POST /rpc)
    #[arg(long = "listen", required = true)]
    listen: Vec<String>,
    /// Chunk size in bytes for tensors the server sends.
    #[arg(long, default_value_t = tensorwire::DEFAULT_CHUNK_SIZE)]
    chunk_size: usize,
    /// Largest tensor accepted, in bytes.
    #[arg(long, default_value_t = tensorwire::DEFAULT_MAX_TENSOR_BYTES)]
    max_tensor_bytes: u64,
    /// Memory budget of the tensor store, in bytes.
    #[arg(long, default_value_t = tensorwire::DEFAULT_MAX_STORE_BYTES)]
    max_store_bytes: u64,
    /// What a full store does: refuse new tensors, or drop the least recently used.
    #[arg(long, default_value_t = tensorwire::EvictPolicy::default())]
    store_evict: tensorwire::EvictPolicy,
    /// Memory budget for everything clients make the server hold (tensors in
    /// flight and stored, task results), in bytes (default: half of RAM).
    #[arg(long)]
    max_memory_bytes: Option<u64>,
    /// Most bytes of receive buffers kept for reuse (the receive pool; at
    /// most a quarter of the memory budget; 0: none).
    #[arg(long, default_value_t = tensorwire::DEFAULT_RECV_POOL_BYTES)]
    recv_pool_bytes: u64,
    /// Most connections open at once (default: half the open-file limit).
    #[arg(long)]
    max_connections: Option<usize>,
    /// Wrong auth tokens a peer may present per minute before it is refused (0: no limit).
    #[arg(long, default_value_t = tensorwire::DEFAULT_MAX_AUTH_FAILURES)]
    max_auth_failures: u32,
    /// Require this token in client handshakes.
    #[arg(long, env = "TENSORWIRE_TOKEN")]
    auth_token: Option<String>,
    /// Server certificate (PEM) for QUIC and grpcs; without it a
    /// self-signed certificate is generated and its fingerprint printed.
    #[arg(long)]
    cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long)]
    key: Option<PathBuf>,
    /// CA (PEM) that client certificates must chain to (mutual TLS).
    #[arg(long)]
    client_ca: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP on this address (e.g. 127.0.0.1:9100).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Service name reported by `info`.
    #[arg(long, default_value = tensorwire::DEFAULT_SERVICE_NAME)]
    service_name: String,
    /// Largest JSON-RPC request body on http:// listeners, in bytes.
    #[arg(long, default_value_t = tensorwire::DEFAULT_MAX_HTTP_BODY_BYTES)]
    max_http_body_bytes: u64,
    /// Largest JSON-RPC response on http:// listeners, in bytes (a batch's
    /// answers together; tensors count as base64, 4/3 of their bytes).
    #[arg(long, default_value_t = tensorwire::DEFAULT_MAX_HTTP_RESPONSE_BYTES)]
    max_http_response_bytes: u64,
}

#[derive(ClapArgs, Debug, Clone)]
struct ConnArgs {
    /// Server URL.
    #[arg(long = "to", visible_alias = "from")]
    to: String,
    /// Trust this CA (PEM) for the server's certificate (QUIC, grpcs).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Accept the server certificate with this SHA-256 fingerprint (hex).
    #[arg(long)]
    pin_sha256: Option<String>,
    /// Verify this name in the server certificate instead of the URL's host.
    #[arg(long)]
    server_name: Option<String>,
    /// Skip certificate verification. Development only: anyone can impersonate the server.
    #[arg(long)]
    insecure_dev: bool,
    /// Client certificate (PEM) for mutual TLS.
    #[arg(long)]
    client_cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS.
    #[arg(long)]
    client_key: Option<PathBuf>,
    /// Auth token for the handshake.
    #[arg(long, env = "TENSORWIRE_TOKEN")]
    auth_token: Option<String>,
    /// Print one JSON object on the last line.
    #[arg(long)]
    json: bool,
}

#[derive(ClapArgs, Debug, Clone)]
struct EncodingArgs {
    /// Codec for tensors sent: raw, torch, safetensors.
    #[arg(long, default_value_t = Encoding::default().codec)]
    codec: CodecKind,
    /// Compression: none, lz4, zstd, zstd:LEVEL, planes (float exponent/mantissa planes), auto.
    #[arg(long, default_value_t = Encoding::default().compression)]
    compress: CompressionMode,
    /// Byte-shuffle multi-byte elements before compressing.
    #[arg(long)]
    shuffle: bool,
    /// Chunk size in bytes.
    #[arg(long, default_value_t = tensorwire::DEFAULT_CHUNK_SIZE)]
    chunk_size: usize,
    /// Link bandwidth for auto compression, in MB/s (default: measured).
    #[arg(long)]
    link_mbps: Option<f64>,
}

#[derive(ClapArgs, Debug)]
struct SendArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(flatten)]
    enc: EncodingArgs,
    /// A torch.save (.pt) or .safetensors file to send.
    #[arg(long, conflicts_with = "random")]
    file: Option<PathBuf>,
    /// Send a random tensor of this shape (e.g. 64,1024).
    #[arg(long)]
    random: Option<String>,
    /// dtype of the random tensor (torch names; short forms like f32 work).
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Name to store the tensor under; with a state dict file, the state
    /// dict's name (its tensors are stored as NAME.<key>).
    #[arg(long)]
    name: Option<String>,
    /// Send the tensor(s) this many times.
    #[arg(long, default_value_t = 1)]
    count: u64,
    /// Send each tensor as a delta (XOR, then compressed) against the tensor
    /// of the same name in BASE_FILE, which must be what the server stores
    /// under that name (checked by content hash; else an error naming it).
    #[arg(long, value_name = "BASE_FILE", requires = "file")]
    delta: Option<PathBuf>,
}

#[derive(ClapArgs, Debug)]
struct FetchArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(flatten)]
    enc: EncodingArgs,
    /// Name of the tensor, or of a state dict.
    #[arg(long)]
    name: String,
    /// Write it to this file (.pt: torch.save format; .safetensors). A state
    /// dict is written while it arrives.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(ClapArgs, Debug)]
struct CallArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(flatten)]
    enc: EncodingArgs,
    /// Function name.
    function: String,
    /// Input tensor (repeatable): a .pt/.safetensors file, or random:SHAPE[:DTYPE].
    #[arg(long = "input")]
    inputs: Vec<String>,
    /// Scalar argument KEY=VALUE (repeatable).
    #[arg(long = "arg")]
    args: Vec<String>,
    /// Timeout in milliseconds (the server stops the work too).
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Write output tensors to this .pt file (a list when several).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Rust's allocations go to mimalloc (above); glibc's malloc still
    // serves the C libraries (UCX, zstd): tuned as the library suggests.
    tensorwire::tune_allocator();
    let default_level = if matches!(cli.command, Command::Bench(_)) { "warn" } else { "info" };
    init_logging(cli.log_level.as_deref().unwrap_or(default_level));
    if let Command::Bench(a) = cli.command {
        // The bench runs its own runtimes (server and client apart, as two processes).
        return match bench::run(a) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logging(level: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_new(level).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn run(cmd: Command) -> Result<std::process::ExitCode, BoxError> {
    use std::process::ExitCode;
    match cmd {
        Command::Serve(a) => serve(a).await.map(|_| ExitCode::SUCCESS),
        Command::Send(a) => send(a).await.map(|_| ExitCode::SUCCESS),
        Command::Fetch(a) => fetch(a).await.map(|_| ExitCode::SUCCESS),
        Command::Ls(a) => store::ls(a).await.map(|_| ExitCode::SUCCESS),
        Command::Rm(a) => store::rm(a).await.map(|_| ExitCode::SUCCESS),
        Command::Call(a) => call(a).await.map(|_| ExitCode::SUCCESS),
        Command::Info(a) => info(a).await.map(|_| ExitCode::SUCCESS),
        Command::Health(a) => {
            let serving = match client(&a, None, None).await {
                Ok(c) => c.health().await.unwrap_or(false),
                Err(e) => {
                    eprintln!("not serving: {e}");
                    false
                }
            };
            if a.json {
                println!("{}", serde_json::json!({ "serving": serving }));
            } else {
                println!("{}", if serving { "SERVING" } else { "NOT_SERVING" });
            }
            Ok(if serving { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Command::Bench(_) => unreachable!("handled in main"),
    }
}

fn transport_config(a: &ConnArgs) -> TransportConfig {
    let mut t = TransportConfig::default();
    t.tls.ca_path = a.ca.clone();
    t.tls.pin_sha256 = a.pin_sha256.clone();
    t.tls.insecure_skip_verify_dangerous = a.insecure_dev;
    t.tls.server_name = a.server_name.clone();
    t.tls.client_cert_path = a.client_cert.clone();
    t.tls.client_key_path = a.client_key.clone();
    if a.insecure_dev {
        eprintln!("warning: --insecure-dev: the server's certificate is NOT verified; anyone can impersonate it");
    }
    t
}

fn encoding(e: &EncodingArgs) -> Encoding {
    Encoding {
        codec: e.codec,
        compression: e.compress,
        shuffle: e.shuffle,
        chunk_size: e.chunk_size,
        link_bandwidth: e.link_mbps.map(|m| m * 1e6),
        ..Encoding::default()
    }
}

/// Why a token on `url` would travel in cleartext over a network (None:
/// the transport encrypts, or the address stays on this host).
fn plaintext_beyond_loopback(url: &str) -> Option<&'static str> {
    let ep = tensorwire::Endpoint::parse(url).ok()?;
    // Every scheme that crosses a network unencrypted (ucx://'s control
    // connection is plain TCP; http:// carries the bearer token).
    if !matches!(
        ep.scheme(),
        tensorwire::Scheme::Tcp | tensorwire::Scheme::Grpc | tensorwire::Scheme::Ucx | tensorwire::Scheme::Http
    ) {
        return None;
    }
    let host = ep.host().trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    (!loopback).then_some("the token and the tensors travel in cleartext")
}

async fn client(
    a: &ConnArgs,
    enc: Option<&EncodingArgs>,
    progress: Option<Arc<AtomicU64>>,
) -> Result<Client, BoxError> {
    if a.auth_token.is_some()
        && let Some(why) = plaintext_beyond_loopback(&a.to)
    {
        eprintln!("warning: auth token to {}: {why}", a.to);
    }
    let cfg = ClientConfig {
        transport: transport_config(a),
        encoding: match enc {
            Some(e) => encoding(e),
            None => Encoding::default(),
        },
        auth_token: a.auth_token.clone(),
        progress,
        ..ClientConfig::default()
    };
    Ok(Client::connect_with(&a.to, cfg).await?)
}

async fn serve(a: ServeArgs) -> Result<(), BoxError> {
    let mut transport = TransportConfig::default();
    transport.tls.cert_path = a.cert.clone();
    transport.tls.key_path = a.key.clone();
    if let Some(ca) = &a.client_ca {
        transport.tls.ca_path = Some(ca.clone());
        transport.tls.require_client_cert = true;
    }
    let defaults = ServerConfig::default();
    let config = ServerConfig {
        transport,
        encoding: Encoding { chunk_size: a.chunk_size, ..Encoding::default() },
        limits: tensorwire::Limits { max_tensor_bytes: a.max_tensor_bytes, ..Default::default() },
        service_name: a.service_name.clone(),
        auth_token: a.auth_token.clone(),
        max_memory_bytes: a.max_memory_bytes.unwrap_or(defaults.max_memory_bytes),
        recv_pool_bytes: a.recv_pool_bytes,
        max_connections: a.max_connections.unwrap_or(defaults.max_connections),
        max_connections_per_peer: a.max_connections.unwrap_or(defaults.max_connections_per_peer),
        max_auth_failures: a.max_auth_failures,
        max_http_body_bytes: a.max_http_body_bytes,
        max_http_response_bytes: a.max_http_response_bytes,
        ..defaults
    };
    if config.auth_token.is_some() {
        for url in &a.listen {
            if let Some(why) = plaintext_beyond_loopback(url) {
                eprintln!("warning: --auth-token on {url}: {why}; use tcps://, quic:// or grpcs:// beyond this host");
            }
        }
    }
    let store = StoreService::with_policy(a.max_store_bytes, a.store_evict);
    let mut b = Server::builder().config(config).service(store);
    for f in builtin_functions() {
        b = b.function(f);
    }
    let server = b.build().start(&a.listen).await?;
    for e in server.endpoints() {
        println!("listening on {e}");
    }
    #[cfg(feature = "metrics")]
    let _metrics = match &a.metrics_listen {
        Some(addr) => Some(server.serve_metrics(addr).await?),
        None => None,
    };
    #[cfg(not(feature = "metrics"))]
    if a.metrics_listen.is_some() {
        return Err("this build has no metrics support (cargo feature \"metrics\")".into());
    }
    wait_for_signal().await;
    eprintln!("shutting down: finishing calls in flight");
    server.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
    }
}

/// A progress bar on stderr while bytes move (only on a terminal). It moves
/// with the client's payload counter, which advances chunk by chunk as the
/// transport takes each one (within one credit window of what the peer has
/// read) and as each arrives.
struct Progress {
    counter: Arc<AtomicU64>,
    done: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Progress {
    /// A bar for `total` bytes (None: unknown, a byte count and rate only),
    /// when stderr is a terminal and the transfer is large enough to watch.
    fn start(total: Option<u64>) -> Option<Self> {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() || total.is_some_and(|t| t < (64 << 20)) {
            return None;
        }
        let counter = Arc::new(AtomicU64::new(0));
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, d) = (counter.clone(), done.clone());
        let task = tokio::spawn(async move {
            let (bar, template) = match total {
                Some(t) => {
                    (indicatif::ProgressBar::new(t), "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
                }
                None => (indicatif::ProgressBar::no_length(), "{spinner} {bytes} {binary_bytes_per_sec}"),
            };
            bar.set_style(
                indicatif::ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            loop {
                let n = c.load(Ordering::Relaxed);
                bar.set_position(total.map_or(n, |t| n.min(t)));
                if d.load(Ordering::Acquire) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            bar.finish_and_clear();
        });
        Some(Self { counter, done, task })
    }

    fn counter(p: &Option<Self>) -> Option<Arc<AtomicU64>> {
        p.as_ref().map(|p| p.counter.clone())
    }

    /// Clears the bar before the result is printed.
    async fn finish(p: Option<Self>) {
        if let Some(p) = p {
            p.done.store(true, Ordering::Release);
            let _ = p.task.await;
        }
    }
}

fn report(json: bool, what: &str, bytes: u64, secs: f64, crc: u32, extra: serde_json::Value) {
    let gib = bytes as f64 / (1u64 << 30) as f64 / secs.max(1e-9);
    if json {
        let mut v =
            serde_json::json!({ "bytes": bytes, "seconds": secs, "gib_per_s": gib, "crc32c": format!("{crc:08x}") });
        if let (Some(o), serde_json::Value::Object(x)) = (v.as_object_mut(), extra) {
            o.extend(x);
        }
        println!("{v}");
    } else {
        println!("{what} {bytes} bytes in {secs:.3} s ({gib:.2} GiB/s), crc32c {crc:08x}");
    }
}

async fn send(a: SendArgs) -> Result<(), BoxError> {
    let tensors: Vec<Tensor> = match (&a.file, &a.random) {
        (Some(f), _) => {
            let (items, bare) = files::load_file(f)?;
            if let (Some(name), false) = (&a.name, bare) {
                if a.delta.is_some() {
                    return Err("--delta sends tensors, not whole state dicts (leave out --name)".into());
                }
                return store::send_state_dict(&a, name, items).await;
            }
            files::name_tensors(f, items, a.name.as_deref())?
        }
        (None, Some(shape)) => {
            let dtype: DType = a.dtype.parse()?;
            let t = random_tensor(dtype, &parse_shape(shape)?, 0)?;
            vec![t.with_name(a.name.clone().unwrap_or_else(|| "random".into()))]
        }
        (None, None) => return Err("give --file F or --random SHAPE".into()),
    };
    let per_round: u64 = tensors.iter().map(|t| t.nbytes() as u64).sum();
    let total = per_round * a.count;
    let bar = Progress::start(Some(total));
    let c = client(&a.conn, Some(&a.enc), Progress::counter(&bar)).await?;
    let mut crc = 0;
    for t in &tensors {
        crc = t.crc32c()?;
    }
    let start = Instant::now();
    let mut summary = None;
    let bases = match &a.delta {
        Some(path) => {
            let (items, _) = files::load_file(path)?;
            Some(files::name_tensors(path, items, a.name.as_deref())?)
        }
        None => None,
    };
    for _ in 0..a.count {
        summary = Some(match &bases {
            None => c.send(tensors.clone()).await?,
            Some(bases) => {
                let mut last = None;
                for t in &tensors {
                    let base = bases.iter().find(|b| b.name() == t.name()).ok_or_else(|| {
                        format!("no tensor named {:?} in the --delta base file", t.name().unwrap_or(""))
                    })?;
                    last = Some(c.send_delta(t, base).await?);
                }
                last.unwrap_or_default()
            }
        });
    }
    let secs = start.elapsed().as_secs_f64();
    Progress::finish(bar).await;
    let names: Vec<&str> = tensors.iter().filter_map(Tensor::name).collect();
    let message = summary.map(|s| s.message).unwrap_or_default();
    report(
        a.conn.json,
        "sent",
        total,
        secs,
        crc,
        serde_json::json!({ "tensors": tensors.len() as u64 * a.count, "names": names, "server": message }),
    );
    Ok(())
}

async fn fetch(a: FetchArgs) -> Result<(), BoxError> {
    let bar = Progress::start(None);
    let c = client(&a.conn, Some(&a.enc), Progress::counter(&bar)).await?;
    // A name that is no tensor's may be a state dict's (servers without a
    // store to list answer the fetch itself).
    if let Ok(entries) = c.stat(&a.name).await
        && !(entries.len() == 1 && entries[0].name == a.name)
    {
        let r = store::fetch_state_dict(&a, &c, entries).await;
        Progress::finish(bar).await;
        return r;
    }
    let start = Instant::now();
    let t = c.fetch_one(&a.name).await;
    Progress::finish(bar).await;
    let t = t?;
    let secs = start.elapsed().as_secs_f64();
    if let Some(out) = &a.out {
        files::write_tensors(out, &[(a.name.clone(), t.clone())])?;
    }
    report(
        a.conn.json,
        "fetched",
        t.nbytes() as u64,
        secs,
        t.crc32c()?,
        serde_json::json!({ "name": a.name, "dtype": t.dtype().name(), "shape": t.shape() }),
    );
    Ok(())
}

async fn call(a: CallArgs) -> Result<(), BoxError> {
    let c = client(&a.conn, Some(&a.enc), None).await?;
    let mut inputs = Vec::new();
    for spec in &a.inputs {
        inputs.extend(files::input_tensor(spec)?);
    }
    let args = Args::from_cli(a.args.iter().map(String::as_str))?;
    let opts = tensorwire::CallOptions { timeout: a.timeout_ms.map(Duration::from_millis), ..Default::default() };
    let start = Instant::now();
    let out = c.call_with(&a.function, inputs, args, &opts).await?;
    let secs = start.elapsed().as_secs_f64();
    if let Some(path) = &a.out {
        let named: Vec<(String, Tensor)> =
            out.tensors.iter().enumerate().map(|(i, t)| (i.to_string(), t.clone())).collect();
        files::write_tensors(path, &named)?;
    }
    if a.conn.json {
        let ts: Vec<_> = out
            .tensors
            .iter()
            .map(|t| serde_json::json!({ "dtype": t.dtype().name(), "shape": t.shape(), "crc32c": format!("{:08x}", t.crc32c().unwrap_or(0)) }))
            .collect();
        println!("{}", serde_json::json!({ "seconds": secs, "tensors": ts, "values": out.values.to_string() }));
    } else {
        for (i, t) in out.tensors.iter().enumerate() {
            println!("output {i}: {} {:?} crc32c {:08x}{}", t.dtype(), t.shape(), t.crc32c()?, files::preview(t));
        }
        if out.values != tensorwire::Value::None {
            println!("values: {}", out.values);
        }
        println!("({secs:.3} s)");
    }
    Ok(())
}

async fn info(a: ConnArgs) -> Result<(), BoxError> {
    let c = client(&a, None, None).await?;
    let i = c.service_info().await?;
    let functions = c.list_functions().await?;
    if a.json {
        let fs: Vec<_> = functions
            .iter()
            .map(|f| serde_json::json!({ "name": f.name, "doc": f.doc, "batch": f.batch.map(|b| b.0) }))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "service_name": i.service_name, "version": i.version, "transports": i.transports, "codecs": i.codecs,
                "compressions": i.compressions, "devices": i.devices, "uptime_s": i.uptime.as_secs_f64(),
                "calls": i.calls, "failures": i.failures, "bytes_received": i.bytes_received, "bytes_sent": i.bytes_sent,
                "active_calls": i.active_calls, "functions": fs, "stored_tensors": i.store.tensors,
                "stored_bytes": i.store.bytes, "store_max_bytes": i.store.max_bytes,
            })
        );
    } else {
        println!("{} (tensorwire {}), up {:.0} s", i.service_name, i.version, i.uptime.as_secs_f64());
        println!("transports: {}", i.transports.join(", "));
        println!(
            "codecs: {}; compressions: {}; devices: {}",
            i.codecs.join(", "),
            i.compressions.join(", "),
            i.devices.join(", ")
        );
        println!(
            "calls: {} ({} failed, {} active); bytes in {} out {}",
            i.calls, i.failures, i.active_calls, i.bytes_received, i.bytes_sent
        );
        if i.store.max_bytes > 0 {
            println!("store: {} tensors, {} of {} bytes", i.store.tensors, i.store.bytes, i.store.max_bytes);
        }
        for f in functions {
            let stats = i.functions.iter().find(|s| s.name == f.name);
            println!(
                "  {}{}: {}{}",
                f.name,
                f.batch.map(|(b, w)| format!(" [batched ≤{b}, ≤{w:?}]")).unwrap_or_default(),
                f.doc,
                stats.map(|s| format!(" — {} calls, {} failed", s.calls, s.failures)).unwrap_or_default()
            );
        }
    }
    Ok(())
}
