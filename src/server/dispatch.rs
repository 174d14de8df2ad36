//! Serving one stream: the handshake, or one call dispatched by its method.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use tensorwire_codecs::{Compression, available_codecs};
use tensorwire_proto::v1::{self, Method, frame_header::Kind};
use tensorwire_transports::{Incoming, StopSignal, StreamKind};
use tokio::task::coop::{Unconstrained, unconstrained};

use crate::config::VERSION;
use crate::error::{Code, Status};
use crate::pipeline::link::PeerCaps;
use crate::pipeline::reader::{FrameReader, Item};
use crate::pipeline::tensors::{TensorSink, TensorStream, apply_response_encoding};
use crate::pipeline::wire::FEATURE_DELTA;
use crate::pipeline::wire::PROTOCOL_VERSION;
use crate::pipeline::wire::{codec_to_wire, compression_to_wire};
use crate::pipeline::writer::FrameWriter;
use crate::rpc::call::Call;
use crate::rpc::call::{CallContext, Cancellation, FetchRequest, Held};
use crate::rpc::listing::{Selector, StoredTensor};
use crate::rpc::tasks::TaskState;
use crate::rpc::value::Args;
use crate::server::state::{ServerInner, Session, StreamSlot};
use crate::util::sync::lock;

pub(crate) async fn handle_stream(inner: Arc<ServerInner>, sess: Arc<Session>, inc: Incoming, slot: StreamSlot) {
    let Incoming { kind, send, recv, peer } = inc;
    // A stateless transport's calls come from many clients: each names its own.
    let peer: Arc<str> = peer.map_or_else(|| sess.peer.clone(), Arc::from);
    let reader = FrameReader::pooled(
        recv,
        peer.clone(),
        inner.config.limits.clone(),
        inner.config.placement,
        inner.pool.clone(),
    );
    let mut writer = FrameWriter::new(
        send,
        inner.config.encoding.clone(),
        sess.caps(),
        sess.info.max_frame_payload,
        Some(sess.link.clone()),
    )
    .for_transport(sess.info.transport);
    let mut input = TensorStream::new(reader, false);
    let mut req = match input.reader_mut().next().await {
        Ok(Item::Control(h)) => match h.kind {
            Some(Kind::Hello(hello)) => return handshake(&inner, &sess, &peer, *hello, &mut writer).await,
            Some(Kind::Request(r)) => *r,
            _ => {
                let msg = format!("a call must start with a request, got a {} frame", h.kind_name());
                return fail(&mut writer, Status::protocol(msg)).await;
            }
        },
        // gRPC clients may skip the request: the RPC names the method.
        Ok(Item::Tensor(t)) => match kind.and_then(method_of) {
            Some(m) => {
                input.push_front(t);
                v1::Request { method: m as i32, ..Default::default() }
            }
            None => return fail(&mut writer, Status::protocol("a call must start with a request")).await,
        },
        Ok(Item::End) => return,
        Err(e) => return fail(&mut writer, Status::from(e)).await,
    };
    if !sess.handshaken.load(Ordering::Acquire) {
        let s = Status::failed_precondition("handshake required: the first stream of a connection must carry Hello");
        return fail(&mut writer, s).await;
    }
    // Stateless transports (gRPC) bind no calls to a Hello: each call
    // carries the token itself.
    if sess.info.stateless
        && let Err(s) = inner.auth.check(&peer, &req.auth_token)
    {
        return fail(&mut writer, s).await;
    }
    let method = Method::try_from(req.method).unwrap_or(Method::Unspecified);
    if !inner.serving.load(Ordering::Acquire) && !matches!(method, Method::Health | Method::Info) {
        return fail(&mut writer, Status::refused("the server is shutting down; the call was not processed")).await;
    }
    // Work that runs on after its call ended (a sync handler that does not
    // look at `is_cancelled` after its client went away or its deadline
    // passed) keeps its place: a connection cannot pile up more of it than
    // it may open streams. Health and info are always answered.
    let limit = inner.config.transport.max_concurrent_streams;
    let orphaned = sess.orphaned.load(Ordering::Acquire);
    if !sess.info.stateless && orphaned >= limit && !matches!(method, Method::Health | Method::Info) {
        let msg = format!(
            "{orphaned} calls of this connection whose clients went away are still running (the limit is {limit}); retry later"
        );
        return fail(&mut writer, Status::resource_exhausted(msg)).await;
    }
    inner.stats.calls.fetch_add(1, Ordering::Relaxed);
    let timeout_ms = req.timeout_ms;
    let deadline = (timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(timeout_ms));
    // The call's place is held until its reply is written (this function's
    // end) and until its work is gone (its context, which the work owns).
    let slot = Arc::new(slot);
    let _orphan_check = OrphanCheck(&slot);
    let ctx = CallContext {
        peer,
        transport: sess.info.transport,
        // The function's name lives on in the context (run_call looks it up there).
        function: std::mem::take(&mut req.function),
        deadline,
        cancel: Cancellation::default(),
        max_tensor_bytes: inner.config.limits.max_tensor_bytes,
        budget: Some(inner.budget.clone()),
        params: req.params.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        held: Some(Held::new(slot.clone())),
    };
    writer.encoding = apply_response_encoding(writer.encoding.clone(), &req);
    // The context moves into the call (no copy of its strings); the
    // deadline and client-gone paths keep a handle on its cancellation.
    let cancel = ctx.cancel.clone();
    let gone = writer.stop_signal();
    let result = {
        // Polled in place: the method's future (kilobytes) is made where
        // it runs, not moved through a deadline and a client-gone wrapper
        // (each move a memcpy of its whole size on every call).
        let mut work = std::pin::pin!(run_method(&inner, method, req, &mut input, &mut writer, ctx));
        // Unconstrained, as `tokio::time::timeout`'s own check: work that
        // spends the task's whole coop budget on every poll (a streaming
        // call whose input is always ready) would otherwise never see the
        // timer fire.
        let mut expiry = std::pin::pin!(deadline.map(|d| unconstrained(tokio::time::sleep_until(d.into()))));
        std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = work.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            stopped_early(cx, expiry.as_mut().as_pin_mut(), gone.as_deref(), &cancel, timeout_ms)
        })
        .await
    };
    // A handler that noticed the deadline and gave up reports it as such.
    let result = match (result, deadline) {
        (Err(s), Some(d)) if Instant::now() >= d && s.code != Code::DeadlineExceeded => Err(Status::deadline_exceeded(
            format!("the call's deadline of {timeout_ms} ms passed on the server ({})", s.message),
        )),
        (r, _) => r,
    };
    inner.stats.bytes_received.fetch_add(input.received().1, Ordering::Relaxed);
    inner.stats.bytes_sent.fetch_add(writer.bytes_sent, Ordering::Relaxed);
    match result {
        Ok(reply) => {
            if let Err(e) = writer.control_last(Kind::Reply(reply)).await {
                tracing::debug!(peer = %sess.info.peer, error = %e, "reply not delivered");
            }
        }
        Err(status) => {
            inner.stats.failures.fetch_add(1, Ordering::Relaxed);
            fail(&mut writer, status).await
        }
    }
}

