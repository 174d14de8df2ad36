//! The mux connection: shared state, stream handles and the handshake.
//!
//! A connection runs a reader task (`reader`) and a writer task
//! (`writer`); streams are handles that share per-stream state with
//! them. Small frames are written directly by the sending task when the
//! writer is idle; everything else goes through the writer's queue.

use std::collections::HashMap;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

use super::flow::{RecvWindow, SendWindow};
use super::frame::{self, Head, Kind, PREFACE_LEN, Preface, code};
use super::writer::{MuxWrite, Out, Writer};
use crate::{
    Connection, ConnectionInfo, Frame, Incoming, Placement, Received, RecvStream, SendStream, StreamError, StreamKind,
    TransportConfig,
};

/// Which end of the connection this is: clients open odd stream ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The connecting side.
    Client,
    /// The accepting side.
    Server,
}

#[allow(clippy::large_enum_variant)]
pub(crate) enum Event {
    Frame(Received, u64),
    Fin,
    Reset(u32),
    Error(StreamError),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum SendHalf {
    Open,
    Done,
    Stopped(u32),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum RecvHalf {
    Open,
    Fin,
    Reset,
    Dropped,
}

pub(crate) struct StreamInner {
    pub(crate) send: SendWindow,
    pub(crate) send_half: SendHalf,
    pub(crate) recv: RecvWindow,
    pub(crate) recv_half: RecvHalf,
    pub(crate) events: Option<mpsc::UnboundedSender<Event>>,
    pub(crate) placement: Option<Placement>,
    pub(crate) send_alive: bool,
    pub(crate) recv_alive: bool,
}

pub(crate) struct StreamShared {
    /// 0 until the stream's first frame is sent (locally opened streams get
    /// their id then, so new ids reach the wire in increasing order).
    pub(crate) id: AtomicU32,
    pub(crate) remote: bool,
    pub(crate) inner: Mutex<StreamInner>,
    pub(crate) send_notify: Notify,
}

impl StreamShared {
    pub(crate) fn id(&self) -> u32 {
        self.id.load(Ordering::Acquire)
    }
}

pub(crate) struct ConnState {
    pub(crate) streams: HashMap<u32, Arc<StreamShared>>,
    pub(crate) next_id: u32,
    pub(crate) last_remote: u32,
    pub(crate) remote_open: u32,
    pub(crate) error: Option<StreamError>,
}

pub(crate) struct Shared {
    pub(crate) role: Role,
    pub(crate) peer: String,
    pub(crate) transport: &'static str,
    pub(crate) local: bool,
    pub(crate) limits: frame::Limits,
    pub(crate) my_window: u32,
    pub(crate) peer_window: u32,
    pub(crate) peer_max_payload: u32,
    pub(crate) max_streams: u32,
    pub(crate) conn_window: u64,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) state: Mutex<ConnState>,
    pub(crate) writer: Writer,
    pub(crate) accept_tx: mpsc::UnboundedSender<Incoming>,
    pub(crate) closed: AtomicBool,
    pub(crate) closed_notify: Notify,
    pub(crate) buffered: AtomicU64,
    pub(crate) budget_notify: Notify,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks would be a bug in this module; the
    // data stays consistent enough to report errors, so don't propagate poison.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(crate) fn error(&self) -> StreamError {
        lock(&self.state)
            .error
            .clone()
            .unwrap_or_else(|| StreamError::ConnectionClosed { peer: self.peer.clone(), reason: "closed".into() })
    }

    pub(crate) fn protocol(&self, reason: impl Into<String>) -> StreamError {
        StreamError::Protocol { peer: self.peer.clone(), reason: reason.into() }
    }

    /// Marks the connection failed: every stream learns `err`, every waiter wakes.
    pub(crate) fn fail(&self, err: StreamError) {
        let streams: Vec<Arc<StreamShared>> = {
            let mut st = lock(&self.state);
            if st.error.is_some() {
                return;
            }
            st.error = Some(err.clone());
            st.streams.values().cloned().collect()
        };
        self.closed.store(true, Ordering::Release);
        for s in streams {
            let inner = lock(&s.inner);
            if let Some(tx) = &inner.events {
                let _ = tx.send(Event::Error(err.clone()));
            }
            drop(inner);
            s.send_notify.notify_waiters();
        }
        self.closed_notify.notify_waiters();
        self.budget_notify.notify_waiters();
    }

