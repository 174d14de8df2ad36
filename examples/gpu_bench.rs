//! GPU figures (needs a CUDA machine; elsewhere it says why and exits 0):
//!
//! 1. device→host of 256 MiB through the pinned staging pool (chunked,
//!    double-buffered) next to one plain `cuMemcpyDtoH` of the whole tensor
//!    into pinned memory, and host→device through the pool (`Gpu::upload`)
//!    next to one plain `cuMemcpyHtoD` of the same pageable memory and one
//!    from pinned memory;
//! 2. end to end over tcp, a Unix socket and shared memory: the same
//!    tensor sent from host memory to a server that drops it (the
//!    network's ceiling in this run), sent from the GPU with
//!    `Client::send_gpu` to that server, to a server that uploads what it
//!    receives (`Gpu::upload`), to one that receives each tensor straight
//!    into GPU memory chunk by chunk (`TensorStream::next_to_gpu`), and to
//!    one that receives each tensor into a page-locked buffer
//!    (`TensorStream::next_into`) and copies it up in one DMA
//!    (`Gpu::upload_pinned`); and a stored tensor fetched to host memory
//!    (the ceiling) and to the GPU chunk by chunk (`Client::fetch_to_gpu`);
//! 3. CUDA IPC between two processes: this program re-runs itself as a
//!    child that imports the parent's device buffer and copies it device to
//!    device.
//!
//! ```text
//! cargo run --release --features cuda --example gpu_bench [-- --mib 256 --chunk-mib 8 --no-tune-allocator]
//! ```

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use tensorwire::builtins::random_tensor;
use tensorwire::cuda::{self, Gpu, PinnedBuffer};
use tensorwire::{CallContext, Client, DType, SendSummary, Server, Status, TensorService, TensorStream};

/// What the bench's server does with each tensor it receives.
enum Mode {
    /// Drops it (the network-only baseline).
    Drop,
    /// Receives it whole, then uploads it (`Gpu::upload`).
    Whole(Arc<Gpu>),
    /// Receives it straight into GPU memory chunk by chunk
    /// (`TensorStream::next_to_gpu`).
    Stream(Arc<Gpu>),
    /// Receives it into a page-locked buffer (`next_into`), then copies it
    /// up in one DMA (`Gpu::upload_pinned`).
    Landing(Arc<Gpu>, tokio::sync::Mutex<PinnedBuffer>),
}

struct ToGpu(Mode);

#[async_trait]
impl TensorService for ToGpu {
    async fn send(&self, _ctx: &CallContext, tensors: &mut TensorStream) -> Result<SendSummary, Status> {
        let mut s = SendSummary::default();
        match &self.0 {
            Mode::Landing(g, landing) => {
                let mut buf = landing.lock().await;
                while let Some(info) = tensors.next_into(&mut buf, None).await {
                    let info = info.map_err(Status::from)?;
                    s.received += 1;
                    s.bytes += buf.len() as u64;
                    let dtype = info.dtype.unwrap_or(DType::UInt8);
                    tokio::task::block_in_place(|| g.upload_pinned(&buf, dtype, info.shape))
                        .map_err(|e| Status::internal(e.to_string()))?;
                }
            }
            Mode::Stream(g) => {
                while let Some(d) = tensors.next_to_gpu(g).await {
                    s.received += 1;
                    s.bytes += d.map_err(Status::from)?.nbytes() as u64;
                }
            }
            Mode::Drop | Mode::Whole(_) => {
                while let Some(t) = tensors.next().await {
                    let t = t.map_err(Status::from)?;
                    s.received += 1;
                    s.bytes += t.nbytes() as u64;
                    let Mode::Whole(g) = &self.0 else { continue };
                    let g = g.clone();
                    tokio::task::spawn_blocking(move || g.upload(&t))
                        .await
                        .map_err(|e| Status::internal(e.to_string()))?
                        .map_err(|e| Status::internal(e.to_string()))?;
                }
            }
        }
        Ok(s)
    }
}

/// The label of send mode `k` in the end-to-end rows.
fn modes_label(k: usize) -> &'static str {
    [
        "host -> wire",
        "GPU -> wire",
        "GPU -> wire -> whole, then GPU",
        "GPU -> wire -> GPU chunk by chunk (next_to_gpu)",
        "GPU -> wire -> pinned buffer (next_into) -> GPU",
    ][k]
}

