//! Measurement helpers shared by `tensorwire bench` and the criterion
//! benches: raw-socket baselines and tensorwire runs in the same process, so
//! every figure comes with its ratio to the baseline measured alongside.
//!
//! The raw baselines are the ceilings a transport is measured against: one
//! thread writes a buffer into a plain socket in 1 MiB writes, another reads
//! it into a reused, already-faulted (warm) buffer, as a receiver with a
//! recycled buffer pool does ([`Receive::Warm`]); or ping-pongs a small
//! message for latency. The same copy into a freshly allocated buffer per
//! tensor ([`Receive::Fresh`]) is mostly page faults on these VMs (~1 GiB/s)
//! and is only ever shown as a labelled extra column, never as the
//! denominator of a ratio.
//!
//! The tensorwire side runs like a deployment: the server on its own thread
//! and runtime ([`ServerThread`]), the client on another, as two processes
//! (or the raw baseline's two threads) would.
//!
//! Part of the CLI (`src/bin/tensorwire/`), not of the library: the
//! criterion benches include this folder by path. Each uses part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorwire_codecs::{DType, Tensor};
use tensorwire_transports::copy::{STREAMED_DESTINATIONS_FROM, copy_streaming};

use tensorwire::builtins::random_tensor;
use tensorwire::{Client, Histogram};

/// Largest warm-up transfer before a throughput measurement.
const WARM_UP_BYTES: usize = 64 << 20;

/// Which raw socket a baseline uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawSocket {
    /// TCP over 127.0.0.1 with TCP_NODELAY.
    Tcp,
    /// A Unix stream socket.
    Unix,
    /// One raw quinn stream per copy on one QUIC connection, with the same
    /// TLS (a self-signed certificate, pinned), windows, congestion
    /// controller and socket buffers as tensorwire's QUIC transport
    /// (default [`TransportConfig`](tensorwire::TransportConfig)).
    #[cfg(feature = "quic")]
    Quic,
    /// No socket: a copy of the bytes between two buffers in the same
    /// process (the ceiling for same-host transports such as shm): the
    /// faster of `memcpy` and the non-temporal copy the shm transport
    /// fills large segments with.
    Memcpy,
}

/// Where a raw baseline's receiver puts the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Receive {
    /// One buffer, allocated and written once before timing, reused for
    /// every copy: no page faults (the ceiling).
    Warm,
    /// A new buffer per copy, as a receiver without a pool: mostly page
    /// faults here. For a labelled extra column only.
    Fresh,
}