    pub(crate) fn new_stream(&self, id: u32, remote: bool) -> (Arc<StreamShared>, mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let s = Arc::new(StreamShared {
            id: AtomicU32::new(id),
            remote,
            inner: Mutex::new(StreamInner {
                send: SendWindow::new(self.peer_window),
                send_half: SendHalf::Open,
                recv: RecvWindow::new(self.my_window),
                recv_half: RecvHalf::Open,
                events: Some(tx),
                placement: None,
                send_alive: true,
                recv_alive: true,
            }),
            send_notify: Notify::new(),
        });
        (s, rx)
    }

    pub(crate) fn forget(&self, s: &StreamShared) {
        let id = s.id();
        if id == 0 {
            return;
        }
        let mut st = lock(&self.state);
        let removed = st.streams.remove(&id).is_some();
        if removed {
            self.writer.open_streams.fetch_sub(1, Ordering::Relaxed);
        }
        if removed && s.remote {
            st.remote_open -= 1;
        }
    }

    pub(crate) fn is_remote_id(&self, id: u32) -> bool {
        // Clients open odd ids, servers even ones.
        (id % 2 == 1) == (self.role == Role::Server)
    }

    pub(crate) async fn wait_closed(&self) {
        loop {
            let n = self.closed_notify.notified();
            let mut n = pin!(n);
            n.as_mut().enable();
            if self.closed.load(Ordering::Acquire) {
                return;
            }
            n.await;
        }
    }
}

/// A multiplexed connection over a byte stream.
pub struct MuxConnection {
    shared: Arc<Shared>,
    accept_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Incoming>>,
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
    mut rd: R,
    mut wr: W,
    role: Role,
    info: SocketInfo,
    config: &TransportConfig,
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
    let (writer, out_rx) = Writer::new(Box::new(wr));
    let (accept_tx, accept_rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        role,
        peer: info.peer,
        transport: info.transport,
        local: info.local,
        limits: frame::Limits { max_meta: config.max_header_bytes, max_payload: config.max_frame_payload },
        my_window: config.stream_window,
        peer_window: theirs.stream_window,
        peer_max_payload: theirs.max_frame_payload,
        max_streams: config.max_concurrent_streams,
        conn_window: config.connection_window,
        idle_timeout: config.idle_timeout,
        state: Mutex::new(ConnState {
            streams: HashMap::new(),
            next_id: if role == Role::Client { 1 } else { 2 },
            last_remote: 0,
            remote_open: 0,
            error: None,
        }),
        writer,
        accept_tx,
        closed: AtomicBool::new(false),
        closed_notify: Notify::new(),
        buffered: AtomicU64::new(0),
        budget_notify: Notify::new(),
    });
    tokio::spawn(super::writer::run(shared.clone(), out_rx));
    tokio::spawn(super::reader::run(shared.clone(), rd));
    Ok(Arc::new(MuxConnection { shared, accept_rx: tokio::sync::Mutex::new(accept_rx) }))
}

impl Drop for MuxConnection {
    fn drop(&mut self) {
        self.close("connection dropped");
    }
}

#[async_trait]
impl Connection for MuxConnection {
    async fn open(&self, _kind: StreamKind) -> Result<(Box<dyn SendStream>, Box<dyn RecvStream>), StreamError> {
        let sh = &self.shared;
        if let Some(e) = &lock(&sh.state).error {
            return Err(e.clone());
        }
        // The id is assigned when the first frame is sent (see `MuxSend::enqueue`).
        let (s, rx) = sh.new_stream(0, false);
        Ok((
            Box::new(MuxSend { shared: sh.clone(), stream: s.clone() }),
            Box::new(MuxRecv { shared: sh.clone(), stream: s, events: rx, done: false }),
        ))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        let mut rx = self.accept_rx.lock().await;
        tokio::select! {
            // Streams that arrived before a close are still handed out; their
            // reads report the connection's error.
            biased;
            inc = rx.recv() => inc.ok_or_else(|| self.shared.error()),
            _ = self.shared.wait_closed() => Err(self.shared.error()),
        }
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
        if !self.shared.closed.load(Ordering::Acquire) {
            let _ = self.shared.writer.push(Out::GoAway { code: code::NO_ERROR, reason: reason.to_string() });
            self.shared.fail(StreamError::ConnectionClosed {
                peer: self.shared.peer.clone(),
                reason: format!("closed locally: {reason}"),
            });
        }
    }

    fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    async fn closed(&self) {
        self.shared.wait_closed().await;
    }
}

pub(crate) struct MuxSend {
    pub(crate) shared: Arc<Shared>,
    pub(crate) stream: Arc<StreamShared>,
}

impl MuxSend {
    fn check_frame(&self, frame: &Frame) -> Result<u64, StreamError> {
        let sh = &self.shared;
        let cost = frame.header.encoded_len() as u64 + frame.payload.len() as u64;
        if frame.payload.len() as u64 > u64::from(sh.peer_max_payload) {
            return Err(StreamError::LimitExceeded {
                peer: sh.peer.clone(),
                what: "frame payload",
                size: frame.payload.len() as u64,
                limit: sh.peer_max_payload.into(),
            });
        }
        if cost > u64::from(sh.peer_window) {
            return Err(StreamError::LimitExceeded {
                peer: sh.peer.clone(),
                what: "frame (the peer's stream window)",
                size: cost,
                limit: sh.peer_window.into(),
            });
        }
        Ok(cost)
    }

    /// Waits for `cost` bytes of credit and takes them; with `fin`, also
    /// closes this direction.
    async fn acquire(&self, cost: u64, fin: bool) -> Result<(), StreamError> {
        let sh = &self.shared;
        let s = &self.stream;
        loop {
            let notified = s.send_notify.notified();
            let mut notified = pin!(notified);
            notified.as_mut().enable();
            if sh.closed.load(Ordering::Acquire) {
                return Err(sh.error());
            }
            {
                let mut inner = lock(&s.inner);
                match inner.send_half {
                    SendHalf::Done => {
                        return Err(StreamError::Finished { peer: sh.peer.clone(), stream: s.id().into() });
                    }
                    SendHalf::Stopped(code) => {
                        return Err(StreamError::Stopped { peer: sh.peer.clone(), stream: s.id().into(), code });
                    }
                    SendHalf::Open => {
                        if inner.send.try_consume(cost) {
                            if fin {
                                inner.send_half = SendHalf::Done;
                            }
                            return Ok(());
                        }
                    }
                }
            }
            notified.await;
        }
    }

    async fn send_inner(&mut self, frame: Frame, fin: bool) -> Result<(), StreamError> {
        let cost = self.check_frame(&frame)?;
        self.acquire(cost, fin).await?;
        self.enqueue(|id| [Out::Data { id, header: Some(frame.header), payload: frame.payload, fin }])
    }

    /// Hands frames to the writer. A locally opened stream's first frame
    /// gets the next id, assigned and handed over under the connection lock:
    /// the peer treats any id at or below the highest it has seen as an old
    /// stream, so new ids must reach the wire in increasing order.
    fn enqueue<I>(&self, frames: impl FnOnce(u32) -> I) -> Result<(), StreamError>
    where
        I: AsRef<[Out]> + IntoIterator<Item = Out>,
    {
        let sh = &self.shared;
        let s = &self.stream;
        let fail = |e: std::io::Error| {
            let err = StreamError::io(&sh.peer, &e);
            sh.fail(err.clone());
            err
        };
        let id = s.id();
        if id != 0 {
            if sh.closed.load(Ordering::Acquire) {
                return Err(sh.error());
            }
            return sh.writer.write_or_push(frames(id)).map_err(fail);
        }
        let mut st = lock(&sh.state);
        if let Some(e) = &st.error {
            return Err(e.clone());
        }
        let id = st.next_id;
        st.next_id = id.checked_add(2).ok_or_else(|| StreamError::Refused {
            peer: sh.peer.clone(),
            reason: "stream ids exhausted on this connection; reconnect".into(),
        })?;
        s.id.store(id, Ordering::Release);
        st.streams.insert(id, s.clone());
        sh.writer.open_streams.fetch_add(1, Ordering::Relaxed);
        let r = sh.writer.write_or_push(frames(id));
        drop(st);
        r.map_err(fail)
    }
}

