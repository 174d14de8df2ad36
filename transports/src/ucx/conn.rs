//! Connection setup for `ucx://host:port` and the [`Connection`] that ties
//! the mux to the UCX worker.
//!
//! ```text
//!   client                                          server (TCP listener on host:port)
//!   TCP connect ─ "TWUCX\x04\0\0" host token ───────►  same host? → worker (context for it)
//!   same host? → worker ◄─ "TWUCX\x04\0\0" host token, server worker address
//!   client worker address ─────────────────────────►  ucp_ep_create(client address)
//!   ucp_ep_create(server address)
//!   mux preface ◄════════ UCP stream ═════════════► mux preface (frames from now on)
//!   ...
//!   writer shutdown: flush, frame byte count ─ TCP ─►  stream ends after that many bytes
//! ```
//!
//! The host token (boot id and PID/IPC/mount namespaces) tells both sides,
//! alike, whether the peer can share memory with them: with `UCX_TLS`
//! unset, same-host peers get workers limited to UCX's shared-memory
//! transports (see `ffi::context_for`), others every transport.
//!
//! After the address exchange every frame travels through UCX (see
//! `stream`); the TCP socket stays open as the control channel: it carries
//! each side's closing byte count, and its end without one (a peer that
//! exits or is killed) tears the worker down at once, failing outstanding
//! UCX operations.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use super::rendezvous::{Rendezvous, UcxRecv, UcxSend};
use super::stream::{UcxReader, UcxWriter};
use super::worker::WorkerHandle;
use crate::listener::{AcceptTx, QueueListener, RawAccept, establish_error};
use crate::mux::{self, Role, SocketInfo};
use crate::{
    AcceptError, ConnectError, Connection, ConnectionInfo, Endpoint, Incoming, ListenError, Listener, RecvStream,
    SendStream, StreamError, StreamKind, TransportConfig,
};

/// First bytes of each side's first message (version 2: with host tokens;
/// 3: frames through the UCP stream).
const MAGIC: &[u8; 8] = b"TWUCX\x04\0\0";
/// Largest worker address accepted from a peer (UCX's are a few hundred bytes).
const MAX_ADDRESS: u32 = 64 << 10;
/// Largest host token accepted from a peer.
const MAX_TOKEN: u16 = 1024;

fn bad(m: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, m)
}

fn hello(token: &[u8]) -> Vec<u8> {
    let token = &token[..token.len().min(MAX_TOKEN.into())];
    let mut msg = Vec::with_capacity(10 + token.len());
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&(token.len() as u16).to_le_bytes());
    msg.extend_from_slice(token);
    msg
}

fn address_msg(address: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(4 + address.len());
    msg.extend_from_slice(&(address.len() as u32).to_le_bytes());
    msg.extend_from_slice(address);
    msg
}

async fn read_hello(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = [0u8; 10];
    s.read_exact(&mut head).await?;
    if &head[..8] != MAGIC {
        return Err(bad("not a tensorwire ucx:// peer of this version (bad preface)".into()));
    }
    let len = u16::from_le_bytes([head[8], head[9]]);
    if len > MAX_TOKEN {
        return Err(bad(format!("host token of {len} bytes (limit {MAX_TOKEN})")));
    }
    let mut token = vec![0u8; len as usize];
    s.read_exact(&mut token).await?;
    Ok(token)
}

async fn read_address(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = [0u8; 4];
    s.read_exact(&mut head).await?;
    let len = u32::from_le_bytes(head);
    if len == 0 || len > MAX_ADDRESS {
        return Err(bad(format!("UCX worker address of {len} bytes (limit {MAX_ADDRESS})")));
    }
    let mut addr = vec![0u8; len as usize];
    s.read_exact(&mut addr).await?;
    Ok(addr)
}

fn tune(s: &TcpStream) {
    let _ = s.set_nodelay(true);
}

