//! The mux driver: one reader task and one writer task per socket, streams
//! as handles that talk to them through channels.
//!
//! * The **writer** drains a queue of outgoing frames, batches whatever is
//!   queued into one vectored write (headers copied into a scratch buffer,
//!   large payloads passed by reference), so many small calls share a
//!   syscall and large payloads are never copied.
//! * The **reader** parses frames, enforces limits and credit before
//!   allocating, and hands each frame to its stream's queue. Payloads go
//!   straight into a stream's [`Placement`] buffer when one is registered.
//!   It stops reading the socket while more than the connection window sits
//!   unconsumed, so memory is bounded per connection too.

use std::collections::HashMap;
use std::io::IoSlice;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

use super::flow::{RecvWindow, SendWindow};
use super::frame::{self, FLAG_FIN, HEAD_LEN, Head, Kind, PREFACE_LEN, Preface, code};
use crate::{
    Connection, ConnectionInfo, Frame, FrameHeader, Incoming, Payload, Placement, Received, RecvStream, SendStream,
    StreamError, StreamKind, TransportConfig,
};

/// Which end of the connection this is: clients open odd stream ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The connecting side.
    Client,
    /// The accepting side.
    Server,
}

/// Read buffer size: many small frames per read, and at most this much of a
/// large payload is copied out of it (the rest is read in place).
const READ_BUF: usize = 64 << 10;
/// Payloads up to this size are copied into the writer's scratch buffer so a
/// batch of small frames is one contiguous write.
const INLINE_PAYLOAD: usize = 8 << 10;

// Nearly every queued item is a frame; boxing frames to shrink the rare
// control items would cost an allocation per frame.
#[allow(clippy::large_enum_variant)]
enum Out {
    Data { id: u32, header: Option<FrameHeader>, payload: Bytes, fin: bool },
    Window { id: u32, inc: u32 },
    Reset { id: u32, code: u32 },
    Stop { id: u32, code: u32 },
    GoAway { code: u32, reason: String },
    Pong(u32),
}

#[allow(clippy::large_enum_variant)]
enum Event {
    Frame(Received, u64),
    Fin,
    Reset(u32),
    Error(StreamError),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SendHalf {
    Open,
    Done,
    Stopped(u32),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum RecvHalf {
    Open,
    Fin,
    Reset,
    Dropped,
}

struct StreamInner {
    send: SendWindow,
    send_half: SendHalf,
    recv: RecvWindow,
    recv_half: RecvHalf,
    events: Option<mpsc::UnboundedSender<Event>>,
    placement: Option<Placement>,
    send_alive: bool,
    recv_alive: bool,
}

struct StreamShared {
    /// 0 until the stream's first frame is sent (locally opened streams get
    /// their id then, so new ids reach the wire in increasing order).
    id: AtomicU32,
    remote: bool,
    inner: Mutex<StreamInner>,
    send_notify: Notify,
}

impl StreamShared {
    fn id(&self) -> u32 {
        self.id.load(Ordering::Acquire)
    }
}

struct ConnState {
    streams: HashMap<u32, Arc<StreamShared>>,
    next_id: u32,
    last_remote: u32,
    remote_open: u32,
    error: Option<StreamError>,
}

struct Shared {
    role: Role,
    peer: String,
    transport: &'static str,
    local: bool,
    limits: frame::Limits,
    my_window: u32,
    peer_window: u32,
    peer_max_payload: u32,
    max_streams: u32,
    conn_window: u64,
    idle_timeout: Option<Duration>,
    state: Mutex<ConnState>,
    out: mpsc::UnboundedSender<Out>,
    accept_tx: mpsc::UnboundedSender<Incoming>,
    closed: AtomicBool,
    closed_notify: Notify,
    buffered: AtomicU64,
    budget_notify: Notify,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks would be a bug in this module; the
    // data stays consistent enough to report errors, so don't propagate poison.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn error(&self) -> StreamError {
        lock(&self.state)
            .error
            .clone()
            .unwrap_or_else(|| StreamError::ConnectionClosed { peer: self.peer.clone(), reason: "closed".into() })
    }

    fn protocol(&self, reason: impl Into<String>) -> StreamError {
        StreamError::Protocol { peer: self.peer.clone(), reason: reason.into() }
    }

    /// Marks the connection failed: every stream learns `err`, every waiter wakes.
    fn fail(&self, err: StreamError) {
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

    fn new_stream(&self, id: u32, remote: bool) -> (Arc<StreamShared>, mpsc::UnboundedReceiver<Event>) {
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

    fn forget(&self, s: &StreamShared) {
        let id = s.id();
        if id == 0 {
            return;
        }
        let mut st = lock(&self.state);
        if st.streams.remove(&id).is_some() && s.remote {
            st.remote_open -= 1;
        }
    }

    fn is_remote_id(&self, id: u32) -> bool {
        // Clients open odd ids, servers even ones.
        (id % 2 == 1) == (self.role == Role::Server)
    }

    async fn wait_closed(&self) {
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
    W: AsyncWrite + Unpin + Send + 'static,
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
    let (out_tx, out_rx) = mpsc::unbounded_channel();
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
        out: out_tx,
        accept_tx,
        closed: AtomicBool::new(false),
        closed_notify: Notify::new(),
        buffered: AtomicU64::new(0),
        budget_notify: Notify::new(),
    });
    tokio::spawn(writer(shared.clone(), wr, out_rx));
    tokio::spawn(reader(shared.clone(), rd));
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
            let _ = self.shared.out.send(Out::GoAway { code: code::NO_ERROR, reason: reason.to_string() });
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

struct MuxSend {
    shared: Arc<Shared>,
    stream: Arc<StreamShared>,
}

impl MuxSend {
    async fn send_inner(&mut self, frame: Frame, fin: bool) -> Result<(), StreamError> {
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
                    SendHalf::Done => return Err(StreamError::Finished { peer: sh.peer.clone(), stream: s.id().into() }),
                    SendHalf::Stopped(code) => {
                        return Err(StreamError::Stopped { peer: sh.peer.clone(), stream: s.id().into(), code });
                    }
                    SendHalf::Open => {
                        if inner.send.try_consume(cost) {
                            if fin {
                                inner.send_half = SendHalf::Done;
                            }
                            break;
                        }
                    }
                }
            }
            notified.await;
        }
        self.enqueue(Some(frame.header), frame.payload, fin)
    }

