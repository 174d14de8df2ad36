//! What the client and server sides share: the ALPN name, message size
//! limit, socket tuning and transport names.

use tokio::net::TcpStream;

use crate::{Scheme, TransportConfig};

/// ALPN protocol of HTTP/2 over TLS.
pub(crate) const H2: &[u8] = b"h2";

pub(crate) fn transport_name(s: Scheme) -> &'static str {
    match s {
        Scheme::Grpcs => "grpcs",
        Scheme::GrpcUnix => "grpc+unix",
        _ => "grpc",
    }
}

/// Largest gRPC message either side accepts: a frame's payload and header
/// plus protobuf framing.
pub fn message_limit(config: &TransportConfig) -> usize {
    config.max_frame_payload as usize + config.max_header_bytes as usize + 64
}

pub(crate) fn tune_tcp(s: &TcpStream, config: &TransportConfig) {
    let _ = s.set_nodelay(true);
    if let Some(n) = config.socket_buffer {
        let sock = socket2::SockRef::from(s);
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
}
