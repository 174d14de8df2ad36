//! `grpc://host:port`, `grpcs://host:port` and `grpc+unix:///path`: the
//! `tensorwire.v1.TensorService` of `proto/tensorwire/v1/service.proto`
//! over HTTP/2 (tonic on hyper).
//!
//! Each logical stream is one gRPC call whose messages are frames (a
//! `FrameHeader` and its payload as a `bytes` field, decoded into
//! [`bytes::Bytes`] without another copy). The method names the call kind:
//! `Handshake` (unary), `Send` (client stream), `Fetch` (server stream),
//! `Exchange` and `Call` (bidirectional).
//!
//! **Speed.** hyper's HTTP/2 defaults (1 MiB server windows, 16 KiB frames,
//! adaptive windows off) move large messages at 0.1–0.3× of raw TCP. Both
//! ends here use [`GrpcConfig`](crate::config::GrpcConfig): 16 MiB stream
//! windows, 64 MiB connection windows and 1 MiB HTTP/2 frames. Message size
//! limits follow the frame limits ([`TransportConfig::max_frame_payload`]
//! plus header room), never tonic's hidden 4 MiB default.
//!
//! **Server.** A gRPC server is stateless: calls from every HTTP/2
//! connection reach the pipeline as the streams of one [`Connection`] whose
//! [`ConnectionInfo::stateless`] is true (the pipeline then checks
//! authentication per call). Other tonic services (health, reflection, the
//! skytorch compat service) are mounted beside it with [`listen_with`].
//! Closing that connection stops the server gracefully (HTTP/2 GOAWAY).
//!
//! **Client.** One HTTP/2 connection per [`Connection`]; [`channel`] gives
//! the raw [`GrpcChannel`] for tonic clients of other services.
//!
//! **TLS** (`grpcs://`) uses the same certificate options as QUIC
//! ([`TlsConfig`](crate::config::TlsConfig): PEM files or a self-signed
//! certificate whose fingerprint the client pins, CA files, mutual TLS),
//! with ALPN `h2`.

mod streams;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http_body::Body as HttpBody;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tensorwire_proto::v1;
use tensorwire_proto::v1::tensor_service_client::TensorServiceClient;
use tensorwire_proto::v1::tensor_service_server::{TensorService, TensorServiceServer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http::{self, Uri};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::{Request, Response, Status, Streaming};

pub use tonic::service::Routes;

use self::streams::{GrpcRecv, QUEUE, RequestSend, ResetFlag, ResponseSend, Source};
use crate::{
    AcceptError, ConnectError, Connection, ConnectionInfo, Endpoint, Incoming, ListenError, Listener, RecvStream,
    Scheme, SendStream, StreamError, StreamKind, TransportConfig, tls,
};

/// ALPN protocol of HTTP/2 over TLS.
const H2: &[u8] = b"h2";

/// How long a TLS handshake may take before the server drops the socket.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_STREAM.fetch_add(1, Ordering::Relaxed)
}

fn transport_name(s: Scheme) -> &'static str {
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

// ---------------------------------------------------------------------------
// Client

/// One HTTP/2 connection to a gRPC server, usable by any tonic client
/// (`SomeClient::with_origin(channel.clone(), channel.origin().clone())`).
/// Cloning shares the connection.
#[derive(Clone)]
pub struct GrpcChannel {
    send: SendRequest<RequestBody>,
    origin: Uri,
    peer: Arc<str>,
    closed: watch::Receiver<bool>,
    driver: Arc<AbortOnDrop>,
}

impl std::fmt::Debug for GrpcChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcChannel").field("origin", &self.origin).field("peer", &self.peer).finish()
    }
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl GrpcChannel {
    /// The URI prefix of every call (`http://host:port` or `https://…`).
    pub fn origin(&self) -> &Uri {
        &self.origin
    }

    /// The server's address, for messages.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// True once the HTTP/2 connection is gone.
    pub fn is_closed(&self) -> bool {
        *self.closed.borrow() || self.send.is_closed()
    }

    /// Resolves when the HTTP/2 connection ends.
    pub async fn closed(&self) {
        let mut rx = self.closed.clone();
        let _ = rx.wait_for(|c| *c).await;
    }

    /// Closes the connection at once (calls in flight fail).
    pub fn close(&self) {
        self.driver.0.abort();
    }
}

