//! `ucx://` beyond the shared pipeline suite: payloads really travel
//! through UCX, a peer SIGKILLed mid-rendezvous (either side) leaves a
//! clear error and nothing behind, frames that lie about UCX payloads are
//! refused without a hang, and a missing libucx or an unreachable peer are
//! clear errors, bad preambles are refused. tests/run.sh runs this file
//! with UCX_TLS=tcp, UCX_TLS=sm,self and UCX's default (all).
#![cfg(feature = "ucx")]

mod common;

use std::io::BufRead;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{Client, ClientConfig, Compression, CompressionMode, DType, Encoding, ServerConfig, Tensor};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{
    self as transports, Connection, Frame, FrameHeader, Payload, Placement, RecvBuf, StreamKind, TransportConfig, ucx,
};

/// Makes `child_process_client` send to this URL.
const CHILD_URL: &str = "TENSORWIRE_TEST_UCX_CHILD_URL";
/// Makes `child_process_server` serve a 256 MiB tensor.
const CHILD_SERVER: &str = "TENSORWIRE_TEST_UCX_CHILD_SERVER";
/// Makes `child_without_libucx` try to connect.
const CHILD_NO_LIB: &str = "TENSORWIRE_TEST_UCX_CHILD_NO_LIB";

const BIG: usize = 256 << 20;

/// A client connection and the server's end of it, over ucx:// on loopback.
async fn connected(cfg: &TransportConfig) -> (Arc<dyn Connection>, Arc<dyn Connection>) {
    let ep = transports::Endpoint::parse("ucx://127.0.0.1:0").unwrap();
    let mut listener = transports::listen(&ep, cfg).await.unwrap();
    let url = listener.local_endpoint();
    let (client, server) = tokio::join!(transports::connect(&url, cfg), listener.accept());
    (client.unwrap(), server.unwrap())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// What the open descriptors are (for failure messages).
fn fd_listing() -> Vec<std::path::PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).collect())
        .unwrap_or_default()
}

/// Waits up to 10 s for `f` to hold.
async fn eventually(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..200 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f()
}

/// A 4 MiB tensor in one chunk (its payload goes by tag) arrives intact
/// from `client` to `server`.
async fn still_carries_a_tensor(client: &Arc<dyn Connection>, server: &Arc<dyn Connection>) {
    let payload = vec![9u8; 4 << 20];
    let c = v1::Chunk {
        tensor_id: 1,
        raw_len: payload.len() as u64,
        total_bytes: payload.len() as u64,
        last: true,
        compression: v1::Compression::None as i32,
        ..Default::default()
    };
    let frame = Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: payload.clone().into() };
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    let send = tokio::spawn(async move { tx.send_batch(vec![frame], true).await });
    let mut inc = server.accept().await.unwrap();
    let r = inc.recv.recv().await.unwrap().expect("a chunk");
    assert!(matches!(r.payload, Payload::Bytes(ref b) if b[..] == payload[..]));
    send.await.unwrap().unwrap();
}

fn child(test: &str, var: &str, value: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"]).env(var, value);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_travel_through_ucx_bit_exact() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "ucx").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let before = ucx::stats();
    let t = random_tensor(DType::Float32, &[16, 1 << 20], 7).unwrap().with_name("big");
    client.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &client.fetch_one("big").await.unwrap());
    let after = ucx::stats();
    // Both directions of 64 MiB went through UCX (client and server share
    // this process, so each byte counts once sent and once received). With
    // shared-memory transports only, all but the first chunk of each
    // direction went by put into memory the receiver granted.
    assert!(after.bytes_received >= before.bytes_received + 2 * (64 << 20), "{before:?} -> {after:?}");
    assert!(after.bytes_sent >= before.bytes_sent + 2 * (64 << 20), "{before:?} -> {after:?}");
    if ucx::ucx_puts(true).unwrap() {
        assert_eq!(after.grants, before.grants + 2, "{before:?} -> {after:?}");
        assert!(after.bytes_put >= before.bytes_put + 2 * (32 << 20), "{before:?} -> {after:?}");
    } else {
        assert_eq!((after.grants, after.bytes_put), (before.grants, before.bytes_put));
    }
    // Small tensors travel inside frames, and frames through UCX's stream
    // (not the TCP control socket).
    let small = random_tensor(DType::UInt8, &[1000], 1).unwrap().with_name("small");
    let b = ucx::stats();
    client.send(vec![small.clone()]).await.unwrap();
    assert_same(&small, &client.fetch_one("small").await.unwrap());
    let a = ucx::stats();
    assert_eq!(a.bytes_received, b.bytes_received);
    assert!(a.frame_bytes_received >= b.frame_bytes_received + 2 * 1000, "{b:?} -> {a:?}");
    assert!(a.frame_bytes_sent >= b.frame_bytes_sent + 2 * 1000, "{b:?} -> {a:?}");
}

