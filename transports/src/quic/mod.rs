//! `quic://host:port`: QUIC with quinn and rustls (ring), ALPN `tensorwire/1`.
//!
//! Each logical stream is one bidirectional QUIC stream, so concurrent calls
//! never block each other (no head-of-line blocking between streams), and
//! QUIC's per-stream flow control bounds what each may buffer. The framing
//! on a stream is in [`stream`](self) (`QuicConnection`); striping one
//! logical connection over several QUIC connections is in [`group`].
//!
//! TLS (see [`crate::tls`]): a server without a certificate generates a
//! self-signed one and puts its fingerprint in its URL
//! (`quic://host:port?pin-sha256=...`), so the URL it prints is all a client
//! needs; CA files, mutual TLS and an explicit opt-out exist too.
//!
//! Tuning (see [`QuicConfig`]): stream and connection windows sized for a
//! large bandwidth-delay product, a selectable congestion controller, larger
//! UDP socket buffers, keep-alive and idle timeout, striping.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use quinn::{VarInt, congestion};
use tokio::sync::mpsc;

use crate::config::{Congestion, QuicConfig};
use crate::{
    AcceptError, ConnectError, Connection, Endpoint, ListenError, Listener, StreamError, TransportConfig, tls,
};

pub mod group;
mod stream;

use group::{Group, GroupIndex, MAX_STRIPES, STRIPE_ALPN};
pub use stream::QuicConnection;

/// The quinn this transport is built on, for code that needs the same
/// version (the raw-stream baseline of the benchmarks).
pub use quinn;

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
        // Unidirectional streams: group control and stripe payloads.
        .max_concurrent_uni_streams(var(cfg.max_concurrent_streams.into()))
        .keep_alive_interval(q.keep_alive)
        .max_idle_timeout(q.idle_timeout.try_into().ok());
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    // Path MTU discovery probes up to this (see QuicConfig::max_udp_payload).
    mtu.upper_bound(q.max_udp_payload);
    t.mtu_discovery_config(Some(mtu));
    match q.congestion {
        Congestion::Cubic => t.congestion_controller_factory(Arc::new(congestion::CubicConfig::default())),
        Congestion::Bbr => t.congestion_controller_factory(Arc::new(congestion::BbrConfig::default())),
        Congestion::NewReno => t.congestion_controller_factory(Arc::new(congestion::NewRenoConfig::default())),
    };
    t
}

/// quinn's endpoint settings from ours: the largest UDP payload this side
/// accepts, which the peer's path MTU discovery will not exceed (quinn's
/// default is 1472 bytes, which caps loopback and jumbo-frame links).
pub fn endpoint_config(cfg: &TransportConfig) -> quinn::EndpointConfig {
    let mut e = quinn::EndpointConfig::default();
    let _ = e.max_udp_payload_size(cfg.quic.max_udp_payload);
    e
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

/// `config` with the URL's `?stripes=` and `?congestion=` applied.
fn url_overrides(config: &TransportConfig, ep: &Endpoint) -> Result<TransportConfig, String> {
    let mut c = config.clone();
    if let Some(n) = ep.query("stripes") {
        c.quic.stripes = n
            .parse()
            .ok()
            .filter(|n| (1..=MAX_STRIPES).contains(n))
            .ok_or_else(|| format!("stripes={n:?}: expected a number of connections from 1 to {MAX_STRIPES}"))?;
    }
    if let Some(cc) = ep.query("congestion") {
        c.quic.congestion = cc.parse()?;
    }
    Ok(c)
}

/// A client endpoint on its own UDP socket, connected to `addr`.
async fn dial(
    name: &str,
    addr: SocketAddr,
    server_name: &str,
    rustls_cfg: rustls::ClientConfig,
    config: &TransportConfig,
) -> Result<(quinn::Endpoint, quinn::Connection), ConnectError> {
    let io = |source| ConnectError::Io { endpoint: name.to_string(), source };
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg)
        .map_err(|e| ConnectError::Config { endpoint: name.to_string(), reason: e.to_string() })?;
    let mut client_cfg = quinn::ClientConfig::new(Arc::new(crypto));
    client_cfg.transport_config(Arc::new(transport_config(config)));
    let local: SocketAddr =
        if addr.is_ipv6() { "[::]:0".parse().expect("addr") } else { "0.0.0.0:0".parse().expect("addr") };
    let socket = udp_socket(local, &config.quic).map_err(io)?;
    let endpoint = quinn::Endpoint::new(endpoint_config(config), None, socket, runtime().map_err(io)?).map_err(io)?;
    let connecting = endpoint
        .connect_with(client_cfg, addr, server_name)
        .map_err(|e| ConnectError::Config { endpoint: name.to_string(), reason: e.to_string() })?;
    let conn = connecting.await.map_err(|e| handshake_error(name, e, config.quic.idle_timeout))?;
    Ok((endpoint, conn))
}

async fn send_control(conn: &quinn::Connection, msg: Vec<u8>) -> Result<(), String> {
    let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
    s.write_all(&msg).await.map_err(|e| e.to_string())?;
    s.finish().map_err(|e| e.to_string())
}

