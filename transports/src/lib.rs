//! # tensorwire-transports
//!
//! The [`Transport`] trait and its implementations. A transport moves
//! *frames* — a small protobuf [`FrameHeader`] and raw payload bytes — over
//! many concurrent logical streams of one connection, with flow control that
//! keeps each stream's buffered bytes within a window whatever the peer does.
//! Transports know nothing of dtypes or codecs; the `tensorwire` crate puts
//! tensors into frames.
//!
//! ```text
//!   Connection ── open()/accept() ──► (SendStream, RecvStream) per call
//!       │                                   │ send(Frame)      │ recv() -> Received
//!       ▼                                   ▼                  ▼
//!   tcp:// unix:// : one socket, frames multiplexed by stream id (mux)
//!   quic://        : one QUIC stream per logical stream
//!   grpc://        : one HTTP/2 call per logical stream (tonic)
//!   shm://         : mux over a Unix socket, large payloads in shared memory
//!   ucx://         : mux over a TCP socket, large payloads through UCX (RDMA)
//! ```
//!
//! ## Feature flags
//!
//! | feature | default | scheme | implementation |
//! |---|---|---|---|
//! | `tcp` | yes | `tcp://host:port` | [`mux`] over a TCP socket (TCP_NODELAY, vectored writes) |
//! | `unix` | yes | `unix:///path` | [`mux`] over a Unix stream socket |
//! | `quic` | no | `quic://host:port` | quinn + rustls (ring) |
//! | `grpc` | no | `grpc://`, `grpcs://`, `grpc+unix://` | [`grpc`]: tonic server, hyper HTTP/2 client, tuned windows |
//! | `shm` | no | `shm://name` (and `unix://` upgraded) | [`shm`]: mux over Unix + sealed memfd segments passed by `SCM_RIGHTS` |
//! | `ucx` | no | `ucx://host:port` | `ucx`: mux over TCP + UCX rendezvous for large payloads (needs libucx) |
#![warn(missing_docs)]

pub mod buf;
pub mod config;
pub mod copy;
pub mod endpoint;
#[cfg(feature = "grpc")]
pub mod grpc;
mod listener;
pub mod mux;
#[cfg(feature = "quic")]
pub mod quic;
#[cfg(feature = "shm")]
pub mod shm;
mod spin;
mod sync;
#[cfg(feature = "tcp")]
pub mod tcp;
#[cfg(feature = "tcps")]
pub mod tcps;
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(any(feature = "ucx", feature = "fuzzing"))]
pub mod ucx;
#[cfg(feature = "unix")]
pub mod unix;

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

pub use buf::RecvBuf;

pub use config::TransportConfig;
pub use endpoint::{Endpoint, EndpointError, Scheme};
pub use tensorwire_proto::v1::FrameHeader;

/// One frame to send: a header and its payload (empty for non-chunk frames).
#[derive(Debug, Clone, Default)]
pub struct Frame {
    /// The header.
    pub header: FrameHeader,
    /// Payload bytes that follow the header on the wire.
    pub payload: Bytes,
}

impl Frame {
    /// A frame with no payload.
    pub fn header_only(header: FrameHeader) -> Self {
        Self { header, payload: Bytes::new() }
    }
}

/// A received frame.
#[derive(Debug, Clone)]
pub struct Received {
    /// The header.
    pub header: FrameHeader,
    /// Where the payload is.
    pub payload: Payload,
}

/// Where a received payload went.
#[derive(Debug, Clone)]
pub enum Payload {
    /// The payload bytes.
    Bytes(Bytes),
    /// The transport wrote the payload straight into the stream's
    /// [`Placement`] buffer at `offset..offset+len`.
    Placed {
        /// Byte offset in the placement buffer.
        offset: u64,
        /// Length in bytes.
        len: usize,
    },
}

impl Payload {
    /// Payload length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Payload::Bytes(b) => b.len(),
            Payload::Placed { len, .. } => *len,
        }
    }

    /// True when the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A buffer a receiver registers for one tensor so that the transport
/// writes that tensor's uncompressed chunk payloads directly at their
/// offsets (see [`FrameHeader::placement_offset`]) instead of handing over a
/// copy: the receive path of a large tensor then has no copy besides the
/// socket read. Chunks of other tensors are never placed in it.
#[derive(Clone, Debug)]
pub struct Placement {
    buf: Arc<tokio::sync::Mutex<RecvBuf>>,
    len: usize,
    tensor_id: u64,
}