/// Run as a child process: sends 256 MiB tensors until killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_client() {
    let Ok(url) = std::env::var(CHILD_URL) else { return };
    let client = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[BIG], 1).unwrap();
    loop {
        client.send(vec![t.clone()]).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_killed_mid_rendezvous_leaves_nothing_behind() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "ucx").await;
    let url = server.url();
    // A first client warms up what the server keeps for its lifetime.
    let warm = Client::connect(&url).await.unwrap();
    warm.send(vec![random_tensor(DType::UInt8, &[1 << 20], 1).unwrap()]).await.unwrap();
    drop(warm);
    assert!(eventually(|| ucx::stats().workers == 0).await, "{:?}", ucx::stats());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let fds_before = open_fds();

    let mut kid = child("child_process_client", CHILD_URL, &url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it while a 256 MiB tensor is half through UCX (by tag or put:
    // the server counts what arrived either way).
    let start = server.info().bytes_received;
    let moving = eventually(|| server.info().bytes_received > start + (BIG as u64) / 2).await;
    kid.kill().unwrap();
    kid.wait().unwrap();
    assert!(moving, "the child sent nothing through UCX: {:?}", ucx::stats());
    assert!(ucx::stats().grants > 0 || !ucx::ucx_puts(true).unwrap(), "no puts: {:?}", ucx::stats());

    // The server side of the dead connection is released: no UCX operation
    // holds a buffer, its worker is gone, descriptors are back.
    assert!(
        eventually(|| ucx::stats().operations_outstanding == 0
            && ucx::stats().workers == 0
            && ucx::stats().operations_abandoned == 0)
        .await,
        "UCX state left after the peer died: {:?}",
        ucx::stats()
    );
    assert!(
        eventually(|| open_fds() <= fds_before).await,
        "descriptors left: {} > {fds_before}: {:?}",
        open_fds(),
        fd_listing()
    );
    // And the server serves the next client.
    let c = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[8 << 20], 3).unwrap().with_name("after");
    c.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &c.fetch_one("after").await.unwrap());
}

