//! The client: connects by URL, handshakes, reconnects when the connection
//! drops, retries when it is safe, and offers every call mode.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt};
use tensorwire_codecs::{Compression, CompressionMode, Tensor, available_codecs};
use tensorwire_proto::v1::{self, Method, frame_header::Kind};
use tensorwire_transports::{ConnectError, Connection, ConnectionInfo, Endpoint, Scheme, StreamKind};

use crate::config::{ClientConfig, Encoding};
use crate::error::{CallError, Code, Status};
use crate::function::Output;
use crate::info::{FunctionInfo, ServiceInfo};
use crate::service::{FetchRequest, SendSummary};
use crate::stats::{ClientStats, Statistics};
use crate::stream::{FrameReader, FrameWriter, Item, LinkEstimator, PeerCaps, SharedCaps, TensorStream};
use crate::tasks::TaskState;
use crate::value::{Args, Value};
use crate::wire::{codec_to_wire, compression_to_wire};
use crate::{PROTOCOL_VERSION, VERSION, connect};

/// Per-call settings that override the client's.
#[derive(Clone, Debug, Default)]
pub struct CallOptions {
    /// Give up after this long (the server stops the work too).
    pub timeout: Option<Duration>,
    /// The call may run twice safely: retry it even after the request may
    /// have reached the server.
    pub idempotent: bool,
    /// Encoding of tensors sent in this call (codec, compression, chunk size).
    pub encoding: Option<Encoding>,
}

impl CallOptions {
    /// Options with a timeout.
    pub fn timeout(t: Duration) -> Self {
        Self { timeout: Some(t), ..Self::default() }
    }

    /// Builder form: marks the call idempotent.
    pub fn idempotent(mut self) -> Self {
        self.idempotent = true;
        self
    }
}

/// One handshaken connection.
pub(crate) struct ClientSession {
    conn: Arc<dyn Connection>,
    info: ConnectionInfo,
    caps: SharedCaps,
    welcome: v1::Welcome,
    link: Arc<LinkEstimator>,
}

struct ClientInner {
    endpoint: Endpoint,
    config: ClientConfig,
    coalescer: crate::coalesce::Coalescer,
    current: RwLock<Option<Arc<ClientSession>>>,
    connecting: tokio::sync::Mutex<()>,
    stats: ClientStats,
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        if let Some(s) = self.current.get_mut().ok().and_then(Option::take) {
            s.conn.close("client dropped");
        }
    }
}

/// An async client. Cheap to clone; clones share the connection, on which
/// many calls run at once.
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("endpoint", &self.inner.endpoint.to_string()).finish_non_exhaustive()
    }
}

/// Marks that a call's request may have reached the server.
#[derive(Default)]
struct Sent(AtomicBool);

/// One attempt of a call: its result and the server's reported compute time.
type Attempt<'a, T> = Pin<Box<dyn Future<Output = Result<(T, Option<Duration>), CallError>> + Send + 'a>>;

