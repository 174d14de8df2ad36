//! The stream handles: [`SendStream`] and [`RecvStream`] over a mux
//! connection. They ask the stream's [`StreamState`](super::state::StreamState)
//! what to do, and do it: wait for credit, hand frames to the writer,
//! return credit, send STOP or RESET when dropped.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use async_trait::async_trait;
use bytes::Bytes;

use super::frame::code;
use super::shared::{Event, Events, Shared, StreamShared};
use super::state::SendPoll;
use super::writer::Out;
use crate::sync::lock;
use crate::{Frame, Placement, Received, RecvStream, SendStream, StreamError};

/// The sending half of a mux stream.
pub(crate) struct MuxSend {
    pub(crate) shared: Arc<Shared>,
    pub(crate) stream: Arc<StreamShared>,
}

impl MuxSend {
    /// Checks `frame` against the peer's limits and makes it a DATA item
    /// (its stream id is 0 until `Out::set_stream`).
    fn check_frame(&self, frame: Frame, fin: bool) -> Result<Out, StreamError> {
        let sh = &self.shared;
        let payload_len = frame.payload.len() as u64;
        if payload_len > u64::from(sh.peer_max_payload) {
            return Err(StreamError::LimitExceeded {
                peer: sh.peer.clone(),
                what: "frame payload",
                size: payload_len,
                limit: sh.peer_max_payload.into(),
            });
        }
        let out = Out::data(0, Some(frame.header), frame.payload, fin);
        let cost = out.cost();
        if cost > u64::from(sh.peer_window) {
            return Err(StreamError::LimitExceeded {
                peer: sh.peer.clone(),
                what: "frame (the peer's stream window)",
                size: cost,
                limit: sh.peer_window.into(),
            });
        }
        Ok(out)
    }

    /// Takes `cost` bytes of credit (with `fin`, also closes this
    /// direction) if they are there: None when the caller must wait.
    fn try_acquire(&self, cost: u64, fin: bool) -> Option<Result<(), StreamError>> {
        let sh = &self.shared;
        let s = &self.stream;
        if sh.closed.load(Ordering::Acquire) {
            return Some(Err(sh.error()));
        }
        let poll = lock(&s.inner).state.poll_send(cost, fin);
        let stream = s.id().into();
        match poll {
            SendPoll::Ready => Some(Ok(())),
            SendPoll::Finished => Some(Err(StreamError::Finished { peer: sh.peer.clone(), stream })),
            SendPoll::Stopped(code) => Some(Err(StreamError::Stopped { peer: sh.peer.clone(), stream, code })),
            SendPoll::Blocked => None,
        }
    }

    /// Waits for `cost` bytes of credit and takes them; with `fin`, also
    /// closes this direction.
    async fn acquire(&self, cost: u64, fin: bool) -> Result<(), StreamError> {
        loop {
            // Registered before the credit is checked: a grant between the
            // check and the wait still wakes this task.
            let notified = self.stream.send_notify.notified();
            let mut notified = pin!(notified);
            notified.as_mut().enable();
            match self.try_acquire(cost, fin) {
                Some(r) => return r,
                None => notified.await,
            }
        }
    }

    /// [`SendStream::send`] or, with `fin`, [`SendStream::send_last`],
    /// callable without a boxed future.
    pub(crate) async fn send_inner(&mut self, frame: Frame, fin: bool) -> Result<(), StreamError> {
        let out = self.check_frame(frame, fin)?;
        self.send_out(out).await
    }

    /// Sends one checked DATA item once its cost in credit is there.
    async fn send_out(&mut self, mut out: Out) -> Result<(), StreamError> {
        self.acquire(out.cost(), out.is_fin()).await?;
        self.enqueue(|id| {
            out.set_stream(id);
            [out]
        })
    }

    /// Checks `frames` and makes them DATA items (the last with `fin`);
    /// returns them and their total cost.
    fn prepare(&self, frames: Vec<Frame>, fin: bool) -> Result<(Vec<Out>, u64), StreamError> {
        let n = frames.len();
        let mut cost = 0;
        let mut outs = Vec::with_capacity(n);
        for (i, f) in frames.into_iter().enumerate() {
            let out = self.check_frame(f, fin && i + 1 == n)?;
            cost += out.cost();
            outs.push(out);
        }
        Ok((outs, cost))
    }

    /// Hands checked items whose credit was taken to the writer.
    fn enqueue_all(&self, mut outs: Vec<Out>) -> Result<(), StreamError> {
        self.enqueue(|id| {
            for out in &mut outs {
                out.set_stream(id);
            }
            outs
        })
    }

