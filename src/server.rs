//! The server: a [`ServerBuilder`] collects a [`TensorService`] and named
//! [`Function`]s; [`Server::start`] listens on URLs and returns a
//! [`RunningServer`] that serves until [`RunningServer::shutdown`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorwire_codecs::Tensor;
use tensorwire_transports::{AcceptError, Connection, ConnectionInfo, Endpoint, Incoming, ListenError, Listener};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::connect;
use crate::dispatch;
use crate::error::Status;
use crate::function::{Function, Output, Registry};
use crate::info::{FunctionStatistics, ServiceInfo};
use crate::service::{Cancellation, EchoService, TensorService};
use crate::stats::ServerStats;
use crate::stream::{LinkEstimator, SharedCaps};
use crate::tasks::{TaskConfig, TaskManager};
use crate::{ServerConfig, VERSION};

/// Collects what a server serves.
pub struct ServerBuilder {
    config: ServerConfig,
    service: Arc<dyn TensorService>,
    functions: Registry,
    tasks: TaskConfig,
}

impl Default for ServerBuilder {
    fn default() -> Self {
        Self {
            config: ServerConfig::default(),
            service: Arc::new(EchoService),
            functions: Registry::default(),
            tasks: TaskConfig::default(),
        }
    }
}

impl ServerBuilder {
    /// Settings (chunk size, limits, TLS, ...).
    pub fn config(mut self, config: ServerConfig) -> Self {
        self.config = config;
        self
    }

    /// The handlers of send, fetch and exchange (default: [`EchoService`]).
    pub fn service(mut self, service: impl TensorService) -> Self {
        self.service = Arc::new(service);
        self
    }

    /// Registers a named function (replacing one of the same name).
    pub fn function(mut self, f: Function) -> Self {
        self.functions.insert(f);
        self
    }

    /// Registers a compute function (tensors in, tensors out), run on the
    /// blocking pool: the split-learning seed's `ComputeFunction`.
    pub fn compute(
        self,
        name: impl Into<String>,
        f: impl Fn(Vec<Tensor>) -> Result<Vec<Tensor>, Status> + Send + Sync + 'static,
    ) -> Self {
        self.function(Function::new(name, move |c| f(c.inputs).map(Output::from)))
    }

    /// Task retention settings.
    pub fn tasks(mut self, tasks: TaskConfig) -> Self {
        self.tasks = tasks;
        self
    }

    /// The server, ready to start.
    pub fn build(self) -> Server {
        Server {
            inner: Arc::new(ServerInner {
                tasks: TaskManager::new(self.tasks),
                config: self.config,
                service: self.service,
                functions: self.functions,
                stats: ServerStats::default(),
                started: Instant::now(),
                serving: AtomicBool::new(true),
                shutdown: Cancellation::default(),
                idle: Notify::new(),
                conns: Mutex::new(HashMap::new()),
                next_conn: AtomicU64::new(0),
                transports: Mutex::new(Vec::new()),
            }),
        }
    }
}

pub(crate) struct ServerInner {
    pub(crate) config: ServerConfig,
    pub(crate) service: Arc<dyn TensorService>,
    pub(crate) functions: Registry,
    pub(crate) tasks: TaskManager,
    pub(crate) stats: ServerStats,
    pub(crate) started: Instant,
    pub(crate) serving: AtomicBool,
    pub(crate) shutdown: Cancellation,
    idle: Notify,
    conns: Mutex<HashMap<u64, Arc<dyn Connection>>>,
    next_conn: AtomicU64,
    transports: Mutex<Vec<String>>,
}