/// Why a call whose work is still pending ends now, if it does: its
/// deadline passed (`expiry`), or its client stopped reading the reply (it
/// dropped the call, or its connection failed: `gone`). Either way the
/// call's cancellation fires (async work stops as its future is dropped,
/// sync work sees `ctx.is_cancelled()`). Looked at only while the work
/// waits: a call that completes at once pays nothing for it.
fn stopped_early<T>(
    cx: &mut std::task::Context<'_>,
    expiry: Option<Pin<&mut Unconstrained<tokio::time::Sleep>>>,
    gone: Option<&dyn StopSignal>,
    cancel: &Cancellation,
    timeout_ms: u64,
) -> Poll<Result<T, Status>> {
    if let Some(e) = expiry
        && e.poll(cx).is_ready()
    {
        cancel.cancel();
        let msg = format!("the call's deadline of {timeout_ms} ms passed on the server");
        return Poll::Ready(Err(Status::deadline_exceeded(msg)));
    }
    if let Some(g) = gone
        && let Poll::Ready(e) = g.poll_stopped(cx)
    {
        cancel.cancel();
        tracing::debug!(error = %e, "the client went away: call cancelled");
        return Poll::Ready(Err(Status::cancelled(format!("the client stopped waiting for the reply: {e}"))));
    }
    Poll::Pending
}

/// At the end of `handle_stream`: a call whose context still lives (its
/// work runs on) is counted as orphaned on its connection until it ends.
struct OrphanCheck<'a>(&'a Arc<StreamSlot>);

impl Drop for OrphanCheck<'_> {
    fn drop(&mut self) {
        if Arc::strong_count(self.0) > 1 {
            self.0.orphan();
        }
    }
}

fn method_of(kind: StreamKind) -> Option<Method> {
    match kind {
        StreamKind::Send => Some(Method::Send),
        StreamKind::Exchange => Some(Method::Exchange),
        _ => None,
    }
}

async fn fail(writer: &mut FrameWriter, status: Status) {
    if status.code == Code::Protocol || status.code == Code::Internal {
        tracing::info!(error = %status, "call failed");
    }
    let _ = writer.control_last(Kind::Error(status.to_wire())).await;
}