    /// [`SendStream::send_batch`], callable without a boxed future.
    pub(crate) async fn send_frames(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        if frames.is_empty() {
            return if fin { self.finish_now() } else { Ok(()) };
        }
        let (outs, cost) = self.prepare(frames, fin)?;
        if cost > u64::from(self.shared.peer_window) {
            // More than the peer's window at once: send them one by one.
            for out in outs {
                self.send_out(out).await?;
            }
            return Ok(());
        }
        self.acquire(cost, fin).await?;
        self.enqueue_all(outs)
    }

    /// [`SendStream::try_send_batch`]: sends now when the credit is there.
    pub(crate) fn try_send_frames(
        &mut self,
        frames: Vec<Frame>,
        fin: bool,
    ) -> Result<Result<(), StreamError>, Vec<Frame>> {
        if frames.is_empty() {
            return Ok(if fin { self.finish_now() } else { Ok(()) });
        }
        let (outs, cost) = match self.prepare(frames, fin) {
            Ok(p) => p,
            Err(e) => return Ok(Err(e)),
        };
        let taken = if cost > u64::from(self.shared.peer_window) { None } else { self.try_acquire(cost, fin) };
        match taken {
            Some(Ok(())) => Ok(self.enqueue_all(outs)),
            Some(Err(e)) => Ok(Err(e)),
            // No credit yet (or more than a window): the caller waits.
            None => Err(outs.into_iter().filter_map(Out::into_frame).collect()),
        }
    }

    /// [`SendStream::finish`] (it never waits).
    pub(crate) fn finish_now(&mut self) -> Result<(), StreamError> {
        // Finishing twice, or after the peer stopped reading, has nothing left to do.
        let send_fin = lock(&self.stream.inner).state.finish();
        if send_fin {
            self.enqueue(|id| [Out::data(id, None, Bytes::new(), true)])?;
        }
        Ok(())
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
        let id = st
            .streams
            .open_local(s.clone())
            .map_err(|e| StreamError::Refused { peer: sh.peer.clone(), reason: e.to_string() })?;
        s.id.store(id, Ordering::Release);
        sh.count_streams(&st);
        let r = sh.writer.write_or_push(frames(id));
        drop(st);
        // A receiver dropped before the stream had an id could not say
        // STOP: it says it now, so the peer does not send what nobody reads.
        if r.is_ok() && lock(&s.inner).state.recv_half() == super::state::RecvHalf::Dropped {
            let _ = sh.writer.write_or_push([Out::Stop { id, code: code::CANCELLED }]);
        }
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
        self.send_frames(frames, fin).await
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        self.finish_now()
    }

    fn try_send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<Result<(), StreamError>, Vec<Frame>> {
        self.try_send_frames(frames, fin)
    }

    async fn stopped(&mut self) -> StreamError {
        stopped(&self.stream, &self.shared).await
    }

    fn stop_signal(&self) -> Option<Arc<dyn crate::StopSignal>> {
        Some(self.stream.clone())
    }

    fn reset(&mut self, code: u32) {
        let inner = &mut *lock(&self.stream.inner);
        // A stream that never sent a frame does not exist for the peer.
        let id = self.stream.id();
        if inner.state.reset() && id != 0 {
            let _ = self.shared.writer.write_or_push([Out::Reset { id, code }]);
        }
    }

    fn id(&self) -> u64 {
        self.stream.id().into()
    }
}

impl Drop for MuxSend {
    fn drop(&mut self) {
        self.reset(code::CANCELLED);
        let forget = lock(&self.stream.inner).state.send_dropped();
        if forget {
            self.shared.forget(&self.stream);
        }
    }
}

/// The receiving half of a mux stream.
pub(crate) struct MuxRecv {
    pub(crate) shared: Arc<Shared>,
    pub(crate) stream: Arc<StreamShared>,
    pub(crate) done: bool,
}

impl MuxRecv {
    pub(crate) fn new(shared: Arc<Shared>, stream: Arc<StreamShared>) -> Self {
        Self { shared, stream, done: false }
    }

    /// [`RecvStream::recv`], callable without a boxed future.
    pub(crate) async fn recv_next(&mut self) -> Result<Option<Received>, StreamError> {
        if let Some(r) = self.settled() {
            return r;
        }
        let event = self.next_event().await;
        self.on_event(event)
    }

    /// The next event the reader queued for this stream (cancel-safe:
    /// nothing is taken until it is returned).
    async fn next_event(&self) -> Option<Event> {
        if self.stream.id() == 0 {
            return self.next_event_unnumbered().await;
        }
        std::future::poll_fn(|cx| match lock(&self.stream.inner).events.as_mut() {
            Some(ev) => ev.poll_next(cx).map(Some),
            None => std::task::Poll::Ready(None),
        })
        .await
    }