impl Sent {
    fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
    fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl Client {
    /// Connects to `url` with default settings.
    pub async fn connect(url: &str) -> Result<Client, ConnectError> {
        Self::connect_with(url, ClientConfig::default()).await
    }

    /// Connects to `url` and handshakes (fails fast if the server is not there).
    pub async fn connect_with(url: &str, config: ClientConfig) -> Result<Client, ConnectError> {
        let endpoint = Endpoint::parse(url)?;
        let c = Client {
            inner: Arc::new(ClientInner {
                endpoint,
                config,
                coalescer: Default::default(),
                current: RwLock::new(None),
                connecting: tokio::sync::Mutex::new(()),
                stats: ClientStats::default(),
            }),
        };
        c.session().await?;
        Ok(c)
    }

    /// The server's URL.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The client's settings.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The server's service name, from the handshake.
    pub fn server_name(&self) -> Option<String> {
        self.current().map(|s| s.welcome.service_name.clone())
    }

    /// Counters and latencies of this client's calls.
    pub fn statistics(&self) -> Statistics {
        self.inner.stats.snapshot()
    }

    /// Closes the connection; the next call reconnects.
    pub fn disconnect(&self) {
        if let Some(s) = self.inner.current.write().unwrap_or_else(|e| e.into_inner()).take() {
            s.conn.close("client disconnected");
        }
    }

    fn current(&self) -> Option<Arc<ClientSession>> {
        self.inner.current.read().unwrap_or_else(|e| e.into_inner()).clone().filter(|s| !s.conn.is_closed())
    }

    async fn session(&self) -> Result<Arc<ClientSession>, ConnectError> {
        if let Some(s) = self.current() {
            return Ok(s);
        }
        let _g = self.inner.connecting.lock().await;
        if let Some(s) = self.current() {
            return Ok(s);
        }
        let s = Arc::new(self.new_session().await?);
        self.inner.stats.connects.fetch_add(1, Ordering::Relaxed);
        *self.inner.current.write().unwrap_or_else(|e| e.into_inner()) = Some(s.clone());
        Ok(s)
    }

    async fn new_session(&self) -> Result<ClientSession, ConnectError> {
        let cfg = &self.inner.config;
        let ep = &self.inner.endpoint;
        let conn = connect::connect(ep, &cfg.transport).await?;
        let info = conn.info();
        let proto = |reason: String| ConnectError::Protocol { endpoint: ep.to_string(), reason };
        let (mut tx, rx) = conn.open(StreamKind::Handshake).await.map_err(|e| proto(e.to_string()))?;
        let hello = v1::Hello {
            version: PROTOCOL_VERSION,
            codecs: available_codecs().into_iter().map(|c| codec_to_wire(c) as i32).collect(),
            compressions: Compression::available().into_iter().map(|c| compression_to_wire(c) as i32).collect(),
            chunk_size: cfg.encoding.effective_chunk_size() as u64,
            limits: Some(cfg.limits.to_wire(&cfg.transport)),
            auth_token: cfg.auth_token.clone().unwrap_or_default(),
            agent: format!("tensorwire/{VERSION}"),
            host_id: crate::host_id(),
        };
        let frame = tensorwire_transports::Frame::header_only(v1::FrameHeader::new(Kind::Hello(Box::new(hello))));
        tx.send_last(frame).await.map_err(|e| proto(e.to_string()))?;
        let mut r = FrameReader::new(rx, info.peer.clone(), cfg.limits.clone(), false);
        let welcome = match tokio::time::timeout(cfg.transport.connect_timeout, r.next()).await {
            Err(_) => {
                return Err(ConnectError::Timeout { endpoint: ep.to_string(), after: cfg.transport.connect_timeout });
            }
            Ok(Ok(Item::Control(h))) => match h.kind {
                Some(Kind::Welcome(w)) => *w,
                Some(Kind::Error(e)) => {
                    return Err(proto(format!("the server refused the handshake: {}", Status::from_wire(&e))));
                }
                _ => return Err(proto(format!("expected a welcome, got a {} frame", h.kind_name()))),
            },
            Ok(Ok(_)) => return Err(proto("expected a welcome frame".into())),
            Ok(Err(e)) => return Err(proto(e.to_string())),
        };
        if welcome.version != PROTOCOL_VERSION {
            return Err(proto(format!(
                "the server speaks protocol version {}, this client {PROTOCOL_VERSION}",
                welcome.version
            )));
        }
        let caps = Arc::new(PeerCaps {
            limits: welcome.limits,
            codecs: Some(welcome.codecs.clone()),
            compressions: Some(welcome.compressions.clone()),
        });
        Ok(ClientSession { conn, info, caps, welcome, link: Arc::new(LinkEstimator::default()) })
    }

    fn encoding(&self, opts: &CallOptions) -> Encoding {
        opts.encoding.clone().unwrap_or_else(|| self.inner.config.encoding.clone())
    }

    fn request(&self, method: Method, opts: &CallOptions, started: Instant) -> v1::Request {
        let enc = self.encoding(opts);
        let timeout = opts.timeout.or(self.inner.config.timeout);
        let mut req = v1::Request {
            method: method as i32,
            idempotent: opts.idempotent,
            timeout_ms: timeout.map_or(0, |t| t.saturating_sub(started.elapsed()).as_millis().max(1) as u64),
            response_codec: codec_to_wire(enc.codec) as i32,
            ..Default::default()
        };
        // gRPC servers see no connection-wide Hello: every call proves itself.
        if let Some(token) = &self.inner.config.auth_token
            && matches!(self.inner.endpoint.scheme(), Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix)
        {
            req.auth_token = token.clone();
        }
        // An explicit compression applies to the answer too (WAN links).
        if let CompressionMode::Fixed(c) = enc.compression {
            req.response_compression = compression_to_wire(c) as i32;
            req.response_shuffle = u32::from(enc.shuffle) * 16;
        }
        req
    }

    async fn open(
        &self,
        s: &ClientSession,
        kind: StreamKind,
        opts: &CallOptions,
    ) -> Result<(FrameWriter, FrameReader), CallError> {
        let (tx, rx) = s.conn.open(kind).await?;
        let w =
            FrameWriter::new(tx, self.encoding(opts), s.caps.clone(), s.info.max_frame_payload, Some(s.link.clone()));
        let cfg = &self.inner.config;
        let r = FrameReader::new(rx, s.info.peer.clone(), cfg.limits.clone(), cfg.placement);
        Ok((w, r))
    }

    /// Runs one call with the timeout and retry policy. `attempt` gets a
    /// fresh session and marks `Sent` once its request may have reached the server.
    async fn run<'a, T>(
        &'a self,
        opts: &CallOptions,
        attempt: impl FnMut(Arc<ClientSession>, Arc<Sent>, Instant) -> Attempt<'a, T>,
    ) -> Result<T, CallError> {
        self.run_recorded(opts, true, attempt).await
    }

