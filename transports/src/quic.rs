//! `quic://host:port`: QUIC with quinn and rustls (ring), ALPN `tensorwire/1`.
//!
//! Each logical stream is one bidirectional QUIC stream, so concurrent calls
//! never block each other (no head-of-line blocking between streams), and
//! QUIC's per-stream flow control bounds what each may buffer. On a stream,
//! each frame is `u32 meta length | u32 payload length | meta | payload`
//! (little-endian); the end of the stream is QUIC's FIN.
//!
//! Tuning (see [`QuicConfig`]): stream and connection windows sized for a
//! large bandwidth-delay product, a selectable congestion controller, larger
//! UDP socket buffers, keep-alive and idle timeout.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use quinn::{VarInt, congestion};
use tokio::sync::mpsc;

use crate::config::{Congestion, QuicConfig};
use crate::{
    AcceptError, ConnectError, Connection, ConnectionInfo, Endpoint, Frame, FrameHeader, Incoming, ListenError,
    Listener, Payload, Placement, Received, RecvStream, SendStream, StreamError, StreamKind, TransportConfig, tls,
};

/// The ALPN protocol name.
pub const ALPN: &[u8] = b"tensorwire/1";

/// quinn's transport settings from ours.
pub fn transport_config(cfg: &TransportConfig) -> quinn::TransportConfig {
    let q = &cfg.quic;
    let mut t = quinn::TransportConfig::default();
    let var = |v: u64| VarInt::from_u64(v).unwrap_or(VarInt::MAX);
    t.stream_receive_window(var(q.stream_receive_window))
        .receive_window(var(q.receive_window))
        .send_window(q.send_window)
        .max_concurrent_bidi_streams(var(cfg.max_concurrent_streams.into()))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .keep_alive_interval(q.keep_alive)
        .max_idle_timeout(q.idle_timeout.try_into().ok());
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    // Loopback and jumbo-frame networks carry far larger datagrams.
    mtu.upper_bound(8952);
    t.mtu_discovery_config(Some(mtu));
    match q.congestion {
        Congestion::Cubic => t.congestion_controller_factory(Arc::new(congestion::CubicConfig::default())),
        Congestion::Bbr => t.congestion_controller_factory(Arc::new(congestion::BbrConfig::default())),
        Congestion::NewReno => t.congestion_controller_factory(Arc::new(congestion::NewRenoConfig::default())),
    };
    t
}

/// A UDP socket with the buffer sizes asked for (the OS may cap them).
pub fn udp_socket(addr: SocketAddr, q: &QuicConfig) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    if addr.is_ipv6() {
        let _ = s.set_only_v6(false);
    }
    // No SO_REUSEADDR: on UDP it would let a second server share the port
    // silently. A restarted server rebinds at once anyway (no TIME_WAIT).
    let _ = s.set_recv_buffer_size(q.udp_buffer);
    let _ = s.set_send_buffer_size(q.udp_buffer);
    s.bind(&addr.into())?;
    Ok(s.into())
}

fn resolve(ep: &Endpoint) -> std::io::Result<SocketAddr> {
    ep.authority().to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, format!("{} resolves to no address", ep.host()))
    })
}

fn runtime() -> Result<Arc<dyn quinn::Runtime>, std::io::Error> {
    quinn::default_runtime().ok_or_else(|| std::io::Error::other("no tokio runtime"))
}

