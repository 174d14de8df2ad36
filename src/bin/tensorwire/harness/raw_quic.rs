//! The QUIC baseline: raw quinn streams, configured exactly as
//! tensorwire's QUIC transport configures them (TLS with a pinned
//! self-signed certificate, windows, congestion control, UDP buffers), with
//! no framing, no codec and no protocol on top. Each side runs on its own
//! thread and runtime, as the tensorwire benchmarks do.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tensorwire_transports::quic::{ALPN, endpoint_config, quinn, transport_config, udp_socket};
use tensorwire_transports::{TransportConfig, config::TlsConfig, tls};

use tensorwire::Histogram;

use super::{Receive, warm_buffer};

fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().enable_all().build()
}

/// A server endpoint on 127.0.0.1 and the fingerprint clients pin.
struct Pair {
    server: quinn::Endpoint,
    fingerprint: String,
}

fn server_endpoint(cfg: &TransportConfig, bind: SocketAddr) -> std::io::Result<Pair> {
    let id = tls::server_identity(&cfg.tls, &[]).map_err(io)?;
    let rustls_cfg = tls::server_config(&cfg.tls, &id, &[ALPN]).map_err(io)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(rustls_cfg).map_err(io)?;
    let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server_cfg.transport_config(Arc::new(transport_config(cfg)));
    let socket = udp_socket(bind, &cfg.quic)?;
    let rt = quinn::default_runtime().ok_or_else(|| io("no runtime"))?;
    let server = quinn::Endpoint::new(endpoint_config(cfg), Some(server_cfg), socket, rt)?;
    Ok(Pair { server, fingerprint: id.fingerprint })
}

async fn client_connection(
    cfg: &TransportConfig,
    bind: SocketAddr,
    addr: SocketAddr,
    pin: &str,
) -> std::io::Result<(quinn::Endpoint, quinn::Connection)> {
    let tls_cfg = TlsConfig { pin_sha256: Some(pin.to_string()), ..cfg.tls.clone() };
    let rustls_cfg = tls::client_config(&tls_cfg, &[ALPN]).map_err(io)?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg).map_err(io)?;
    let mut client_cfg = quinn::ClientConfig::new(Arc::new(crypto));
    client_cfg.transport_config(Arc::new(transport_config(cfg)));
    let socket = udp_socket(bind, &cfg.quic)?;
    let rt = quinn::default_runtime().ok_or_else(|| io("no runtime"))?;
    let endpoint = quinn::Endpoint::new(endpoint_config(cfg), None, socket, rt)?;
    let conn = endpoint.connect_with(client_cfg, addr, "localhost").map_err(io)?.await.map_err(io)?;
    Ok((endpoint, conn))
}

/// Where the two ends of a raw QUIC baseline run: on loopback in this
/// network namespace, or (the WAN benchmark) the server bound to an address
/// of another namespace that its thread enters first, the client bound to
/// an address of the caller's namespace.
pub(crate) struct Placement {
    /// The server's bind address (port 0: any).
    pub server_bind: SocketAddr,
    /// The client's bind address (port 0: any).
    pub client_bind: SocketAddr,
    /// Run first on the server's thread (e.g. entering a namespace).
    pub enter_server: Box<dyn FnOnce() -> std::io::Result<()> + Send>,
}

impl Placement {
    /// Both ends on 127.0.0.1.
    pub(crate) fn loopback() -> Placement {
        let lo = SocketAddr::from(([127, 0, 0, 1], 0));
        Placement { server_bind: lo, client_bind: lo, enter_server: Box::new(|| Ok(())) }
    }
}

/// Runs `serve` on a server thread (its own runtime) and `drive` here (on
/// another runtime) over one connection; returns what both returned.
fn run<S, D, A, B>(cfg: &TransportConfig, at: Placement, serve: S, drive: D) -> std::io::Result<(A, B)>
where
    S: FnOnce(quinn::Connection) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<A>> + Send>> + Send + 'static,
    D: FnOnce(quinn::Connection) -> std::pin::Pin<Box<dyn Future<Output = std::io::Result<B>>>>,
    A: Send + 'static,
{
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let server_cfg = cfg.clone();
    let Placement { server_bind, client_bind, enter_server } = at;
    let server = std::thread::spawn(move || -> std::io::Result<A> {
        enter_server()?;
        let rt = runtime()?;
        rt.block_on(async move {
            let pair = server_endpoint(&server_cfg, server_bind)?;
            let _ = addr_tx.send((pair.server.local_addr()?, pair.fingerprint.clone()));
            let incoming = pair.server.accept().await.ok_or_else(|| io("endpoint closed"))?;
            let conn = incoming.await.map_err(io)?;
            let out = serve(conn.clone()).await;
            // Let the client read the last reply before the connection goes.
            conn.closed().await;
            pair.server.wait_idle().await;
            out
        })
    });
    let (addr, pin) = addr_rx.recv().map_err(|_| io("raw QUIC server did not start"))?;
    let rt = runtime()?;
    let b = rt.block_on(async {
        let (endpoint, conn) = client_connection(cfg, client_bind, addr, &pin).await?;
        let b = drive(conn.clone()).await;
        conn.close(0u32.into(), b"done");
        endpoint.wait_idle().await;
        b
    });
    let a = server.join().map_err(|_| io("raw QUIC server thread panicked"))?;
    Ok((a?, b?))
}