    async fn run_recorded<'a, T>(
        &'a self,
        opts: &CallOptions,
        record: bool,
        mut attempt: impl FnMut(Arc<ClientSession>, Arc<Sent>, Instant) -> Attempt<'a, T>,
    ) -> Result<T, CallError> {
        let started = Instant::now();
        let timeout = opts.timeout.or(self.inner.config.timeout);
        let mut retries = 0;
        loop {
            let sent = Arc::new(Sent::default());
            let fut = async {
                let s = self.session().await?;
                attempt(s, sent.clone(), started).await
            };
            let r = match timeout {
                Some(t) => match tokio::time::timeout(t.saturating_sub(started.elapsed()), fut).await {
                    Ok(r) => r,
                    Err(_) => Err(CallError::Timeout(t)),
                },
                None => fut.await,
            };
            match r {
                Ok((v, server_time)) => {
                    if record {
                        self.inner.stats.record(true, started.elapsed(), server_time);
                    }
                    return Ok(v);
                }
                Err(e) => {
                    if retriable(&e, sent.get(), opts.idempotent) {
                        retries += 1;
                        if let Some(d) = self.inner.config.retry.delay(retries, &e) {
                            self.inner.stats.retries.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(error = %e, retry = retries, delay = ?d, "retrying");
                            tokio::time::sleep(d).await;
                            continue;
                        }
                    }
                    if record {
                        self.inner.stats.record(false, started.elapsed(), None);
                    }
                    return Err(e);
                }
            }
        }
    }

    fn count(&self, w: &FrameWriter, r: &FrameReader) {
        self.count_sent(w);
        self.count_received(r);
    }

    fn count_sent(&self, w: &FrameWriter) {
        self.inner.stats.bytes_sent.fetch_add(w.bytes_sent, Ordering::Relaxed);
    }

    fn count_received(&self, r: &FrameReader) {
        self.inner.stats.bytes_received.fetch_add(r.bytes, Ordering::Relaxed);
    }

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
                self.count_sent(&w);
                if let Err(e) = sent_ok {
                    return Err(explain(e, &mut r).await);
                }
                let out = read_outputs(&mut r).await;
                self.count_received(&r);
                let (_, reply) = out?;
                Ok((
                    SendSummary { received: reply.received_count, bytes: reply.received_bytes, message: reply.message },
                    None,
                ))
            })
        })
        .await
    }

    /// Streams tensors from any source to the server's `send` handler
    /// (no retries: the source is consumed as it goes).
    pub async fn send_stream(&self, tensors: impl Stream<Item = Tensor> + Send) -> Result<SendSummary, CallError> {
        let opts = CallOptions { encoding: None, ..CallOptions::default() };
        let started = Instant::now();
        let s = self.session().await?;
        let (mut w, mut r) = self.open(&s, StreamKind::Send, &opts).await?;
        w.control(Kind::Request(Box::new(self.request(Method::Send, &opts, started))));
        let mut tensors = std::pin::pin!(tensors);
        while let Some(t) = tensors.next().await {
            if let Err(e) = w.send_tensor(&t, false).await {
                return Err(explain(e, &mut r).await);
            }
        }
        self.finish_send(w, r, started).await
    }

    /// Sends tensors that live in GPU memory to the server's `send` handler.
    /// Each is copied device→host through `gpu`'s pinned buffers chunk by
    /// chunk (double-buffered), and each chunk goes on the wire while the
    /// next is being copied.
    #[cfg(feature = "cuda")]
    pub async fn send_gpu(
        &self,
        gpu: &Arc<crate::cuda::Gpu>,
        tensors: Vec<Arc<crate::cuda::DeviceTensor>>,
    ) -> Result<SendSummary, CallError> {
        let opts = CallOptions::default();
        let started = Instant::now();
        let s = self.session().await?;
        let (mut w, mut r) = self.open(&s, StreamKind::Send, &opts).await?;
        w.control(Kind::Request(Box::new(self.request(Method::Send, &opts, started))));
        for d in tensors {
            let (tx, mut rx) = tokio::sync::mpsc::channel(2);
            let (g, dd) = (gpu.clone(), d.clone());
            let producer = tokio::task::spawn_blocking(move || {
                let r = g.download_chunks(&dd, |c| {
                    tx.blocking_send(Ok(c)).map_err(|_| crate::cuda::GpuError::Invalid("the send was abandoned".into()))
                });
                if let Err(e) = &r {
                    let _ = tx.blocking_send(Err(CallError::InvalidArgument(e.to_string())));
                }
                r
            });
            let info = tensorwire_codecs::TensorInfo {
                dtype: Some(d.dtype()),
                shape: d.shape().to_vec(),
                strides: None,
                storage_offset: 0,
                device: d.device(),
                name: d.name().map(str::to_string),
                metadata: Default::default(),
            };
            let sent = w.send_streamed(info, d.nbytes() as u64, &mut rx).await;
            drop(rx);
            let produced = producer.await;
            if let Err(e) = sent {
                return Err(explain(e, &mut r).await);
            }
            match produced {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(CallError::InvalidArgument(e.to_string())),
                Err(e) => return Err(CallError::InvalidArgument(format!("GPU copy task failed: {e}"))),
            }
        }
        self.finish_send(w, r, started).await
    }

    /// Fetches tensors into GPU memory: they arrive in host memory and are
    /// copied host→device through `gpu`'s pinned buffers (the host copy of
    /// each chunk overlapping the DMA of the previous one).
    #[cfg(feature = "cuda")]
    pub async fn fetch_to_gpu(
        &self,
        gpu: &Arc<crate::cuda::Gpu>,
        request: FetchRequest,
    ) -> Result<Vec<crate::cuda::DeviceTensor>, CallError> {
        let host = self.fetch(request).await?;
        let g = gpu.clone();
        tokio::task::spawn_blocking(move || host.iter().map(|t| g.upload(t)).collect::<Result<Vec<_>, _>>())
            .await
            .map_err(|e| CallError::InvalidArgument(format!("GPU copy task failed: {e}")))?
            .map_err(|e| CallError::InvalidArgument(e.to_string()))
    }

    /// Ends a send call that runs outside the retry loop and reads its summary.
    async fn finish_send(
        &self,
        mut w: FrameWriter,
        mut r: FrameReader,
        started: Instant,
    ) -> Result<SendSummary, CallError> {
        w.finish().await?;
        let (_, reply) = read_outputs(&mut r).await?;
        self.count(&w, &r);
        self.inner.stats.record(true, started.elapsed(), None);
        Ok(SendSummary { received: reply.received_count, bytes: reply.received_bytes, message: reply.message })
    }

    /// Asks the server's `fetch` handler for tensors; they arrive as a stream.
    pub async fn fetch_stream(&self, request: FetchRequest) -> Result<TensorStream, CallError> {
        let opts = CallOptions::default();
        let s = self.session().await?;
        let (mut w, r) = self.open(&s, StreamKind::Fetch, &opts).await?;
        let mut req = self.request(Method::Fetch, &opts, Instant::now());
        req.params = request.params.into_iter().collect();
        w.control_last(Kind::Request(Box::new(req))).await?;
        Ok(TensorStream::new(r, true))
    }

    /// Fetches all tensors the server returns for `request` (retried on
    /// failure: fetching twice is harmless).
    pub async fn fetch(&self, request: FetchRequest) -> Result<Vec<Tensor>, CallError> {
        let opts = &CallOptions { idempotent: true, ..CallOptions::default() };
        let request = &request;
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (mut w, mut r) = self.open(&s, StreamKind::Fetch, opts).await?;
                let mut req = self.request(Method::Fetch, opts, started);
                req.params = request.params.clone().into_iter().collect();
                w.control_last(Kind::Request(Box::new(req))).await?;
                sent.set();
                let (out, _) = read_outputs(&mut r).await?;
                self.count(&w, &r);
                Ok((out, None))
            })
        })
        .await
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
    /// answers; returns the answers as a stream.
    pub async fn exchange(
        &self,
        inputs: impl Stream<Item = Tensor> + Send + 'static,
    ) -> Result<TensorStream, CallError> {
        let opts = CallOptions::default();
        let s = self.session().await?;
        let (mut w, r) = self.open(&s, StreamKind::Exchange, &opts).await?;
        w.control(Kind::Request(Box::new(self.request(Method::Exchange, &opts, Instant::now()))));
        let sender = tokio::spawn(async move {
            let mut inputs = std::pin::pin!(inputs);
            w.flush(false).await?;
            while let Some(t) = inputs.next().await {
                w.send_tensor(&t, false).await?;
            }
            w.finish().await
        });
        Ok(TensorStream::new(r, true).with_sender(sender))
    }

    /// [`Client::exchange`] with a list of inputs, collecting every output.
    pub async fn exchange_all(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        self.exchange(futures_util::stream::iter(inputs)).await?.collect_all().await
    }

    /// Runs a compute function: tensors in, tensors out.
    pub async fn compute(&self, function: &str, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        Ok(self.call(function, inputs, Args::new()).await?.tensors)
    }

    /// Calls a named function with tensors and scalar arguments.
    pub async fn call(&self, function: &str, inputs: Vec<Tensor>, args: Args) -> Result<Output, CallError> {
        self.call_with(function, inputs, args, &CallOptions::default()).await
    }

    /// [`Client::call`] with options (timeout, idempotent, encoding).
    pub async fn call_with(
        &self,
        function: &str,
        inputs: Vec<Tensor>,
        args: Args,
        opts: &CallOptions,
    ) -> Result<Output, CallError> {
        let plain = opts.timeout.is_none()
            && !opts.idempotent
            && opts.encoding.is_none()
            && self.inner.config.timeout.is_none();
        if plain
            && self.inner.config.coalesce
            && let Some(max_batch) = self.batched(function).await
        {
            return self.inner.coalescer.call(self, function, max_batch, inputs, args).await;
        }
        self.call_inner(function, &inputs, &args, opts, 0, true).await
    }

    /// One wire call of `function`, not coalesced (`examples` > 0: the inputs
    /// hold that many stacked examples). Not counted in the statistics: the
    /// coalescer counts each caller.
    pub(crate) async fn call_raw(
        &self,
        function: &str,
        inputs: Vec<Tensor>,
        args: Args,
        examples: usize,
    ) -> Result<Output, CallError> {
        self.call_inner(function, &inputs, &args, &CallOptions::default(), examples, false).await
    }

    /// Counts one logical call (coalesced calls share wire calls).
    pub(crate) fn record_logical_call(&self, ok: bool, took: Duration) {
        self.inner.stats.record(ok, took, None);
    }

    /// `Some(max_batch)` when the server declared `function` batched in the handshake.
    async fn batched(&self, function: &str) -> Option<usize> {
        let s = self.session().await.ok()?;
        s.welcome.batched_functions.get(function).map(|&n| n as usize).filter(|&n| n > 1)
    }

    async fn call_inner(
        &self,
        function: &str,
        inputs: &[Tensor],
        args: &Args,
        opts: &CallOptions,
        examples: usize,
        record: bool,
    ) -> Result<Output, CallError> {
        self.run_recorded(opts, record, move |s, sent, started| {
            Box::pin(async move {
                let (mut w, mut r) = self.open(&s, StreamKind::Call, opts).await?;
                let mut req = self.request(Method::Call, opts, started);
                req.function = function.to_string();
                req.args = args.to_wire();
                req.examples = examples as u32;
                w.control(Kind::Request(Box::new(req)));
                sent.set();
                let sent_ok = send_all(&mut w, inputs).await;
                self.count_sent(&w);
                if let Err(e) = sent_ok {
                    return Err(explain(e, &mut r).await);
                }
                let out = read_outputs(&mut r).await;
                self.count_received(&r);
                let (tensors, reply) = out?;
                let values = reply.values.as_ref().map(Value::from_wire).unwrap_or_default();
                let server_time = (reply.server_time_us > 0).then(|| Duration::from_micros(reply.server_time_us));
                Ok((Output { tensors, values }, server_time))
            })
        })
        .await
    }

    /// A control call (no tensors in): returns the tensors and reply.
    async fn control(
        &self,
        method: Method,
        fill: impl Fn(&mut v1::Request) + Sync,
        idempotent: bool,
    ) -> Result<(Vec<Tensor>, v1::Reply), CallError> {
        let opts = &CallOptions { idempotent, ..CallOptions::default() };
        let fill = &fill;
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (mut w, mut r) = self.open(&s, StreamKind::Call, opts).await?;
                let mut req = self.request(method, opts, started);
                fill(&mut req);
                w.control_last(Kind::Request(Box::new(req))).await?;
                sent.set();
                let out = read_outputs(&mut r).await?;
                self.count(&w, &r);
                Ok((out, None))
            })
        })
        .await
    }

    /// Starts a named function as a background task; returns its id.
    pub async fn submit(&self, function: &str, inputs: Vec<Tensor>, args: Args) -> Result<String, CallError> {
        let opts = &CallOptions::default();
        let (inputs, args) = (&inputs, &args);
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (mut w, mut r) = self.open(&s, StreamKind::Call, opts).await?;
                let mut req = self.request(Method::Submit, opts, started);
                req.function = function.to_string();
                req.args = args.to_wire();
                w.control(Kind::Request(Box::new(req)));
                sent.set();
                if let Err(e) = send_all(&mut w, inputs).await {
                    return Err(explain(e, &mut r).await);
                }
                let (_, reply) = read_outputs(&mut r).await?;
                let id = reply.task.map(|t| t.task_id).filter(|id| !id.is_empty());
                Ok((
                    id.ok_or_else(|| CallError::Protocol {
                        peer: s.info.peer.clone(),
                        reason: "submit reply without a task id".into(),
                    })?,
                    None,
                ))
            })
        })
        .await
    }

    /// A task's state.
    pub async fn task_status(&self, task_id: &str) -> Result<TaskState, CallError> {
        let (_, reply) = self.control(Method::TaskStatus, |r| r.task_id = task_id.to_string(), true).await?;
        task_state(reply.task.as_ref())
    }

    /// A task's result, waiting up to `wait` for it to finish (zero: don't wait).
    pub async fn task_result(&self, task_id: &str, wait: Duration) -> Result<Output, CallError> {
        let (tensors, reply) = self
            .control(
                Method::TaskResult,
                |r| {
                    r.task_id = task_id.to_string();
                    r.wait_ms = wait.as_millis() as u64;
                },
                true,
            )
            .await?;
        Ok(Output { tensors, values: reply.values.as_ref().map(Value::from_wire).unwrap_or_default() })
    }

    /// Cancels a task; returns its state afterwards.
    pub async fn cancel_task(&self, task_id: &str) -> Result<TaskState, CallError> {
        let (_, reply) = self.control(Method::TaskCancel, |r| r.task_id = task_id.to_string(), true).await?;
        task_state(reply.task.as_ref())
    }

    /// The server's functions and their signatures.
    pub async fn list_functions(&self) -> Result<Vec<FunctionInfo>, CallError> {
        let (_, reply) = self.control(Method::ListFunctions, |_| {}, true).await?;
        Ok(reply.functions.map(|l| l.functions.iter().map(FunctionInfo::from_wire).collect()).unwrap_or_default())
    }

    /// The server's name, version, transports, codecs, devices, uptime and totals.
    pub async fn service_info(&self) -> Result<ServiceInfo, CallError> {
        let (_, reply) = self.control(Method::Info, |_| {}, true).await?;
        reply.info.as_ref().map(ServiceInfo::from_wire).ok_or_else(|| CallError::Protocol {
            peer: self.inner.endpoint.to_string(),
            reason: "info reply without info".into(),
        })
    }

    /// True while the server is serving (false during its shutdown).
    pub async fn health(&self) -> Result<bool, CallError> {
        let (_, reply) = self.control(Method::Health, |_| {}, true).await?;
        Ok(reply.health == v1::HealthState::Serving as i32)
    }
}