/// Connects to `quic://host:port`.
pub async fn connect(ep: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let name = ep.to_string();
    let io = |source| ConnectError::Io { endpoint: name.clone(), source };
    let tls_cfg = tls::client_tls_for(&config.tls, ep);
    let rustls_cfg = tls::client_config(&tls_cfg, &[ALPN])
        .map_err(|r| ConnectError::Config { endpoint: name.clone(), reason: r })?;
    let server_name =
        tls::server_name(&tls_cfg, ep).map_err(|r| ConnectError::Config { endpoint: name.clone(), reason: r })?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg)
        .map_err(|e| ConnectError::Config { endpoint: name.clone(), reason: e.to_string() })?;
    let mut client_cfg = quinn::ClientConfig::new(Arc::new(crypto));
    client_cfg.transport_config(Arc::new(transport_config(config)));
    let addr = resolve(ep).map_err(io)?;
    let local: SocketAddr =
        if addr.is_ipv6() { "[::]:0".parse().expect("addr") } else { "0.0.0.0:0".parse().expect("addr") };
    let socket = udp_socket(local, &config.quic).map_err(io)?;
    let endpoint =
        quinn::Endpoint::new(quinn::EndpointConfig::default(), None, socket, runtime().map_err(io)?).map_err(io)?;
    let connecting = endpoint
        .connect_with(client_cfg, addr, &server_name.to_str())
        .map_err(|e| ConnectError::Config { endpoint: name.clone(), reason: e.to_string() })?;
    let conn = connecting.await.map_err(|e| handshake_error(&name, e, config.quic.idle_timeout))?;
    Ok(Arc::new(QuicConnection::new(conn, Some(endpoint), config)))
}

/// TLS alert names for the crypto error codes a QUIC handshake ends with.
fn alert_name(code: u8) -> &'static str {
    match code {
        40 => "handshake_failure",
        42 => "bad_certificate",
        43 => "unsupported_certificate",
        44 => "certificate_revoked",
        45 => "certificate_expired",
        46 => "certificate_unknown",
        48 => "unknown_ca",
        51 => "decrypt_error",
        70 => "protocol_version",
        80 => "internal_error",
        116 => "certificate_required (the server requires a client certificate)",
        120 => "no_application_protocol (the server does not speak tensorwire/1)",
        _ => "TLS alert",
    }
}

fn handshake_error(name: &str, e: quinn::ConnectionError, timeout: Duration) -> ConnectError {
    let tls = |reason: String| ConnectError::Tls { endpoint: name.to_string(), reason };
    match e {
        // Raised here: our verifier refused the server (reason says why).
        quinn::ConnectionError::TransportError(t) => {
            let code = u64::from(t.code);
            if (0x100..0x200).contains(&code) {
                tls(format!("{} [TLS alert {}]{}", t.reason, alert_name((code & 0xff) as u8), tls::hint(&t.reason)))
            } else {
                tls(t.to_string())
            }
        }
        // Raised by the server: it refused us.
        quinn::ConnectionError::ConnectionClosed(c) => {
            let code = u64::from(c.error_code);
            if (0x100..0x200).contains(&code) {
                let alert = (code & 0xff) as u8;
                let why = String::from_utf8_lossy(&c.reason).into_owned();
                tls(format!(
                    "the server refused the handshake: alert {alert} {}{}",
                    alert_name(alert),
                    if why.is_empty() { String::new() } else { format!(": {why}") }
                ))
            } else {
                ConnectError::Protocol { endpoint: name.to_string(), reason: c.to_string() }
            }
        }
        quinn::ConnectionError::TimedOut => ConnectError::Timeout { endpoint: name.to_string(), after: timeout },
        quinn::ConnectionError::VersionMismatch => {
            ConnectError::Protocol { endpoint: name.to_string(), reason: "no common QUIC version".into() }
        }
        other => ConnectError::Io { endpoint: name.to_string(), source: std::io::Error::other(other.to_string()) },
    }
}

/// Listens on `quic://host:port`. Without a certificate a self-signed one is
/// generated; its fingerprint is logged and added to the listener's URL.
pub async fn listen(ep: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    let name = ep.to_string();
    let cfg_err = |reason: String| ListenError::Config { endpoint: name.clone(), reason };
    let id = tls::server_identity(&config.tls, &[ep.host().to_string()]).map_err(cfg_err)?;
    let rustls_cfg = tls::server_config(&config.tls, &id, &[ALPN]).map_err(cfg_err)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(rustls_cfg).map_err(|e| cfg_err(e.to_string()))?;
    let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server_cfg.transport_config(Arc::new(transport_config(config)));
    let io = |source| ListenError::Io { endpoint: name.clone(), source };
    let addr = resolve(ep).map_err(io)?;
    let socket = udp_socket(addr, &config.quic).map_err(io)?;
    let endpoint =
        quinn::Endpoint::new(quinn::EndpointConfig::default(), Some(server_cfg), socket, runtime().map_err(io)?)
            .map_err(io)?;
    let port = endpoint.local_addr().map_err(io)?.port();
    let mut local = ep.with_port(port);
    if id.generated {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "self-signed certificate (clients pin it with --pin-sha256)");
        local = Endpoint::parse(&format!("{}?pin-sha256={}", local, id.fingerprint)).unwrap_or(local);
    } else {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "serving certificate");
    }
    let (tx, rx) = mpsc::channel(64);
    Ok(Box::new(QuicListener { endpoint, local, config: config.clone(), tx, rx, fingerprint: id.fingerprint }))
}

