//! The pipeline (send, fetch, exchange, compute) over real sockets on
//! loopback, every test on every transport.

mod common;

use std::time::Duration;

use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{
    Args, CallError, Client, ClientConfig, Code, CodecKind, Compression, CompressionMode, DType, Encoding,
    FetchRequest, Limits, ServerConfig, Tensor,
};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{self as transports, Frame, FrameHeader, StreamKind};

mod suite {
    use super::*;

    pub async fn send_then_fetch_every_sample(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let samples = sample_tensors(true);
        let summary = client.send(samples.clone()).await.unwrap();
        assert_eq!(summary.received, samples.len() as u64);
        assert_eq!(summary.bytes, samples.iter().map(|t| t.nbytes() as u64).sum::<u64>());
        for t in &samples {
            let back = client.fetch_one(t.name().unwrap()).await.unwrap();
            assert_same(t, &back);
            assert_eq!(back.name(), t.name());
            assert_eq!(back.metadata(), t.metadata());
        }
        // A transpose travels with its strides (no copy); a narrowed view is made contiguous.
        let tr = client.fetch_one("transposed").await.unwrap();
        assert!(!tr.is_contiguous() && tr.is_dense());
        assert!(client.fetch_one("narrowed").await.unwrap().is_contiguous());
    }

    pub async fn exchange_echoes_in_order(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let samples = sample_tensors(true);
        let out = client.exchange_all(samples.clone()).await.unwrap();
        assert_eq!(out.len(), samples.len());
        for (a, b) in samples.iter().zip(&out) {
            assert_same(a, b);
        }
    }

    /// Refuses every exchanged tensor.
    struct Refusing;

    #[async_trait::async_trait]
    impl tensorwire::TensorService for Refusing {
        async fn process(&self, _: &tensorwire::CallContext, _: Tensor) -> Result<Vec<Tensor>, tensorwire::Status> {
            Err(tensorwire::Status::invalid_argument("this service takes no inputs"))
        }
    }

    /// Ends every exchange at once, inputs unread.
    struct Deaf;

    #[async_trait::async_trait]
    impl tensorwire::TensorService for Deaf {
        async fn exchange(
            &self,
            _: &tensorwire::CallContext,
            _: &mut tensorwire::TensorStream,
            _: &mut tensorwire::TensorSink<'_>,
        ) -> Result<(), tensorwire::Status> {
            Ok(())
        }
    }