#[async_trait]
impl SendStream for MuxSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        self.send_inner(frame, false).await
    }

    async fn send_last(&mut self, frame: Frame) -> Result<(), StreamError> {
        self.send_inner(frame, true).await
    }

    async fn send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        let mut cost = 0;
        for f in &frames {
            cost += self.check_frame(f)?;
        }
        if frames.is_empty() {
            return if fin { self.finish().await } else { Ok(()) };
        }
        if cost > u64::from(self.shared.peer_window) {
            // More than the peer's window at once: send them one by one.
            let n = frames.len();
            for (i, f) in frames.into_iter().enumerate() {
                self.send_inner(f, fin && i + 1 == n).await?;
            }
            return Ok(());
        }
        self.acquire(cost, fin).await?;
        let n = frames.len();
        self.enqueue(|id| {
            frames
                .into_iter()
                .enumerate()
                .map(|(i, f)| Out::Data { id, header: Some(f.header), payload: f.payload, fin: fin && i + 1 == n })
                .collect::<Vec<_>>()
        })
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        let mut inner = lock(&self.stream.inner);
        match inner.send_half {
            SendHalf::Open => {
                inner.send_half = SendHalf::Done;
                drop(inner);
                self.enqueue(|id| [Out::Data { id, header: None, payload: Bytes::new(), fin: true }])
            }
            // Finishing twice, or after the peer stopped reading, has nothing left to do.
            SendHalf::Done | SendHalf::Stopped(_) => Ok(()),
        }
    }

    fn reset(&mut self, code: u32) {
        let mut inner = lock(&self.stream.inner);
        if inner.send_half == SendHalf::Open {
            inner.send_half = SendHalf::Done;
            // A stream that never sent a frame does not exist for the peer.
            let id = self.stream.id();
            if id != 0 {
                let _ = self.shared.writer.write_or_push([Out::Reset { id, code }]);
            }
        }
    }

    fn id(&self) -> u64 {
        self.stream.id().into()
    }
}

impl Drop for MuxSend {
    fn drop(&mut self) {
        self.reset(code::CANCELLED);
        let mut inner = lock(&self.stream.inner);
        inner.send_alive = false;
        let dead = !inner.recv_alive;
        drop(inner);
        if dead {
            self.shared.forget(&self.stream);
        }
    }
}

pub(crate) struct MuxRecv {
    pub(crate) shared: Arc<Shared>,
    pub(crate) stream: Arc<StreamShared>,
    pub(crate) events: mpsc::UnboundedReceiver<Event>,
    pub(crate) done: bool,
}

impl MuxRecv {
    fn consumed(&self, cost: u64) {
        let sh = &self.shared;
        if sh.buffered.fetch_sub(cost, Ordering::AcqRel) > sh.conn_window {
            sh.budget_notify.notify_waiters();
        }
        let mut inner = lock(&self.stream.inner);
        let inc = inner.recv.on_consume(cost);
        // No credit goes back once the peer finished: it will send nothing more.
        if let (Some(inc), RecvHalf::Open) = (inc, inner.recv_half) {
            let _ = sh.writer.write_or_push([Out::Window { id: self.stream.id(), inc }]);
        }
    }
}

#[async_trait]
impl RecvStream for MuxRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        if self.done {
            return Ok(None);
        }
        match self.events.recv().await {
            Some(Event::Frame(r, cost)) => {
                self.consumed(cost);
                Ok(Some(r))
            }
            Some(Event::Fin) => {
                self.done = true;
                Ok(None)
            }
            Some(Event::Reset(code)) => {
                self.done = true;
                Err(StreamError::Reset { peer: self.shared.peer.clone(), stream: self.stream.id().into(), code })
            }
            Some(Event::Error(e)) => Err(e),
            None => Err(self.shared.error()),
        }
    }

    fn place(&mut self, target: Option<Placement>) {
        lock(&self.stream.inner).placement = target;
    }

    fn id(&self) -> u64 {
        self.stream.id().into()
    }
}

impl Drop for MuxRecv {
    fn drop(&mut self) {
        let mut inner = lock(&self.stream.inner);
        if inner.recv_half == RecvHalf::Open {
            inner.recv_half = RecvHalf::Dropped;
            let id = self.stream.id();
            if id != 0 {
                let _ = self.shared.writer.write_or_push([Out::Stop { id, code: code::CANCELLED }]);
            }
        }
        inner.events = None;
        inner.placement = None;
        inner.recv_alive = false;
        let dead = !inner.send_alive;
        drop(inner);
        // Frames still queued count against the connection window until released.
        while let Ok(ev) = self.events.try_recv() {
            if let Event::Frame(_, cost) = ev {
                self.shared.buffered.fetch_sub(cost, Ordering::AcqRel);
            }
        }
        self.shared.budget_notify.notify_waiters();
        if dead {
            self.shared.forget(&self.stream);
        }
    }
}