fn task_state(t: Option<&v1::TaskStatus>) -> Result<TaskState, CallError> {
    use v1::TaskState as W;
    let t = t.ok_or_else(|| CallError::Protocol { peer: String::new(), reason: "reply without task status".into() })?;
    Ok(match W::try_from(t.state).unwrap_or(W::Unspecified) {
        W::Pending | W::Unspecified => TaskState::Pending,
        W::Running => TaskState::Running,
        W::Done => TaskState::Done,
        W::Failed => TaskState::Failed(t.message.clone()),
        W::Cancelled => TaskState::Cancelled,
    })
}

/// Sends every tensor, then ends the stream; a small call leaves in one write.
async fn send_all(w: &mut FrameWriter, tensors: &[Tensor]) -> Result<(), CallError> {
    for t in tensors {
        w.send_tensor(t, true).await?;
    }
    w.finish().await
}

/// Whether a failed attempt may run again: only when the request cannot
/// have been processed, or the caller said running twice is fine.
fn retriable(e: &CallError, sent: bool, idempotent: bool) -> bool {
    match e {
        CallError::Connect(_) => true,
        CallError::Remote(s) => s.code == Code::Refused || (idempotent && s.code == Code::Unavailable),
        CallError::Stream(se) => {
            (!sent || idempotent)
                && (se.is_connection_error() || matches!(se, tensorwire_transports::StreamError::Refused { .. }))
        }
        _ => false,
    }
}

