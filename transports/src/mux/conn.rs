//! The mux connection, a thin async driver: the preface exchange, the
//! reader and writer tasks, and [`MuxConnection`] (opening and accepting
//! streams, closing). Stream bookkeeping is in [`state`](super::state),
//! the handles in `handles`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

use super::frame::{self, Head, Kind, PREFACE_LEN, Preface, code};
use super::handles::{MuxRecv, MuxSend};
use super::shared::{ConnState, DiscardHook, Shared};
use super::state::Streams;
use super::writer::{self, MuxWrite, Out, Writer};
use crate::sync::lock;
use crate::{Connection, ConnectionInfo, Incoming, RecvStream, SendStream, StreamError, StreamKind, TransportConfig};

pub use super::state::Role;

/// A multiplexed connection over a byte stream.
pub struct MuxConnection {
    shared: Arc<Shared>,
    accept_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<(MuxSend, MuxRecv)>>,
}

impl std::fmt::Debug for MuxConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MuxConnection")
            .field("peer", &self.shared.peer)
            .field("transport", &self.shared.transport)
            .finish()
    }
}

/// Errors while exchanging prefaces.
#[derive(Debug, thiserror::Error)]
pub enum EstablishError {
    /// Socket error.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer is not a compatible tensorwire mux.
    #[error("{0}")]
    Protocol(String),
    /// No preface in time.
    #[error("no preface within {0:?}")]
    Timeout(Duration),
}

/// Facts about the underlying socket, for [`ConnectionInfo`] and errors.
pub struct SocketInfo {
    /// Peer address.
    pub peer: String,
    /// Transport name.
    pub transport: &'static str,
    /// True when no network is crossed.
    pub local: bool,
}

/// Exchanges prefaces on a fresh socket and starts the reader and writer
/// tasks. Both sides send their preface first, then read the peer's.
pub async fn establish<R, W>(
    rd: R,
    wr: W,
    role: Role,
    info: SocketInfo,
    config: &TransportConfig,
) -> Result<Arc<MuxConnection>, EstablishError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: MuxWrite,
{
    establish_with(rd, wr, role, info, config, None).await
}

/// [`establish`], with what the transport does with frames dropped unread
/// (see [`DiscardHook`]), in place before the reader starts.
pub(crate) async fn establish_with<R, W>(
    mut rd: R,
    mut wr: W,
    role: Role,
    info: SocketInfo,
    config: &TransportConfig,
    discard_hook: Option<DiscardHook>,
) -> Result<Arc<MuxConnection>, EstablishError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: MuxWrite,
{
    let mine = Preface {
        version: frame::MUX_VERSION,
        stream_window: config.stream_window,
        max_frame_payload: config.max_frame_payload,
    };
    let mut b = BytesMut::with_capacity(PREFACE_LEN);
    mine.encode(&mut b);
    wr.write_all(&b).await?;
    let mut pre = [0u8; PREFACE_LEN];
    match tokio::time::timeout(config.connect_timeout, rd.read_exact(&mut pre)).await {
        Err(_) => return Err(EstablishError::Timeout(config.connect_timeout)),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(EstablishError::Protocol("the peer closed the connection before sending a preface".into()));
        }
        Ok(r) => {
            r?;
        }
    }
    let theirs = match Preface::decode(&pre) {
        Ok(p) => p,
        Err(e) => {
            // Tell a tensorwire peer why (a foreign client will just see the close).
            let reason = e.to_string();
            let mut g = BytesMut::new();
            let c = if matches!(e, frame::FrameError::Version(_)) { code::VERSION } else { code::PROTOCOL };
            Head { stream: 0, kind: Kind::GoAway, flags: 0, meta_len: reason.len() as u32, value: c }.encode(&mut g);
            g.put_slice(reason.as_bytes());
            let _ = wr.write_all(&g).await;
            let _ = wr.shutdown().await;
            return Err(EstablishError::Protocol(reason));
        }
    };
    let spin = if wr.spins() { config.spin } else { Duration::ZERO };
    let (rd, wr) = super::spinning::halves(rd, wr, crate::spin::Activity::new(spin));
    let (writer, out_rx) = Writer::new(Box::new(wr));
    let (accept_tx, accept_rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        peer: info.peer,
        transport: info.transport,
        local: info.local,
        limits: frame::FrameLimits { max_meta: config.max_header_bytes, max_payload: config.max_frame_payload },
        my_window: config.stream_window,
        peer_window: theirs.stream_window,
        peer_max_payload: theirs.max_frame_payload,
        conn_window: config.connection_window,
        frames_heard: AtomicU64::new(0),
        state: Mutex::new(ConnState { streams: Streams::new(role, config.max_concurrent_streams), error: None }),
        writer,
        closed: AtomicBool::new(false),
        closed_notify: Notify::new(),
        buffered: AtomicU64::new(0),
        budget_notify: Notify::new(),
        discard_hook,
    });
    let sh = shared.clone();
    tokio::spawn(async move {
        if let Err(e) = writer::run(&sh.writer, out_rx, sh.wait_closed()).await {
            sh.fail(StreamError::io(&sh.peer, &e));
        }
    });
    tokio::spawn(super::reader::run(shared.clone(), rd, accept_tx));
    if let Some(interval) = config.keepalive_interval {
        tokio::spawn(keep(Arc::downgrade(&shared), interval, config.idle_timeout));
    }
    Ok(Arc::new(MuxConnection { shared, accept_rx: tokio::sync::Mutex::new(accept_rx) }))
}

