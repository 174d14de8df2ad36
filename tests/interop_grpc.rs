//! gRPC interop with real grpcio peers (installed by tests/run.sh): the
//! standard health service through a shutdown, reflection, a Python client
//! generated from proto/, the skytorch Python client against the Rust
//! server, and the Rust compat client against a Python skytorch server.
//! Also, without Python: the compat client against the Rust server, bad
//! compat input, and per-call auth over gRPC.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::python::{python, run};
use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::grpc::CompatClient;
use tensorwire::{CallError, Client, ClientConfig, Code, DType, Function, Output, ServerConfig, Status, Tensor};

fn proto_dir() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("proto").display().to_string()
}

fn host_port(url: &str) -> String {
    tensorwire_transports::Endpoint::parse(url).unwrap().authority()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_serving_then_not_serving_during_shutdown() {
    let Some(py) = python() else { return };
    let cfg = ServerConfig { shutdown_grace: Duration::from_secs(20), ..Default::default() };
    // A call that lasts until released keeps the server in its grace period.
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = std::sync::Mutex::new(release_rx);
    let slow = Function::new("hold", move |_c| {
        let _ = release_rx.lock().unwrap().recv_timeout(Duration::from_secs(20));
        Ok(Output::default())
    });
    let (server, _dir) = start(store_server(cfg).function(slow), "grpc").await;
    let addr = host_port(&server.url());
    let services = ["-", "tensorwire.v1.TensorService", "skytorch.torch.Service"];
    let mut args = vec![addr.as_str(), "SERVING"];
    args.extend(services);
    let py2 = py.clone();
    let a2: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = a2.iter().map(String::as_str).collect();
        run(&py2, "grpc_interop.py", &[&["health"], &a[..]].concat())
    })
    .await
    .unwrap();

    // Watch from before the shutdown: SERVING, then NOT_SERVING.
    let mut watcher = Command::new(&py)
        .arg(common::python::script("grpc_interop.py"))
        .args(["watch", &addr])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The watcher's first answer must be in before the shutdown begins (a
    // Python process takes a while to start under load).
    let mut watch_out = std::io::BufReader::new(watcher.stdout.take().unwrap());
    let (first, watch_out) = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = std::io::BufRead::read_line(&mut watch_out, &mut line);
        (line, watch_out)
    })
    .await
    .unwrap();
    assert_eq!(first, "SERVING\n", "the watcher's first answer");
    let client = Client::connect(&server.url()).await.unwrap();
    let held = tokio::spawn(async move { client.call("hold", vec![], Default::default()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shutdown = tokio::spawn(server.shutdown());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!shutdown.is_finished(), "shutdown waits for the call in flight");

    let py2 = py.clone();
    let a2: Vec<String> = args.iter().map(|s| s.replace("SERVING", "NOT_SERVING")).collect();
    let out = tokio::task::spawn_blocking(move || {
        let a: Vec<&str> = a2.iter().map(String::as_str).collect();
        run(&py2, "grpc_interop.py", &[&["health"], &a[..]].concat())
    })
    .await
    .unwrap();
    assert!(out.contains("'skytorch.torch.Service': NOT_SERVING"), "{out}");

    release_tx.send(()).unwrap();
    assert!(held.await.unwrap().is_ok(), "the call in flight completes during the grace period");
    tokio::time::timeout(Duration::from_secs(20), shutdown).await.unwrap().unwrap();
    let text = tokio::task::spawn_blocking(move || {
        let mut rest = String::new();
        let mut r = watch_out;
        let _ = std::io::Read::read_to_string(&mut r, &mut rest);
        let _ = watcher.wait();
        rest
    })
    .await
    .unwrap();
    assert!(text.contains("NOT_SERVING"), "after SERVING, the watch saw: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_and_describes_the_services() {
    let Some(py) = python() else { return };
    let (server, _dir) = start(store_server(ServerConfig::default()), "grpc").await;
    let addr = host_port(&server.url());
    let out = tokio::task::spawn_blocking(move || run(&py, "grpc_interop.py", &["reflect", &addr])).await.unwrap();
    assert!(out.contains("TensorChunk fields: ['tensor_id', 'chunk_number', 'data'"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_generated_from_the_protos_sends_and_fetches() {
    let Some(py) = python() else { return };
    let (server, _dir) = start(store_server(ServerConfig::default()), "grpc").await;
    let addr = host_port(&server.url());
    tokio::task::spawn_blocking(move || run(&py, "grpc_interop.py", &["tensorservice", &addr, &proto_dir()]))
        .await
        .unwrap();
    // What Python sent is stored under its name, bit for bit.
    let client = Client::connect(&server.url()).await.unwrap();
    let t = client.fetch_one("from-python").await.unwrap();
    let want: Vec<f32> = (0..300_000).map(|i| i as f32).collect();
    assert_eq!(t.shape(), [600, 500]);
    assert_eq!(t.as_slice::<f32>().unwrap(), &want[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_skytorch_client_round_trips_through_the_rust_server() {
    let Some(py) = python() else { return };
    let (server, _dir) = start(store_server(ServerConfig::default()), "grpc").await;
    let addr = host_port(&server.url());
    let out = tokio::task::spawn_blocking(move || run(&py, "grpc_interop.py", &["compat-client", &addr, &proto_dir()]))
        .await
        .unwrap();
    assert!(out.contains("torch.equal ok"), "{out}");
    assert!(out.contains("malicious pickle:"), "{out}");
    // Compat calls count in the server's statistics like native ones.
    assert!(server.info().calls >= 8, "{:?}", server.info());
}

struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_compat_client_talks_to_a_python_skytorch_server() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let port_file = dir.path().join("port");
    let _server = Killed(
        Command::new(&py)
            .arg(common::python::script("grpc_interop.py"))
            .args(["compat-server", port_file.to_str().unwrap(), &proto_dir()])
            .spawn()
            .unwrap(),
    );
    let mut port = String::new();
    for _ in 0..600 {
        if let Ok(p) = std::fs::read_to_string(&port_file) {
            port = p;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!port.is_empty(), "the Python server did not start");
    let mut c = CompatClient::connect(&format!("grpc://127.0.0.1:{port}")).await.unwrap();

    let big = random_tensor(DType::Float32, &[512, 1024], 3).unwrap();
    let small = Tensor::from_vec([2, 2], vec![1i64, 2, 3, 4]).unwrap();
    let r = c.send_tensors(vec![big.clone(), small.clone()]).await.unwrap();
    assert!(r.success && r.received_count == 2, "{r:?}");

    let got = c.receive_tensors(3, [("shape", "4,5")]).await.unwrap();
    assert_eq!(got.len(), 3);
    for (i, t) in got.iter().enumerate() {
        assert_eq!(t.shape(), [4, 5]);
        let want: Vec<f32> = (0..20).map(|j| (j + i) as f32).collect();
        assert_eq!(t.as_slice::<f32>().unwrap(), &want[..]);
    }

    // The Python server's _process_tensor: t * 2 + 1.
    let x = Tensor::from_vec([3], vec![1.0f32, 2.0, 3.0]).unwrap();
    let out = c.stream_tensors(vec![x, big.clone()]).await.unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[3.0, 5.0, 7.0]);
    let want: Vec<f32> = big.as_slice::<f32>().unwrap().iter().map(|v| v * 2.0 + 1.0).collect();
    assert_eq!(out[1].as_slice::<f32>().unwrap(), &want[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compat_client_against_the_rust_server_and_bad_compat_input() {
    use tensorwire_proto::compat::TensorChunk;
    use tensorwire_proto::compat::service_client::ServiceClient;

    for scheme in ["grpc", "grpcs", "grpc+unix"] {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let url = server.url();
        let mut c = CompatClient::connect(&url).await.unwrap();
        let samples = sample_tensors(true);
        let r = c.send_tensors(samples.clone()).await.unwrap();
        assert!(r.success && r.received_count == samples.len() as i32, "{r:?}");
        let native = Client::connect(&url).await.unwrap();
        for t in &samples {
            // Named tensors keep their names through the compat protocol.
            let back = native.fetch_one(t.name().unwrap()).await.unwrap();
            assert_eq!(back.shape(), t.shape());
            assert!(back.data_eq(t), "{:?}", t.name());
        }
        let echoed = c.stream_tensors(samples.clone()).await.unwrap();
        assert_eq!(echoed.len(), samples.len());
        for (a, b) in samples.iter().zip(&echoed) {
            assert!(a.data_eq(b), "{:?}", a.name());
        }
        let got = c.receive_tensors(2, [("shape", "50,50")]).await.unwrap();
        assert!(got.len() == 2 && got.iter().all(|t| t.shape() == [50, 50]));
        let names = c.receive_tensors(0, [("names", "bf16,mask")]).await.unwrap();
        assert_eq!(names.len(), 2);

        if scheme != "grpc" {
            continue;
        }
        // Bad input through the raw protocol: clear errors, and the server keeps serving.
        let chan = tensorwire_transports::grpc::channel(
            &tensorwire_transports::Endpoint::parse(&url).unwrap(),
            &Default::default(),
        )
        .await
        .unwrap();
        let mut raw = ServiceClient::with_origin(chan.clone(), chan.origin().clone());
        let chunk = |id: &str, n: u32, total: u32, data: &'static [u8]| TensorChunk {
            tensor_id: id.into(),
            chunk_number: n,
            data: bytes::Bytes::from_static(data),
            total_chunks: total,
            is_last: n + 1 == total,
            metadata: Default::default(),
        };
        let cases: Vec<(Vec<TensorChunk>, &str)> = vec![
            (vec![chunk("a", 0, 2, b"PK")], "incomplete"),
            (vec![chunk("b", 0, 1, b"definitely not a zip file")], "not a torch.save() file"),
            (vec![chunk("c", 3, 2, b"x")], "chunk 3 of a tensor with 2 chunks"),
            (vec![chunk("d", 0, 2, b"x"), chunk("d", 0, 2, b"x")], "sent twice"),
        ];
        for (chunks, want) in cases {
            let e = raw.receive_tensors(tokio_stream::iter(chunks)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
            assert!(e.message().contains(want), "{want}: {}", e.message());
        }
        // A lying size: more bytes than the server's tensor limit.
        let small = ServerConfig {
            limits: tensorwire::Limits { max_tensor_bytes: 1 << 20, ..Default::default() },
            ..Default::default()
        };
        let (limited, _d) = start(store_server(small), "grpc").await;
        let mut lc = CompatClient::connect(&limited.url()).await.unwrap();
        let e = lc.send_tensors(vec![Tensor::zeros(DType::UInt8, [3 << 20]).unwrap()]).await.unwrap_err();
        assert!(matches!(&e, CallError::Remote(Status { code: Code::ResourceExhausted, .. })), "oversized tensor: {e}");
        assert!(c.send_tensors(vec![Tensor::from_vec([1], vec![1u8]).unwrap()]).await.unwrap().success);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_token_is_checked_on_every_grpc_call() {
    let cfg = ServerConfig { auth_token: Some("s3cret".into()), ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "grpc").await;
    let url = server.url();
    let x = Tensor::from_vec([2], vec![1.0f32, 2.0]).unwrap();

    // Refused at the handshake, and a call that skips it is refused too.
    let e = Client::connect(&url).await.unwrap_err();
    assert!(e.to_string().contains("auth token"), "{e}");
    let ep = tensorwire_transports::Endpoint::parse(&url).unwrap();
    let conn = tensorwire_transports::connect(&ep, &Default::default()).await.unwrap();
    let (mut tx, mut rx) = conn.open(tensorwire_transports::StreamKind::Call).await.unwrap();
    let req = tensorwire_proto::v1::Request { method: tensorwire_proto::v1::Method::Info as i32, ..Default::default() };
    let kind = tensorwire_proto::v1::frame_header::Kind::Request(Box::new(req));
    tx.send_last(tensorwire_transports::Frame::header_only(tensorwire_transports::FrameHeader::new(kind)))
        .await
        .unwrap();
    let h = rx.recv().await.unwrap().unwrap().header;
    match h.kind {
        Some(tensorwire_proto::v1::frame_header::Kind::Error(e)) => assert!(e.message.contains("auth token"), "{e:?}"),
        other => panic!("expected an error, got {other:?}"),
    }

    let ok = ClientConfig { auth_token: Some("s3cret".into()), ..Default::default() };
    let c = Client::connect_with(&url, ok.clone()).await.unwrap();
    assert!(c.compute("identity", vec![x.clone()]).await.unwrap()[0].data_eq(&x));

    // The compat protocol takes it as `authorization: Bearer …`.
    let mut anon = CompatClient::connect(&url).await.unwrap();
    let e = anon.send_tensors(vec![x.clone()]).await.unwrap_err();
    assert!(matches!(&e, CallError::Remote(Status { code: Code::Unauthenticated, .. })), "{e}");
    let mut good = CompatClient::connect_with(&url, &ok).await.unwrap();
    assert!(good.send_tensors(vec![x]).await.unwrap().success);
}

/// The compat service checks a caller's token before it reads the
/// request: an unauthenticated `SendTensors` whose request announces 60 MiB
/// (and never sends them) is answered UNAUTHENTICATED at once, instead of
/// the server waiting to collect (and hold) the whole message first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compat_tokens_are_checked_before_a_request_is_read() {
    use tonic::codegen::{Service as _, http};
    let cfg = ServerConfig { auth_token: Some("s3cret".into()), ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "grpc").await;
    let ep = tensorwire_transports::Endpoint::parse(&server.url()).unwrap();
    let mut chan = tensorwire_transports::grpc::channel(&ep, &Default::default()).await.unwrap();
    type Piece = Result<hyper::body::Frame<bytes::Bytes>, std::convert::Infallible>;
    let (tx, rx) = tokio::sync::mpsc::channel::<Piece>(1);
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(&(60u32 << 20).to_be_bytes());
    tx.send(Ok(hyper::body::Frame::data(bytes::Bytes::from(prefix)))).await.unwrap();
    let body = tonic::body::Body::new(http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)));
    let uri = format!("{}/skytorch.torch.Service/SendTensors", chan.origin().to_string().trim_end_matches('/'));
    let req = http::Request::builder()
        .method("POST")
        .uri(uri)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(body)
        .unwrap();
    std::future::poll_fn(|cx| chan.poll_ready(cx)).await.unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), chan.call(req))
        .await
        .expect("answered without waiting for the request's message")
        .unwrap();
    let status = resp.headers().get("grpc-status").map(|v| v.to_str().unwrap().to_string());
    assert_eq!(status.as_deref(), Some("16"), "UNAUTHENTICATED: {:?}", resp.headers());
    drop(tx);
}

/// Wrong tokens on native gRPC calls are counted per client address, not
/// for every gRPC client at once (the server's one gRPC "connection"
/// carries all of them): the refusal names the address it counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_auth_failures_are_counted_per_client_address() {
    use tensorwire_proto::v1::frame_header::Kind;
    let cfg = ServerConfig { auth_token: Some("s3cret".into()), max_auth_failures: 2, ..Default::default() };
    let (server, _dir) = start(store_server(cfg), "grpc").await;
    let ep = tensorwire_transports::Endpoint::parse(&server.url()).unwrap();
    let conn = tensorwire_transports::connect(&ep, &Default::default()).await.unwrap();
    let mut last = String::new();
    for _ in 0..3 {
        let (mut tx, mut rx) = conn.open(tensorwire_transports::StreamKind::Call).await.unwrap();
        let req = tensorwire_proto::v1::Request {
            method: tensorwire_proto::v1::Method::Info as i32,
            auth_token: "wrong".into(),
            ..Default::default()
        };
        let head = tensorwire_transports::FrameHeader::new(Kind::Request(Box::new(req)));
        tx.send_last(tensorwire_transports::Frame::header_only(head)).await.unwrap();
        match rx.recv().await.unwrap().unwrap().header.kind {
            Some(Kind::Error(e)) => last = e.message,
            other => panic!("expected an error, got {other:?}"),
        }
    }
    assert!(last.contains("too many wrong auth tokens from 127.0.0.1"), "{last}");
}

/// A server's gRPC listener is not one of the connections its connection
/// caps count and evict: at the cap, a new native connection used to
/// close the "oldest idle connection", which was the gRPC listener's one
/// connection, and so stop the gRPC server for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_connections_at_the_cap_never_evict_the_grpc_server() {
    let cfg = ServerConfig { max_connections: 2, ..Default::default() };
    let server = store_server(cfg).build().start(["grpc://127.0.0.1:0", "tcp://127.0.0.1:0?shm=0"]).await.unwrap();
    let grpc = server.endpoints()[0].to_string();
    let tcp = server.endpoints()[1].to_string();
    let x = Tensor::from_vec([2], vec![1.0f32, 2.0]).unwrap();
    // Two native clients take both places (the second makes room by
    // closing the first, idle one), and a third does again.
    let mut natives = vec![];
    for _ in 0..3 {
        let c = Client::connect(&tcp).await.unwrap();
        assert!(c.compute("identity", vec![x.clone()]).await.unwrap()[0].data_eq(&x));
        natives.push(c);
    }
    let g = Client::connect(&grpc).await.unwrap();
    assert!(g.compute("identity", vec![x.clone()]).await.unwrap()[0].data_eq(&x), "gRPC still served");
}
