//! Reliability and security: declared sizes never abort, one memory budget
//! bounds what peers make the server hold, idle and silent connections are
//! reclaimed, connections are capped, token guessing is limited, errors say
//! what is missing without listing the store. Real sockets on loopback.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{
    Args, CallError, Client, ClientConfig, Code, DType, FetchRequest, Function, Limits, Output, RetryPolicy, Server,
    ServerConfig, StoreService, TransportConfig,
};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{self as transports, Frame, FrameHeader, StreamKind};

/// Reads (and drops) what the server sends until it closes the socket;
/// false if it is still open after 20 s.
async fn closed_by_server(s: &mut tokio::net::TcpStream) -> bool {
    let mut sink = vec![0u8; 1 << 16];
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Ok(n) = tokio::io::AsyncReadExt::read(s, &mut sink).await {
            if n == 0 {
                return;
            }
        }
    })
    .await
    .is_ok()
}

fn remote_code(e: &CallError) -> Code {
    e.status().map(|s| s.code).unwrap_or_else(|| e.code())
}

/// A send call whose first chunk declares `total` bytes and carries 64 KiB,
/// then stalls (the stream stays open).
async fn stalled_send(
    conn: &Arc<dyn transports::Connection>,
    total: u64,
) -> (Box<dyn transports::SendStream>, Box<dyn transports::RecvStream>) {
    let (mut tx, rx) = conn.open(StreamKind::Send).await.unwrap();
    let req = v1::Request { method: v1::Method::Send as i32, ..Default::default() };
    tx.send(Frame::header_only(FrameHeader::new(Kind::Request(Box::new(req))))).await.unwrap();
    let info = v1::TensorInfo {
        dtype: v1::Dtype::Uint8 as i32,
        shape: vec![total],
        codec: v1::Codec::Raw as i32,
        ..Default::default()
    };
    let payload = bytes::Bytes::from(vec![1u8; 64 << 10]);
    let c = v1::Chunk {
        tensor_id: 1,
        total_bytes: total,
        raw_len: payload.len() as u64,
        compression: v1::Compression::None as i32,
        info: Some(Box::new(info)),
        ..Default::default()
    };
    tx.send(Frame { header: FrameHeader::new(Kind::Chunk(c)), payload }).await.unwrap();
    (tx, rx)
}

