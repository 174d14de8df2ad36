//! Figures for `docs/SECURITY.md` and the reliability notes: the release or
//! dev `tensorwire serve` binary, as a separate process, under each memory
//! attack and connection flood, with its peak resident memory (`VmHWM`)
//! and how long it takes to reclaim idle connections. Prints one line per
//! probe; asserts only what must hold (memory within the budget plus the
//! process's baseline, every flood reclaimed), never a timing.
//!
//! Ignored by default (about two minutes):
//! `cargo nextest run --features fuzzing --test attack_figures --run-ignored only --no-capture`

mod common;

use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cli::bin;
use common::raw_handshake;
use tensorwire::builtins::random_tensor;
use tensorwire::{Args, Client, DType, FetchRequest};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{self as transports, Frame, FrameHeader, StreamKind};

const MIB: u64 = 1 << 20;

/// A `tensorwire serve` child, killed on drop.
struct Serve {
    child: Child,
    url: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn serve(scheme: &str, extra: &[&str]) -> Serve {
    let url = format!("{scheme}://127.0.0.1:{}", free_port());
    let child = bin()
        .args(["serve", "--listen", &url, "--log-level", "error"])
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !bin().args(["health", "--to", &url]).stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap().success()
    {
        assert!(start.elapsed() < Duration::from_secs(20), "server did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Serve { child, url }
}

/// A field of /proc/PID/status in bytes (VmRSS, VmHWM).
fn status_bytes(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / MIB as f64)
}

/// A send whose tensor declares `total` bytes, of which `sent` are sent in
/// 1 MiB chunks before the sender stalls (the stream stays open). Returns
/// the stream and whether the server refused it.
async fn stalled_send(
    conn: &Arc<dyn transports::Connection>,
    total: u64,
    sent: u64,
) -> (Box<dyn transports::SendStream>, Box<dyn transports::RecvStream>) {
    let (mut tx, rx) = conn.open(StreamKind::Send).await.unwrap();
    let req = v1::Request { method: v1::Method::Send as i32, ..Default::default() };
    tx.send(Frame::header_only(FrameHeader::new(Kind::Request(Box::new(req))))).await.unwrap();
    let mut offset = 0;
    let mut index = 0;
    while offset < sent.max(1) {
        let n = MIB.min(sent - offset).max(1);
        let info = (index == 0).then(|| {
            Box::new(v1::TensorInfo {
                dtype: v1::Dtype::Uint8 as i32,
                shape: vec![total],
                codec: v1::Codec::Raw as i32,
                ..Default::default()
            })
        });
        let payload = bytes::Bytes::from(vec![1u8; n as usize]);
        let c = v1::Chunk {
            tensor_id: 1,
            index,
            offset,
            total_bytes: total,
            raw_len: n,
            compression: v1::Compression::None as i32,
            info,
            ..Default::default()
        };
        // A refused stream stops taking chunks: stop sending, keep it open.
        if tx.send(Frame { header: FrameHeader::new(Kind::Chunk(c)), payload }).await.is_err() {
            break;
        }
        offset += n;
        index += 1;
    }
    (tx, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures: about two minutes against the real binary"]
async fn memory_attacks_and_connection_floods() {
    // 1. Stalled senders: 6 × 768 MiB declared, 700 MiB sent each, budget 1 GiB.
    {
        let s = serve("tcp", &["--max-memory-bytes", "1073741824"]);
        let pid = s.child.id();
        let base = status_bytes(pid, "VmRSS");
        let conn = raw_handshake(&s.url, "").await;
        let mut held = Vec::new();
        for _ in 0..6 {
            held.push(stalled_send(&conn, 768 * MIB, 700 * MIB).await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let client = Client::connect(&s.url).await.unwrap();
        let info = client.service_info().await.unwrap();
        let hwm = status_bytes(pid, "VmHWM");
        println!(
            "stalled senders 6 × 700/768 MiB, budget 1 GiB: peak RSS {} (baseline {}), budget used {}, refused {}",
            mib(hwm),
            mib(base),
            mib(info.memory_used),
            info.memory_refused
        );
        assert!(hwm <= base + (1 << 30) + 128 * MIB, "peak RSS {} over the budget", mib(hwm));
        // Normal traffic still works while the attackers hold their streams.
        let t = random_tensor(DType::UInt8, &[8 << 20], 1).unwrap().with_name("ok");
        let e = client.send(vec![t.clone()]).await;
        println!(
            "  an 8 MiB send from another client meanwhile: {}",
            if e.is_ok() { "ok" } else { "refused (budget full)" }
        );
        drop(held);
        conn.close("done");
    }
    // 2. Task results: 16 × 128 MiB identity tasks, budget 256 MiB.
    {
        let s = serve("tcp", &["--max-memory-bytes", "268435456"]);
        let pid = s.child.id();
        let base = status_bytes(pid, "VmRSS");
        let client = Client::connect(&s.url).await.unwrap();
        let x = random_tensor(DType::UInt8, &[128 << 20], 2).unwrap();
        let (mut submitted, mut refused) = (0, 0);
        for _ in 0..16 {
            match client.submit("identity", vec![x.clone()], Args::new()).await {
                Ok(_) => submitted += 1,
                Err(_) => refused += 1,
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let info = client.service_info().await.unwrap();
        let hwm = status_bytes(pid, "VmHWM");
        println!(
            "task results 16 × 128 MiB, budget 256 MiB: {submitted} accepted, {refused} refused at submit; peak RSS {} (baseline {}), budget used {}",
            mib(hwm),
            mib(base),
            mib(info.memory_used)
        );
        assert!(info.memory_used <= 256 * MIB);
    }
    // 3. Declared sizes: shape=1000000,1000000 and a 16 GiB first chunk.
    {
        let s = serve("tcp", &["--max-tensor-bytes", "1048576"]);
        let pid = s.child.id();
        let client = Client::connect(&s.url).await.unwrap();
        let e = client.fetch(FetchRequest::default().param("shape", "1000000,1000000")).await.unwrap_err();
        println!("fetch shape=1000000,1000000: {e}");
        let conn = raw_handshake(&s.url, "").await;
        let (_tx, mut rx) = stalled_send(&conn, 16 << 30, 0).await;
        let reply = rx.recv().await;
        let why = match reply {
            Ok(Some(r)) => match r.header.kind {
                Some(Kind::Error(e)) => e.message,
                other => format!("{other:?}"),
            },
            other => format!("{other:?}"),
        };
        println!("first chunk declaring 16 GiB: {why}; server RSS {}", mib(status_bytes(pid, "VmRSS")));
        assert!(client.health().await.unwrap(), "the server keeps serving");
    }
    // 3b. The same first chunks within a 64 GiB max_tensor_bytes: the memory
    //     budget (default: half the machine's memory) refuses them first.
    {
        let s = serve("tcp", &["--max-tensor-bytes", "68719476736"]);
        let pid = s.child.id();
        let conn = raw_handshake(&s.url, "").await;
        for gib in [16u64, 40] {
            let (_tx, mut rx) = stalled_send(&conn, gib << 30, 0).await;
            let why = match rx.recv().await {
                Ok(Some(r)) => match r.header.kind {
                    Some(Kind::Error(e)) => e.message,
                    other => format!("{other:?}"),
                },
                other => format!("{other:?}"),
            };
            println!(
                "first chunk declaring {gib} GiB (max_tensor_bytes 64 GiB): {why}; server RSS {}",
                mib(status_bytes(pid, "VmRSS"))
            );
        }
        let client = Client::connect(&s.url).await.unwrap();
        assert!(client.health().await.unwrap(), "the server keeps serving");
    }
    // 4. Floods: 300 connections that send nothing, 300 that handshake and
    //    then answer nothing, 300 on the gRPC port without an HTTP/2 preface.
    for (what, scheme) in [
        ("300 silent TCP connections (no preface)", "tcp"),
        ("300 connections that send the mux preface, then no Hello", "tcp-hello"),
        ("300 gRPC connections without an HTTP/2 preface", "grpc"),
    ] {
        let s = serve(if scheme == "grpc" { "grpc" } else { "tcp" }, &[]);
        let pid = s.child.id();
        let base_fds = open_fds(pid);
        let addr = transports::Endpoint::parse(&s.url).unwrap().authority();
        let mut socks = Vec::new();
        for _ in 0..300 {
            let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
            if scheme == "tcp-hello" {
                let mut b = bytes::BytesMut::new();
                tensorwire_transports::mux::frame::Preface {
                    version: 1,
                    stream_window: 1 << 20,
                    max_frame_payload: 1 << 20,
                }
                .encode(&mut b);
                tokio::io::AsyncWriteExt::write_all(&mut c, &b).await.unwrap();
            }
            socks.push(c);
        }
        let start = Instant::now();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let peak = open_fds(pid);
        while open_fds(pid) > base_fds && start.elapsed() < Duration::from_secs(120) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let after = open_fds(pid);
        println!(
            "{what}: server descriptors {base_fds} → {peak} → {after}, reclaimed in {:.1} s",
            start.elapsed().as_secs_f64()
        );
        assert!(after <= base_fds, "{what}: {after} descriptors still open");
        drop(socks);
    }
}
