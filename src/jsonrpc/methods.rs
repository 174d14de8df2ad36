//! Running one JSON-RPC request: named functions and the `tensorwire.*`
//! methods, each through the server's dispatcher as an in-process call
//! (`server::inproc`), so it meets the same registry, limits, deadlines,
//! statistics and shutdown rules as a native call.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value as Json, json};
use tensorwire_codecs::Tensor;
use tensorwire_proto::v1::{self, Method};
use tensorwire_transports::StreamKind;

use super::convert::{Signature, call_params, output_to_json};
use super::protocol::{Params, Request, RpcError, response};
use crate::config::{JSONRPC_MAX_WAIT_MS, MIN_ANSWER_ROOM};
use crate::error::{CallError, Status};
use crate::observe::info::{FunctionInfo, ServiceInfo};
use crate::rpc::call::Output;
use crate::rpc::function::Function;
use crate::rpc::listing::StoredTensor;
use crate::rpc::value::Value;
use crate::server::inproc::{self, LocalCall};
use crate::server::state::ServerInner;

/// Who asks, and what every request of one HTTP request shares.
pub(crate) struct Caller {
    pub(crate) inner: Arc<ServerInner>,
    pub(crate) peer: String,
    /// From the `X-Timeout-Ms` header: each call's deadline (0: none).
    pub(crate) timeout_ms: u64,
    /// Room the response has left: `max_http_response_bytes` plus 64 KiB
    /// of slack, less the answers made so far and the room answers in the
    /// making hold (see [`Caller::answer`]).
    pub(crate) response_left: AtomicU64,
}

fn status(e: CallError) -> RpcError {
    RpcError::from_status(&Status::from(e))
}

/// `[a, b]` or `{"x": a, "y": b}` as a list of the params named `names`,
/// in order (missing ones are null); anything more is refused.
fn fixed_params(method: &str, params: &Params, names: &[&str]) -> Result<Vec<Json>, RpcError> {
    let usage = || format!("{method} takes [{}] or {{{}}}", names.join(", "), names.join(", "));
    match params {
        Params::None => Ok(vec![Json::Null; names.len()]),
        Params::Positional(a) if a.len() <= names.len() => {
            let mut v = a.clone();
            v.resize(names.len(), Json::Null);
            Ok(v)
        }
        Params::Named(m) if m.keys().all(|k| names.contains(&k.as_str())) => {
            Ok(names.iter().map(|n| m.get(*n).cloned().unwrap_or(Json::Null)).collect())
        }
        _ => Err(RpcError::invalid_params(usage())),
    }
}

fn string_param(method: &str, v: &Json, name: &str) -> Result<String, RpcError> {
    v.as_str().map(str::to_string).ok_or_else(|| RpcError::invalid_params(format!("{method}: {name} must be a string")))
}

fn task_json(t: Option<&v1::TaskStatus>) -> Json {
    use v1::TaskState as W;
    let Some(t) = t else { return Json::Null };
    let state = match W::try_from(t.state).unwrap_or(W::Unspecified) {
        W::Pending | W::Unspecified => "pending",
        W::Running => "running",
        W::Done => "done",
        W::Failed => "failed",
        W::Cancelled => "cancelled",
    };
    let mut o = Map::new();
    o.insert("task_id".into(), json!(t.task_id));
    o.insert("state".into(), json!(state));
    if !t.message.is_empty() {
        o.insert("message".into(), json!(t.message));
    }
    Json::Object(o)
}

fn function_json(f: &FunctionInfo) -> Json {
    json!({
        "name": f.name,
        "doc": f.doc,
        "inputs": f.inputs.as_ref().map(|specs| specs.iter().map(|s| json!({
            "name": s.name,
            "dtype": s.dtype.map(|d| d.name()),
            "shape": s.shape,
        })).collect::<Vec<_>>()),
        "args": f.arg_names,
        "batch": f.batch.map(|(n, w)| json!({ "max_batch": n, "max_wait_ms": w.as_secs_f64() * 1e3 })),
        "async": f.is_async,
    })
}

