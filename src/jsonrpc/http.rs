//! The HTTP side: a hyper HTTP/1.1 server on the listen address, checks
//! before a body is read (path, method, token, content type, declared
//! length), the body read within its limit, and the answers; graceful
//! shutdown with the rest of the server.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::header::{self, HeaderValue};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::Value as Json;
use tensorwire_transports::{AcceptError, Connection, Endpoint, ListenError, Listener};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

use super::methods::Caller;
use super::protocol::{self, Body, RpcError};
use crate::config::{
    HTTP_BODY_TIMEOUT, HTTP_SMALL_BYTES, JSON_VALUE_BYTES, JSONRPC_BATCH_CONCURRENCY, JSONRPC_MAX_BATCH,
};
use crate::error::Status;
use crate::server::state::ServerInner;
use crate::util::sync::lock;

/// The path JSON-RPC requests are POSTed to.
const RPC_PATH: &str = "/rpc";

/// Listens on `http://host:port` and serves JSON-RPC there. The listener
/// hands no connections to the accept loop: HTTP connections are served
/// here, and stop when the listener is dropped (new ones) and when the
/// server shuts down (open ones, after their requests in flight).
pub(crate) async fn listen(ep: &Endpoint, inner: &Arc<ServerInner>) -> Result<Box<dyn Listener>, ListenError> {
    let io = |source| ListenError::Io { endpoint: ep.to_string(), source };
    let tcp = TcpListener::bind(ep.authority()).await.map_err(io)?;
    let local = ep.with_port(tcp.local_addr().map_err(io)?.port());
    let (stop, stopped) = oneshot::channel::<()>();
    let (done_tx, done) = watch::channel(false);
    let inner = inner.clone();
    tokio::spawn(async move {
        accept(tcp, inner, stopped).await;
        let _ = done_tx.send(true);
    });
    Ok(Box::new(HttpListener { local, _stop: stop, done }))
}

struct HttpListener {
    local: Endpoint,
    /// Dropped with the listener: the accept task then stops and closes the socket.
    _stop: oneshot::Sender<()>,
    done: watch::Receiver<bool>,
}

#[async_trait]
impl Listener for HttpListener {
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError> {
        // Connections are served by the accept task; the accept loop just
        // holds the listener until shutdown drops it.
        std::future::pending().await
    }

    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }

    fn release(&self) -> Option<BoxFuture<'static, ()>> {
        let mut done = self.done.clone();
        Some(Box::pin(async move {
            let _ = done.wait_for(|d| *d).await;
        }))
    }
}

/// Open HTTP connections of one listener, in all and per peer address:
/// `max_connections` and `max_connections_per_peer` apply to them as to
/// native connections (counted apart from those).
#[derive(Default)]
struct Open {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// One admitted connection; gives its place back when dropped.
struct Admitted {
    open: Arc<Mutex<Open>>,
    peer: IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut o = lock(&self.open);
        o.total = o.total.saturating_sub(1);
        if let Some(n) = o.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                o.per_peer.remove(&self.peer);
            }
        }
    }
}

fn admit(open: &Arc<Mutex<Open>>, peer: IpAddr, inner: &ServerInner) -> Result<Admitted, String> {
    let cfg = &inner.config;
    let mut o = lock(open);
    let from_peer = o.per_peer.get(&peer).copied().unwrap_or(0);
    if from_peer >= cfg.max_connections_per_peer {
        return Err(format!(
            "too many HTTP connections from {peer}: {from_peer} open, the server allows {} per peer",
            cfg.max_connections_per_peer
        ));
    }
    if o.total >= cfg.max_connections {
        return Err(format!("too many HTTP connections: {} open, the server allows {}", o.total, cfg.max_connections));
    }
    o.total += 1;
    *o.per_peer.entry(peer).or_default() += 1;
    Ok(Admitted { open: open.clone(), peer })
}

/// Answers a connection over the caps with 503 and closes it.
async fn refuse_connection(mut stream: tokio::net::TcpStream, reason: String) {
    use tokio::io::AsyncWriteExt;
    let body = protocol::response(Json::Null, Err(RpcError::from_status(&Status::unavailable(reason)))).to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), write).await;
}

