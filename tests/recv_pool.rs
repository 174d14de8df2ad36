//! The receive pool and receives into the caller's memory, over real
//! sockets: steady traffic reuses pooled buffers, a sender killed mid-tensor
//! leaves the pool and the memory budget consistent, and `fetch_into`
//! writes straight into a caller's buffer on every transport, refusing one
//! of the wrong size or dtype before writing anything.

mod common;

use std::time::Duration;

use common::*;
use tensorwire::builtins::{builtin_functions, random_tensor};
use tensorwire::{CallError, Client, DType, EchoService, FetchRequest, Server, ServerConfig, Tensor};

/// Environment variable that makes `child_sender` act (it is run by
/// `a_killed_sender_leaves_the_pool_consistent` as a separate process).
const CHILD_URL: &str = "TENSORWIRE_TEST_POOL_CHILD_URL";

/// A server that drops what it receives (the pool gets each buffer back as
/// soon as the handler drops the tensor) and serves the built-in functions.
fn dropping_server(cfg: ServerConfig) -> tensorwire::ServerBuilder {
    let mut b = Server::builder().config(cfg).service(EchoService);
    for f in builtin_functions() {
        b = b.function(f);
    }
    b
}

/// Polls `cond` for up to ~10 s (the server releases things asynchronously).
async fn eventually(mut cond: impl AsyncFnMut() -> bool) -> bool {
    for _ in 0..500 {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_receives_reuse_pooled_buffers_bit_exact() {
    let cfg = ServerConfig { max_memory_bytes: 1 << 30, ..Default::default() };
    let (server, _dir) = start(dropping_server(cfg), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    for i in 0..6u64 {
        let t = random_tensor(DType::UInt8, &[8 << 20], i).unwrap();
        client.send(vec![t.clone()]).await.unwrap();
        // Through both pools (server receive, client receive), bit-exact.
        let back = client.compute("identity", vec![t.clone()]).await.unwrap();
        assert_same(&t, &back[0]);
    }
    let info = client.service_info().await.unwrap();
    assert!(info.recv_pool_misses >= 1, "{info:?}");
    assert!(info.recv_pool_hits >= 6, "steady receives reuse buffers: {} hits", info.recv_pool_hits);
    // The last buffer goes back to the pool once the reply is written,
    // which may be after the client has it.
    let c = client.clone();
    assert!(
        eventually(async || c.service_info().await.unwrap().recv_pool_idle_bytes >= 8 << 20).await,
        "{:?}",
        client.service_info().await.unwrap()
    );
    // Nothing is viewed any more: all that is reserved is the idle pool.
    let c = client.clone();
    assert!(
        eventually(async || {
            let i = c.service_info().await.unwrap();
            i.memory_used == i.recv_pool_idle_bytes
        })
        .await,
        "{:?}",
        client.service_info().await.unwrap()
    );
}

/// Run as a separate process by `a_killed_sender_leaves_the_pool_consistent`:
/// sends 32 MiB tensors until it is killed. Does nothing in a normal run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_sender() {
    let Ok(url) = std::env::var(CHILD_URL) else { return };
    let client = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[32 << 20], 1).unwrap();
    loop {
        let _ = client.send(vec![t.clone()]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_sender_leaves_the_pool_consistent() {
    let cfg = ServerConfig { max_memory_bytes: 1 << 30, ..Default::default() };
    let (server, _dir) = start(dropping_server(cfg), "tcp").await;
    let url = server.url();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_sender", "--nocapture", "--test-threads=1"])
        .env(CHILD_URL, &url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it in the middle of a tensor: after some have arrived, while
    // one is being received (something leased beyond the idle pool).
    let received = || server.info().bytes_received;
    // (A deadline, not a count of short sleeps: the child is a new process
    // of a debug build that makes its tensors first; a loaded machine may
    // take seconds.)
    let mut mid_tensor = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let i = server.info();
        if received() > 128 << 20 && i.memory_used > i.recv_pool_idle_bytes {
            mid_tensor = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(received() > 0, "the child sent nothing");
    // Everything the dead sender's tensor held went back: what is reserved
    // is exactly the idle pool, within its size.
    assert!(
        eventually(async || {
            let i = server.info();
            i.memory_used == i.recv_pool_idle_bytes && i.active_calls == 0
        })
        .await,
        "{:?}",
        server.info()
    );
    let info = server.info();
    assert!(info.recv_pool_idle_bytes <= 256 << 20, "bounded by a quarter of the budget: {info:?}");
    assert!(info.recv_pool_hits >= 1, "the child's steady sends reused buffers: {info:?}");
    eprintln!("killed mid-tensor: {mid_tensor}; {info:?}");
    // The pool serves new traffic bit-exact (a buffer the dead sender
    // filled half is reused and fully overwritten).
    let client = Client::connect(&url).await.unwrap();
    for i in 0..3u64 {
        let t = random_tensor(DType::UInt8, &[32 << 20], 100 + i).unwrap();
        let back = client.compute("identity", vec![t.clone()]).await.unwrap();
        assert_same(&t, &back[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_over_the_budget_is_refused_before_its_bytes_arrive() {
    // 48 MiB of budget: a 64 MiB tensor cannot be pooled or allocated.
    let cfg = ServerConfig { max_memory_bytes: 48 << 20, ..Default::default() };
    let (server, _dir) = start(dropping_server(cfg), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let small = random_tensor(DType::UInt8, &[8 << 20], 1).unwrap();
    client.send(vec![small.clone()]).await.unwrap();
    let e = client.send(vec![random_tensor(DType::UInt8, &[64 << 20], 2).unwrap()]).await.unwrap_err();
    assert_eq!(e.status().map(|s| s.code), Some(tensorwire::Code::ResourceExhausted), "{e}");
    assert!(e.to_string().contains("memory budget"), "{e}");
    // Still serving, and the pool's idle buffer was given up to make room
    // only if needed: the budget is consistent.
    client.send(vec![small]).await.unwrap();
    let i = server.info();
    assert!(i.memory_used <= i.memory_limit);
}

/// `fetch_into` on one transport: bit-exact into caller memory, nothing
/// written past the buffer, wrong size or dtype refused with nothing written.
async fn fetch_into_on(scheme: &str) {
    let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
    let url = if scheme == "unix" { format!("{}?shm=0", server.url()) } else { server.url() };
    let client = Client::connect(&url).await.unwrap();
    // 4 MiB of float32 in several chunks, and one small tensor.
    let w = random_tensor(DType::Float32, &[256, 4096], 7).unwrap().with_name("w");
    let b = Tensor::from_vec([3], vec![1i32, 2, 3]).unwrap().with_name("b");
    client.send(vec![w.clone(), b.clone()]).await.unwrap();

    let mut dst = vec![0f32; 256 * 4096];
    let shape = client.fetch_into("w", &mut dst).await.unwrap();
    assert_eq!(shape, vec![256, 4096]);
    assert_eq!(&dst[..], w.as_slice::<f32>().unwrap(), "{scheme}");
    let mut small = [0i32; 3];
    assert_eq!(client.fetch_into("b", &mut small).await.unwrap(), vec![3]);
    assert_eq!(small, [1, 2, 3]);

    // Into the front of a larger byte buffer: the rest stays untouched.
    let n = w.nbytes();
    let mut bytes = vec![0xAAu8; n + 4096];
    let info = client.fetch_into_bytes(FetchRequest::name("w"), &mut bytes[..n], Some(DType::Float32)).await.unwrap();
    assert_eq!((info.dtype, info.shape.as_slice()), (Some(DType::Float32), &[256usize, 4096][..]));
    assert_eq!(&bytes[..n], w.to_contiguous_bytes().unwrap().as_ref());
    assert!(bytes[n..].iter().all(|&x| x == 0xAA), "{scheme}: bytes written past the buffer");

    // Wrong sizes and a wrong dtype: a clear error, nothing written.
    for len in [256 * 4096 - 1, 256 * 4096 + 1] {
        let mut wrong = vec![-1f32; len];
        let e = client.fetch_into("w", &mut wrong).await.unwrap_err();
        assert!(matches!(e, CallError::InvalidArgument(_)), "{scheme}: {e}");
        assert!(e.to_string().contains("bytes"), "{e}");
        assert!(wrong.iter().all(|&x| x == -1.0), "{scheme}: a refused buffer was written");
    }
    let mut as_int = vec![-1i32; 256 * 4096];
    let e = client.fetch_into("w", &mut as_int).await.unwrap_err();
    assert!(e.to_string().contains("float32") && e.to_string().contains("int32"), "{scheme}: {e}");
    assert!(as_int.iter().all(|&x| x == -1), "{scheme}: a refused buffer was written");
    // A name that is not there is the server's error, as with fetch.
    let e = client.fetch_into("missing", &mut [0u8; 4]).await.unwrap_err();
    assert!(e.status().is_some(), "{e}");
    // The connection goes on working after the refusals.
    assert_same(&w, &client.fetch_one("w").await.unwrap());
    // The blocking client does the same (on its own runtime, off this one).
    let w2 = w.clone();
    tokio::task::spawn_blocking(move || {
        let c = tensorwire::BlockingClient::connect(&url).unwrap();
        let mut dst = vec![0f32; 256 * 4096];
        assert_eq!(c.fetch_into("w", &mut dst).unwrap(), vec![256, 4096]);
        assert_eq!(&dst[..], w2.as_slice::<f32>().unwrap());
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_over_tcp() {
    fetch_into_on("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_over_unix() {
    fetch_into_on("unix").await;
}

#[cfg(feature = "shm")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_over_shm() {
    fetch_into_on("shm").await;
}

#[cfg(feature = "grpc")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_into_over_grpc() {
    fetch_into_on("grpc").await;
}
