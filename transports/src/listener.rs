//! Listener plumbing shared by the byte-stream transports. The listener
//! owns its socket (dropping it closes the socket at once, so a restarted
//! server can bind the same address); each accepted socket's handshake runs
//! in its own task, so a slow or hostile client never delays the others.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::io::AsyncRead;
use tokio::sync::mpsc;

use crate::mux::{self, EstablishError, Role, SocketInfo};
use crate::{AcceptError, ConnectError, Connection, Endpoint, Listener, TransportConfig};

/// Connections (or handshake failures) ready for [`Listener::accept`].
pub(crate) type AcceptTx = mpsc::Sender<Result<Arc<dyn Connection>, AcceptError>>;

/// A bound socket that yields raw connections.
#[async_trait]
pub(crate) trait RawAccept: Send + 'static {
    /// Accepts one socket and starts its handshake in the background.
    async fn accept_and_handshake(&mut self, config: &TransportConfig, tx: &AcceptTx) -> std::io::Result<()>;
}

/// A listener: accepts sockets on demand, handshakes them in the background.
pub(crate) struct QueueListener {
    pub(crate) raw: Box<dyn RawAccept>,
    pub(crate) config: TransportConfig,
    pub(crate) tx: AcceptTx,
    pub(crate) rx: mpsc::Receiver<Result<Arc<dyn Connection>, AcceptError>>,
    pub(crate) local: Endpoint,
    /// Socket file removed when the listener is dropped.
    pub(crate) cleanup: Option<PathBuf>,
}

impl QueueListener {
    pub(crate) fn new(
        raw: Box<dyn RawAccept>,
        config: &TransportConfig,
        local: Endpoint,
        cleanup: Option<PathBuf>,
    ) -> Self {
        let (tx, rx) = mpsc::channel(64);
        Self { raw, config: config.clone(), tx, rx, local, cleanup }
    }
}

impl Drop for QueueListener {
    fn drop(&mut self) {
        if let Some(p) = &self.cleanup {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[async_trait]
impl Listener for QueueListener {
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError> {
        loop {
            tokio::select! {
                done = self.rx.recv() => return done.unwrap_or(Err(AcceptError::Closed)),
                r = self.raw.accept_and_handshake(&self.config, &self.tx) => {
                    match r {
                        Ok(()) => accepted(),
                        Err(e) => backoff(&e).await,
                    }
                }
            }
        }
    }

    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }
}

/// Runs the mux handshake for an accepted socket in its own task.
pub(crate) fn handshake_in_background<R, W>(rd: R, wr: W, info: SocketInfo, config: TransportConfig, tx: AcceptTx)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: mux::MuxWrite,
{
    tokio::spawn(async move {
        let peer = info.peer.clone();
        let r = match mux::establish(rd, wr, Role::Server, info, &config).await {
            Ok(c) => Ok(c as Arc<dyn Connection>),
            Err(e) => {
                tracing::info!(%peer, error = %e, "rejected connection");
                Err(AcceptError::Handshake { peer, reason: e.to_string() })
            }
        };
        let _ = tx.send(r).await;
    });
}

/// Consecutive accept failures (EMFILE, ENFILE, ENOMEM…) seen by any
/// listener, for the back-off and for logging without a flood.
static ACCEPT_FAILURES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Waits after an accept error such as EMFILE so the loop doesn't spin:
/// 5 ms doubling to 1 s while errors continue. Logs the first failure of a
/// run and then every 64th, not every one.
pub(crate) async fn backoff(e: &std::io::Error) {
    use std::sync::atomic::Ordering;
    let n = ACCEPT_FAILURES.fetch_add(1, Ordering::Relaxed);
    if n.is_multiple_of(64) {
        tracing::warn!(error = %e, failures = n + 1, "accept failed; backing off (is the open-file limit too low?)");
    }
    let delay = std::time::Duration::from_millis(5u64 << n.min(8)).min(std::time::Duration::from_secs(1));
    tokio::time::sleep(delay).await;
}

/// Ends a run of accept failures (called after a successful accept).
pub(crate) fn accepted() {
    ACCEPT_FAILURES.store(0, std::sync::atomic::Ordering::Relaxed);
}

/// Maps a failed client-side mux handshake to a [`ConnectError`].
pub(crate) fn establish_error(endpoint: &Endpoint, e: EstablishError) -> ConnectError {
    match e {
        EstablishError::Io(source) => ConnectError::Io { endpoint: endpoint.to_string(), source },
        EstablishError::Protocol(reason) => ConnectError::Protocol { endpoint: endpoint.to_string(), reason },
        EstablishError::Timeout(after) => ConnectError::Timeout { endpoint: endpoint.to_string(), after },
    }
}
