//! The client: connects by URL, handshakes, reconnects when the connection
//! drops, retries when it is safe, and offers every call mode.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tensorwire_codecs::{Compression, CompressionMode, Tensor, available_codecs};
use tensorwire_proto::v1::{self, Method, frame_header::Kind};
use tensorwire_transports::{ConnectError, Connection, ConnectionInfo, Endpoint, Scheme, StreamKind};

use super::coalesce::Coalescer;
use crate::config::{ClientConfig, Encoding, VERSION};
use crate::error::{CallError, Code, Status};
use crate::observe::stats::{ClientStats, Statistics};
use crate::pipeline::budget::MemoryBudget;
use crate::pipeline::link::{LinkEstimator, PeerCaps, SharedCaps};
use crate::pipeline::pool::{PoolConfig, RecvPool};
use crate::pipeline::reader::{FrameReader, Item};
use crate::pipeline::wire::{PROTOCOL_VERSION, codec_to_wire, compression_to_wire};
use crate::pipeline::writer::FrameWriter;
use crate::rpc::call::SendSummary;
use crate::util::host::host_id;
use crate::util::sync::{read, write};

/// Per-call settings that override the client's.
#[derive(Clone, Debug, Default)]
pub struct CallOptions {
    /// Give up after this long (the server stops the work too).
    pub timeout: Option<Duration>,
    /// The call may run twice safely: retry it even after the request may
    /// have reached the server.
    pub idempotent: bool,
    /// Encoding of tensors sent in this call (codec, compression, chunk size).
    pub encoding: Option<Encoding>,
}

impl CallOptions {
    /// Options with a timeout.
    pub fn timeout(t: Duration) -> Self {
        Self { timeout: Some(t), ..Self::default() }
    }

    /// Builder form: marks the call idempotent.
    pub fn idempotent(mut self) -> Self {
        self.idempotent = true;
        self
    }
}

/// One handshaken connection.
pub(crate) struct ClientSession {
    pub(crate) conn: Arc<dyn Connection>,
    pub(crate) info: ConnectionInfo,
    /// `info.peer`, shared by the calls' readers.
    pub(crate) peer: Arc<str>,
    pub(crate) caps: SharedCaps,
    pub(crate) welcome: v1::Welcome,
    pub(crate) link: Arc<LinkEstimator>,
}

pub(crate) struct ClientInner {
    pub(crate) endpoint: Endpoint,
    pub(crate) config: ClientConfig,
    pub(crate) coalescer: Coalescer,
    current: RwLock<Option<Arc<ClientSession>>>,
    connecting: tokio::sync::Mutex<()>,
    pub(crate) stats: ClientStats,
    /// Large receive buffers (fetches, call outputs) are recycled here.
    pub(crate) pool: RecvPool,
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        if let Some(s) = self.current.get_mut().ok().and_then(Option::take) {
            s.conn.close("client dropped");
        }
    }
}

/// An async client. Cheap to clone; clones share the connection, on which
/// many calls run at once.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("endpoint", &self.inner.endpoint.to_string()).finish_non_exhaustive()
    }
}

/// Marks that a call's request may have reached the server.
#[derive(Default)]
pub(crate) struct Sent(AtomicBool);

/// One attempt of a call: its result and the server's reported compute time.
pub(crate) type Attempt<'a, T> = Pin<Box<dyn Future<Output = Result<(T, Option<Duration>), CallError>> + Send + 'a>>;

impl Sent {
    pub(crate) fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
    pub(crate) fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl Client {
    /// Connects to `url` with default settings.
    pub async fn connect(url: &str) -> Result<Client, ConnectError> {
        Self::connect_with(url, ClientConfig::default()).await
    }

    /// Connects to `url` and handshakes (fails fast if the server is not there).
    pub async fn connect_with(url: &str, config: ClientConfig) -> Result<Client, ConnectError> {
        let endpoint = Endpoint::parse(url)?;
        // The client has no memory budget of its own: the pool's counts
        // bound nothing but keep the accounting in one place.
        let pool = RecvPool::new(MemoryBudget::unlimited(), PoolConfig::sized(config.recv_pool_bytes, u64::MAX));
        let c = Client {
            inner: Arc::new(ClientInner {
                endpoint,
                config,
                coalescer: Default::default(),
                current: RwLock::new(None),
                connecting: tokio::sync::Mutex::new(()),
                stats: ClientStats::default(),
                pool,
            }),
        };
        c.session().await?;
        Ok(c)
    }

    /// The server's URL.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The client's settings.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The server's service name, from the handshake.
    pub fn server_name(&self) -> Option<String> {
        self.current().map(|s| s.welcome.service_name.clone())
    }

    /// Counters and latencies of this client's calls.
    pub fn statistics(&self) -> Statistics {
        self.inner.stats.snapshot()
    }

    /// The transport the current connection runs on (`tcp`, `unix`,
    /// `unix+shm` for a same-host `tcp://` or `unix://` connection upgraded
    /// to shared memory, ...); None while not connected.
    pub fn transport(&self) -> Option<&'static str> {
        self.current().map(|s| s.info.transport)
    }