/// Sends `bytes` `reps` times, each on its own stream, in 1 MiB writes; the
/// server reads each into a warm reused buffer (or a fresh one per copy,
/// with [`Receive::Fresh`]) and acknowledges with one byte. Returns the
/// sender's mean time per copy, from opening the stream to the
/// acknowledgement (as `send_time` measures tensorwire). A first copy (up
/// to 64 MiB, untimed) warms up the congestion window and path MTU.
pub(crate) fn copy(cfg: &TransportConfig, bytes: usize, reps: usize, recv: Receive) -> std::io::Result<Duration> {
    let mut sizes = vec![bytes.min(super::WARM_UP_BYTES)];
    sizes.extend(std::iter::repeat_n(bytes, reps));
    let times = transfers(cfg, Placement::loopback(), sizes, recv)?;
    Ok(times[1..].iter().sum::<Duration>() / reps.max(1) as u32)
}

/// One transfer per entry of `sizes`, in order on one connection, each on
/// its own stream as in [`copy`]; returns each transfer's time (stream
/// opened → one-byte acknowledgement read).
pub(crate) fn transfers(
    cfg: &TransportConfig,
    at: Placement,
    sizes: Vec<usize>,
    recv: Receive,
) -> std::io::Result<Vec<Duration>> {
    let largest = sizes.iter().copied().max().unwrap_or(0);
    let server_sizes = sizes.clone();
    let ((), times) = run(
        cfg,
        at,
        move |conn| {
            Box::pin(async move {
                let mut warm = if recv == Receive::Warm { warm_buffer(largest) } else { Vec::new() };
                for bytes in server_sizes {
                    let (mut tx, mut rx) = conn.accept_bi().await.map_err(io)?;
                    let mut fresh = super::FreshPages::new(if recv == Receive::Fresh { bytes } else { 0 })?;
                    let dst = if recv == Receive::Warm { &mut warm[..bytes] } else { &mut fresh[..] };
                    let mut got = 0;
                    while got < bytes {
                        let Some(chunk) = rx.read_chunk(bytes - got, true).await.map_err(io)? else { break };
                        dst[got..got + chunk.bytes.len()].copy_from_slice(&chunk.bytes);
                        got += chunk.bytes.len();
                    }
                    if got != bytes {
                        return Err(io(format!("stream ended after {got} of {bytes} bytes")));
                    }
                    std::hint::black_box(&dst);
                    tx.write_all(&[1]).await.map_err(io)?;
                    tx.finish().map_err(io)?;
                }
                Ok(())
            })
        },
        move |conn| {
            Box::pin(async move {
                // A warm source of the largest size, read through as a
                // tensor is (see `raw_copy_into`).
                let src = Bytes::from(warm_buffer(largest));
                let mut times = Vec::with_capacity(sizes.len());
                for bytes in sizes {
                    let start = Instant::now();
                    let (mut tx, mut rx) = conn.open_bi().await.map_err(io)?;
                    let mut sent = 0;
                    while sent < bytes {
                        let n = (bytes - sent).min(1 << 20);
                        tx.write_chunk(src.slice(sent..sent + n)).await.map_err(io)?;
                        sent += n;
                    }
                    tx.finish().map_err(io)?;
                    let mut ack = [0u8; 1];
                    rx.read_exact(&mut ack).await.map_err(io)?;
                    times.push(start.elapsed());
                }
                Ok(times)
            })
        },
    )?;
    Ok(times)
}

/// Round trips of a `size`-byte message echoed by the server on one raw
/// quinn stream per round trip (as tensorwire opens one stream per call).
pub(crate) fn round_trips(cfg: &TransportConfig, size: usize, reps: usize) -> std::io::Result<Histogram> {
    let ((), h) = run(
        cfg,
        Placement::loopback(),
        move |conn| {
            Box::pin(async move {
                let mut buf = vec![0u8; size];
                for _ in 0..reps {
                    let (mut tx, mut rx) = conn.accept_bi().await.map_err(io)?;
                    rx.read_exact(&mut buf).await.map_err(io)?;
                    tx.write_all(&buf).await.map_err(io)?;
                    tx.finish().map_err(io)?;
                }
                Ok(())
            })
        },
        move |conn| {
            Box::pin(async move {
                let msg = vec![1u8; size];
                let mut back = vec![0u8; size];
                let mut h = Histogram::default();
                for _ in 0..reps {
                    let t = Instant::now();
                    let (mut tx, mut rx) = conn.open_bi().await.map_err(io)?;
                    tx.write_all(&msg).await.map_err(io)?;
                    tx.finish().map_err(io)?;
                    rx.read_exact(&mut back).await.map_err(io)?;
                    h.record(t.elapsed());
                }
                Ok(h)
            })
        },
    )?;
    Ok(h)
}
