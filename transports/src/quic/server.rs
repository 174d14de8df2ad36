//! The server side: listening on `quic://host:port`, admitting connections
//! and stripes.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use quinn::VarInt;
use tokio::sync::mpsc;

use super::group::{self, Group, GroupIndex, STRIPE_ALPN};
use super::settings::{ALPN, endpoint_config, resolve, runtime, transport_config, udp_socket};
use super::stream::QuicConnection;
use crate::{AcceptError, Connection, Endpoint, ListenError, Listener, TransportConfig, tls};

/// Listens on `quic://host:port`. Without a certificate a self-signed one is
/// generated; its fingerprint is logged and added to the listener's URL.
pub async fn listen(ep: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    let name = ep.to_string();
    let cfg_err = |reason: String| ListenError::Config { endpoint: name.clone(), reason };
    let id = tls::server_identity(&config.tls, &[ep.host().to_string()]).map_err(cfg_err)?;
    let rustls_cfg = tls::server_config(&config.tls, &id, &[ALPN, STRIPE_ALPN]).map_err(cfg_err)?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(rustls_cfg).map_err(|e| cfg_err(e.to_string()))?;
    let mut server_cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server_cfg.transport_config(Arc::new(transport_config(config)));
    let io = |source| ListenError::Io { endpoint: name.clone(), source };
    let addr = resolve(ep).map_err(io)?;
    let socket = udp_socket(addr, &config.quic).map_err(io)?;
    let endpoint =
        quinn::Endpoint::new(endpoint_config(config), Some(server_cfg), socket, runtime().map_err(io)?).map_err(io)?;
    let port = endpoint.local_addr().map_err(io)?.port();
    let mut local = ep.with_port(port);
    if id.generated {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "self-signed certificate (clients pin it with --pin-sha256)");
        local = Endpoint::parse(&format!("{}?pin-sha256={}", local, id.fingerprint)).unwrap_or(local);
    } else {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "serving certificate");
    }
    let (tx, rx) = mpsc::channel(64);
    Ok(Box::new(QuicListener {
        endpoint,
        local,
        config: config.clone(),
        tx,
        rx,
        groups: Arc::new(GroupIndex::default()),
    }))
}

struct QuicListener {
    endpoint: quinn::Endpoint,
    local: Endpoint,
    config: TransportConfig,
    tx: mpsc::Sender<Result<Arc<dyn Connection>, AcceptError>>,
    rx: mpsc::Receiver<Result<Arc<dyn Connection>, AcceptError>>,
    groups: Arc<GroupIndex>,
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        // Stops accepting at once; established connections are closed by their owners.
        self.endpoint.set_server_config(None);
    }
}

fn alpn_of(conn: &quinn::Connection) -> Option<Vec<u8>> {
    conn.handshake_data()?.downcast::<quinn::crypto::rustls::HandshakeData>().ok()?.protocol
}

/// Finishes accepting one connection: the TLS handshake, then either a new
/// connection for the application or a stripe joining its group.
async fn admit(
    incoming: quinn::Incoming,
    config: TransportConfig,
    groups: Arc<GroupIndex>,
) -> Option<Result<Arc<dyn Connection>, AcceptError>> {
    let peer = incoming.remote_address().to_string();
    let conn = match incoming.await {
        Ok(c) => c,
        Err(e) => {
            tracing::info!(%peer, error = %e, "rejected QUIC connection");
            return Some(Err(AcceptError::Handshake { peer, reason: e.to_string() }));
        }
    };
    if alpn_of(&conn).as_deref() == Some(STRIPE_ALPN) {
        tokio::spawn(group::serve_stripe_join(conn, groups));
        return None;
    }
    let group = Group::new(conn.clone());
    tokio::spawn(group::serve_primary_control(conn.clone(), Arc::downgrade(&group), groups));
    Some(Ok(Arc::new(QuicConnection::new(conn, group, Vec::new(), &config)) as Arc<dyn Connection>))
}

#[async_trait]
impl Listener for QuicListener {
    async fn accept(&mut self) -> Result<Arc<dyn Connection>, AcceptError> {
        loop {
            tokio::select! {
                done = self.rx.recv() => return done.unwrap_or(Err(AcceptError::Closed)),
                incoming = self.endpoint.accept() => {
                    let Some(incoming) = incoming else { return Err(AcceptError::Closed) };
                    // The TLS handshake runs on its own, so a slow client delays no one.
                    let (tx, config, groups) = (self.tx.clone(), self.config.clone(), self.groups.clone());
                    tokio::spawn(async move {
                        if let Some(r) = admit(incoming, config, groups).await {
                            let _ = tx.send(r).await;
                        }
                    });
                }
            }
        }
    }

    fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }

    fn release(&self) -> Option<futures_util::future::BoxFuture<'static, ()>> {
        let endpoint = self.endpoint.clone();
        Some(Box::pin(async move {
            endpoint.set_server_config(None);
            endpoint.close(VarInt::from_u32(0), b"server shutting down");
            endpoint.wait_idle().await;
            let addr = endpoint.local_addr().ok();
            // The endpoint's task drops the socket once the last handle is gone.
            drop(endpoint);
            if let Some(addr) = addr {
                for _ in 0..200 {
                    if std::net::UdpSocket::bind(addr).is_ok() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tracing::warn!(%addr, "the QUIC socket is still bound after its connections closed");
            }
        }))
    }
}
