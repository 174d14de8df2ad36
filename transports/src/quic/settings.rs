//! quinn settings from [`TransportConfig`]: the ALPN name, transport and
//! endpoint configs, the UDP socket, address resolution.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use quinn::{VarInt, congestion};

use crate::config::{Congestion, QuicConfig};
use crate::{Endpoint, TransportConfig};

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

pub(crate) fn resolve(ep: &Endpoint) -> std::io::Result<SocketAddr> {
    ep.authority().to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, format!("{} resolves to no address", ep.host()))
    })
}

pub(crate) fn runtime() -> Result<Arc<dyn quinn::Runtime>, std::io::Error> {
    quinn::default_runtime().ok_or_else(|| std::io::Error::other("no tokio runtime"))
}

/// An idle connection is closed after this long by default (see [`QuicConfig::idle_timeout`]).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