/// A receive buffer on fresh pages: a new anonymous mapping, unmapped when
/// dropped, so writing it faults every page in as a receiver that
/// allocates per tensor would (an allocator recycles freed memory instead:
/// the CLI's mimalloc does, which is why this is not a `Vec`).
pub struct FreshPages {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone.
unsafe impl Send for FreshPages {}

impl FreshPages {
    /// Maps `len` bytes of new, never-touched memory.
    pub fn new(len: usize) -> std::io::Result<Self> {
        if len == 0 {
            return Ok(Self { ptr: std::ptr::NonNull::dangling().as_ptr(), len: 0 });
        }
        // SAFETY: a new private anonymous mapping; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { ptr: p.cast(), len })
    }
}

impl std::ops::Deref for FreshPages {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr/len is our mapping (or an empty slice).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for FreshPages {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len is our mapping (or an empty slice), borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for FreshPages {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmaps the mapping made in new(), once.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

/// The shared-memory ceiling: mean time per copy of `bytes` between two
/// warm buffers, the faster of `memcpy` and (from
/// [`STREAMED_DESTINATIONS_FROM`] bytes up, where the shm transport uses
/// it) the non-temporal copy that fills its segments, each timed in a
/// loop of its own after an untimed copy (so that neither finds the
/// destination where the other left it).
fn memcpy_ceiling(bytes: usize, reps: usize) -> Duration {
    let src = warm_buffer(bytes);
    let mut dst = warm_buffer(bytes);
    let mut time = |copy: &dyn Fn(&mut [u8], &[u8])| {
        copy(&mut dst, &src);
        let t = Instant::now();
        for _ in 0..reps {
            copy(&mut dst, &src);
            std::hint::black_box(&mut dst);
        }
        t.elapsed() / reps.max(1) as u32
    };
    let plain = time(&|d, s| d.copy_from_slice(s));
    if bytes < STREAMED_DESTINATIONS_FROM {
        return plain;
    }
    plain.min(time(&|d, s| copy_streaming(d, s)))
}

/// A buffer of `n` bytes whose pages are all faulted in (written once).
pub(crate) fn warm_buffer(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // `vec![0; n]` maps zero pages lazily: touch one byte per page.
    for i in (0..n).step_by(4096) {
        v[i] = 1;
    }
    std::hint::black_box(&mut v);
    v
}

trait Duplex: Read + Write + Send + 'static {
    fn nonblocking(&self) -> std::io::Result<()>;
}
impl Duplex for TcpStream {
    fn nonblocking(&self) -> std::io::Result<()> {
        self.set_nonblocking(true)
    }
}
impl Duplex for UnixStream {
    fn nonblocking(&self) -> std::io::Result<()> {
        self.set_nonblocking(true)
    }
}

/// A socket made non-blocking and polled busily: each read or write is
/// retried at once while it would block, so the thread never sleeps.
struct BusyPoll(Box<dyn Duplex>);

impl BusyPoll {
    fn new(s: Box<dyn Duplex>) -> std::io::Result<Self> {
        s.nonblocking()?;
        Ok(Self(s))
    }

