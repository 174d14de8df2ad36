//! The hand-written `tensorwire.v1.TensorService` over real HTTP/2 on
//! loopback: bad messages from a raw HTTP/2 client get clear errors (on
//! the server's stream and as gRPC statuses), and the server keeps serving.
#![cfg(feature = "grpc")]

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use tensorwire_proto::v1::{self, frame_header::Kind as HKind};
use tensorwire_transports::grpc::{GrpcChannel, channel};
use tensorwire_transports::{
    Connection, Endpoint, Frame, FrameHeader, Payload, Placement, RecvBuf, StreamError, StreamKind, TransportConfig,
    connect, listen,
};
use tonic::codegen::http;
use tower_service::Service;

/// A body of given frames (data, then maybe trailers).
struct Frames(VecDeque<http_body::Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(Ok))
    }
}

fn message(flag: u8, body: &[u8]) -> Bytes {
    let mut m = vec![flag];
    m.extend_from_slice(&(body.len() as u32).to_be_bytes());
    m.extend_from_slice(body);
    Bytes::from(m)
}

fn chunk_frame(tensor_id: u64, index: u32, offset: u64, payload: &[u8]) -> v1::Frame {
    let c = v1::Chunk {
        tensor_id,
        index,
        offset,
        raw_len: payload.len() as u64,
        compression: v1::Compression::None as i32,
        ..Default::default()
    };
    v1::Frame { header: Some(FrameHeader::new(HKind::Chunk(c))), payload: Bytes::copy_from_slice(payload) }
}

/// Sends `data` as the body of `path` with `headers`; the response's
/// grpc-status (headers or trailers) and message.
async fn raw_call(chan: &mut GrpcChannel, path: &str, headers: &[(&str, &str)], data: Vec<Bytes>) -> (String, String) {
    let uri = format!("{}{}", chan.origin().to_string().trim_end_matches('/'), path);
    let mut b = http::Request::builder().method("POST").uri(uri).header("te", "trailers");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(tonic::body::Body::new(Frames(data.into_iter().map(http_body::Frame::data).collect()))).unwrap();
    std::future::poll_fn(|cx| chan.poll_ready(cx)).await.unwrap();
    let resp = chan.call(req).await.unwrap();
    let (parts, mut body) = resp.into_parts();
    let get = |h: &http::HeaderMap| {
        let v = |k: &str| h.get(k).map(|v| v.to_str().unwrap_or("").to_string());
        v("grpc-status").map(|s| (s, v("grpc-message").unwrap_or_default()))
    };
    if let Some(s) = get(&parts.headers) {
        return s;
    }
    use http_body::Body as _;
    while let Some(f) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(t) = f.unwrap().into_trailers()
            && let Some(s) = get(&t)
        {
            return s;
        }
    }
    panic!("no grpc-status");
}

async fn server() -> (Box<dyn tensorwire_transports::Listener>, std::sync::Arc<dyn Connection>, Endpoint) {
    let ep = Endpoint::parse("grpc://127.0.0.1:0").unwrap();
    let mut l = listen(&ep, &TransportConfig::default()).await.unwrap();
    let local = l.local_endpoint();
    let conn = l.accept().await.unwrap();
    (l, conn, local)
}

