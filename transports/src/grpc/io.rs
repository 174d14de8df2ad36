//! The accepted sockets handed to tonic: TCP, TLS over TCP or Unix, as one
//! type, with a deadline for the client's HTTP/2 preface: a client that
//! connects and sends nothing is closed after the connect timeout instead
//! of holding a connection (and a file descriptor) forever.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tonic::transport::server::Connected;

use super::held::Held;
use crate::sync::lock;

/// The HTTP/2 client connection preface is this long.
const PREFACE_LEN: usize = 24;

/// An accepted socket.
pub(crate) enum Sock {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Unix(UnixStream),
    /// Handed to the lingering close (see [`Io`]'s `Drop`).
    Gone,
}

/// How long a closed connection's socket is drained before it is closed.
const LINGER: Duration = Duration::from_secs(1);

fn gone() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::NotConnected, "the socket is closed")
}

/// An accepted socket handed to tonic, failing its reads with `TimedOut`
/// when the preface has not arrived in time.
pub(crate) struct Io {
    sock: Sock,
    preface: Option<Pin<Box<Sleep>>>,
    seen: usize,
    /// Close by lingering (see `Drop`).
    linger: bool,
    /// What the connection's calls hold in unfinished messages.
    held: Arc<Held>,
    /// The connection's place under the listener's cap, given back when
    /// the socket is closed (after its lingering close).
    slot: Option<Slot>,
}

impl Io {
    /// `sock`, which must send the HTTP/2 preface within `timeout`; its
    /// calls' unfinished messages are counted in `held`.
    pub(crate) fn new(sock: Sock, timeout: Duration, held: Arc<Held>, slot: Slot) -> Self {
        Self {
            sock,
            preface: Some(Box::pin(tokio::time::sleep(timeout))),
            seen: 0,
            linger: true,
            held,
            slot: Some(slot),
        }
    }
}

/// Refusals under way at once at most (each holds a socket for up to a
/// second, a TLS one a handshake too): past it a connection over the cap
/// is closed without a word.
const MAX_REFUSING: usize = 64;

/// The connections a listener keeps open, in all and per peer address (see
/// [`TransportConfig::max_connections`](crate::TransportConfig::max_connections)).
#[derive(Debug)]
pub(crate) struct Slots {
    cap: usize,
    per_peer: usize,
    /// Open in all, and by peer (None: Unix sockets, one local peer).
    open: Mutex<(usize, HashMap<Option<IpAddr>, usize>)>,
    refusing: Arc<Semaphore>,
}

impl Slots {
    /// At most `cap` connections, `per_peer` of them from one address.
    pub(crate) fn new(cap: usize, per_peer: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            per_peer,
            open: Mutex::new((0, HashMap::new())),
            refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
        })
    }

    /// A place for a connection from `peer`, or why there is none.
    pub(crate) fn take(self: &Arc<Self>, peer: Option<IpAddr>) -> Result<Slot, String> {
        let mut open = lock(&self.open);
        let (total, by_peer) = &mut *open;
        let mine = by_peer.get(&peer).copied().unwrap_or(0);
        if mine >= self.per_peer {
            let who = peer.map_or_else(|| "local clients".to_string(), |ip| ip.to_string());
            return Err(format!(
                "too many connections from {who}: {mine} open, the server allows {} per peer",
                self.per_peer
            ));
        }
        if *total >= self.cap {
            return Err(format!("too many connections: {total} open, the server allows {}", self.cap));
        }
        *total += 1;
        *by_peer.entry(peer).or_insert(0) += 1;
        Ok(Slot { slots: self.clone(), peer })
    }

    /// Leave to refuse one more connection (None: too many refusals under
    /// way; close it without a word).
    pub(crate) fn refusal(&self) -> Option<OwnedSemaphorePermit> {
        self.refusing.clone().try_acquire_owned().ok()
    }
}

/// A connection's place among a listener's [`Slots`], given back when
/// dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    peer: Option<IpAddr>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = lock(&self.slots.open);
        let (total, by_peer) = &mut *open;
        *total -= 1;
        if let Some(n) = by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                by_peer.remove(&self.peer);
            }
        }
    }
}

/// Refuses an accepted connection the HTTP/2 way: the server's preface
/// (empty SETTINGS) and a GOAWAY whose debug data says why (clients show
/// it), then a lingering close.
pub(crate) async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, reason: &str) {
    use tokio::io::AsyncWriteExt;
    // SETTINGS (type 4) with no settings; GOAWAY (type 7): last stream 0,
    // ENHANCE_YOUR_CALM (0xb), the reason.
    let debug = &reason.as_bytes()[..reason.len().min(1024)];
    let mut out = vec![0, 0, 0, 4, 0, 0, 0, 0, 0];
    out.extend_from_slice(&((8 + debug.len()) as u32).to_be_bytes()[1..]);
    out.extend_from_slice(&[7, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0x0b]);
    out.extend_from_slice(debug);
    let _ = tokio::time::timeout(LINGER, async {
        let _ = s.write_all(&out).await;
        drain_until_closed(&mut s).await
    })
    .await;
}

