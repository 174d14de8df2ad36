//! The server side: the tonic service that hands each call to the pipeline
//! as a stream, the one [`Connection`] carrying every client's calls, and
//! the listener (accept loop with TLS handshakes).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::transport::server::TcpConnectInfo;

use super::body::{Abandoned, Ending, Item, MessageSource, OutBody};
use super::held::{Held, Share};
use super::io::{ConnectInfo, Io, Slots, Sock, refuse};
use super::settings::{
    ContentType, H2, Method, SERVICE, content_type, limits, message_limit, transport_name, tune_tcp,
};
use super::streams::{GrpcRecv, Halves, QUEUE, ResponseSend, Source, next_id};
use super::wire::Limits;
use crate::sync::lock;
use crate::{
    AcceptError, Connection, ConnectionInfo, Endpoint, Incoming, ListenError, Listener, Scheme, StreamError,
    StreamKind, TransportConfig, tls,
};

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
        if let Some(h) = lock(&self.acceptor).take() {
            h.abort();
        }
        if let Some(p) = lock(&self.cleanup).take() {
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

/// `tensorwire.v1.TensorService`, served by hand (see `wire`): hands each
/// call to the pipeline as a stream. Cloned per call by the router.
#[derive(Clone)]
struct Service {
    inner: Arc<ServiceInner>,
}

struct ServiceInner {
    tx: mpsc::Sender<Incoming>,
    closed: watch::Receiver<bool>,
    peer: Arc<str>,
    /// Largest message and header either way.
    limits: Limits,
}

impl NamedService for Service {
    const NAME: &'static str = SERVICE;
}

impl ServiceInner {
    /// Hands the call to the pipeline; its replies become the response.
    async fn start(
        &self,
        method: Method,
        source: Source,
        remote: Option<SocketAddr>,
    ) -> Result<(mpsc::Receiver<Item>, Arc<Abandoned>), Status> {
        if *self.closed.borrow() {
            return Err(Status::unavailable("the server is shutting down"));
        }
        let id = next_id();
        let (tx, rx) = mpsc::channel(QUEUE);
        // The call's own client, where known, in its errors too.
        let client = remote.map(|a| a.to_string());
        let peer: Arc<str> = client.as_deref().map_or_else(|| self.peer.clone(), Arc::from);
        let abandoned = Arc::new(Abandoned::new(peer.clone(), id));
        let send = ResponseSend { tx: Some(tx), id, peer: peer.clone(), abandoned: abandoned.clone() };
        let recv = GrpcRecv::new(source, id, peer);
        let inc = Incoming { kind: Some(method.kind()), send: Box::new(send), recv: Box::new(recv), peer: client };
        self.tx.send(inc).await.map_err(|_| Status::unavailable("the server is shutting down"))?;
        Ok((rx, abandoned))
    }

    async fn handle(&self, req: http::Request<Body>) -> http::Response<Body> {
        let Some(method) = Method::from_path(req.uri().path()) else {
            return Status::unimplemented(format!("no method {} in {SERVICE}", req.uri().path())).into_http();
        };
        let (parts, body) = req.into_parts();
        let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("");
        let ct = header("content-type");
        match content_type(ct) {
            ContentType::Proto => {}
            ContentType::NotGrpc => {
                // Not gRPC at all: HTTP's answer, with a gRPC status for
                // clients that read one (as grpc-go answers).
                let mut resp =
                    Status::invalid_argument(format!("content-type {ct:?}: this is a gRPC server (application/grpc)"))
                        .into_http();
                *resp.status_mut() = http::StatusCode::UNSUPPORTED_MEDIA_TYPE;
                return resp;
            }
            ContentType::OtherGrpc => {
                return Status::invalid_argument(format!(
                    "content-type {ct:?}: this service speaks protobuf (application/grpc or application/grpc+proto)"
                ))
                .into_http();
            }
        }
        if !matches!(header("grpc-encoding"), "" | "identity") {
            return Status::unimplemented(
                "gRPC message compression is not accepted (tensorwire compresses chunks itself)",
            )
            .into_http();
        }
        let connect = parts.extensions.get::<ConnectInfo>();
        let remote = connect.and_then(ConnectInfo::remote_addr);
        let held = connect.map(|c| Share::new(c.held.clone()));
        drop(parts);
        let mut source = MessageSource::new(body, self.limits, false, method.unary_request());
        if let Some(share) = held {
            source = source.counted(share);
        }
        match self.start(method, Source::Wire(Box::new(source)), remote).await {
            Ok((rx, abandoned)) => {
                let ending = if method.unary_response() { Ending::UnaryResponse } else { Ending::Response };
                let body = OutBody::new(rx, None, self.limits.message, ending).abandoned_by(abandoned);
                let mut resp = http::Response::new(Body::new(body));
                resp.headers_mut()
                    .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/grpc"));
                resp
            }
            Err(status) => status.into_http(),
        }
    }
}

impl tower_service::Service<http::Request<Body>> for Service {
    type Response = http::Response<Body>;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move { Ok(inner.handle(req).await) })
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
    let limits = limits(config);
    let svc = Service { inner: Arc::new(ServiceInner { tx: call_tx, closed: closed_rx.clone(), peer, limits }) };
    let g = &config.grpc;
    let mut builder = tonic::transport::Server::builder()
        .initial_stream_window_size(g.stream_window)
        .initial_connection_window_size(g.connection_window)
        .max_frame_size(g.max_frame_size)
        .max_concurrent_streams(config.max_concurrent_streams)
        .http2_keepalive_interval(config.keepalive_interval)
        .tcp_nodelay(true)
        .layer(tonic::service::InterceptorLayer::new(tcp_connect_info));
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

/// Puts tonic's `TcpConnectInfo` beside ours in every request, so the
/// services mounted beside ours see `remote_addr()` as usual.
fn tcp_connect_info(mut req: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
    if let Some(c) = req.extensions().get::<ConnectInfo>() {
        let tcp = TcpConnectInfo { local_addr: c.local_addr(), remote_addr: c.remote_addr() };
        req.extensions_mut().insert(tcp);
    }
    Ok(req)
}

async fn accept_loop(
    bound: Bound,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    config: TransportConfig,
    tx: mpsc::Sender<std::io::Result<Io>>,
) {
    let slots =
        Slots::new(config.max_connections.unwrap_or(usize::MAX), config.max_connections_per_peer.unwrap_or(usize::MAX));
    // At least one whole message, so a lone call can always complete one.
    let held_cap = usize::try_from(config.connection_window).unwrap_or(usize::MAX).max(message_limit(&config));
    let timeout = config.connect_timeout;
    let room_wait = config.grpc.room_wait;
    // An accepted socket, in its place, with its own account.
    let io = move |sock, slot| Io::new(sock, timeout, Held::new(held_cap, room_wait), slot);
    loop {
        let accepted = match &bound {
            Bound::Tcp(l) => l.accept().await.map(|(s, a)| (Some(s), None, Some(a))),
            Bound::Unix(l) => l.accept().await.map(|(s, _)| (None, Some(s), None::<SocketAddr>)),
        };
        if accepted.is_ok() {
            crate::listener::accepted();
        }
        match accepted {
            Ok((Some(s), _, addr)) => {
                tune_tcp(&s, &config);
                // Counted from the accept (a TLS handshake holds a socket too).
                let slot = match slots.take(addr.map(|a| a.ip())) {
                    Ok(slot) => slot,
                    Err(reason) => {
                        let Some(permit) = slots.refusal() else { continue };
                        tracing::info!(peer = ?addr, %reason, "gRPC connection refused");
                        let acceptor = acceptor.clone();
                        tokio::spawn(async move {
                            let _permit = permit;
                            match acceptor {
                                None => refuse(s, &reason).await,
                                // The refusal is said inside TLS (the client
                                // reads nothing before its handshake).
                                Some(acc) => {
                                    if let Ok(Ok(t)) = tokio::time::timeout(timeout, acc.accept(s)).await {
                                        refuse(t, &reason).await
                                    }
                                }
                            }
                        });
                        continue;
                    }
                };
                match &acceptor {
                    None => {
                        if tx.send(Ok(io(Sock::Tcp(s), slot))).await.is_err() {
                            return;
                        }
                    }
                    Some(acc) => {
                        // Each handshake in its own task: a slow client never
                        // delays the others. It gets the connect timeout.
                        let (acc, tx) = (acc.clone(), tx.clone());
                        tokio::spawn(async move {
                            match tokio::time::timeout(timeout, acc.accept(s)).await {
                                Ok(Ok(t)) => {
                                    let _ = tx.send(Ok(io(Sock::Tls(Box::new(t)), slot))).await;
                                }
                                Ok(Err(e)) => tracing::info!(peer = ?addr, error = %e, "TLS handshake failed"),
                                Err(_) => tracing::info!(peer = ?addr, "TLS handshake timed out"),
                            }
                        });
                    }
                }
            }
            Ok((None, Some(s), _)) => match slots.take(None) {
                Ok(slot) => {
                    if tx.send(Ok(io(Sock::Unix(s), slot))).await.is_err() {
                        return;
                    }
                }
                Err(reason) => {
                    if let Some(permit) = slots.refusal() {
                        tracing::info!(%reason, "gRPC connection refused");
                        tokio::spawn(async move {
                            let _permit = permit;
                            refuse(s, &reason).await
                        });
                    }
                }
            },
            Ok(_) => {}
            // Out of file descriptors and the like: back off, keep serving.
            Err(e) => crate::listener::backoff(&e).await,
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
            let handle = lock(&server).take();
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