impl Placement {
    /// Wraps a buffer for the tensor `tensor_id` (its length is fixed from now on).
    pub fn new(buf: RecvBuf, tensor_id: u64) -> Self {
        let len = buf.len();
        Self { buf: Arc::new(tokio::sync::Mutex::new(buf)), len, tensor_id }
    }

    /// The payload range `offset..offset+len` of tensor `tensor_id` fits here.
    pub fn accepts(&self, tensor_id: u64, offset: u64, len: usize) -> bool {
        tensor_id == self.tensor_id
            && len > 0
            && offset.checked_add(len as u64).is_some_and(|end| end <= self.len as u64)
    }

    /// Buffer length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Locks the buffer for writing.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, RecvBuf> {
        self.buf.lock().await
    }

    /// Locks the buffer for a write that outlives the caller's borrow (a
    /// receive posted to another thread or a NIC): the guard keeps the
    /// buffer alive and exclusive until it is dropped.
    pub async fn lock_owned(&self) -> tokio::sync::OwnedMutexGuard<RecvBuf> {
        self.buf.clone().lock_owned().await
    }

    /// Locks the buffer like [`lock_owned`](Self::lock_owned) if no one
    /// holds it now.
    pub fn try_lock_owned(&self) -> Option<tokio::sync::OwnedMutexGuard<RecvBuf>> {
        self.buf.clone().try_lock_owned().ok()
    }

    /// The tensor this placement is for.
    pub fn tensor_id(&self) -> u64 {
        self.tensor_id
    }

    /// Takes the buffer back once no transport holds it (after
    /// [`RecvStream::place`] with `None`); otherwise takes its contents.
    pub async fn into_inner(self) -> RecvBuf {
        match Arc::try_unwrap(self.buf) {
            Ok(m) => m.into_inner(),
            Err(shared) => std::mem::take(&mut *shared.lock().await),
        }
    }
}

/// Which call a stream carries. Only gRPC, which names a method per call,
/// uses it; byte-stream transports ignore it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StreamKind {
    /// Version, codecs and limits.
    Handshake,
    /// Client-to-server tensors.
    Send,
    /// Server-to-client tensors.
    Fetch,
    /// Both directions.
    Exchange,
    /// Functions, tasks, info, health.
    Call,
}

impl StreamKind {
    /// The gRPC method name.
    pub const fn method(self) -> &'static str {
        match self {
            StreamKind::Handshake => "Handshake",
            StreamKind::Send => "Send",
            StreamKind::Fetch => "Fetch",
            StreamKind::Exchange => "Exchange",
            StreamKind::Call => "Call",
        }
    }
}

