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

/// A request body of given DATA frames.
struct Chunks(VecDeque<Bytes>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
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
    let req = b.body(tonic::body::Body::new(Chunks(data.into()))).unwrap();
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
    let (code, _) =
        raw_call(&mut chan, "/tensorwire.v1.TensorService/Send", &[("content-type", "text/plain")], vec![]).await;
    assert_eq!(code, "3");

    // Reach the pipeline's stream, which reports what was wrong.
    let frame = chunk_frame(1, 0, 0, b"abc").encode_to_vec();
    let cases: Vec<(Vec<Bytes>, &str)> = vec![
        (vec![message(1, &frame)], "compression flag 1"),
        // A prefix declaring more than the limit: refused before anything is buffered.
        (vec![Bytes::from(vec![0, 0xff, 0xff, 0xff, 0xff])], "exceeds the limit"),
        // The body ends inside a message.
        (vec![message(0, &frame).slice(..9)], "ended inside a message"),
        // A payload field longer than its message.
        (vec![message(0, &[0x12, 50, 1, 2])], "malformed"),
        // A frame without a header.
        (vec![message(0, &[0x12, 1, 7])], "without a header"),
    ];
    for (data, want) in cases {
        let mut chan2 = chan.clone();
        let call =
            tokio::spawn(async move { raw_call(&mut chan2, "/tensorwire.v1.TensorService/Send", &[ct], data).await });
        let inc = tokio::time::timeout(Duration::from_secs(5), conn.accept()).await.unwrap().unwrap();
        assert_eq!(inc.kind, Some(StreamKind::Send));
        let mut recv = inc.recv;
        let err = recv.recv().await.expect_err(want);
        let text = err.to_string();
        assert!(text.to_lowercase().contains(&want.to_lowercase()), "{want}: {text}");
        if want == "exceeds the limit" {
            assert!(matches!(err, StreamError::Protocol { .. }), "{err:?}");
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
