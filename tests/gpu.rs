//! GPU tensors end to end (feature `cuda`), on a machine with an NVIDIA
//! GPU: uploads and downloads through the pinned staging pool at every
//! size around a chunk boundary (empty tensors too), `send_gpu` and
//! `fetch_to_gpu` against a storing server on every same-host transport,
//! uploads fed piece by piece, a handler receiving tensors straight into
//! GPU memory chunk by chunk (`next_to_gpu`, every transport, raw,
//! compressed and torch-coded), a handler landing tensors in pinned memory
//! of its own (`next_into`, `upload_pinned`), a limit refused mid-send, an abandoned send, a caller's buffer
//! page-locked, device memory of the caller's own, and CUDA IPC between
//! two processes. Without a driver or device each test says why it skips.

#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::cuda::{self, DeviceTensor, Gpu, GpuError};
use tensorwire::{Client, DType, FetchRequest, Limits, ServerConfig, Tensor};

/// Environment variables that make `ipc_child_process` act (the parent
/// test runs this binary again with them set).
const CHILD_HANDLE: &str = "TENSORWIRE_TEST_IPC_HANDLE";
const CHILD_BYTES: &str = "TENSORWIRE_TEST_IPC_BYTES";

/// cuda:0 with small staging chunks (so modest tensors cross many chunk
/// boundaries), or `None` after saying why GPU tests skip here.
fn gpu(chunk: usize) -> Option<Arc<Gpu>> {
    match cuda::available() {
        Ok(n) if n > 0 => Some(Arc::new(Gpu::with_staging(0, chunk).expect("cuda:0 opens"))),
        Ok(_) => {
            eprintln!("skipping GPU test: the driver reports no device");
            None
        }
        Err(e) => {
            eprintln!("skipping GPU test: {e}");
            None
        }
    }
}

const CHUNK: usize = 1 << 20;

fn gpu_samples() -> Vec<Tensor> {
    let mut v = Vec::new();
    for (i, n) in [1usize, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 3].into_iter().enumerate() {
        v.push(random_tensor(DType::UInt8, &[n], i as u64).unwrap().with_name(format!("u8-{n}")));
    }
    v.push(random_tensor(DType::Float32, &[0, 4], 10).unwrap().with_name("empty"));
    v.push(random_tensor(DType::BFloat16, &[3, 5, 7], 11).unwrap().with_name("bf16"));
    v.push(random_tensor(DType::Float64, &[257, 129], 12).unwrap().transpose(0, 1).unwrap().with_name("transposed"));
    v.push(random_tensor(DType::Float32, &[16, 1 << 20], 13).unwrap().with_name("64mib"));
    v
}