/// Request bodies: tonic's, ended with an error when the call was reset.
pub struct RequestBody {
    inner: tonic::body::Body,
    reset: Option<ResetFlag>,
}

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let aborted = || Box::<dyn std::error::Error + Send + Sync>::from("the call was reset by the client");
        if self.reset.as_ref().is_some_and(ResetFlag::is_set) {
            return Poll::Ready(Some(Err(aborted())));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(None) if self.reset.as_ref().is_some_and(ResetFlag::is_set) => {
                Poll::Ready(Some(Err(aborted())))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            other => other.map(|o| o.map(|r| r.map_err(|e| Box::new(e) as Self::Error))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl tower_service::Service<http::Request<tonic::body::Body>> for GrpcChannel {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, hyper::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), hyper::Error>> {
        self.send.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let reset = parts.extensions.remove::<ResetFlag>();
        let fut = self.send.send_request(http::Request::from_parts(parts, RequestBody { inner: body, reset }));
        Box::pin(fut)
    }
}

fn io_error(ep: &Endpoint) -> impl Fn(std::io::Error) -> ConnectError + '_ {
    move |source| ConnectError::Io { endpoint: ep.to_string(), source }
}

/// Opens an HTTP/2 connection to a `grpc://`, `grpcs://` or `grpc+unix://`
/// endpoint with the configured windows, frame size and TLS.
pub async fn channel(ep: &Endpoint, config: &TransportConfig) -> Result<GrpcChannel, ConnectError> {
    match ep.scheme() {
        Scheme::Grpc => {
            let s = TcpStream::connect(ep.authority()).await.map_err(io_error(ep))?;
            tune_tcp(&s, config);
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| ep.authority());
            let origin = format!("http://{}", ep.authority());
            handshake(s, origin, peer, ep, config).await
        }
        Scheme::Grpcs => {
            let tls_cfg = tls::client_tls_for(&config.tls, ep);
            let cfg_err = |reason: String| ConnectError::Config { endpoint: ep.to_string(), reason };
            let rustls_cfg = tls::client_config(&tls_cfg, &[H2]).map_err(cfg_err)?;
            let name = tls::server_name(&tls_cfg, ep).map_err(cfg_err)?;
            let s = TcpStream::connect(ep.authority()).await.map_err(io_error(ep))?;
            tune_tcp(&s, config);
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| ep.authority());
            let connector = tokio_rustls::TlsConnector::from(Arc::new(rustls_cfg));
            let tls = connector.connect(name, s).await.map_err(|e| {
                let reason = e.to_string();
                ConnectError::Tls { endpoint: ep.to_string(), reason: format!("{reason}{}", tls::hint(&reason)) }
            })?;
            if tls.get_ref().1.alpn_protocol() != Some(H2) {
                return Err(ConnectError::Protocol {
                    endpoint: ep.to_string(),
                    reason: "the server did not agree to HTTP/2 (ALPN h2)".into(),
                });
            }
            let origin = format!("https://{}", ep.authority());
            handshake(tls, origin, peer, ep, config).await
        }
        Scheme::GrpcUnix => {
            let s = crate::unix::connect_socket(ep.path()).await.map_err(io_error(ep))?;
            let peer = ep.path().display().to_string();
            handshake(s, "http://localhost".to_string(), peer, ep, config).await
        }
        other => Err(ConnectError::NotEnabled { scheme: other, feature: "grpc" }),
    }
}