/// Errors on a stream or its connection. Peer misbehaviour, limits, resets
/// and I/O are different variants; every message names the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The connection is gone.
    #[error("connection to {peer} closed: {reason}")]
    ConnectionClosed {
        /// Peer address.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The peer abandoned its side of the stream.
    #[error("stream {stream} reset by {peer} (code {code})")]
    Reset {
        /// Peer address.
        peer: String,
        /// Stream id.
        stream: u64,
        /// Application code.
        code: u32,
    },
    /// The peer stopped reading what this side sends.
    #[error("{peer} stopped reading stream {stream} (code {code})")]
    Stopped {
        /// Peer address.
        peer: String,
        /// Stream id.
        stream: u64,
        /// Application code.
        code: u32,
    },
    /// The peer broke the protocol.
    #[error("protocol violation by {peer}: {reason}")]
    Protocol {
        /// Peer address.
        peer: String,
        /// What it did.
        reason: String,
    },
    /// A size above a limit.
    #[error("{what} of {size} bytes exceeds the limit of {limit} bytes (peer {peer})")]
    LimitExceeded {
        /// Peer address.
        peer: String,
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The peer holds more of this side's memory than it may (a gRPC
    /// connection's unfinished messages); the stream ends, the connection
    /// stays.
    #[error("{peer}: resource exhausted: {reason}")]
    ResourceExhausted {
        /// Peer address.
        peer: String,
        /// What was exhausted.
        reason: String,
    },
    /// A socket error.
    #[error("I/O error with {peer}: {reason}")]
    Io {
        /// Peer address.
        peer: String,
        /// The error kind.
        kind: io::ErrorKind,
        /// The error message.
        reason: String,
    },
    /// Sending on a stream this side already finished or reset (API misuse).
    #[error("stream {stream} to {peer} is already finished")]
    Finished {
        /// Peer address.
        peer: String,
        /// Stream id.
        stream: u64,
    },
    /// The peer refused to open a new stream (too many open).
    #[error("{peer} refused a new stream: {reason}")]
    Refused {
        /// Peer address.
        peer: String,
        /// Why.
        reason: String,
    },
}

impl StreamError {
    pub(crate) fn io(peer: &str, e: &io::Error) -> Self {
        StreamError::Io { peer: peer.to_string(), kind: e.kind(), reason: e.to_string() }
    }

    /// True when the whole connection is unusable (as opposed to one stream).
    pub fn is_connection_error(&self) -> bool {
        matches!(self, StreamError::ConnectionClosed { .. } | StreamError::Io { .. } | StreamError::Protocol { .. })
    }
}

/// Errors from connecting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL is malformed.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The scheme was compiled out.
    #[error("scheme {scheme} is not enabled in this build (cargo feature {feature:?})")]
    NotEnabled {
        /// The scheme.
        scheme: Scheme,
        /// The cargo feature that enables it.
        feature: &'static str,
    },
    /// A socket error (refused, unreachable, ...).
    #[error("cannot connect to {endpoint}: {source}")]
    Io {
        /// The endpoint.
        endpoint: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// No connection within the configured time.
    #[error("connecting to {endpoint} timed out after {after:?}")]
    Timeout {
        /// The endpoint.
        endpoint: String,
        /// The timeout.
        after: Duration,
    },
    /// TLS failed: certificate mismatch, unknown CA, pin mismatch, ...
    #[error("TLS with {endpoint} failed: {reason}")]
    Tls {
        /// The endpoint.
        endpoint: String,
        /// The cause, as the TLS stack names it.
        reason: String,
    },
    /// The peer does not speak this transport's protocol.
    #[error("{endpoint} does not speak tensorwire: {reason}")]
    Protocol {
        /// The endpoint.
        endpoint: String,
        /// What was wrong.
        reason: String,
    },
    /// Bad configuration (missing certificate file, ...).
    #[error("invalid configuration for {endpoint}: {reason}")]
    Config {
        /// The endpoint.
        endpoint: String,
        /// What is wrong.
        reason: String,
    },
}

/// Errors from listening.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ListenError {
    /// The URL is malformed.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// The scheme was compiled out.
    #[error("scheme {scheme} is not enabled in this build (cargo feature {feature:?})")]
    NotEnabled {
        /// The scheme.
        scheme: Scheme,
        /// The cargo feature that enables it.
        feature: &'static str,
    },
    /// Binding failed (address in use, permission, ...).
    #[error("cannot listen on {endpoint}: {source}")]
    Io {
        /// The endpoint.
        endpoint: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Bad configuration (unreadable certificate, ...).
    #[error("invalid configuration for {endpoint}: {reason}")]
    Config {
        /// The endpoint.
        endpoint: String,
        /// What is wrong.
        reason: String,
    },
}

/// Errors from accepting connections.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AcceptError {
    /// The listener was closed.
    #[error("listener closed")]
    Closed,
    /// Accepting failed; the listener keeps working.
    #[error("accept failed: {0}")]
    Io(#[from] io::Error),
    /// A peer connected but failed the transport handshake (bad preface,
    /// TLS failure). The listener keeps working.
    #[error("rejected connection from {peer}: {reason}")]
    Handshake {
        /// Peer address.
        peer: String,
        /// Why.
        reason: String,
    },
}

/// Facts about a connection.
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    /// Transport name (`"tcp"`, `"unix"`, `"quic"`, ...).
    pub transport: &'static str,
    /// Peer address, for messages.
    pub peer: String,
    /// Largest payload the peer accepts in one frame.
    pub max_frame_payload: u64,
    /// True when payload bytes cross no network (Unix sockets, shm).
    pub local: bool,
    /// True when each stream stands alone and there is no per-connection
    /// handshake (gRPC: calls from many HTTP/2 connections arrive as one).
    pub stateless: bool,
}

/// A stream opened by the peer, ready to be served.
pub struct Incoming {
    /// The call kind, when the transport knows it (gRPC).
    pub kind: Option<StreamKind>,
    /// Sending half.
    pub send: Box<dyn SendStream>,
    /// Receiving half.
    pub recv: Box<dyn RecvStream>,
    /// The caller's address when it is not the connection's peer (a gRPC
    /// server's one connection carries every client's calls); None: the
    /// connection's [`ConnectionInfo::peer`].
    pub peer: Option<String>,
}

impl fmt::Debug for Incoming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Incoming").field("kind", &self.kind).finish_non_exhaustive()
    }
}

