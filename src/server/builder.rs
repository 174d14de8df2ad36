//! The server's face: a [`ServerBuilder`] collects a [`TensorService`] and
//! named [`Function`]s; [`Server::start`] listens on URLs and returns a
//! [`RunningServer`] that serves until [`RunningServer::shutdown`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tensorwire_codecs::Tensor;
#[cfg(feature = "shm")]
use tensorwire_transports::Scheme;
use tensorwire_transports::{Endpoint, ListenError, Transport};

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::accept::{accept_loop, listen};
use super::auth::Auth;
use super::running::RunningServer;
use super::service::{EchoService, TensorService};
use super::state::ServerInner;
use crate::config::ServerConfig;
use crate::error::Status;
use crate::observe::stats::ServerStats;
use crate::pipeline::budget::MemoryBudget;
use crate::pipeline::pool::{PoolConfig, RecvPool};
use crate::rpc::call::{Cancellation, Output};
use crate::rpc::function::{Function, Registry};
use crate::rpc::tasks::{TaskConfig, TaskManager};
use crate::util::sync::lock;

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

    /// Adds a transport of your own: listen URLs of the schemes it names
    /// use it instead of the built-in transport (see [`crate::transport`]).
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.config.transports = std::mem::take(&mut self.config.transports).with(transport);
        self
    }

    /// Task retention settings.
    pub fn tasks(mut self, tasks: TaskConfig) -> Self {
        self.tasks = tasks;
        self
    }

    /// The server, ready to start.
    pub fn build(self) -> Server {
        let budget = MemoryBudget::new(self.config.max_memory_bytes);
        let service = self.service.clone();
        budget.add_reclaimer(Arc::new(move |wanted| service.reclaim(wanted)));
        let pool =
            RecvPool::new(budget.clone(), PoolConfig::sized(self.config.recv_pool_bytes, self.config.max_memory_bytes));
        Server {
            inner: Arc::new(ServerInner {
                tasks: TaskManager::new(self.tasks, budget.clone()),
                budget,
                pool,
                auth: Auth::new(self.config.auth_token.clone(), self.config.max_auth_failures),
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
                shm_upgrade_url: Mutex::new(None),
            }),
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
            listeners.push(listen(&ep, &self.inner).await?);
        }
        if listeners.is_empty() {
            return Err(ServeError::NoListeners);
        }
        let endpoints: Vec<Endpoint> = listeners.iter().map(|l| l.local_endpoint()).collect();
        {
            let mut t = lock(&self.inner.transports);
            for e in &endpoints {
                let s = e.scheme().as_str().to_string();
                if !t.contains(&s) {
                    t.push(s);
                }
            }
        }
        // Same-host tcp:// clients may reconnect here and use shared memory.
        #[cfg(feature = "shm")]
        if self.inner.config.transport.shm.unix_upgrade
            && endpoints.iter().any(|e| e.scheme() == Scheme::Tcp && e.query("shm") != Some("0"))
        {
            static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let url = format!("unix://@tensorwire-upgrade-{}-{n}", std::process::id());
            let ep = Endpoint::parse(&url).map_err(ListenError::from)?;
            match listen(&ep, &self.inner).await {
                Ok(l) => {
                    *lock(&self.inner.shm_upgrade_url) = Some(url);
                    listeners.push(l);
                }
                Err(e) => tracing::debug!(error = %e, "no shared-memory upgrade for tcp:// clients"),
            }
        }
        let releases = listeners.iter().filter_map(|l| l.release()).collect();
        let mut tasks: Vec<JoinHandle<()>> =
            listeners.into_iter().map(|l| tokio::spawn(accept_loop(self.inner.clone(), l))).collect();
        // Expired task results are dropped even when nobody asks about them,
        // and receive buffers idle too long leave the pool (it shrinks when idle).
        let weak = Arc::downgrade(&self.inner);
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(crate::config::TASK_SWEEP_INTERVAL).await;
                match weak.upgrade() {
                    Some(inner) => {
                        inner.tasks.sweep();
                        inner.pool.trim();
                    }
                    None => return,
                }
            }
        }));
        for e in &endpoints {
            tracing::info!(endpoint = %e, "listening");
        }
        Ok(RunningServer::new(self.inner, endpoints, tasks, releases))
    }
}