    /// Queues a DATA frame. A locally opened stream's first frame gets the
    /// next id, assigned and queued under the connection lock: the peer
    /// treats any id at or below the highest it has seen as an old stream,
    /// so new ids must reach the wire in increasing order.
    fn enqueue(&self, header: Option<FrameHeader>, payload: Bytes, fin: bool) -> Result<(), StreamError> {
        let sh = &self.shared;
        let s = &self.stream;
        let id = s.id();
        if id != 0 {
            return sh.out.send(Out::Data { id, header, payload, fin }).map_err(|_| sh.error());
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
        sh.out.send(Out::Data { id, header, payload, fin }).map_err(|_| sh.error())
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

    async fn finish(&mut self) -> Result<(), StreamError> {
        let sh = &self.shared;
        let mut inner = lock(&self.stream.inner);
        match inner.send_half {
            SendHalf::Open => {
                inner.send_half = SendHalf::Done;
                drop(inner);
                if sh.closed.load(Ordering::Acquire) {
                    return Err(sh.error());
                }
                self.enqueue(None, Bytes::new(), true)
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
                let _ = self.shared.out.send(Out::Reset { id, code });
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

struct MuxRecv {
    shared: Arc<Shared>,
    stream: Arc<StreamShared>,
    events: mpsc::UnboundedReceiver<Event>,
    done: bool,
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
            let _ = sh.out.send(Out::Window { id: self.stream.id(), inc });
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
                let _ = self.shared.out.send(Out::Stop { id, code: code::CANCELLED });
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

async fn writer<W: AsyncWrite + Unpin>(shared: Arc<Shared>, mut wr: W, mut rx: mpsc::UnboundedReceiver<Out>) {
    let mut scratch = BytesMut::with_capacity(64 << 10);
    let mut batch: Vec<Out> = Vec::with_capacity(64);
    // Ranges of `scratch` interleaved with borrowed payloads, in write order.
    let mut parts: Vec<(usize, usize, Option<Bytes>)> = Vec::with_capacity(64);
    let mut closing = false;
    while !closing {
        // Queued frames go out first; once the connection is closed, what is
        // still queued (a GOAWAY, say) is written and the writer ends.
        let first = tokio::select! {
            biased;
            o = rx.recv() => o,
            _ = shared.wait_closed() => None,
        };
        match first {
            Some(o) => batch.push(o),
            None => closing = true,
        }
        while batch.len() < 512 {
            match rx.try_recv() {
                Ok(o) => batch.push(o),
                Err(_) => break,
            }
        }
        if batch.is_empty() {
            break;
        }
        scratch.clear();
        parts.clear();
        let mut start = 0;
        for o in batch.drain(..) {
            let mut payload_ref = None;
            match o {
                Out::Data { id, header, payload, fin } => {
                    let meta_len = header.as_ref().map_or(0, Message::encoded_len);
                    Head {
                        stream: id,
                        kind: Kind::Data,
                        flags: if fin { FLAG_FIN } else { 0 },
                        meta_len: meta_len as u32,
                        value: payload.len() as u32,
                    }
                    .encode(&mut scratch);
                    if let Some(h) = header {
                        h.encode(&mut scratch).expect("BytesMut grows");
                    }
                    if payload.len() <= INLINE_PAYLOAD {
                        scratch.put_slice(&payload);
                    } else {
                        payload_ref = Some(payload);
                    }
                }
                Out::Window { id, inc } => {
                    Head { stream: id, kind: Kind::Window, flags: 0, meta_len: 0, value: inc }.encode(&mut scratch)
                }
                Out::Reset { id, code } => {
                    Head { stream: id, kind: Kind::Reset, flags: 0, meta_len: 0, value: code }.encode(&mut scratch)
                }
                Out::Stop { id, code } => {
                    Head { stream: id, kind: Kind::Stop, flags: 0, meta_len: 0, value: code }.encode(&mut scratch)
                }
                Out::Pong(v) => {
                    Head { stream: 0, kind: Kind::Pong, flags: 0, meta_len: 0, value: v }.encode(&mut scratch)
                }
                Out::GoAway { code, reason } => {
                    let r = &reason.as_bytes()[..reason.len().min(1024)];
                    Head { stream: 0, kind: Kind::GoAway, flags: 0, meta_len: r.len() as u32, value: code }
                        .encode(&mut scratch);
                    scratch.put_slice(r);
                    closing = true;
                }
            }
            if let Some(p) = payload_ref {
                parts.push((start, scratch.len(), Some(p)));
                start = scratch.len();
            }
        }
        parts.push((start, scratch.len(), None));
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len() * 2);
        for (a, b, p) in &parts {
            if b > a {
                slices.push(IoSlice::new(&scratch[*a..*b]));
            }
            if let Some(p) = p {
                slices.push(IoSlice::new(p));
            }
        }
        if let Err(e) = write_all_vectored(&mut wr, &mut slices).await {
            shared.fail(StreamError::io(&shared.peer, &e));
            return;
        }
    }
    let _ = wr.shutdown().await;
}

async fn write_all_vectored<W: AsyncWrite + Unpin>(wr: &mut W, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !slices.is_empty() {
        let n = wr.write_vectored(slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

async fn reader<R: AsyncRead + Unpin>(shared: Arc<Shared>, mut rd: R) {
    let mut buf = BytesMut::with_capacity(READ_BUF);
    let result = tokio::select! {
        r = read_frames(&shared, &mut rd, &mut buf) => r,
        _ = shared.wait_closed() => return,
    };
    let err = match result {
        Ok(()) => {
            StreamError::ConnectionClosed { peer: shared.peer.clone(), reason: "the peer closed the connection".into() }
        }
        Err(e) => {
            if let StreamError::Protocol { reason, .. } = &e {
                tracing::warn!(peer = %shared.peer, %reason, "closing connection: protocol violation");
                let _ = shared.out.send(Out::GoAway { code: code::PROTOCOL, reason: reason.clone() });
            }
            e
        }
    };
    shared.fail(err);
}

/// Reads until `buf` holds `n` bytes. Ok(false): clean EOF before any byte.
async fn fill<R: AsyncRead + Unpin>(
    shared: &Shared,
    rd: &mut R,
    buf: &mut BytesMut,
    n: usize,
) -> Result<bool, StreamError> {
    while buf.len() < n {
        let (spare, need) = (buf.capacity() - buf.len(), n - buf.len());
        if spare < need || spare < 4096 {
            buf.reserve(need.max(READ_BUF));
        }
        let read = rd.read_buf(buf);
        let got = match shared.idle_timeout {
            Some(t) => tokio::time::timeout(t, read).await.map_err(|_| StreamError::ConnectionClosed {
                peer: shared.peer.clone(),
                reason: format!("idle for {t:?}"),
            })?,
            None => read.await,
        }
        .map_err(|e| StreamError::io(&shared.peer, &e))?;
        if got == 0 {
            if buf.is_empty() {
                return Ok(false);
            }
            return Err(
                shared.protocol(format!("connection closed in the middle of a frame ({} of {n} bytes)", buf.len()))
            );
        }
    }
    Ok(true)
}

async fn read_frames<R: AsyncRead + Unpin>(
    shared: &Arc<Shared>,
    rd: &mut R,
    buf: &mut BytesMut,
) -> Result<(), StreamError> {
    loop {
        if !fill(shared, rd, buf, HEAD_LEN).await? {
            return Ok(());
        }
        let hb: [u8; HEAD_LEN] = buf[..HEAD_LEN].try_into().expect("filled");
        let head = Head::decode(&hb, &shared.limits).map_err(|e| shared.protocol(e.to_string()))?;
        buf.advance(HEAD_LEN);
        let meta_len = head.meta_len as usize;
        fill(shared, rd, buf, meta_len).await.and_then(|ok| {
            if ok || meta_len == 0 { Ok(()) } else { Err(shared.protocol("connection closed inside a frame header")) }
        })?;
        let meta = buf.split_to(meta_len).freeze();
        match head.kind {
            Kind::Data => on_data(shared, rd, buf, head, meta).await?,
            Kind::Window => {
                if let Some(s) = lookup(shared, head.stream) {
                    let r = lock(&s.inner).send.grant(head.value);
                    r.map_err(|e| shared.protocol(format!("stream {}: {e}", head.stream)))?;
                    s.send_notify.notify_waiters();
                }
            }
            Kind::Reset => {
                if let Some(s) = lookup(shared, head.stream) {
                    let mut inner = lock(&s.inner);
                    if inner.recv_half == RecvHalf::Open {
                        inner.recv_half = RecvHalf::Reset;
                        if let Some(tx) = &inner.events {
                            let _ = tx.send(Event::Reset(head.value));
                        }
                    }
                }
            }
            Kind::Stop => {
                if let Some(s) = lookup(shared, head.stream) {
                    let mut inner = lock(&s.inner);
                    if inner.send_half == SendHalf::Open {
                        inner.send_half = SendHalf::Stopped(head.value);
                    }
                    drop(inner);
                    s.send_notify.notify_waiters();
                }
            }
            Kind::GoAway => {
                let reason = String::from_utf8_lossy(&meta).into_owned();
                return Err(StreamError::ConnectionClosed {
                    peer: shared.peer.clone(),
                    reason: if head.value == code::NO_ERROR {
                        format!("the peer closed the connection ({reason})")
                    } else {
                        format!("the peer closed the connection with error {}: {reason}", head.value)
                    },
                });
            }
            Kind::Ping => {
                let _ = shared.out.send(Out::Pong(head.value));
            }
            Kind::Pong => {}
        }
    }
}

fn lookup(shared: &Shared, id: u32) -> Option<Arc<StreamShared>> {
    lock(&shared.state).streams.get(&id).cloned()
}

/// Finds or opens the stream a DATA frame belongs to. None: discard the frame.
fn stream_for_data(shared: &Arc<Shared>, id: u32) -> Result<Option<Arc<StreamShared>>, StreamError> {
    if id == 0 {
        return Err(shared.protocol("DATA on stream 0"));
    }
    let mut st = lock(&shared.state);
    if let Some(s) = st.streams.get(&id) {
        return Ok(Some(s.clone()));
    }
    if !shared.is_remote_id(id) || id <= st.last_remote {
        // A stream already closed here (or never opened): late data is dropped.
        return Ok(None);
    }
    st.last_remote = id;
    if st.remote_open >= shared.max_streams {
        drop(st);
        let _ = shared.out.send(Out::Reset { id, code: code::REFUSED });
        return Ok(None);
    }
    st.remote_open += 1;
    let (s, rx) = shared.new_stream(id, true);
    st.streams.insert(id, s.clone());
    drop(st);
    let incoming = Incoming {
        kind: None,
        send: Box::new(MuxSend { shared: shared.clone(), stream: s.clone() }),
        recv: Box::new(MuxRecv { shared: shared.clone(), stream: s.clone(), events: rx, done: false }),
    };
    if shared.accept_tx.send(incoming).is_err() {
        return Ok(None);
    }
    Ok(Some(s))
}

async fn on_data<R: AsyncRead + Unpin>(
    shared: &Arc<Shared>,
    rd: &mut R,
    buf: &mut BytesMut,
    head: Head,
    meta: Bytes,
) -> Result<(), StreamError> {
    let plen = head.payload_len() as usize;
    let header = if meta.is_empty() {
        if plen > 0 {
            return Err(shared.protocol(format!("stream {}: payload without a frame header", head.stream)));
        }
        None
    } else {
        Some(
            FrameHeader::decode(meta)
                .map_err(|e| shared.protocol(format!("stream {}: undecodable frame header: {e}", head.stream)))?,
        )
    };
    let Some(s) = stream_for_data(shared, head.stream)? else {
        return skip(shared, rd, buf, plen).await;
    };
    let cost = head.meta_len as u64 + plen as u64;
    let (placement, deliver) = {
        let mut inner = lock(&s.inner);
        match inner.recv_half {
            RecvHalf::Fin | RecvHalf::Reset => {
                return Err(shared.protocol(format!("stream {}: data after the end of the stream", head.stream)));
            }
            RecvHalf::Dropped => (None, false),
            RecvHalf::Open => {
                inner.recv.on_receive(cost).map_err(|e| shared.protocol(format!("stream {}: {e}", head.stream)))?;
                let place = match (&inner.placement, &header) {
                    (Some(p), Some(h)) => h
                        .placement_offset()
                        .filter(|&(id, off)| p.accepts(id, off, plen))
                        .map(|(_, off)| (p.clone(), off)),
                    _ => None,
                };
                (place, true)
            }
        }
    };
    if !deliver {
        return skip(shared, rd, buf, plen).await;
    }
    let payload = match placement {
        Some((p, off)) => {
            let mut g = p.lock().await;
            let dst = &mut g[off as usize..off as usize + plen];
            let have = buf.len().min(plen);
            dst[..have].copy_from_slice(&buf[..have]);
            buf.advance(have);
            if have < plen {
                rd.read_exact(&mut dst[have..]).await.map_err(|e| read_err(shared, &e))?;
            }
            Payload::Placed { offset: off, len: plen }
        }
        None => Payload::Bytes(read_payload(shared, rd, buf, plen).await?),
    };
    {
        let mut inner = lock(&s.inner);
        if inner.recv_alive && inner.recv_half == RecvHalf::Open {
            if let (Some(tx), Some(header)) = (&inner.events, header)
                && tx.send(Event::Frame(Received { header, payload }, cost)).is_ok() {
                    shared.buffered.fetch_add(cost, Ordering::AcqRel);
                }
            if head.fin() {
                inner.recv_half = RecvHalf::Fin;
                if let Some(tx) = &inner.events {
                    let _ = tx.send(Event::Fin);
                }
            }
        }
    }
    // Connection window: stop reading while too much sits unconsumed.
    loop {
        let n = shared.budget_notify.notified();
        let mut n = pin!(n);
        n.as_mut().enable();
        if shared.buffered.load(Ordering::Acquire) <= shared.conn_window || shared.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        n.await;
    }
}

fn read_err(shared: &Shared, e: &std::io::Error) -> StreamError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        shared.protocol("connection closed in the middle of a payload")
    } else {
        StreamError::io(&shared.peer, e)
    }
}

async fn read_payload<R: AsyncRead + Unpin>(
    shared: &Shared,
    rd: &mut R,
    buf: &mut BytesMut,
    n: usize,
) -> Result<Bytes, StreamError> {
    if buf.len() >= n {
        return Ok(buf.split_to(n).freeze());
    }
    if n <= READ_BUF {
        if !fill(shared, rd, buf, n).await? {
            return Err(shared.protocol("connection closed in the middle of a payload"));
        }
        return Ok(buf.split_to(n).freeze());
    }
    // Large: one allocation of exactly n (checked against max_frame_payload
    // by Head::decode), filled by reading straight into it.
    let mut dst = BytesMut::with_capacity(n);
    dst.extend_from_slice(&buf[..]);
    buf.clear();
    while dst.len() < n {
        let room = n - dst.len();
        let mut limited = (&mut dst).limit(room);
        let got = rd.read_buf(&mut limited).await.map_err(|e| read_err(shared, &e))?;
        if got == 0 {
            return Err(shared.protocol("connection closed in the middle of a payload"));
        }
    }
    Ok(dst.freeze())
}

async fn skip<R: AsyncRead + Unpin>(
    shared: &Shared,
    rd: &mut R,
    buf: &mut BytesMut,
    mut n: usize,
) -> Result<(), StreamError> {
    let have = buf.len().min(n);
    buf.advance(have);
    n -= have;
    let mut sink = [0u8; 8192];
    while n > 0 {
        let k = n.min(sink.len());
        rd.read_exact(&mut sink[..k]).await.map_err(|e| read_err(shared, &e))?;
        n -= k;
    }
    Ok(())
}
