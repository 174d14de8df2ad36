//! `tcps://host:port`: the mux over TLS over TCP (rustls with ring, the
//! same certificate options as `quic://` and `grpcs://`).
//!
//! The server presents a certificate from PEM files, or a self-signed one
//! whose SHA-256 fingerprint it logs and puts in its URL
//! (`tcps://host:port?pin-sha256=HEX`); clients verify it by that pin, a CA
//! file (`?ca=PATH` / [`TlsConfig::ca_path`](crate::config::TlsConfig)) or the
//! system roots, and may present a client certificate (mutual TLS when the
//! server sets `require_client_cert`). The TLS handshake must finish within
//! [`TransportConfig::connect_timeout`], on both sides, like the mux preface.
//!
//! Everything the mux sends (headers, the auth token, tensor bytes) is
//! encrypted and authenticated; TCP settings are those of `tcp://`.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::listener::{AcceptTx, QueueListener, RawAccept, establish_error, handshake_in_background};
use crate::mux::{self, QueuedWrite, Role, SocketInfo};
use crate::tcp::tune;
use crate::{ConnectError, Connection, Endpoint, ListenError, Listener, TransportConfig, tls};

/// The ALPN protocol id both ends must agree on.
pub const ALPN: &[u8] = b"tensorwire-mux";

/// Connects to `tcps://host:port` (URL options `?pin-sha256=HEX`,
/// `?ca=PATH`, `?server-name=NAME` on top of `config.tls`).
pub async fn connect(endpoint: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let tls_cfg = tls::client_tls_for(&config.tls, endpoint);
    let cfg_err = |reason: String| ConnectError::Config { endpoint: endpoint.to_string(), reason };
    let rustls_cfg = tls::client_config(&tls_cfg, &[ALPN]).map_err(cfg_err)?;
    let name = tls::server_name(&tls_cfg, endpoint).map_err(cfg_err)?;
    let s = TcpStream::connect(endpoint.authority())
        .await
        .map_err(|source| ConnectError::Io { endpoint: endpoint.to_string(), source })?;
    tune(&s, config);
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| endpoint.authority());
    let local = s.peer_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
    let connector = TlsConnector::from(Arc::new(rustls_cfg));
    // Bounded by `connect_timeout` with the rest of the connect (crate::connect).
    let stream = connector.connect(name, s).await.map_err(|e| {
        let reason = e.to_string();
        ConnectError::Tls { endpoint: endpoint.to_string(), reason: format!("{reason}{}", tls::hint(&reason)) }
    })?;
    if stream.get_ref().1.alpn_protocol() != Some(ALPN) {
        return Err(ConnectError::Protocol {
            endpoint: endpoint.to_string(),
            reason:
                "the server did not agree to the tensorwire protocol (ALPN tensorwire-mux): is it a tcps:// listener?"
                    .into(),
        });
    }
    let (rd, wr) = tokio::io::split(stream);
    let info = SocketInfo { peer, transport: "tcps", local };
    let c = mux::establish(rd, QueuedWrite(wr), Role::Client, info, config)
        .await
        .map_err(|e| establish_error(endpoint, e))?;
    Ok(c)
}

struct TlsAccept {
    listener: TcpListener,
    acceptor: TlsAcceptor,
}

#[async_trait::async_trait]
impl RawAccept for TlsAccept {
    async fn accept_and_handshake(&mut self, config: &TransportConfig, tx: &AcceptTx) -> std::io::Result<()> {
        let (s, addr) = self.listener.accept().await?;
        tune(&s, config);
        let acceptor = self.acceptor.clone();
        let (config, tx) = (config.clone(), tx.clone());
        // The TLS handshake runs beside the accept loop, bounded like the
        // mux preface: a peer that connects and says nothing is dropped.
        tokio::spawn(async move {
            let peer = addr.to_string();
            let stream = match tokio::time::timeout(config.connect_timeout, acceptor.accept(s)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::info!(%peer, error = %e, "rejected connection: TLS handshake failed");
                    let reason = format!("TLS handshake failed: {e}");
                    let _ = tx.send(Err(crate::AcceptError::Handshake { peer, reason })).await;
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, after = ?config.connect_timeout, "rejected connection: no TLS handshake in time");
                    let reason = format!("no TLS handshake within {:?}", config.connect_timeout);
                    let _ = tx.send(Err(crate::AcceptError::Handshake { peer, reason })).await;
                    return;
                }
            };
            let (rd, wr) = tokio::io::split(stream);
            let info = SocketInfo { peer, transport: "tcps", local: addr.ip().is_loopback() };
            handshake_in_background(rd, QueuedWrite(wr), info, config, tx);
        });
        Ok(())
    }
}

/// Listens on `tcps://host:port` (port 0 picks a free port) with the
/// certificate of `config.tls`, or a self-signed one whose pin is added to
/// the listener's URL.
pub async fn listen(endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    let cfg_err = |reason: String| ListenError::Config { endpoint: endpoint.to_string(), reason };
    let id = tls::server_identity(&config.tls, &[endpoint.host().to_string()]).map_err(cfg_err)?;
    let rustls_cfg = tls::server_config(&config.tls, &id, &[ALPN]).map_err(cfg_err)?;
    let l = TcpListener::bind(endpoint.authority())
        .await
        .map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?;
    let port = l.local_addr().map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?.port();
    let mut local = endpoint.with_port(port);
    if id.generated {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "self-signed certificate (clients pin it with --pin-sha256)");
        local = Endpoint::parse(&format!("{}?pin-sha256={}", local, id.fingerprint)).unwrap_or(local);
    } else {
        tracing::info!(endpoint = %local, fingerprint = %id.fingerprint, "serving certificate");
    }
    let accept = TlsAccept { listener: l, acceptor: TlsAcceptor::from(Arc::new(rustls_cfg)) };
    Ok(Box::new(QueueListener::new(Box::new(accept), config, local, None)))
}