#[tokio::test]
async fn bad_messages_get_clear_errors_and_the_server_keeps_serving() {
    let (_l, conn, ep) = server().await;
    let cfg = TransportConfig::default();
    let mut chan = channel(&ep, &cfg).await.unwrap();
    let limit = tensorwire_transports::grpc::message_limit(&cfg);

    // Refused before the pipeline sees a stream: unknown method, gRPC
    // compression, not gRPC at all.
    let ct = ("content-type", "application/grpc");
    let (code, msg) = raw_call(&mut chan, "/tensorwire.v1.TensorService/Nope", &[ct], vec![]).await;
    assert_eq!(code, "12", "{msg}");
    let (code, msg) =
        raw_call(&mut chan, "/tensorwire.v1.TensorService/Send", &[ct, ("grpc-encoding", "gzip")], vec![]).await;
    assert_eq!(code, "12");
    assert!(msg.contains("compression"), "{msg}");
    // Not gRPC: HTTP 415 (with a gRPC status); gRPC but not protobuf.
    let (code, msg) =
        raw_call(&mut chan, "/tensorwire.v1.TensorService/Send", &[("content-type", "text/plain")], vec![]).await;
    assert_eq!(code, "3", "{msg}");
    assert!(msg.contains("text/plain"), "{msg}");
    let (code, msg) =
        raw_call(&mut chan, "/tensorwire.v1.TensorService/Send", &[("content-type", "application/grpc+json")], vec![])
            .await;
    assert_eq!(code, "3", "{msg}");

    // Reach the pipeline's stream, which reports what was wrong.
    let frame = chunk_frame(1, 0, 0, b"abc").encode_to_vec();
    let huge_header = v1::Frame {
        header: Some(FrameHeader::new(HKind::Error(v1::Error {
            message: "x".repeat(cfg.max_header_bytes as usize + 1),
            ..Default::default()
        }))),
        payload: Bytes::new(),
    }
    .encode_to_vec();
    let send = "/tensorwire.v1.TensorService/Send";
    let cases: Vec<(&str, Vec<Bytes>, &str)> = vec![
        (send, vec![message(1, &frame)], "compression flag 1"),
        // A prefix declaring more than the limit: refused before anything is buffered.
        (send, vec![Bytes::from(vec![0, 0xff, 0xff, 0xff, 0xff])], "exceeds the limit"),
        // The body ends inside a message.
        (send, vec![message(0, &frame).slice(..9)], "ended inside a message"),
        // A payload field longer than its message.
        (send, vec![message(0, &[0x12, 50, 1, 2])], "malformed"),
        // A frame without a header.
        (send, vec![message(0, &[0x12, 1, 7])], "without a header"),
        // A frame header over max_header_bytes (within the message limit).
        (send, vec![message(0, &huge_header)], "frame header of"),
        // A one-message method called with none.
        ("/tensorwire.v1.TensorService/Handshake", vec![], "without its message"),
    ];
    for (path, data, want) in cases {
        let mut chan2 = chan.clone();
        let call = tokio::spawn(async move { raw_call(&mut chan2, path, &[ct], data).await });
        let inc = tokio::time::timeout(Duration::from_secs(5), conn.accept()).await.unwrap().unwrap();
        assert_eq!(inc.kind, Some(if path == send { StreamKind::Send } else { StreamKind::Handshake }));
        let mut recv = inc.recv;
        let err = recv.recv().await.expect_err(want);
        let text = err.to_string();
        assert!(text.to_lowercase().contains(&want.to_lowercase()), "{want}: {text}");
        if want == "exceeds the limit" {
            assert!(matches!(err, StreamError::ResourceExhausted { .. }), "{err:?}");
            assert!(text.contains(&limit.to_string()), "{text}");
        }
        drop((inc.send, recv));
        // The call ends with an error status, never OK.
        let (code, _) = tokio::time::timeout(Duration::from_secs(5), call).await.unwrap().unwrap();
        assert_ne!(code, "0");
    }

    // A good client is served on the same server afterwards, and a placed
    // chunk lands in the receiver's buffer.
    let client = connect(&ep, &cfg).await.unwrap();
    let (mut tx, mut rx) = client.open(StreamKind::Exchange).await.unwrap();
    let first = chunk_frame(9, 0, 0, &[1u8; 100]);
    let second = chunk_frame(9, 1, 100, &[2u8; 5000]);
    for f in [first, second] {
        tx.send(Frame { header: f.header.unwrap(), payload: f.payload }).await.unwrap();
    }
    tx.finish().await.unwrap();
    let inc = tokio::time::timeout(Duration::from_secs(5), conn.accept()).await.unwrap().unwrap();
    let (mut stx, mut srx) = (inc.send, inc.recv);
    let got = srx.recv().await.unwrap().unwrap();
    assert!(matches!(&got.payload, Payload::Bytes(b) if b[..] == [1u8; 100][..]));
    let place = Placement::new(RecvBuf::try_zeroed(5100).unwrap(), 9);
    srx.place(Some(place.clone()));
    let got = srx.recv().await.unwrap().unwrap();
    assert!(matches!(got.payload, Payload::Placed { offset: 100, len: 5000 }), "{:?}", got.payload.len());
    assert!(place.lock().await[100..].iter().all(|&b| b == 2));
    srx.place(None);
    assert!(srx.recv().await.unwrap().is_none());
    let reply = chunk_frame(10, 0, 0, b"reply");
    stx.send(Frame { header: reply.header.unwrap(), payload: reply.payload }).await.unwrap();
    stx.finish().await.unwrap();
    let r = rx.recv().await.unwrap().unwrap();
    assert!(matches!(&r.payload, Payload::Bytes(b) if &b[..] == b"reply"));
    assert!(rx.recv().await.unwrap().is_none());
}