fn info_json(i: &ServiceInfo) -> Json {
    json!({
        "service_name": i.service_name, "version": i.version, "transports": i.transports, "codecs": i.codecs,
        "compressions": i.compressions, "devices": i.devices, "uptime_s": i.uptime.as_secs_f64(),
        "calls": i.calls, "failures": i.failures, "bytes_received": i.bytes_received, "bytes_sent": i.bytes_sent,
        "active_calls": i.active_calls, "stored_tensors": i.store.tensors, "stored_bytes": i.store.bytes,
        "store_max_bytes": i.store.max_bytes,
        "functions": i.functions.iter().map(|f| json!({
            "name": f.name, "calls": f.calls, "failures": f.failures, "batches": f.batches,
            "seconds": f.total_time.as_secs_f64(),
        })).collect::<Vec<_>>(),
    })
}

impl Caller {
    /// Runs one request; the response, serialized, or None for a
    /// notification. The response's room (`max_http_response_bytes` plus
    /// `HTTP_SMALL_BYTES` of slack, so that a small answer fits whatever the
    /// limit) is taken from as answers are made: a result's tensors before
    /// they are encoded ([`Caller::output_json`]), the rest once serialized.
    /// Each request holds `MIN_ANSWER_ROOM` of it before it runs, and is
    /// not run when that is not there: a call that ran (a task submitted)
    /// has room to say so.
    pub(crate) async fn answer(&self, req: Request) -> Option<Vec<u8>> {
        if let Err(left) = self.take(MIN_ANSWER_ROOM) {
            let id = req.id?;
            let e = RpcError::from_status(&Status::limit_exceeded(format!(
                "not run: this response has {left} bytes of room left, under the {MIN_ANSWER_ROOM} a request needs \
                 (serve --max-http-response-bytes is {}); send it again in another request",
                self.inner.config.max_http_response_bytes
            )));
            return Some(response(id, Err(e)).to_string().into_bytes());
        }
        // The room this answer holds.
        let mut charged = MIN_ANSWER_ROOM;
        let result = self.run(&req.method, &req.params, &mut charged).await;
        let Some(id) = req.id else {
            self.give_back(charged);
            return None;
        };
        let bytes = response(id.clone(), result).to_string().into_bytes();
        let n = bytes.len() as u64;
        if n <= charged {
            self.give_back(charged - n);
            return Some(bytes);
        }
        match self.take(n - charged) {
            Ok(()) => Some(bytes),
            Err(left) => {
                self.give_back(charged);
                Some(response(id, Err(self.too_large(n, left + charged))).to_string().into_bytes())
            }
        }
    }

