//! The HTTP/2 bodies of `tensorwire.v1.TensorService` calls, on both
//! sides: [`OutBody`] sends frames (each as its head and its payload, two
//! DATA buffers, the payload never copied), [`MessageSource`] reads the
//! peer's messages with [`wire::Decoder`](super::wire::Decoder) (payloads
//! kept as the DATA frames' own bytes, except, on a server, what a call
//! holds of an unfinished message between frames: that is copied, and
//! counted in its connection's account, see `held`).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::Body as HttpBody;
use tensorwire_proto::v1;
use tokio::sync::mpsc;
use tonic::Status;
use tonic::codegen::http::HeaderMap;

use super::held::Share;
use super::wire::{self, Decoded, Limits, WireError};
use crate::sync::lock;
use crate::{StopSignal, StreamError};

/// What a stream's sending half queues: a frame, or (server) the status
/// that ends the call.
pub(crate) type Item = Result<v1::Frame, Status>;

/// A wire error as the gRPC status a peer (or our caller) sees.
pub(crate) fn wire_status(e: WireError) -> Status {
    match e {
        WireError::TooLarge { .. } | WireError::HeaderTooLarge { .. } => Status::resource_exhausted(e.to_string()),
        WireError::Compressed(_) => Status::unimplemented(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// How an [`OutBody`] ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// A request: the end of the stream (a client's reset ends it with an
    /// error, see `RequestBody`).
    Request,
    /// A response: trailers with `grpc-status`.
    Response,
    /// A unary response: trailers right after the first message (and an
    /// error status when the call ends without one).
    UnaryResponse,
}

/// Whether a call's response was given up by its client: set when the
/// response body is dropped before its end (the client reset the call,
/// or its connection went, and the HTTP/2 server dropped the body), so
/// that the server's work on the call can stop
/// ([`SendStream::stop_signal`](crate::SendStream::stop_signal)).
pub(crate) struct Abandoned {
    set: AtomicBool,
    waker: Mutex<Option<Waker>>,
    peer: Arc<str>,
    id: u64,
}

impl Abandoned {
    /// Not set yet, for the call `id` from `peer` (named in the error).
    pub(crate) fn new(peer: Arc<str>, id: u64) -> Self {
        Self { set: AtomicBool::new(false), waker: Mutex::new(None), peer, id }
    }

    /// The client gave the response up: wakes whoever waits.
    pub(crate) fn set(&self) {
        self.set.store(true, Ordering::Release);
        let waker = lock(&self.waker).take();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl StopSignal for Abandoned {
    fn poll_stopped(&self, cx: &mut Context<'_>) -> Poll<StreamError> {
        let stopped = || StreamError::Stopped { peer: self.peer.to_string(), stream: self.id, code: 0 };
        if self.set.load(Ordering::Acquire) {
            return Poll::Ready(stopped());
        }
        {
            let mut w = lock(&self.waker);
            if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                *w = Some(cx.waker().clone());
            }
        }
        // Set between the first look and the waker's registration: seen here.
        if self.set.load(Ordering::Acquire) {
            return Poll::Ready(stopped());
        }
        Poll::Pending
    }
}

/// Frames as a gRPC call's body.
pub(crate) struct OutBody {
    rx: mpsc::Receiver<Item>,
    /// A frame to send before those in `rx` (the first request of a unary
    /// call, read before the call was made).
    first: Option<Item>,
    /// The payload of the message whose head just went.
    payload: Option<Bytes>,
    limit: usize,
    ending: Ending,
    sent: usize,
    done: bool,
    /// Told when the body goes before its end (a response the client gave up).
    abandoned: Option<Arc<Abandoned>>,
}

impl OutBody {
    /// A body sending what `rx` yields (after `first`), refusing messages
    /// over `limit` bytes.
    pub(crate) fn new(rx: mpsc::Receiver<Item>, first: Option<Item>, limit: usize, ending: Ending) -> Self {
        Self { rx, first, payload: None, limit, ending, sent: 0, done: false, abandoned: None }
    }

    /// Sets `abandoned` if this body is dropped before its end.
    pub(crate) fn abandoned_by(mut self, abandoned: Arc<Abandoned>) -> Self {
        self.abandoned = Some(abandoned);
        self
    }

    /// Ends the body with `status`: trailers for a response, an error for
    /// a request.
    fn end(&mut self, status: Status) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        self.done = true;
        if self.ending == Ending::Request {
            return Poll::Ready(if status.code() == tonic::Code::Ok { None } else { Some(Err(status)) });
        }
        let mut trailers = HeaderMap::new();
        if let Err(s) = status.add_header(&mut trailers) {
            // A message that cannot be a header value: the code alone.
            let _ = Status::new(s.code(), "").add_header(&mut trailers);
        }
        Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))))
    }
}

impl Drop for OutBody {
    fn drop(&mut self) {
        if !self.done
            && let Some(a) = &self.abandoned
        {
            a.set();
        }
    }
}

impl HttpBody for OutBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        if let Some(p) = self.payload.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(p))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        if self.ending == Ending::UnaryResponse && self.sent == 1 {
            return self.end(Status::ok(""));
        }
        let item = match self.first.take() {
            Some(item) => Some(item),
            None => match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(item) => item,
            },
        };
        match item {
            Some(Ok(frame)) => match wire::encode(&frame, self.limit) {
                Ok((head, payload)) => {
                    self.sent += 1;
                    if !payload.is_empty() {
                        self.payload = Some(payload);
                    }
                    Poll::Ready(Some(Ok(http_body::Frame::data(head))))
                }
                Err(e) => self.end(wire_status(e)),
            },
            Some(Err(status)) => self.end(status),
            None if self.ending == Ending::UnaryResponse => {
                self.end(Status::internal("the call ended without a reply"))
            }
            None => self.end(Status::ok("")),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.payload.is_none()
    }
}