/// Keeps a connection honest: pings a peer that has been quiet for an
/// `interval`, closes one that answered nothing (not even a PONG) for
/// [`PING_TIMEOUT_INTERVALS`] intervals, and closes a connection that had no
/// open stream for `idle` (its client reconnects on its next call).
///
/// Quiet time is told from the frame counter at each tick (the reader
/// reads no clock per frame), so it is known to a tick: a silent peer is
/// closed after between [`PING_TIMEOUT_INTERVALS`] and one more ticks.
async fn keep(shared: std::sync::Weak<Shared>, interval: Duration, idle: Option<Duration>) {
    let mut idle_from: Option<std::time::Instant> = None;
    let (mut heard, mut heard_at) = (0u64, std::time::Instant::now());
    loop {
        tokio::time::sleep(interval.min(idle.unwrap_or(interval))).await;
        let Some(sh) = shared.upgrade() else { return };
        if sh.closed.load(Ordering::Acquire) {
            return;
        }
        let frames = sh.frames_heard.load(Ordering::Relaxed);
        if frames != heard {
            (heard, heard_at) = (frames, std::time::Instant::now());
        }
        let quiet = heard_at.elapsed();
        if quiet >= interval * PING_TIMEOUT_INTERVALS {
            sh.close(&format!("the peer answered no keep-alive ping for {}s", quiet.as_secs()));
            return;
        }
        if quiet >= interval {
            let _ = sh.writer.push(Out::Ping(0));
        }
        if let Some(idle) = idle {
            if lock(&sh.state).streams.is_empty() {
                let from = *idle_from.get_or_insert_with(std::time::Instant::now);
                if from.elapsed() >= idle {
                    sh.close(&format!("idle for {}s with no open stream", idle.as_secs()));
                    return;
                }
            } else {
                idle_from = None;
            }
        }
    }
}

/// A peer silent for this many keep-alive intervals is taken for dead.
const PING_TIMEOUT_INTERVALS: u32 = 3;

impl Drop for MuxConnection {
    fn drop(&mut self) {
        self.close("connection dropped");
    }
}

impl MuxConnection {
    /// Opens a stream: its two halves as they are (a wrapper such as the
    /// shared-memory connection keeps them unboxed, so its calls into them
    /// make no boxed futures).
    pub(crate) fn open_halves(&self) -> Result<(MuxSend, MuxRecv), StreamError> {
        let sh = &self.shared;
        if let Some(e) = &lock(&sh.state).error {
            return Err(e.clone());
        }
        // The id is assigned when the first frame is sent (see `MuxSend::enqueue`).
        let s = sh.new_stream(0);
        Ok((MuxSend { shared: sh.clone(), stream: s.clone() }, MuxRecv::new(sh.clone(), s)))
    }

    /// The next stream the peer opened, as its two halves.
    pub(crate) async fn accept_halves(&self) -> Result<(MuxSend, MuxRecv), StreamError> {
        let mut rx = self.accept_rx.lock().await;
        tokio::select! {
            // Streams that arrived before a close are still handed out; their
            // reads report the connection's error.
            biased;
            inc = rx.recv() => match inc {
                Some(halves) => Ok(halves),
                // The reader ended: report the connection's reason, set by then.
                None => {
                    self.shared.wait_closed().await;
                    Err(self.shared.error())
                }
            },
            _ = self.shared.wait_closed() => Err(self.shared.error()),
        }
    }
}

#[async_trait]
impl Connection for MuxConnection {
    async fn open(&self, _kind: StreamKind) -> Result<(Box<dyn SendStream>, Box<dyn RecvStream>), StreamError> {
        let (tx, rx) = self.open_halves()?;
        Ok((Box::new(tx), Box::new(rx)))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        let (send, recv) = self.accept_halves().await?;
        Ok(Incoming { kind: None, send: Box::new(send), recv: Box::new(recv), peer: None })
    }