struct QuicListener {
    endpoint: quinn::Endpoint,
    local: Endpoint,
    config: TransportConfig,
    tx: mpsc::Sender<Result<Arc<dyn Connection>, AcceptError>>,
    rx: mpsc::Receiver<Result<Arc<dyn Connection>, AcceptError>>,
    #[allow(dead_code)]
    fingerprint: String,
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        // Stops accepting at once; established connections are closed by their owners.
        self.endpoint.set_server_config(None);
    }
}

#[async_trait]
impl Listener for QuicListener {
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError> {
        loop {
            tokio::select! {
                done = self.rx.recv() => return done.unwrap_or(Err(AcceptError::Closed)),
                incoming = self.endpoint.accept() => {
                    let Some(incoming) = incoming else { return Err(AcceptError::Closed) };
                    // The TLS handshake runs on its own, so a slow client delays no one.
                    let (tx, config) = (self.tx.clone(), self.config.clone());
                    tokio::spawn(async move {
                        let peer = incoming.remote_address().to_string();
                        let r = match incoming.await {
                            Ok(c) => Ok(Arc::new(QuicConnection::new(c, None, &config)) as Arc<dyn Connection>),
                            Err(e) => {
                                tracing::info!(%peer, error = %e, "rejected QUIC connection");
                                Err(AcceptError::Handshake { peer, reason: e.to_string() })
                            }
                        };
                        let _ = tx.send(r).await;
                    });
                }
            }
        }
    }

    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }

    fn release(&self) -> Option<futures_util::future::BoxFuture<'static, ()>> {
        let endpoint = self.endpoint.clone();
        Some(Box::pin(async move {
            endpoint.set_server_config(None);
            endpoint.close(VarInt::from_u32(0), b"server shutting down");
            endpoint.wait_idle().await;
            let addr = endpoint.local_addr().ok();
            // The endpoint's task drops the socket once the last handle is gone.
            drop(endpoint);
            if let Some(addr) = addr {
                for _ in 0..200 {
                    if std::net::UdpSocket::bind(addr).is_ok() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tracing::warn!(%addr, "the QUIC socket is still bound after its connections closed");
            }
        }))
    }
}

/// A QUIC connection; keeps its client endpoint alive.
pub struct QuicConnection {
    conn: quinn::Connection,
    _endpoint: Option<quinn::Endpoint>,
    peer: String,
    max_meta: u32,
    max_payload: u32,
}

impl QuicConnection {
    fn new(conn: quinn::Connection, endpoint: Option<quinn::Endpoint>, config: &TransportConfig) -> Self {
        let peer = conn.remote_address().to_string();
        Self {
            conn,
            _endpoint: endpoint,
            peer,
            max_meta: config.max_header_bytes,
            max_payload: config.max_frame_payload,
        }
    }

    fn halves(&self, send: quinn::SendStream, recv: quinn::RecvStream) -> (Box<dyn SendStream>, Box<dyn RecvStream>) {
        let id = u64::from(send.id().index());
        (
            Box::new(QuicSend { inner: send, peer: self.peer.clone(), id }),
            Box::new(QuicRecv {
                inner: recv,
                peer: self.peer.clone(),
                id,
                max_meta: self.max_meta,
                max_payload: self.max_payload,
                placement: None,
            }),
        )
    }
}

impl Drop for QuicConnection {
    fn drop(&mut self) {
        self.conn.close(VarInt::from_u32(0), b"connection dropped");
    }
}