/// The error frame a call ends with.
async fn error_of(rx: &mut Box<dyn transports::RecvStream>) -> v1::Error {
    loop {
        match rx.recv().await {
            Ok(Some(r)) => {
                if let Some(Kind::Error(e)) = r.header.kind {
                    return e;
                }
            }
            other => panic!("expected an error frame, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_sizes_are_checked_before_anything_is_allocated() {
    let cfg = ServerConfig { limits: Limits { max_tensor_bytes: 1 << 20, ..Limits::default() }, ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    // Finding 1a: generated tensors of a caller's shape obey max_tensor_bytes.
    for shape in ["1000000,1000000", "1024,1024,64", "18446744073709551615,2"] {
        let e = client.fetch(FetchRequest::default().param("shape", shape)).await.unwrap_err();
        assert!(matches!(remote_code(&e), Code::LimitExceeded | Code::InvalidArgument), "{shape}: {e}");
    }
    let ok = client.fetch(FetchRequest::default().param("shape", "64,64")).await.unwrap();
    assert_eq!(ok[0].shape(), &[64, 64]);
    // Finding 1b, client side: a 64 GiB random tensor is a clear error, not an abort.
    let e = random_tensor(DType::Float32, &[1 << 40, 1 << 30], 0).unwrap_err();
    assert!(e.message.contains("cannot allocate") || e.message.contains("overflow"), "{e}");
    assert!(client.health().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_senders_are_bounded_by_the_memory_budget() {
    let cfg = ServerConfig { max_memory_bytes: 256 << 20, ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "tcp").await;
    let url = server.url();
    let conn = raw_handshake(&url, "").await;
    // Two stalled senders hold 2 × 96 MiB: within the budget, held while they stall.
    let a = stalled_send(&conn, 96 << 20).await;
    let b = stalled_send(&conn, 96 << 20).await;
    let client = Client::connect(&url).await.unwrap();
    let used = || async { client.service_info().await.unwrap().memory_used };
    for _ in 0..200 {
        if used().await >= 192 << 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(used().await >= 192 << 20, "the stalled tensors are reserved");
    // A third does not fit: refused before its bytes are read.
    let (_tx, mut rx) = stalled_send(&conn, 96 << 20).await;
    let e = error_of(&mut rx).await;
    assert_eq!(e.code, v1::ErrorCode::ResourceExhausted as i32, "{e:?}");
    assert!(e.message.contains("memory budget"), "{}", e.message);
    let info = client.service_info().await.unwrap();
    assert!(info.memory_used <= info.memory_limit, "{} > {}", info.memory_used, info.memory_limit);
    assert!(info.memory_refused >= 1);
    // Senders that go away give their reservations back.
    drop((a, b));
    conn.close("test done");
    // (Receive buffers kept idle in the receive pool stay reserved.)
    let held = || async {
        let i = client.service_info().await.unwrap();
        i.memory_used - i.recv_pool_idle_bytes
    };
    for _ in 0..500 {
        if held().await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(held().await, 0);
    // And normal traffic goes on.
    let t = random_tensor(DType::UInt8, &[8 << 20], 3).unwrap().with_name("after");
    client.send(vec![t.clone()]).await.unwrap();
    assert!(client.fetch_one("after").await.unwrap().data_eq(&t));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_results_are_held_against_the_budget() {
    let cfg = ServerConfig { max_memory_bytes: 200 << 20, ..Default::default() };
    let big = Function::new("big", |_c| Ok(Output::from(random_tensor(DType::UInt8, &[64 << 20], 1)?)));
    let (server, _dir) = start(Server::builder().config(cfg).function(big), "unix").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..4 {
        ids.push(client.submit("big", vec![], Args::new()).await.unwrap());
    }
    let mut done = 0;
    let mut refused = 0;
    for id in &ids {
        match client.task_result(id, Duration::from_secs(30)).await {
            Ok(out) => {
                assert_eq!(out.tensors[0].nbytes(), 64 << 20);
                done += 1;
            }
            Err(e) => {
                assert_eq!(remote_code(&e), Code::ResourceExhausted, "{e}");
                assert!(e.to_string().contains("task result"), "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((done, refused), (3, 1), "three 64 MiB results fit a 200 MiB budget, the fourth does not");
    let info = client.service_info().await.unwrap();
    assert!(info.memory_used <= info.memory_limit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_lru_store_makes_room_and_a_refusing_store_says_why() {
    let cfg = ServerConfig { max_memory_bytes: 100 << 20, ..Default::default() };
    let store = StoreService::with_policy(1 << 40, tensorwire::EvictPolicy::Lru);
    let (server, _dir) = start(Server::builder().config(cfg).service(store), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    for i in 0..4 {
        let t = random_tensor(DType::UInt8, &[40 << 20], i).unwrap().with_name(format!("t{i}"));
        client.send(vec![t]).await.unwrap();
    }
    // The budget holds two 40 MiB tensors: the oldest were evicted to make room.
    let e = client.fetch_one("t0").await.unwrap_err();
    assert_eq!(remote_code(&e), Code::NotFound);
    assert!(e.to_string().contains("\"t0\"") && e.to_string().contains("tensors)"), "{e}");
    assert!(!e.to_string().contains("t3"), "the error does not list what is stored: {e}");
    assert_eq!(client.fetch_one("t3").await.unwrap().nbytes(), 40 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_are_limited_per_peer() {
    let cfg = ServerConfig { auth_token: Some("s3cret".into()), max_auth_failures: 3, ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "tcp").await;
    let url = server.url();
    let with =
        |token: &str| ClientConfig { auth_token: Some(token.into()), retry: RetryPolicy::None, ..Default::default() };
    for _ in 0..3 {
        let e = Client::connect_with(&url, with("guess")).await.unwrap_err();
        assert!(e.to_string().contains("wrong auth token"), "{e}");
    }
    let e = Client::connect_with(&url, with("s3cret")).await.unwrap_err();
    assert!(e.to_string().contains("too many wrong auth tokens"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_silent_connections_are_reclaimed() {
    let transport = TransportConfig {
        keepalive_interval: Some(Duration::from_millis(100)),
        idle_timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    let cfg = ServerConfig { transport: transport.clone(), ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "tcp").await;
    let url = server.url();
    // A handshaken client with no call open is closed after the idle timeout,
    // and its next call reconnects.
    let client = Client::connect(&url).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(client.health().await.unwrap());
    assert_eq!(client.statistics().reconnects, 1, "the idle connection was closed and the client reconnected");
    // A peer that sends the mux preface and then nothing (answers no PING)
    // is closed: its socket reaches end of file.
    let addr = tensorwire_transports::Endpoint::parse(&url).unwrap().authority();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut pre = bytes::BytesMut::new();
    tensorwire_transports::mux::frame::Preface { version: 1, stream_window: 1 << 20, max_frame_payload: 1 << 20 }
        .encode(&mut pre);
    tokio::io::AsyncWriteExt::write_all(&mut s, &pre).await.unwrap();
    assert!(closed_by_server(&mut s).await, "the silent connection was closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_capped_and_idle_ones_make_room() {
    let cfg = ServerConfig { max_connections: 64, max_connections_per_peer: 2, ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "tcp").await;
    let url = server.url();
    // Two clients each hold a call open (an exchange whose input never ends).
    let mut busy = Vec::new();
    for _ in 0..2 {
        let c = Client::connect(&url).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel::<tensorwire::Tensor>(1);
        let stream = c.exchange(tokio_stream_from(rx)).await.unwrap();
        busy.push((c, tx, stream));
    }
    // Both calls are open on the server (else a connection counts as idle).
    wait_until(Duration::from_secs(10), || server.info().active_calls >= 2).await;
    let cfg = ClientConfig { retry: RetryPolicy::None, ..Default::default() };
    let e = Client::connect_with(&url, cfg.clone()).await.unwrap_err();
    assert!(e.to_string().contains("too many connections"), "{e}");
    // Once they are gone, their slots are free again. (Their connections
    // close in the background: until the server has seen that, a new
    // client is still refused.)
    drop(busy);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let idle = loop {
        match Client::connect_with(&url, cfg.clone()).await {
            Ok(c) => break c,
            Err(e) if e.to_string().contains("too many connections") && std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => panic!("the dropped clients' slots were not freed: {e}"),
        }
    };
    assert!(idle.health().await.unwrap());
    let other = Client::connect(&url).await.unwrap();
    assert!(other.health().await.unwrap());
    // At the cap again: the oldest idle connection makes room.
    let third = Client::connect_with(&url, cfg).await.unwrap();
    assert!(third.health().await.unwrap());
}

/// A stream of what a channel receives.
fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<tensorwire::Tensor>,
) -> impl futures_util::Stream<Item = tensorwire::Tensor> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_client_that_sends_no_preface_is_closed() {
    let transport = TransportConfig { connect_timeout: Duration::from_millis(300), ..Default::default() };
    let cfg = ServerConfig { transport, ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "grpc").await;
    let addr = tensorwire_transports::Endpoint::parse(&server.url()).unwrap().authority();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    assert!(closed_by_server(&mut s).await, "the server closed the connection that sent no HTTP/2 preface");
    let client = Client::connect(&server.url()).await.unwrap();
    assert!(client.health().await.unwrap());
}

/// Graceful shutdown lets a transfer in flight finish, on every transport
/// (finding 5: QUIC closed it at once and its client retried for 30 s).
async fn shutdown_drains_a_fetch_in_flight(scheme: &str) {
    let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
    let url = server.url();
    let client = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[192 << 20], 5).unwrap().with_name("big");
    client.send(vec![t.clone()]).await.unwrap();
    let c = client.clone();
    let fetch = tokio::spawn(async move { c.fetch_one("big").await });
    // Shut down once the server has the fetch in hand (a call that has not
    // reached it yet is refused, not drained: that is another test).
    wait_until(Duration::from_secs(10), || server.info().active_calls > 0).await;
    // ...and has begun answering it (QUIC: see the notes on issue 17; a
    // shutdown in the first instants of a call is not drained there yet).
    tokio::time::sleep(Duration::from_millis(30)).await;
    let started = std::time::Instant::now();
    server.shutdown().await;
    let back = fetch.await.unwrap().expect("the fetch in flight finishes during a graceful shutdown");
    assert!(back.data_eq(&t));
    // Not a timing assertion on speed: a shutdown that closed the transfer
    // would have made the client retry for many seconds.
    assert!(started.elapsed() < Duration::from_secs(20), "shutdown took {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_shutdown_drains_a_fetch_in_flight() {
    shutdown_drains_a_fetch_in_flight("quic").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_shutdown_drains_a_fetch_in_flight() {
    shutdown_drains_a_fetch_in_flight("tcp").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_shutdown_drains_a_fetch_in_flight() {
    shutdown_drains_a_fetch_in_flight("grpc").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sockets_say_who_may_connect() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mode.sock");
    // A path socket is owner-only unless the URL says otherwise.
    let s = store_server(ServerConfig::default()).build().start([format!("unix://{}", path.display())]).await.unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    s.shutdown().await;
    let url = format!("unix://{}?mode=0660", path.display());
    let s = store_server(ServerConfig::default()).build().start([url]).await.unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o660);
    s.shutdown().await;
    // An abstract socket checks the peer's user id: ours is allowed by default,
    // refused when the listener allows only another user.
    let name = format!("tw-uid-{}", std::process::id());
    let s = store_server(ServerConfig::default()).build().start([format!("unix://@{name}")]).await.unwrap();
    assert!(Client::connect(&format!("unix://@{name}")).await.unwrap().health().await.unwrap());
    s.shutdown().await;
    let other = unsafe { libc::geteuid() } + 4242;
    let s = store_server(ServerConfig::default())
        .build()
        .start([format!("unix://@{name}?allow_uid={other}")])
        .await
        .unwrap();
    let cfg = ClientConfig { retry: RetryPolicy::None, ..Default::default() };
    assert!(Client::connect_with(&format!("unix://@{name}"), cfg).await.is_err());
    s.shutdown().await;
}
