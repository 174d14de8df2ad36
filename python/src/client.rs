//! `NativeClient`: the blocking client behind `tensorwire.Client`.
//!
//! Each call releases the GIL, runs on the client's own small tokio runtime
//! and wakes every [`SIGNAL_POLL`] to let Python run its signal handlers: a
//! `KeyboardInterrupt` drops the call's future, which resets its stream (the
//! server sees the call cancelled) and leaves the connection usable.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tensorwire::{
    BlockingClient, CallError, Client, ClientConfig, CodecKind, CompressionMode, FetchRequest, RetryPolicy,
    ServiceInfo, TaskState, Tensor, TensorStream,
};

use crate::errors::{call_error, raise};
use crate::tensors::{Received, all_from_py, from_py};
use crate::values::{from_args, from_value, to_args};

/// How often a blocked call lets Python check for Ctrl-C.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Builds a client configuration from the keyword options of
/// `tensorwire.Client` (documented there).
#[allow(clippy::too_many_arguments)]
pub fn config(
    timeout: Option<f64>,
    retries: Option<u32>,
    retry_backoff: Option<f64>,
    auth_token: Option<String>,
    chunk_size: Option<usize>,
    compression: Option<&str>,
    codec: Option<&str>,
    coalesce: bool,
) -> PyResult<ClientConfig> {
    let mut c = ClientConfig { auth_token, coalesce, ..ClientConfig::default() };
    if let Some(t) = timeout {
        c.timeout = Some(seconds(t, "timeout")?);
    }
    match (retries, retry_backoff) {
        (Some(0), _) => c.retry = RetryPolicy::None,
        (None, None) => {}
        (n, backoff) => {
            if let RetryPolicy::Exponential { initial, max_retries, .. } = &mut c.retry {
                if let Some(n) = n {
                    *max_retries = n;
                }
                if let Some(b) = backoff {
                    *initial = seconds(b, "retry_backoff")?;
                }
            }
        }
    }
    if let Some(n) = chunk_size {
        c.encoding.chunk_size = n;
    }
    if let Some(m) = compression {
        c.encoding.compression =
            m.parse::<CompressionMode>().map_err(|e| PyValueError::new_err(format!("compression: {e}")))?;
    }
    if let Some(k) = codec {
        c.encoding.codec = k.parse::<CodecKind>().map_err(|e| PyValueError::new_err(format!("codec: {e}")))?;
    }
    Ok(c)
}

/// Seconds as a Duration; negative and NaN are refused.
pub fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| PyValueError::new_err(format!("{what} must be >= 0 seconds, got {s}")))
}

/// A task state as the Python-facing string (`"failed: <why>"` for failures).
pub fn task_state(s: &TaskState) -> String {
    match s {
        TaskState::Pending => "pending".into(),
        TaskState::Running => "running".into(),
        TaskState::Done => "done".into(),
        TaskState::Cancelled => "cancelled".into(),
        TaskState::Failed(why) => format!("failed: {why}"),
    }
}

/// Service info as a dict.
/// The server's functions as a list of dicts (the blocking and async clients').
pub fn functions_list<'py>(py: Python<'py>, fs: &[tensorwire::FunctionInfo]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for f in fs {
        let d = PyDict::new(py);
        d.set_item("name", &f.name)?;
        d.set_item("doc", &f.doc)?;
        d.set_item("max_batch", f.batch.map(|b| b.0))?;
        d.set_item("is_async", f.is_async)?;
        out.append(d)?;
    }
    Ok(out)
}

/// A client's counters and latencies as a dict.
pub fn statistics_dict<'py>(py: Python<'py>, s: &tensorwire::Statistics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("requests", s.requests)?;
    d.set_item("successes", s.successes)?;
    d.set_item("failures", s.failures)?;
    d.set_item("retries", s.retries)?;
    d.set_item("reconnects", s.reconnects)?;
    d.set_item("bytes_sent", s.bytes_sent)?;
    d.set_item("bytes_received", s.bytes_received)?;
    d.set_item("latency_p50_ms", s.latency_p50_ms)?;
    d.set_item("latency_p99_ms", s.latency_p99_ms)?;
    Ok(d)
}