/// Connects to `quic://host:port`; with [`QuicConfig::stripes`] > 1, also
/// opens and joins the stripe connections (see [`group`]).
///
/// The URL may override settings: `?stripes=N`, `?congestion=bbr`, and the
/// TLS ones (`?pin-sha256=HEX`, `?ca=PATH`, `?server-name=NAME`).
pub async fn connect(ep: &Endpoint, config: &TransportConfig) -> Result<Arc<QuicConnection>, ConnectError> {
    let name = ep.to_string();
    let cfg_err = |reason: String| ConnectError::Config { endpoint: name.clone(), reason };
    let config = &url_overrides(config, ep).map_err(cfg_err)?;
    let tls_cfg = tls::client_tls_for(&config.tls, ep);
    let rustls_cfg = tls::client_config(&tls_cfg, &[ALPN]).map_err(cfg_err)?;
    let server_name = tls::server_name(&tls_cfg, ep).map_err(cfg_err)?.to_str().into_owned();
    let addr = resolve(ep).map_err(|source| ConnectError::Io { endpoint: name.clone(), source })?;
    let (endpoint, conn) = dial(&name, addr, &server_name, rustls_cfg.clone(), config).await?;
    let group = Group::new(conn.clone());
    let mut endpoints = vec![endpoint];
    let stripes = config.quic.stripes.clamp(1, MAX_STRIPES);
    if stripes > 1 {
        let token = group::new_token();
        let announce = send_control(&conn, group::group_message(&token, stripes as u8));
        announce.await.map_err(|r| ConnectError::Protocol { endpoint: name.clone(), reason: r })?;
        group.expect(token, stripes as u8).map_err(cfg_err)?;
        let mut stripe_tls = rustls_cfg;
        stripe_tls.alpn_protocols = vec![STRIPE_ALPN.to_vec()];
        for i in 1..stripes as u8 {
            // A stripe that cannot join costs speed, not the connection.
            let joined = async {
                let (e, c) =
                    dial(&name, addr, &server_name, stripe_tls.clone(), config).await.map_err(|e| e.to_string())?;
                send_control(&c, group::join_message(&token, i)).await?;
                group.attach(&token, i, c.clone())?;
                Ok::<_, String>((e, c))
            };
            match joined.await {
                Ok((e, c)) => {
                    endpoints.push(e);
                    tokio::spawn(group::serve_stripe_streams(c, Arc::downgrade(&group), i));
                }
                Err(reason) => tracing::warn!(endpoint = %name, stripe = i, %reason, "QUIC stripe not joined"),
            }
        }
    }
    // The client accepts no control streams: anything the server opens
    // unidirectionally on the primary is refused.
    Ok(Arc::new(QuicConnection::new(conn, group, endpoints, config)))
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
    let rustls_cfg = tls::server_config(&config.tls, &id, &[ALPN, STRIPE_ALPN]).map_err(cfg_err)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(rustls_cfg).map_err(|e| cfg_err(e.to_string()))?;
    let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server_cfg.transport_config(Arc::new(transport_config(config)));
    let io = |source| ListenError::Io { endpoint: name.clone(), source };
    let addr = resolve(ep).map_err(io)?;
    let socket = udp_socket(addr, &config.quic).map_err(io)?;
    let endpoint =
        quinn::Endpoint::new(endpoint_config(config), Some(server_cfg), socket, runtime().map_err(io)?).map_err(io)?;
    let port = endpoint.local_addr().map_err(io)?.port();
    let mut local = ep.with_port(port);
    if id.generated {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "self-signed certificate (clients pin it with --pin-sha256)");
        local = Endpoint::parse(&format!("{}?pin-sha256={}", local, id.fingerprint)).unwrap_or(local);
    } else {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "serving certificate");
    }
    let (tx, rx) = mpsc::channel(64);
    Ok(Box::new(QuicListener {
        endpoint,
        local,
        config: config.clone(),
        tx,
        rx,
        groups: Arc::new(GroupIndex::default()),
    }))
}

struct QuicListener {
    endpoint: quinn::Endpoint,
    local: Endpoint,
    config: TransportConfig,
    tx: mpsc::Sender<Result<Arc<dyn Connection>, AcceptError>>,
    rx: mpsc::Receiver<Result<Arc<dyn Connection>, AcceptError>>,
    groups: Arc<GroupIndex>,
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        // Stops accepting at once; established connections are closed by their owners.
        self.endpoint.set_server_config(None);
    }
}

fn alpn_of(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?.downcast::<quinn::crypto::rustls::HandshakeData>().ok()?.protocol
}

/// Finishes accepting one connection: the TLS handshake, then either a new
/// connection for the application or a stripe joining its group.
async fn admit(
    incoming: quinn::Incoming,
    config: TransportConfig,
    groups: Arc<GroupIndex>,
) -> Option<Result<Arc<dyn Connection>, AcceptError>> {
    let peer = incoming.remote_address().to_string();
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            tracing::info!(%peer, error = %e, "rejected QUIC connection");
            return Some(Err(AcceptError::Handshake { peer, reason: e.to_string() }));
        }
    };
    if alpn_of(&conn).as_deref() == Some(STRIPE_ALPN) {
        tokio::spawn(group::serve_stripe_join(conn, groups));
        return None;
    }
    let group = Group::new(conn.clone());
    tokio::spawn(group::serve_primary_control(conn.clone(), Arc::downgrade(&group), groups));
    Some(Ok(Arc::new(QuicConnection::new(conn, group, Vec::new(), &config)) as Arc<dyn Connection>))
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
                    let (tx, config, groups) = (self.tx.clone(), self.config.clone(), self.groups.clone());
                    tokio::spawn(async move {
                        if let Some(r) = admit(incoming, config, groups).await {
                            let _ = tx.send(r).await;
                        }
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

pub(crate) fn conn_error(peer: &str, e: &quinn::ConnectionError) -> StreamError {
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

/// An idle connection is closed after this long by default (see [`QuicConfig::idle_timeout`]).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