fn tune_tcp(s: &TcpStream, config: &TransportConfig) {
    let _ = s.set_nodelay(true);
    if let Some(n) = config.socket_buffer {
        let sock = socket2::SockRef::from(s);
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
}

async fn handshake<IO>(
    io: IO,
    origin: String,
    peer: String,
    ep: &Endpoint,
    config: &TransportConfig,
) -> Result<GrpcChannel, ConnectError>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let g = &config.grpc;
    let mut b = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    b.timer(TokioTimer::new());
    b.initial_stream_window_size(g.stream_window)
        .initial_connection_window_size(g.connection_window)
        .max_frame_size(g.max_frame_size)
        .adaptive_window(false)
        .max_send_buf_size(g.max_frame_size as usize * 4)
        .keep_alive_interval(config.keepalive_interval)
        .keep_alive_while_idle(true);
    let (send, conn) = b.handshake(TokioIo::new(io)).await.map_err(|e| ConnectError::Protocol {
        endpoint: ep.to_string(),
        reason: format!("HTTP/2 handshake failed: {e}"),
    })?;
    let (closed_tx, closed) = watch::channel(false);
    let peer_log = peer.clone();
    let driver = tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(peer = %peer_log, error = %e, "gRPC connection ended");
        }
        let _ = closed_tx.send(true);
    });
    let origin = origin
        .parse::<Uri>()
        .map_err(|e| ConnectError::Config { endpoint: ep.to_string(), reason: format!("bad origin {origin}: {e}") })?;
    Ok(GrpcChannel { send, origin, peer: peer.into(), closed, driver: Arc::new(AbortOnDrop(driver)) })
}

/// Connects to a gRPC endpoint: one HTTP/2 connection, one call per stream.
pub async fn connect(ep: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let chan = channel(ep, config).await?;
    let limit = message_limit(config);
    let client = TensorServiceClient::with_origin(chan.clone(), chan.origin().clone())
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit);
    let info = ConnectionInfo {
        transport: transport_name(ep.scheme()),
        peer: chan.peer().to_string(),
        max_frame_payload: config.max_frame_payload.into(),
        local: ep.scheme() == Scheme::GrpcUnix,
        stateless: true,
    };
    Ok(Arc::new(ClientConn { client, chan, info }))
}

struct ClientConn {
    client: TensorServiceClient<GrpcChannel>,
    chan: GrpcChannel,
    info: ConnectionInfo,
}

type Halves = (Box<dyn SendStream>, Box<dyn RecvStream>);

#[async_trait]
impl Connection for ClientConn {
    async fn open(&self, kind: StreamKind) -> Result<Halves, StreamError> {
        if self.chan.is_closed() {
            return Err(StreamError::ConnectionClosed {
                peer: self.info.peer.clone(),
                reason: "the HTTP/2 connection is closed".into(),
            });
        }
        let id = next_id();
        let peer: Arc<str> = Arc::from(self.info.peer.as_str());
        let unary = matches!(kind, StreamKind::Handshake | StreamKind::Fetch);
        let (tx, mut rx) = mpsc::channel::<v1::Frame>(QUEUE);
        let (resp_tx, resp_rx) = oneshot::channel();
        let reset = ResetFlag::default();
        let mut client = self.client.clone();
        let flag = reset.clone();
        tokio::spawn(async move {
            let streaming = |rx| {
                let mut req = Request::new(ReceiverStream::new(rx));
                req.extensions_mut().insert(flag);
                req
            };
            let r = match kind {
                StreamKind::Handshake | StreamKind::Fetch => {
                    // Nothing sent: the caller dropped the stream, no call.
                    let Some(first) = rx.recv().await else { return };
                    if kind == StreamKind::Fetch {
                        client.fetch(first).await.map(|r| Source::Stream(r.into_inner()))
                    } else {
                        client.handshake(first).await.map(|r| Source::One(Some(r.into_inner())))
                    }
                }
                StreamKind::Send => client.send(streaming(rx)).await.map(|r| Source::One(Some(r.into_inner()))),
                StreamKind::Exchange => client.exchange(streaming(rx)).await.map(|r| Source::Stream(r.into_inner())),
                _ => client.call(streaming(rx)).await.map(|r| Source::Stream(r.into_inner())),
            };
            let _ = resp_tx.send(r);
        });
        let send = RequestSend { tx: Some(tx), reset, unary, sent: false, id, peer: peer.clone() };
        let recv = GrpcRecv { source: Source::Pending(resp_rx), id, peer };
        Ok((Box::new(send), Box::new(recv)))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        // gRPC servers never open calls to their clients.
        self.chan.closed().await;
        Err(StreamError::ConnectionClosed {
            peer: self.info.peer.clone(),
            reason: "the HTTP/2 connection closed".into(),
        })
    }

    fn info(&self) -> ConnectionInfo {
        self.info.clone()
    }