/// Checks a client's Hello: its protocol version, then what it announces
/// (limits, codecs, compressions) as this session's view of the peer.
pub(crate) fn accept_hello(hello: &v1::Hello) -> Result<PeerCaps, Status> {
    if hello.version != PROTOCOL_VERSION {
        return Err(Status::new(
            Code::UnsupportedVersion,
            format!(
                "protocol version {} is not supported; this server speaks version {PROTOCOL_VERSION}",
                hello.version
            ),
        ));
    }
    Ok(PeerCaps::announced(hello.limits, &hello.codecs, &hello.compressions))
}

async fn handshake(inner: &ServerInner, sess: &Session, peer: &str, hello: v1::Hello, writer: &mut FrameWriter) {
    let caps = match accept_hello(&hello) {
        Ok(c) => c,
        Err(s) => return fail(writer, s).await,
    };
    if let Err(s) = inner.auth.check(peer, &hello.auth_token) {
        return fail(writer, s).await;
    }
    // A stateless session is shared by every client: one client's
    // capabilities must not become everyone's.
    if !sess.info.stateless {
        *lock(&sess.caps) = std::sync::Arc::new(caps);
        sess.handshaken.store(true, Ordering::Release);
    }
    let welcome = v1::Welcome {
        version: PROTOCOL_VERSION,
        codecs: available_codecs().into_iter().map(|c| codec_to_wire(c) as i32).collect(),
        compressions: Compression::available().into_iter().map(|c| compression_to_wire(c) as i32).collect(),
        chunk_size: inner.config.encoding.effective_chunk_size() as u64,
        limits: Some(inner.config.limits.to_wire(&inner.config.transport)),
        agent: format!("tensorwire/{VERSION}"),
        host_id: crate::util::host::host_id(),
        shm_upgrade_url: if sess.info.transport == "tcp"
            && !hello.host_id.is_empty()
            && hello.host_id == crate::util::host::host_id()
        {
            lock(&inner.shm_upgrade_url).clone().unwrap_or_default()
        } else {
            String::new()
        },
        service_name: inner.config.service_name.clone(),
        batched_functions: inner
            .functions
            .iter()
            .filter_map(|f| f.batch_limit().map(|n| (f.name().to_string(), n as u32)))
            .collect(),
        features: if inner.service.supports_delta() { vec![FEATURE_DELTA.to_string()] } else { vec![] },
    };
    let _ = writer.control_last(Kind::Welcome(Box::new(welcome))).await;
}

async fn inputs_of(input: &mut TensorStream) -> Result<Vec<tensorwire_codecs::Tensor>, Status> {
    let mut v = Vec::new();
    while let Some(t) = input.next().await {
        v.push(t.map_err(Status::from)?);
    }
    Ok(v)
}

fn task_status(id: &str, s: &TaskState) -> v1::TaskStatus {
    use v1::TaskState as W;
    let (state, message) = match s {
        TaskState::Pending => (W::Pending, String::new()),
        TaskState::Running => (W::Running, String::new()),
        TaskState::Done => (W::Done, String::new()),
        TaskState::Failed(m) => (W::Failed, m.clone()),
        TaskState::Cancelled => (W::Cancelled, String::new()),
    };
    v1::TaskStatus { task_id: id.to_string(), state: state as i32, message }
}

/// Runs a call's method; the reply comes boxed, as it is sent (a `v1::Reply`
/// is ~0.5 KB, moved through every layer otherwise).
async fn run_method(
    inner: &Arc<ServerInner>,
    method: Method,
    req: v1::Request,
    input: &mut TensorStream,
    writer: &mut FrameWriter,
    ctx: CallContext,
) -> Result<Box<v1::Reply>, Status> {
    match method {
        Method::Call | Method::Submit => run_call(inner, method, req, input, writer, ctx).await,
        // Boxed: a send's, a fetch's or a task's future would otherwise
        // set the size of every call's.
        _ => Box::pin(async move { run_other(inner, method, req, input, writer, &ctx).await }).await.map(Box::new),
    }
}