/// A server at the TensorService's paths that answers every call with
/// `status`, `content_type` and `frames` (its body): what a proxy, a web
/// server or a broken gRPC server might send.
struct Fake {
    status: u16,
    content_type: &'static str,
    grpc_status_in_headers: bool,
    frames: Vec<http_body::Frame<Bytes>>,
}

impl Clone for Fake {
    fn clone(&self) -> Self {
        Fake { frames: self.frames.iter().map(clone_frame).collect(), ..*self }
    }
}

fn clone_frame(f: &http_body::Frame<Bytes>) -> http_body::Frame<Bytes> {
    match (f.data_ref(), f.trailers_ref()) {
        (Some(d), _) => http_body::Frame::data(d.clone()),
        (_, Some(t)) => http_body::Frame::trailers(t.clone()),
        _ => unreachable!("data or trailers"),
    }
}

impl tonic::server::NamedService for Fake {
    const NAME: &'static str = "tensorwire.v1.TensorService";
}

impl Service<http::Request<tonic::body::Body>> for Fake {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<tonic::body::Body>) -> Self::Future {
        let frames = Frames(self.frames.iter().map(clone_frame).collect());
        let mut b = http::Response::builder().status(self.status).header("content-type", self.content_type);
        if self.grpc_status_in_headers {
            b = b.header("grpc-status", "0");
        }
        std::future::ready(Ok(b.body(tonic::body::Body::new(frames)).unwrap()))
    }
}

async fn fake_server(fake: Fake) -> Endpoint {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ep = Endpoint::parse(&format!("grpc://{}", l.local_addr().unwrap())).unwrap();
    let incoming = futures_util::stream::unfold(l, |l| async move {
        let s = l.accept().await.map(|(s, _)| s);
        Some((s, l))
    });
    tokio::spawn(tonic::transport::Server::builder().add_service(fake).serve_with_incoming(incoming));
    ep
}

#[tokio::test]
async fn answers_that_are_not_a_grpc_reply_are_clear_errors() {
    let trailers = |status: &str| {
        let mut t = http::HeaderMap::new();
        t.insert("grpc-status", status.parse().unwrap());
        http_body::Frame::trailers(t)
    };
    let html = http_body::Frame::data(Bytes::from_static(b"<html>not found</html>"));
    let cases = [
        // A web server or proxy: the HTTP status maps to a gRPC code.
        (
            Fake {
                status: 404,
                content_type: "text/html",
                grpc_status_in_headers: false,
                frames: vec![clone_frame(&html)],
            },
            "Unimplemented",
        ),
        (
            Fake { status: 503, content_type: "text/html", grpc_status_in_headers: false, frames: vec![] },
            "HTTP status 503",
        ),
        // 200 but not gRPC.
        (
            Fake { status: 200, content_type: "text/html", grpc_status_in_headers: false, frames: vec![html] },
            "not a gRPC server",
        ),
        // OK without the one response message Send owes: trailers-only,
        // and a body that ends with OK trailers.
        (
            Fake { status: 200, content_type: "application/grpc", grpc_status_in_headers: true, frames: vec![] },
            "without its response message",
        ),
        (
            Fake {
                status: 200,
                content_type: "application/grpc",
                grpc_status_in_headers: false,
                frames: vec![trailers("0")],
            },
            "ended without its message",
        ),
    ];
    for (fake, want) in cases {
        let ep = fake_server(fake).await;
        let client = connect(&ep, &TransportConfig::default()).await.unwrap();
        let (mut tx, mut rx) = client.open(StreamKind::Send).await.unwrap();
        let f = chunk_frame(1, 0, 0, b"abc");
        let _ = tx.send(Frame { header: f.header.unwrap(), payload: f.payload }).await;
        let _ = tx.finish().await;
        let err = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().expect_err(want);
        assert!(err.to_string().contains(want), "{want}: {err}");
    }
}