#[test]
fn upload_download_bit_exact_around_chunk_boundaries() {
    let Some(g) = gpu(CHUNK) else { return };
    for t in gpu_samples() {
        let d = g.upload(&t).unwrap();
        assert_eq!(d.nbytes(), t.nbytes(), "{:?}", t.name());
        assert_eq!(d.shape(), t.shape());
        assert_eq!(d.name(), t.name());
        let back = g.download(&d).unwrap();
        assert_same(&t.contiguous().unwrap(), &back);
        let mut chunks = 0;
        g.download_chunks(&d, |c| {
            assert!(c.len() <= CHUNK && !c.is_empty());
            chunks += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(chunks, t.nbytes().div_ceil(CHUNK));
    }
    // A consumer that stops after two chunks (copies still in flight): the
    // error comes back, and the staging buffers stay usable.
    let t = random_tensor(DType::UInt8, &[5 * CHUNK + 3], 9).unwrap();
    let d = g.upload(&t).unwrap();
    let mut seen = 0;
    let e = g
        .download_chunks(&d, |_| {
            seen += 1;
            if seen == 2 { Err(GpuError::Invalid("enough".into())) } else { Ok(()) }
        })
        .unwrap_err();
    assert_eq!(e.to_string(), "enough");
    assert_same(&t, &g.download(&d).unwrap());
}

/// An upload fed in pieces of uneven sizes (across staging buffers, as
/// chunks off the network arrive) is bit-exact; a piece past the tensor's
/// end is refused, a short upload fails at `finish`, and one dropped
/// half-way leaves the GPU's staging pool usable.
#[test]
fn an_upload_fed_piece_by_piece() {
    let Some(g) = gpu(CHUNK) else { return };
    let t = random_tensor(DType::Float32, &[3, (CHUNK + 5) / 4 * 5], 80).unwrap().with_name("pieces");
    let src = t.as_bytes().unwrap();
    let mut up = g.begin_upload(t.dtype(), t.shape().to_vec()).unwrap();
    let (mut off, mut step) = (0, 1);
    while off < src.len() / 2 {
        let end = (off + step).min(src.len());
        up.push(&src[off..end]).unwrap();
        off = end;
        step = step * 5 + 4099;
    }
    // The rest as several parts at once (pieces that queued up), across a
    // staging buffer's end.
    let (a, b) = (off + (src.len() - off) / 3, off + 2 * (src.len() - off) / 3);
    up.push_parts(&[&src[off..a], &[], &src[a..b], &src[b..]]).unwrap();
    let e = up.push(&[0]).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
    let d = up.finish().unwrap();
    assert_same(&t, &g.download(&d).unwrap());
    let mut short = g.begin_upload(DType::UInt8, vec![3 * CHUNK]).unwrap();
    short.push(&src[..2 * CHUNK + 1]).unwrap();
    let e = short.finish().unwrap_err();
    assert!(e.to_string().contains("ended after"), "{e}");
    let mut dropped = g.begin_upload(DType::UInt8, vec![4 * CHUNK]).unwrap();
    dropped.push(&src[..3 * CHUNK]).unwrap();
    drop(dropped);
    assert_same(&t, &g.download(&g.upload(&t).unwrap()).unwrap());
    let empty = g.begin_upload(DType::Float32, vec![0, 4]).unwrap().finish().unwrap();
    assert_eq!((empty.nbytes(), empty.shape()), (0, &[0usize, 4][..]));
}

#[test]
fn a_missing_device_is_an_error_not_a_panic() {
    let Some(_g) = gpu(CHUNK) else { return };
    let n = cuda::available().unwrap();
    match Gpu::open(n) {
        Err(GpuError::NoDevice { ordinal, count }) => assert_eq!((ordinal, count), (n, n)),
        other => panic!("cuda:{n} on a machine with {n} devices: {other:?}"),
    }
}

/// Device memory the caller allocated and filled is sent as it is; a slice
/// of the wrong size is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_memory_of_the_callers_own_is_sent() {
    let Some(g) = gpu(CHUNK) else { return };
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let t = random_tensor(DType::Float32, &[1000, 3], 21).unwrap();
    let slice = stream.clone_htod(t.as_bytes().unwrap()).unwrap();
    let e = DeviceTensor::from_cuda(stream.clone_htod(&[0u8; 12]).unwrap(), DType::Float32, vec![4]).unwrap_err();
    assert!(e.to_string().contains("do not hold"), "{e}");
    let d = DeviceTensor::from_cuda(slice, DType::Float32, vec![1000, 3]).unwrap().with_name("own");
    let (server, _dir) = start(store_server(ServerConfig::default()), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let s = client.send_gpu(&g, vec![Arc::new(d)]).await.unwrap();
    assert_eq!(s.bytes, 12000);
    assert_same(&t, &client.fetch_one("own").await.unwrap());

    // Filled by an async copy still running on a stream of the caller's
    // (non-blocking, so nothing orders it with the GPU's copy stream): the
    // send waits for it. 64 MiB from pinned memory, sent at once.
    let own = ctx.new_stream().unwrap();
    let big = random_tensor(DType::UInt8, &[64 << 20], 22).unwrap().with_name("filled");
    for round in 0..3 {
        // SAFETY: written in full below before any read.
        let mut host = unsafe { ctx.alloc_pinned::<u8>(big.nbytes()) }.unwrap();
        host.as_mut_slice().unwrap().copy_from_slice(big.as_bytes().unwrap());
        let mut dev = own.alloc_zeros::<u8>(big.nbytes()).unwrap();
        own.memcpy_htod(&host, &mut dev).unwrap();
        let d = DeviceTensor::from_cuda(dev, DType::UInt8, vec![big.nbytes()]).unwrap().with_name("filled");
        client.send_gpu(&g, vec![Arc::new(d)]).await.unwrap();
        let back = client.fetch_one("filled").await.unwrap();
        assert_eq!(back.crc32c().unwrap(), big.crc32c().unwrap(), "round {round}: the send read the memory early");
    }
}

/// GPU → wire → store, then store → wire → GPU, compared bit for bit on
/// the host, over every same-host transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_gpu_and_fetch_to_gpu_on_every_transport() {
    let Some(g) = gpu(CHUNK) else { return };
    let samples = gpu_samples();
    let on_gpu: Vec<Arc<DeviceTensor>> = samples.iter().map(|t| Arc::new(g.upload(t).unwrap())).collect();
    let total: usize = samples.iter().map(Tensor::nbytes).sum();
    for scheme in ["tcp", "unix", "shm", "quic", "grpc"] {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let url = match scheme {
            "unix" => format!("{}?shm=0", server.url()),
            _ => server.url(),
        };
        let client = Client::connect(&url).await.unwrap();
        let s = client.send_gpu(&g, on_gpu.clone()).await.unwrap_or_else(|e| panic!("{scheme}: {e}"));
        assert_eq!((s.received, s.bytes), (samples.len() as u64, total as u64), "{scheme}");
        for t in &samples {
            let name = t.name().unwrap();
            assert_same(&t.contiguous().unwrap(), &client.fetch_one(name).await.unwrap());
            let mut back = client.fetch_to_gpu(&g, FetchRequest::name(name)).await.unwrap();
            assert_eq!(back.len(), 1, "{scheme} {name}");
            let d = back.pop().unwrap();
            assert_eq!((d.dtype(), d.shape(), d.nbytes()), (t.dtype(), t.shape(), t.nbytes()), "{scheme} {name}");
            assert_same(&t.contiguous().unwrap(), &g.download(&d).unwrap());
        }
        server.shutdown().await;
    }
}

/// Receives each tensor into a page-locked buffer of the handler's own,
/// then uploads it in one DMA; keeps what reached the GPU.
struct LandOnGpu {
    gpu: Arc<Gpu>,
    landing: tokio::sync::Mutex<cuda::PinnedBuffer>,
    got: Arc<std::sync::Mutex<Vec<DeviceTensor>>>,
}

#[async_trait::async_trait]
impl tensorwire::TensorService for LandOnGpu {
    async fn send(
        &self,
        _: &tensorwire::CallContext,
        tensors: &mut tensorwire::TensorStream,
    ) -> Result<tensorwire::SendSummary, tensorwire::Status> {
        let mut buf = self.landing.lock().await;
        let mut s = tensorwire::SendSummary::default();
        while let Some(info) = tensors.next_into(&mut buf, None).await {
            let info = info.map_err(tensorwire::Status::from)?;
            let d = self
                .gpu
                .upload_pinned(&buf, info.dtype.unwrap(), info.shape)
                .map_err(|e| tensorwire::Status::internal(e.to_string()))?;
            self.got.lock().unwrap().push(d);
            s.received += 1;
        }
        Ok(s)
    }
}

/// GPU → wire → a server's page-locked buffer → its GPU, on the transports
/// that place chunks differently (socket reads, shared memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_lands_tensors_in_pinned_memory_and_uploads_them() {
    let Some(g) = gpu(CHUNK) else { return };
    let t = random_tensor(DType::BFloat16, &[3, (5 << 20) + 1], 61).unwrap();
    let e = g.upload_pinned(&g.pinned(10).unwrap(), DType::Float32, vec![3]).unwrap_err();
    assert!(e.to_string().contains("do not hold"), "{e}");
    for scheme in ["tcp", "unix", "shm"] {
        let got = Arc::new(std::sync::Mutex::new(Vec::new()));
        let service = LandOnGpu {
            gpu: g.clone(),
            landing: tokio::sync::Mutex::new(g.pinned(t.nbytes()).unwrap()),
            got: got.clone(),
        };
        let builder = tensorwire::Server::builder().service(service);
        let (server, _dir) = start(builder, scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let d = Arc::new(g.upload(&t).unwrap());
        client.send_gpu(&g, vec![d.clone(), d]).await.unwrap_or_else(|e| panic!("{scheme}: {e}"));
        let got = std::mem::take(&mut *got.lock().unwrap());
        assert_eq!(got.len(), 2, "{scheme}");
        for d in &got {
            assert_same(&t, &g.download(d).unwrap());
        }
        server.shutdown().await;
    }
}

/// Receives each tensor straight into GPU memory, chunk by chunk as it
/// arrives (`next_to_gpu`); keeps what reached the GPU, in order.
struct StreamToGpu {
    gpu: Arc<Gpu>,
    got: Arc<std::sync::Mutex<Vec<DeviceTensor>>>,
}

#[async_trait::async_trait]
impl tensorwire::TensorService for StreamToGpu {
    async fn send(
        &self,
        _: &tensorwire::CallContext,
        tensors: &mut tensorwire::TensorStream,
    ) -> Result<tensorwire::SendSummary, tensorwire::Status> {
        let mut s = tensorwire::SendSummary::default();
        while let Some(d) = tensors.next_to_gpu(&self.gpu).await {
            let d = d.map_err(tensorwire::Status::from)?;
            s.received += 1;
            s.bytes += d.nbytes() as u64;
            self.got.lock().unwrap().push(d);
        }
        Ok(s)
    }
}

/// Host tensors → wire → a handler's GPU, chunk by chunk: every sample
/// (around chunk boundaries, empty, a strided view), raw and compressed,
/// and in the torch codec (read whole, then uploaded), over every
/// transport (gRPC hands the handler its first tensor already read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_receives_tensors_straight_into_gpu_memory() {
    use tensorwire::codecs::{CodecKind, Compression, CompressionMode};
    let Some(g) = gpu(CHUNK) else { return };
    let samples = gpu_samples();
    for scheme in ["tcp", "unix", "shm", "quic", "grpc"] {
        for (codec, compression) in [
            (CodecKind::Raw, Compression::None),
            (CodecKind::Raw, Compression::Lz4),
            (CodecKind::Torch, Compression::None),
        ] {
            let landed = Arc::new(std::sync::Mutex::new(Vec::new()));
            let builder = tensorwire::Server::builder().service(StreamToGpu { gpu: g.clone(), got: landed.clone() });
            let (server, _dir) = start(builder, scheme).await;
            let url = match scheme {
                "unix" => format!("{}?shm=0", server.url()),
                _ => server.url(),
            };
            let mut cfg = tensorwire::ClientConfig::default();
            cfg.encoding.codec = codec;
            cfg.encoding.compression = CompressionMode::Fixed(compression);
            let client = Client::connect_with(&url, cfg).await.unwrap();
            let what = format!("{scheme} {codec:?} {compression:?}");
            let s = client.send(samples.clone()).await.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(s.received, samples.len() as u64, "{what}");
            let got = std::mem::take(&mut *landed.lock().unwrap());
            assert_eq!(got.len(), samples.len(), "{what}");
            for (t, d) in samples.iter().zip(&got) {
                assert_eq!(d.name(), t.name(), "{what}");
                assert_same(&t.contiguous().unwrap(), &g.download(d).unwrap());
            }
            // The connection and the GPU keep serving.
            let t = random_tensor(DType::UInt8, &[CHUNK + 9], 70).unwrap();
            client.send(vec![t.clone()]).await.unwrap();
            let more = std::mem::take(&mut *landed.lock().unwrap());
            assert_eq!(more.len(), 1, "{what}");
            assert_same(&t, &g.download(&more[0]).unwrap());
            server.shutdown().await;
        }
    }
}

