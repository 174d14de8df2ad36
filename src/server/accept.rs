//! Listening and accepting: the listener for each URL (gRPC listeners also
//! mount health, reflection and the skytorch compat service; `http://`
//! listeners serve JSON-RPC), the accept
//! loop, and the per-connection loop that hands each stream to the dispatcher.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Instant;

#[cfg(any(feature = "grpc", feature = "http"))]
use tensorwire_transports::Scheme;
use tensorwire_transports::{AcceptError, Connection, Endpoint, Incoming, ListenError, Listener};

use super::auth::peer_key;
use super::dispatch;
use super::state::{ConnEntry, ServerInner, Session, StreamSlot};
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

/// Admits a new connection within `max_connections` and
/// `max_connections_per_peer`: when a cap is reached, the oldest idle
/// connection (handshaken, no stream open) of the same scope is closed to
/// make room; when none is idle, the new one is refused with the reason.
fn admit(inner: &ServerInner, conns: &mut HashMap<u64, ConnEntry>, key: &str) -> Result<(), String> {
    let cfg = &inner.config;
    // A stateless connection (a gRPC listener's one, carrying every gRPC
    // client's calls) is neither counted nor evicted here: closing it
    // would stop the gRPC server for good, and its listener caps its own
    // HTTP/2 connections.
    let counted = || conns.values().filter(|c| !c.session.info.stateless);
    let total = counted().count();
    let per_peer = counted().filter(|c| c.peer_key == key).count();
    let scope = if per_peer >= cfg.max_connections_per_peer {
        Some(true)
    } else if total >= cfg.max_connections {
        Some(false)
    } else {
        None
    };
    let Some(same_peer) = scope else { return Ok(()) };
    let idle = conns
        .iter()
        .filter(|(_, c)| !c.session.info.stateless)
        .filter(|(_, c)| (!same_peer || c.peer_key == key) && c.session.active.load(Ordering::Acquire) == 0)
        .filter(|(_, c)| c.session.handshaken.load(Ordering::Acquire))
        .min_by_key(|(_, c)| c.session.since)
        .map(|(id, _)| *id);
    match idle {
        Some(id) => {
            if let Some(old) = conns.remove(&id) {
                tracing::info!(peer = %old.session.info.peer, "closing an idle connection to make room for a new one");
                old.conn.close("closed to make room for a new connection (this one was idle)");
            }
            Ok(())
        }
        None if same_peer => Err(format!(
            "too many connections from {key}: {per_peer} open, the server allows {} per peer",
            cfg.max_connections_per_peer
        )),
        None => Err(format!("too many connections: {total} open, the server allows {}", cfg.max_connections)),
    }
}

async fn serve_connection(inner: Arc<ServerInner>, conn: Arc<dyn Connection>) {
    let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
    let info = conn.info();
    let session = Arc::new(Session {
        peer: Arc::from(info.peer.as_str()),
        info: info.clone(),
        handshaken: AtomicBool::new(info.stateless),
        caps: Mutex::new(SharedCaps::default()),
        link: Arc::new(LinkEstimator::default()),
        active: AtomicU32::new(0),
        orphaned: AtomicU32::new(0),
        since: Instant::now(),
    });
    {
        let key = peer_key(&info.peer);
        let mut conns = lock(&inner.conns);
        let admitted = if info.stateless { Ok(()) } else { admit(&inner, &mut conns, &key) };
        if let Err(reason) = admitted {
            drop(conns);
            tracing::warn!(peer = %info.peer, %reason, "connection refused");
            conn.close(&reason);
            return;
        }
        conns.insert(id, ConnEntry { conn: conn.clone(), session: session.clone(), peer_key: key });
    }
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
        let slot = StreamSlot::new(&inner, &session);
        // Boxed where it is made: the call's future (kilobytes) is then
        // copied once, not again into the spawned task.
        tokio::spawn(Box::pin(dispatch::handle_stream(inner.clone(), session.clone(), inc, slot)));
    }
    lock(&inner.conns).remove(&id);
}