    fn close(&self, _reason: &str) {
        self.chan.close();
    }

    fn is_closed(&self) -> bool {
        self.chan.is_closed()
    }

    async fn closed(&self) {
        self.chan.closed().await
    }
}

// ---------------------------------------------------------------------------
// Server

/// Accepted sockets handed to tonic.
enum Io {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Unix(UnixStream),
}

impl Connected for Io {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        let tcp = match self {
            Io::Tcp(s) => Some(s),
            Io::Tls(s) => Some(s.get_ref().0),
            Io::Unix(_) => None,
        };
        TcpConnectInfo {
            local_addr: tcp.and_then(|s| s.local_addr().ok()),
            remote_addr: tcp.and_then(|s| s.peer_addr().ok()),
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Io::Tcp($s) => {
                let $s = Pin::new($s);
                $e
            }
            Io::Tls($s) => {
                let $s = Pin::new(&mut **$s);
                $e
            }
            Io::Unix($s) => {
                let $s = Pin::new($s);
                $e
            }
        }
    };
}

impl AsyncRead for Io {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Tcp(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
            Io::Unix(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }
}

/// The calls of every client, as the streams of one connection.
struct ServerConn {
    rx: tokio::sync::Mutex<mpsc::Receiver<Incoming>>,
    closed: watch::Sender<bool>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    cleanup: Mutex<Option<PathBuf>>,
    info: ConnectionInfo,
}

impl ServerConn {
    async fn wait_closed(&self) {
        let mut rx = self.closed.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }
}

#[async_trait]
impl Connection for ServerConn {
    async fn open(&self, _kind: StreamKind) -> Result<Halves, StreamError> {
        Err(StreamError::Refused {
            peer: self.info.peer.clone(),
            reason: "a gRPC server cannot call its clients".into(),
        })
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        let closed = || StreamError::ConnectionClosed { peer: self.info.peer.clone(), reason: "server closed".into() };
        let mut rx = self.rx.lock().await;
        tokio::select! {
            inc = rx.recv() => inc.ok_or_else(closed),
            _ = self.wait_closed() => Err(closed()),
        }
    }

    fn info(&self) -> ConnectionInfo {
        self.info.clone()
    }

    fn close(&self, reason: &str) {
        if self.closed.send_replace(true) {
            return;
        }
        tracing::debug!(endpoint = %self.info.peer, reason, "gRPC server stopping");
        if let Some(h) = self.acceptor.lock().unwrap_or_else(|e| e.into_inner()).take() {
            h.abort();
        }
        if let Some(p) = self.cleanup.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = std::fs::remove_file(p);
        }
    }

    fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    async fn closed(&self) {
        self.wait_closed().await
    }
}

/// The tonic service: hands each call to the pipeline as a stream.
struct Service {
    tx: mpsc::Sender<Incoming>,
    closed: watch::Receiver<bool>,
    peer: Arc<str>,
}

type FrameStream = ReceiverStream<Result<v1::Frame, Status>>;

impl Service {
    async fn start(
        &self,
        kind: StreamKind,
        source: Source,
    ) -> Result<mpsc::Receiver<Result<v1::Frame, Status>>, Status> {
        if *self.closed.borrow() {
            return Err(Status::unavailable("the server is shutting down"));
        }
        let id = next_id();
        let (tx, rx) = mpsc::channel(QUEUE);
        let send = ResponseSend { tx: Some(tx), id, peer: self.peer.clone() };
        let recv = GrpcRecv { source, id, peer: self.peer.clone() };
        let inc = Incoming { kind: Some(kind), send: Box::new(send), recv: Box::new(recv) };
        self.tx.send(inc).await.map_err(|_| Status::unavailable("the server is shutting down"))?;
        Ok(rx)
    }

    async fn unary_reply(mut rx: mpsc::Receiver<Result<v1::Frame, Status>>) -> Result<Response<v1::Frame>, Status> {
        match rx.recv().await {
            Some(Ok(f)) => Ok(Response::new(f)),
            Some(Err(s)) => Err(s),
            None => Err(Status::internal("the call ended without a reply")),
        }
    }
}

