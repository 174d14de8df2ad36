//! `unix:///path`: the mux over a Unix stream socket. A path starting with
//! `@` names a Linux abstract socket (no file to clean up).

use std::path::Path;
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};

use crate::listener::establish_error;
use crate::listener::{AcceptTx, QueueListener, RawAccept, handshake_in_background};
use crate::mux::{self, Role, SocketInfo};
use crate::{ConnectError, Connection, Endpoint, ListenError, Listener, TransportConfig};

fn abstract_name(path: &Path) -> Option<&[u8]> {
    path.to_str()?.strip_prefix('@').map(str::as_bytes)
}

/// Opens a Unix socket connection to `path` (abstract when it starts with `@`).
pub(crate) async fn connect_socket(path: &Path) -> std::io::Result<UnixStream> {
    if let Some(name) = abstract_name(path) {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        let s = std::os::unix::net::UnixStream::connect_addr(&addr)?;
        s.set_nonblocking(true)?;
        return UnixStream::from_std(s);
    }
    UnixStream::connect(path).await
}

/// Binds a Unix listener at `path`, replacing a stale socket file left by a
/// dead server (but never a live one, nor a non-socket file).
pub(crate) fn bind_socket(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(name) = abstract_name(path) {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        let l = std::os::unix::net::UnixListener::bind_addr(&addr)?;
        l.set_nonblocking(true)?;
        return UnixListener::from_std(l);
    }
    match UnixListener::bind(path) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            use std::os::unix::fs::FileTypeExt;
            let is_socket = std::fs::symlink_metadata(path).map(|m| m.file_type().is_socket()).unwrap_or(false);
            let live = std::os::unix::net::UnixStream::connect(path).is_ok();
            if is_socket && !live {
                std::fs::remove_file(path)?;
                UnixListener::bind(path)
            } else {
                Err(e)
            }
        }
        other => other,
    }
}

/// Connects to `unix:///path`.
pub async fn connect(endpoint: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let s = connect_socket(endpoint.path())
        .await
        .map_err(|source| ConnectError::Io { endpoint: endpoint.to_string(), source })?;
    let (rd, wr) = s.into_split();
    let info = SocketInfo { peer: endpoint.to_string(), transport: "unix", local: true };
    let c = mux::establish(rd, wr, Role::Client, info, config).await.map_err(|e| establish_error(endpoint, e))?;
    Ok(c)
}

struct UnixAccept {
    listener: UnixListener,
    name: String,
    n: u64,
}

#[async_trait::async_trait]
impl RawAccept for UnixAccept {
    async fn accept_and_handshake(&mut self, config: &TransportConfig, tx: &AcceptTx) -> std::io::Result<()> {
        let (s, _) = self.listener.accept().await?;
        self.n += 1;
        let (rd, wr) = s.into_split();
        let info = SocketInfo { peer: format!("{}#{}", self.name, self.n), transport: "unix", local: true };
        handshake_in_background(rd, wr, info, config.clone(), tx.clone());
        Ok(())
    }
}

/// Listens on `unix:///path`; the socket file is removed when the listener is dropped.
pub async fn listen(endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    let path = endpoint.path().to_path_buf();
    let l = bind_socket(&path).map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?;
    let raw = UnixAccept { listener: l, name: endpoint.to_string(), n: 0 };
    let cleanup = abstract_name(&path).is_none().then_some(path);
    Ok(Box::new(QueueListener::new(Box::new(raw), config, endpoint.clone(), cleanup)))
}