    /// Takes `n` bytes of the response's room; what is left when they do not fit.
    fn take(&self, n: u64) -> Result<(), u64> {
        self.response_left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| left.checked_sub(n)).map(drop)
    }

    fn give_back(&self, n: u64) {
        self.response_left.fetch_add(n, Ordering::AcqRel);
    }

    /// The error for an answer of `n` bytes when `left` may still be sent.
    fn too_large(&self, n: u64, left: u64) -> RpcError {
        RpcError::from_status(&Status::limit_exceeded(format!(
            "the answer (~{n} bytes as JSON) is above what this response may still take ({left} bytes; its limit \
             is {} bytes, serve --max-http-response-bytes); fetch large results with the native protocol",
            self.inner.config.max_http_response_bytes
        )))
    }

    /// A call's outputs as JSON, once the answer holds room for their
    /// tensors (as base64, 4/3 of their bytes, and their fields), taken
    /// before they are encoded beyond the `charged` bytes it already holds
    /// (the answer gives back what it did not use). Refused when they do
    /// not fit.
    fn output_json(&self, out: &Output, charged: &mut u64) -> Result<Json, RpcError> {
        let size: u64 = out
            .tensors
            .iter()
            .map(|t| {
                let fields = 64 + t.name().map_or(0, str::len) + 21 * t.shape().len();
                (t.nbytes() as u64).div_ceil(3) * 4 + fields as u64
            })
            .sum();
        let more = size.saturating_sub(*charged);
        if let Err(left) = self.take(more) {
            return Err(self.too_large(size, left + *charged));
        }
        output_to_json(out).inspect(|_| *charged += more).inspect_err(|_| self.give_back(more))
    }

    /// Runs one request; bytes taken from the response's room ahead of the
    /// answer (a result's tensors) are added to `charged`.
    async fn run(&self, method: &str, params: &Params, charged: &mut u64) -> Result<Json, RpcError> {
        match method {
            "tensorwire.submit" => self.submit(method, params).await,
            "tensorwire.status" | "tensorwire.cancel" => {
                let [id] = <[Json; 1]>::try_from(fixed_params(method, params, &["task_id"])?).expect("one param");
                let m = if method == "tensorwire.status" { Method::TaskStatus } else { Method::TaskCancel };
                let req = v1::Request { task_id: string_param(method, &id, "task_id")?, ..self.request(m) };
                let (_, reply) = self.dispatch(req, vec![]).await?;
                Ok(task_json(reply.task.as_ref()))
            }
            "tensorwire.result" => {
                let [id, wait] =
                    <[Json; 2]>::try_from(fixed_params(method, params, &["task_id", "wait_ms"])?).expect("two params");
                // Cut to JSONRPC_MAX_WAIT_MS: a client that went away holds
                // the call no longer than that (one still there asks again).
                let wait_ms = match wait {
                    Json::Null => 0,
                    w => w
                        .as_u64()
                        .ok_or_else(|| RpcError::invalid_params("wait_ms must be a number of milliseconds"))?,
                }
                .min(JSONRPC_MAX_WAIT_MS);
                let req = v1::Request {
                    task_id: string_param(method, &id, "task_id")?,
                    wait_ms,
                    ..self.request(Method::TaskResult)
                };
                let (tensors, reply) = self.dispatch(req, vec![]).await?;
                self.output_json(
                    &Output { tensors, values: reply.values.as_ref().map(Value::from_wire).unwrap_or_default() },
                    charged,
                )
            }
            "tensorwire.list_functions" => {
                fixed_params(method, params, &[])?;
                let (_, reply) = self.dispatch(self.request(Method::ListFunctions), vec![]).await?;
                let fs = reply.functions.map(|l| l.functions).unwrap_or_default();
                Ok(Json::Array(fs.iter().map(|f| function_json(&FunctionInfo::from_wire(f))).collect()))
            }
            "tensorwire.health" => {
                fixed_params(method, params, &[])?;
                let (_, reply) = self.dispatch(self.request(Method::Health), vec![]).await?;
                let serving = reply.health == v1::HealthState::Serving as i32;
                Ok(json!({ "serving": serving, "status": if serving { "SERVING" } else { "NOT_SERVING" } }))
            }
            "tensorwire.info" => {
                fixed_params(method, params, &[])?;
                let (_, reply) = self.dispatch(self.request(Method::Info), vec![]).await?;
                Ok(reply.info.as_ref().map_or(Json::Null, |i| info_json(&ServiceInfo::from_wire(i))))
            }
            "tensorwire.list" => {
                let [prefix] = <[Json; 1]>::try_from(fixed_params(method, params, &["prefix"])?).expect("one param");
                let prefix = match prefix {
                    Json::Null => String::new(),
                    p => string_param(method, &p, "prefix")?,
                };
                let mut req = self.request(Method::List);
                req.params.insert("prefix".into(), prefix);
                let (_, reply) = self.dispatch(req, vec![]).await?;
                let listing = reply.listing.unwrap_or_default();
                let tensors: Vec<Json> = listing
                    .tensors
                    .iter()
                    .filter_map(|w| StoredTensor::from_wire(w).ok())
                    .map(|t| {
                        json!({
                            "name": t.name, "dtype": t.dtype.name(), "shape": t.shape, "bytes": t.bytes,
                            "state_dict": t.state_dict, "age_s": t.age.as_secs_f64(),
                        })
                    })
                    .collect();
                Ok(json!({ "tensors": tensors, "total_bytes": listing.total_bytes, "max_bytes": listing.max_bytes }))
            }
            m if m.starts_with("rpc.") || m.starts_with("tensorwire.") => Err(RpcError::method_not_found(format!(
                "Method not found: {m:?} (tensorwire.* methods: submit, status, result, cancel, list_functions, health, info, list)"
            ))),
            name => self.call(name, params, charged).await,
        }
    }

    fn request(&self, method: Method) -> v1::Request {
        v1::Request { method: method as i32, timeout_ms: self.timeout_ms, ..Default::default() }
    }

    /// The inputs and arguments of a call of `f`.
    fn prepare(&self, f: &Function, params: &Params) -> Result<(Vec<Tensor>, v1::Request), RpcError> {
        let sig = Signature {
            inputs: f.inputs.as_ref().map(|specs| specs.iter().map(|s| s.name.clone()).collect()),
            args: f.arg_names.clone(),
        };
        let (inputs, args) = call_params(&f.name, params, &sig, &self.inner.config.limits.decode_limits())?;
        let req = v1::Request { function: f.name.clone(), args: args.to_wire(), ..self.request(Method::Call) };
        Ok((inputs, req))
    }

    async fn call(&self, function: &str, params: &Params, charged: &mut u64) -> Result<Json, RpcError> {
        // An unknown name is an unknown method.
        let f = self
            .inner
            .functions
            .get(function)
            .map_err(|s| RpcError::method_not_found(format!("Method not found: {}", s.message)))?;
        let (inputs, req) = self.prepare(f, params)?;
        let (tensors, reply) = self.dispatch(req, inputs).await?;
        let values = reply.values.as_ref().map(Value::from_wire).unwrap_or_default();
        self.output_json(&Output { tensors, values }, charged)
    }

    /// `tensorwire.submit`: `[function, params]` or `{"function", "params"}`,
    /// params as for a call of the function.
    async fn submit(&self, method: &str, params: &Params) -> Result<Json, RpcError> {
        let [function, call] =
            <[Json; 2]>::try_from(fixed_params(method, params, &["function", "params"])?).expect("two params");
        let function = string_param(method, &function, "function")?;
        let call = match call {
            Json::Null => Params::None,
            Json::Array(a) => Params::Positional(a),
            Json::Object(o) => Params::Named(o),
            _ => return Err(RpcError::invalid_params(format!("{method}: params must be an array or an object"))),
        };
        let f = self.inner.functions.get(&function).map_err(|s| RpcError::from_status(&s))?;
        let (inputs, mut req) = self.prepare(f, &call)?;
        req.method = Method::Submit as i32;
        let (_, reply) = self.dispatch(req, inputs).await?;
        Ok(task_json(reply.task.as_ref()))
    }

    /// Runs `req` with `inputs` through the dispatcher; its outputs and reply.
    async fn dispatch(&self, req: v1::Request, inputs: Vec<Tensor>) -> Result<(Vec<Tensor>, v1::Reply), RpcError> {
        let LocalCall { mut writer, mut output } =
            inproc::start(&self.inner, "http", self.peer.clone(), StreamKind::Call, req).await.map_err(status)?;
        let mut fed = Ok(());
        for t in &inputs {
            if let Err(e) = writer.send_tensor(t, true).await {
                fed = Err(e);
                break;
            }
        }
        if fed.is_ok() {
            fed = writer.finish().await;
        }
        // The dispatcher's verdict explains a failure better than the feed's.
        let mut tensors = Vec::new();
        while let Some(t) = output.next().await {
            tensors.push(t.map_err(status)?);
        }
        fed.map_err(status)?;
        Ok((tensors, output.reply().cloned().unwrap_or_default()))
    }
}