    /// [`Self::next_event`] on a stream that has no id yet (nothing sent):
    /// it is not in the connection's table, so a failure of the
    /// connection does not queue its error here; this wait also ends when
    /// the connection closes (None: the caller reports its error).
    async fn next_event_unnumbered(&self) -> Option<Event> {
        let closed = self.shared.closed_notify.notified();
        let mut closed = pin!(closed);
        closed.as_mut().enable();
        std::future::poll_fn(|cx| {
            if let Some(ev) = lock(&self.stream.inner).events.as_mut()
                && let std::task::Poll::Ready(e) = ev.poll_next(cx)
            {
                return std::task::Poll::Ready(Some(e));
            }
            if self.shared.closed.load(Ordering::Acquire) || closed.as_mut().poll(cx).is_ready() {
                return std::task::Poll::Ready(None);
            }
            std::task::Poll::Pending
        })
        .await
    }

    fn consumed(&self, cost: u64) {
        let sh = &self.shared;
        if sh.buffered.fetch_sub(cost, Ordering::AcqRel) > sh.conn_window {
            sh.budget_notify.notify_waiters();
        }
        let mut inner = lock(&self.stream.inner);
        if let Some(inc) = inner.state.on_consumed(cost) {
            let _ = sh.writer.write_or_push([Out::Window { id: self.stream.id(), inc }]);
        }
    }

    /// What `recv` returns without waiting for an event: the end, or a
    /// reset (frames still queued dropped). None: look at the events.
    fn settled(&mut self) -> Option<Result<Option<Received>, StreamError>> {
        if self.done {
            return Some(Ok(None));
        }
        let (reset, drained) = {
            let inner = lock(&self.stream.inner);
            (inner.reset, inner.events.as_ref().is_none_or(Events::is_empty))
        };
        let Some(code) = reset else {
            // The connection failed and nothing it delivered is left: its
            // error, on every call (also for a stream its failure's notice
            // did not reach, and after that notice was read once).
            return (drained && self.shared.closed.load(Ordering::Acquire)).then(|| Err(self.shared.error()));
        };
        // The sender abandoned the stream: frames still queued are dropped
        // (their credit returned), so a receiver stops at once instead of
        // working through what a cancelled call had sent.
        let shared = &self.shared;
        let cost = lock(&self.stream.inner).events.as_mut().map_or(0, |e| e.discard(|h| shared.discarded(h)));
        if cost > 0 {
            self.consumed(cost);
        }
        self.done = true;
        Some(Err(StreamError::Reset { peer: self.shared.peer.clone(), stream: self.stream.id().into(), code }))
    }

    /// What `recv` returns for `event` (None: the events are gone with the connection).
    fn on_event(&mut self, event: Option<Event>) -> Result<Option<Received>, StreamError> {
        match event {
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
}

#[async_trait]
impl RecvStream for MuxRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        self.recv_next().await
    }

    fn try_recv(&mut self) -> Option<Result<Option<Received>, StreamError>> {
        if let Some(r) = self.settled() {
            return Some(r);
        }
        let event = match lock(&self.stream.inner).events.as_mut() {
            Some(ev) => Some(ev.try_next()?),
            None => None,
        };
        Some(self.on_event(event))
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
        let dropped = inner.state.recv_dropped();
        let id = self.stream.id();
        if dropped.stop && id != 0 {
            let _ = self.shared.writer.write_or_push([Out::Stop { id, code: code::CANCELLED }]);
        }
        let events = inner.events.take();
        inner.placement = None;
        drop(inner);
        // Frames still queued count against the connection window until
        // released; the reader may be waiting for that room.
        let cost = events.map_or(0, |mut e| e.discard(|h| self.shared.discarded(h)));
        if cost > 0 {
            self.shared.buffered.fetch_sub(cost, Ordering::AcqRel);
            self.shared.budget_notify.notify_waiters();
        }
        if dropped.forget {
            self.shared.forget(&self.stream);
        }
    }
}

/// Resolves once the peer has stopped reading `stream` or the connection
/// failed, with the error a send would get then.
async fn stopped(stream: &StreamShared, shared: &Shared) -> StreamError {
    loop {
        // Registered before the state is read: a STOP (or a failure)
        // between the check and the wait still wakes this task.
        let notified = stream.send_notify.notified();
        let mut notified = pin!(notified);
        notified.as_mut().enable();
        if shared.closed.load(Ordering::Acquire) {
            return shared.error();
        }
        if let Some(code) = lock(&stream.inner).state.peer_stopped() {
            return StreamError::Stopped { peer: shared.peer.clone(), stream: stream.id().into(), code };
        }
        notified.await;
    }
}