impl ServerInner {
    pub(crate) fn info(&self) -> ServiceInfo {
        use tensorwire_codecs::{Compression, available_codecs};
        ServiceInfo {
            service_name: self.config.service_name.clone(),
            version: VERSION.to_string(),
            transports: self.transports.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            codecs: available_codecs().iter().map(|c| c.name().to_string()).collect(),
            compressions: Compression::available().iter().map(|c| c.name().to_string()).collect(),
            devices: crate::devices(),
            uptime: self.started.elapsed(),
            calls: self.stats.calls.load(Ordering::Relaxed),
            failures: self.stats.failures.load(Ordering::Relaxed),
            bytes_received: self.stats.bytes_received.load(Ordering::Relaxed),
            bytes_sent: self.stats.bytes_sent.load(Ordering::Relaxed),
            active_calls: self.stats.active.load(Ordering::Relaxed),
            functions: self
                .functions
                .iter()
                .map(|f| {
                    let c = f.stats.counters();
                    FunctionStatistics {
                        name: f.name.clone(),
                        calls: c.calls.load(Ordering::Relaxed),
                        failures: c.failures.load(Ordering::Relaxed),
                        batches: c.batches.load(Ordering::Relaxed),
                        total_time: Duration::from_micros(c.total_us.load(Ordering::Relaxed)),
                    }
                })
                .collect(),
        }
    }

    /// Counts a call as active until the guard drops.
    pub(crate) fn begin_call(self: &Arc<Self>) -> ActiveCall {
        self.stats.active.fetch_add(1, Ordering::AcqRel);
        ActiveCall(self.clone())
    }
}

pub(crate) struct ActiveCall(Arc<ServerInner>);

impl Drop for ActiveCall {
    fn drop(&mut self) {
        if self.0.stats.active.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// A server, built and not yet listening.
pub struct Server {
    inner: Arc<ServerInner>,
}

/// Errors from starting a server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A listener could not be created.
    #[error(transparent)]
    Listen(#[from] ListenError),
    /// No URL was given.
    #[error("no listen URL given")]
    NoListeners,
}

impl Server {
    /// Starts building a server.
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// Listens on every URL (`tcp://127.0.0.1:0` picks a free port) and
    /// starts serving. All listeners bind before any accepts, so an error
    /// leaves nothing running.
    pub async fn start<I, S>(self, urls: I) -> Result<RunningServer, ServeError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut listeners = Vec::new();
        for url in urls {
            let ep = Endpoint::parse(url.as_ref()).map_err(ListenError::from)?;
            listeners.push(connect::listen(&ep, &self.inner).await?);
        }
        if listeners.is_empty() {
            return Err(ServeError::NoListeners);
        }
        let endpoints: Vec<Endpoint> = listeners.iter().map(|l| l.local_endpoint()).collect();
        {
            let mut t = self.inner.transports.lock().unwrap_or_else(|e| e.into_inner());
            for e in &endpoints {
                let s = e.scheme().as_str().to_string();
                if !t.contains(&s) {
                    t.push(s);
                }
            }
        }
        let releases = listeners.iter().filter_map(|l| l.release()).collect();
        let mut tasks: Vec<JoinHandle<()>> =
            listeners.into_iter().map(|l| tokio::spawn(accept_loop(self.inner.clone(), l))).collect();
        // Expired task results are dropped even when nobody asks about them.
        let weak = Arc::downgrade(&self.inner);
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                match weak.upgrade() {
                    Some(inner) => inner.tasks.sweep(),
                    None => return,
                }
            }
        }));
        for e in &endpoints {
            tracing::info!(endpoint = %e, "listening");
        }
        Ok(RunningServer { inner: self.inner, endpoints, tasks, releases })
    }
}

/// A serving server.
pub struct RunningServer {
    inner: Arc<ServerInner>,
    endpoints: Vec<Endpoint>,
    tasks: Vec<JoinHandle<()>>,
    /// Listeners whose address outlives them (QUIC) free it with these.
    releases: Vec<futures_util::future::BoxFuture<'static, ()>>,
}

impl RunningServer {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn inner(&self) -> &Arc<ServerInner> {
        &self.inner
    }

    /// Where it listens (ports resolved).
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// The first listen URL, as a string clients can connect to.
    pub fn url(&self) -> String {
        self.endpoints[0].to_string()
    }

    /// Name, capabilities and totals.
    pub fn info(&self) -> ServiceInfo {
        self.inner.info()
    }

    /// True until shutdown begins.
    pub fn is_serving(&self) -> bool {
        self.inner.serving.load(Ordering::Acquire)
    }