    fn retry<T>(mut op: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
        loop {
            match op() {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                r => return r,
            }
        }
    }
}

impl Read for BusyPoll {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        Self::retry(|| self.0.read(buf))
    }
}

impl Write for BusyPoll {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Self::retry(|| self.0.write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Self::retry(|| self.0.flush())
    }
}

impl Duplex for BusyPoll {
    fn nonblocking(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Removes a socket file when dropped.
struct SocketFile(std::path::PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(feature = "quic")]
pub(crate) mod raw_quic;
mod ring_exchange;
#[cfg(feature = "grpc")]
pub mod tonic_peer;
mod ucx_perftest;

// The criterion benches include this folder without using it.
#[allow(unused_imports)]
pub use ring_exchange::ring_exchanges_per_second;
#[allow(unused_imports)]
pub use ucx_perftest::{ucx_perftest, ucx_perftest_on};

/// Two connected ends of a raw socket, and the socket file to remove after.
type RawPair = (Box<dyn Duplex>, Box<dyn Duplex>, Option<SocketFile>);

fn pair(kind: RawSocket) -> std::io::Result<RawPair> {
    match kind {
        RawSocket::Tcp => {
            let l = TcpListener::bind("127.0.0.1:0")?;
            let a = TcpStream::connect(l.local_addr()?)?;
            let (b, _) = l.accept()?;
            a.set_nodelay(true)?;
            b.set_nodelay(true)?;
            Ok((Box::new(a), Box::new(b), None))
        }
        RawSocket::Unix => {
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "tensorwire-raw-{}-{}.sock",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let guard = SocketFile(p.clone());
            let l = UnixListener::bind(&p)?;
            let a = UnixStream::connect(&p)?;
            let (b, _) = l.accept()?;
            Ok((Box::new(a), Box::new(b), Some(guard)))
        }
        #[cfg(feature = "quic")]
        RawSocket::Quic => Err(std::io::Error::other("QUIC has no socket pair")),
        RawSocket::Memcpy => Err(std::io::Error::other("memcpy has no socket pair")),
    }
}

/// Copies `bytes` through a raw socket `reps` times into a warm, reused
/// receive buffer (the ceiling); returns the mean time per copy (connection
/// setup excluded).
pub fn raw_copy(kind: RawSocket, bytes: usize, reps: usize) -> std::io::Result<Duration> {
    raw_copy_into(kind, bytes, reps, Receive::Warm)
}

/// [`raw_copy`] with the receive buffer chosen by `recv`.
pub fn raw_copy_into(kind: RawSocket, bytes: usize, reps: usize, recv: Receive) -> std::io::Result<Duration> {
    #[cfg(feature = "quic")]
    if kind == RawSocket::Quic {
        return raw_quic::copy(&tensorwire::TransportConfig::default(), bytes, reps, recv);
    }
    if kind == RawSocket::Memcpy {
        return Ok(match recv {
            Receive::Warm => memcpy_ceiling(bytes, reps),
            Receive::Fresh => {
                let src = warm_buffer(bytes);
                let mut total = Duration::ZERO;
                for _ in 0..reps {
                    let t = Instant::now();
                    let mut dst = FreshPages::new(bytes)?;
                    dst.copy_from_slice(&src);
                    std::hint::black_box(&dst[..]);
                    total += t.elapsed();
                }
                total / reps.max(1) as u32
            }
        });
    }
    let (mut tx, mut rx, _dir) = pair(kind)?;
    // The sender writes from a warm buffer of the tensor's size, as a
    // transport sending a tensor reads the tensor: the same 1 MiB written
    // again and again stays in the cache, which a 256 MiB tensor does not
    // (over TCP that ceiling read ~20% higher, 4 paired runs on 2026-11-26).
    let src = warm_buffer(bytes);
    let reader = std::thread::spawn(move || -> std::io::Result<Duration> {
        let mut total = Duration::ZERO;
        let mut ack = [0u8; 1];
        let mut warm = if recv == Receive::Warm { warm_buffer(bytes) } else { Vec::new() };
        for _ in 0..reps {
            let mut fresh = FreshPages::new(if recv == Receive::Fresh { bytes } else { 0 })?;
            let dst: &mut [u8] = if recv == Receive::Warm { &mut warm } else { &mut fresh };
            let mut got = 0;
            let t = Instant::now();
            while got < bytes {
                let n = rx.read(&mut dst[got..])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                got += n;
            }
            total += t.elapsed();
            std::hint::black_box(&dst);
            ack[0] = 1;
            rx.write_all(&ack)?;
        }
        Ok(total / reps.max(1) as u32)
    });
    let mut ack = [0u8; 1];
    for _ in 0..reps {
        for piece in src.chunks(1 << 20) {
            tx.write_all(piece)?;
        }
        tx.read_exact(&mut ack)?;
    }
    reader.join().map_err(|_| std::io::Error::other("reader thread panicked"))?
}

/// Round trips of a `size`-byte message through a raw socket (echoed by a
/// second thread); returns the latency histogram. Each side sleeps in a
/// blocking read until the other's message arrives, or with `spin`
/// busy-polls a non-blocking socket instead (no thread ever sleeps: the
/// floor for a transport that spins, at the cost of two busy cores).
pub fn raw_round_trips(kind: RawSocket, size: usize, reps: usize, spin: bool) -> std::io::Result<Histogram> {
    #[cfg(feature = "quic")]
    if kind == RawSocket::Quic {
        return raw_quic::round_trips(&tensorwire::TransportConfig::default(), size, reps);
    }
    let (a, b, _dir) = pair(kind)?;
    let (mut a, mut b): (Box<dyn Duplex>, Box<dyn Duplex>) =
        if spin { (Box::new(BusyPoll::new(a)?), Box::new(BusyPoll::new(b)?)) } else { (a, b) };
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buf = vec![0u8; size];
        for _ in 0..reps {
            b.read_exact(&mut buf)?;
            b.write_all(&buf)?;
        }
        Ok(())
    });
    let msg = vec![1u8; size];
    let mut back = vec![0u8; size];
    let mut h = Histogram::default();
    for _ in 0..reps {
        let t = Instant::now();
        a.write_all(&msg)?;
        a.read_exact(&mut back)?;
        h.record(t.elapsed());
    }
    echo.join().map_err(|_| std::io::Error::other("echo thread panicked"))??;
    Ok(h)
}

/// Round trips between two threads of this process handing a counter back
/// and forth, no transport at all: with `spin` each side busy-waits on the
/// shared word; otherwise each sleeps (a futex, as a socket read or an idle
/// async runtime does) until the other wakes it. The floor under every
/// round trip that sleeps while it waits: on a VM a wake-up can cost tens
/// of microseconds, spinning a fraction of one. Returns the histogram
/// (whole microseconds) and the mean round trip (exact: what a spinning
/// round trip is read from).
pub fn wake_round_trips(spin: bool, reps: usize) -> std::io::Result<(Histogram, Duration)> {
    use std::sync::atomic::Ordering::{Acquire, Release};
    let turn = Arc::new(AtomicU64::new(0));
    let main = std::thread::current();
    let t2 = turn.clone();
    let echo = std::thread::spawn(move || {
        for i in 0..reps as u64 {
            while t2.load(Acquire) != 2 * i + 1 {
                if spin { std::hint::spin_loop() } else { std::thread::park() }
            }
            t2.store(2 * i + 2, Release);
            if !spin {
                main.unpark();
            }
        }
    });
    let peer = echo.thread().clone();
    let mut h = Histogram::default();
    let all = Instant::now();
    for i in 0..reps as u64 {
        let t = Instant::now();
        turn.store(2 * i + 1, Release);
        if !spin {
            peer.unpark();
        }
        while turn.load(Acquire) != 2 * i + 2 {
            if spin { std::hint::spin_loop() } else { std::thread::park() }
        }
        h.record(t.elapsed());
    }
    let mean = all.elapsed() / reps.max(1) as u32;
    echo.join().map_err(|_| std::io::Error::other("echo thread panicked"))?;
    Ok((h, mean))
}

/// Mean time to `send` one tensor of `bytes` to the server behind `client`.
pub async fn send_time(client: &Client, bytes: usize, reps: usize) -> Result<Duration, tensorwire::CallError> {
    let t = random_tensor(DType::UInt8, &[bytes], 1).map_err(tensorwire::CallError::Remote)?;
    // Warm up (connection, congestion window, allocator).
    let warm = random_tensor(DType::UInt8, &[bytes.min(WARM_UP_BYTES)], 1).map_err(tensorwire::CallError::Remote)?;
    client.send(vec![warm]).await?;
    let start = Instant::now();
    for _ in 0..reps {
        client.send(vec![t.clone()]).await?;
    }
    Ok(start.elapsed() / reps.max(1) as u32)
}

/// Mean time to `fetch` one tensor of `bytes` from a server running
/// [`BenchService`] (server → client: the other direction of [`send_time`]).
pub async fn fetch_time(client: &Client, bytes: usize, reps: usize) -> Result<Duration, tensorwire::CallError> {
    let req = |n: usize| tensorwire::FetchRequest::default().param("bytes", n.to_string());
    client.fetch(req(bytes.min(WARM_UP_BYTES))).await?;
    let start = Instant::now();
    for _ in 0..reps {
        let t = client.fetch(req(bytes)).await?;
        debug_assert_eq!(t[0].nbytes(), bytes);
    }
    Ok(start.elapsed() / reps.max(1) as u32)
}

/// The benchmark server's service: `send` counts what arrives and keeps
/// nothing; `fetch` with `bytes=N` returns a tensor of N bytes (made once
/// per size and kept, so serving costs only the transfer).
#[derive(Debug, Default)]
pub struct BenchService {
    cache: std::sync::Mutex<std::collections::HashMap<usize, Tensor>>,
}

#[async_trait::async_trait]
impl tensorwire::TensorService for BenchService {
    async fn fetch(
        &self,
        _ctx: &tensorwire::CallContext,
        req: &tensorwire::FetchRequest,
        out: &mut tensorwire::TensorSink<'_>,
    ) -> Result<(), tensorwire::Status> {
        let n: usize = req
            .get("bytes")
            .and_then(|b| b.parse().ok())
            .ok_or_else(|| tensorwire::Status::invalid_argument("the bench service serves fetch(bytes=N)"))?;
        if n > 4 << 30 {
            return Err(tensorwire::Status::invalid_argument("the bench service serves at most 4 GiB"));
        }
        let t = {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            match cache.get(&n) {
                Some(t) => t.clone(),
                None => {
                    let t = random_tensor(DType::UInt8, &[n], 2)?;
                    cache.insert(n, t.clone());
                    t
                }
            }
        };
        out.send(t).await
    }
}

/// The receive pool size of the bench's server and clients: the library
/// default, or `TENSORWIRE_BENCH_RECV_POOL_BYTES` (0 turns the pool off, to
/// compare with a receiver that allocates a buffer per tensor).
pub fn bench_recv_pool_bytes() -> u64 {
    std::env::var("TENSORWIRE_BENCH_RECV_POOL_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(tensorwire::DEFAULT_RECV_POOL_BYTES)
}

/// A client configuration for benchmarks (the bench's receive pool size).
pub fn bench_client_config() -> tensorwire::ClientConfig {
    tensorwire::ClientConfig { recv_pool_bytes: bench_recv_pool_bytes(), ..Default::default() }
}

/// A server builder for benchmarks: [`BenchService`] and the built-in functions.
pub fn bench_server() -> tensorwire::ServerBuilder {
    bench_server_with(|_| {})
}

/// [`bench_server`] with its transport settings changed by `tune` (the
/// bench's `--spin-us`).
pub fn bench_server_with(tune: impl FnOnce(&mut tensorwire::TransportConfig)) -> tensorwire::ServerBuilder {
    let mut cfg = tensorwire::ServerConfig { recv_pool_bytes: bench_recv_pool_bytes(), ..Default::default() };
    tune(&mut cfg.transport);
    let mut b = tensorwire::Server::builder().config(cfg).service(BenchService::default());
    for f in tensorwire::builtins::builtin_functions() {
        b = b.function(f);
    }
    b
}

/// Round trips of `identity` on a `size`-byte tensor, one at a time.
pub async fn call_round_trips(client: &Client, size: usize, reps: usize) -> Result<Histogram, tensorwire::CallError> {
    let t = Tensor::zeros(DType::UInt8, [size]).map_err(|e| tensorwire::CallError::InvalidArgument(e.to_string()))?;
    for _ in 0..100.min(reps) {
        client.compute("identity", vec![t.clone()]).await?;
    }
    let mut h = Histogram::default();
    for _ in 0..reps {
        let s = Instant::now();
        client.compute("identity", vec![t.clone()]).await?;
        h.record(s.elapsed());
    }
    Ok(h)
}

/// Calls per second of `identity` on `size`-byte tensors with `in_flight`
/// calls outstanding on one connection, for `total` calls.
pub async fn calls_per_second(
    client: &Client,
    size: usize,
    in_flight: usize,
    total: usize,
) -> Result<f64, tensorwire::CallError> {
    let t = Tensor::zeros(DType::UInt8, [size]).map_err(|e| tensorwire::CallError::InvalidArgument(e.to_string()))?;
    function_calls_per_second(client, "identity", t, in_flight, total).await
}

/// Calls per second of `function` on `input` with `in_flight` calls
/// outstanding on one connection, for `total` calls.
pub async fn function_calls_per_second(
    client: &Client,
    function: &str,
    input: Tensor,
    in_flight: usize,
    total: usize,
) -> Result<f64, tensorwire::CallError> {
    let t = input;
    let function: Arc<str> = Arc::from(function);
    let left = Arc::new(AtomicU64::new(total as u64));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(in_flight);
    for _ in 0..in_flight {
        let (c, t, left, f) = (client.clone(), t.clone(), left.clone(), function.clone());
        tasks.push(tokio::spawn(async move {
            while left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
                c.compute(&f, vec![t.clone()]).await?;
            }
            Ok::<_, tensorwire::CallError>(())
        }));
    }
    for task in tasks {
        task.await.map_err(|e| tensorwire::CallError::InvalidArgument(format!("bench task failed: {e}")))??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// A thread running a server on a runtime of its own until dropped: the
/// server reports that it started (with e.g. its URL) on `ready`, then
/// runs until `stop` resolves; dropping this stops it and joins the thread.
pub struct Background {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    join: Option<std::thread::JoinHandle<()>>,
}

impl Background {
    /// Runs `serve(ready, stop)` on a thread named `name` with `workers`
    /// runtime threads; returns once it reported ready (or failed).
    pub fn start<T, Fut>(
        name: &str,
        workers: usize,
        serve: impl FnOnce(std::sync::mpsc::Sender<Result<T, String>>, tokio::sync::oneshot::Receiver<()>) -> Fut
        + Send
        + 'static,
    ) -> Result<(Background, T), String>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = ()>,
    {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread_name = name.to_string();
        let join = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                match tokio::runtime::Builder::new_multi_thread().worker_threads(workers.max(1)).enable_all().build() {
                    Ok(rt) => rt.block_on(serve(ready_tx, stop_rx)),
                    Err(e) => drop(ready_tx.send(Err(format!("{thread_name}: no runtime: {e}")))),
                }
            })
            .map_err(|e| format!("{name}: no thread: {e}"))?;
        let bg = Background { stop: Some(stop_tx), join: Some(join) };
        let ready = ready_rx.recv().map_err(|_| format!("{name} ended before it started"))??;
        Ok((bg, ready))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// A tensorwire server running on its own thread and runtime, stopped when
/// dropped.
pub struct ServerThread {
    url: String,
    _thread: Background,
}

impl ServerThread {
    /// Builds a server with `build` (on the server's runtime) and starts it
    /// on `url`, with `workers` runtime threads.
    pub fn start(
        url: &str,
        workers: usize,
        build: impl FnOnce() -> tensorwire::ServerBuilder + Send + 'static,
    ) -> Result<ServerThread, String> {
        let url = url.to_string();
        let (thread, url) = Background::start("tensorwire-bench-server", workers, move |ready, stop| async move {
            match build().build().start([url.as_str()]).await {
                Ok(server) => {
                    let _ = ready.send(Ok(server.url()));
                    let _ = stop.await;
                    server.shutdown().await;
                }
                Err(e) => drop(ready.send(Err(format!("{url}: {e}")))),
            }
        })?;
        Ok(ServerThread { url, _thread: thread })
    }

    /// The URL clients connect to.
    pub fn url(&self) -> &str {
        &self.url
    }
}

/// Functions for the batching benchmark: `double` (×2, one example per
/// call) and `double_batched` (the same, batched up to `max_batch`); both run
/// inline on the runtime thread, as functions this cheap should.
pub fn batching_functions(max_batch: usize, max_wait: std::time::Duration) -> Vec<tensorwire::Function> {
    fn double(t: &Tensor) -> Result<Tensor, tensorwire::Status> {
        let v: Vec<f32> = t.as_slice::<f32>()?.iter().map(|x| x * 2.0).collect();
        Ok(Tensor::from_vec(t.shape(), v)?)
    }
    vec![
        tensorwire::Function::inline("double", |c| Ok(double(&c.inputs[0])?.into())),
        tensorwire::Function::batched(
            "double_batched",
            tensorwire::BatchConfig { max_batch, max_wait, inline: true, ..Default::default() },
            |x, _| Ok(vec![double(&x[0])?]),
        ),
    ]
}

/// GiB per second for `bytes` moved in `d`.
pub fn gib_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / d.as_secs_f64().max(1e-12)
}