/// Sending half of a logical stream.
#[async_trait]
pub trait SendStream: Send + 'static {
    /// Sends a frame, waiting for flow-control credit as needed.
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError>;
    /// Sends a frame and marks it the last one.
    async fn send_last(&mut self, frame: Frame) -> Result<(), StreamError> {
        self.send(frame).await?;
        self.finish().await
    }
    /// Sends several frames at once (and with `fin`, ends this direction):
    /// transports that can write them together save wake-ups and syscalls.
    async fn send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        let n = frames.len();
        for (i, f) in frames.into_iter().enumerate() {
            if fin && i + 1 == n {
                return self.send_last(f).await;
            }
            self.send(f).await?;
        }
        if fin { self.finish().await } else { Ok(()) }
    }
    /// Ends this direction gracefully; the peer's `recv` returns `None`.
    async fn finish(&mut self) -> Result<(), StreamError>;
    /// [`send_batch`](SendStream::send_batch) now, without waiting, when the
    /// transport can (the flow-control credit is there and nothing else
    /// needs a wait): `Ok` with the send's result. `Err` hands the frames
    /// back untouched: await `send_batch` with them. A small call's frames
    /// usually leave this way, sparing a boxed future per send (default:
    /// hands them back).
    fn try_send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<Result<(), StreamError>, Vec<Frame>> {
        let _ = fin;
        Err(frames)
    }
    /// Abandons this direction; the peer's `recv` fails with `code`.
    fn reset(&mut self, code: u32);
    /// The stream's id (for logs).
    fn id(&self) -> u64;
    /// Resolves once the peer has stopped reading this stream, or the
    /// connection has failed, with the error a send would get now: for a
    /// sender waiting on something else than this stream's credit (UCX: the
    /// completions of its tagged sends, which a peer that stopped reading
    /// never receives). Transports that cannot tell never resolve (the
    /// default).
    async fn stopped(&mut self) -> StreamError {
        std::future::pending().await
    }
    /// What [`stopped`](SendStream::stopped) waits for, as a signal a
    /// caller can poll while it goes on using this stream (a server
    /// cancelling a call whose client went away while its handler runs).
    /// None where the transport cannot tell (the default).
    fn stop_signal(&self) -> Option<Arc<dyn StopSignal>> {
        None
    }
}

/// Whether the peer has stopped reading a stream, or its connection failed
/// ([`SendStream::stop_signal`]). One task at a time polls it.
pub trait StopSignal: Send + Sync + 'static {
    /// Ready with the error a send would get once the peer stopped reading
    /// the stream or the connection failed; otherwise Pending, and the
    /// task is woken when that happens.
    fn poll_stopped(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<StreamError>;
}

/// Receiving half of a logical stream. Dropping it before the end asks the
/// peer to stop sending.
#[async_trait]
pub trait RecvStream: Send + 'static {
    /// The next frame, or `None` once the peer finished.
    async fn recv(&mut self) -> Result<Option<Received>, StreamError>;
    /// What [`recv`](RecvStream::recv) would return right now, when the
    /// transport already holds it; `None` when the caller should await
    /// `recv` (nothing is here yet, or this transport cannot tell without
    /// waiting). A small call's frames usually arrive together: taking
    /// them this way spares a boxed future per frame (default: `None`).
    fn try_recv(&mut self) -> Option<Result<Option<Received>, StreamError>> {
        None
    }
    /// Registers (or with `None`, withdraws) a buffer for payloads to be
    /// written into directly. Transports that cannot do this ignore it and
    /// return payloads as [`Payload::Bytes`].
    fn place(&mut self, target: Option<Placement>) {
        let _ = target;
    }
    /// The stream's id (for logs).
    fn id(&self) -> u64;
}

/// A connection carrying many logical streams.
#[async_trait]
pub trait Connection: Send + Sync + 'static {
    /// Opens a new stream.
    async fn open(&self, kind: StreamKind) -> Result<(Box<dyn SendStream>, Box<dyn RecvStream>), StreamError>;
    /// The next stream the peer opened; an error once the connection is closed.
    async fn accept(&self) -> Result<Incoming, StreamError>;
    /// Facts about the connection.
    fn info(&self) -> ConnectionInfo;
    /// Closes the connection; open streams fail.
    fn close(&self, reason: &str);
    /// True once the connection is closed or failed.
    fn is_closed(&self) -> bool;
    /// Resolves when the connection closes or fails.
    async fn closed(&self);
}

