//! The handles users see on a call: [`TensorStream`] (tensors arriving)
//! and [`TensorSink`] (where a server handler writes the tensors it returns).

use tensorwire_codecs::{CodecKind, CompressionMode, DType, Tensor, TensorInfo};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::StreamError;

use super::reader::{FrameReader, IntoItem, Item};
use super::storages::{self, Share};
use super::wire::{codec_from_wire, compression_from_wire};
use super::writer::FrameWriter;
use crate::config::Encoding;
use crate::error::{CallError, Code, Status};

/// Copies a tensor already read (a gRPC call's first) into `dst`, on the
/// terms of [`TensorStream::next_into`].
fn copy_into(t: &Tensor, dst: &mut [u8], want: Option<DType>) -> Result<TensorInfo, CallError> {
    let refuse = |why: String| CallError::InvalidArgument(format!("cannot receive into the given buffer: {why}"));
    if want.is_some_and(|w| w != t.dtype()) {
        return Err(refuse(format!("the tensor is {}, the buffer holds {}", t.dtype(), want.unwrap_or(t.dtype()))));
    }
    if !t.is_contiguous() {
        return Err(refuse("the tensor arrives strided (a view), not contiguous".into()));
    }
    let b = t.as_bytes().map_err(|e| refuse(e.to_string()))?;
    if b.len() != dst.len() {
        return Err(refuse(format!(
            "the tensor (shape {:?}, {}) has {} bytes, the buffer {}",
            t.shape(),
            t.dtype(),
            b.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(b);
    Ok(TensorInfo::of(t))
}

/// Tensors arriving on a call: a server handler's inputs, or a client's
/// fetch/exchange outputs.
pub struct TensorStream {
    reader: FrameReader,
    client_side: bool,
    done: bool,
    /// Boxed as it arrived (~0.5 KB, held by every call's future otherwise).
    reply: Option<Box<v1::Reply>>,
    pending: Option<Tensor>,
    sender: Option<InputSender>,
    /// How the stream ended, while `next` waits for the sender (boxed:
    /// needed at the end of an exchange only).
    ending: Option<Box<Option<Result<Tensor, CallError>>>>,
}

impl TensorStream {
    pub(crate) fn new(reader: FrameReader, client_side: bool) -> Self {
        Self { reader, client_side, done: false, reply: None, pending: None, sender: None, ending: None }
    }

    pub(crate) fn reader_mut(&mut self) -> &mut FrameReader {
        &mut self.reader
    }

    /// Makes `t` the next tensor returned.
    pub(crate) fn push_front(&mut self, t: Tensor) {
        self.pending = Some(t);
    }

    /// Ties the task sending this call's inputs to the stream: its error
    /// is reported once the outputs end (exchange).
    pub(crate) fn with_sender(mut self, sender: InputSender) -> Self {
        self.sender = Some(sender);
        self
    }

    /// The next tensor, or None at the end of the stream.
    pub async fn next(&mut self) -> Option<Result<Tensor, CallError>> {
        if let Some(t) = self.pending.take() {
            return Some(Ok(t));
        }
        if self.done {
            return None;
        }
        let r = match self.ending.take() {
            Some(r) => *r,
            None => self.step().await,
        };
        if matches!(r, Some(Ok(_))) {
            return r;
        }
        if self.sender.is_none() {
            // Nothing to settle with (every call but an exchange): ended.
            self.done = true;
            return r;
        }
        Box::pin(self.end(r)).await
    }

    /// The next tensor written straight into `dst`, memory the caller owns
    /// (a reused buffer, a page-locked region a GPU copies from): no
    /// receive buffer is allocated, chunks land at their offsets as they
    /// arrive. The tensor must arrive raw (not compressed), contiguous, of
    /// exactly `dst.len()` bytes and, when `dtype` is given, of that dtype;
    /// otherwise this fails with [`CallError::InvalidArgument`] before a
    /// byte is written, and the stream is over (the rest of that tensor is
    /// not read: end the call). Returns the tensor's header (dtype, shape,
    /// name), or None at the end of the stream.
    pub async fn next_into(&mut self, dst: &mut [u8], dtype: Option<DType>) -> Option<Result<TensorInfo, CallError>> {
        self.next_via(async |pending, reader| match pending {
            Some(t) => copy_into(&t, dst, dtype).map(IntoItem::Tensor),
            None => reader.next_into(dst, dtype).await,
        })
        .await
    }

    /// The next item read by `recv`, which is given the tensor already read
    /// (a gRPC call's first) if there is one, and otherwise reads from the
    /// stream; the end of the stream is handled as by [`TensorStream::next`].
    /// An error from `recv` ends the stream (a refused tensor's rest is
    /// left unread).
    pub(crate) async fn next_via<T>(
        &mut self,
        recv: impl AsyncFnOnce(Option<Tensor>, &mut FrameReader) -> Result<IntoItem<T>, CallError>,
    ) -> Option<Result<T, CallError>> {
        if let Some(t) = self.pending.take() {
            let r = match recv(Some(t), &mut self.reader).await {
                Ok(IntoItem::Tensor(x)) => Ok(x),
                Ok(_) => Err(self.reader.protocol("a tensor read ahead was lost")),
                Err(e) => Err(e),
            };
            self.done |= r.is_err();
            return Some(r);
        }
        if self.done {
            return None;
        }
        let r = match self.ending.take() {
            Some(r) => *r,
            None => match recv(None, &mut self.reader).await {
                Ok(IntoItem::Tensor(x)) => return Some(Ok(x)),
                Ok(IntoItem::End) => self.settle(Item::End).await,
                Ok(IntoItem::Control(h)) => self.settle(Item::Control(h)).await,
                Err(e) => Some(Err(e)),
            },
        };
        match self.end(r).await {
            Some(Ok(_)) => Some(Err(self.reader.protocol("a tensor after the stream ended"))),
            Some(Err(e)) => Some(Err(e)),
            None => None,
        }
    }

    /// The stream ended with `r` (an error or None): settles the call's
    /// outcome with the input sender of an exchange, if any.
    async fn end(&mut self, mut r: Option<Result<Tensor, CallError>>) -> Option<Result<Tensor, CallError>> {
        // The answers ended: a sender waiting for the caller's next input
        // (which may wait for an answer that will not come) stops now.
        if let Some(s) = &self.sender {
            s.ended.send_replace(true);
        }
        let settled = match &r {
            // The server ended the call with its status: that is the
            // outcome. (CANCELLED is the server seeing this side reset the
            // stream: the sender failed, and says why below.)
            Some(Err(CallError::Remote(s))) => s.code != Code::Cancelled,
            // Found on this side while reading (a bad payload, memory, a
            // limit): that is the outcome, and waiting for a sender short
            // of credit could deadlock (the server waits for this side to
            // read its answers).
            // (InvalidArgument: `next_into` refused a tensor, whose rest is
            // left unread; Protocol: a frame this side could not make sense
            // of, a chunk that did not decompress, say.)
            Some(Err(
                CallError::Decode(_)
                | CallError::Protocol { .. }
                | CallError::OutOfMemory(_)
                | CallError::Limit { .. }
                | CallError::Timeout(_)
                | CallError::InvalidArgument(_),
            )) => true,
            _ => false,
        };
        if settled {
            if let Some(s) = self.sender.take() {
                s.task.abort();
            }
        } else if let Some(h) = self.sender.as_mut().map(|s| &mut s.task) {
            // A failed send explains a missing reply better than the reply
            // does. Awaited in place, the outcome kept aside: if this future
            // is dropped meanwhile (a caller's timeout), the next call waits
            // on, and dropping the stream still stops the sender.
            self.ending = Some(Box::new(r));
            let sent = h.await;
            self.sender = None;
            r = self.ending.take().and_then(|r| *r);
            match sent {
                // (After a clean end the call succeeded: a send the peer cut
                // short by ending it changes nothing; this side's own
                // refusal of an input still counts.)
                Ok(Err(e)) if r.is_some() || !cut_by_peer(&e) => r = Some(Err(e)),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                _ => {}
            }
        }
        self.done = true;
        r
    }

    /// Reads until the next tensor or the end. (One read in a loop, not
    /// nested reads: this future is part of every call's.)
    async fn step(&mut self) -> Option<Result<Tensor, CallError>> {
        loop {
            let item = match self.reader.next().await {
                Ok(item) => item,
                Err(e) => return Some(Err(e)),
            };
            if let Some(r) = self.after(item) {
                return r;
            }
        }
    }

    /// [`Self::after`], reading on when `item` asks for it.
    async fn settle(&mut self, item: Item) -> Option<Result<Tensor, CallError>> {
        match self.after(item) {
            Some(r) => r,
            None => self.step().await,
        }
    }

    /// What `item`, read from the stream, means for its caller; None: read
    /// the next item (after the server's reply only the end may come).
    fn after(&mut self, item: Item) -> Option<Option<Result<Tensor, CallError>>> {
        if self.reply.is_some() {
            return Some(match item {
                Item::End => None,
                _ => Some(Err(self.reader.protocol("frames after the reply"))),
            });
        }
        Some(match item {
            Item::Tensor(t) => Some(Ok(t)),
            Item::End if self.client_side => {
                Some(Err(self.reader.protocol("the server ended the call without a reply")))
            }
            Item::End => None,
            Item::Control(h) => match h.kind {
                Some(Kind::Error(e)) => Some(Err(CallError::Remote(Status::from_wire(&e)))),
                Some(Kind::Reply(r)) if self.client_side => {
                    self.reply = Some(r);
                    return None;
                }
                _ => Some(Err(self.reader.protocol(format!("unexpected {} frame among tensors", h.kind_name())))),
            },
        })
    }

    /// Reads every remaining tensor.
    pub async fn collect_all(mut self) -> Result<Vec<Tensor>, CallError> {
        let mut out = Vec::new();
        while let Some(t) = self.next().await {
            out.push(t?);
        }
        Ok(out)
    }

    /// The server's closing reply, once the stream has ended (client side).
    pub fn reply(&self) -> Option<&v1::Reply> {
        self.reply.as_deref()
    }

    /// The storage id of the tensor returned last: tensors of one stream
    /// with the same id view one storage (see `TensorInfo.storage_id`).
    pub(crate) fn storage_of_last(&self) -> Option<u64> {
        (self.reader.last_storage != 0).then_some(self.reader.last_storage)
    }

    /// Tensors and payload bytes read so far.
    pub fn received(&self) -> (u64, u64) {
        (self.reader.tensors, self.reader.bytes)
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.reader.peer
    }
}

/// A send that failed because the peer ended, stopped or reset the stream.
fn cut_by_peer(e: &CallError) -> bool {
    matches!(
        e,
        CallError::Stream(StreamError::Stopped { .. } | StreamError::Finished { .. } | StreamError::Reset { .. })
    )
}

/// The task sending an exchange's inputs.
pub(crate) struct InputSender {
    pub(crate) task: tokio::task::JoinHandle<Result<(), CallError>>,
    /// Set when the answers end: the task stops waiting for inputs (it
    /// finishes a write it is in first).
    pub(crate) ended: tokio::sync::watch::Sender<bool>,
}

impl Drop for TensorStream {
    /// An exchange's stream dropped before its end cancels the call, inputs
    /// included: the task sending them stops (its stream is reset, so the
    /// server never mistakes the cut for a clean end of inputs).
    fn drop(&mut self) {
        if let Some(s) = self.sender.take() {
            s.task.abort();
        }
    }
}

/// Where a server handler writes the tensors it returns.
pub struct TensorSink<'a> {
    pub(crate) writer: &'a mut FrameWriter,
}

impl TensorSink<'_> {
    /// Sends one tensor to the caller (waits while the caller is slow to read).
    pub async fn send(&mut self, tensor: Tensor) -> Result<(), Status> {
        self.writer.send_tensor(&tensor, false).await.map(|_| ()).map_err(Status::from)
    }

    /// Sends tensors in order, each storage once: tensors that view one
    /// storage (a state dict's tied weights, a transposed view, a slice)
    /// arrive sharing it, with their strides and offsets, as `torch.save`
    /// writes them. With a codec other than raw, each tensor travels whole.
    pub async fn send_state_dict(&mut self, tensors: &[Tensor]) -> Result<(), Status> {
        let shares = if self.writer.encoding.codec == CodecKind::Raw {
            storages::plan(tensors)
        } else {
            vec![Share::Plain; tensors.len()]
        };
        for (t, share) in tensors.iter().zip(shares) {
            self.writer.send_shared(t, share, false).await.map_err(Status::from)?;
        }
        Ok(())
    }

    /// Tensors and payload bytes sent so far.
    pub fn sent(&self) -> (u64, u64) {
        (self.writer.tensors_sent, self.writer.bytes_sent)
    }

    /// The codec tensors are sent with.
    pub fn codec(&self) -> CodecKind {
        self.writer.encoding.codec
    }
}

/// Codec and compression a request asks for, applied to an encoding.
pub(crate) fn apply_response_encoding(mut enc: Encoding, req: &v1::Request) -> Encoding {
    if req.response_codec != 0
        && let Ok(c) = codec_from_wire(req.response_codec)
    {
        enc.codec = c;
    }
    if req.response_compression != 0
        && let Ok(c) = compression_from_wire(req.response_compression)
    {
        enc.compression = CompressionMode::Fixed(c);
        enc.shuffle = req.response_shuffle > 1;
    }
    enc
}
