//! `unix:///path`: the mux over a Unix stream socket. A path starting with
//! `@` names a Linux abstract socket (no file to clean up).

use std::path::Path;
use std::sync::Arc;

use tokio::net::{UnixListener, UnixStream};

#[cfg(feature = "shm")]
use crate::AcceptError;
use crate::listener::establish_error;
#[cfg(not(feature = "shm"))]
use crate::listener::handshake_in_background;
use crate::listener::{AcceptTx, QueueListener, RawAccept};
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

/// True when a client connecting to `endpoint` offers shared memory.
fn wants_shm(endpoint: &Endpoint, config: &TransportConfig) -> bool {
    match endpoint.scheme() {
        crate::Scheme::Shm => true,
        _ => cfg!(feature = "shm") && config.shm.unix_upgrade && endpoint.query("shm") != Some("0"),
    }
}

/// The socket path of `unix:///path` or `shm://name`.
fn socket_path(endpoint: &Endpoint) -> std::path::PathBuf {
    match endpoint.scheme() {
        #[cfg(feature = "shm")]
        crate::Scheme::Shm => crate::shm::socket_path(endpoint.name()),
        _ => endpoint.path().to_path_buf(),
    }
}

/// Connects to `unix:///path` (offering shared memory for large tensors
/// unless [`ShmConfig::unix_upgrade`](crate::config::ShmConfig) is off or
/// the URL says `?shm=0`), or to `shm://name`.
pub async fn connect(endpoint: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    let io = |source| ConnectError::Io { endpoint: endpoint.to_string(), source };
    let s = connect_socket(&socket_path(endpoint)).await.map_err(io)?;
    let info = SocketInfo { peer: endpoint.to_string(), transport: "unix", local: true };
    #[cfg(feature = "shm")]
    if wants_shm(endpoint, config) {
        let ring_bytes = if endpoint.query("ring") == Some("0") { 0 } else { config.shm.ring_bytes };
        let offer = crate::shm::offer(&s, ring_bytes).await.map_err(io)?;
        let (side, hook) = crate::shm::side_channel(offer.side, &config.shm).map_err(io)?;
        let (c, busy) = match offer.ring {
            Some(parts) => {
                let (rd, wr) =
                    crate::shm::ring_halves(crate::shm::ring::End::Client, parts, s, config.spin).map_err(io)?;
                let busy = wr.busy();
                (mux::establish_with(rd, wr, Role::Client, info, config, Some(hook)).await, Some(busy))
            }
            None => {
                let (rd, wr) = s.into_split();
                (mux::establish_with(rd, wr, Role::Client, info, config, Some(hook)).await, None)
            }
        };
        let c = c.map_err(|e| establish_error(endpoint, e))?;
        let name = if endpoint.scheme() == crate::Scheme::Shm { "shm" } else { "unix+shm" };
        return Ok(crate::shm::wrap(c, side, &config.shm, name, busy));
    }
    #[cfg(not(feature = "shm"))]
    let _ = wants_shm(endpoint, config);
    let (rd, wr) = s.into_split();
    let c: Arc<dyn Connection> =
        mux::establish(rd, wr, Role::Client, info, config).await.map_err(|e| establish_error(endpoint, e))?;
    Ok(c)
}

/// Who may connect to a socket: the file mode of a path socket, and the
/// user ids allowed on an abstract socket (which has no file mode).
#[derive(Clone, Debug)]
struct Access {
    /// None: any user.
    uids: Option<Vec<u32>>,
}

/// Default mode of a path socket: the owner only.
const DEFAULT_SOCKET_MODE: u32 = 0o600;