    /// Closes the connection; the next call reconnects.
    pub fn disconnect(&self) {
        if let Some(s) = write(&self.inner.current).take() {
            s.conn.close("client disconnected");
        }
    }

    pub(crate) fn current(&self) -> Option<Arc<ClientSession>> {
        read(&self.inner.current).clone().filter(|s| !s.conn.is_closed())
    }

    pub(crate) async fn session(&self) -> Result<Arc<ClientSession>, ConnectError> {
        if let Some(s) = self.current() {
            return Ok(s);
        }
        // Boxed: connecting is rare, and its future (every transport's
        // connect and handshake) would otherwise make every call's future
        // kilobytes larger, copied as calls are made.
        Box::pin(self.connect_session()).await
    }

    /// Connects (once, for every caller waiting) and makes the session current.
    async fn connect_session(&self) -> Result<Arc<ClientSession>, ConnectError> {
        let _g = self.inner.connecting.lock().await;
        if let Some(s) = self.current() {
            return Ok(s);
        }
        let s = Arc::new(self.new_session().await?);
        self.inner.stats.connects.fetch_add(1, Ordering::Relaxed);
        *write(&self.inner.current) = Some(s.clone());
        Ok(s)
    }

    pub(crate) async fn new_session(&self) -> Result<ClientSession, ConnectError> {
        let s = self.session_at(&self.inner.endpoint).await?;
        match self.upgrade_url(&s) {
            Some(url) => match Endpoint::parse(&url) {
                Ok(ep) => match self.session_at(&ep).await {
                    Ok(upgraded) => {
                        s.conn.close("upgraded to shared memory");
                        Ok(upgraded)
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, %url, "shared-memory upgrade failed; staying on tcp");
                        Ok(s)
                    }
                },
                Err(_) => Ok(s),
            },
            None => Ok(s),
        }
    }

    /// Where a same-host `tcp://` session may reconnect to use shared
    /// memory: the server's upgrade socket, unless the URL says `?shm=0` or
    /// [`ShmConfig::unix_upgrade`](tensorwire_transports::config::ShmConfig)
    /// is off; a `?ring=0` on the URL goes with it (rings off there too).
    fn upgrade_url(&self, s: &ClientSession) -> Option<String> {
        let ep = &self.inner.endpoint;
        let wanted = cfg!(feature = "shm")
            && self.inner.config.transport.shm.unix_upgrade
            && ep.scheme() == Scheme::Tcp
            && ep.query("shm") != Some("0")
            && self.inner.config.transports.added_for(Scheme::Tcp).is_none();
        let url = &s.welcome.shm_upgrade_url;
        (wanted && s.info.transport == "tcp" && url.starts_with("unix://@")).then(|| carry_ring_option(url, ep))
    }

    async fn session_at(&self, ep: &Endpoint) -> Result<ClientSession, ConnectError> {
        let cfg = &self.inner.config;
        let conn = cfg.transports.connect(ep, &cfg.transport).await?;
        let info = conn.info();
        let proto = |reason: String| ConnectError::Protocol { endpoint: ep.to_string(), reason };
        let (mut tx, rx) = conn.open(StreamKind::Handshake).await.map_err(|e| proto(e.to_string()))?;
        let hello = v1::Hello {
            version: PROTOCOL_VERSION,
            codecs: available_codecs().into_iter().map(|c| codec_to_wire(c) as i32).collect(),
            compressions: Compression::available().into_iter().map(|c| compression_to_wire(c) as i32).collect(),
            chunk_size: cfg.encoding.effective_chunk_size() as u64,
            limits: Some(cfg.limits.to_wire(&cfg.transport)),
            auth_token: cfg.auth_token.clone().unwrap_or_default(),
            agent: format!("tensorwire/{VERSION}"),
            host_id: host_id(),
        };
        let frame = tensorwire_transports::Frame::header_only(v1::FrameHeader::new(Kind::Hello(Box::new(hello))));
        tx.send_last(frame).await.map_err(|e| proto(e.to_string()))?;
        let mut r = FrameReader::new(rx, Arc::from(info.peer.as_str()), cfg.limits.clone(), false);
        let welcome = match tokio::time::timeout(cfg.transport.connect_timeout, r.next()).await {
            Err(_) => {
                return Err(ConnectError::Timeout { endpoint: ep.to_string(), after: cfg.transport.connect_timeout });
            }
            Ok(Ok(Item::Control(h))) => match h.kind {
                Some(Kind::Welcome(w)) => *w,
                Some(Kind::Error(e)) => {
                    return Err(proto(format!("the server refused the handshake: {}", Status::from_wire(&e))));
                }
                _ => return Err(proto(format!("expected a welcome, got a {} frame", h.kind_name()))),
            },
            Ok(Ok(_)) => return Err(proto("expected a welcome frame".into())),
            Ok(Err(e)) => return Err(proto(e.to_string())),
        };
        let caps = Arc::new(accept_welcome(&welcome).map_err(proto)?);
        Ok(ClientSession {
            conn,
            peer: Arc::from(info.peer.as_str()),
            info,
            caps,
            welcome,
            link: Arc::new(LinkEstimator::default()),
        })
    }

    pub(crate) fn encoding(&self, opts: &CallOptions) -> Encoding {
        opts.encoding.clone().unwrap_or_else(|| self.inner.config.encoding.clone())
    }

    pub(crate) fn request(&self, method: Method, opts: &CallOptions, started: Instant) -> v1::Request {
        let enc = self.encoding(opts);
        let timeout = opts.timeout.or(self.inner.config.timeout);
        let mut req = v1::Request {
            method: method as i32,
            idempotent: opts.idempotent,
            timeout_ms: timeout.map_or(0, |t| t.saturating_sub(started.elapsed()).as_millis().max(1) as u64),
            response_codec: codec_to_wire(enc.codec) as i32,
            ..Default::default()
        };
        // gRPC servers see no connection-wide Hello: every call proves itself.
        if let Some(token) = &self.inner.config.auth_token
            && matches!(self.inner.endpoint.scheme(), Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix)
        {
            req.auth_token = token.clone();
        }
        // An explicit compression applies to the answer too (WAN links).
        if let CompressionMode::Fixed(c) = enc.compression {
            req.response_compression = compression_to_wire(c) as i32;
            req.response_shuffle = u32::from(enc.shuffle) * 16;
        }
        req
    }

    pub(crate) async fn open(
        &self,
        s: &ClientSession,
        kind: StreamKind,
        opts: &CallOptions,
    ) -> Result<(FrameWriter, FrameReader), CallError> {
        let (tx, rx) = s.conn.open(kind).await?;
        let cfg = &self.inner.config;
        let mut w =
            FrameWriter::new(tx, self.encoding(opts), s.caps.clone(), s.info.max_frame_payload, Some(s.link.clone()))
                .for_transport(s.info.transport);
        let mut r = FrameReader::pooled(rx, s.peer.clone(), cfg.limits.clone(), cfg.placement, self.inner.pool.clone());
        w.progress = cfg.progress.clone();
        w.defer_link = kind == StreamKind::Send;
        r.progress = cfg.progress.clone();
        Ok((w, r))
    }

    /// Runs one call with the timeout and retry policy. `attempt` gets a
    /// fresh session and marks `Sent` once its request may have reached the server.
    pub(crate) async fn run<'a, T>(
        &'a self,
        opts: &CallOptions,
        attempt: impl FnMut(Arc<ClientSession>, Arc<Sent>, Instant) -> Attempt<'a, T>,
    ) -> Result<T, CallError> {
        self.run_recorded(opts, true, attempt).await
    }

    pub(crate) async fn run_recorded<'a, T>(
        &'a self,
        opts: &CallOptions,
        record: bool,
        mut attempt: impl FnMut(Arc<ClientSession>, Arc<Sent>, Instant) -> Attempt<'a, T>,
    ) -> Result<T, CallError> {
        let started = Instant::now();
        let timeout = opts.timeout.or(self.inner.config.timeout);
        let mut retries = 0;
        // What went wrong first: the cause a caller wants to see when the
        // retries fail too (they often fail only because of it: a server
        // that reset the call and is now gone refuses the retry).
        let mut first: Option<CallError> = None;
        loop {
            let sent = Arc::new(Sent::default());
            let fut = async {
                let s = self.session().await?;
                attempt(s, sent.clone(), started).await
            };
            let r = within(timeout, started, fut).await;
            match r {
                Ok((v, server_time)) => {
                    if record {
                        self.inner.stats.record(true, started.elapsed(), server_time);
                    }
                    return Ok(v);
                }
                Err(e) => {
                    if retriable(&e, sent.get(), opts.idempotent) {
                        retries += 1;
                        if let Some(d) = self.inner.config.retry.delay(retries, &e) {
                            self.inner.stats.retries.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(error = %e, retry = retries, delay = ?d, "retrying");
                            first.get_or_insert(e);
                            tokio::time::sleep(d).await;
                            continue;
                        }
                    }
                    if record {
                        self.inner.stats.record(false, started.elapsed(), None);
                    }
                    if let Some(cause) = first {
                        tracing::debug!(last = %e, retries, "the retries failed too; reporting the first error");
                        return Err(cause);
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Runs `fut`, a call outside the retry loop, within the call's
    /// timeout (`opts`', else the client's), counted from `started`.
    pub(crate) async fn within_timeout<T>(
        &self,
        opts: &CallOptions,
        started: Instant,
        fut: impl Future<Output = Result<T, CallError>>,
    ) -> Result<T, CallError> {
        within(opts.timeout.or(self.inner.config.timeout), started, fut).await
    }

    pub(crate) fn count(&self, w: &FrameWriter, r: &FrameReader) {
        self.count_sent(w);
        self.count_received(r);
    }

    pub(crate) fn count_sent(&self, w: &FrameWriter) {
        self.inner.stats.bytes_sent.fetch_add(w.bytes_sent, Ordering::Relaxed);
    }

    pub(crate) fn count_received(&self, r: &FrameReader) {
        self.inner.stats.bytes_received.fetch_add(r.bytes, Ordering::Relaxed);
    }

    /// Opens a `send` call that runs outside the retry loop (its source is
    /// consumed as it goes): the writer with the request queued, the
    /// reader, and when the call started.
    pub(crate) async fn begin_send(&self) -> Result<(FrameWriter, FrameReader, Instant), CallError> {
        let opts = CallOptions::default();
        let started = Instant::now();
        let s = self.session().await?;
        let (mut w, r) = self.open(&s, StreamKind::Send, &opts).await?;
        w.control(Kind::Request(Box::new(self.request(Method::Send, &opts, started))));
        Ok((w, r, started))
    }

    /// Ends a send call that runs outside the retry loop and reads its summary.
    pub(crate) async fn finish_send(
        &self,
        mut w: FrameWriter,
        mut r: FrameReader,
        started: Instant,
    ) -> Result<SendSummary, CallError> {
        w.finish().await?;
        let (_, reply) = read_outputs(&mut r).await?;
        self.count(&w, &r);
        self.inner.stats.record(true, started.elapsed(), None);
        Ok(SendSummary { received: reply.received_count, bytes: reply.received_bytes, message: reply.message })
    }
}

/// `fut`, failed with [`CallError::Timeout`] once `timeout` (if any) has
/// passed since `started`.
async fn within<T>(
    timeout: Option<Duration>,
    started: Instant,
    fut: impl Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    match timeout {
        Some(t) => {
            tokio::time::timeout(t.saturating_sub(started.elapsed()), fut).await.unwrap_or(Err(CallError::Timeout(t)))
        }
        None => fut.await,
    }
}

/// Sends every tensor, then ends the stream; a small call leaves in one write.
pub(crate) async fn send_all(w: &mut FrameWriter, tensors: &[Tensor]) -> Result<(), CallError> {
    for t in tensors {
        w.send_tensor(t, true).await?;
    }
    w.finish().await
}

/// Whether a failed attempt may run again: only when the request cannot
/// have been processed, or the caller said running twice is fine.
pub(crate) fn retriable(e: &CallError, sent: bool, idempotent: bool) -> bool {
    match e {
        CallError::Connect(_) => true,
        CallError::Remote(s) => s.code == Code::Refused || (idempotent && s.code == Code::Unavailable),
        CallError::Stream(se) => {
            (!sent || idempotent)
                && (se.is_connection_error() || matches!(se, tensorwire_transports::StreamError::Refused { .. }))
        }
        _ => false,
    }
}

/// A send that failed because the server stopped reading usually has the
/// server's reason waiting in the reply: report that instead.
pub(crate) async fn explain(e: CallError, r: &mut FrameReader) -> CallError {
    if !matches!(e, CallError::Stream(_)) {
        return e;
    }
    match tokio::time::timeout(Duration::from_secs(2), read_outputs(r)).await {
        Ok(Err(remote @ CallError::Remote(_))) => remote,
        _ => e,
    }
}

/// The end of a `send` attempt: counts the bytes, explains a failed send by
/// the server's reply, and reads the summary.
pub(crate) async fn send_summary(
    c: &Client,
    w: &mut FrameWriter,
    r: &mut FrameReader,
    sent: Result<(), CallError>,
) -> Result<SendSummary, CallError> {
    c.count_sent(w);
    if let Err(e) = sent {
        return Err(explain(e, r).await);
    }
    let out = read_outputs(r).await;
    c.count_received(r);
    let (_, reply) = out?;
    w.record_call();
    Ok(SendSummary { received: reply.received_count, bytes: reply.received_bytes, message: reply.message })
}

/// Reads output tensors until the reply (or error) and the end of the stream.
/// The reply stays boxed, as it arrived: it is ~0.5 KB, mostly fields of
/// other methods.
pub(crate) async fn read_outputs(r: &mut FrameReader) -> Result<(Vec<Tensor>, Box<v1::Reply>), CallError> {
    let mut out = Vec::new();
    loop {
        match r.next().await? {
            Item::Tensor(t) => out.push(t),
            Item::Control(h) => match h.kind {
                Some(Kind::Reply(reply)) => {
                    return match r.next().await? {
                        Item::End => Ok((out, reply)),
                        _ => Err(r.protocol("frames after the reply")),
                    };
                }
                Some(Kind::Error(e)) => return Err(CallError::Remote(Status::from_wire(&e))),
                _ => return Err(r.protocol(format!("unexpected {} frame in a reply", h.kind_name()))),
            },
            Item::End => return Err(r.protocol("the server ended the call without a reply")),
        }
    }
}

/// Checks a server's Welcome: its protocol version, then what it announces
/// (limits, codecs, compressions) as this connection's view of the peer.
pub(crate) fn accept_welcome(welcome: &v1::Welcome) -> Result<PeerCaps, String> {
    if welcome.version != PROTOCOL_VERSION {
        return Err(format!("the server speaks protocol version {}, this client {PROTOCOL_VERSION}", welcome.version));
    }
    Ok(PeerCaps::announced(welcome.limits, &welcome.codecs, &welcome.compressions))
}

/// The server's upgrade URL, with the `ring=0` of the URL the client was
/// given (the one shared-memory option that concerns the upgraded
/// connection).
fn carry_ring_option(upgrade: &str, given: &Endpoint) -> String {
    if given.query("ring") != Some("0") {
        return upgrade.to_string();
    }
    let sep = if upgrade.contains('?') { '&' } else { '?' };
    format!("{upgrade}{sep}ring=0")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `?ring=0` on a `tcp://` URL reaches the shared-memory connection
    /// it upgrades to; other options (and a URL without it) leave the
    /// server's upgrade URL as it is.
    #[test]
    fn the_upgrade_keeps_the_ring_option() {
        let ep = |u: &str| Endpoint::parse(u).unwrap();
        let up = "unix://@tensorwire-up-1";
        assert_eq!(carry_ring_option(up, &ep("tcp://127.0.0.1:5000?ring=0")), "unix://@tensorwire-up-1?ring=0");
        assert_eq!(carry_ring_option("unix://@x?a=b", &ep("tcp://127.0.0.1:5000?ring=0")), "unix://@x?a=b&ring=0");
        assert_eq!(carry_ring_option(up, &ep("tcp://127.0.0.1:5000")), up);
        assert_eq!(carry_ring_option(up, &ep("tcp://127.0.0.1:5000?ring=1&timeout=5")), up);
        // The upgraded URL parses, and says what it should.
        let upgraded = ep(&carry_ring_option(up, &ep("tcp://127.0.0.1:5000?ring=0")));
        assert_eq!(upgraded.query("ring"), Some("0"));
    }
}
