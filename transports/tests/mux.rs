//! The mux over real TCP and Unix sockets on loopback.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use tensorwire_proto::v1::{self, frame_header::Kind as HKind};
use tensorwire_transports::mux::frame::{self, Head, Kind, Preface};
use tensorwire_transports::{
    AcceptError, Connection, Endpoint, Frame, FrameHeader, Listener, Payload, Placement, StreamError, StreamKind,
    TransportConfig, connect, listen,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn chunk_header(offset: u64, len: u64) -> FrameHeader {
    FrameHeader::new(HKind::Chunk(v1::Chunk {
        tensor_id: 1,
        index: (offset / (1 << 20)) as u32 + 1,
        offset,
        raw_len: len,
        compression: v1::Compression::None as i32,
        ..Default::default()
    }))
}

fn data(len: usize, seed: u8) -> Bytes {
    Bytes::from((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<u8>>())
}

struct Pair {
    client: Arc<dyn Connection>,
    server: Arc<dyn Connection>,
    _listener: Box<dyn Listener>,
    _dir: tempfile::TempDir,
}

async fn pair(scheme: &str, config: TransportConfig) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let url = match scheme {
        "tcp" => "tcp://127.0.0.1:0".to_string(),
        _ => format!("unix://{}", dir.path().join("s.sock").display()),
    };
    let mut l = listen(&Endpoint::parse(&url).unwrap(), &config).await.unwrap();
    let ep = l.local_endpoint();
    let (client, server) = tokio::join!(connect(&ep, &config), l.accept());
    Pair { client: client.unwrap(), server: server.unwrap(), _listener: l, _dir: dir }
}

#[tokio::test]
async fn echo_streams_on_both_transports() {
    // Readers that spin after traffic (the default) and readers that sleep
    // at once; the pause between calls outlasts the spin, so each call finds
    // the readers asleep and the request's write wakes the client's reader.
    let spins = [TransportConfig::default().spin, std::time::Duration::ZERO];
    for (scheme, spin) in ["tcp", "unix"].into_iter().flat_map(|s| spins.map(|d| (s, d))) {
        let p = pair(scheme, TransportConfig { spin, ..TransportConfig::default() }).await;
        let server = p.server.clone();
        let srv = tokio::spawn(async move {
            while let Ok(mut inc) = server.accept().await {
                tokio::spawn(async move {
                    while let Some(r) = inc.recv.recv().await.unwrap() {
                        let Payload::Bytes(b) = r.payload else { panic!("no placement registered") };
                        inc.send.send(Frame { header: r.header, payload: b }).await.unwrap();
                    }
                    inc.send.finish().await.unwrap();
                });
            }
        });
        for size in [0usize, 1, 100, 70_000, 3 << 20] {
            let (mut tx, mut rx) = p.client.open(StreamKind::Exchange).await.unwrap();
            let payload = data(size, 7);
            tx.send_last(Frame { header: chunk_header(0, size as u64), payload: payload.clone() }).await.unwrap();
            let got = rx.recv().await.unwrap().unwrap();
            let Payload::Bytes(b) = got.payload else { panic!() };
            assert_eq!(b, payload, "{scheme} size {size} spin {spin:?}");
            assert!(rx.recv().await.unwrap().is_none(), "FIN after the echo");
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        p.client.close("done");
        srv.abort();
    }
}

#[tokio::test]
async fn sixty_four_concurrent_streams() {
    let p = pair("unix", TransportConfig::default()).await;
    let server = p.server.clone();
    tokio::spawn(async move {
        while let Ok(mut inc) = server.accept().await {
            tokio::spawn(async move {
                let mut total = 0usize;
                while let Some(r) = inc.recv.recv().await.unwrap() {
                    total += r.payload.len();
                }
                let n = (total as u64).to_le_bytes();
                inc.send
                    .send_last(Frame { header: chunk_header(0, 8), payload: Bytes::copy_from_slice(&n) })
                    .await
                    .unwrap();
            });
        }
    });
    let mut tasks = vec![];
    for i in 0..64usize {
        let c = p.client.clone();
        tasks.push(tokio::spawn(async move {
            let (mut tx, mut rx) = c.open(StreamKind::Send).await.unwrap();
            let mut sent = 0;
            for k in 0..(i % 7 + 1) {
                let b = data(4096 * (k + 1), i as u8);
                sent += b.len();
                tx.send(Frame { header: chunk_header(0, b.len() as u64), payload: b }).await.unwrap();
            }
            tx.finish().await.unwrap();
            let r = rx.recv().await.unwrap().unwrap();
            let Payload::Bytes(b) = r.payload else { panic!() };
            assert_eq!(u64::from_le_bytes(b[..].try_into().unwrap()), sent as u64);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Small frames are views of the reader's buffer, which is reused once
/// every frame cut from it is dropped: frames held while many buffers' worth
/// go by (and others are dropped at once) must come out intact.
#[tokio::test]
async fn frames_held_across_many_read_buffers_stay_intact() {
    const FRAMES: usize = 40;
    let p = pair("unix", TransportConfig::default()).await;
    let server = p.server.clone();
    tokio::spawn(async move {
        while let Ok(mut inc) = server.accept().await {
            tokio::spawn(async move {
                let mut held = vec![];
                let mut bad = 0u64;
                while let Some(r) = inc.recv.recv().await.unwrap() {
                    let Payload::Bytes(b) = r.payload else { panic!("no placement registered") };
                    let Some(HKind::Chunk(c)) = r.header.kind.clone() else { panic!("a chunk") };
                    // The sender's seed rides in the chunk's offset; even
                    // seeds' streams keep every frame until their end.
                    if c.offset % 2 == 0 {
                        held.push((c.offset, b));
                    } else if b != data(b.len(), c.offset as u8) {
                        bad += 1;
                    }
                }
                bad += held.iter().filter(|(seed, b)| *b != data(b.len(), *seed as u8)).count() as u64;
                let reply = Bytes::copy_from_slice(&bad.to_le_bytes());
                inc.send.send_last(Frame { header: chunk_header(0, 8), payload: reply }).await.unwrap();
            });
        }
    });
    let tasks: Vec<_> = (0..64u64)
        .map(|i| {
            let c = p.client.clone();
            tokio::spawn(async move {
                let (mut tx, mut rx) = c.open(StreamKind::Send).await.unwrap();
                for k in 0..FRAMES {
                    // Odd sizes: frames straddle the ends of read buffers.
                    let len = 3000 + 17 * k + i as usize;
                    let h = chunk_header(i, len as u64);
                    tx.send(Frame { header: h, payload: data(len, i as u8) }).await.unwrap();
                }
                tx.finish().await.unwrap();
                let r = rx.recv().await.unwrap().unwrap();
                let Payload::Bytes(b) = r.payload else { panic!() };
                assert_eq!(
                    u64::from_le_bytes(b[..].try_into().unwrap()),
                    0,
                    "stream {i}: frames changed under their reader"
                );
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn slow_reader_bounds_what_the_sender_puts_in_flight() {
    let cfg = TransportConfig { stream_window: 1 << 20, ..Default::default() };
    let p = pair("tcp", cfg).await;
    let (mut tx, _rx) = p.client.open(StreamKind::Send).await.unwrap();
    let sent = Arc::new(AtomicUsize::new(0));
    let s2 = sent.clone();
    let sender = tokio::spawn(async move {
        for _ in 0..64 {
            tx.send(Frame { header: chunk_header(0, 128 << 10), payload: data(128 << 10, 1) }).await.unwrap();
            s2.fetch_add(1, Ordering::SeqCst);
        }
        tx
    });
    let mut inc = p.server.accept().await.unwrap();
    // Give the sender every chance to run ahead; credit stops it at the
    // window (1 MiB / ~128 KiB frames => at most 7 frames), whatever the time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = sent.load(Ordering::SeqCst);
    assert!(before <= 8, "sender ran {before} frames ahead of a reader that read nothing");
    // Once the reader reads, everything flows.
    let mut n = 0;
    while n < 64 {
        inc.recv.recv().await.unwrap().unwrap();
        n += 1;
    }
    let tx = sender.await.unwrap();
    assert_eq!(sent.load(Ordering::SeqCst), 64);
    drop(tx);
}

#[tokio::test]
async fn placement_receives_in_place() {
    let p = pair("unix", TransportConfig::default()).await;
    let (mut tx, _rx) = p.client.open(StreamKind::Send).await.unwrap();
    let mut inc = p.server.accept_or_first(&mut tx).await;
    let total = 4 << 20;
    let whole = data(total, 3);
    let placement = Placement::new(tensorwire_transports::RecvBuf::try_zeroed(total).unwrap(), 1);
    inc.recv.place(Some(placement.clone()));
    let chunk = 1 << 20;
    for off in (0..total).step_by(chunk) {
        tx.send(Frame { header: chunk_header(off as u64, chunk as u64), payload: whole.slice(off..off + chunk) })
            .await
            .unwrap();
    }
    tx.finish().await.unwrap();
    let mut placed = 0;
    while let Some(r) = inc.recv.recv().await.unwrap() {
        match r.payload {
            Payload::Placed { len, .. } => placed += len,
            Payload::Bytes(b) => panic!("{} bytes not placed", b.len()),
        }
    }
    assert_eq!(placed, total);
    inc.recv.place(None);
    assert_eq!(&placement.into_inner().await[..], &whole[..]);
}

#[tokio::test]
async fn placement_never_takes_another_tensors_chunks() {
    let p = pair("unix", TransportConfig::default()).await;
    let (mut tx, _rx) = p.client.open(StreamKind::Send).await.unwrap();
    let mut inc = p.server.accept_or_first(&mut tx).await;
    // Registered for tensor 1, while chunks of tensor 2 (and a first chunk) arrive.
    let placement = Placement::new(tensorwire_transports::RecvBuf::try_zeroed(1 << 20).unwrap(), 1);
    inc.recv.place(Some(placement.clone()));
    let mut other = chunk_header(0, 4096);
    if let Some(HKind::Chunk(c)) = &mut other.kind {
        c.tensor_id = 2;
        c.index = 1;
    }
    tx.send(Frame { header: other, payload: data(4096, 1) }).await.unwrap();
    let mut first = chunk_header(0, 4096);
    if let Some(HKind::Chunk(c)) = &mut first.kind {
        c.index = 0;
    }
    tx.send(Frame { header: first, payload: data(4096, 2) }).await.unwrap();
    for _ in 0..2 {
        let r = inc.recv.recv().await.unwrap().unwrap();
        assert!(matches!(r.payload, Payload::Bytes(_)), "a foreign chunk was placed");
    }
    inc.recv.place(None);
    assert!(placement.into_inner().await.iter().all(|&b| b == 0));
}

/// Sends one empty frame so the server sees the stream, then accepts it.
trait AcceptFirst {
    async fn accept_or_first(
        &self,
        tx: &mut Box<dyn tensorwire_transports::SendStream>,
    ) -> tensorwire_transports::Incoming;
}

impl AcceptFirst for Arc<dyn Connection> {
    async fn accept_or_first(
        &self,
        tx: &mut Box<dyn tensorwire_transports::SendStream>,
    ) -> tensorwire_transports::Incoming {
        let hello = FrameHeader::new(HKind::Request(Box::default()));
        tx.send(Frame::header_only(hello)).await.unwrap();
        let mut inc = self.accept().await.unwrap();
        let first = inc.recv.recv().await.unwrap().unwrap();
        assert_eq!(first.header.kind_name(), "request");
        inc
    }
}

#[tokio::test]
async fn dropping_the_receiver_stops_the_sender() {
    let p = pair("tcp", TransportConfig { stream_window: 256 << 10, ..Default::default() }).await;
    let (mut tx, _rx) = p.client.open(StreamKind::Send).await.unwrap();
    let inc = p.server.accept_or_first(&mut tx).await;
    drop(inc);
    let mut err = None;
    for _ in 0..100 {
        if let Err(e) = tx.send(Frame { header: chunk_header(0, 64 << 10), payload: data(64 << 10, 0) }).await {
            err = Some(e);
            break;
        }
    }
    assert!(matches!(err, Some(StreamError::Stopped { .. })), "{err:?}");
    // A sender waiting on something else learns it too, also after it
    // finished (`stopped`, used by UCX's sends).
    let _ = tx.finish().await;
    let stopped = tokio::time::timeout(Duration::from_secs(10), tx.stopped()).await;
    assert!(matches!(stopped, Ok(StreamError::Stopped { .. })), "{stopped:?}");
    // The connection still works.
    let (mut tx2, mut rx2) = p.client.open(StreamKind::Call).await.unwrap();
    let mut inc2 = p.server.accept_or_first(&mut tx2).await;
    inc2.send.send_last(Frame::header_only(chunk_header(0, 0))).await.unwrap();
    assert!(rx2.recv().await.unwrap().is_some());
}

async fn raw_client(ep: &Endpoint) -> tokio::net::TcpStream {
    tokio::net::TcpStream::connect(ep.authority()).await.unwrap()
}

fn preface(window: u32) -> BytesMut {
    let mut b = BytesMut::new();
    Preface { version: frame::MUX_VERSION, stream_window: window, max_frame_payload: 1 << 20 }.encode(&mut b);
    b
}

fn data_frame(stream: u32, header: &FrameHeader, payload: &[u8], fin: bool) -> BytesMut {
    let meta = header.encode_to_vec();
    let mut b = BytesMut::new();
    frame::encode_frame(
        &Head {
            stream,
            kind: Kind::Data,
            flags: if fin { frame::FLAG_FIN } else { 0 },
            meta_len: meta.len() as u32,
            value: payload.len() as u32,
        },
        &meta,
        payload,
        &mut b,
    );
    b
}

/// Reads the server's preface and then frames until EOF; returns GOAWAY reasons.
async fn goaways(s: &mut tokio::net::TcpStream) -> Vec<String> {
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut all)).await;
    let mut out = vec![];
    let mut dec = frame::Decoder::new(frame::FrameLimits { max_meta: 1 << 20, max_payload: 1 << 26 });
    let mut buf = BytesMut::from(&all[frame::PREFACE_LEN.min(all.len())..]);
    while let Ok(Some(f)) = dec.decode(&mut buf) {
        if f.head.kind == Kind::GoAway {
            out.push(String::from_utf8_lossy(&f.meta).into_owned());
        }
    }
    out
}

#[tokio::test]
async fn frames_written_one_byte_at_a_time_are_reassembled() {
    let mut l = listen(&Endpoint::parse("tcp://127.0.0.1:0").unwrap(), &TransportConfig::default()).await.unwrap();
    let ep = l.local_endpoint();
    let writer = tokio::spawn(async move {
        let mut s = raw_client(&ep).await;
        let mut wire = preface(1 << 20);
        let payload = data(3000, 5);
        wire.put(data_frame(1, &chunk_header(0, 3000), &payload, false));
        wire.put(data_frame(1, &chunk_header(3000, 10), &payload[..10], true));
        for b in wire.iter() {
            s.write_all(&[*b]).await.unwrap();
            s.flush().await.unwrap();
        }
        let mut rest = vec![];
        let _ = s.read_to_end(&mut rest).await;
    });
    let conn = l.accept().await.unwrap();
    let mut inc = conn.accept().await.unwrap();
    let a = inc.recv.recv().await.unwrap().unwrap();
    let b = inc.recv.recv().await.unwrap().unwrap();
    assert!(inc.recv.recv().await.unwrap().is_none());
    assert_eq!(a.payload.len(), 3000);
    let Payload::Bytes(bb) = b.payload else { panic!() };
    assert_eq!(bb, data(3000, 5).slice(..10));
    conn.close("test over");
    writer.await.unwrap();
}

#[tokio::test]
async fn garbage_is_rejected_and_the_listener_keeps_serving() {
    let mut l = listen(&Endpoint::parse("tcp://127.0.0.1:0").unwrap(), &TransportConfig::default()).await.unwrap();
    let ep = l.local_endpoint();
    let mut s = raw_client(&ep).await;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    match l.accept().await {
        Err(AcceptError::Handshake { reason, .. }) => assert!(reason.contains("bad magic"), "{reason}"),
        other => panic!("expected a handshake error, got {:?}", other.map(|_| ())),
    }
    let reasons = goaways(&mut s).await;
    assert!(reasons.iter().any(|r| r.contains("not a tensorwire connection")), "{reasons:?}");
    // A wrong mux version is named.
    let mut s = raw_client(&ep).await;
    let mut p = preface(1 << 20);
    p[4] = 42;
    s.write_all(&p).await.unwrap();
    assert!(l.accept().await.is_err());
    assert!(goaways(&mut s).await.iter().any(|r| r.contains("unsupported mux version 42")));
    // A real client still gets through.
    let cfg = TransportConfig::default();
    let (c, srv) = tokio::join!(connect(&ep, &cfg), l.accept());
    let (c, srv) = (c.unwrap(), srv.unwrap());
    let (mut tx, mut rx) = c.open(StreamKind::Call).await.unwrap();
    let mut inc = srv.accept_or_first(&mut tx).await;
    inc.send.send_last(Frame::header_only(chunk_header(0, 0))).await.unwrap();
    assert!(rx.recv().await.unwrap().is_some());
}

#[tokio::test]
async fn credit_overrun_and_oversized_frames_close_only_that_connection() {
    let cfg = TransportConfig { stream_window: 64 << 10, max_frame_payload: 1 << 20, ..Default::default() };
    let mut l = listen(&Endpoint::parse("tcp://127.0.0.1:0").unwrap(), &cfg).await.unwrap();
    let ep = l.local_endpoint();
    // Overrun: 3 × 32 KiB on a 64 KiB window without waiting for credit.
    let mut s = raw_client(&ep).await;
    let mut wire = preface(1 << 20);
    for _ in 0..3 {
        wire.put(data_frame(1, &chunk_header(0, 32 << 10), &data(32 << 10, 0), false));
    }
    s.write_all(&wire).await.unwrap();
    let conn = l.accept().await.unwrap();
    let mut err = None;
    match conn.accept().await {
        Err(e) => err = Some(e),
        Ok(mut inc) => {
            for _ in 0..3 {
                match inc.recv.recv().await {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
            }
        }
    }
    assert!(matches!(&err, Some(StreamError::Protocol { reason, .. }) if reason.contains("credit")), "{err:?}");
    assert!(goaways(&mut s).await.iter().any(|r| r.contains("credit")));
    // Oversized: a frame head declaring 2 GiB of payload.
    let mut s = raw_client(&ep).await;
    let mut wire = preface(1 << 20);
    Head { stream: 1, kind: Kind::Data, flags: 0, meta_len: 0, value: 2 << 30 }.encode(&mut wire);
    s.write_all(&wire).await.unwrap();
    let conn2 = l.accept().await.unwrap();
    assert!(conn2.accept().await.is_err());
    assert!(goaways(&mut s).await.iter().any(|r| r.contains("exceeds the limit")));
    // Truncated: EOF inside a frame.
    let mut s = raw_client(&ep).await;
    let mut wire = preface(1 << 20);
    wire.put(&data_frame(1, &chunk_header(0, 100), &data(100, 0), false)[..50]);
    s.write_all(&wire).await.unwrap();
    s.shutdown().await.unwrap();
    let conn3 = l.accept().await.unwrap();
    // The stream may be announced before its payload turns out short: the
    // error then reaches its reader instead.
    let e = match conn3.accept().await {
        Ok(mut inc) => inc.recv.recv().await.expect_err("truncated payload must fail"),
        Err(e) => e,
    };
    assert!(e.to_string().contains("middle of a"), "{e}");
    // The listener still serves real clients.
    let (c, srv) = tokio::join!(connect(&ep, &cfg), l.accept());
    let (c, srv) = (c.unwrap(), srv.unwrap());
    let (mut tx, mut rx) = c.open(StreamKind::Call).await.unwrap();
    let mut inc = srv.accept_or_first(&mut tx).await;
    inc.send.send_last(Frame::header_only(chunk_header(0, 0))).await.unwrap();
    assert!(rx.recv().await.unwrap().is_some());
}

#[tokio::test]
async fn closing_fails_pending_calls_with_a_clear_error() {
    let p = pair("unix", TransportConfig::default()).await;
    let (mut tx, mut rx) = p.client.open(StreamKind::Call).await.unwrap();
    let _inc = p.server.accept_or_first(&mut tx).await;
    p.server.close("shutting down");
    let e = rx.recv().await.unwrap_err();
    assert!(e.to_string().contains("shutting down"), "{e}");
    assert!(
        p.client.open(StreamKind::Call).await.is_err() || p.client.is_closed() || {
            p.client.closed().await;
            true
        }
    );
    tokio::time::timeout(Duration::from_secs(5), p.client.closed()).await.unwrap();
}

#[tokio::test]
async fn streams_opened_in_one_order_and_used_in_another_all_arrive() {
    let p = pair("tcp", TransportConfig::default()).await;
    let mut opened = Vec::new();
    for _ in 0..20 {
        opened.push(p.client.open(StreamKind::Call).await.unwrap());
    }
    // Use them last-opened first: ids are assigned at first send, so the
    // peer never mistakes a stream for an old one.
    for (i, (tx, _)) in opened.iter_mut().enumerate().rev() {
        tx.send_last(Frame { header: chunk_header(0, 1), payload: Bytes::from(vec![i as u8]) }).await.unwrap();
    }
    let mut seen = Vec::new();
    for _ in 0..20 {
        let mut inc = tokio::time::timeout(Duration::from_secs(5), p.server.accept())
            .await
            .expect("every stream arrives")
            .unwrap();
        let r = inc.recv.recv().await.unwrap().unwrap();
        let Payload::Bytes(b) = r.payload else { panic!() };
        seen.push(b[0]);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..20).collect::<Vec<u8>>());
}

#[tokio::test]
async fn try_send_batch_sends_while_credit_lasts_and_hands_the_frames_back_after() {
    // A window of 1 MiB: two batches of 3 × 128 KiB fit, a third does not
    // until the reader reads. What is handed back is what was offered, and
    // `send_batch` then sends it once credit returns; the peer sees every
    // frame once, in order.
    for scheme in ["tcp", "unix"] {
        let p = pair(scheme, TransportConfig { stream_window: 1 << 20, ..Default::default() }).await;
        let (mut tx, _rx) = p.client.open(StreamKind::Send).await.unwrap();
        let batch = |seed: u8| -> Vec<Frame> {
            (0..3u8).map(|i| Frame { header: chunk_header(0, 128 << 10), payload: data(128 << 10, seed + i) }).collect()
        };
        for seed in [0, 10] {
            assert!(matches!(tx.try_send_batch(batch(seed), false), Ok(Ok(()))), "{scheme}: batch {seed} fits");
        }
        let back = match tx.try_send_batch(batch(20), true) {
            Err(back) => back,
            Ok(r) => panic!("{scheme}: a batch past the window was sent without credit: {r:?}"),
        };
        assert_eq!(back.len(), 3);
        for (i, f) in back.iter().enumerate() {
            assert_eq!(f.payload, data(128 << 10, 20 + i as u8), "{scheme}: frame {i} handed back untouched");
            assert_eq!(f.header, chunk_header(0, 128 << 10));
        }
        let sender = tokio::spawn(async move {
            tx.send_batch(back, true).await.unwrap();
            tx
        });
        let mut inc = p.server.accept().await.unwrap();
        for seed in [0u8, 10, 20] {
            for i in 0..3 {
                let r = inc.recv.recv().await.unwrap().expect("a frame");
                let payload = match r.payload {
                    Payload::Bytes(b) => b,
                    other => panic!("{scheme}: unexpected payload {other:?}"),
                };
                assert_eq!(payload, data(128 << 10, seed + i), "{scheme}: frame {seed}+{i}");
            }
        }
        assert!(inc.recv.recv().await.unwrap().is_none(), "{scheme}: the stream ends after the last batch");
        drop(sender.await.unwrap());
    }
}
