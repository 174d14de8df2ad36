//! QUIC-specific behaviour over real loopback UDP: the idle timeout, a
//! server restart, every congestion controller and striping. Certificates
//! are tested on every TLS transport in `tls.rs`; the transport-independent
//! suite runs over QUIC in `pipeline.rs`.

mod common;

use std::time::Duration;

use common::pki::pki;
use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{Client, ClientConfig, DType, FetchRequest, ServerConfig, TransportConfig};
use tensorwire_transports::config::{Congestion, TlsConfig};
use tensorwire_transports::{self as transports, Endpoint};

fn server_config(tls: TlsConfig) -> ServerConfig {
    ServerConfig { transport: TransportConfig { tls, ..TransportConfig::default() }, ..ServerConfig::default() }
}

fn client_config(tls: TlsConfig) -> ClientConfig {
    ClientConfig { transport: TransportConfig { tls, ..TransportConfig::default() }, ..ClientConfig::default() }
}

async fn works(url: &str, cfg: ClientConfig) {
    let c = Client::connect_with(url, cfg).await.unwrap_or_else(|e| panic!("{url}: {e}"));
    let x = random_tensor(DType::Float32, &[257], 1).unwrap();
    assert_same(&x, &c.compute("identity", vec![x.clone()]).await.unwrap()[0]);
}

fn port_of(url: &str) -> u16 {
    Endpoint::parse(url).unwrap().port()
}