    /// An exchange the server fails, or ends without reading its inputs,
    /// while the caller's inputs are still open (the next input waits for
    /// an answer that will not come): the answers end with the server's
    /// error, or cleanly, instead of waiting for inputs; an input the
    /// client itself refuses (over the server's announced limit) ends them
    /// with the client's reason.
    pub async fn exchange_ended_by_the_server_ends_while_inputs_wait(scheme: &str) {
        let cfg = ServerConfig { limits: Limits { max_tensor_bytes: 1024, ..Limits::default() }, ..Default::default() };
        let (deaf, _dir) = start(tensorwire::Server::builder().config(cfg.clone()).service(Deaf), scheme).await;
        let client = Client::connect(&deaf.url()).await.unwrap();
        // A clean end; then the same, but this side refused its input
        // (over the server's limit): that refusal is the outcome.
        for (size, code) in [(16, None), (4096, Some(Code::LimitExceeded))] {
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Tensor>(1);
            let inputs = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
            let mut answers = client.exchange(inputs).await.unwrap();
            tx.send(Tensor::zeros(DType::UInt8, [size]).unwrap()).await.unwrap();
            let end = tokio::time::timeout(Duration::from_secs(20), answers.next()).await.expect("the answers ended");
            assert_eq!(end.map(|r| r.map(drop).unwrap_err().code()), code);
        }

        let (server, _dir) = start(tensorwire::Server::builder().config(cfg).service(Refusing), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        for (size, code) in [(16, Code::InvalidArgument), (4096, Code::LimitExceeded)] {
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Tensor>(1);
            let inputs = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
            let mut answers = client.exchange(inputs).await.unwrap();
            tx.send(Tensor::zeros(DType::UInt8, [size]).unwrap()).await.unwrap();
            let first = tokio::time::timeout(Duration::from_secs(20), answers.next()).await;
            let e = first.expect("the answers ended").expect("an error, not an answer").unwrap_err();
            assert_eq!(e.code(), code, "{e}");
            assert!(tokio::time::timeout(Duration::from_secs(5), answers.next()).await.unwrap().is_none());
        }
        // Same connection, still serving.
        assert!(client.health().await.unwrap());
    }

    /// Echoes exchanges and records how each one's inputs ended.
    #[derive(Clone, Default)]
    struct Recording(std::sync::Arc<std::sync::Mutex<Vec<&'static str>>>);

    #[async_trait::async_trait]
    impl tensorwire::TensorService for Recording {
        async fn exchange(
            &self,
            _: &tensorwire::CallContext,
            input: &mut tensorwire::TensorStream,
            out: &mut tensorwire::TensorSink<'_>,
        ) -> Result<(), tensorwire::Status> {
            // Records "cancelled" if the server drops this call unfinished.
            struct Dropped<'a>(&'a Recording, bool);
            impl Drop for Dropped<'_> {
                fn drop(&mut self) {
                    if !self.1 {
                        self.0.0.lock().unwrap().push("cancelled");
                    }
                }
            }
            let mut guard = Dropped(self, false);
            while let Some(t) = input.next().await {
                match t {
                    Ok(t) => out.send(t).await?,
                    Err(e) => {
                        guard.1 = true;
                        self.0.lock().unwrap().push("cut");
                        return Err(e.into());
                    }
                }
            }
            guard.1 = true;
            self.0.lock().unwrap().push("clean end");
            Ok(())
        }
    }