fn conn_error(peer: &str, e: &quinn::ConnectionError) -> StreamError {
    let reason = match e {
        quinn::ConnectionError::ApplicationClosed(c) => {
            format!("closed by the peer: {}", String::from_utf8_lossy(&c.reason))
        }
        quinn::ConnectionError::TimedOut => "idle timeout: nothing heard from the peer".to_string(),
        quinn::ConnectionError::ConnectionClosed(c) if (0x100..0x200).contains(&u64::from(c.error_code)) => {
            let alert = (u64::from(c.error_code) & 0xff) as u8;
            format!("the peer ended the TLS handshake: alert {alert} {}", alert_name(alert))
        }
        quinn::ConnectionError::TransportError(t) if (0x100..0x200).contains(&u64::from(t.code)) => {
            format!("TLS failed: {}{}", t.reason, tls::hint(&t.reason))
        }
        quinn::ConnectionError::Reset => "reset by the peer (it restarted or forgot the connection)".to_string(),
        quinn::ConnectionError::LocallyClosed => "closed locally".to_string(),
        other => other.to_string(),
    };
    StreamError::ConnectionClosed { peer: peer.to_string(), reason }
}

#[async_trait]
impl Connection for QuicConnection {
    async fn open(&self, _kind: StreamKind) -> Result<(Box<dyn SendStream>, Box<dyn RecvStream>), StreamError> {
        let (s, r) = self.conn.open_bi().await.map_err(|e| conn_error(&self.peer, &e))?;
        Ok(self.halves(s, r))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        let (s, r) = self.conn.accept_bi().await.map_err(|e| conn_error(&self.peer, &e))?;
        let (send, recv) = self.halves(s, r);
        Ok(Incoming { kind: None, send, recv })
    }

    fn info(&self) -> ConnectionInfo {
        ConnectionInfo {
            transport: "quic",
            peer: self.peer.clone(),
            max_frame_payload: self.max_payload.into(),
            local: self.conn.remote_address().ip().is_loopback(),
            stateless: false,
        }
    }

    fn close(&self, reason: &str) {
        self.conn.close(VarInt::from_u32(0), reason.as_bytes());
    }

    fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }

    async fn closed(&self) {
        self.conn.closed().await;
    }
}

struct QuicSend {
    inner: quinn::SendStream,
    peer: String,
    id: u64,
}

fn write_error(peer: &str, id: u64, e: quinn::WriteError) -> StreamError {
    match e {
        quinn::WriteError::Stopped(code) => {
            StreamError::Stopped { peer: peer.into(), stream: id, code: code.into_inner() as u32 }
        }
        quinn::WriteError::ConnectionLost(c) => conn_error(peer, &c),
        quinn::WriteError::ClosedStream => StreamError::Finished { peer: peer.into(), stream: id },
        other => StreamError::Protocol { peer: peer.into(), reason: other.to_string() },
    }
}

fn frame_chunks(f: Frame, out: &mut Vec<Bytes>) {
    let meta_len = f.header.encoded_len();
    let mut head = BytesMut::with_capacity(8 + meta_len);
    head.put_u32_le(meta_len as u32);
    head.put_u32_le(f.payload.len() as u32);
    f.header.encode(&mut head).expect("BytesMut grows");
    out.push(head.freeze());
    if !f.payload.is_empty() {
        out.push(f.payload);
    }
}

#[async_trait]
impl SendStream for QuicSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        self.send_batch(vec![frame], false).await
    }

    async fn send_last(&mut self, frame: Frame) -> Result<(), StreamError> {
        self.send_batch(vec![frame], true).await
    }

    async fn send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        let mut chunks = Vec::with_capacity(frames.len() * 2);
        for f in frames {
            frame_chunks(f, &mut chunks);
        }
        self.inner.write_all_chunks(&mut chunks).await.map_err(|e| write_error(&self.peer, self.id, e))?;
        if fin {
            self.finish().await?;
        }
        Ok(())
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        // Finishing twice has nothing left to do.
        let _ = self.inner.finish();
        Ok(())
    }

    fn reset(&mut self, code: u32) {
        let _ = self.inner.reset(VarInt::from_u32(code));
    }

    fn id(&self) -> u64 {
        self.id
    }
}

struct QuicRecv {
    inner: quinn::RecvStream,
    peer: String,
    id: u64,
    max_meta: u32,
    max_payload: u32,
    placement: Option<Placement>,
}