fn quic_transport(idle: Duration, keep_alive: Option<Duration>) -> TransportConfig {
    let mut t = TransportConfig::default();
    t.quic.idle_timeout = idle;
    t.quic.keep_alive = keep_alive;
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_closes_a_silent_connection() {
    // The server closes connections silent for 300 ms and sends no keep-alives itself.
    let cfg = ServerConfig { transport: quic_transport(Duration::from_millis(300), None), ..ServerConfig::default() };
    let (server, _d) = start(store_server(cfg), "quic").await;
    let ep = Endpoint::parse(&server.url()).unwrap();
    // A client that never speaks.
    let silent = transports::connect(&ep, &quic_transport(Duration::from_secs(60), None)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(20), silent.closed()).await.expect("the idle connection was closed");
    assert!(silent.is_closed());
    let e = match silent.open(transports::StreamKind::Call).await {
        Ok((mut tx, mut rx)) => {
            let _ = tx.finish().await;
            rx.recv().await.unwrap_err()
        }
        Err(e) => e,
    };
    assert!(e.to_string().contains("idle timeout"), "{e}");
    // A client whose keep-alives are more frequent than the timeout stays
    // connected through the same silence.
    let lively = transports::connect(&ep, &quic_transport(Duration::from_secs(60), Some(Duration::from_millis(50))))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(!lively.is_closed(), "keep-alives did not keep the connection open");
    // And the tensorwire client over a timed-out connection just reconnects.
    let c = Client::connect_with(
        &server.url(),
        ClientConfig { transport: quic_transport(Duration::from_secs(60), None), ..ClientConfig::default() },
    )
    .await
    .unwrap();
    assert!(c.health().await.unwrap());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(c.health().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_reconnects_after_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let a = pki(dir.path(), "a");
    let tls = TlsConfig {
        cert_path: Some(a.server_cert.clone()),
        key_path: Some(a.server_key.clone()),
        ..Default::default()
    };
    let (first, _d) = start(store_server(server_config(tls.clone())), "quic").await;
    let port = port_of(&first.url());
    let url = format!("quic://127.0.0.1:{port}?server-name=localhost");
    let client =
        Client::connect_with(&url, client_config(TlsConfig { ca_path: Some(a.ca.clone()), ..Default::default() }))
            .await
            .unwrap();
    let x = random_tensor(DType::Int32, &[1000], 2).unwrap().with_name("x");
    client.send(vec![x.clone()]).await.unwrap();
    // A graceful restart, then a crash and restart: each time the next call
    // finds the new server by itself.
    first.shutdown().await;
    let second =
        store_server(server_config(tls.clone())).build().start([format!("quic://127.0.0.1:{port}")]).await.unwrap();
    client.send(vec![x.clone()]).await.unwrap();
    assert_same(&x, &client.fetch(FetchRequest::name("x")).await.unwrap()[0]);
    second.abort().await;
    let third = store_server(server_config(tls)).build().start([format!("quic://127.0.0.1:{port}")]).await.unwrap();
    client.send(vec![x.clone()]).await.unwrap();
    assert_same(&x, &client.fetch(FetchRequest::name("x")).await.unwrap()[0]);
    assert!(client.statistics().reconnects >= 2, "{:?}", client.statistics());
    third.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_congestion_controller_moves_tensors() {
    for cc in [Congestion::Cubic, Congestion::Bbr, Congestion::NewReno] {
        let mut cfg = ServerConfig::default();
        cfg.transport.quic.congestion = cc;
        let (server, _d) = start(store_server(cfg), "quic").await;
        let mut c = ClientConfig::default();
        c.transport.quic.congestion = cc;
        let client = Client::connect_with(&server.url(), c).await.unwrap();
        let x = random_tensor(DType::Float32, &[4 << 20], 3).unwrap().with_name("big");
        client.send(vec![x.clone()]).await.unwrap();
        assert_same(&x, &client.fetch(FetchRequest::name("big")).await.unwrap()[0]);
    }
}

mod striping {
    use super::*;
    use bytes::Bytes;
    use tensorwire_proto::v1::{self, frame_header::Kind};
    use tensorwire_transports::quic::group::STRIPE_ALPN;
    use tensorwire_transports::quic::{self, quinn};
    use tensorwire_transports::{Connection, Frame, FrameHeader, Payload, StreamKind};

    fn frame(i: u64, len: usize) -> Frame {
        let payload: Vec<u8> = (0..len).map(|j| (j as u64).wrapping_mul(31).wrapping_add(i) as u8).collect();
        Frame {
            header: FrameHeader::new(Kind::Chunk(v1::Chunk { tensor_id: 7, index: i as u32, ..Default::default() })),
            payload: Bytes::from(payload),
        }
    }

    /// A transport-level echo server: every frame of every stream comes back, in order.
    async fn echo_listener() -> (Endpoint, tokio::task::JoinHandle<()>) {
        let ep = Endpoint::parse("quic://127.0.0.1:0").unwrap();
        let mut l = transports::listen(&ep, &TransportConfig::default()).await.unwrap();
        let url = l.local_endpoint();
        let task = tokio::spawn(async move {
            while let Ok(conn) = l.accept().await {
                tokio::spawn(async move {
                    while let Ok(mut inc) = conn.accept().await {
                        tokio::spawn(async move {
                            while let Ok(Some(r)) = inc.recv.recv().await {
                                let Payload::Bytes(payload) = r.payload else { panic!("nothing was placed") };
                                inc.send.send(Frame { header: r.header, payload }).await.unwrap();
                            }
                            inc.send.finish().await.unwrap();
                        });
                    }
                });
            }
        });
        (url, task)
    }

    /// A frame head naming stripe `stripe`, with a `len`-byte payload (the
    /// primary stream's framing: stripe and header length, payload length,
    /// header).
    fn striped_head(stripe: u8, len: u32) -> Vec<u8> {
        let h = frame(0, 0).header;
        let meta = tensorwire_proto::header::encoded_len(&h) as u32;
        let mut out = Vec::new();
        out.extend_from_slice(&((u32::from(stripe) << 24) | meta).to_le_bytes());
        out.extend_from_slice(&len.to_le_bytes());
        tensorwire_proto::header::encode(&h, &mut out);
        out
    }

    /// A stream cut while a striped payload was being sent: its header has
    /// reached the receiver on the primary stream, the stripe's stream ends
    /// short (a cut sender finishes its stripe streams, since resetting them
    /// could discard their opening bytes and leave the receiver waiting),
    /// and the primary is reset. The receiver must report the reset, not a
    /// protocol error. A raw QUIC client makes the order certain. First, a
    /// header that names a stripe before the stripe has joined.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_cut_mid_stripe_is_reported_as_a_reset() {
        let ep = Endpoint::parse("quic://127.0.0.1:0").unwrap();
        let mut l = transports::listen(&ep, &TransportConfig::default()).await.unwrap();
        let url = l.local_endpoint();
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let _server = tokio::spawn(async move {
            while let Ok(conn) = l.accept().await {
                let seen_tx = seen_tx.clone();
                tokio::spawn(async move {
                    while let Ok(mut inc) = conn.accept().await {
                        let seen_tx = seen_tx.clone();
                        tokio::spawn(async move {
                            let mut frames = 0;
                            let outcome = loop {
                                match inc.recv.recv().await {
                                    Ok(Some(_)) => frames += 1,
                                    Ok(None) => break format!("finished after {frames} frames"),
                                    Err(e) => break e.to_string(),
                                }
                            };
                            let _ = seen_tx.send(outcome);
                        });
                    }
                });
            }
        });
        let tls = TlsConfig { pin_sha256: url.query("pin-sha256").map(str::to_string), ..Default::default() };
        let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let dial = async |alpn: &[u8]| {
            let rustls_cfg = transports::tls::client_config(&tls, &[alpn]).unwrap();
            let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg).unwrap();
            let cfg = quinn::ClientConfig::new(std::sync::Arc::new(crypto));
            endpoint.connect_with(cfg, url.authority().parse().unwrap(), "localhost").unwrap().await.unwrap()
        };
        let control = async |c: &quinn::Connection, magic: &[u8], n: u8| {
            let mut s = c.open_uni().await.unwrap();
            s.write_all(&[magic, &[0x42; 16], &[n]].concat()).await.unwrap();
            s.finish().unwrap();
        };
        let primary = dial(tensorwire_transports::quic::ALPN).await;
        control(&primary, b"TWG1", 2).await;
        // A whole striped frame first, its header sent before the stripe
        // even joins (a join travels on its own connection, so a receiver
        // may see a header naming a stripe that has not joined yet: it
        // waits for the join).
        let (mut s, _r) = primary.open_bi().await.unwrap();
        s.write_all(&striped_head(1, 4)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let stripe = dial(STRIPE_ALPN).await;
        control(&stripe, b"TWJ1", 1).await;
        let mut st = stripe.open_uni().await.unwrap();
        st.write_all(&u64::from(quinn::VarInt::from(s.id())).to_le_bytes()).await.unwrap();
        st.write_all(b"four").await.unwrap();
        st.finish().unwrap();
        s.finish().unwrap();
        let first = tokio::time::timeout(Duration::from_secs(30), seen.recv()).await.unwrap().unwrap();
        assert_eq!(first, "finished after 1 frames");
        // Now a payload cut short on its stripe, then the primary's reset.
        let (mut s, _r) = primary.open_bi().await.unwrap();
        s.write_all(&striped_head(1, 1 << 20)).await.unwrap();
        let mut st = stripe.open_uni().await.unwrap();
        st.write_all(&u64::from(quinn::VarInt::from(s.id())).to_le_bytes()).await.unwrap();
        st.write_all(&[7; 1000]).await.unwrap();
        st.finish().unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.reset(quinn::VarInt::from_u32(8)).unwrap();
        let started = std::time::Instant::now();
        let outcome = tokio::time::timeout(Duration::from_secs(30), seen.recv()).await.unwrap().unwrap();
        assert!(outcome.contains("reset"), "ended with {outcome:?} after {:?}", started.elapsed());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn payloads_spread_over_every_stripe_and_frames_stay_in_order() {
        let (url, _server) = echo_listener().await;
        let striped = Endpoint::parse(&format!("{url}&stripes=3")).unwrap();
        let conn = quic::connect(&striped, &TransportConfig::default()).await.unwrap();
        assert_eq!(conn.stripes(), 3);
        let conn: std::sync::Arc<dyn transports::Connection> = conn.clone();
        // Two streams at once, mixing payloads above and below the striping
        // threshold and empty ones.
        let sizes: Vec<usize> = (0..60).map(|i| [1 << 20, 0, 4096, 300 << 10][i % 4]).collect();
        let mut calls = Vec::new();
        for _ in 0..2 {
            let (conn, sizes) = (conn.clone(), sizes.clone());
            calls.push(tokio::spawn(async move {
                let (mut tx, mut rx) = conn.open(StreamKind::Exchange).await.unwrap();
                let to_send = sizes.clone();
                let sender = tokio::spawn(async move {
                    for (i, &n) in to_send.iter().enumerate() {
                        tx.send(frame(i as u64, n)).await.unwrap();
                    }
                    tx.finish().await.unwrap();
                });
                let mut i = 0u64;
                while let Some(r) = rx.recv().await.unwrap() {
                    let want = frame(i, sizes[i as usize]);
                    assert_eq!(r.header, want.header, "frame {i} out of order");
                    match r.payload {
                        Payload::Bytes(b) => assert!(b == want.payload, "frame {i} payload differs"),
                        other => panic!("{other:?}"),
                    }
                    i += 1;
                }
                sender.await.unwrap();
                i
            }));
        }
        for c in calls {
            assert_eq!(c.await.unwrap(), 60);
        }
        // The echoes came back over all three connections: the server
        // stripes its sends over the client's group too.
        let concrete = quic::connect(&striped, &TransportConfig::default()).await.unwrap();
        let (mut tx, mut rx) = concrete.open(StreamKind::Exchange).await.unwrap();
        for i in 0..24 {
            tx.send(frame(i, 1 << 20)).await.unwrap();
        }
        tx.finish().await.unwrap();
        let mut n = 0;
        while rx.recv().await.unwrap().is_some() {
            n += 1;
        }
        assert_eq!(n, 24);
        let per_conn = concrete.bytes_received();
        assert_eq!(per_conn.len(), 3);
        assert!(per_conn.iter().all(|&b| b > 4 << 20), "received per connection: {per_conn:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tensorwire_calls_over_a_striped_connection() {
        let (server, _d) = start(store_server(ServerConfig::default()), "quic").await;
        let mut cfg = ClientConfig::default();
        cfg.transport.quic.stripes = 4;
        let client = Client::connect_with(&server.url(), cfg).await.unwrap();
        let big = random_tensor(DType::Float32, &[16 << 20], 5).unwrap().with_name("big");
        client.send(vec![big.clone()]).await.unwrap();
        assert_same(&big, &client.fetch(FetchRequest::name("big")).await.unwrap()[0]);
        let mut calls = Vec::new();
        for i in 0..8 {
            let c = client.clone();
            calls.push(tokio::spawn(async move {
                let x = random_tensor(DType::Int16, &[(1 << 20) + i], i as u64).unwrap();
                let y = c.compute("identity", vec![x.clone()]).await.unwrap();
                assert_same(&x, &y[0]);
            }));
        }
        for c in calls {
            c.await.unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stripe_with_a_wrong_token_is_refused() {
        let (server, _d) = start(store_server(ServerConfig::default()), "quic").await;
        let url = Endpoint::parse(&server.url()).unwrap();
        let tls = TlsConfig { pin_sha256: url.query("pin-sha256").map(str::to_string), ..Default::default() };
        let rustls_cfg = transports::tls::client_config(&tls, &[STRIPE_ALPN]).unwrap();
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg).unwrap();
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        endpoint.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(crypto)));
        let conn = endpoint.connect(url.authority().parse().unwrap(), "localhost").unwrap().await.unwrap();
        let mut s = conn.open_uni().await.unwrap();
        let mut join = b"TWJ1".to_vec();
        join.extend_from_slice(&[0x5a; 16]);
        join.push(1);
        s.write_all(&join).await.unwrap();
        s.finish().unwrap();
        let e = tokio::time::timeout(Duration::from_secs(20), conn.closed()).await.unwrap();
        assert!(e.to_string().contains("no group with this token"), "{e}");
        // The server serves everyone else.
        works(&server.url(), ClientConfig::default()).await;
    }
}