pub fn info_dict<'py>(py: Python<'py>, i: &ServiceInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("service_name", &i.service_name)?;
    d.set_item("version", &i.version)?;
    d.set_item("transports", &i.transports)?;
    d.set_item("codecs", &i.codecs)?;
    d.set_item("compressions", &i.compressions)?;
    d.set_item("devices", &i.devices)?;
    d.set_item("uptime_s", i.uptime.as_secs_f64())?;
    d.set_item("calls", i.calls)?;
    d.set_item("failures", i.failures)?;
    d.set_item("bytes_received", i.bytes_received)?;
    d.set_item("bytes_sent", i.bytes_sent)?;
    d.set_item("active_calls", i.active_calls)?;
    let functions = PyList::empty(py);
    for f in &i.functions {
        let fd = PyDict::new(py);
        fd.set_item("name", &f.name)?;
        fd.set_item("calls", f.calls)?;
        fd.set_item("failures", f.failures)?;
        functions.append(fd)?;
    }
    d.set_item("functions", functions)?;
    Ok(d)
}

/// Runs `f` on the client's runtime with the GIL released; a pending Python
/// signal (Ctrl-C) ends it early with the handler's exception.
fn block<T: Send>(
    py: Python<'_>,
    client: &BlockingClient,
    f: impl AsyncFnOnce(&Client) -> Result<T, CallError> + Send,
) -> PyResult<T> {
    let r = py.detach(|| {
        client.run(async move |c| {
            tokio::select! {
                r = f(c) => Ok(r),
                e = interrupted() => Err(e),
            }
        })
    });
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(call_error(py, e)),
        Err(e) => Err(e),
    }
}

/// Resolves with the exception of the first Python signal handler that raises.
pub async fn interrupted() -> PyErr {
    loop {
        tokio::time::sleep(SIGNAL_POLL).await;
        if let Err(e) = Python::attach(|py| py.check_signals()) {
            return e;
        }
    }
}

/// The blocking client (see `tensorwire.Client` for the documented API).
#[pyclass(frozen, module = "tensorwire._native")]
pub struct NativeClient {
    inner: RwLock<Option<Arc<BlockingClient>>>,
    url: String,
}

impl NativeClient {
    fn live(&self, py: Python<'_>) -> PyResult<Arc<BlockingClient>> {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        g.clone().ok_or_else(|| {
            raise(py, "Error", format!("client for {} is closed", self.url), tensorwire::Code::FailedPrecondition)
        })
    }
}