/// A request body fed by the test as it goes.
struct Fed(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for Fed {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// Starts a `Send` call whose body is `body`; resolves to its grpc-status.
fn start_send(mut chan: GrpcChannel, body: tonic::body::Body) -> tokio::task::JoinHandle<String> {
    tokio::spawn(async move {
        let uri = format!("{}/tensorwire.v1.TensorService/Send", chan.origin().to_string().trim_end_matches('/'));
        let req = http::Request::builder()
            .method("POST")
            .uri(uri)
            .header("te", "trailers")
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap();
        std::future::poll_fn(|cx| chan.poll_ready(cx)).await.unwrap();
        let resp = chan.call(req).await.unwrap();
        let (parts, mut body) = resp.into_parts();
        if let Some(s) = parts.headers.get("grpc-status") {
            return s.to_str().unwrap().to_string();
        }
        use http_body::Body as _;
        while let Some(f) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            if let Ok(t) = f.unwrap().into_trailers()
                && let Some(s) = t.get("grpc-status")
            {
                return s.to_str().unwrap().to_string();
            }
        }
        panic!("no grpc-status");
    })
}

/// A listener whose calls report each frame they receive: (payload
/// length, first byte), or the error that ended the stream. Messages of up
/// to ~4 MiB; a connection may hold 4 MiB of unfinished ones (the message
/// limit); a small HTTP/2 stream window, so the client can only write what
/// the server has read.
async fn reporting_server(
    room_wait: Duration,
) -> (
    Box<dyn tensorwire_transports::Listener>,
    GrpcChannel,
    tokio::sync::mpsc::UnboundedReceiver<Result<(usize, u8), String>>,
) {
    let mut cfg = TransportConfig {
        connection_window: 4 << 20,
        max_frame_payload: 4 << 20,
        max_header_bytes: 4 << 10,
        ..TransportConfig::default()
    };
    cfg.grpc.stream_window = 128 << 10;
    cfg.grpc.room_wait = room_wait;
    let ep = Endpoint::parse("grpc://127.0.0.1:0").unwrap();
    let mut l = listen(&ep, &cfg).await.unwrap();
    let local = l.local_endpoint();
    let conn = l.accept().await.unwrap();
    let (got_tx, got) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(mut inc) = conn.accept().await {
            let got_tx = got_tx.clone();
            tokio::spawn(async move {
                loop {
                    match inc.recv.recv().await {
                        Ok(Some(r)) => {
                            let Payload::Bytes(b) = r.payload else { panic!("no placement registered") };
                            let _ = got_tx.send(Ok((b.len(), b.first().copied().unwrap_or(0))));
                        }
                        Ok(None) => break,
                        Err(e) => {
                            let _ = got_tx.send(Err(e.to_string()));
                            return;
                        }
                    }
                }
                let reply = Frame::header_only(FrameHeader::new(HKind::Reply(Default::default())));
                let _ = inc.send.send_last(reply).await;
            });
        }
    });
    let chan = channel(&local, &cfg).await.unwrap();
    (l, chan, got)
}

/// Starts a `Send` call and writes the first `upto` bytes of `msg` as its
/// body, in 64 KiB pieces; returns the feed (for the rest) and the call.
async fn start_fed(
    chan: &GrpcChannel,
    msg: &Bytes,
    upto: usize,
) -> (tokio::sync::mpsc::Sender<Bytes>, tokio::task::JoinHandle<String>) {
    let (feed, fed) = tokio::sync::mpsc::channel::<Bytes>(1);
    let call = start_send(chan.clone(), tonic::body::Body::new(Fed(fed)));
    for piece in msg[..upto].chunks(64 << 10) {
        feed.send(Bytes::copy_from_slice(piece)).await.unwrap();
    }
    (feed, call)
}