impl QuicRecv {
    fn read_error(&self, e: quinn::ReadError) -> StreamError {
        match e {
            quinn::ReadError::Reset(code) => {
                StreamError::Reset { peer: self.peer.clone(), stream: self.id, code: code.into_inner() as u32 }
            }
            quinn::ReadError::ConnectionLost(c) => conn_error(&self.peer, &c),
            other => StreamError::Protocol { peer: self.peer.clone(), reason: other.to_string() },
        }
    }

    fn exact_error(&self, e: quinn::ReadExactError, what: &str) -> StreamError {
        match e {
            quinn::ReadExactError::FinishedEarly(n) => StreamError::Protocol {
                peer: self.peer.clone(),
                reason: format!("stream ended {n} bytes into a {what}"),
            },
            quinn::ReadExactError::ReadError(e) => self.read_error(e),
        }
    }

    async fn payload(&mut self, len: usize) -> Result<Bytes, StreamError> {
        // Often one chunk holds it all: then no copy at all.
        let mut out: Option<BytesMut> = None;
        let mut first: Option<Bytes> = None;
        let mut got = 0;
        while got < len {
            let chunk = self.inner.read_chunk(len - got, true).await.map_err(|e| self.read_error(e))?;
            let Some(chunk) = chunk else {
                return Err(StreamError::Protocol {
                    peer: self.peer.clone(),
                    reason: format!("stream ended {got} bytes into a {len} byte payload"),
                });
            };
            got += chunk.bytes.len();
            match (&mut out, first.take()) {
                (None, None) if got == len => return Ok(chunk.bytes),
                (None, None) => first = Some(chunk.bytes),
                (None, Some(f)) => {
                    let mut b = BytesMut::with_capacity(len);
                    b.extend_from_slice(&f);
                    b.extend_from_slice(&chunk.bytes);
                    out = Some(b);
                }
                (Some(b), _) => b.extend_from_slice(&chunk.bytes),
            }
        }
        Ok(out.map(BytesMut::freeze).or(first).unwrap_or_default())
    }
}

#[async_trait]
impl RecvStream for QuicRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        let mut head = [0u8; 8];
        match self.inner.read_exact(&mut head).await {
            Ok(()) => {}
            Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
            Err(e) => return Err(self.exact_error(e, "frame head")),
        }
        let meta_len = u32::from_le_bytes(head[..4].try_into().expect("4"));
        let payload_len = u32::from_le_bytes(head[4..].try_into().expect("4"));
        if meta_len > self.max_meta || payload_len > self.max_payload {
            let (what, size, limit) = if meta_len > self.max_meta {
                ("frame header", meta_len, self.max_meta)
            } else {
                ("frame payload", payload_len, self.max_payload)
            };
            let _ = self.inner.stop(VarInt::from_u32(5));
            return Err(StreamError::LimitExceeded {
                peer: self.peer.clone(),
                what,
                size: size.into(),
                limit: limit.into(),
            });
        }
        let mut meta = vec![0u8; meta_len as usize];
        self.inner.read_exact(&mut meta).await.map_err(|e| self.exact_error(e, "frame header"))?;
        let header = FrameHeader::decode(&meta[..]).map_err(|e| StreamError::Protocol {
            peer: self.peer.clone(),
            reason: format!("undecodable frame header: {e}"),
        })?;
        let len = payload_len as usize;
        let place = match (&self.placement, header.placement_offset()) {
            (Some(p), Some((tid, off))) if p.accepts(tid, off, len) => Some((p.clone(), off)),
            _ => None,
        };
        let payload = match place {
            Some((p, off)) => {
                let mut g = p.lock().await;
                let dst = &mut g[off as usize..off as usize + len];
                self.inner.read_exact(dst).await.map_err(|e| self.exact_error(e, "payload"))?;
                Payload::Placed { offset: off, len }
            }
            None => Payload::Bytes(self.payload(len).await?),
        };
        Ok(Some(Received { header, payload }))
    }

    fn place(&mut self, target: Option<Placement>) {
        self.placement = target;
    }

    fn id(&self) -> u64 {
        self.id
    }
}

/// An idle connection is closed after this long by default (see [`QuicConfig::idle_timeout`]).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
