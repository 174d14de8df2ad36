//! Shared helpers for the integration tests.
#![allow(dead_code)]

pub mod cli;
pub mod pki;
pub mod proxy;
pub mod python;

use std::path::PathBuf;

use tensorwire::StoreService;
use tensorwire::builtins::{builtin_functions, random_tensor};
use tensorwire::{DType, RunningServer, Server, ServerBuilder, ServerConfig, Tensor};

/// A listen URL for `scheme` on loopback (Unix sockets in a fresh temp dir).
/// `tcp` stays TCP (`?shm=0`: the server offers no shared-memory upgrade
/// and its URL tells clients to refuse one); `tcp+shm` is TCP that
/// same-host clients upgrade to shared memory (the default of `tcp://`).
pub fn listen_url(scheme: &str) -> (String, Option<tempfile::TempDir>) {
    match scheme {
        "tcp" => ("tcp://127.0.0.1:0?shm=0".into(), None),
        "tcp+shm" => ("tcp://127.0.0.1:0".into(), None),
        "unix" | "grpc+unix" | "shm" => {
            let dir = tempfile::tempdir().unwrap();
            let p: PathBuf = dir.path().join("tw.sock");
            let url = match scheme {
                "shm" => format!("shm://tw-test-{}", rand_suffix()),
                _ => format!("{scheme}://{}", p.display()),
            };
            (url, Some(dir))
        }
        other => (format!("{other}://127.0.0.1:0"), None),
    }
}

fn rand_suffix() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let n = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos();
    format!("{}-{n}", std::process::id())
}

/// A server with the CLI's store service and built-in functions.
pub fn store_server(config: ServerConfig) -> ServerBuilder {
    let mut b = Server::builder().config(config).service(StoreService::default());
    for f in builtin_functions() {
        b = b.function(f);
    }
    b
}

/// Starts `builder` on `scheme`; keeps the temp dir alive with the server.
pub async fn start(builder: ServerBuilder, scheme: &str) -> (RunningServer, Option<tempfile::TempDir>) {
    let (url, dir) = listen_url(scheme);
    let server = builder.build().start([url]).await.expect("server starts");
    (server, dir)
}

/// Tensors of several dtypes and sizes: 1 byte, 1 MiB + 1, 64 MiB, and a
/// non-contiguous (transposed and narrowed) view.
pub fn sample_tensors(big: bool) -> Vec<Tensor> {
    let mut v = vec![
        random_tensor(DType::UInt8, &[1], 1).unwrap().with_name("one-byte"),
        random_tensor(DType::UInt8, &[(1 << 20) + 1], 2).unwrap().with_name("mib-plus-one"),
        random_tensor(DType::BFloat16, &[3, 5, 7], 3).unwrap().with_name("bf16"),
        random_tensor(DType::Float64, &[257, 129], 4).unwrap().transpose(0, 1).unwrap().with_name("transposed"),
        random_tensor(DType::Int32, &[300, 400], 5).unwrap().narrow(1, 7, 100).unwrap().with_name("narrowed"),
        random_tensor(DType::Complex64, &[0, 4], 6).unwrap().with_name("empty"),
        random_tensor(DType::Bool, &[17], 7).unwrap().with_metadata("kind", "mask").with_name("mask"),
    ];
    if big {
        v.push(random_tensor(DType::Float32, &[16, 1 << 20], 8).unwrap().with_name("64mib"));
    }
    v
}

/// Bit-for-bit: dtype, shape and every element's bytes.
pub fn assert_same(a: &Tensor, b: &Tensor) {
    assert_eq!(a.dtype(), b.dtype(), "dtype of {:?}", a.name());
    assert_eq!(a.shape(), b.shape(), "shape of {:?}", a.name());
    assert_eq!(a.crc32c().unwrap(), b.crc32c().unwrap(), "data of {:?}", a.name());
    assert!(a.data_eq(b), "data of {:?}", a.name());
}

/// A raw transport connection to `url` that has done the tensorwire
/// handshake (Hello with `token`, Welcome back): for tests that then speak
/// frames a well-behaved client would not.
pub async fn raw_handshake(url: &str, token: &str) -> std::sync::Arc<dyn tensorwire_transports::Connection> {
    use tensorwire_proto::v1::{self, frame_header::Kind};
    use tensorwire_transports::{Frame, FrameHeader, StreamKind};
    let ep = tensorwire_transports::Endpoint::parse(url).unwrap();
    let conn = tensorwire_transports::connect(&ep, &Default::default()).await.unwrap();
    let hello = v1::Hello { version: tensorwire::PROTOCOL_VERSION, auth_token: token.into(), ..Default::default() };
    let (mut tx, mut rx) = conn.open(StreamKind::Handshake).await.unwrap();
    tx.send_last(Frame::header_only(FrameHeader::new(Kind::Hello(Box::new(hello))))).await.unwrap();
    let r = rx.recv().await.unwrap().unwrap();
    assert!(matches!(r.header.kind, Some(Kind::Welcome(_))), "{:?}", r.header);
    conn
}

/// Polls `cond` every few milliseconds until it holds or `within` has
/// passed; says whether it held. For what a server does in the background
/// (a call it lets go of, a connection it sees closed): a loaded machine
/// may take long, so tests wait on the fact, not a fixed sleep.
pub async fn wait_until(within: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
