//! Listener plumbing shared by the byte-stream transports: an accept loop
//! task that hands each new socket to its own handshake task, so a slow or
//! hostile client never delays the others.

use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::io::AsyncRead;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::mux::{self, EstablishError, Role, SocketInfo};
use crate::{AcceptError, ConnectError, Connection, Endpoint, Listener, TransportConfig};

/// Connections (or handshake failures) ready for [`Listener::accept`].
pub(crate) type AcceptTx = mpsc::Sender<Result<Arc<dyn Connection>, AcceptError>>;

/// A listener fed by a background accept loop.
pub(crate) struct QueueListener {
    pub(crate) rx: mpsc::Receiver<Result<Arc<dyn Connection>, AcceptError>>,
    pub(crate) local: Endpoint,
    pub(crate) task: JoinHandle<()>,
    /// Socket file removed when the listener is dropped.
    pub(crate) cleanup: Option<PathBuf>,
}

impl Drop for QueueListener {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(p) = &self.cleanup {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[async_trait]
impl Listener for QueueListener {
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError> {
        self.rx.recv().await.unwrap_or(Err(AcceptError::Closed))
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