/// A send that failed because the server stopped reading usually has the
/// server's reason waiting in the reply: report that instead.
async fn explain(e: CallError, r: &mut FrameReader) -> CallError {
    if !matches!(e, CallError::Stream(_)) {
        return e;
    }
    match tokio::time::timeout(Duration::from_secs(2), read_outputs(r)).await {
        Ok(Err(remote @ CallError::Remote(_))) => remote,
        _ => e,
    }
}

/// Reads output tensors until the reply (or error) and the end of the stream.
async fn read_outputs(r: &mut FrameReader) -> Result<(Vec<Tensor>, v1::Reply), CallError> {
    let mut out = Vec::new();
    loop {
        match r.next().await? {
            Item::Tensor(t) => out.push(t),
            Item::Control(h) => match h.kind {
                Some(Kind::Reply(reply)) => {
                    return match r.next().await? {
                        Item::End => Ok((out, *reply)),
                        _ => Err(r.protocol("frames after the reply")),
                    };
                }
                Some(Kind::Error(e)) => return Err(CallError::Remote(Status::from_wire(&e))),
                _ => return Err(r.protocol(format!("unexpected {} frame in a reply", h.kind_name()))),
            },
            Item::End => return Err(r.protocol("the server ended the call without a reply")),
        }
    }
}

