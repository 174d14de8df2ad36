//! [`RunningServer`]: a serving server, its listeners' tasks, graceful
//! shutdown and abort.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tensorwire_transports::Endpoint;
use tokio::task::JoinHandle;

use super::state::ServerInner;
use crate::observe::info::ServiceInfo;
use crate::util::sync::lock;

/// A serving server.
pub struct RunningServer {
    inner: Arc<ServerInner>,
    endpoints: Vec<Endpoint>,
    tasks: Vec<JoinHandle<()>>,
    /// Listeners whose address outlives them (QUIC) free it with these.
    releases: Vec<futures_util::future::BoxFuture<'static, ()>>,
}

impl RunningServer {
    pub(crate) fn new(
        inner: Arc<ServerInner>,
        endpoints: Vec<Endpoint>,
        tasks: Vec<JoinHandle<()>>,
        releases: Vec<futures_util::future::BoxFuture<'static, ()>>,
    ) -> Self {
        Self { inner, endpoints, tasks, releases }
    }

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
    /// every connection (calls still running then are cancelled as if their
    /// clients went away: see [`CallContext::is_cancelled`](crate::CallContext::is_cancelled)).
    pub async fn shutdown(mut self) {
        self.stop_accepting().await;
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
        self.stop_accepting().await;
        self.close_all();
        self.release().await;
    }

    /// Reports NOT_SERVING, refuses new calls, and stops accepting: waits
    /// until the listeners are closed, so the addresses are free again.
    async fn stop_accepting(&mut self) {
        self.begin_shutdown_without_waiting();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }

    async fn release(&mut self) {
        for r in self.releases.drain(..) {
            if tokio::time::timeout(Duration::from_secs(5), r).await.is_err() {
                tracing::warn!("a listener's address was not released within 5 s");
            }
        }
    }

    /// Reports NOT_SERVING, refuses new calls, aborts the accept tasks.
    fn begin_shutdown_without_waiting(&mut self) {
        self.inner.serving.store(false, Ordering::Release);
        self.inner.shutdown.cancel();
        for t in &self.tasks {
            t.abort();
        }
    }

    fn close_all(&self) {
        let conns: Vec<_> = lock(&self.inner.conns).drain().map(|(_, c)| c.conn).collect();
        for c in conns {
            c.close("server shutting down");
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if !self.tasks.is_empty() {
            self.begin_shutdown_without_waiting();
            self.tasks.clear();
            self.close_all();
        }
    }
}