/// Exchanges worker addresses on a fresh socket, starts the worker, runs
/// the mux handshake and wraps the result.
async fn establish(
    mut s: TcpStream,
    role: Role,
    peer: String,
    config: &TransportConfig,
) -> Result<Arc<dyn Connection>, Failure> {
    let ours = super::ffi::same_host_token();
    let (worker, pending, theirs) = match role {
        Role::Client => {
            s.write_all(&hello(&ours)).await.map_err(Failure::Io)?;
            let same_host = read_hello(&mut s).await.map_err(Failure::Io)? == ours;
            let theirs = read_address(&mut s).await.map_err(Failure::Io)?;
            let (worker, pending) = WorkerHandle::new(&peer, same_host).map_err(Failure::Ucx)?;
            s.write_all(&address_msg(&worker.address)).await.map_err(Failure::Io)?;
            (worker, pending, theirs)
        }
        Role::Server => {
            let same_host = read_hello(&mut s).await.map_err(Failure::Io)? == ours;
            let (worker, pending) = WorkerHandle::new(&peer, same_host).map_err(Failure::Ucx)?;
            let mut msg = hello(&ours);
            msg.extend_from_slice(&address_msg(&worker.address));
            s.write_all(&msg).await.map_err(Failure::Io)?;
            let theirs = read_address(&mut s).await.map_err(Failure::Io)?;
            (worker, pending, theirs)
        }
    };
    worker.connect(pending, &theirs, config.spin).map_err(Failure::Ucx)?;
    let local = s.peer_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
    let worker = Arc::new(worker);
    let (control_rd, control_wr) = s.into_split();
    // The control socket's reading side: the peer's frame count, then its
    // end; let go of once the connection is over (with the writing side,
    // which the writer holds, that closes the socket: the peer's signal).
    let (over_tx, over_rx) = oneshot::channel::<()>();
    let watch = tokio::spawn(watch_control(control_rd, Arc::downgrade(&worker), over_rx));
    worker.attach(watch.abort_handle());
    let (writer_gone_tx, writer_gone) = oneshot::channel::<()>();
    let rd = UcxReader { worker: worker.clone() };
    let wr = UcxWriter::new(worker.clone(), control_wr, writer_gone_tx);
    let info = SocketInfo { peer: peer.clone(), transport: "ucx", local };
    let rv = Arc::new(Rendezvous {
        worker: worker.clone(),
        next_tag: AtomicU64::new(1),
        cfg: config.ucx.clone(),
        peer: peer.clone(),
        max_payload: u64::from(config.max_frame_payload),
        scratch: Default::default(),
    });
    // Frames of streams whose receiver is gone: their payloads are
    // received and dropped, so the peer's sends complete (in place before
    // the mux reads its first frame).
    let weak = Arc::downgrade(&rv);
    let hook: mux::DiscardHook = Box::new(move |h| {
        if let Some(rv) = weak.upgrade() {
            rv.discard(h);
        }
    });
    let mux = mux::establish_with(rd, wr, role, info, config, Some(hook)).await.map_err(Failure::Mux)?;
    let inner: Arc<dyn Connection> = mux;
    // Once the connection is closed and its writer has sent what it had
    // (or given up), stop the worker, failing what UCX still has
    // outstanding.
    let (c, w) = (inner.clone(), worker);
    tokio::spawn(async move {
        c.closed().await;
        let _ = tokio::time::timeout(WRITER_GRACE, writer_gone).await;
        w.stop("the connection closed");
        drop(over_tx);
    });
    Ok(Arc::new(UcxConnection { inner, rv }))
}

/// How long a closed connection's writer may take to hand over its last
/// frames before the worker stops.
const WRITER_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Reads the control socket until the connection is `over`: the 8-byte
/// count of frame-stream bytes the peer sent, written when it finished,
/// then its end. An end without the count (a killed or failed peer) or
/// anything else stops the worker.
async fn watch_control(mut rd: OwnedReadHalf, worker: Weak<WorkerHandle>, over: oneshot::Receiver<()>) {
    tokio::select! {
        _ = over => {}
        _ = read_control(&mut rd, &worker) => {}
    }
}

