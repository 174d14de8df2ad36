//! The client side: dialing `quic://host:port` and joining stripes.

use std::net::SocketAddr;
use std::sync::Arc;

use super::errors::handshake_error;
use super::group::{self, Group, MAX_STRIPES, STRIPE_ALPN};
use super::settings::{ALPN, endpoint_config, resolve, runtime, transport_config, udp_socket};
use super::stream::QuicConnection;
use crate::{ConnectError, Endpoint, TransportConfig, tls};

/// `config` with the URL's `?stripes=` and `?congestion=` applied.
fn url_overrides(config: &TransportConfig, ep: &Endpoint) -> Result<TransportConfig, String> {
    let mut c = config.clone();
    if let Some(n) = ep.query("stripes") {
        c.quic.stripes = n
            .parse()
            .ok()
            .filter(|n| (1..=MAX_STRIPES).contains(n))
            .ok_or_else(|| format!("stripes={n:?}: expected a number of connections from 1 to {MAX_STRIPES}"))?;
    }
    if let Some(cc) = ep.query("congestion") {
        c.quic.congestion = cc.parse()?;
    }
    Ok(c)
}

/// A client endpoint on its own UDP socket, connected to `addr`.
async fn dial(
    name: &str,
    addr: SocketAddr,
    server_name: &str,
    rustls_cfg: rustls::ClientConfig,
    config: &TransportConfig,
) -> Result<(quinn::Endpoint, quinn::Connection), ConnectError> {
    let io = |source| ConnectError::Io { endpoint: name.to_string(), source };
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls_cfg)
        .map_err(|e| ConnectError::Config { endpoint: name.to_string(), reason: e.to_string() })?;
    let mut client_cfg = quinn::ClientConfig::new(Arc::new(crypto));
    client_cfg.transport_config(Arc::new(transport_config(config)));
    let local: SocketAddr =
        if addr.is_ipv6() { "[::]:0".parse().expect("addr") } else { "0.0.0.0:0".parse().expect("addr") };
    let socket = udp_socket(local, &config.quic).map_err(io)?;
    let endpoint = quinn::Endpoint::new(endpoint_config(config), None, socket, runtime().map_err(io)?).map_err(io)?;
    let connecting = endpoint
        .connect_with(client_cfg, addr, server_name)
        .map_err(|e| ConnectError::Config { endpoint: name.to_string(), reason: e.to_string() })?;
    let conn = connecting.await.map_err(|e| handshake_error(name, e, config.quic.idle_timeout))?;
    Ok((endpoint, conn))
}

async fn send_control(conn: &quinn::Connection, msg: Vec<u8>) -> Result<(), String> {
    let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
    s.write_all(&msg).await.map_err(|e| e.to_string())?;
    s.finish().map_err(|e| e.to_string())
}

/// Connects to `quic://host:port`; with [`QuicConfig::stripes`](crate::config::QuicConfig::stripes) > 1, also
/// opens and joins the stripe connections (see [`group`](super::group)).
///
/// The URL may override settings: `?stripes=N`, `?congestion=bbr`, and the
/// TLS ones (`?pin-sha256=HEX`, `?ca=PATH`, `?server-name=NAME`).
pub async fn connect(ep: &Endpoint, config: &TransportConfig) -> Result<Arc<QuicConnection>, ConnectError> {
    let name = ep.to_string();
    let cfg_err = |reason: String| ConnectError::Config { endpoint: name.clone(), reason };
    let config = &url_overrides(config, ep).map_err(cfg_err)?;
    let tls_cfg = tls::client_tls_for(&config.tls, ep);
    let rustls_cfg = tls::client_config(&tls_cfg, &[ALPN]).map_err(cfg_err)?;
    let server_name = tls::server_name(&tls_cfg, ep).map_err(cfg_err)?.to_str().into_owned();
    let addr = resolve(ep).map_err(|source| ConnectError::Io { endpoint: name.clone(), source })?;
    let (endpoint, conn) = dial(&name, addr, &server_name, rustls_cfg.clone(), config).await?;
    let group = Group::new(conn.clone());
    let mut endpoints = vec![endpoint];
    let stripes = config.quic.stripes.clamp(1, MAX_STRIPES);
    if stripes > 1 {
        let token = group::new_token();
        let announce = send_control(&conn, group::group_message(&token, stripes as u8));
        announce.await.map_err(|r| ConnectError::Protocol { endpoint: name.clone(), reason: r })?;
        group.expect(token, stripes as u8).map_err(cfg_err)?;
        let mut stripe_tls = rustls_cfg;
        stripe_tls.alpn_protocols = vec![STRIPE_ALPN.to_vec()];
        for i in 1..stripes as u8 {
            // A stripe that cannot join costs speed, not the connection.
            let joined = async {
                let (e, c) =
                    dial(&name, addr, &server_name, stripe_tls.clone(), config).await.map_err(|e| e.to_string())?;
                send_control(&c, group::join_message(&token, i)).await?;
                group.attach(&token, i, c.clone())?;
                Ok::<_, String>((e, c))
            };
            match joined.await {
                Ok((e, c)) => {
                    endpoints.push(e);
                    tokio::spawn(group::serve_stripe_streams(c, Arc::downgrade(&group), i));
                }
                Err(reason) => tracing::warn!(endpoint = %name, stripe = i, %reason, "QUIC stripe not joined"),
            }
        }
    }
    // The client accepts no control streams: anything the server opens
    // unidirectionally on the primary is refused.
    Ok(Arc::new(QuicConnection::new(conn, group, endpoints, config)))
}