/// A `CALL` or `SUBMIT`: the hot path, kept apart from the other methods so
/// that its future (every small call's) is not as large as theirs.
async fn run_call(
    inner: &Arc<ServerInner>,
    method: Method,
    req: v1::Request,
    input: &mut TensorStream,
    writer: &mut FrameWriter,
    ctx: CallContext,
) -> Result<Box<v1::Reply>, Status> {
    let inputs = inputs_of(input).await?;
    let f = inner.functions.get(&ctx.function)?.clone();
    let stacked = req.examples as usize;
    if stacked > 0 {
        if inputs.iter().any(|t| t.shape().first() != Some(&stacked)) {
            return Err(Status::invalid_argument(format!(
                "{stacked} stacked examples need a leading dimension of {stacked}"
            )));
        }
        f.check_stacked(&inputs)?;
    } else {
        f.check(&inputs)?;
    }
    let args = Args::from_wire(req.args.as_ref()).map_err(Status::invalid_argument)?;
    let call = Call { inputs, args, ctx };
    if method == Method::Submit {
        let id = inner.tasks.submit(f, call)?;
        return Ok(Box::new(v1::Reply { task: Some(task_status(&id, &TaskState::Pending)), ..Default::default() }));
    }
    let (out, took) = if stacked > 0 {
        let started = Instant::now();
        let out = f.run_stacked(call, stacked).await;
        (out, started.elapsed())
    } else {
        f.run_timed(call).await
    };
    let out = out?;
    let server_time_us = took.as_micros() as u64;
    for t in &out.tensors {
        writer.send_tensor(t, true).await.map_err(Status::from)?;
    }
    Ok(Box::new(v1::Reply { values: Some(out.values.to_wire()), server_time_us, ..Default::default() }))
}

/// Every method but `CALL` and `SUBMIT`.
async fn run_other(
    inner: &Arc<ServerInner>,
    method: Method,
    req: v1::Request,
    input: &mut TensorStream,
    writer: &mut FrameWriter,
    ctx: &CallContext,
) -> Result<v1::Reply, Status> {
    match method {
        Method::Send => {
            let s = inner.service.send(ctx, input).await?;
            Ok(v1::Reply {
                received_count: s.received,
                received_bytes: s.bytes,
                message: s.message,
                ..Default::default()
            })
        }
        Method::Fetch => {
            let request = FetchRequest { params: req.params.into_iter().collect() };
            let mut sink = TensorSink { writer };
            inner.service.fetch(ctx, &request, &mut sink).await?;
            let (n, _) = sink.sent();
            Ok(v1::Reply { message: format!("sent {n} tensors"), ..Default::default() })
        }
        Method::Exchange => {
            let mut sink = TensorSink { writer };
            inner.service.exchange(ctx, input, &mut sink).await?;
            let (n, _) = sink.sent();
            let (r, _) = input.received();
            Ok(v1::Reply {
                received_count: r,
                message: format!("received {r}, sent {n} tensors"),
                ..Default::default()
            })
        }
        Method::Call | Method::Submit => Err(Status::internal("calls are run by run_call")),
        Method::TaskStatus => {
            let s = inner.tasks.status(&req.task_id)?;
            Ok(v1::Reply { task: Some(task_status(&req.task_id, &s)), ..Default::default() })
        }
        Method::TaskResult => {
            let out = inner.tasks.result(&req.task_id, Duration::from_millis(req.wait_ms)).await?;
            for t in &out.tensors {
                writer.send_tensor(t, true).await.map_err(Status::from)?;
            }
            Ok(v1::Reply {
                values: Some(out.values.to_wire()),
                task: Some(task_status(&req.task_id, &TaskState::Done)),
                ..Default::default()
            })
        }
        Method::TaskCancel => {
            let s = inner.tasks.cancel(&req.task_id)?;
            Ok(v1::Reply { task: Some(task_status(&req.task_id, &s)), ..Default::default() })
        }
        Method::ListFunctions => Ok(v1::Reply {
            functions: Some(v1::FunctionList { functions: inner.functions.iter().map(|f| f.info()).collect() }),
            ..Default::default()
        }),
        Method::Info => Ok(v1::Reply { info: Some(inner.info().to_wire()), ..Default::default() }),
        Method::Health => {
            let h = if inner.serving.load(Ordering::Acquire) {
                v1::HealthState::Serving
            } else {
                v1::HealthState::NotServing
            };
            Ok(v1::Reply { health: h as i32, ..Default::default() })
        }
        Method::List | Method::Remove => {
            let get = |k: &str| req.params.get(k).map(String::as_str);
            let which = if method == Method::List {
                Selector::from_params(get)
            } else {
                Selector::for_remove(get).map_err(Status::invalid_argument)?
            };
            let tensors = if method == Method::List {
                inner.service.list(ctx, &which).await?
            } else {
                inner.service.remove(ctx, &which).await?
            };
            let usage = inner.service.usage().unwrap_or_default();
            let listing = v1::StoreListing {
                tensors: tensors.iter().map(StoredTensor::to_wire).collect(),
                total_bytes: usage.bytes,
                max_bytes: usage.max_bytes,
            };
            Ok(v1::Reply { listing: Some(listing), ..Default::default() })
        }
        Method::Unspecified => Err(Status::invalid_argument(format!("unknown method {}", req.method))),
    }
}
