//! `tcp://host:port`: the mux over a TCP socket with TCP_NODELAY, larger
//! socket buffers and TCP keep-alive. `?congestion=NAME` (Linux) picks the
//! socket's congestion controller (`cubic`, `bbr`, `reno`: any the kernel
//! has; a listener's applies to the sockets it accepts) instead of the
//! system default.

use std::sync::Arc;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::{TcpListener, TcpStream};

use crate::listener::{AcceptTx, QueueListener, RawAccept, establish_error, handshake_in_background};
use crate::mux::{self, Role, SocketInfo};
use crate::{ConnectError, Connection, Endpoint, ListenError, Listener, TransportConfig};

/// Applies `?congestion=` of `endpoint` to the socket.
fn congestion(s: &TcpStream, endpoint: &Endpoint) -> std::io::Result<()> {
    let Some(cc) = endpoint.query("congestion") else { return Ok(()) };
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        SockRef::from(s).set_tcp_congestion(cc.as_bytes()).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "TCP congestion controller {cc:?}: {e} (see /proc/sys/net/ipv4/tcp_available_congestion_control)"
                ),
            )
        })
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = s;
        Err(std::io::Error::other(format!("?congestion={cc} needs Linux")))
    }
}

/// TCP_NODELAY, socket buffers and keep-alive as `config` says (also for `tcps://`).
pub(crate) fn tune(s: &TcpStream, config: &TransportConfig) {
    let _ = s.set_nodelay(true);
    let sock = SockRef::from(s);
    if let Some(n) = config.socket_buffer {
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
    if let Some(iv) = config.keepalive_interval {
        let _ = sock.set_tcp_keepalive(&TcpKeepalive::new().with_time(iv).with_interval(iv));
    }
}

/// Connects to `tcp://host:port`.
pub async fn connect(endpoint: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let s = TcpStream::connect(endpoint.authority())
        .await
        .map_err(|source| ConnectError::Io { endpoint: endpoint.to_string(), source })?;
    tune(&s, config);
    congestion(&s, endpoint).map_err(|source| ConnectError::Io { endpoint: endpoint.to_string(), source })?;
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| endpoint.authority());
    let local = s.peer_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
    let (rd, wr) = s.into_split();
    let c = mux::establish(rd, wr, Role::Client, SocketInfo { peer, transport: "tcp", local }, config)
        .await
        .map_err(|e| establish_error(endpoint, e))?;
    Ok(c)
}

struct TcpAccept(TcpListener, Endpoint);

#[async_trait::async_trait]
impl RawAccept for TcpAccept {
    async fn accept_and_handshake(&mut self, config: &TransportConfig, tx: &AcceptTx) -> std::io::Result<()> {
        let (s, addr) = self.0.accept().await?;
        tune(&s, config);
        if let Err(e) = congestion(&s, &self.1) {
            tracing::warn!(peer = %addr, "{e}");
        }
        let (rd, wr) = s.into_split();
        let info = SocketInfo { peer: addr.to_string(), transport: "tcp", local: addr.ip().is_loopback() };
        handshake_in_background(rd, wr, info, config.clone(), tx.clone());
        Ok(())
    }
}

/// Listens on `tcp://host:port` (port 0 picks a free port).
pub async fn listen(endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    let l = TcpListener::bind(endpoint.authority())
        .await
        .map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?;
    let port = l.local_addr().map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?.port();
    let accept = TcpAccept(l, endpoint.clone());
    Ok(Box::new(QueueListener::new(Box::new(accept), config, endpoint.with_port(port), None)))
}