/// Shuts `s` down for writing and reads (dropping it) what the client
/// still sends until it closes too (callers bound the time).
async fn drain_until_closed<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = s.shutdown().await;
    let mut buf = [0u8; 8192];
    while let Ok(n) = s.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}

/// A lingering close. When the HTTP/2 server is done with a connection
/// (after a graceful shutdown, the last stream's trailers just written),
/// closing the socket at once while the client's frames (window updates)
/// sit unread in it makes the kernel send a reset instead of a FIN, and the
/// client can lose the end of a response it has not read yet — a fetch
/// drained by a graceful shutdown then failed ("error reading a body from
/// connection", ~1 in 50 runs). So the socket is shut down for writing and
/// drained until the client closes too, at most [`LINGER`].
impl Drop for Io {
    fn drop(&mut self) {
        if !self.linger || matches!(self.sock, Sock::Gone) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let sock = std::mem::replace(&mut self.sock, Sock::Gone);
        let mut io =
            Io { sock, preface: None, seen: 0, linger: false, held: self.held.clone(), slot: self.slot.take() };
        rt.spawn(async move {
            let _ = tokio::time::timeout(LINGER, drain_until_closed(&mut io)).await;
        });
    }
}

/// What the server knows of the connection a gRPC call came on, in the
/// request's extensions (`req.extensions().get::<ConnectInfo>()`); the
/// listener also puts tonic's `TcpConnectInfo` there, so `remote_addr()`
/// and `local_addr()` of a tonic request work as usual.
#[derive(Clone, Debug)]
pub struct ConnectInfo {
    local: Option<SocketAddr>,
    remote: Option<SocketAddr>,
    pub(crate) held: Arc<Held>,
}

impl ConnectInfo {
    /// The client's address (None over a Unix socket).
    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.remote
    }

    /// The server's address the client connected to (None over a Unix
    /// socket).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }
}

impl Connected for Io {
    type ConnectInfo = ConnectInfo;

    fn connect_info(&self) -> ConnectInfo {
        let tcp = match &self.sock {
            Sock::Tcp(s) => Some(s),
            Sock::Tls(s) => Some(s.get_ref().0),
            Sock::Unix(_) | Sock::Gone => None,
        };
        ConnectInfo {
            local: tcp.and_then(|s| s.local_addr().ok()),
            remote: tcp.and_then(|s| s.peer_addr().ok()),
            held: self.held.clone(),
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match &mut $self.get_mut().sock {
            Sock::Tcp($s) => {
                let $s = Pin::new($s);
                $e
            }
            Sock::Tls($s) => {
                let $s = Pin::new(&mut **$s);
                $e
            }
            Sock::Unix($s) => {
                let $s = Pin::new($s);
                $e
            }
            Sock::Gone => Poll::Ready(Err(gone())),
        }
    };
}

impl AsyncRead for Io {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        let r = match &mut this.sock {
            Sock::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Sock::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
            Sock::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Sock::Gone => return Poll::Ready(Err(gone())),
        };
        if let Some(deadline) = &mut this.preface {
            this.seen += buf.filled().len() - before;
            if this.seen >= PREFACE_LEN {
                this.preface = None;
            } else if r.is_pending() && deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no HTTP/2 preface within the connect timeout",
                )));
            }
        }
        r
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match &self.sock {
            Sock::Tcp(s) => s.is_write_vectored(),
            Sock::Tls(s) => s.is_write_vectored(),
            Sock::Unix(s) => s.is_write_vectored(),
            Sock::Gone => false,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }
}

/// A client's socket that keeps the first I/O error it meets (a TLS alert,
/// a broken pipe): hyper drives the HTTP/2 connection in a task of its own
/// and only logs such an error, so without this the connection would end
/// with no cause to report.
pub(crate) struct Recording<IO> {
    inner: IO,
    first_error: std::sync::Arc<std::sync::OnceLock<String>>,
}

impl<IO> Recording<IO> {
    /// Wraps `inner`; its first error goes to `first_error`.
    pub(crate) fn new(inner: IO, first_error: std::sync::Arc<std::sync::OnceLock<String>>) -> Self {
        Recording { inner, first_error }
    }

    fn note<T>(&self, r: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        if let Poll::Ready(Err(e)) = &r {
            let _ = self.first_error.set(e.to_string());
        }
        r
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Recording<IO> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.note(r)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Recording<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note(r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.note(r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.note(r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.note(r)
    }
}