/// A tensor over the server's limit fails the send with the limit named;
/// the GPU's staging pool and the connection both keep working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_gpu_send_is_a_clear_error_and_the_next_one_works() {
    let Some(g) = gpu(CHUNK) else { return };
    let cfg = ServerConfig { limits: Limits { max_tensor_bytes: 4 << 20, ..Limits::default() }, ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let big = random_tensor(DType::UInt8, &[16 << 20], 31).unwrap().with_name("big");
    let d = Arc::new(g.upload(&big).unwrap());
    let e = client.send_gpu(&g, vec![d]).await.unwrap_err();
    assert!(e.to_string().to_lowercase().contains("limit"), "{e}");
    let small = random_tensor(DType::UInt8, &[3 << 20], 32).unwrap().with_name("small");
    client.send_gpu(&g, vec![Arc::new(g.upload(&small).unwrap())]).await.unwrap();
    assert_same(&small, &client.fetch_one("small").await.unwrap());
}

/// A send the caller gives up on (its future dropped mid-tensor) stops the
/// device copies and leaves the client and the GPU usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_gpu_send_stops_and_the_next_one_works() {
    let Some(g) = gpu(CHUNK) else { return };
    let (server, _dir) = start(store_server(ServerConfig::default()), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let big = random_tensor(DType::UInt8, &[256 << 20], 41).unwrap().with_name("big");
    let d = Arc::new(g.upload(&big).unwrap());
    let r = tokio::time::timeout(Duration::from_millis(20), client.send_gpu(&g, vec![d.clone()])).await;
    assert!(r.is_err(), "256 MiB sent in under 20 ms; the test needs a slower send");
    let after = random_tensor(DType::UInt8, &[CHUNK + 5], 42).unwrap().with_name("after");
    client.send_gpu(&g, vec![Arc::new(g.upload(&after).unwrap())]).await.unwrap();
    assert_same(&after, &client.fetch_one("after").await.unwrap());
    // The abandoned tensor never landed whole.
    assert!(client.fetch_one("big").await.is_err());
}

