//! The tensor calls of [`Client`]: `send` (client → server stream),
//! `fetch` (server → client), `exchange` (both ways).

use std::time::Instant;

use futures_util::{Stream, StreamExt};
use tensorwire_codecs::{DType, Element, Tensor, TensorInfo};
use tensorwire_proto::v1::{Method, frame_header::Kind};
use tensorwire_transports::StreamKind;

use super::session::{CallOptions, Client, ClientSession, explain, read_outputs, send_all, send_summary};
use crate::error::{CallError, Status};
use crate::pipeline::reader::{FrameReader, IntoItem, Item};
use crate::pipeline::tensors::{InputSender, TensorStream};
use crate::pipeline::writer::FrameWriter;
use crate::rpc::call::{FetchRequest, SendSummary};

impl Client {
    /// Streams tensors to the server's `send` handler; returns its summary.
    pub async fn send(&self, tensors: impl IntoIterator<Item = Tensor>) -> Result<SendSummary, CallError> {
        self.send_with(tensors, &CallOptions::default()).await
    }

    /// [`Client::send`] with options.
    pub async fn send_with(
        &self,
        tensors: impl IntoIterator<Item = Tensor>,
        opts: &CallOptions,
    ) -> Result<SendSummary, CallError> {
        let tensors: Vec<Tensor> = tensors.into_iter().collect();
        let tensors = &tensors;
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (mut w, mut r) = self.open(&s, StreamKind::Send, opts).await?;
                w.control(Kind::Request(Box::new(self.request(Method::Send, opts, started))));
                sent.set();
                let sent_ok = send_all(&mut w, tensors).await;
                Ok((send_summary(self, &mut w, &mut r, sent_ok).await?, None))
            })
        })
        .await
    }

    /// Streams tensors from any source to the server's `send` handler
    /// (no retries: the source is consumed as it goes; the client's timeout
    /// bounds the whole call, the source's waits included).
    pub async fn send_stream(&self, tensors: impl Stream<Item = Tensor> + Send) -> Result<SendSummary, CallError> {
        let started = Instant::now();
        self.within_timeout(&CallOptions::default(), started, async {
            let (mut w, mut r, started) = self.begin_send().await?;
            let mut tensors = std::pin::pin!(tensors);
            while let Some(t) = tensors.next().await {
                if let Err(e) = w.send_tensor(&t, false).await {
                    return Err(explain(e, &mut r).await);
                }
            }
            self.finish_send(w, r, started).await
        })
        .await
    }

    /// Opens a fetch stream on `s` and sends its request (the stream's
    /// writer is finished; the reader gets the tensors and the reply).
    pub(crate) async fn begin_fetch(
        &self,
        s: &ClientSession,
        opts: &CallOptions,
        request: &FetchRequest,
        started: Instant,
    ) -> Result<(FrameWriter, FrameReader), CallError> {
        let (mut w, r) = self.open(s, StreamKind::Fetch, opts).await?;
        let mut req = self.request(Method::Fetch, opts, started);
        req.params = request.params.clone().into_iter().collect();
        w.control_last(Kind::Request(Box::new(req))).await?;
        Ok((w, r))
    }

    /// Asks the server's `fetch` handler for tensors; they arrive as a stream.
    pub async fn fetch_stream(&self, request: FetchRequest) -> Result<TensorStream, CallError> {
        let (opts, started) = (CallOptions::default(), Instant::now());
        let r = self
            .within_timeout(&opts, started, async {
                let s = self.session().await?;
                Ok(self.begin_fetch(&s, &opts, &request, started).await?.1)
            })
            .await?;
        Ok(TensorStream::new(r, true))
    }

    /// Fetches all tensors the server returns for `request` (retried on
    /// failure: fetching twice is harmless).
    pub async fn fetch(&self, request: FetchRequest) -> Result<Vec<Tensor>, CallError> {
        let opts = &CallOptions { idempotent: true, ..CallOptions::default() };
        let request = &request;
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (w, mut r) = self.begin_fetch(&s, opts, request, started).await?;
                sent.set();
                let (out, _) = read_outputs(&mut r).await?;
                self.count(&w, &r);
                Ok((out, None))
            })
        })
        .await
    }

    /// Fetches the one tensor `request` returns straight into `dst`, memory
    /// the caller owns (no receive buffer is allocated): chunks are written
    /// (or decompressed) at their offsets as they arrive. The tensor's header
    /// is checked first: it must be a raw, contiguous tensor of exactly
    /// `dst.len()` bytes, and of dtype `dtype` when given; otherwise the call
    /// fails with [`CallError::InvalidArgument`] and nothing is written.
    /// Returns the tensor's header (dtype, shape, name). Not retried; the
    /// client's timeout ([`ClientConfig::timeout`](crate::ClientConfig))
    /// bounds the whole call (a server that stops sending half-way fails it
    /// with [`CallError::Timeout`], `dst` then holds part of the tensor).
    pub async fn fetch_into_bytes(
        &self,
        request: FetchRequest,
        dst: &mut [u8],
        dtype: Option<DType>,
    ) -> Result<TensorInfo, CallError> {
        let (opts, started) = (CallOptions::default(), Instant::now());
        self.within_timeout(&opts, started, self.fetch_into_now(&opts, started, request, dst, dtype)).await
    }

    /// [`Client::fetch_into_bytes`] without its timeout.
    async fn fetch_into_now(
        &self,
        opts: &CallOptions,
        started: Instant,
        request: FetchRequest,
        dst: &mut [u8],
        dtype: Option<DType>,
    ) -> Result<TensorInfo, CallError> {
        let s = self.session().await?;
        let (w, mut r) = self.begin_fetch(&s, opts, &request, started).await?;
        let mut got: Option<TensorInfo> = None;
        loop {
            let item = if got.is_none() {
                r.next_into(dst, dtype).await?
            } else {
                match r.next().await? {
                    Item::Tensor(_) => {
                        return Err(CallError::InvalidArgument(
                            "fetch_into receives one tensor, and the server returned more".into(),
                        ));
                    }
                    Item::Control(h) => IntoItem::Control(h),
                    Item::End => IntoItem::End,
                }
            };
            match item {
                IntoItem::Tensor(info) => got = Some(info),
                IntoItem::Control(h) => match h.kind {
                    Some(Kind::Reply(_)) => break,
                    Some(Kind::Error(e)) => return Err(CallError::Remote(Status::from_wire(&e))),
                    _ => return Err(r.protocol(format!("unexpected {} frame in a reply", h.kind_name()))),
                },
                IntoItem::End => return Err(r.protocol("the server ended the call without a reply")),
            }
        }
        self.count(&w, &r);
        got.ok_or_else(|| CallError::InvalidArgument("fetch_into: the server returned no tensor".into()))
    }

    /// Fetches the tensor named `name` straight into `dst` (see
    /// [`Client::fetch_into_bytes`]): its dtype must be `T`'s and its
    /// element count `dst.len()`. Returns its shape.
    pub async fn fetch_into<T: Element>(&self, name: &str, dst: &mut [T]) -> Result<Vec<usize>, CallError> {
        let len = std::mem::size_of_val(dst);
        // SAFETY: `T: Element` is `Pod` (any byte pattern is a valid `T`,
        // no padding), and the byte slice covers exactly `dst`, which it
        // borrows mutably for its lifetime.
        let bytes = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), len) };
        let info = self.fetch_into_bytes(FetchRequest::name(name), bytes, Some(T::DTYPE)).await?;
        Ok(info.shape)
    }

    /// Fetches the tensor named `name`.
    pub async fn fetch_one(&self, name: &str) -> Result<Tensor, CallError> {
        let mut v = self.fetch(FetchRequest::name(name)).await?;
        match v.len() {
            1 => Ok(v.pop().expect("one")),
            n => Err(CallError::Protocol {
                peer: self.inner.endpoint.to_string(),
                reason: format!("asked for one tensor named {name:?}, got {n}"),
            }),
        }
    }

    /// Bidirectional: sends `inputs` while the server's `exchange` handler
    /// answers; returns the answers as a stream. `inputs` is polled as the
    /// call goes, so an input may wait for an earlier answer (a channel's
    /// receiver). Dropping the returned stream before its end cancels the
    /// call, inputs included.
    pub async fn exchange(
        &self,
        inputs: impl Stream<Item = Tensor> + Send + 'static,
    ) -> Result<TensorStream, CallError> {
        let (opts, started) = (CallOptions::default(), Instant::now());
        let (mut w, r) = self
            .within_timeout(&opts, started, async {
                let s = self.session().await?;
                self.open(&s, StreamKind::Exchange, &opts).await
            })
            .await?;
        w.control(Kind::Request(Box::new(self.request(Method::Exchange, &opts, started))));
        let (ended, mut answers_ended) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut inputs = std::pin::pin!(inputs);
            w.flush(false).await?;
            loop {
                let next = tokio::select! {
                    biased;
                    n = inputs.next() => n,
                    // The call is over (answered, failed or cut): inputs still
                    // to come are not needed; `w` drops unfinished (a reset).
                    _ = answers_ended.wait_for(|e| *e) => return Ok(()),
                };
                let Some(t) = next else { break };
                w.send_tensor(&t, false).await?;
            }
            w.finish().await
        });
        Ok(TensorStream::new(r, true).with_sender(InputSender { task, ended }))
    }

    /// [`Client::exchange`] with a list of inputs, collecting every output.
    pub async fn exchange_all(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        self.exchange(futures_util::stream::iter(inputs)).await?.collect_all().await
    }
}