/// Run as a child process: serves a 256 MiB tensor named "big", prints its URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_server() {
    if std::env::var(CHILD_SERVER).is_err() {
        return;
    }
    let (server, _dir) = start(store_server(ServerConfig::default()), "ucx").await;
    let c = Client::connect(&server.url()).await.unwrap();
    c.send(vec![random_tensor(DType::UInt8, &[BIG], 2).unwrap().with_name("big")]).await.unwrap();
    println!("\nURL {}", server.url());
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_fetch_fails_the_fetch_clearly() {
    let mut kid = child("child_process_server", CHILD_SERVER, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let out = kid.stdout.take().unwrap();
    let url = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.split_once("URL ").map(|(_, u)| u.trim().to_string()))
    })
    .await
    .unwrap()
    .expect("the child prints its URL");
    let client = Client::connect(&url).await.unwrap();
    let fetching = tokio::spawn(async move {
        loop {
            if let Err(e) = client.fetch_one("big").await {
                return e;
            }
        }
    });
    let start = ucx::stats().bytes_received;
    let moving = eventually(|| ucx::stats().bytes_received > start + (BIG as u64) / 2).await;
    kid.kill().unwrap();
    kid.wait().unwrap();
    assert!(moving, "nothing arrived through UCX");
    let err = tokio::time::timeout(Duration::from_secs(20), fetching).await.expect("an error, not a hang").unwrap();
    let text = err.to_string();
    // The call fails (or its automatic retry finds nobody listening).
    assert!(["closed", "UCX", "reset", "refused"].iter().any(|w| text.contains(w)), "unclear error: {text}");
    assert!(
        eventually(|| ucx::stats().operations_outstanding == 0
            && ucx::stats().workers == 0
            && ucx::stats().operations_abandoned == 0)
        .await,
        "UCX state left after the server died: {:?}",
        ucx::stats()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_that_lie_about_ucx_payloads_are_refused_without_a_hang() {
    let mut cfg = TransportConfig::default();
    cfg.ucx.rendezvous_timeout = Duration::from_secs(1);
    cfg.max_frame_payload = 4 << 20;
    let (client, server) = connected(&cfg).await;

    let chunk = |ucx_tag: u64, raw_len: u64, payload: Vec<u8>| {
        let c = v1::Chunk {
            tensor_id: 1,
            total_bytes: raw_len,
            raw_len,
            last: true,
            ucx_tag,
            compression: v1::Compression::None as i32,
            ..Default::default()
        };
        Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: payload.into() }
    };
    let next_error = async || {
        let mut inc = server.accept().await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), inc.recv.recv()).await.expect("an error, not a hang");
        match got {
            Err(e) => e.to_string(),
            Ok(r) => panic!("a lying frame was accepted: {:?}", r.map(|r| r.header)),
        }
    };

    // A tag the peer never sends: the receive gives up after the timeout.
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    tx.send_batch(vec![chunk(999, 100, Vec::new())], true).await.unwrap();
    let e = next_error().await;
    assert!(e.contains("not completed within"), "{e}");
    // ... and lets go of it: nothing stays posted with UCX.
    assert!(
        eventually(|| ucx::stats().operations_outstanding == 0).await,
        "the timed-out receive is still posted: {:?}",
        ucx::stats()
    );

    // A payload declared larger than this side accepts.
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    tx.send_batch(vec![chunk(7, 1 << 30, Vec::new())], true).await.unwrap();
    let e = next_error().await;
    assert!(e.contains("exceeds the limit"), "{e}");

    // A frame declaring 100 bytes for a tag whose message has 1 MiB (the
    // next tag this client's UCX sends use): UCX refuses to write past the
    // posted buffer.
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    tx.send_batch(vec![chunk(1, 100, Vec::new())], true).await.unwrap();
    let mut inc = server.accept().await.unwrap();
    let lying = tokio::spawn(async move { inc.recv.recv().await.map(|r| r.map(|r| r.header)) });
    let (mut tx2, _rx2) = client.open(StreamKind::Send).await.unwrap();
    let _ = tx2.send(chunk(0, 1 << 20, vec![7u8; 1 << 20])).await;
    let got = tokio::time::timeout(Duration::from_secs(10), lying).await.expect("an error, not a hang").unwrap();
    let e = got.expect_err("a frame lying about its UCX payload's size was accepted").to_string();
    // UCX refuses the longer message ("Message truncated"); where its
    // rendezvous instead waits for a buffer that fits, the receive times out.
    assert!(e.to_lowercase().contains("truncated") || e.contains("not completed within"), "{e}");

    // (The stream whose message the lying frame consumed.)
    drop(server.accept().await.unwrap());

    // A tag in the range this side's grant answers use.
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    tx.send_batch(vec![chunk((1 << 63) | 5, 100, Vec::new())], true).await.unwrap();
    let e = next_error().await;
    assert!(e.contains("grant answers"), "{e}");

    // A frame that carries a payload and a tag at once.
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    tx.send_batch(vec![chunk(5, 3, vec![1, 2, 3])], true).await.unwrap();
    let e = next_error().await;
    assert!(e.contains("carry no payload"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_preambles_are_refused_and_the_next_client_is_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (server, _dir) = start(store_server(ServerConfig::default()), "ucx").await;
    let authority = server.url().trim_start_matches("ucx://").to_string();
    let mut huge_token = b"TWUCX\x04\0\0".to_vec();
    huge_token.extend_from_slice(&u16::MAX.to_le_bytes());
    let mut zero_address = b"TWUCX\x04\0\0\x01\0x".to_vec();
    zero_address.extend_from_slice(&0u32.to_le_bytes());
    let previous_version = b"TWUCX\x03\0\0\x10\0\0\0".to_vec();
    let older_version = b"TWUCX\x02\0\0\x10\0\0\0".to_vec();
    let first_version = b"TWUCX\x01\0\0\x10\0\0\0".to_vec();
    for bad in
        [previous_version, older_version, first_version, huge_token, zero_address, b"GET / HTTP/1.1\r\n\r\n".to_vec()]
    {
        let mut s = tokio::net::TcpStream::connect(&authority).await.unwrap();
        s.write_all(&bad).await.unwrap();
        // The server hangs up (after its own hello at most), never waits.
        let mut seen = Vec::new();
        let end = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut seen)).await;
        assert!(end.is_ok(), "the server kept a connection that sent {bad:?}");
        assert!(!seen.starts_with(b"TWUCX") || seen.starts_with(b"TWUCX\x04"), "{seen:?}");
    }
    let client = Client::connect(&server.url()).await.unwrap();
    let t = random_tensor(DType::UInt8, &[1 << 20], 3).unwrap().with_name("after");
    client.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &client.fetch_one("after").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_peer_is_a_clear_error() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e = Client::connect(&format!("ucx://127.0.0.1:{port}")).await.unwrap_err().to_string();
    assert!(e.contains("refused") && e.contains("ucx://127.0.0.1"), "{e}");
}