#[test]
fn a_callers_buffer_is_page_locked_and_released() {
    let Some(g) = gpu(CHUNK) else { return };
    let mut buf = vec![7u8; 16 << 20];
    {
        let mut reg = g.register_host(&mut buf).unwrap();
        reg.buffer()[0] = 9;
    }
    // Released on drop: registering again works.
    let reg = g.register_host(&mut buf).unwrap();
    drop(reg);
    assert_eq!(buf[0], 9);
}

/// CUDA IPC: this process exports a device tensor, a child process (this
/// test binary again) imports it, copies it device to device and prints
/// its checksum.
#[test]
fn ipc_between_two_processes() {
    let Some(g) = gpu(CHUNK) else { return };
    let t = random_tensor(DType::UInt8, &[(32 << 20) + 7], 51).unwrap();
    let d = Arc::new(g.upload(&t).unwrap());
    let export = match g.ipc_export(d) {
        Ok(e) => e,
        Err(e) => return eprintln!("skipping: CUDA IPC is not supported here: {e}"),
    };
    let hex: String = export.handle.iter().map(|b| format!("{b:02x}")).collect();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ipc_child_process", "--nocapture", "--test-threads", "1"])
        .env(CHILD_HANDLE, hex)
        .env(CHILD_BYTES, t.nbytes().to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let want = format!("ipc crc32c {:08x}", t.crc32c().unwrap());
    assert!(stdout.contains(&want), "child printed {stdout:?}, expected {want:?}");
    drop(export);
}

/// The importing side of `ipc_between_two_processes`; does nothing unless
/// that test runs it.
#[test]
fn ipc_child_process() {
    let (Ok(hex), Ok(n)) = (std::env::var(CHILD_HANDLE), std::env::var(CHILD_BYTES)) else { return };
    let n: usize = n.parse().unwrap();
    let g = Gpu::open(0).unwrap();
    let mut handle = [0u8; 64];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let bad = g.ipc_import(&handle, DType::Float32, vec![n], n).unwrap_err();
    assert!(bad.to_string().contains("do not hold"), "{bad}");
    let imported = g.ipc_import(&handle, DType::UInt8, vec![n], n).unwrap();
    let copy = g.copy_imported(&imported).unwrap();
    drop(imported);
    let host = g.download(&copy).unwrap();
    println!("ipc crc32c {:08x}", host.crc32c().unwrap());
}
