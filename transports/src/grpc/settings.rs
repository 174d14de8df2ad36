//! What the client and server sides share: the ALPN name, message size
//! limit, socket tuning and transport names.

use tokio::net::TcpStream;

use super::wire::Limits;
use crate::{Scheme, StreamKind, TransportConfig};

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

/// The message and header limits of [`super::wire::Decoder`].
pub(crate) fn limits(config: &TransportConfig) -> Limits {
    Limits { message: message_limit(config), header: config.max_header_bytes as usize }
}

/// What a `content-type` says of a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContentType {
    /// `application/grpc` or `application/grpc+proto` (any case, optionally
    /// with parameters): protobuf gRPC messages.
    Proto,
    /// gRPC with another message format (`application/grpc+json`, ...).
    OtherGrpc,
    /// Not gRPC.
    NotGrpc,
}

/// Classifies a `content-type` header value.
pub(crate) fn content_type(v: &str) -> ContentType {
    let base = v.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    match base.as_str() {
        "application/grpc" | "application/grpc+proto" => ContentType::Proto,
        b if b.starts_with("application/grpc+") => ContentType::OtherGrpc,
        _ => ContentType::NotGrpc,
    }
}

pub(crate) fn tune_tcp(s: &TcpStream, config: &TransportConfig) {
    let _ = s.set_nodelay(true);
    if let Some(n) = config.socket_buffer {
        let sock = socket2::SockRef::from(s);
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
}

/// The gRPC service both sides speak.
pub(crate) const SERVICE: &str = "tensorwire.v1.TensorService";

/// A method of [`SERVICE`], and which of its directions carry one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Method {
    Handshake,
    Send,
    Fetch,
    Exchange,
    Call,
}

impl Method {
    /// The method a stream of `kind` calls.
    pub(crate) fn for_kind(kind: StreamKind) -> Self {
        match kind {
            StreamKind::Handshake => Method::Handshake,
            StreamKind::Send => Method::Send,
            StreamKind::Fetch => Method::Fetch,
            StreamKind::Exchange => Method::Exchange,
            StreamKind::Call => Method::Call,
        }
    }

    /// The method at an HTTP/2 `:path`, if it is one of [`SERVICE`]'s.
    pub(crate) fn from_path(path: &str) -> Option<Self> {
        let name = path.strip_prefix('/')?.strip_prefix(SERVICE)?.strip_prefix('/')?;
        Some(match name {
            "Handshake" => Method::Handshake,
            "Send" => Method::Send,
            "Fetch" => Method::Fetch,
            "Exchange" => Method::Exchange,
            "Call" => Method::Call,
            _ => return None,
        })
    }

    /// The stream kind the server hands the pipeline.
    pub(crate) fn kind(self) -> StreamKind {
        match self {
            Method::Handshake => StreamKind::Handshake,
            Method::Send => StreamKind::Send,
            Method::Fetch => StreamKind::Fetch,
            Method::Exchange => StreamKind::Exchange,
            Method::Call => StreamKind::Call,
        }
    }

    /// The HTTP/2 `:path` of a call.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Method::Handshake => "/tensorwire.v1.TensorService/Handshake",
            Method::Send => "/tensorwire.v1.TensorService/Send",
            Method::Fetch => "/tensorwire.v1.TensorService/Fetch",
            Method::Exchange => "/tensorwire.v1.TensorService/Exchange",
            Method::Call => "/tensorwire.v1.TensorService/Call",
        }
    }

    /// The request is one message.
    pub(crate) fn unary_request(self) -> bool {
        matches!(self, Method::Handshake | Method::Fetch)
    }

    /// The response is one message.
    pub(crate) fn unary_response(self) -> bool {
        matches!(self, Method::Handshake | Method::Send)
    }
}