fn gib_s(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / (1u64 << 30) as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("ipc-child") {
        return ipc_child(&args[2], args[3].parse()?);
    }
    // As the CLI does: fixed glibc malloc thresholds, so that 1 MiB receive
    // buffers are recycled rather than mapped and faulted in anew.
    if !args.iter().any(|a| a == "--no-tune-allocator") {
        tensorwire::tune_allocator();
    }
    let mib: usize = args.iter().position(|a| a == "--mib").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(256);
    let n = mib << 20;
    let chunk = args
        .iter()
        .position(|a| a == "--chunk-mib")
        .and_then(|i| args.get(i + 1)?.parse::<usize>().ok())
        .map_or(cuda::DEFAULT_STAGING_CHUNK, |m| m << 20);
    match cuda::available() {
        Ok(0) | Err(_) => {
            println!("skipping: {}", cuda::available().err().map_or("no CUDA device".into(), |e| e.to_string()));
            return Ok(());
        }
        Ok(count) => println!("CUDA devices: {count}"),
    }
    let gpu = Arc::new(Gpu::with_staging(0, chunk)?);
    // The servers' own: a copy stream and staging pool apart from the
    // client's, as a server in another process has.
    let server_gpu = Arc::new(Gpu::with_staging(0, chunk)?);
    println!("staging chunk {} MiB", chunk >> 20);
    let host = random_tensor(DType::UInt8, &[n], 1)?;
    let dev = Arc::new(gpu.upload(&host)?);

    // 1. D2H: staging pool vs one plain copy into pinned memory.
    let reps = 5;
    let t = Instant::now();
    for _ in 0..reps {
        gpu.download_chunks(&dev, |c| {
            std::hint::black_box(&c);
            Ok(())
        })?;
    }
    let pool = gib_s(n * reps, t.elapsed().as_secs_f64());
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let src = stream.clone_htod(host.as_bytes()?)?;
    // SAFETY: written by the copy before it is read.
    let mut pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(n, 0)? };
    let t = Instant::now();
    for _ in 0..reps {
        stream.memcpy_dtoh(&src, &mut pinned)?;
        stream.synchronize()?;
    }
    let plain = gib_s(n * reps, t.elapsed().as_secs_f64());
    println!(
        "D2H {mib} MiB: pinned pool (chunked, double-buffered, chunks handed out as views of the pinned buffers) {pool:.2} GiB/s; one cuMemcpyDtoH into pinned memory {plain:.2} GiB/s; ratio {:.2}",
        pool / plain
    );
    assert!(gpu.download(&dev)?.data_eq(&host), "D2H changed the data");

    // H2D: the staging pool (host copy overlapping the DMA) vs one plain
    // cuMemcpyHtoD from pinned memory.
    let t = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(gpu.upload(&host)?);
    }
    let up = gib_s(n * reps, t.elapsed().as_secs_f64());
    let mut dst = stream.alloc_zeros::<u8>(n)?;
    let t = Instant::now();
    for _ in 0..reps {
        stream.memcpy_htod(&pinned, &mut dst)?;
        stream.synchronize()?;
    }
    let plain_up = gib_s(n * reps, t.elapsed().as_secs_f64());
    let t = Instant::now();
    for _ in 0..reps {
        stream.memcpy_htod(host.as_bytes()?, &mut dst)?;
        stream.synchronize()?;
    }
    let pageable_up = gib_s(n * reps, t.elapsed().as_secs_f64());
    println!(
        "H2D {mib} MiB: upload from pageable host memory through the pool {up:.2} GiB/s; one cuMemcpyHtoD of the same pageable memory {pageable_up:.2} GiB/s ({:.2}x); from pinned memory {plain_up:.2} GiB/s ({:.2}x, the bus)",
        up / pageable_up,
        up / plain_up
    );

    // 2. End to end: host -> wire -> dropped (the network ceiling, same
    // run), GPU -> wire -> dropped, and GPU -> wire -> GPU; then fetches.
    // Every figure alternates with its ceiling, round after round; each
    // ratio is the median of the rounds' ratios.
    let rounds: usize =
        args.iter().position(|a| a == "--rounds").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(3);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let dir = tempfile_dir();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for (label, listen, suffix) in [
        ("tcp", "tcp://127.0.0.1:0?shm=0".to_string(), ""),
        ("unix socket", format!("unix://{}/gpu-u.sock", dir.display()), "?shm=0"),
        ("unix + shared memory", format!("unix://{}/gpu-s.sock", dir.display()), ""),
    ] {
        let modes = [
            Mode::Drop,
            Mode::Drop,
            Mode::Whole(server_gpu.clone()),
            Mode::Stream(server_gpu.clone()),
            Mode::Landing(server_gpu.clone(), tokio::sync::Mutex::new(server_gpu.pinned(n)?)),
        ];
        let figures = rt.block_on(async {
            // One server (and client) per mode, each on its own socket.
            let mut peers = Vec::new();
            for (k, mode) in modes.into_iter().enumerate() {
                let at = listen.replace(".sock", &format!("-{k}.sock"));
                let server = Server::builder().service(ToGpu(mode)).build().start([at.as_str()]).await?;
                let client = Client::connect(&format!("{}{suffix}", server.url())).await?;
                peers.push((server, client));
            }
            let store = Server::builder()
                .service(tensorwire::StoreService::default())
                .build()
                .start([listen.replace(".sock", "-store.sock").as_str()])
                .await?;
            let store_client = Client::connect(&format!("{}{suffix}", store.url())).await?;
            store_client.send(vec![host.clone().with_name("x")]).await?;
            // Rates per round: the five send modes, then fetch to host and
            // fetch to the GPU.
            let mut rates = vec![Vec::new(); peers.len() + 2];
            // Tensors per figure and round.
            let reps = 2;
            for round in 0..=rounds {
                for (k, (_, client)) in peers.iter().enumerate() {
                    let t = Instant::now();
                    for _ in 0..reps {
                        match k {
                            0 => client.send(vec![host.clone()]).await.map(drop)?,
                            _ => client.send_gpu(&gpu, vec![dev.clone()]).await.map(drop)?,
                        }
                    }
                    // Round 0 warms up.
                    if round > 0 {
                        rates[k].push(gib_s(n * reps, t.elapsed().as_secs_f64()));
                    }
                }
                for to_gpu in [false, true] {
                    let t = Instant::now();
                    for _ in 0..reps {
                        if to_gpu {
                            store_client.fetch_to_gpu(&gpu, tensorwire::FetchRequest::name("x")).await.map(drop)?;
                        } else {
                            store_client.fetch_one("x").await.map(drop)?;
                        }
                    }
                    if round > 0 {
                        rates[peers.len() + usize::from(to_gpu)].push(gib_s(n * reps, t.elapsed().as_secs_f64()));
                    }
                }
            }
            for (server, _) in peers {
                server.shutdown().await;
            }
            store.shutdown().await;
            Ok::<_, Box<dyn std::error::Error>>(rates)
        })?;
        let ratio = |k: usize, base: usize| median((0..rounds).map(|r| figures[k][r] / figures[base][r]).collect());
        let sends: Vec<String> = (1..5)
            .map(|k| format!("{} {:.2} GiB/s ({:.2}x)", modes_label(k), median(figures[k].clone()), ratio(k, 0)))
            .collect();
        println!(
            "{label}, {mib} MiB, median of {rounds} rounds: host -> wire {:.2} GiB/s (ceiling); {}",
            median(figures[0].clone()),
            sends.join("; ")
        );
        println!(
            "{label}, {mib} MiB, median of {rounds} rounds: fetch to host {:.2} GiB/s (ceiling); fetch_to_gpu chunk by chunk {:.2} GiB/s ({:.2}x)",
            median(figures[5].clone()),
            median(figures[6].clone()),
            ratio(6, 5)
        );
    }

    // 3. CUDA IPC: a child process imports and copies device to device.
    let export = gpu.ipc_export(dev.clone())?;
    let hex: String = export.handle.iter().map(|b| format!("{b:02x}")).collect();
    let t = Instant::now();
    let out =
        std::process::Command::new(std::env::current_exe()?).args(["ipc-child", &hex, &n.to_string()]).output()?;
    println!(
        "CUDA IPC {mib} MiB, child process start + import + device copy: {:.1} ms; child says: {}",
        t.elapsed().as_secs_f64() * 1e3,
        String::from_utf8_lossy(&out.stdout).trim()
    );
    drop(export); // the child closed its mapping and exited: safe to free
    Ok(())
}

fn ipc_child(hex: &str, n: usize) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Gpu::open(0)?;
    let mut handle = [0u8; 64];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)?;
    }
    let t = Instant::now();
    let imported = gpu.ipc_import(&handle, DType::UInt8, vec![n], n)?;
    let copy = gpu.copy_imported(&imported)?;
    let secs = t.elapsed().as_secs_f64();
    drop(imported);
    let host = gpu.download(&copy)?;
    println!("import + device-to-device copy {:.2} GiB/s, crc32c {:08x}", gib_s(n, secs), host.crc32c()?);
    Ok(())
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tensorwire-gpu-bench-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&d);
    d
}