    /// Graceful shutdown: stop accepting, report NOT_SERVING, refuse new
    /// calls, wait for calls in flight (up to `shutdown_grace`), then close
    /// every connection.
    pub async fn shutdown(mut self) {
        // Stop accepting and wait until the listeners are closed, so the
        // addresses are free again when this returns.
        self.inner.serving.store(false, Ordering::Release);
        self.inner.shutdown.cancel();
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
        let deadline = tokio::time::Instant::now() + self.inner.config.shutdown_grace;
        loop {
            let idle = self.inner.idle.notified();
            let mut idle = std::pin::pin!(idle);
            idle.as_mut().enable();
            if self.inner.stats.active.load(Ordering::Acquire) == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                tracing::warn!(
                    active = self.inner.stats.active.load(Ordering::Acquire),
                    "shutdown grace period over; closing calls still in flight"
                );
                break;
            }
        }
        self.close_all();
        self.release().await;
    }

    /// Stops at once: closes the listeners (the addresses are free when this
    /// returns) and every connection, without waiting for calls in flight.
    pub async fn abort(mut self) {
        self.inner.serving.store(false, Ordering::Release);
        self.inner.shutdown.cancel();
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
        self.close_all();
        self.release().await;
    }

    async fn release(&mut self) {
        for r in self.releases.drain(..) {
            if tokio::time::timeout(Duration::from_secs(5), r).await.is_err() {
                tracing::warn!("a listener's address was not released within 5 s");
            }
        }
    }

    fn begin_shutdown(&mut self) {
        self.inner.serving.store(false, Ordering::Release);
        self.inner.shutdown.cancel();
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }

    fn close_all(&self) {
        let conns: Vec<_> =
            self.inner.conns.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, c)| c).collect();
        for c in conns {
            c.close("server shutting down");
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if !self.tasks.is_empty() {
            self.begin_shutdown();
            self.close_all();
        }
    }
}

async fn accept_loop(inner: Arc<ServerInner>, mut listener: Box<dyn Listener>) {
    loop {
        match listener.accept().await {
            Ok(conn) => {
                tokio::spawn(serve_connection(inner.clone(), conn));
            }
            Err(AcceptError::Closed) => return,
            Err(e) => tracing::debug!(error = %e, "connection not accepted"),
        }
    }
}

/// Per-connection state shared by its streams.
pub(crate) struct Session {
    pub(crate) info: ConnectionInfo,
    pub(crate) handshaken: AtomicBool,
    pub(crate) caps: Mutex<SharedCaps>,
    pub(crate) link: Arc<LinkEstimator>,
}

impl Session {
    pub(crate) fn caps(&self) -> SharedCaps {
        self.caps.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

async fn serve_connection(inner: Arc<ServerInner>, conn: Arc<dyn Connection>) {
    let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
    inner.conns.lock().unwrap_or_else(|e| e.into_inner()).insert(id, conn.clone());
    let info = conn.info();
    let session = Arc::new(Session {
        info: info.clone(),
        handshaken: AtomicBool::new(info.stateless),
        caps: Mutex::new(SharedCaps::default()),
        link: Arc::new(LinkEstimator::default()),
    });
    if !info.stateless {
        // A client that never says Hello does not hold a connection forever.
        // (Weak: a closed connection must not be kept alive by this timer;
        // a QUIC connection holds its listener's socket.)
        let (c, s, t) = (Arc::downgrade(&conn), Arc::downgrade(&session), inner.config.handshake_timeout);
        tokio::spawn(async move {
            tokio::time::sleep(t).await;
            if let (Some(c), Some(s)) = (c.upgrade(), s.upgrade())
                && !s.handshaken.load(Ordering::Acquire)
            {
                c.close(&format!("no handshake within {t:?}"));
            }
        });
    }
    // Runs until the peer goes or shutdown closes the connection; streams
    // opened during shutdown are refused by the dispatcher.
    loop {
        let inc: Incoming = match conn.accept().await {
            Ok(i) => i,
            Err(e) => {
                tracing::debug!(peer = %info.peer, reason = %e, "connection ended");
                break;
            }
        };
        tokio::spawn(dispatch::handle_stream(inner.clone(), session.clone(), inc));
    }
    inner.conns.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
}