/// Run as a child process with libucx out of reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_without_libucx() {
    if std::env::var(CHILD_NO_LIB).is_err() {
        return;
    }
    let e = Client::connect("ucx://127.0.0.1:1").await.unwrap_err().to_string();
    assert!(e.contains("cannot load") && e.contains("libucs.so.0") && e.contains("apt-get install libucx0"), "{e}");
    let e = tensorwire::Server::builder()
        .build()
        .start(["ucx://127.0.0.1:0"])
        .await
        .err()
        .expect("no server without libucx")
        .to_string();
    assert!(e.contains("cannot load"), "{e}");
}

#[test]
fn a_missing_libucx_is_a_clear_error_at_run_time() {
    let out =
        child("child_without_libucx", CHILD_NO_LIB, "1").env("TENSORWIRE_UCX_LIBDIR", "/nonexistent").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}

/// What this process's UCX reports: the memory types it moves (host always;
/// device types only in a CUDA/ROCm build) and the transports `ucx://`
/// uses for a peer on this host (UCX_TLS as given, or `sm,self` reduced to
/// what can detect dead peers when it is unset).
#[test]
fn ucx_reports_memory_types_and_same_host_transports() {
    let types = ucx::ucx_memory_types().unwrap();
    assert!(types.contains(&"host"), "{types:?}");
    assert!(types.iter().all(|t| ["host", "cuda", "cuda-managed", "rocm", "rocm-managed"].contains(t)));
    let tls = ucx::ucx_transports(true).unwrap();
    match std::env::var("UCX_TLS").ok().filter(|t| t != "all") {
        Some(t) if !ucx::ucx_peer_failure_detection().unwrap() => {
            assert!(!tls.contains("cma"), "{tls} for UCX_TLS={t}")
        }
        Some(t) => assert_eq!(tls, t),
        // sm,self as it is where UCX detects dead peers over shared
        // memory; without cma where it cannot (UCX 1.13).
        None => assert!(tls == "sm,self" || tls == "sysv,posix,self", "{tls}"),
    }
}

/// A close travels as frames through UCX's stream, then the byte count on
/// the control socket: the peer learns why (not just that the socket
/// went), and both workers and every descriptor are gone afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_reaches_the_peer_with_its_reason_and_releases_the_workers() {
    let cfg = TransportConfig::default();
    let ep = transports::Endpoint::parse("ucx://127.0.0.1:0").unwrap();
    let mut listener = transports::listen(&ep, &cfg).await.unwrap();
    let url = listener.local_endpoint();
    // A first connection creates UCX's process-wide contexts (and their
    // descriptors): count from after it.
    let (client, server) = tokio::join!(transports::connect(&url, &cfg), listener.accept());
    drop((client.unwrap(), server.unwrap()));
    assert!(eventually(|| ucx::stats().workers == 0).await, "{:?}", ucx::stats());
    let (fds, workers) = (open_fds(), ucx::stats().workers);
    let (client, server) = tokio::join!(transports::connect(&url, &cfg), listener.accept());
    let (client, server) = (client.unwrap(), server.unwrap());
    assert_eq!(ucx::stats().workers, workers + 2);

    // A frame gets through, then the client closes with a reason.
    let (mut tx, rx) = client.open(StreamKind::Send).await.unwrap();
    let hello = Frame { header: FrameHeader::new(Kind::Chunk(v1::Chunk::default())), payload: vec![9u8; 100].into() };
    tx.send_batch(vec![hello], true).await.unwrap();
    let mut inc = server.accept().await.unwrap();
    let got = inc.recv.recv().await.unwrap().expect("the frame");
    assert_eq!(got.payload.len(), 100);
    client.close("the client is done");
    let e = match tokio::time::timeout(Duration::from_secs(10), server.accept()).await {
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(_)) => panic!("a stream after the close"),
        Err(_) => panic!("the close did not arrive"),
    };
    assert!(e.contains("the client is done"), "{e}");

    drop((tx, rx, inc, client, server));
    assert!(eventually(|| ucx::stats().workers == workers).await, "{:?}", ucx::stats());
    assert!(eventually(|| open_fds() <= fds).await, "{} descriptors, {fds} before: {:?}", open_fds(), fd_listing());
}