async fn read_control(rd: &mut OwnedReadHalf, worker: &Weak<WorkerHandle>) {
    let mut count = [0u8; 8];
    let why = match rd.read_exact(&mut count).await {
        Ok(_) => {
            if let Some(w) = worker.upgrade() {
                w.peer_finished(u64::from_le_bytes(count));
            }
            let mut more = [0u8; 1];
            match rd.read(&mut more).await {
                Ok(0) => return,
                Ok(_) => "the peer wrote past its frame count on the control socket".to_string(),
                Err(e) => format!("control socket: {e}"),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => "the peer closed the connection".to_string(),
        Err(e) => format!("control socket: {e}"),
    };
    if let Some(w) = worker.upgrade() {
        w.stop(&why);
    }
}

enum Failure {
    Ucx(String),
    Io(std::io::Error),
    Mux(mux::EstablishError),
}

impl Failure {
    fn into_connect(self, endpoint: &Endpoint) -> ConnectError {
        match self {
            Failure::Ucx(reason) => ConnectError::Config { endpoint: endpoint.to_string(), reason },
            Failure::Io(source) if source.kind() == std::io::ErrorKind::InvalidData => {
                ConnectError::Protocol { endpoint: endpoint.to_string(), reason: source.to_string() }
            }
            Failure::Io(source) => ConnectError::Io { endpoint: endpoint.to_string(), source },
            Failure::Mux(e) => establish_error(endpoint, e),
        }
    }

    fn reason(&self) -> String {
        match self {
            Failure::Ucx(s) => s.clone(),
            Failure::Io(e) => e.to_string(),
            Failure::Mux(e) => e.to_string(),
        }
    }
}

/// Connects to `ucx://host:port`.
pub async fn connect(endpoint: &Endpoint, config: &TransportConfig) -> Result<Arc<dyn Connection>, ConnectError> {
    // Fail before touching the network when UCX cannot be loaded.
    super::ffi::context().map_err(|reason| ConnectError::Config { endpoint: endpoint.to_string(), reason })?;
    let s = TcpStream::connect(endpoint.authority())
        .await
        .map_err(|source| ConnectError::Io { endpoint: endpoint.to_string(), source })?;
    tune(&s);
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| endpoint.authority());
    establish(s, Role::Client, peer, config).await.map_err(|f| f.into_connect(endpoint))
}

struct UcxAccept(TcpListener);

#[async_trait]
impl RawAccept for UcxAccept {
    async fn accept_and_handshake(&mut self, config: &TransportConfig, tx: &AcceptTx) -> std::io::Result<()> {
        let (s, addr) = self.0.accept().await?;
        tune(&s);
        let (config, tx) = (config.clone(), tx.clone());
        tokio::spawn(async move {
            let peer = addr.to_string();
            let r =
                match tokio::time::timeout(config.connect_timeout, establish(s, Role::Server, peer.clone(), &config))
                    .await
                {
                    Ok(Ok(c)) => Ok(c),
                    Ok(Err(f)) => {
                        tracing::info!(%peer, error = %f.reason(), "rejected ucx connection");
                        Err(AcceptError::Handshake { peer, reason: f.reason() })
                    }
                    Err(_) => {
                        Err(AcceptError::Handshake { peer, reason: "no handshake within the connect timeout".into() })
                    }
                };
            let _ = tx.send(r).await;
        });
        Ok(())
    }
}

/// Listens on `ucx://host:port` (a TCP port for the control connection;
/// port 0 picks a free one).
pub async fn listen(endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    super::ffi::context().map_err(|reason| ListenError::Config { endpoint: endpoint.to_string(), reason })?;
    let l = TcpListener::bind(endpoint.authority())
        .await
        .map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?;
    let port = l.local_addr().map_err(|source| ListenError::Io { endpoint: endpoint.to_string(), source })?.port();
    Ok(Box::new(QueueListener::new(Box::new(UcxAccept(l)), config, endpoint.with_port(port), None)))
}

/// A mux connection over a UCP stream whose large payloads travel by
/// rendezvous.
struct UcxConnection {
    inner: Arc<dyn Connection>,
    rv: Arc<Rendezvous>,
}

impl Drop for UcxConnection {
    fn drop(&mut self) {
        // The mux says goodbye over the stream; the worker stops after
        // (see `establish`).
        self.inner.close("connection dropped");
    }
}

#[async_trait]
impl Connection for UcxConnection {
    async fn open(&self, kind: StreamKind) -> Result<(Box<dyn SendStream>, Box<dyn RecvStream>), StreamError> {
        let (tx, rx) = self.inner.open(kind).await?;
        Ok((Box::new(UcxSend::new(tx, self.rv.clone())), Box::new(UcxRecv::new(rx, self.rv.clone()))))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        let inc = self.inner.accept().await?;
        Ok(Incoming {
            kind: inc.kind,
            send: Box::new(UcxSend::new(inc.send, self.rv.clone())),
            recv: Box::new(UcxRecv::new(inc.recv, self.rv.clone())),
            peer: inc.peer,
        })
    }

    fn info(&self) -> ConnectionInfo {
        ConnectionInfo { transport: "ucx", ..self.inner.info() }
    }

    fn close(&self, reason: &str) {
        self.inner.close(reason);
    }

    fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }

    async fn closed(&self) {
        self.inner.closed().await
    }
}