/// A client for programs without an async runtime. Owns a small runtime;
/// closes its connection and stops the runtime when dropped.
pub struct BlockingClient {
    client: Option<Client>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for BlockingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockingClient").field("client", &self.client).finish()
    }
}

impl BlockingClient {
    /// Connects to `url` with default settings.
    pub fn connect(url: &str) -> Result<Self, ConnectError> {
        Self::connect_with(url, ClientConfig::default())
    }

    /// Connects to `url`.
    pub fn connect_with(url: &str, config: ClientConfig) -> Result<Self, ConnectError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tensorwire-client")
            .enable_all()
            .build()
            .map_err(|source| ConnectError::Io { endpoint: url.to_string(), source })?;
        let client = rt.block_on(Client::connect_with(url, config))?;
        Ok(Self { client: Some(client), rt: Some(rt) })
    }

    /// Runs any async client method to completion.
    pub fn run<T>(&self, f: impl AsyncFnOnce(&Client) -> T) -> T {
        let (rt, c) = (self.rt.as_ref().expect("live"), self.client.as_ref().expect("live"));
        rt.block_on(f(c))
    }

    /// See [`Client::send`].
    pub fn send(&self, tensors: Vec<Tensor>) -> Result<SendSummary, CallError> {
        self.run(async |c| c.send(tensors).await)
    }

    /// See [`Client::fetch`].
    pub fn fetch(&self, request: FetchRequest) -> Result<Vec<Tensor>, CallError> {
        self.run(async |c| c.fetch(request).await)
    }

    /// See [`Client::exchange_all`].
    pub fn exchange(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        self.run(async |c| c.exchange_all(inputs).await)
    }

    /// See [`Client::compute`].
    pub fn compute(&self, function: &str, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        self.run(async |c| c.compute(function, inputs).await)
    }

    /// See [`Client::call`].
    pub fn call(&self, function: &str, inputs: Vec<Tensor>, args: Args) -> Result<Output, CallError> {
        self.run(async |c| c.call(function, inputs, args).await)
    }

    /// See [`Client::statistics`].
    pub fn statistics(&self) -> Statistics {
        self.client.as_ref().expect("live").statistics()
    }
}

impl Drop for BlockingClient {
    fn drop(&mut self) {
        if let (Some(c), Some(rt)) = (self.client.take(), self.rt.as_ref()) {
            // Drop inside the runtime so the close reaches the connection's tasks.
            rt.block_on(async move {
                c.disconnect();
                drop(c);
                tokio::task::yield_now().await;
            });
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}