#[pymethods]
impl NativeClient {
    /// Connects to `url`.
    #[new]
    #[pyo3(signature = (url, timeout=None, retries=None, retry_backoff=None, auth_token=None, chunk_size=None, compression=None, codec=None, coalesce=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        url: String,
        timeout: Option<f64>,
        retries: Option<u32>,
        retry_backoff: Option<f64>,
        auth_token: Option<String>,
        chunk_size: Option<usize>,
        compression: Option<String>,
        codec: Option<String>,
        coalesce: bool,
    ) -> PyResult<Self> {
        let cfg = config(
            timeout,
            retries,
            retry_backoff,
            auth_token,
            chunk_size,
            compression.as_deref(),
            codec.as_deref(),
            coalesce,
        )?;
        let u = url.clone();
        let c = py
            .detach(move || BlockingClient::connect_with(&u, cfg))
            .map_err(|e| call_error(py, CallError::Connect(e)))?;
        Ok(Self { inner: RwLock::new(Some(Arc::new(c))), url })
    }

    /// The URL this client connected to.
    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    /// Closes the connection (idempotent).
    fn close(&self, py: Python<'_>) {
        let c = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        // The drop joins the runtime: never with the GIL held.
        py.detach(move || drop(c));
    }

    /// Sends tensor descriptions; returns (received, bytes, message).
    fn send(&self, py: Python<'_>, tensors: &Bound<'_, PyAny>) -> PyResult<(u64, u64, String)> {
        let tensors = all_from_py(tensors)?;
        let c = self.live(py)?;
        let s = block(py, &c, async move |c| c.send(tensors).await)?;
        Ok((s.received, s.bytes, s.message))
    }

    /// Fetches with string parameters (`{"name": ...}`).
    fn fetch(&self, py: Python<'_>, params: std::collections::BTreeMap<String, String>) -> PyResult<Vec<Received>> {
        let c = self.live(py)?;
        let req = FetchRequest { params };
        Ok(Received::all(block(py, &c, async move |c| c.fetch(req).await)?))
    }

    /// Opens an exchange: inputs are pushed one at a time
    /// ([`Exchange::push`]) while the answers stream back.
    fn exchange(&self, py: Python<'_>) -> PyResult<Exchange> {
        let c = self.live(py)?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Tensor>(EXCHANGE_QUEUE);
        let (cancel, cancelled) = tokio::sync::watch::channel(false);
        let inputs = exchange_inputs(rx, cancelled);
        let stream = block(py, &c, async move |c| c.exchange(inputs).await)?;
        Ok(Exchange {
            client: c,
            stream: std::sync::Mutex::new(Some(stream)),
            inputs: std::sync::Mutex::new(Some(tx)),
            cancel,
        })
    }

    /// Calls a function: returns (tensors, value).
    #[pyo3(signature = (function, tensors, kwargs=None, timeout=None))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        function: String,
        tensors: &Bound<'py, PyAny>,
        kwargs: Option<&Bound<'py, PyDict>>,
        timeout: Option<f64>,
    ) -> PyResult<(Vec<Received>, Bound<'py, PyAny>)> {
        let tensors = all_from_py(tensors)?;
        let args = to_args(kwargs)?;
        let c = self.live(py)?;
        let opts = match timeout {
            Some(t) => Some(tensorwire::CallOptions::timeout(seconds(t, "timeout")?)),
            None => None,
        };
        let out = block(py, &c, async move |c| match opts {
            Some(o) => c.call_with(&function, tensors, args, &o).await,
            None => c.call(&function, tensors, args).await,
        })?;
        Ok((Received::all(out.tensors), from_value(py, &out.values)?))
    }

    /// Starts a function as a background task; returns its id.
    #[pyo3(signature = (function, tensors, kwargs=None))]
    fn submit(
        &self,
        py: Python<'_>,
        function: String,
        tensors: &Bound<'_, PyAny>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let tensors = all_from_py(tensors)?;
        let args = to_args(kwargs)?;
        let c = self.live(py)?;
        block(py, &c, async move |c| c.submit(&function, tensors, args).await)
    }

    /// A task's state.
    fn status(&self, py: Python<'_>, task_id: String) -> PyResult<String> {
        let c = self.live(py)?;
        Ok(task_state(&block(py, &c, async move |c| c.task_status(&task_id).await)?))
    }

    /// A task's result (tensors, value), waiting up to `wait` seconds.
    #[pyo3(signature = (task_id, wait=0.0))]
    fn result<'py>(&self, py: Python<'py>, task_id: String, wait: f64) -> PyResult<(Vec<Received>, Bound<'py, PyAny>)> {
        let wait = seconds(wait, "wait")?;
        let c = self.live(py)?;
        let out = block(py, &c, async move |c| c.task_result(&task_id, wait).await)?;
        Ok((Received::all(out.tensors), from_value(py, &out.values)?))
    }

    /// Cancels a task; returns its state afterwards.
    fn cancel(&self, py: Python<'_>, task_id: String) -> PyResult<String> {
        let c = self.live(py)?;
        Ok(task_state(&block(py, &c, async move |c| c.cancel_task(&task_id).await)?))
    }

    /// True while the server serves.
    fn health(&self, py: Python<'_>) -> PyResult<bool> {
        let c = self.live(py)?;
        block(py, &c, async move |c| c.health().await)
    }

    /// The server's description and totals.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.live(py)?;
        let i = block(py, &c, async move |c| c.service_info().await)?;
        info_dict(py, &i)
    }

    /// The server's functions: a list of dicts (name, doc, max_batch).
    fn functions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let c = self.live(py)?;
        let fs = block(py, &c, async move |c| c.list_functions().await)?;
        functions_list(py, &fs)
    }

    /// This client's counters and latencies.
    fn statistics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        statistics_dict(py, &self.live(py)?.statistics())
    }

    /// Helper for tests: the keyword arguments as the server will see them.
    #[staticmethod]
    #[pyo3(signature = (**kwargs))]
    fn _roundtrip_values<'py>(py: Python<'py>, kwargs: Option<&Bound<'py, PyDict>>) -> PyResult<Bound<'py, PyDict>> {
        from_args(py, &to_args(kwargs)?)
    }
}