    fn info(&self) -> ConnectionInfo {
        ConnectionInfo {
            transport: self.shared.transport,
            peer: self.shared.peer.clone(),
            max_frame_payload: self.shared.peer_max_payload.into(),
            local: self.shared.local,
            stateless: false,
        }
    }

    fn close(&self, reason: &str) {
        self.shared.close(reason);
    }

    fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    async fn closed(&self) {
        self.shared.wait_closed().await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use tensorwire_proto::v1::{self, FrameHeader, frame_header::Kind};

    use super::*;
    use crate::{Frame, RecvStream};

    fn chunk(index: u32) -> Frame {
        let c = v1::Chunk { tensor_id: 1, index, raw_len: 8, ..Default::default() };
        Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: Bytes::from(vec![index as u8; 8]) }
    }

    /// A connection pair whose server side has `hook`.
    async fn pair(hook: Option<DiscardHook>) -> (Arc<MuxConnection>, Arc<MuxConnection>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (c, s) = tokio::join!(tokio::net::TcpStream::connect(l.local_addr().unwrap()), l.accept());
        let (c, (s, _)) = (c.unwrap(), s.unwrap());
        let info = |peer: &str| SocketInfo { peer: peer.into(), transport: "tcp", local: true };
        let cfg = TransportConfig::default();
        let ((crd, cwr), (srd, swr)) = (c.into_split(), s.into_split());
        let (client, server) = tokio::join!(
            establish(crd, cwr, Role::Client, info("server"), &cfg),
            establish_with(srd, swr, Role::Server, info("client"), &cfg, hook)
        );
        (client.unwrap(), server.unwrap())
    }

