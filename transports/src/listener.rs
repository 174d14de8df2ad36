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
                    if let Err(e) = r {
                        backoff(&e).await;
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

/// Waits a little after accept errors such as EMFILE, so the loop doesn't spin.
pub(crate) async fn backoff(e: &std::io::Error) {
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

/// Maps a failed client-side mux handshake to a [`ConnectError`].
pub(crate) fn establish_error(endpoint: &Endpoint, e: EstablishError) -> ConnectError {
    match e {
        EstablishError::Io(source) => ConnectError::Io { endpoint: endpoint.to_string(), source },
        EstablishError::Protocol(reason) => ConnectError::Protocol { endpoint: endpoint.to_string(), reason },
        EstablishError::Timeout(after) => ConnectError::Timeout { endpoint: endpoint.to_string(), after },
    }
}