/// A receiver that goes away mid-tensor leaves nothing pending at the
/// sender while the connection lives on: chunk payloads announced after it
/// left are received into scratch memory and dropped (the connection's
/// discard hook), so the sender's UCX sends complete, and the connection
/// keeps serving other streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receiver_leaves_no_send_pending_on_a_live_connection() {
    let mut cfg = TransportConfig::default();
    cfg.ucx.rendezvous_timeout = Duration::from_secs(5);
    let (client, server) = connected(&cfg).await;
    const PART: usize = 1 << 20;
    const PARTS: usize = 24;
    for round in 0..3 {
        let frames: Vec<Frame> = (0..PARTS)
            .map(|i| {
                let c = v1::Chunk {
                    tensor_id: 1,
                    index: i as u32,
                    offset: (i * PART) as u64,
                    total_bytes: (PARTS * PART) as u64,
                    raw_len: PART as u64,
                    last: i + 1 == PARTS,
                    compression: v1::Compression::None as i32,
                    ..Default::default()
                };
                Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: vec![round as u8 + 1; PART].into() }
            })
            .collect();
        let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
        let send = tokio::spawn(async move { tx.send_batch(frames, true).await });
        let mut inc = server.accept().await.unwrap();
        let first = inc.recv.recv().await.unwrap().expect("the first chunk");
        assert!(matches!(first.payload, Payload::Bytes(ref b) if b.len() == PART && b[0] == round as u8 + 1));
        // The receiver leaves with most of the tensor still on its way.
        drop(inc);
        // It may have handed everything to UCX before the STOP came back
        // (then it finished) or not (then it failed): either way it returns.
        tokio::time::timeout(Duration::from_secs(20), send).await.expect("the sender returns").unwrap().ok();
        assert!(
            eventually(|| ucx::stats().operations_outstanding == 0).await,
            "round {round}: UCX operations left pending: {:?}",
            ucx::stats()
        );
    }
    // A sender that goes on after the STOP came back: its frames are
    // refused, and their payloads never reach UCX (nothing waits for a
    // receive that cannot come).
    let chunk = |index: usize| {
        let c = v1::Chunk {
            tensor_id: 1,
            index: index as u32,
            offset: (index * PART) as u64,
            total_bytes: (8 * PART) as u64,
            raw_len: PART as u64,
            last: index == 7,
            compression: v1::Compression::None as i32,
            ..Default::default()
        };
        Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: vec![7u8; PART].into() }
    };
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    tx.send_batch(vec![chunk(0)], false).await.unwrap();
    let mut inc = server.accept().await.unwrap();
    assert!(inc.recv.recv().await.unwrap().is_some());
    drop(inc);
    tokio::time::timeout(Duration::from_secs(10), tx.stopped()).await.expect("the STOP arrives");
    let before = ucx::stats();
    let late = tx.send_batch((1..8).map(chunk).collect(), true).await;
    assert!(late.is_err(), "frames sent after the STOP");
    assert!(
        eventually(|| ucx::stats().operations_outstanding == 0).await,
        "sends left pending after a refused batch: {:?}",
        ucx::stats()
    );
    assert_eq!(ucx::stats().payloads_discarded, before.payloads_discarded, "nothing reached the receiver");
    drop(tx);

    // The connection still carries tensors.
    still_carries_a_tensor(&client, &server).await;
}

