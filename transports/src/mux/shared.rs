//! What the reader task, the writer task and the stream handles of one mux
//! connection share: the [`state`](super::state) machine behind locks, the
//! writer, the per-stream event channels and the wake-ups.
//!
//! The stream table ([`Streams`]) sits under one connection lock and each
//! stream's [`StreamState`] under a lock of its own, so streams never wait
//! on each other's bookkeeping. No IO happens under either lock.

use std::collections::VecDeque;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tensorwire_proto::v1::FrameHeader;
use tokio::sync::Notify;

use super::frame::{self, code};
use super::state::{StreamState, Streams};
use super::writer::{Out, Writer};
use crate::sync::lock;
use crate::{Placement, Received, StreamError};

/// What the reader hands a stream's receiving handle.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Event {
    /// A frame and its cost in credit (returned when it is consumed).
    Frame(Received, u64),
    /// The peer finished.
    Fin,
    /// The peer reset the stream with this code.
    Reset(u32),
    /// The connection failed.
    Error(StreamError),
}

/// The events on their way from the reader to a stream's receiving
/// handle: a queue under the stream's own lock and the handle's waker (one
/// producer, one consumer; a channel per stream cost an allocation of its
/// own and a 32-slot block on each side of every call).
#[derive(Default)]
pub(crate) struct Events {
    queue: VecDeque<Event>,
    waker: Option<Waker>,
}

impl Events {
    /// Queues `ev` and wakes the receiving handle.
    pub(crate) fn send(&mut self, ev: Event) {
        self.queue.push_back(ev);
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }

    /// The next event, or Pending with the task's waker kept.
    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Event> {
        match self.queue.pop_front() {
            Some(ev) => Poll::Ready(ev),
            None => {
                match &mut self.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    w => *w = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }

    /// True when nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The next event if one is queued.
    pub(crate) fn try_next(&mut self) -> Option<Event> {
        self.queue.pop_front()
    }

    /// Drops what is queued, showing each frame's header to `each`;
    /// returns the credit of the frames dropped.
    pub(crate) fn discard(&mut self, mut each: impl FnMut(&FrameHeader)) -> u64 {
        let mut cost = 0;
        for ev in self.queue.drain(..) {
            if let Event::Frame(r, c) = ev {
                each(&r.header);
                cost += c;
            }
        }
        cost
    }
}

/// A stream's mutable part.
pub(crate) struct StreamInner {
    /// The sans-IO state: half-closes and windows.
    pub(crate) state: StreamState,
    /// To the receiving handle; None once it is dropped.
    pub(crate) events: Option<Events>,
    /// Where the receiver wants a tensor's payloads written.
    pub(crate) placement: Option<Placement>,
    /// The peer reset the stream with this code: what it sent before and
    /// is still queued is discarded, not delivered (as HTTP/2's RST_STREAM).
    pub(crate) reset: Option<u32>,
    /// Set once the peer stopped reading the stream or the connection
    /// failed: the error a send gets ([`crate::StopSignal`]).
    pub(crate) gone: Option<StreamError>,
    /// The task polling this stream's [`crate::StopSignal`], woken when
    /// `gone` is set.
    pub(crate) gone_waker: Option<Waker>,
}

impl StreamInner {
    /// Records why this stream's sender cannot go on (the first reason
    /// stays) and wakes the task watching for it.
    pub(crate) fn set_gone(&mut self, why: impl FnOnce() -> StreamError) {
        if self.gone.is_none() {
            self.gone = Some(why());
        }
        if let Some(w) = self.gone_waker.take() {
            w.wake();
        }
    }
}

impl crate::StopSignal for StreamShared {
    fn poll_stopped(&self, cx: &mut Context<'_>) -> Poll<StreamError> {
        let inner = &mut *lock(&self.inner);
        if let Some(e) = &inner.gone {
            return Poll::Ready(e.clone());
        }
        match &inner.gone_waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => inner.gone_waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

/// One stream, shared by its two handles and the reader.
pub(crate) struct StreamShared {
    /// 0 until the stream's first frame is sent (locally opened streams get
    /// their id then, so new ids reach the wire in increasing order).
    pub(crate) id: AtomicU32,
    pub(crate) inner: Mutex<StreamInner>,
    /// Wakes a sender waiting for credit (or for news that it cannot send).
    pub(crate) send_notify: Notify,
}

impl StreamShared {
    pub(crate) fn id(&self) -> u32 {
        self.id.load(Ordering::Acquire)
    }
}

/// The connection's mutable part.
pub(crate) struct ConnState {
    pub(crate) streams: Streams<Arc<StreamShared>>,
    pub(crate) error: Option<StreamError>,
}

/// What a transport does with the header of a DATA frame that nobody will
/// read (its stream's receiver is gone, or the stream was refused or is
/// over): `ucx://` receives and drops the payload such a frame announced
/// through UCX, so that the peer's send of it completes.
pub(crate) type DiscardHook = Box<dyn Fn(&FrameHeader) + Send + Sync>;

/// Everything one connection's tasks and handles share.
pub(crate) struct Shared {
    pub(crate) peer: String,
    pub(crate) transport: &'static str,
    pub(crate) local: bool,
    pub(crate) limits: frame::FrameLimits,
    pub(crate) my_window: u32,
    pub(crate) peer_window: u32,
    pub(crate) peer_max_payload: u32,
    /// Bytes of delivered, unconsumed frames above which the reader pauses.
    pub(crate) conn_window: u64,
    /// Frames that arrived so far (the keep-alive task watches it change;
    /// a counter, not a clock read per frame).
    pub(crate) frames_heard: AtomicU64,
    pub(crate) state: Mutex<ConnState>,
    pub(crate) writer: Writer,
    pub(crate) closed: AtomicBool,
    pub(crate) closed_notify: Notify,
    /// Bytes of delivered, unconsumed frames.
    pub(crate) buffered: AtomicU64,
    pub(crate) budget_notify: Notify,
    /// Set by the transport that needs it (see [`DiscardHook`]).
    pub(crate) discard_hook: Option<DiscardHook>,
}

impl Shared {
    pub(crate) fn error(&self) -> StreamError {
        lock(&self.state)
            .error
            .clone()
            .unwrap_or_else(|| StreamError::ConnectionClosed { peer: self.peer.clone(), reason: "closed".into() })
    }

    /// A DATA frame with this header is dropped unread.
    pub(crate) fn discarded(&self, header: &FrameHeader) {
        if let Some(hook) = &self.discard_hook {
            hook(header);
        }
    }

    /// Records that a frame arrived (the peer is alive); only the reader
    /// task counts.
    pub(crate) fn heard(&self) {
        crate::sync::bump(&self.frames_heard);
    }

    /// Closes the connection with a GOAWAY naming `reason`.
    pub(crate) fn close(&self, reason: &str) {
        if !self.closed.load(Ordering::Acquire) {
            let _ = self.writer.push(Out::GoAway { code: code::NO_ERROR, reason: reason.to_string() });
            self.fail(StreamError::ConnectionClosed {
                peer: self.peer.clone(),
                reason: format!("closed locally: {reason}"),
            });
        }
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
            let mut inner = lock(&s.inner);
            if let Some(ev) = &mut inner.events {
                ev.send(Event::Error(err.clone()));
            }
            inner.set_gone(|| err.clone());
            drop(inner);
            s.send_notify.notify_waiters();
        }
        self.closed_notify.notify_waiters();
        self.budget_notify.notify_waiters();
    }

    /// A new stream (id 0 for a local one until its first frame).
    pub(crate) fn new_stream(&self, id: u32) -> Arc<StreamShared> {
        Arc::new(StreamShared {
            id: AtomicU32::new(id),
            inner: Mutex::new(StreamInner {
                state: StreamState::new(self.peer_window, self.my_window),
                events: Some(Events::default()),
                placement: None,
                reset: None,
                gone: None,
                gone_waker: None,
            }),
            send_notify: Notify::new(),
        })
    }

    /// Keeps the writer's count of open streams (its direct-write rule) in step.
    pub(crate) fn count_streams(&self, st: &ConnState) {
        self.writer.open_streams.store(st.streams.len(), Ordering::Relaxed);
    }

    /// Removes a stream both of whose handles are gone.
    pub(crate) fn forget(&self, s: &StreamShared) {
        let id = s.id();
        if id == 0 {
            return;
        }
        let mut st = lock(&self.state);
        if st.streams.forget(id) {
            self.count_streams(&st);
        }
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
