//! The RPC calls of [`Client`]: named functions (coalesced when the server
//! batches them), background tasks, and the control calls (functions,
//! service info, health).

use std::time::Duration;

use tensorwire_codecs::Tensor;
use tensorwire_proto::v1::{self, Method, frame_header::Kind};
use tensorwire_transports::StreamKind;

use super::coalesce::WireCall;
use super::session::{CallOptions, Client, explain, read_outputs, send_all};
use crate::error::CallError;
use crate::observe::info::{FunctionInfo, ServiceInfo};
use crate::rpc::call::Output;
use crate::rpc::tasks::TaskState;
use crate::rpc::value::{Args, Value};

impl Client {
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
            return Box::pin(self.inner.coalescer.call(self, function, max_batch, inputs, args)).await;
        }
        self.call_inner(function, &inputs, &args, opts, 0, true).await
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
                // In a block: a moved-out local still takes room in the
                // future until its scope ends.
                w.control(Kind::Request(Box::new({
                    let mut req = self.request(Method::Call, opts, started);
                    req.function = function.to_string();
                    req.args = args.to_wire();
                    req.examples = examples as u32;
                    req
                })));
                sent.set();
                let sent_ok = send_all(&mut w, inputs).await;
                self.count_sent(&w);
                if let Err(e) = sent_ok {
                    // Boxed: the failure path's future is the largest.
                    return Err(Box::pin(explain(e, &mut r)).await);
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
    pub(crate) async fn control(
        &self,
        method: Method,
        fill: impl Fn(&mut v1::Request) + Sync,
        idempotent: bool,
    ) -> Result<(Vec<Tensor>, Box<v1::Reply>), CallError> {
        let opts = &CallOptions { idempotent, ..CallOptions::default() };
        let fill = &fill;
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (mut w, mut r) = self.open(&s, StreamKind::Call, opts).await?;
                let mut req = self.request(method, opts, started);
                fill(&mut req);
                // Marked before it leaves: a failure while sending may
                // come after the server has the request (never retried
                // unless idempotent).
                sent.set();
                w.control_last(Kind::Request(Box::new(req))).await?;
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

/// The coalescer's wire calls are not counted in the statistics: it counts
/// each caller's logical call instead.
impl WireCall for Client {
    async fn call_raw(
        &self,
        function: &str,
        inputs: Vec<Tensor>,
        args: Args,
        examples: usize,
    ) -> Result<Output, CallError> {
        self.call_inner(function, &inputs, &args, &CallOptions::default(), examples, false).await
    }

    fn record_logical_call(&self, ok: bool, took: Duration) {
        self.inner.stats.record(ok, took, None);
    }
}