/// Payloads a peer announces for a stream nobody reads and never sends are
/// given up after the rendezvous timeout: the scratch receives (or the
/// receives posted while reading ahead) are cancelled and their buffers
/// freed, and the connection carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_announced_for_a_dropped_receiver_and_never_sent_are_given_up() {
    let mut cfg = TransportConfig::default();
    // Long enough for the posted receives to be seen before they go.
    cfg.ucx.rendezvous_timeout = Duration::from_secs(3);
    let (client, server) = connected(&cfg).await;
    let chunk = |index: u32, ucx_tag: u64, payload: Vec<u8>| {
        let raw_len = if ucx_tag == 0 { payload.len() as u64 } else { 1 << 20 };
        let c = v1::Chunk {
            tensor_id: 1,
            index,
            offset: u64::from(index) << 20,
            total_bytes: 4 << 20,
            raw_len,
            last: index == 3,
            ucx_tag,
            compression: v1::Compression::None as i32,
            ..Default::default()
        };
        Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: payload.into() }
    };
    for round in 0..2u64 {
        // The first chunk comes in the frame (too small to go by tag);
        // three more are announced by tags this peer never sends.
        let frames = vec![
            chunk(0, 0, vec![1u8; 1 << 10]),
            chunk(1, 9000 + 10 * round, Vec::new()),
            chunk(2, 9001 + 10 * round, Vec::new()),
            chunk(3, 9002 + 10 * round, Vec::new()),
        ];
        let before = ucx::stats().payloads_discarded;
        let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
        tx.send_batch(frames, true).await.unwrap();
        let mut inc = server.accept().await.unwrap();
        let first = inc.recv.recv().await.unwrap().expect("the first chunk");
        assert!(matches!(first.payload, Payload::Bytes(ref b) if b.len() == 1 << 10));
        drop(inc);
        // The three announced payloads get scratch receives, posted ...
        assert!(
            eventually(|| ucx::stats().payloads_discarded == before + 3 && ucx::stats().operations_outstanding >= 3)
                .await,
            "round {round}: no scratch receives: {:?}",
            ucx::stats()
        );
        // ... which are cancelled once the timeout has passed.
        assert!(
            eventually(|| ucx::stats().operations_outstanding == 0).await,
            "round {round}: receives of payloads that never came are still posted: {:?}",
            ucx::stats()
        );
    }
    // A reader that gives up waiting for such a payload (its `recv` future
    // dropped, as a call's timeout does) leaves nothing posted either.
    let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
    tx.send_batch(vec![chunk(1, 9100, Vec::new())], true).await.unwrap();
    let mut inc = server.accept().await.unwrap();
    let gave_up = tokio::time::timeout(Duration::from_millis(300), inc.recv.recv()).await;
    assert!(gave_up.is_err(), "a payload that was never sent arrived");
    assert!(
        eventually(|| ucx::stats().operations_outstanding == 0).await,
        "the abandoned receive is still posted: {:?}",
        ucx::stats()
    );
    drop(inc);

    // The connection still carries a tensor whose payload goes by tag.
    still_carries_a_tensor(&client, &server).await;
}

