//! Listening and accepting: the listener for each URL (gRPC listeners also
//! mount health, reflection and the skytorch compat service; `http://`
//! listeners serve JSON-RPC), the accept
//! loop, and the per-connection loop that hands each stream to the dispatcher.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

#[cfg(any(feature = "grpc", feature = "http"))]
use tensorwire_transports::Scheme;
use tensorwire_transports::{AcceptError, Connection, Endpoint, Incoming, ListenError, Listener};

use super::dispatch;
use super::state::{ServerInner, Session};
use crate::pipeline::link::{LinkEstimator, SharedCaps};
use crate::util::sync::lock;

/// Listens on `endpoint` with the transport added for its scheme, or else
/// the built-in one; built-in gRPC listeners also serve health, reflection
/// and the skytorch compat service.
pub(crate) async fn listen(endpoint: &Endpoint, inner: &Arc<ServerInner>) -> Result<Box<dyn Listener>, ListenError> {
    if let Some(t) = inner.config.transports.added_for(endpoint.scheme()) {
        return t.listen(endpoint, &inner.config.transport).await;
    }
    #[cfg(feature = "grpc")]
    if matches!(endpoint.scheme(), Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix) {
        return crate::grpc::service::listen(endpoint, inner).await;
    }
    #[cfg(feature = "http")]
    if endpoint.scheme() == Scheme::Http {
        return crate::jsonrpc::listen(endpoint, inner).await;
    }
    tensorwire_transports::listen(endpoint, &inner.config.transport).await
}

pub(crate) async fn accept_loop(inner: Arc<ServerInner>, mut listener: Box<dyn Listener>) {
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

async fn serve_connection(inner: Arc<ServerInner>, conn: Arc<dyn Connection>) {
    let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
    lock(&inner.conns).insert(id, conn.clone());
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
    lock(&inner.conns).remove(&id);
}