    /// Frames that reach a stream after its receiver went away are shown
    /// to the discard hook (what `ucx://` needs to drain their payloads),
    /// and so are frames still queued when the receiver drops. (One thread:
    /// nothing runs between the receiver's drop and the next send.)
    #[tokio::test(flavor = "current_thread")]
    async fn frames_dropped_unread_reach_the_discard_hook() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let hook: DiscardHook = Box::new(move |h: &FrameHeader| {
            if let Some(Kind::Chunk(c)) = &h.kind {
                s.lock().unwrap().push(c.index);
            }
        });
        let (client, server) = pair(Some(hook)).await;
        let (mut tx, _rx) = client.open_halves().unwrap();
        tx.try_send_frames(vec![chunk(0), chunk(1), chunk(2)], false).unwrap().unwrap();
        let (_stx, mut srx) = server.accept_halves().await.unwrap();
        assert_eq!(srx.recv().await.unwrap().unwrap().header, chunk(0).header);
        // Chunks 1 and 2 are queued for the stream by now, or arrive after
        // it is gone: either way dropped unread.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        drop(srx);
        // On this single-threaded runtime the sender has not yet seen the
        // STOP (its reader has not run): these frames leave anyway and
        // arrive after the receiver is gone.
        tx.try_send_frames(vec![chunk(3), chunk(4)], false).unwrap().unwrap();
        let all = async {
            while seen.lock().unwrap().len() < 4 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        };
        let waited = tokio::time::timeout(std::time::Duration::from_secs(10), all).await;
        assert!(waited.is_ok(), "dropped frames seen: {:?}", seen.lock().unwrap());
        assert_eq!(*seen.lock().unwrap(), [1, 2, 3, 4]);
    }

    /// When the connection fails, every receiver learns it and keeps
    /// saying so: one that waits on a stream it has not sent on yet (no id,
    /// so not in the connection's table) and one that already read the
    /// error once.
    #[tokio::test(flavor = "current_thread")]
    async fn a_failed_connection_ends_every_receive() {
        let (client, server) = pair(None).await;
        let (mut tx, mut rx) = client.open_halves().unwrap();
        tx.try_send_frames(vec![chunk(0)], false).unwrap().unwrap();
        let (_stx, _srx) = server.accept_halves().await.unwrap();
        let (_tx2, mut unnumbered) = client.open_halves().unwrap();
        let waiting = tokio::spawn(async move { unnumbered.recv().await.map(|_| ()) });
        tokio::task::yield_now().await;
        drop(server);
        let within = std::time::Duration::from_secs(10);
        let first = tokio::time::timeout(within, rx.recv()).await.expect("the open stream hears of the failure");
        assert!(first.is_err(), "{first:?}");
        let second = tokio::time::timeout(within, rx.recv()).await.expect("and says so again");
        assert!(second.is_err(), "{second:?}");
        assert!(rx.try_recv().is_some_and(|r| r.is_err()));
        let unnumbered = tokio::time::timeout(within, waiting).await.expect("the stream with no id hears too").unwrap();
        assert!(unnumbered.is_err(), "{unnumbered:?}");
    }

    /// A peer that floods PINGs and never reads the PONGs cannot grow the
    /// writer's queue without bound: the connection fails once a bounded
    /// number of answers wait behind the full socket.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ping_flood_that_reads_nothing_ends_the_connection() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (c, s) = tokio::join!(tokio::net::TcpStream::connect(l.local_addr().unwrap()), l.accept());
        let (mut raw, (s, _)) = (c.unwrap(), s.unwrap());
        let mut pre = BytesMut::new();
        Preface { version: frame::MUX_VERSION, stream_window: 1 << 20, max_frame_payload: 1 << 20 }.encode(&mut pre);
        raw.write_all(&pre).await.unwrap();
        let info = SocketInfo { peer: "flooder".into(), transport: "tcp", local: true };
        let (srd, swr) = s.into_split();
        let server = establish(srd, swr, Role::Server, info, &TransportConfig::default()).await.unwrap();
        let mut pings = BytesMut::new();
        for v in 0..4096u32 {
            Head { stream: 0, kind: frame::Kind::Ping, flags: 0, meta_len: 0, value: v }.encode(&mut pings);
        }
        // Up to 1 GiB of pings (64 Mi of them), never reading a byte: the
        // server must give up long before.
        let flood = async {
            for _ in 0..(1usize << 30) / pings.len() {
                if raw.write_all(&pings).await.is_err() {
                    break;
                }
            }
        };
        let ended = tokio::time::timeout(Duration::from_secs(60), async {
            tokio::select! {
                _ = server.closed() => {}
                _ = flood => server.closed().await,
            }
        })
        .await;
        assert!(ended.is_ok(), "the server kept answering a peer that reads nothing");
    }

    /// A stream's stop signal (what a server watches while a handler runs)
    /// fires when the peer stops reading, also when the STOP came before
    /// anyone polled it, and when the connection fails while the peer's
    /// handles are all still open.
    #[tokio::test(flavor = "current_thread")]
    async fn the_stop_signal_fires_on_a_stop_and_on_a_failed_connection() {
        use crate::SendStream;
        let poll = |sig: &Arc<dyn crate::StopSignal>| {
            let sig = sig.clone();
            tokio::time::timeout(Duration::from_secs(10), std::future::poll_fn(move |cx| sig.poll_stopped(cx)))
        };
        let (client, server) = pair(None).await;
        // A STOP before the first poll.
        let (mut tx, rx) = client.open_halves().unwrap();
        tx.try_send_frames(vec![chunk(0)], false).unwrap().unwrap();
        let (mut stx, _srx) = server.accept_halves().await.unwrap();
        let sig = stx.stop_signal().expect("the mux can tell");
        drop(rx);
        // Wait until the STOP has arrived (a send says so), then poll once.
        let stopped = tokio::time::timeout(Duration::from_secs(10), async {
            while stx.send_inner(chunk(1), false).await.is_ok() {
                tokio::task::yield_now().await;
            }
        });
        stopped.await.expect("the STOP arrives");
        let waker = std::task::Waker::noop();
        let first = sig.poll_stopped(&mut std::task::Context::from_waker(waker));
        assert!(matches!(first, std::task::Poll::Ready(StreamError::Stopped { .. })), "{first:?}");
        // A waiting watcher woken by the connection's failure; the peer's
        // handles stay open (no STOP).
        let (mut tx, _rx) = client.open_halves().unwrap();
        tx.try_send_frames(vec![chunk(0)], false).unwrap().unwrap();
        let (stx, _srx) = server.accept_halves().await.unwrap();
        let sig = stx.stop_signal().unwrap();
        let waiting = tokio::spawn(poll(&sig));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "nothing stopped yet");
        drop(client);
        let e = waiting.await.unwrap().expect("the failure is seen");
        assert!(matches!(e, StreamError::ConnectionClosed { .. } | StreamError::Io { .. }), "{e}");
        drop((tx, stx));
    }

    /// A receiver dropped before its stream sent anything (no id yet, so
    /// no STOP then) stops the peer once the stream opens.
    #[tokio::test(flavor = "current_thread")]
    async fn a_receiver_dropped_before_the_first_send_stops_the_peer() {
        let (client, server) = pair(None).await;
        let (mut tx, rx) = client.open_halves().unwrap();
        drop(rx);
        tx.try_send_frames(vec![chunk(0)], false).unwrap().unwrap();
        let (mut stx, _srx) = server.accept_halves().await.unwrap();
        let stopped = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Err(e) = stx.send_inner(chunk(1), false).await {
                    return e;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the peer is stopped, not left sending");
        assert!(matches!(stopped, StreamError::Stopped { .. }), "{stopped}");
    }
}
