//! The client side: [`GrpcChannel`] (one HTTP/2 connection, usable by any
//! tonic client) and the [`Connection`] whose streams are calls on it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use async_trait::async_trait;
use bytes::Bytes;
use http_body::Body as HttpBody;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tonic::Status;
use tonic::codegen::http::{self, Uri};

use super::body::{Ending, Item, MessageSource, OutBody};
use super::io::Recording;
use super::settings::{ContentType, H2, Method, content_type, limits, transport_name, tune_tcp};
use super::streams::{GrpcRecv, Halves, QUEUE, RequestSend, ResetFlag, Source, next_id};
use super::wire::Limits;
use crate::{
    ConnectError, Connection, ConnectionInfo, Endpoint, Incoming, Scheme, StreamError, StreamKind, TransportConfig, tls,
};

/// One HTTP/2 connection to a gRPC server, usable by any tonic client
/// (`SomeClient::with_origin(channel.clone(), channel.origin().clone())`).
/// Cloning shares the connection.
#[derive(Clone)]
pub struct GrpcChannel {
    send: SendRequest<RequestBody>,
    origin: Uri,
    peer: Arc<str>,
    /// Why the HTTP/2 connection ended (None while it is open).
    closed: watch::Receiver<Option<Arc<str>>>,
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
        self.closed.borrow().is_some() || self.send.is_closed()
    }

    /// Why the HTTP/2 connection ended (a TLS alert, the peer's GOAWAY, a
    /// broken socket), once it has.
    pub fn end_reason(&self) -> Option<Arc<str>> {
        self.closed.borrow().clone()
    }

    /// Resolves when the HTTP/2 connection ends.
    pub async fn closed(&self) {
        let mut rx = self.closed.clone();
        let _ = rx.wait_for(|c| c.is_some()).await;
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
    let first_error = Arc::new(std::sync::OnceLock::new());
    let io = Recording::new(io, first_error.clone());
    let (send, conn) = b.handshake(TokioIo::new(io)).await.map_err(|e| ConnectError::Protocol {
        endpoint: ep.to_string(),
        reason: format!("HTTP/2 handshake failed: {e}"),
    })?;
    let (closed_tx, closed) = watch::channel(None);
    let peer_log = peer.clone();
    let driver = tokio::spawn(async move {
        let why: Arc<str> = match conn.await {
            Err(e) => {
                tracing::debug!(peer = %peer_log, error = %e, "gRPC connection ended");
                // hyper's error names the layer; its source (a TLS alert,
                // an I/O error) is the cause worth reporting.
                let cause = std::error::Error::source(&e).map(|s| format!(": {s}")).unwrap_or_default();
                Arc::from(format!("the HTTP/2 connection failed: {e}{cause}").as_str())
            }
            // hyper ends its side without an error when the connection task
            // it spawned met one; the socket kept it.
            Ok(()) => match first_error.get() {
                Some(io) => Arc::from(format!("the HTTP/2 connection failed: {io}").as_str()),
                None => Arc::from("the HTTP/2 connection is closed"),
            },
        };
        let _ = closed_tx.send(Some(why));
    });
    let origin = origin
        .parse::<Uri>()
        .map_err(|e| ConnectError::Config { endpoint: ep.to_string(), reason: format!("bad origin {origin}: {e}") })?;
    Ok(GrpcChannel { send, origin, peer: peer.into(), closed, driver: Arc::new(AbortOnDrop(driver)) })
}

/// A call that failed because its connection did (hyper says only "channel
/// closed" or "connection error") is reported with the connection's own
/// cause — a TLS alert, a reset — which the connection task records a
/// moment after the call fails (so this waits briefly for it), or, when
/// hyper's connection task ended without one, the I/O error in the call's
/// own source chain.
async fn with_connection_cause(chan: &GrpcChannel, status: tonic::Status) -> tonic::Status {
    // A status the server sent has no source error; one tonic made from a
    // transport failure carries hyper's, or says the service was not ready.
    let from_transport = std::error::Error::source(&status).is_some()
        || status.message().starts_with("Service was not ready")
        || status.message().starts_with("transport error");
    if !from_transport {
        return status;
    }
    if !chan.is_closed() {
        let _ = tokio::time::timeout(std::time::Duration::from_millis(500), chan.closed()).await;
    }
    match (chan.end_reason(), io_cause(&status)) {
        (Some(why), _) if why.contains("failed") => tonic::Status::unavailable(format!("{}: {why}", status.message())),
        (_, Some(io)) => tonic::Status::unavailable(format!("{}: {io}", status.message())),
        // Closed with no cause to give: still a closed connection, not a
        // peer that broke the protocol.
        (Some(why), None) => tonic::Status::unavailable(format!("{}: {why}", status.message())),
        (None, None) => status,
    }
}

/// The I/O error (a TLS alert, a broken pipe) under a transport failure,
/// when hyper kept it in the error's source chain.
fn io_cause(status: &tonic::Status) -> Option<String> {
    let mut cause = std::error::Error::source(status);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return Some(io.to_string());
        }
        cause = e.source();
    }
    None
}