impl Access {
    /// From the URL: `?mode=0660` (path sockets, octal; default 0600) and
    /// `?allow_uid=1000,1001` or `?allow_uid=any` (abstract sockets and
    /// `shm://`; default: this process's user only).
    fn of(endpoint: &Endpoint) -> Result<(Option<u32>, Self), String> {
        let mode = match endpoint.query("mode") {
            Some(m) => Some(
                u32::from_str_radix(m.trim_start_matches("0o"), 8)
                    .map_err(|_| format!("bad mode {m:?} (octal, e.g. 0660)"))?,
            ),
            None => None,
        };
        let uids = match endpoint.query("allow_uid") {
            Some("any") => None,
            Some(list) => Some(
                list.split(',')
                    .map(|u| u.trim().parse::<u32>().map_err(|_| format!("bad user id {u:?} in allow_uid")))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            // SAFETY: geteuid has no preconditions and cannot fail.
            None => Some(vec![unsafe { libc::geteuid() }]),
        };
        Ok((mode, Self { uids }))
    }

    fn allows(&self, s: &UnixStream) -> Result<(), String> {
        let Some(uids) = &self.uids else { return Ok(()) };
        let cred = s.peer_cred().map_err(|e| format!("cannot read the peer's credentials: {e}"))?;
        if uids.contains(&cred.uid()) {
            Ok(())
        } else {
            Err(format!("user id {} may not connect (allowed: {uids:?}; see ?allow_uid=)", cred.uid()))
        }
    }
}

struct UnixAccept {
    listener: UnixListener,
    name: String,
    n: u64,
    /// Peers checked by user id (abstract sockets), None: the file mode decides.
    access: Option<Access>,
    /// Listening as `shm://`.
    #[cfg_attr(not(feature = "shm"), allow(dead_code))]
    shm: bool,
}

#[async_trait::async_trait]
impl RawAccept for UnixAccept {
    async fn accept_and_handshake(&mut self, config: &TransportConfig, tx: &AcceptTx) -> std::io::Result<()> {
        let (s, _) = self.listener.accept().await?;
        self.n += 1;
        if let Some(access) = &self.access
            && let Err(reason) = access.allows(&s)
        {
            tracing::warn!(socket = %self.name, %reason, "refused a local connection");
            return Ok(());
        }
        let info = SocketInfo { peer: format!("{}#{}", self.name, self.n), transport: "unix", local: true };
        #[cfg(feature = "shm")]
        {
            // Whether the client offers shared memory shows in its first
            // bytes; read them in the connection's own task.
            let (config, tx, shm) = (config.clone(), tx.clone(), self.shm);
            tokio::spawn(async move {
                let peer = info.peer.clone();
                let fail = |reason: String| AcceptError::Handshake { peer: peer.clone(), reason };
                let offer = match tokio::time::timeout(config.connect_timeout, crate::shm::accept_offer(&s)).await {
                    Ok(Ok(offer)) => offer,
                    Ok(Err(e)) => return drop(tx.send(Err(fail(e.to_string()))).await),
                    Err(_) => return drop(tx.send(Err(fail("no data within the connect timeout".into()))).await),
                };
                let (side, ring) = match offer {
                    Some(o) => match crate::shm::side_channel(o.side, &config.shm) {
                        Ok(side) => (Some(side), o.ring),
                        Err(e) => return drop(tx.send(Err(fail(e.to_string()))).await),
                    },
                    None => (None, None),
                };
                let (side, hook) = side.map_or((None, None), |(s, h)| (Some(s), Some(h)));
                let (established, busy) = match ring {
                    Some(parts) => {
                        match crate::shm::ring_halves(crate::shm::ring::End::Server, parts, s, config.spin) {
                            Ok((rd, wr)) => {
                                let busy = wr.busy();
                                (mux::establish_with(rd, wr, Role::Server, info, &config, hook).await, Some(busy))
                            }
                            Err(e) => return drop(tx.send(Err(fail(e.to_string()))).await),
                        }
                    }
                    None => {
                        let (rd, wr) = s.into_split();
                        (mux::establish_with(rd, wr, Role::Server, info, &config, hook).await, None)
                    }
                };
                let r = match established {
                    Ok(c) => match side {
                        Some(side) => {
                            let name = if shm { "shm" } else { "unix+shm" };
                            Ok(crate::shm::wrap(c, side, &config.shm, name, busy))
                        }
                        None => Ok(c as Arc<dyn Connection>),
                    },
                    Err(e) => {
                        tracing::info!(%peer, error = %e, "rejected connection");
                        Err(fail(e.to_string()))
                    }
                };
                let _ = tx.send(r).await;
            });
        }
        #[cfg(not(feature = "shm"))]
        {
            let (rd, wr) = s.into_split();
            handshake_in_background(rd, wr, info, config.clone(), tx.clone());
        }
        Ok(())
    }
}

/// Listens on `unix:///path` (the socket file is removed when the listener
/// is dropped), or on `shm://name` (an abstract socket: no file). Clients
/// that offer shared memory get it.
///
/// Who may connect: a path socket's file gets mode 0600 (`?mode=0660` to
/// share it with the group); an abstract socket (and `shm://`) has no file,
/// so connections are checked by the peer's user id (`SO_PEERCRED`): this
/// process's user only unless `?allow_uid=1000,1001` or `?allow_uid=any`.
pub async fn listen(endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    let path = socket_path(endpoint);
    let (mode, access) =
        Access::of(endpoint).map_err(|reason| ListenError::Config { endpoint: endpoint.to_string(), reason })?;
    let l = bind_socket(&path).map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?;
    let is_abstract = abstract_name(&path).is_some();
    if !is_abstract {
        use std::os::unix::fs::PermissionsExt;
        let perms = std::fs::Permissions::from_mode(mode.unwrap_or(DEFAULT_SOCKET_MODE));
        std::fs::set_permissions(&path, perms)
            .map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?;
    }
    let raw = UnixAccept {
        listener: l,
        name: endpoint.to_string(),
        n: 0,
        access: is_abstract.then_some(access),
        shm: endpoint.scheme() == crate::Scheme::Shm,
    };
    let cleanup = (!is_abstract).then_some(path);
    Ok(Box::new(QueueListener::new(Box::new(raw), config, endpoint.clone(), cleanup)))
}
