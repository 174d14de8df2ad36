//! Shared memory: `shm://` and `unix://` upgraded to it, bit-exact from
//! 1 byte to 1 GiB in every direction, cleanup after a peer is killed, and
//! frames that lie about segments.

mod common;

use std::time::Duration;

use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{Client, DType, ServerConfig, Tensor};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{self as transports, Frame, FrameHeader, StreamKind};

/// Environment variable that makes `child_process_client` act (it is run
/// by `a_killed_peer_leaves_nothing_behind` as a separate process).
const CHILD_URL: &str = "TENSORWIRE_TEST_SHM_CHILD_URL";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_fetch_exchange_from_one_byte_to_one_gib_bit_exact() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let sizes = [1usize, 255 << 10, 256 << 10, (1 << 20) + 1, 64 << 20, 1 << 30];
    for (i, &n) in sizes.iter().enumerate() {
        let t = random_tensor(DType::UInt8, &[n], i as u64).unwrap().with_name(format!("t{i}"));
        let s = client.send(vec![t.clone()]).await.unwrap();
        assert_eq!(s.bytes, n as u64);
        let back = client.fetch_one(&format!("t{i}")).await.unwrap();
        assert_same(&t, &back);
        drop(back); // its segment goes back to the server's pool
        // Two tensors per exchange, one at 1 GiB (memory on a small machine).
        let copies = if n <= 64 << 20 { 2 } else { 1 };
        let ex = client.exchange_all(vec![t.clone(); copies]).await.unwrap();
        assert_eq!(ex.len(), copies);
        for e in &ex {
            assert_same(&t, e);
        }
    }
    // Typed views of a received tensor work (the mapping is page-aligned).
    let x = random_tensor(DType::Float64, &[512, 1024], 9).unwrap().with_name("f64");
    client.send(vec![x.clone()]).await.unwrap();
    let y = client.fetch_one("f64").await.unwrap();
    assert_eq!(y.as_slice::<f64>().unwrap(), x.as_slice::<f64>().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_connections_upgrade_and_plain_clients_still_work() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "unix").await;
    let url = server.url();
    let cfg = transports::TransportConfig::default();
    let upgraded = transports::connect(&transports::Endpoint::parse(&url).unwrap(), &cfg).await.unwrap();
    assert_eq!(upgraded.info().transport, "unix+shm");
    let plain_url = format!("{url}?shm=0");
    let plain = transports::connect(&transports::Endpoint::parse(&plain_url).unwrap(), &cfg).await.unwrap();
    assert_eq!(plain.info().transport, "unix");
    let mut off = cfg.clone();
    off.shm.unix_upgrade = false;
    let plain2 = transports::connect(&transports::Endpoint::parse(&url).unwrap(), &off).await.unwrap();
    assert_eq!(plain2.info().transport, "unix");
    // Both kinds of client move the same tensors through the same server.
    let t = random_tensor(DType::Float32, &[1 << 20], 4).unwrap().with_name("both");
    let a = Client::connect(&url).await.unwrap();
    let b = Client::connect(&plain_url).await.unwrap();
    a.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &b.fetch_one("both").await.unwrap());
    b.send(vec![t.clone().with_name("both2")]).await.unwrap();
    assert_same(&t, &a.fetch_one("both2").await.unwrap());
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn dev_shm() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Run as a child process by the test below: sends big tensors forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_client() {
    let Ok(url) = std::env::var(CHILD_URL) else { return };
    let client = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[64 << 20], 1).unwrap();
    println!("child connected");
    loop {
        client.send(vec![t.clone()]).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_leaves_nothing_behind() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let url = server.url();
    // A first client warms up everything the server keeps for its lifetime.
    let warm = Client::connect(&url).await.unwrap();
    warm.send(vec![random_tensor(DType::UInt8, &[1 << 20], 1).unwrap()]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (fds_before, shm_before) = (open_fds(), dev_shm());

    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_process_client", "--nocapture", "--test-threads=1"])
        .env(CHILD_URL, &url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Let it send for a while (segments in flight in both directions).
    let stats = || server.info().bytes_received;
    let start = stats();
    for _ in 0..200 {
        if stats() > start + (256 << 20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(stats() > start, "the child sent nothing");
    assert!(open_fds() > fds_before, "the child's connection holds descriptors here");
    child.kill().unwrap();
    child.wait().unwrap();

    // Everything the dead peer had is released: descriptors closed, no
    // file in /dev/shm (segments are anonymous memfds), server serving.
    let mut fds = open_fds();
    for _ in 0..100 {
        if fds <= fds_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        fds = open_fds();
    }
    assert!(fds <= fds_before, "descriptors left after the peer died: {fds} > {fds_before}");
    assert_eq!(dev_shm(), shm_before, "files appeared in /dev/shm");
    let c = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[8 << 20], 3).unwrap().with_name("after");
    c.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &c.fetch_one("after").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_that_lie_about_segments_are_refused() {
    let mut cfg = ServerConfig::default();
    cfg.transport.shm.segment_timeout = Duration::from_millis(300);
    let (server, _dir) = start(store_server(cfg), "shm").await;
    let url = server.url();
    let ep = transports::Endpoint::parse(&url).unwrap();
    let conn = transports::connect(&ep, &Default::default()).await.unwrap();
    let hello = v1::Hello { version: tensorwire::PROTOCOL_VERSION, ..Default::default() };
    let (mut tx, mut rx) = conn.open(StreamKind::Handshake).await.unwrap();
    tx.send_last(Frame::header_only(FrameHeader::new(Kind::Hello(Box::new(hello))))).await.unwrap();
    assert!(matches!(rx.recv().await.unwrap().unwrap().header.kind, Some(Kind::Welcome(_))));

    let info = v1::TensorInfo { dtype: v1::Dtype::Uint8 as i32, shape: vec![100], ..Default::default() };
    let lying = |segment: u64, raw_len: u64, total: u64| {
        let c = v1::Chunk {
            tensor_id: 1,
            total_bytes: total,
            raw_len,
            last: true,
            info: Some(Box::new(info.clone())),
            shm_segment: segment,
            ucx_tag: 0,
            compression: v1::Compression::None as i32,
            ..Default::default()
        };
        Frame::header_only(FrameHeader::new(Kind::Chunk(c)))
    };
    let request = || {
        let r = v1::Request { method: v1::Method::Send as i32, ..Default::default() };
        Frame::header_only(FrameHeader::new(Kind::Request(Box::new(r))))
    };
    // A segment never passed, and a frame whose sizes disagree.
    for (frame, want) in [(lying(999, 100, 100), "segment 999"), (lying(5, 50, 100), "declares 50 bytes")] {
        let (mut tx, mut rx) = conn.open(StreamKind::Send).await.unwrap();
        let _ = tx.send_batch(vec![request(), frame], true).await;
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("an answer, not a hang");
        let text = match got {
            Ok(Some(r)) => format!("{:?}", r.header.kind),
            Ok(None) => "closed".to_string(),
            Err(e) => e.to_string(),
        };
        assert!(text.contains(want) || text.contains("closed") || text.contains("connection"), "{want}: {text}");
    }
    // The server keeps serving everyone else.
    let c = Client::connect(&url).await.unwrap();
    let t = Tensor::from_vec([3], vec![1u8, 2, 3]).unwrap();
    assert_same(&t, &c.compute("identity", vec![t.clone()]).await.unwrap()[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_held_tensors_than_the_peer_takes_segments_still_arrive() {
    // Each tensor a receiver keeps holds its segment; past the peer's limit
    // (256 per connection) the sender uses the socket instead of failing.
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let tensors: Vec<Tensor> =
        (0..300u64).map(|i| random_tensor(DType::UInt8, &[300 << 10], i).unwrap().with_name(format!("h{i}"))).collect();
    let s = client.send(tensors.clone()).await.unwrap();
    assert_eq!(s.received, 300);
    let names: Vec<String> = (0..300).map(|i| format!("h{i}")).collect();
    let back = client.fetch(tensorwire::FetchRequest::default().param("names", names.join(","))).await.unwrap();
    assert_eq!(back.len(), 300);
    for (a, b) in tensors.iter().zip(&back) {
        assert_same(a, b);
    }
    // Still healthy afterwards, both ways.
    let t = random_tensor(DType::UInt8, &[1 << 20], 7).unwrap().with_name("after");
    client.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &client.fetch_one("after").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_on_the_same_host_upgrades_to_shared_memory_unless_refused() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "tcp+shm").await;
    let url = server.url();
    // The server lists only what it was asked to listen on.
    assert_eq!(server.info().transports, vec!["tcp".to_string()]);
    let upgraded = Client::connect(&url).await.unwrap();
    assert_eq!(upgraded.transport(), Some("unix+shm"), "a same-host tcp:// client upgrades");
    let plain = Client::connect(&format!("{url}?shm=0")).await.unwrap();
    assert_eq!(plain.transport(), Some("tcp"), "?shm=0 refuses the upgrade");
    let mut cfg = tensorwire::ClientConfig::default();
    cfg.transport.shm.unix_upgrade = false;
    let off = Client::connect_with(&url, cfg).await.unwrap();
    assert_eq!(off.transport(), Some("tcp"), "unix_upgrade = false refuses it too");
    // Both move the same tensors through the same server, bit-exact.
    for (i, c) in [&upgraded, &plain, &off].into_iter().enumerate() {
        let t = random_tensor(DType::UInt8, &[(8 << 20) + i], i as u64).unwrap().with_name(format!("t{i}"));
        c.send(vec![t.clone()]).await.unwrap();
        for d in [&upgraded, &plain] {
            assert_same(&t, &d.fetch_one(&format!("t{i}")).await.unwrap());
        }
    }
    // A reconnect upgrades again.
    upgraded.disconnect();
    assert!(upgraded.health().await.unwrap());
    assert_eq!(upgraded.transport(), Some("unix+shm"));
}