/// Connects to a gRPC endpoint: one HTTP/2 connection, one call per stream.
pub async fn connect(ep: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let chan = channel(ep, config).await?;
    let info = ConnectionInfo {
        transport: transport_name(ep.scheme()),
        peer: chan.peer().to_string(),
        max_frame_payload: config.max_frame_payload.into(),
        local: ep.scheme() == Scheme::GrpcUnix,
        stateless: true,
    };
    Ok(Arc::new(ClientConn { limits: limits(config), chan, info }))
}

struct ClientConn {
    chan: GrpcChannel,
    /// Largest message and header either way.
    limits: Limits,
    info: ConnectionInfo,
}

/// Makes the call `method` of `tensorwire.v1.TensorService` with `body`;
/// resolves with the response's messages once its headers arrived.
async fn call(
    chan: &GrpcChannel,
    method: Method,
    body: OutBody,
    reset: ResetFlag,
    limits: Limits,
) -> Result<Source, Status> {
    let transport = |e: hyper::Error| Status::from_error(Box::new(e));
    let uri = Uri::builder()
        .scheme(chan.origin.scheme_str().unwrap_or("http"))
        .authority(chan.origin.authority().map_or("localhost", |a| a.as_str()))
        .path_and_query(method.path())
        .build()
        .map_err(|e| Status::internal(format!("bad request URI: {e}")))?;
    let req = http::Request::builder()
        .method(http::Method::POST)
        .uri(uri)
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(RequestBody { inner: tonic::body::Body::new(body), reset: Some(reset) })
        .map_err(|e| Status::internal(format!("bad request: {e}")))?;
    let mut send = chan.send.clone();
    send.ready().await.map_err(transport)?;
    let (parts, body) = send.send_request(req).await.map_err(transport)?.into_parts();
    // Trailers-only: the call ended at once (an error, usually).
    if let Some(status) = Status::from_header_map(&parts.headers) {
        return match status.code() {
            tonic::Code::Ok if method.unary_response() => {
                Err(Status::internal("the gRPC server ended the call without its response message"))
            }
            tonic::Code::Ok => Ok(Source::Wire(Box::new(MessageSource::ended(Ok(()))))),
            _ => Err(status),
        };
    }
    if parts.status != http::StatusCode::OK {
        // No gRPC status: a proxy or a server that is not gRPC answered.
        return Err(Status::new(
            http_status_code(parts.status),
            format!("the server answered HTTP status {} without a gRPC status", parts.status),
        ));
    }
    let ct = parts.headers.get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if content_type(ct) != ContentType::Proto {
        return Err(Status::unknown(format!(
            "the server answered content-type {ct:?}, not application/grpc: not a gRPC server"
        )));
    }
    let body = tonic::body::Body::new(body);
    Ok(Source::Wire(Box::new(MessageSource::new(body, limits, true, method.unary_response()))))
}

/// The gRPC code of an HTTP status that came without one, as gRPC's
/// `http-grpc-status-mapping.md` (and tonic, grpcio) map it.
fn http_status_code(status: http::StatusCode) -> tonic::Code {
    match status.as_u16() {
        400 => tonic::Code::Internal,
        401 => tonic::Code::Unauthenticated,
        403 => tonic::Code::PermissionDenied,
        404 => tonic::Code::Unimplemented,
        429 | 502 | 503 | 504 => tonic::Code::Unavailable,
        _ => tonic::Code::Unknown,
    }
}

#[async_trait]
impl Connection for ClientConn {
    async fn open(&self, kind: StreamKind) -> Result<Halves, StreamError> {
        if self.chan.is_closed() {
            let reason =
                self.chan.end_reason().map_or_else(|| "the HTTP/2 connection is closed".into(), |r| r.to_string());
            return Err(StreamError::ConnectionClosed { peer: self.info.peer.clone(), reason });
        }
        let id = next_id();
        let peer: Arc<str> = Arc::from(self.info.peer.as_str());
        let method = Method::for_kind(kind);
        let (tx, mut rx) = mpsc::channel::<Item>(QUEUE);
        let (resp_tx, resp_rx) = oneshot::channel();
        let reset = ResetFlag::default();
        let (flag, chan, limits) = (reset.clone(), self.chan.clone(), self.limits);
        tokio::spawn(async move {
            // A one-message request waits for it: a stream dropped unused
            // makes no call.
            let first = if method.unary_request() {
                let Some(first) = rx.recv().await else { return };
                Some(first)
            } else {
                None
            };
            let body = OutBody::new(rx, first, limits.message, Ending::Request);
            let r = match call(&chan, method, body, flag, limits).await {
                Err(status) => Err(with_connection_cause(&chan, status).await),
                ok => ok,
            };
            let _ = resp_tx.send(r);
        });
        let unary = method.unary_request();
        let send = RequestSend { tx: Some(tx), reset, unary, sent: false, id, peer: peer.clone() };
        let recv = GrpcRecv::new(Source::Pending(resp_rx), id, peer);
        Ok((Box::new(send), Box::new(recv)))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        // gRPC servers never open calls to their clients.
        self.chan.closed().await;
        let reason = self.chan.end_reason().map_or_else(|| "the HTTP/2 connection closed".into(), |r| r.to_string());
        Err(StreamError::ConnectionClosed { peer: self.info.peer.clone(), reason })
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