#[tonic::async_trait]
impl TensorService for Service {
    async fn handshake(&self, req: Request<v1::Frame>) -> Result<Response<v1::Frame>, Status> {
        let rx = self.start(StreamKind::Handshake, Source::One(Some(req.into_inner()))).await?;
        Self::unary_reply(rx).await
    }

    async fn send(&self, req: Request<Streaming<v1::Frame>>) -> Result<Response<v1::Frame>, Status> {
        let rx = self.start(StreamKind::Send, Source::Stream(req.into_inner())).await?;
        Self::unary_reply(rx).await
    }

    type FetchStream = FrameStream;

    async fn fetch(&self, req: Request<v1::Frame>) -> Result<Response<FrameStream>, Status> {
        let rx = self.start(StreamKind::Fetch, Source::One(Some(req.into_inner()))).await?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type ExchangeStream = FrameStream;

    async fn exchange(&self, req: Request<Streaming<v1::Frame>>) -> Result<Response<FrameStream>, Status> {
        let rx = self.start(StreamKind::Exchange, Source::Stream(req.into_inner())).await?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type CallStream = FrameStream;

    async fn call(&self, req: Request<Streaming<v1::Frame>>) -> Result<Response<FrameStream>, Status> {
        let rx = self.start(StreamKind::Call, Source::Stream(req.into_inner())).await?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Listens on a gRPC endpoint serving `tensorwire.v1.TensorService` only.
pub async fn listen(ep: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    listen_with(ep, config, Routes::default()).await
}

enum Bound {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// Listens on a gRPC endpoint serving `tensorwire.v1.TensorService` and
/// the services in `extra` (health, reflection, ...) on the same port.
///
/// The listener yields one [`Connection`] carrying the calls of every
/// client. Closing it refuses new calls and shuts the HTTP/2 server down
/// gracefully; [`Listener::release`] resolves when the server has stopped.
pub async fn listen_with(
    ep: &Endpoint,
    config: &TransportConfig,
    extra: Routes,
) -> Result<Box<dyn Listener>, ListenError> {
    let name = ep.to_string();
    let io = |source| ListenError::Io { endpoint: name.clone(), source };
    let cfg_err = |reason: String| ListenError::Config { endpoint: name.clone(), reason };
    let (bound, mut local, cleanup) = match ep.scheme() {
        Scheme::Grpc | Scheme::Grpcs => {
            let l = tokio::net::TcpListener::bind(ep.authority()).await.map_err(io)?;
            let port = l.local_addr().map_err(io)?.port();
            (Bound::Tcp(l), ep.with_port(port), None)
        }
        Scheme::GrpcUnix => {
            let l = crate::unix::bind_socket(ep.path()).map_err(io)?;
            let file = (!ep.path().to_string_lossy().starts_with('@')).then(|| ep.path().to_path_buf());
            (Bound::Unix(l), ep.clone(), file)
        }
        other => return Err(ListenError::NotEnabled { scheme: other, feature: "grpc" }),
    };
    let acceptor = if ep.scheme() == Scheme::Grpcs {
        let id = tls::server_identity(&config.tls, &[ep.host().to_string()]).map_err(cfg_err)?;
        let rustls_cfg = tls::server_config(&config.tls, &id, &[H2]).map_err(cfg_err)?;
        if id.generated {
            tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "self-signed certificate (clients pin it with --pin-sha256)");
            local = Endpoint::parse(&format!("{}?pin-sha256={}", local, id.fingerprint)).unwrap_or(local);
        } else {
            tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "serving certificate");
        }
        Some(tokio_rustls::TlsAcceptor::from(Arc::new(rustls_cfg)))
    } else {
        None
    };

    let (io_tx, io_rx) = mpsc::channel::<std::io::Result<Io>>(64);
    let accept_task = tokio::spawn(accept_loop(bound, acceptor, config.clone(), io_tx));

    let (closed_tx, closed_rx) = watch::channel(false);
    let (call_tx, call_rx) = mpsc::channel(1024);
    let peer: Arc<str> = Arc::from(format!("gRPC clients of {local}").as_str());
    let conn = Arc::new(ServerConn {
        rx: tokio::sync::Mutex::new(call_rx),
        closed: closed_tx,
        acceptor: Mutex::new(Some(accept_task)),
        cleanup: Mutex::new(cleanup),
        info: ConnectionInfo {
            transport: transport_name(ep.scheme()),
            peer: peer.to_string(),
            max_frame_payload: config.max_frame_payload.into(),
            local: ep.scheme() == Scheme::GrpcUnix,
            stateless: true,
        },
    });
    let limit = message_limit(config);
    let svc = TensorServiceServer::new(Service { tx: call_tx, closed: closed_rx.clone(), peer })
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit);
    let g = &config.grpc;
    let mut builder = tonic::transport::Server::builder()
        .initial_stream_window_size(g.stream_window)
        .initial_connection_window_size(g.connection_window)
        .max_frame_size(g.max_frame_size)
        .max_concurrent_streams(config.max_concurrent_streams)
        .http2_keepalive_interval(config.keepalive_interval)
        .tcp_nodelay(true);
    let router = builder.add_routes(extra.add_service(svc));
    let mut stop = closed_rx;
    let server = tokio::spawn(async move {
        let signal = async move {
            let _ = stop.wait_for(|c| *c).await;
        };
        if let Err(e) = router.serve_with_incoming_shutdown(ReceiverStream::new(io_rx), signal).await {
            tracing::warn!(error = %e, "gRPC server failed");
        }
    });
    Ok(Box::new(GrpcListener {
        conn: Some(conn.clone()),
        shared: conn,
        local,
        server: Arc::new(Mutex::new(Some(server))),
    }))
}

async fn accept_loop(
    bound: Bound,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    config: TransportConfig,
    tx: mpsc::Sender<std::io::Result<Io>>,
) {
    loop {
        let accepted = match &bound {
            Bound::Tcp(l) => l.accept().await.map(|(s, a)| (Some(s), None, Some(a))),
            Bound::Unix(l) => l.accept().await.map(|(s, _)| (None, Some(s), None::<SocketAddr>)),
        };
        match accepted {
            Ok((Some(s), _, addr)) => {
                tune_tcp(&s, &config);
                match &acceptor {
                    None => {
                        if tx.send(Ok(Io::Tcp(s))).await.is_err() {
                            return;
                        }
                    }
                    Some(acc) => {
                        // Each handshake in its own task: a slow client never
                        // delays the others.
                        let (acc, tx) = (acc.clone(), tx.clone());
                        tokio::spawn(async move {
                            match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acc.accept(s)).await {
                                Ok(Ok(t)) => {
                                    let _ = tx.send(Ok(Io::Tls(Box::new(t)))).await;
                                }
                                Ok(Err(e)) => tracing::info!(peer = ?addr, error = %e, "TLS handshake failed"),
                                Err(_) => tracing::info!(peer = ?addr, "TLS handshake timed out"),
                            }
                        });
                    }
                }
            }
            Ok((None, Some(s), _)) => {
                if tx.send(Ok(Io::Unix(s))).await.is_err() {
                    return;
                }
            }
            Ok(_) => {}
            Err(e) => {
                // Out of file descriptors and the like: wait, keep serving.
                tracing::debug!(error = %e, "gRPC accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

struct GrpcListener {
    conn: Option<Arc<ServerConn>>,
    shared: Arc<ServerConn>,
    local: Endpoint,
    server: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Drop for GrpcListener {
    fn drop(&mut self) {
        // Never handed out: nobody else will close it.
        if self.conn.is_some() {
            self.shared.close("listener dropped");
        }
    }
}

#[async_trait]
impl Listener for GrpcListener {
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError> {
        if let Some(c) = self.conn.take() {
            return Ok(c);
        }
        self.shared.wait_closed().await;
        Err(AcceptError::Closed)
    }

    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }

    fn release(&self) -> Option<futures_util::future::BoxFuture<'static, ()>> {
        let (conn, server) = (self.shared.clone(), self.server.clone());
        Some(Box::pin(async move {
            conn.wait_closed().await;
            let handle = server.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(mut h) = handle {
                // Graceful: GOAWAY, then in-flight calls end. A client that
                // keeps a call open does not hold the server forever.
                if tokio::time::timeout(Duration::from_secs(2), &mut h).await.is_err() {
                    h.abort();
                    let _ = h.await;
                }
            }
        }))
    }
}
