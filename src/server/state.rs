//! What every connection and call of one server shares: the configuration,
//! the service and functions, tasks, statistics, the connections, and the
//! per-connection [`Session`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorwire_transports::{Connection, ConnectionInfo};
use tokio::sync::Notify;

use super::auth::Auth;
use super::service::TensorService;
use crate::config::{ServerConfig, VERSION};
use crate::observe::info::{FunctionStatistics, ServiceInfo};
use crate::observe::stats::ServerStats;
use crate::pipeline::budget::MemoryBudget;
use crate::pipeline::link::{LinkEstimator, SharedCaps};
use crate::pipeline::pool::RecvPool;
use crate::rpc::call::Cancellation;
use crate::rpc::function::Registry;
use crate::rpc::tasks::TaskManager;
use crate::util::host::devices;
use crate::util::sync::lock;

/// The state of one server.
pub(crate) struct ServerInner {
    pub(crate) config: ServerConfig,
    pub(crate) service: Arc<dyn TensorService>,
    pub(crate) functions: Registry,
    pub(crate) tasks: TaskManager,
    pub(crate) stats: ServerStats,
    pub(crate) started: Instant,
    pub(crate) serving: AtomicBool,
    pub(crate) shutdown: Cancellation,
    /// Every receive buffer is reserved from this first.
    pub(crate) budget: MemoryBudget,
    /// Large receive buffers come from here (reserved from `budget`).
    pub(crate) pool: RecvPool,
    /// The token check, with its limit on guessing.
    pub(crate) auth: Auth,
    pub(crate) idle: Notify,
    pub(crate) conns: Mutex<HashMap<u64, ConnEntry>>,
    pub(crate) next_conn: AtomicU64,
    pub(crate) transports: Mutex<Vec<String>>,
    /// The abstract Unix socket same-host `tcp://` clients are told to
    /// upgrade through (shared memory), when the server listens on TCP.
    pub(crate) shm_upgrade_url: Mutex<Option<String>>,
}

impl ServerInner {
    pub(crate) fn info(&self) -> ServiceInfo {
        let pool = self.pool.stats();
        use tensorwire_codecs::{Compression, available_codecs};
        ServiceInfo {
            service_name: self.config.service_name.clone(),
            version: VERSION.to_string(),
            transports: lock(&self.transports).clone(),
            codecs: available_codecs().iter().map(|c| c.name().to_string()).collect(),
            compressions: Compression::available().iter().map(|c| c.name().to_string()).collect(),
            devices: devices(),
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
            memory_limit: self.budget.limit(),
            memory_used: self.budget.used(),
            memory_refused: self.budget.refused(),
            recv_pool_hits: pool.hits,
            recv_pool_misses: pool.misses,
            recv_pool_idle_bytes: pool.idle_bytes,
            store: self.service.usage().unwrap_or_default(),
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

/// An open connection, as the server counts it for its caps.
pub(crate) struct ConnEntry {
    pub(crate) conn: Arc<dyn Connection>,
    pub(crate) session: Arc<Session>,
    /// The peer's IP (local sockets: "local"), for the per-peer cap.
    pub(crate) peer_key: String,
}

/// Per-connection state shared by its streams.
pub(crate) struct Session {
    pub(crate) info: ConnectionInfo,
    /// `info.peer`, shared by the calls' readers and contexts.
    pub(crate) peer: Arc<str>,
    pub(crate) handshaken: AtomicBool,
    pub(crate) caps: Mutex<SharedCaps>,
    pub(crate) link: Arc<LinkEstimator>,
    /// Streams being served now, and calls whose work runs on after their
    /// stream ended (a sync handler whose client went away): 0 when the
    /// connection is idle. See [`StreamSlot`].
    pub(crate) active: std::sync::atomic::AtomicU32,
    /// Of those, calls whose stream ended while their work runs on.
    pub(crate) orphaned: std::sync::atomic::AtomicU32,
    /// When the connection was accepted (the oldest idle one makes room first).
    pub(crate) since: Instant,
}

impl Session {
    pub(crate) fn caps(&self) -> SharedCaps {
        lock(&self.caps).clone()
    }
}

/// One stream's place on its connection (`Session::active`) and in the
/// server's active calls, from its accept until the call's work is gone:
/// a call's context holds it, so a sync handler that runs on after its
/// client went away keeps counting (and a connection cannot pile up such
/// work past `max_concurrent_streams`).
pub(crate) struct StreamSlot {
    session: Arc<Session>,
    _call: ActiveCall,
    /// Counted in `Session::orphaned` (its stream ended, its work not).
    orphaned: AtomicBool,
}

impl StreamSlot {
    pub(crate) fn new(inner: &Arc<ServerInner>, session: &Arc<Session>) -> Self {
        session.active.fetch_add(1, Ordering::AcqRel);
        Self { session: session.clone(), _call: inner.begin_call(), orphaned: AtomicBool::new(false) }
    }

    /// The stream ended while the call's work runs on.
    pub(crate) fn orphan(&self) {
        if !self.orphaned.swap(true, Ordering::AcqRel) {
            self.session.orphaned.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.session.active.fetch_sub(1, Ordering::AcqRel);
        if *self.orphaned.get_mut() {
            self.session.orphaned.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