async fn accept(tcp: TcpListener, inner: Arc<ServerInner>, mut stopped: oneshot::Receiver<()>) {
    let open = Arc::new(Mutex::new(Open::default()));
    loop {
        let (stream, addr) = tokio::select! {
            _ = &mut stopped => return,
            r = tcp.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(error = %e, "HTTP connection not accepted");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        match admit(&open, addr.ip(), &inner) {
            Ok(admitted) => drop(tokio::spawn(serve_connection(inner.clone(), stream, addr, admitted))),
            Err(reason) => {
                tracing::debug!(peer = %addr, %reason, "HTTP connection refused");
                tokio::spawn(refuse_connection(stream, reason));
            }
        }
    }
}

async fn serve_connection(
    inner: Arc<ServerInner>,
    stream: tokio::net::TcpStream,
    addr: std::net::SocketAddr,
    _admitted: Admitted,
) {
    let peer = addr.to_string();
    let svc_inner = inner.clone();
    let svc = hyper::service::service_fn(move |req| {
        let (inner, peer) = (svc_inner.clone(), peer.clone());
        async move { Ok::<_, Infallible>(handle(inner, peer, req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(inner.config.handshake_timeout)
        .serve_connection(TokioIo::new(stream), svc);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(peer = %addr, error = %e, "HTTP connection ended");
            }
        }
        _ = inner.shutdown.cancelled() => {
            // Finish the request in flight, then close.
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(inner.config.shutdown_grace, conn).await;
        }
    }
}

fn reply(status: StatusCode, body: Json) -> Response<Full<Bytes>> {
    reply_bytes(status, Bytes::from(body.to_string()))
}

fn reply_bytes(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An HTTP-level refusal, with a JSON-RPC error body for clients that read it.
fn refuse(status: StatusCode, error: RpcError) -> Response<Full<Bytes>> {
    reply(status, protocol::response(Json::Null, Err(error)))
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

fn is_json(req: &Request<hyper::body::Incoming>) -> bool {
    req.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

async fn handle(inner: Arc<ServerInner>, peer: String, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    if req.uri().path() != RPC_PATH {
        return plain(StatusCode::NOT_FOUND, "tensorwire serves JSON-RPC 2.0 at POST /rpc\n");
    }
    if req.method() != hyper::Method::POST {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "JSON-RPC requests are POSTed to /rpc\n");
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST"));
        return r;
    }
    if inner.config.auth_token.is_some() {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
        if let Err(s) = inner.auth.check(&peer, given.strip_prefix("Bearer ").unwrap_or("")) {
            let s = Status::unauthenticated(format!("{} (header Authorization: Bearer <token>)", s.message));
            let mut r = refuse(StatusCode::UNAUTHORIZED, RpcError::from_status(&s));
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"tensorwire\""));
            return r;
        }
    }
    if !is_json(&req) {
        return refuse(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            RpcError::invalid_request("Invalid Request: Content-Type must be application/json"),
        );
    }
    let limit = inner.config.max_http_body_bytes;
    let too_large = |n: Option<u64>| {
        let size = n.map_or_else(|| "above".to_string(), |n| format!("of {n} bytes is above"));
        refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            RpcError::invalid_request(format!(
                "Invalid Request: the body {size} the limit of {limit} bytes (serve --max-http-body-bytes); \
                 move large tensors with the native protocol"
            )),
        )
    };
    // Refused by its declared length before a byte of it is read.
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return too_large(declared);
    }
    let timeout_ms =
        req.headers().get("x-timeout-ms").and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok()).unwrap_or(0);
    let body = Limited::new(req.into_body(), usize::try_from(limit).unwrap_or(usize::MAX));
    let body = match tokio::time::timeout(HTTP_BODY_TIMEOUT, body.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return too_large(None),
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %e, "HTTP body not read");
            return plain(StatusCode::BAD_REQUEST, "the request body could not be read\n");
        }
        Err(_) => return plain(StatusCode::REQUEST_TIMEOUT, "the request body did not arrive in time\n"),
    };
    // What parsing it and the tensors in it will take, held against the
    // server's memory budget until the answer is sent: a small body of many
    // tiny values parses into many times its size. Small ones pass as they
    // are (by the estimate, not the body's length); one that needs more
    // than the whole budget is refused without asking the budget to make
    // room (an LRU store would empty itself for nothing).
    let need = (body.len() as u64)
        .saturating_mul(3)
        .saturating_add(protocol::json_values(&body).saturating_mul(JSON_VALUE_BYTES));
    let _held = if need < HTTP_SMALL_BYTES {
        None
    } else {
        let short = |why: String| {
            let s = Status::resource_exhausted(format!("the server is short of memory for this request: {why}"));
            refuse(StatusCode::SERVICE_UNAVAILABLE, RpcError::from_status(&s))
        };
        if need > inner.budget.limit() {
            return short(format!(
                "parsing it takes ~{need} bytes, above the server's whole memory budget of {} bytes",
                inner.budget.limit()
            ));
        }
        match inner.budget.try_reserve(need, "JSON-RPC request") {
            Ok(h) => Some(h),
            Err(e) => return short(e.to_string()),
        }
    };
    let response_left = AtomicU64::new(inner.config.max_http_response_bytes.saturating_add(HTTP_SMALL_BYTES));
    let caller = Caller { inner, peer, timeout_ms, response_left };
    match protocol::parse(&body, JSONRPC_MAX_BATCH) {
        Body::Invalid(e) => reply(StatusCode::OK, protocol::response(Json::Null, Err(e))),
        Body::Single(Err(bad)) => {
            let (id, e) = *bad;
            reply(StatusCode::OK, protocol::response(id, Err(e)))
        }
        Body::Single(Ok(r)) => match caller.answer(r).await {
            Some(answer) => reply_bytes(StatusCode::OK, Bytes::from(answer)),
            None => no_content(),
        },
        Body::Batch(entries) => {
            let caller = &caller;
            // Answers come back serialized (each charged to the response's
            // limit as it is made) and are joined into one array.
            let answers: Vec<Vec<u8>> = futures_util::stream::iter(entries)
                .map(|e| async move {
                    match e {
                        Ok(r) => caller.answer(r).await,
                        Err(bad) => {
                            let (id, e) = *bad;
                            Some(protocol::response(id, Err(e)).to_string().into_bytes())
                        }
                    }
                })
                .buffered(JSONRPC_BATCH_CONCURRENCY)
                .filter_map(|a| async move { a })
                .collect()
                .await;
            // A batch of notifications only is answered with nothing.
            if answers.is_empty() {
                return no_content();
            }
            let mut out = Vec::with_capacity(answers.iter().map(|a| a.len() + 1).sum::<usize>() + 1);
            out.push(b'[');
            for (i, a) in answers.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(a);
            }
            out.push(b']');
            reply_bytes(StatusCode::OK, Bytes::from(out))
        }
    }
}

fn no_content() -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = StatusCode::NO_CONTENT;
    r
}