async fn finish_fed(feed: tokio::sync::mpsc::Sender<Bytes>, rest: &[u8]) {
    for piece in rest.chunks(64 << 10) {
        feed.send(Bytes::copy_from_slice(piece)).await.unwrap();
    }
}

fn whole(chan: &GrpcChannel, msg: Bytes) -> tokio::task::JoinHandle<String> {
    start_send(chan.clone(), tonic::body::Body::new(Frames(VecDeque::from([http_body::Frame::data(msg)]))))
}

fn seeded(seed: u8, len: usize) -> Bytes {
    message(0, &chunk_frame(u64::from(seed), 0, 0, &vec![seed; len]).encode_to_vec())
}

/// The tests that watch the process-wide gauge, one at a time (`cargo
/// test` runs them as threads of one process).
static GAUGE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Waits until the gRPC servers of this process hold `pred` bytes of
/// unfinished messages (the server has read what was written).
async fn held_until(what: &str, pred: impl Fn(u64) -> bool) -> u64 {
    for _ in 0..2000 {
        let n = tensorwire_transports::grpc::unfinished_message_bytes();
        if pred(n) {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{what}: the server holds {} bytes", tensorwire_transports::grpc::unfinished_message_bytes());
}

/// A server connection's calls hold at most `connection_window` bytes of
/// unfinished messages: hyper hands back a stream's credit as its DATA
/// frames are read, so without a bound of its own a peer could make the
/// server hold a whole message per call before any auth token is seen. A
/// frame past the bound waits (its call reads nothing more, so HTTP/2 flow
/// control stops its sender) while the call that began waiting first goes
/// on; once that one's message is complete the next goes on.
#[tokio::test]
async fn unfinished_messages_are_bounded_per_connection() {
    let _one = GAUGE.lock().await;
    let (_l, chan, mut got) = reporting_server(Duration::from_secs(60)).await;
    // A holds 3.5 MiB of a 4 MiB message (within the cap).
    let a_msg = seeded(0xA, 4 << 20);
    let (a_feed, a) = start_fed(&chan, &a_msg, 7 << 19).await;
    held_until("A's first 3.5 MiB", |n| n == 7 << 19).await;
    // B's first MiB of 2 takes the connection past its cap: B waits first,
    // so it goes on (and leads until its message is complete).
    let b_msg = seeded(0xB, 2 << 20);
    let (b_feed, b) = start_fed(&chan, &b_msg, 1 << 20).await;
    let ab = held_until("B's first MiB", |n| n == (7 << 19) + (1 << 20)).await;
    // C's whole 1 MiB message waits behind B.
    let c = whole(&chan, seeded(0xC, 1 << 20));
    held_until("C's first frame", |n| n > ab).await;
    let early = tokio::time::timeout(Duration::from_millis(300), got.recv()).await;
    assert!(early.is_err(), "C's message went through while B led a full connection: {early:?}");
    // B's message completes: the server takes it, then C goes on.
    finish_fed(b_feed, &b_msg[1 << 20..]).await;
    assert_eq!(got.recv().await.unwrap().unwrap(), (2 << 20, 0xB), "B's message, whole");
    assert_eq!(got.recv().await.unwrap().unwrap(), (1 << 20, 0xC), "then C's");
    assert_eq!(b.await.unwrap(), "0");
    assert_eq!(c.await.unwrap(), "0");
    finish_fed(a_feed, &a_msg[7 << 19..]).await;
    assert_eq!(got.recv().await.unwrap().unwrap(), (4 << 20, 0xA), "A's message, whole");
    assert_eq!(a.await.unwrap(), "0");
    held_until("every message taken", |n| n == 0).await;
}

/// A call that waits for room while no message on its connection
/// completes fails with why once `room_wait` has passed; the calls it
/// waited behind are unharmed.
#[tokio::test]
async fn a_call_that_waits_too_long_for_room_fails_with_why() {
    let _one = GAUGE.lock().await;
    let (_l, chan, mut got) = reporting_server(Duration::from_millis(300)).await;
    let d_msg = seeded(0xD, 4 << 20);
    let (d_feed, d) = start_fed(&chan, &d_msg, 7 << 19).await;
    held_until("D's first 3.5 MiB", |n| n == 7 << 19).await;
    // F leads past the cap and never finishes its message; E waits behind it.
    let f_msg = seeded(0xF, 2 << 20);
    let (f_feed, f) = start_fed(&chan, &f_msg, 1 << 20).await;
    held_until("F's first MiB", |n| n == (7 << 19) + (1 << 20)).await;
    let _e = whole(&chan, seeded(0xE, 1 << 20));
    let e = got.recv().await.unwrap().expect_err("E fails");
    assert!(e.contains("resource exhausted") && e.contains("unfinished messages"), "{e}");
    // F's client gives up; D completes.
    drop(f_feed);
    f.abort();
    assert!(got.recv().await.unwrap().is_err(), "F's stream ends with an error");
    finish_fed(d_feed, &d_msg[7 << 19..]).await;
    assert_eq!(got.recv().await.unwrap().unwrap(), (4 << 20, 0xD), "D's message, whole");
    assert_eq!(d.await.unwrap(), "0");
    held_until("every message taken or dropped", |n| n == 0).await;
}

/// A gRPC listener keeps at most `max_connections` open (and at most
/// `max_connections_per_peer` from one address); the next client is told why (an HTTP/2 GOAWAY), and a place that frees up is taken again.
#[tokio::test]
async fn a_listener_refuses_connections_past_its_cap_and_says_why() {
    let total = TransportConfig { max_connections: Some(1), ..TransportConfig::default() };
    let per_peer = TransportConfig { max_connections_per_peer: Some(1), ..TransportConfig::default() };
    for (cfg, why) in [(total, "too many connections: 1 open"), (per_peer, "too many connections from 127.0.0.1")] {
        refused_past_the_cap(cfg, why).await;
    }
}

async fn refused_past_the_cap(cfg: TransportConfig, why: &str) {
    let ep = Endpoint::parse("grpc://127.0.0.1:0").unwrap();
    let mut l = listen(&ep, &cfg).await.unwrap();
    let local = l.local_endpoint();
    let _conn = l.accept().await.unwrap();
    let ct = ("content-type", "application/grpc");
    let mut first = channel(&local, &cfg).await.unwrap();
    let (code, _) = raw_call(&mut first, "/tensorwire.v1.TensorService/Nope", &[ct], vec![]).await;
    assert_eq!(code, "12", "the first connection is served");

    let refused = async {
        let mut chan = channel(&local, &cfg).await.map_err(|e| format!("{e:?}"))?;
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("{}/tensorwire.v1.TensorService/Nope", chan.origin().to_string().trim_end_matches('/')))
            .header("content-type", "application/grpc")
            .body(tonic::body::Body::empty())
            .unwrap();
        std::future::poll_fn(|cx| chan.poll_ready(cx)).await.map_err(|e| format!("{e:?}"))?;
        chan.call(req).await.map(|_| ()).map_err(|e| format!("{e:?}"))
    };
    let msg = refused.await.expect_err("a second connection is refused");
    assert!(msg.contains(why), "{msg}");

    // The first one closes; its place is free again (after its lingering close).
    drop(first);
    let mut served = false;
    for _ in 0..50 {
        let Ok(mut chan) = channel(&local, &cfg).await else { continue };
        let uri = format!("{}/tensorwire.v1.TensorService/Nope", chan.origin().to_string().trim_end_matches('/'));
        let req = http::Request::builder()
            .method("POST")
            .uri(uri)
            .header("content-type", "application/grpc")
            .body(tonic::body::Body::empty())
            .unwrap();
        if std::future::poll_fn(|cx| chan.poll_ready(cx)).await.is_ok() && chan.call(req).await.is_ok() {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served, "a freed place is taken again");
}