/// Inputs an exchange may have queued ahead of the sender (each holds its
/// tensor's memory, so the queue is short: backpressure reaches Python).
const EXCHANGE_QUEUE: usize = 2;

/// An exchange's inputs as the call's sender reads them. The inputs end
/// cleanly only when Python finishes them: closed by a cancel, they never
/// end (the call is being reset, and a clean end sent first would let the
/// server finish the call as a success).
fn exchange_inputs(
    rx: tokio::sync::mpsc::Receiver<Tensor>,
    cancelled: tokio::sync::watch::Receiver<bool>,
) -> impl futures_util::Stream<Item = Tensor> {
    futures_util::stream::unfold((rx, cancelled), |(mut rx, cancelled)| async move {
        match rx.recv().await {
            Some(t) => Some((t, (rx, cancelled))),
            None if *cancelled.borrow() => std::future::pending().await,
            None => None,
        }
    })
}

/// One exchange in flight: inputs pushed from Python (a feeder thread, so
/// an input may depend on an earlier answer), answers read by `next()`.
#[pyclass(frozen, module = "tensorwire._native")]
pub struct Exchange {
    /// The answers; None once they ended or the exchange was cancelled.
    /// Declared before `inputs` so that it drops first: dropping it stops
    /// the call's input sender, which then never sees the inputs end.
    stream: std::sync::Mutex<Option<TensorStream>>,
    /// Where inputs go; None once the inputs are finished or cancelled.
    inputs: std::sync::Mutex<Option<tokio::sync::mpsc::Sender<Tensor>>>,
    /// Set by `cancel()`: wakes a `next()` waiting for an answer.
    cancel: tokio::sync::watch::Sender<bool>,
    /// Declared last, so dropped last: the answers and inputs go while its
    /// runtime still runs.
    client: Arc<BlockingClient>,
}

#[pymethods]
impl Exchange {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Queues one input (a tensor description), waiting with the GIL
    /// released while the sender is behind. False when the exchange no
    /// longer takes inputs (it ended, failed or was cancelled: the
    /// answers say why).
    fn push(&self, py: Python<'_>, desc: &Bound<'_, PyAny>) -> PyResult<bool> {
        let t = from_py(desc)?;
        let Some(tx) = self.inputs.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return Ok(false);
        };
        let mut cancelled = self.cancel.subscribe();
        block(py, &self.client, async move |_| {
            Ok(tokio::select! {
                r = tx.send(t) => r.is_ok(),
                _ = cancelled.wait_for(|c| *c) => false,
            })
        })
    }

    /// Ends the inputs: the server sees the end of the stream.
    fn finish(&self) {
        self.inputs.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Cancels the exchange: the call is reset (the server sees it
    /// cancelled, never a clean end of inputs) and `next()` ends.
    fn cancel(&self, py: Python<'_>) {
        // Set first: the input sender reads closed inputs as a cancel, not
        // as their end, and a `next()` in flight stops and drops the answers.
        self.cancel.send_replace(true);
        let stream = self.stream.lock().unwrap_or_else(|p| p.into_inner()).take();
        // Dropping the answers resets the call, so the server never sees a
        // clean end of stream.
        py.detach(move || drop(stream));
        self.inputs.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Received>> {
        let Some(mut stream) = self.stream.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(None);
        };
        let mut cancelled = self.cancel.subscribe();
        let next = block(py, &self.client, async move |_| {
            Ok(tokio::select! {
                r = stream.next() => r.map(|r| (stream, r)),
                _ = cancelled.wait_for(|c| *c) => None,
            })
        })?;
        match next {
            None => Ok(None),
            Some((stream, Ok(t))) => {
                // Checked under the lock `cancel()` takes the answers with:
                // a cancel either finds them back or is seen here.
                let mut slot = self.stream.lock().unwrap_or_else(|p| p.into_inner());
                if !*self.cancel.borrow() {
                    *slot = Some(stream);
                }
                Ok(Some(Received::new(t)))
            }
            Some((_, Err(e))) => Err(call_error(py, e)),
        }
    }
}