    /// Dropping an exchange's answers before their end cancels the call:
    /// the server's handler is dropped (told the client stopped reading;
    /// over gRPC by the call's reset) or sees its inputs cut (when the cut
    /// reaches it first), never a clean end (over QUIC a dropped stream
    /// used to be finished).
    pub async fn a_dropped_exchange_is_cut_not_ended(scheme: &str) {
        let rec = Recording::default();
        let (server, _dir) = start(tensorwire::Server::builder().service(rec.clone()), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Tensor>(1);
        let inputs = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        let mut answers = client.exchange(inputs).await.unwrap();
        let x = Tensor::from_vec([1], vec![7u8]).unwrap();
        tx.send(x.clone()).await.unwrap();
        assert_same(&x, &answers.next().await.unwrap().unwrap());
        drop(answers);
        assert!(wait_until(Duration::from_secs(10), || !rec.0.lock().unwrap().is_empty()).await);
        let first = rec.0.lock().unwrap()[0];
        assert!(["cut", "cancelled"].contains(&first), "{scheme}: {first}");
        drop(tx);
        // A finished exchange ends cleanly.
        assert_same(&x, &client.exchange_all(vec![x.clone()]).await.unwrap()[0]);
        assert!(wait_until(Duration::from_secs(10), || rec.0.lock().unwrap().len() == 2).await);
        assert_eq!(*rec.0.lock().unwrap(), [first, "clean end"]);
    }

    pub async fn compute_builtins(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let samples = sample_tensors(false);
        let out = client.compute("identity", samples.clone()).await.unwrap();
        for (a, b) in samples.iter().zip(&out) {
            assert_same(a, b);
        }
        let x = Tensor::from_vec([2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let y = client.call("scale", vec![x.clone()], Args::new().with("factor", 0.5)).await.unwrap();
        assert_eq!(y.tensors[0].as_slice::<f32>().unwrap(), &[0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
        let s = client.compute("sum", vec![x.clone(), x]).await.unwrap();
        assert_eq!(s[0].as_slice::<f32>().unwrap(), &[2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
        // A big input goes through a function too.
        let big = random_tensor(DType::Float32, &[16, 1 << 20], 9).unwrap();
        let back = client.compute("identity", vec![big.clone()]).await.unwrap();
        assert_same(&big, &back[0]);
    }

    pub async fn sixty_four_concurrent_calls(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..64u64 {
            let c = client.clone();
            tasks.push(tokio::spawn(async move {
                let x = random_tensor(DType::Float32, &[1024], i).unwrap();
                let y = c.compute("identity", vec![x.clone()]).await.unwrap();
                assert_same(&x, &y[0]);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let st = client.statistics();
        assert_eq!((st.requests, st.successes, st.failures), (64, 64, 0));
    }

    pub async fn handler_errors_are_typed_and_the_connection_survives(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let e = client.compute("no-such-function", vec![]).await.unwrap_err();
        let s = e.status().expect("a remote status");
        assert_eq!(s.code, Code::NotFound);
        assert!(s.message.contains("identity, scale, sum"), "{s}");
        let e = client.fetch_one("missing").await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        let e = client
            .call("scale", vec![Tensor::zeros(DType::Float32, [2]).unwrap()], Args::new().with("factor", "x"))
            .await;
        assert_eq!(e.unwrap_err().code(), Code::InvalidArgument);
        // Same connection, still serving.
        let x = Tensor::from_vec([1], vec![7u8]).unwrap();
        assert_same(&x, &client.compute("identity", vec![x.clone()]).await.unwrap()[0]);
        assert_eq!(client.statistics().failures, 3);
    }

    pub async fn compressed_and_checksummed_transfers(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let ramp: Vec<f32> = (0..(4 << 20)).map(|i| i as f32 * 1e-3).collect();
        let ramp = Tensor::from_vec([4 << 20], ramp).unwrap().with_name("ramp");
        for (c, shuffle) in [(Compression::Lz4, false), (Compression::Zstd(1), true), (Compression::Zstd(3), false)] {
            let cfg = ClientConfig {
                encoding: Encoding {
                    compression: CompressionMode::Fixed(c),
                    shuffle,
                    checksums: true,
                    ..Encoding::default()
                },
                ..ClientConfig::default()
            };
            let client = Client::connect_with(&server.url(), cfg).await.unwrap();
            client.send(vec![ramp.clone()]).await.unwrap();
            // The response is compressed the same way (the request asks for it).
            assert_same(&ramp, &client.fetch_one("ramp").await.unwrap());
        }
    }

    pub async fn torch_and_safetensors_codecs_on_the_wire(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        for codec in [CodecKind::Torch, CodecKind::Safetensors] {
            let cfg = ClientConfig { encoding: Encoding { codec, ..Encoding::default() }, ..ClientConfig::default() };
            let client = Client::connect_with(&server.url(), cfg).await.unwrap();
            let mut samples = sample_tensors(false);
            if codec == CodecKind::Safetensors {
                samples.retain(|t| t.dtype() != DType::Complex128);
            }
            let out = client.exchange_all(samples.clone()).await.unwrap();
            for (a, b) in samples.iter().zip(&out) {
                assert_same(a, b);
            }
        }
    }

    /// A connection that has completed the handshake, for sending raw frames.
    async fn raw(url: &str) -> std::sync::Arc<dyn transports::Connection> {
        let ep = transports::Endpoint::parse(url).unwrap();
        let conn = transports::connect(&ep, &Default::default()).await.unwrap();
        let reply = raw_call(&conn, StreamKind::Handshake, vec![hello(tensorwire::PROTOCOL_VERSION)]).await;
        assert!(matches!(reply[0].kind, Some(Kind::Welcome(_))), "{reply:?}");
        conn
    }

    fn hello(version: u32) -> Frame {
        Frame::header_only(FrameHeader::new(Kind::Hello(Box::new(v1::Hello { version, ..Default::default() }))))
    }

    fn request(method: v1::Method) -> Frame {
        Frame::header_only(FrameHeader::new(Kind::Request(Box::new(v1::Request {
            method: method as i32,
            ..Default::default()
        }))))
    }

    fn chunk(info: Option<v1::TensorInfo>, total: u64, payload: &[u8], last: bool) -> Frame {
        Frame {
            header: FrameHeader::new(Kind::Chunk(v1::Chunk {
                tensor_id: 1,
                index: 0,
                offset: 0,
                total_bytes: total,
                last,
                compression: v1::Compression::None as i32,
                raw_len: payload.len() as u64,
                info: info.map(Box::new),
                ..Default::default()
            })),
            payload: bytes::Bytes::copy_from_slice(payload),
        }
    }

    fn info(dtype: v1::Dtype, shape: &[u64], codec: i32) -> Option<v1::TensorInfo> {
        Some(v1::TensorInfo { dtype: dtype as i32, shape: shape.to_vec(), codec, ..Default::default() })
    }

    /// Sends `frames` on a new stream, ends it, and returns the headers that come back.
    async fn raw_call(
        conn: &std::sync::Arc<dyn transports::Connection>,
        kind: StreamKind,
        frames: Vec<Frame>,
    ) -> Vec<FrameHeader> {
        let (mut tx, mut rx) = conn.open(kind).await.unwrap();
        for f in frames {
            if tx.send(f).await.is_err() {
                break;
            }
        }
        let _ = tx.finish().await;
        let mut out = vec![];
        while let Ok(Some(r)) = rx.recv().await {
            out.push(r.header);
        }
        out
    }

    fn error_of(headers: &[FrameHeader]) -> v1::Error {
        match headers.last().and_then(|h| h.kind.clone()) {
            Some(Kind::Error(e)) => e,
            other => panic!("expected an error frame, got {other:?}"),
        }
    }

    pub async fn bad_input_gets_clear_errors_and_the_server_keeps_serving(scheme: &str) {
        let cfg = ServerConfig {
            limits: Limits { max_tensor_bytes: 1 << 20, ..Limits::default() },
            ..ServerConfig::default()
        };
        let (server, _dir) = start(store_server(cfg), scheme).await;
        let url = server.url();
        let conn = raw(&url).await;
        let raw_codec = v1::Codec::Raw as i32;
        // Truncated: the first chunk declares 1000 bytes, the stream ends after 100.
        let e = error_of(
            &raw_call(
                &conn,
                StreamKind::Send,
                vec![
                    request(v1::Method::Send),
                    chunk(info(v1::Dtype::Uint8, &[1000], raw_codec), 1000, &[1; 100], false),
                ],
            )
            .await,
        );
        assert_eq!(e.code, v1::ErrorCode::Protocol as i32);
        assert!(e.message.contains("ended in the middle of a tensor"), "{}", e.message);
        // A declared size above max_tensor_bytes, refused before allocation.
        let e = error_of(
            &raw_call(
                &conn,
                StreamKind::Send,
                vec![
                    request(v1::Method::Send),
                    chunk(info(v1::Dtype::Uint8, &[1 << 40], raw_codec), 1 << 40, &[1; 10], false),
                ],
            )
            .await,
        );
        assert_eq!(e.code, v1::ErrorCode::LimitExceeded as i32, "{}", e.message);
        assert!(e.message.contains("max_tensor_bytes"), "{}", e.message);
        // shape × dtype disagrees with the bytes.
        let e = error_of(
            &raw_call(
                &conn,
                StreamKind::Send,
                vec![
                    request(v1::Method::Send),
                    chunk(info(v1::Dtype::Float32, &[2, 3], raw_codec), 20, &[0; 20], true),
                ],
            )
            .await,
        );
        assert_eq!(e.code, v1::ErrorCode::InvalidArgument as i32);
        assert!(e.message.contains("needs 24 bytes"), "{}", e.message);
        // Unknown codec.
        let e = error_of(
            &raw_call(
                &conn,
                StreamKind::Send,
                vec![request(v1::Method::Send), chunk(info(v1::Dtype::Uint8, &[4], 99), 4, &[0; 4], true)],
            )
            .await,
        );
        assert_eq!(e.code, v1::ErrorCode::UnsupportedCodec as i32, "{}", e.message);
        // Unknown protocol version in a handshake.
        let e = error_of(&raw_call(&conn, StreamKind::Handshake, vec![hello(99)]).await);
        assert_eq!(e.code, v1::ErrorCode::UnsupportedVersion as i32);
        assert!(e.message.contains("version 99"), "{}", e.message);
        // A call without a handshake on a fresh connection (gRPC is
        // stateless: every call stands alone, no handshake is required).
        let ep = transports::Endpoint::parse(&url).unwrap();
        let fresh = transports::connect(&ep, &Default::default()).await.unwrap();
        let headers = raw_call(&fresh, StreamKind::Call, vec![request(v1::Method::Info)]).await;
        if fresh.info().stateless {
            assert!(matches!(headers.last().and_then(|h| h.kind.clone()), Some(Kind::Reply(_))), "{headers:?}");
        } else {
            assert_eq!(error_of(&headers).code, v1::ErrorCode::FailedPrecondition as i32);
        }
        // And the server still serves a second client.
        let client = Client::connect(&url).await.unwrap();
        let x = Tensor::from_vec([3], vec![1u8, 2, 3]).unwrap();
        assert_same(&x, &client.compute("identity", vec![x.clone()]).await.unwrap()[0]);
        let too_big = Tensor::zeros(DType::UInt8, [2 << 20]).unwrap();
        // The client knows the server's limit from the handshake and refuses locally.
        assert!(matches!(client.send(vec![too_big]).await, Err(CallError::Limit { .. })));
    }

    pub async fn random_bytes_on_the_socket(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let url = server.url();
        let ep = transports::Endpoint::parse(&url).unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let garbage: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8).collect();
        let mut rest = Vec::new();
        match scheme {
            "tcp" => {
                let mut s = tokio::net::TcpStream::connect(ep.authority()).await.unwrap();
                let _ = s.write_all(&garbage).await;
                let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await.unwrap();
            }
            _ => {
                let mut s = tokio::net::UnixStream::connect(ep.path()).await.unwrap();
                let _ = s.write_all(&garbage).await;
                let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await.unwrap();
            }
        }
        // The server answered with its preface and a GOAWAY naming the problem, then closed.
        assert!(String::from_utf8_lossy(&rest).contains("not a tensorwire connection"));
        let client = Client::connect(&url).await.unwrap();
        assert!(client.health().await.unwrap());
    }

    pub async fn blocking_client_and_fetch_by_shape(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let url = server.url();
        let got = tokio::task::spawn_blocking(move || {
            let c = tensorwire::BlockingClient::connect(&url).unwrap();
            let t = random_tensor(DType::Int64, &[1000], 3).unwrap().with_name("b");
            c.send(vec![t.clone()]).unwrap();
            let back = c.fetch(FetchRequest::name("b")).unwrap();
            assert_same(&t, &back[0]);
            // The seed's SendTensors: count and shape.
            let r = c.fetch(FetchRequest::default().param("shape", "50,50").param("count", "3")).unwrap();
            drop(c);
            r
        })
        .await
        .unwrap();
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|t| t.shape() == [50, 50] && t.dtype() == DType::Float32));
        // The dropped client's connection is closed; new ones still work.
        let client = Client::connect(&server.url()).await.unwrap();
        assert!(client.health().await.unwrap());
    }

    /// A `send` handler that knows its tensors' size receives each straight
    /// into one buffer of its own (`TensorStream::next_into`), and keeps a
    /// copy of what landed there.
    struct IntoOwnBuffer {
        len: usize,
        landed: Landed,
    }

    /// Each tensor's name and bytes, as they landed.
    type Landed = std::sync::Arc<std::sync::Mutex<Vec<(Option<String>, Vec<u8>)>>>;

    #[async_trait::async_trait]
    impl tensorwire::TensorService for IntoOwnBuffer {
        async fn send(
            &self,
            _: &tensorwire::CallContext,
            tensors: &mut tensorwire::TensorStream,
        ) -> Result<tensorwire::SendSummary, tensorwire::Status> {
            let mut buf = vec![0u8; self.len];
            let mut s = tensorwire::SendSummary::default();
            while let Some(info) = tensors.next_into(&mut buf, Some(DType::Float32)).await {
                let info = info.map_err(tensorwire::Status::from)?;
                self.landed.lock().unwrap().push((info.name, buf.clone()));
                s.received += 1;
                s.bytes += buf.len() as u64;
            }
            Ok(s)
        }
    }

    pub async fn send_handler_receives_into_its_own_buffer(scheme: &str) {
        let len = 4 * 300_001;
        let landed = Landed::default();
        let service = IntoOwnBuffer { len, landed: std::sync::Arc::clone(&landed) };
        let (server, _dir) = start(tensorwire::Server::builder().service(service), scheme).await;
        let client = Client::connect(&server.url()).await.unwrap();
        let sent: Vec<Tensor> =
            (0..3).map(|i| random_tensor(DType::Float32, &[300_001], i).unwrap().with_name(format!("t{i}"))).collect();
        let s = client.send(sent.clone()).await.unwrap();
        assert_eq!((s.received, s.bytes), (3, 3 * len as u64));
        {
            let got = landed.lock().unwrap();
            assert_eq!(got.len(), 3);
            for (t, (name, bytes)) in sent.iter().zip(got.iter()) {
                assert_eq!(name.as_deref(), t.name());
                assert!(bytes.as_slice() == t.as_bytes().unwrap(), "{:?} landed changed", t.name());
            }
        }
        // The wrong dtype, the wrong size: refused with the reason, before
        // anything is written; the connection keeps serving. The refusal
        // comes back at once, whether the whole tensor was already on its
        // way (the small ones) or most of it still had to leave (64 MiB):
        // over UCX the payloads the server will not read are sent by tag,
        // and the sender waited out its rendezvous timeout (60 s) for them.
        for (bad, why) in [
            (random_tensor(DType::Int32, &[300_001], 9).unwrap(), "is int32"),
            (random_tensor(DType::Float32, &[300_000], 9).unwrap(), "has 1200000 bytes, the buffer 1200004"),
            (random_tensor(DType::Int32, &[16 << 20], 9).unwrap(), "is int32"),
        ] {
            let sent = tokio::time::timeout(Duration::from_secs(30), client.send(vec![bad])).await;
            let e = sent.expect("a refusal, not a wait").unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
            assert!(matches!(&e, CallError::Remote(s) if s.code == Code::InvalidArgument), "{e:?}");
        }
        // Refused at a first small tensor while a large one (over UCX's
        // shared memory: one that asks the receiver for memory to put its
        // chunks into) follows it: refused at once too.
        let two = vec![
            random_tensor(DType::Int32, &[300_001], 12).unwrap(),
            random_tensor(DType::Float32, &[16 << 20], 13).unwrap(),
        ];
        let sent = tokio::time::timeout(Duration::from_secs(30), client.send(two)).await;
        let e = sent.expect("a refusal, not a wait").unwrap_err();
        assert!(e.to_string().contains("is int32"), "{e}");
        assert_eq!(landed.lock().unwrap().len(), 3);
        let again = random_tensor(DType::Float32, &[300_001], 10).unwrap();
        client.send(vec![again.clone()]).await.unwrap();
        assert!(landed.lock().unwrap()[3].1.as_slice() == again.as_bytes().unwrap());

        // The answers of an exchange whose inputs never end, the first one
        // refused by the buffer it should land in: the refusal ends the call
        // (the inputs stop), nothing is written.
        let (echo, _echo_dir) = start(store_server(ServerConfig::default()), scheme).await;
        let client = Client::connect(&echo.url()).await.unwrap();
        let big = random_tensor(DType::Float32, &[1 << 18], 11).unwrap();
        let mut answers = client.exchange(futures_util::stream::repeat(big)).await.unwrap();
        let mut small = [0u8; 16];
        let r = tokio::time::timeout(Duration::from_secs(30), answers.next_into(&mut small, None)).await;
        let e = r.expect("a refusal, not a hang").expect("an outcome").unwrap_err();
        assert!(e.to_string().contains("has 1048576 bytes, the buffer 16"), "{e}");
        assert_eq!(small, [0u8; 16]);
        assert!(answers.next().await.is_none());
    }

    /// Progress counts every payload byte once, as chunks move, at any chunk
    /// size (here 64 KiB: a tensor of many chunks, one of one chunk).
    pub async fn progress_counts_every_payload_byte(scheme: &str) {
        let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
        let progress = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let cfg = ClientConfig {
            encoding: Encoding { chunk_size: 64 << 10, ..Encoding::default() },
            progress: Some(progress.clone()),
            ..ClientConfig::default()
        };
        let client = Client::connect_with(&server.url(), cfg).await.unwrap();
        let tensors = vec![
            random_tensor(DType::UInt8, &[(1 << 20) + 1], 1).unwrap().with_name("p-mib"),
            random_tensor(DType::UInt8, &[100], 2).unwrap().with_name("p-small"),
            random_tensor(DType::Float32, &[5 << 18], 3).unwrap().with_name("p-5mib"),
        ];
        let total: u64 = tensors.iter().map(|t| t.nbytes() as u64).sum();
        client.send(tensors.clone()).await.unwrap();
        let load = || progress.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(load(), total, "bytes sent");
        for t in &tensors {
            assert_same(t, &client.fetch_one(t.name().unwrap()).await.unwrap());
        }
        assert_eq!(load(), 2 * total, "bytes sent and received");
    }
}

/// Runs every test of `suite` on each transport: `mod tcp { fn ... }`, ...
macro_rules! transport_suite {
    ($($name:ident => $scheme:literal),* $(,)?) => {$(
        mod $name {
            use super::suite;
            suite_tests!($scheme; send_then_fetch_every_sample, exchange_echoes_in_order, exchange_ended_by_the_server_ends_while_inputs_wait, a_dropped_exchange_is_cut_not_ended, compute_builtins, sixty_four_concurrent_calls, handler_errors_are_typed_and_the_connection_survives, compressed_and_checksummed_transfers, torch_and_safetensors_codecs_on_the_wire, bad_input_gets_clear_errors_and_the_server_keeps_serving, blocking_client_and_fetch_by_shape, progress_counts_every_payload_byte, send_handler_receives_into_its_own_buffer);
        }
    )*};
}

/// One `#[tokio::test]` per suite function, run on `$scheme`.
macro_rules! suite_tests {
    ($scheme:literal; $($test:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            suite::$test($scheme).await
        }
    )*};
}

transport_suite!(tcp => "tcp", tcps => "tcps", tcp_shm => "tcp+shm", unix => "unix", quic => "quic", grpc => "grpc", grpcs => "grpcs", grpc_unix => "grpc+unix", shm => "shm");
// Over whichever UCX transports UCX_TLS selects (tests/run.sh runs it with
// UCX_TLS=tcp and with UCX_TLS=sm,self).
#[cfg(feature = "ucx")]
transport_suite!(ucx => "ucx");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_bytes_on_tcp() {
    suite::random_bytes_on_the_socket("tcp").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_bytes_on_unix() {
    suite::random_bytes_on_the_socket("unix").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_datagrams_on_quic() {
    // Garbage datagrams and a bogus QUIC Initial: quinn drops them, the
    // server keeps serving.
    let (server, _dir) = start(store_server(ServerConfig::default()), "quic").await;
    let url = server.url();
    let ep = transports::Endpoint::parse(&url).unwrap();
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for i in 0..200u32 {
        let mut d: Vec<u8> = (0..1200u32).map(|j| (j.wrapping_mul(2654435761).wrapping_add(i) >> 7) as u8).collect();
        if i % 2 == 0 {
            d[0] = 0xc0; // long header, Initial
            d[1..5].copy_from_slice(&1u32.to_be_bytes()); // QUIC v1
        }
        sock.send_to(&d, ep.authority()).await.unwrap();
    }
    let client = Client::connect(&url).await.unwrap();
    assert!(client.health().await.unwrap());
}