/// Accepts connections.
#[async_trait]
pub trait Listener: Send + 'static {
    /// The next connection.
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError>;
    /// Where the listener is bound (port 0 resolved to the real port).
    fn local_endpoint(&self) -> Endpoint;
    /// A future that closes what is left of the listener once it has been
    /// dropped and its connections closed, and resolves when its address can
    /// be bound again. Byte-stream listeners free their address on drop and
    /// return None; a QUIC listener's UDP socket is shared by every
    /// connection it accepted and outlives the listener until they drain.
    fn release(&self) -> Option<futures_util::future::BoxFuture<'static, ()>> {
        None
    }
}

/// A way to reach endpoints of one or more schemes. The built-in transports
/// implement it; so can users, and hand theirs to the `tensorwire` client.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Schemes this transport serves.
    fn schemes(&self) -> &'static [Scheme];
    /// Connects to `endpoint`.
    async fn connect(&self, endpoint: &Endpoint, config: &TransportConfig)
    -> Result<Arc<dyn Connection>, ConnectError>;
    /// Listens on `endpoint`.
    async fn listen(&self, endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError>;
}

/// The built-in transports compiled into this build (TCP, Unix, QUIC, gRPC, shared memory, UCX).
#[derive(Debug, Clone, Copy, Default)]
pub struct Builtin;

#[async_trait]
impl Transport for Builtin {
    fn schemes(&self) -> &'static [Scheme] {
        &Scheme::ALL
    }

    async fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> Result<Arc<dyn Connection>, ConnectError> {
        connect(endpoint, config).await
    }

    async fn listen(&self, endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
        listen(endpoint, config).await
    }
}

/// Connects to `endpoint` with the built-in transport for its scheme.
pub async fn connect(endpoint: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let scheme = endpoint.scheme();
    if !scheme.is_enabled() {
        return Err(ConnectError::NotEnabled { scheme, feature: scheme.feature() });
    }
    let fut = async {
        match scheme {
            #[cfg(feature = "tcp")]
            Scheme::Tcp => tcp::connect(endpoint, config).await,
            #[cfg(feature = "tcps")]
            Scheme::Tcps => tcps::connect(endpoint, config).await,
            #[cfg(feature = "unix")]
            Scheme::Unix => unix::connect(endpoint, config).await,
            #[cfg(feature = "quic")]
            Scheme::Quic => quic::connect(endpoint, config).await.map(|c| c as Arc<dyn Connection>),
            #[cfg(feature = "grpc")]
            Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix => grpc::connect(endpoint, config).await,
            #[cfg(feature = "shm")]
            Scheme::Shm => unix::connect(endpoint, config).await,
            #[cfg(feature = "ucx")]
            Scheme::Ucx => ucx::connect(endpoint, config).await,
            Scheme::Http => Err(ConnectError::Config {
                endpoint: endpoint.to_string(),
                reason: "http:// serves JSON-RPC to HTTP clients (POST /rpc); tensorwire clients connect with \
                         tcp://, tcps://, unix://, quic://, grpc:// or shm://"
                    .into(),
            }),
            #[allow(unreachable_patterns)]
            other => Err(ConnectError::NotEnabled { scheme: other, feature: other.feature() }),
        }
    };
    match tokio::time::timeout(config.connect_timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout { endpoint: endpoint.to_string(), after: config.connect_timeout }),
    }
}

/// Listens on `endpoint` with the built-in transport for its scheme.
pub async fn listen(endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    let scheme = endpoint.scheme();
    match scheme {
        #[cfg(feature = "tcp")]
        Scheme::Tcp => tcp::listen(endpoint, config).await,
        #[cfg(feature = "tcps")]
        Scheme::Tcps => tcps::listen(endpoint, config).await,
        #[cfg(feature = "unix")]
        Scheme::Unix => unix::listen(endpoint, config).await,
        #[cfg(feature = "quic")]
        Scheme::Quic => quic::listen(endpoint, config).await,
        #[cfg(feature = "grpc")]
        Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix => grpc::listen(endpoint, config).await,
        #[cfg(feature = "shm")]
        Scheme::Shm => unix::listen(endpoint, config).await,
        #[cfg(feature = "ucx")]
        Scheme::Ucx => ucx::listen(endpoint, config).await,
        Scheme::Http => Err(ListenError::Config {
            endpoint: endpoint.to_string(),
            reason: "http:// (JSON-RPC) is served by the tensorwire server, not by a transport".into(),
        }),
        #[allow(unreachable_patterns)]
        other => Err(ListenError::NotEnabled { scheme: other, feature: other.feature() }),
    }
}