/// Puts land only in memory the receiver granted: a frame claiming a put
/// without a grant, or outside the granted tensor, is refused; an ask the
/// reader does not answer by placing the tensor is refused and the rest of
/// the tensor comes by tag; a granted tensor arrives bit-exact in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_land_only_in_granted_memory() {
    // Over UCX's tcp, puts would be emulated in software: tensors keep the
    // tagged rendezvous (and the receiver never grants).
    let puts = ucx::ucx_puts(true).unwrap();
    let mut cfg = TransportConfig::default();
    cfg.ucx.rendezvous_timeout = Duration::from_secs(5);
    cfg.ucx.min_put_bytes = 4 << 20;
    let (client, server) = connected(&cfg).await;
    const TOTAL: usize = 8 << 20;
    const PART: usize = 1 << 20;
    let data: Vec<u8> = (0..TOTAL).map(|i| (i * 7 % 251) as u8).collect();
    let chunk = |index: u32, offset: usize, raw_len: usize, put: bool, payload: &[u8]| {
        let c = v1::Chunk {
            tensor_id: 1,
            index,
            offset: offset as u64,
            total_bytes: TOTAL as u64,
            raw_len: raw_len as u64,
            last: offset + raw_len == TOTAL,
            ucx_put: put,
            compression: v1::Compression::None as i32,
            ..Default::default()
        };
        Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: payload.to_vec().into() }
    };
    // Sends the whole tensor, chunk by chunk, on a new stream.
    let send_all = || {
        let client = client.clone();
        let frames: Vec<Frame> =
            (0..TOTAL / PART).map(|i| chunk(i as u32, i * PART, PART, false, &data[i * PART..][..PART])).collect();
        tokio::spawn(async move {
            let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
            tx.send_batch(frames, true).await
        })
    };
    let before = ucx::stats();

    // Granted: the first chunk asks, the receiver places the tensor, the
    // rest is put, bit-exact, and counted (placed by tag without puts).
    let send = send_all();
    let mut inc = server.accept().await.unwrap();
    let first = inc.recv.recv().await.unwrap().unwrap();
    let Payload::Bytes(p0) = &first.payload else { panic!("the first chunk is not placed") };
    let mut buf = RecvBuf::try_zeroed(TOTAL).unwrap();
    buf[..PART].copy_from_slice(p0);
    let placement = Placement::new(buf, 1);
    inc.recv.place(Some(placement.clone()));
    let mut placed = PART;
    while placed < TOTAL {
        let r = inc.recv.recv().await.unwrap().expect("a chunk");
        let Kind::Chunk(c) = r.header.kind.unwrap() else { panic!("not a chunk") };
        assert_eq!(c.ucx_put, puts, "chunk {} of the placed tensor", c.index);
        assert!(matches!(r.payload, Payload::Placed { .. }));
        placed += c.raw_len as usize;
    }
    inc.recv.place(None);
    send.await.unwrap().unwrap();
    let got = placement.into_inner().await;
    assert!(got[..] == data[..], "the put tensor differs");
    let after = ucx::stats();
    let (grants, put) = if puts { (1, (TOTAL - PART) as u64) } else { (0, 0) };
    assert_eq!(after.grants, before.grants + grants, "{before:?} -> {after:?}");
    assert_eq!(after.bytes_put, before.bytes_put + put, "{before:?} -> {after:?}");

    // Not placed: the ask is refused and the rest comes by tag.
    let send = send_all();
    let mut inc = server.accept().await.unwrap();
    let mut got = Vec::new();
    while let Some(r) = inc.recv.recv().await.unwrap() {
        let Payload::Bytes(b) = r.payload else { panic!("placed without a placement") };
        got.extend_from_slice(&b);
    }
    send.await.unwrap().unwrap();
    assert!(got == data, "the refused tensor differs");
    assert_eq!(ucx::stats().grants, after.grants);

    let next_error = async |frames: Vec<Frame>, place: bool| {
        let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
        tokio::spawn(async move { tx.send_batch(frames, true).await });
        let mut inc = server.accept().await.unwrap();
        let limit = Duration::from_secs(10);
        let mut placement = None;
        loop {
            match tokio::time::timeout(limit, inc.recv.recv()).await.expect("an error, not a hang") {
                Err(e) => return e.to_string(),
                Ok(None) => panic!("the lying stream ended cleanly"),
                Ok(Some(r)) if place && placement.is_none() => {
                    let p = Placement::new(RecvBuf::try_zeroed(TOTAL).unwrap(), 1);
                    inc.recv.place(Some(p.clone()));
                    placement = Some((p, r));
                }
                Ok(Some(r)) => assert!(r.header.kind.is_some()),
            }
        }
    };
    // A put claimed without any grant.
    let e = next_error(vec![chunk(0, 0, PART, true, &[])], false).await;
    assert!(e.contains("no memory was granted"), "{e}");
    // A put claimed past the end of the granted tensor (after a real ask).
    let frames = vec![chunk(0, 0, PART, false, &data[..PART]), chunk(1, TOTAL - PART, 2 * PART, true, &[])];
    let e = next_error(frames, true).await;
    let why = if puts { "outside" } else { "no memory was granted" };
    assert!(e.contains(why), "{e}");
}

/// Many large tensors at once on one connection, both ways, in sizes that
/// go by put (≥ 8 MiB on shared memory), by tag, and mixed: every stream's
/// flush runs while other streams have rendezvous outstanding; all arrive
/// bit-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_tensors_by_put_and_by_tag_arrive_intact() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "ucx").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let sizes = [24usize << 20, 3 << 20, 9 << 20, 40 << 20, 1 << 20, 16 << 20];
    let names: Vec<String> = (0..sizes.len()).map(|i| format!("c{i}")).collect();
    let tensors: Vec<_> = sizes
        .iter()
        .zip(&names)
        .enumerate()
        .map(|(i, (&n, name))| random_tensor(DType::UInt8, &[n], 100 + i as u64).unwrap().with_name(name.clone()))
        .collect();
    let sends = tensors.iter().map(|t| client.send(vec![t.clone()]));
    for r in futures_util::future::join_all(sends).await {
        r.unwrap();
    }
    let before = ucx::stats();
    // Fetches and exchanges at once (the server sends while it receives).
    let fetches = names.iter().map(|n| client.fetch_one(n));
    let exchanges = tensors.iter().map(|t| client.exchange_all(vec![t.clone()]));
    let (fetched, exchanged) =
        tokio::join!(futures_util::future::join_all(fetches), futures_util::future::join_all(exchanges));
    for ((t, f), x) in tensors.iter().zip(fetched).zip(exchanged) {
        assert_same(t, &f.unwrap());
        assert_same(t, &x.unwrap()[0]);
    }
    let after = ucx::stats();
    if ucx::ucx_puts(true).unwrap() {
        // 24, 9, 40 and 16 MiB go by put, in each of the three directions used.
        assert!(after.grants >= before.grants + 4 * 3, "{before:?} -> {after:?}");
    }
    assert_eq!(after.operations_outstanding, 0, "{after:?}");
}