/// The messages of a call's incoming body.
pub(crate) struct MessageSource {
    /// In a mutex only to make the source `Sync` (tonic's body is not):
    /// polled through `get_mut`, never locked.
    body: std::sync::Mutex<tonic::body::Body>,
    dec: wire::Decoder,
    /// A response: its status comes in the trailers, which must come.
    response: bool,
    /// The method takes one message in this direction.
    unary: bool,
    seen: usize,
    /// How the body ended, once it has (delivered once the decoder holds no further message).
    end: Option<Result<(), Status>>,
    /// A server call's part of what its connection holds (see `held`).
    share: Option<Share>,
    /// A DATA frame read from the body (and counted in `share`) not yet
    /// pushed to the decoder: it waits for room on the connection, kept
    /// here so a dropped `next` loses nothing.
    waiting: Option<Bytes>,
}

impl MessageSource {
    /// Reads `body`'s messages (within `limits`); `response`: a client
    /// reading the server's reply, which ends with a status.
    pub(crate) fn new(body: tonic::body::Body, limits: Limits, response: bool, unary: bool) -> Self {
        Self {
            body: std::sync::Mutex::new(body),
            dec: wire::Decoder::new(limits),
            response,
            unary,
            seen: 0,
            end: None,
            share: None,
            waiting: None,
        }
    }

    /// Counts what the decoder holds in `share` (a server call's part of
    /// its connection's unfinished messages).
    pub(crate) fn counted(mut self, share: Share) -> Self {
        self.share = Some(share);
        self
    }

    /// The next message, `None` at a clean end, or the call's error.
    pub(crate) async fn next(&mut self) -> Result<Option<Decoded>, Status> {
        loop {
            if self.end.is_none() {
                match self.dec.next() {
                    Ok(Some(m)) => {
                        if let Some(share) = &mut self.share {
                            share.settle(self.dec.held(), true);
                        }
                        self.seen += 1;
                        if self.unary && self.seen > 1 {
                            self.end = Some(Ok(()));
                            return Err(Status::invalid_argument("this gRPC method takes one message"));
                        }
                        return Ok(Some(m));
                    }
                    // A server's call holds it until more frames come: in
                    // memory of its own (a view of a read buffer could keep
                    // a megabyte alive for a few bytes counted).
                    Ok(None) if self.share.is_some() => self.dec.detach(),
                    Ok(None) => {}
                    Err(e) => self.fail(wire_status(e)),
                }
            }
            if let Some(end) = &self.end {
                return end.clone().map(|()| None);
            }
            if let Some(data) = &mut self.waiting {
                if let Some(share) = &mut self.share
                    && !share.ready()
                {
                    // It waits a while: not as a view that keeps a read
                    // buffer alive.
                    *data = Bytes::copy_from_slice(data);
                    if let Err(full) = share.room().await {
                        self.fail(Status::resource_exhausted(full.to_string()));
                        continue;
                    }
                }
                self.dec.push(self.waiting.take().unwrap_or_default());
                continue;
            }
            let body = self.body.get_mut().unwrap_or_else(|e| e.into_inner());
            let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await;
            let ended = match frame {
                None if self.response => {
                    Err(Status::internal("the gRPC response ended without a status (no trailers)"))
                }
                None => Ok(()),
                Some(Err(status)) => Err(status),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => {
                        // Counted as it arrives (it is held from now on);
                        // pushed once the connection has room.
                        if let Some(share) = &mut self.share
                            && let Err(full) = share.add(data.len())
                        {
                            self.fail(Status::resource_exhausted(full.to_string()));
                            continue;
                        }
                        self.waiting = Some(data);
                        continue;
                    }
                    Err(frame) => match frame.into_trailers() {
                        Ok(t) if self.response => match Status::from_header_map(&t) {
                            Some(s) if s.code() == tonic::Code::Ok => Ok(()),
                            Some(s) => Err(s),
                            None => Err(Status::internal("the gRPC response's trailers carry no grpc-status")),
                        },
                        // A request's trailers mean nothing to this service.
                        _ => Ok(()),
                    },
                },
            };
            let ended = ended.and_then(|()| self.dec.finish().map_err(wire_status)).and_then(|()| {
                if self.unary && self.seen == 0 {
                    Err(Status::internal(if self.response {
                        "the gRPC response ended without its message"
                    } else {
                        "the gRPC request ended without its message"
                    }))
                } else {
                    Ok(())
                }
            });
            // The body is over: no message is unfinished any more.
            if let Some(share) = &mut self.share {
                share.settle(0, ended.is_ok());
            }
            self.end = Some(ended);
        }
    }

    /// Ends the call with `status`: nothing more is read, and what the
    /// decoder holds (and a frame waiting for room) is given back.
    fn fail(&mut self, status: Status) {
        self.waiting = None;
        if let Some(share) = &mut self.share {
            share.settle(0, false);
        }
        self.end = Some(Err(status));
    }

    /// A source that yields nothing and ends with `end` (a trailers-only
    /// response).
    pub(crate) fn ended(end: Result<(), Status>) -> Self {
        let mut s = Self::new(tonic::body::Body::empty(), Limits { message: 0, header: 0 }, false, false);
        s.end = Some(end);
        s
    }
}
