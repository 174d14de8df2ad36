//! Faults on the wire, injected by a relay between client and server
//! (tests/common/proxy.rs): a corrupted byte, a truncated or reset
//! connection, a stalled one, a slow one. Whatever happens, no partial or
//! corrupted tensor is delivered or stored as whole, the error is clear,
//! and the next call works.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::proxy::{Dir, Fault, Proxy};
use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{CallError, Client, ClientConfig, Code, DType, FetchRequest, RetryPolicy, ServerConfig, Tensor};

const MIB: u64 = 1 << 20;

async fn setup(fault: Fault, dir: Dir) -> (tensorwire::RunningServer, Proxy, Tensor) {
    let (server, _dir) = start(store_server(ServerConfig::default()), "tcp").await;
    let upstream: SocketAddr =
        tensorwire_transports::Endpoint::parse(&server.url()).unwrap().authority().parse().unwrap();
    let proxy = Proxy::start(upstream, fault, dir).await;
    let t = random_tensor(DType::Float32, &[4 << 20], 11).unwrap().with_name("w");
    (server, proxy, t)
}

fn no_retry() -> ClientConfig {
    ClientConfig { retry: RetryPolicy::None, ..Default::default() }
}

/// The server holds no tensor named `name` (nothing partial was stored).
async fn not_stored(server_url: &str, name: &str) {
    let direct = Client::connect(server_url).await.unwrap();
    let e = direct.fetch_one(name).await.unwrap_err();
    assert_eq!(e.status().map(|s| s.code), Some(Code::NotFound), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_byte_in_a_send_fails_the_call_and_stores_nothing() {
    let (server, proxy, t) = setup(Fault::Corrupt(5 * MIB + 777), Dir::Up).await;
    let c = Client::connect_with(&proxy.url(), no_retry()).await.unwrap();
    let e = c.send(vec![t.clone()]).await.unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("corrupt") || msg.contains("CRC") || msg.contains("checksum"), "{msg}");
    not_stored(&server.url(), "w").await;
    // The next call (a new connection, no fault) goes through whole.
    let c = Client::connect(&proxy.url()).await.unwrap();
    c.send(vec![t.clone()]).await.unwrap();
    assert!(c.fetch_one("w").await.unwrap().data_eq(&t));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_byte_in_a_fetch_is_never_a_wrong_tensor() {
    let (server, proxy, t) = setup(Fault::Corrupt(5 * MIB + 777), Dir::Down).await;
    Client::connect(&server.url()).await.unwrap().send(vec![t.clone()]).await.unwrap();
    let c = Client::connect_with(&proxy.url(), no_retry()).await.unwrap();
    match c.fetch_one("w").await {
        Err(e) => {
            let msg = e.to_string();
            assert!(matches!(e, CallError::Decode(_)) && msg.contains("checksum"), "{msg}");
        }
        Ok(back) => panic!("a corrupted transfer was delivered (equal to the original: {})", back.data_eq(&t)),
    }
    assert!(c.fetch_one("w").await.unwrap().data_eq(&t), "the connection survives a corrupt chunk");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_or_reset_send_stores_nothing_and_the_next_call_works() {
    for fault in [Fault::Truncate(3 * MIB), Fault::Reset(3 * MIB)] {
        let (server, proxy, t) = setup(fault, Dir::Up).await;
        let c = Client::connect_with(&proxy.url(), no_retry()).await.unwrap();
        let e = c.send(vec![t.clone()]).await.unwrap_err();
        assert!(matches!(e.code(), Code::Unavailable | Code::Cancelled | Code::Protocol), "{fault:?}: {e}");
        // The server sees the cut only once its read fails; what it holds
        // must never be the partial tensor.
        tokio::time::sleep(Duration::from_millis(100)).await;
        not_stored(&server.url(), "w").await;
        let c = Client::connect(&proxy.url()).await.unwrap();
        c.send(vec![t.clone()]).await.unwrap();
        assert!(c.fetch_one("w").await.unwrap().data_eq(&t), "{fault:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_cut_mid_way_is_retried_whole_or_fails_clearly() {
    for fault in [Fault::Truncate(3 * MIB), Fault::Reset(3 * MIB)] {
        let (server, proxy, t) = setup(fault, Dir::Down).await;
        Client::connect(&server.url()).await.unwrap().send(vec![t.clone()]).await.unwrap();
        // Fetching is idempotent: the client retries on a new connection.
        let c = Client::connect(&proxy.url()).await.unwrap();
        let back = c.fetch_one("w").await.unwrap();
        assert!(back.data_eq(&t), "{fault:?}");
        assert!(c.statistics().retries >= 1, "{fault:?}: the cut call was retried");
        // Without retries the cut is a clear connection error.
        let (server, proxy, t) = setup(fault, Dir::Down).await;
        Client::connect(&server.url()).await.unwrap().send(vec![t]).await.unwrap();
        let c = Client::connect_with(&proxy.url(), no_retry()).await.unwrap();
        let e = c.fetch_one("w").await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{fault:?}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_connection_times_out_and_a_slow_one_delivers_exactly() {
    let (server, proxy, t) = setup(Fault::Stall(2 * MIB), Dir::Down).await;
    Client::connect(&server.url()).await.unwrap().send(vec![t.clone()]).await.unwrap();
    let cfg = ClientConfig { timeout: Some(Duration::from_millis(500)), ..no_retry() };
    let c = Client::connect_with(&proxy.url(), cfg.clone()).await.unwrap();
    let e = c.fetch_one("w").await.unwrap_err();
    assert!(matches!(e, CallError::Timeout(_)), "{e}");
    // So do the calls outside the retry loop: into the caller's buffer,
    // and as a stream.
    let mut dst = vec![0u8; t.nbytes()];
    let e = c.fetch_into_bytes(FetchRequest::name("w"), &mut dst, None).await.unwrap_err();
    assert!(matches!(e, CallError::Timeout(_)), "fetch_into: {e}");
    let (server, proxy, t) = setup(Fault::Stall(2 * MIB), Dir::Up).await;
    let c = Client::connect_with(&proxy.url(), cfg.clone()).await.unwrap();
    let e = c.send_stream(futures_util::stream::iter(vec![t.clone()])).await.unwrap_err();
    // (The server, told the deadline, may say so first.)
    assert!(matches!(e, CallError::Timeout(_)) || e.code() == Code::DeadlineExceeded, "send_stream: {e}");
    drop(server);
    let (server, proxy, t) = setup(Fault::Delay(Duration::from_millis(2)), Dir::Down).await;
    Client::connect(&server.url()).await.unwrap().send(vec![t.clone()]).await.unwrap();
    let c = Client::connect(&proxy.url()).await.unwrap();
    assert!(c.fetch_one("w").await.unwrap().data_eq(&t));
}