/// A granted tensor whose reader also needs the buffer mid-tensor (chunk
/// checksums to check; chunks that compress, arriving inline) completes:
/// the grant does not keep the buffer locked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn granted_tensors_with_checksums_or_compressed_chunks_complete() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "ucx").await;
    // 1 MiB that does not compress, then 31 MiB of zeros that do.
    let mut bytes = random_tensor(DType::UInt8, &[1 << 20], 5).unwrap().as_bytes().unwrap().to_vec();
    bytes.resize(32 << 20, 0);
    let mixed = Tensor::from_vec([32usize << 20], bytes).unwrap().with_name("mixed");
    let plain = random_tensor(DType::Float32, &[4 << 20], 6).unwrap().with_name("plain");
    let encodings = [
        Encoding { chunk_checksums: Some(true), checksums: true, ..Encoding::default() },
        Encoding { compression: CompressionMode::Fixed(Compression::Lz4), ..Encoding::default() },
    ];
    for encoding in encodings {
        let cfg = ClientConfig { encoding, ..ClientConfig::default() };
        let client = Client::connect_with(&server.url(), cfg).await.unwrap();
        for t in [&mixed, &plain] {
            let name = t.name().unwrap().to_string();
            let limit = Duration::from_secs(30);
            tokio::time::timeout(limit, client.send(vec![t.clone()])).await.expect("no hang").unwrap();
            let back = tokio::time::timeout(limit, client.fetch_one(&name)).await.expect("no hang").unwrap();
            assert_same(t, &back);
        }
    }
}

/// A grant that ends before the tensor's last chunk (the reader gave up)
/// leaves a region the sender may still write into: it is never handed out
/// again (the pool frees it), while a grant that completes leaves it
/// reusable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_abandoned_mid_tensor_is_never_recycled() {
    let puts = ucx::ucx_puts(true).unwrap();
    let cfg = TransportConfig::default();
    let (client, server) = connected(&cfg).await;
    const TOTAL: usize = 16 << 20;
    const PART: usize = 1 << 20;
    let frames = || -> Vec<Frame> {
        (0..TOTAL / PART)
            .map(|i| {
                let c = v1::Chunk {
                    tensor_id: 1,
                    index: i as u32,
                    offset: (i * PART) as u64,
                    total_bytes: TOTAL as u64,
                    raw_len: PART as u64,
                    last: (i + 1) * PART == TOTAL,
                    compression: v1::Compression::None as i32,
                    ..Default::default()
                };
                Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: vec![i as u8; PART].into() }
            })
            .collect()
    };
    for abandon in [false, true] {
        let (mut tx, _rx) = client.open(StreamKind::Send).await.unwrap();
        let f = frames();
        let sending = tokio::spawn(async move { tx.send_batch(f, true).await });
        let mut inc = server.accept().await.unwrap();
        let first = inc.recv.recv().await.unwrap().expect("the first chunk");
        let Some(Kind::Chunk(c0)) = first.header.kind else { panic!("not a chunk") };
        if !puts {
            // Over UCX's tcp nothing is asked for (nor granted).
            assert!(!c0.ucx_grant);
            return;
        }
        let placement = Placement::new(RecvBuf::try_zeroed(TOTAL).unwrap(), 1);
        inc.recv.place(Some(placement.clone()));
        let r = inc.recv.recv().await.unwrap().expect("a put chunk");
        let Kind::Chunk(c) = r.header.kind.unwrap() else { panic!("not a chunk") };
        assert!(c.ucx_put);
        if !abandon {
            while inc.recv.recv().await.unwrap().is_some() {}
        }
        inc.recv.place(None);
        let buf = placement.into_inner().await;
        assert_eq!(buf.reusable(), !abandon, "abandoned: {abandon}");
        drop(inc);
        let _ = sending.await;
    }
}
