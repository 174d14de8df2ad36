//! `NativeServer`: the server behind `tensorwire.Server`, with Python
//! handlers. Bytes move on the server's tokio runtime without the GIL; a
//! handler runs on the blocking thread pool and takes the GIL only for its
//! own duration. The Python half adapts user functions to the calling
//! convention here: handlers get `Received` tensors and a dict of values and
//! return tensor descriptions (see `tensors.rs`) and a value.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use tensorwire::{
    BatchConfig, CallContext, FetchRequest, Function, Output, RunningServer, SendSummary, Server, ServerConfig, Status,
    StoreService, Tensor, TensorService, TensorSink, TensorStream,
};

use crate::errors::{handler_status, raise};
use crate::tensors::{Received, all_from_py};
use crate::values::{from_args, to_value};

/// Runs a Python handler with the GIL; its exception becomes the call's status.
fn with_gil<T>(f: impl FnOnce(Python<'_>) -> PyResult<T>) -> Result<T, Status> {
    Python::attach(|py| f(py).map_err(|e| handler_status(py, e)))
}

/// [`with_gil`] off the async runtime, on the blocking pool.
async fn on_pool<T: Send + 'static>(f: impl FnOnce(Python<'_>) -> PyResult<T> + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(move || with_gil(f))
        .await
        .unwrap_or_else(|e| Err(Status::internal(format!("Python handler thread failed: {e}"))))
}

/// The handler's result: a list of tensor descriptions and a value.
fn output(res: &Bound<'_, PyAny>) -> PyResult<Output> {
    let (descs, value): (Bound<'_, PyAny>, Bound<'_, PyAny>) = res.extract()?;
    Ok(Output { tensors: all_from_py(&descs)?, values: to_value(&value)? })
}

fn received_list<'py>(py: Python<'py>, tensors: Vec<Tensor>) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, Received::all(tensors))
}

/// The streaming handlers; a missing one falls back to the store (send and
/// fetch by name, like `tensorwire serve`) or to echo (exchange).
struct PyService {
    store: StoreService,
    on_send: Option<Arc<Py<PyAny>>>,
    on_fetch: Option<Arc<Py<PyAny>>>,
    on_exchange: Option<Arc<Py<PyAny>>>,
}

#[async_trait]
impl TensorService for PyService {
    async fn send(&self, ctx: &CallContext, tensors: &mut TensorStream) -> Result<SendSummary, Status> {
        let Some(h) = &self.on_send else { return self.store.send(ctx, tensors).await };
        let mut s = SendSummary::default();
        while let Some(t) = tensors.next().await {
            let t = t.map_err(Status::from)?;
            s.received += 1;
            s.bytes += t.nbytes() as u64;
            let h = h.clone();
            on_pool(move |py| h.call1(py, (Received::new(t),)).map(drop)).await?;
        }
        s.message = format!("received {} tensors", s.received);
        Ok(s)
    }

    async fn fetch(&self, ctx: &CallContext, request: &FetchRequest, out: &mut TensorSink<'_>) -> Result<(), Status> {
        let Some(h) = &self.on_fetch else { return self.store.fetch(ctx, request, out).await };
        let (h, params) = (h.clone(), request.params.clone());
        let tensors = on_pool(move |py| all_from_py(h.call1(py, (params,))?.bind(py))).await?;
        for t in tensors {
            out.send(t).await?;
        }
        Ok(())
    }

    async fn exchange(
        &self,
        ctx: &CallContext,
        input: &mut TensorStream,
        out: &mut TensorSink<'_>,
    ) -> Result<(), Status> {
        let Some(h) = &self.on_exchange else {
            while let Some(t) = input.next().await {
                out.send(t.map_err(Status::from)?).await?;
            }
            return Ok(());
        };
        let _ = ctx;
        while let Some(t) = input.next().await {
            let t = t.map_err(Status::from)?;
            let h = h.clone();
            let answers = on_pool(move |py| all_from_py(h.call1(py, (Received::new(t),))?.bind(py))).await?;
            for a in answers {
                out.send(a).await?;
            }
        }
        Ok(())
    }
}

struct Running {
    rt: tokio::runtime::Runtime,
    server: RunningServer,
}

/// A function as registered: made into a [`Function`] anew at each start
/// (a batched function's batcher lives on the runtime it first ran on, so
/// one made for an earlier start would not run on the next).
struct Registration {
    name: String,
    dispatch: Arc<Py<PyAny>>,
    batch: Option<BatchConfig>,
    doc: String,
}

impl Registration {
    fn function(&self) -> Function {
        let (name, dispatch) = (self.name.clone(), self.dispatch.clone());
        // The handler's answer to `inputs` and `args`.
        let run = move |py: Python<'_>, inputs: Vec<Tensor>, args: &tensorwire::Args| {
            let res = dispatch.call1(py, (received_list(py, inputs)?, from_args(py, args)?))?;
            output(res.bind(py))
        };
        let f = match &self.batch {
            Some(cfg) => Function::batched(name.clone(), cfg.clone(), move |inputs, args| {
                with_gil(|py| {
                    let out = run(py, inputs, args)?;
                    // Per-caller values cannot be split out of a batch: say
                    // so rather than drop them (a dict of tensors would
                    // come back as a tuple).
                    if out.values != tensorwire::Value::None {
                        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                            "batched function {name} returned a value or named tensors; a batched function returns \
                             tensors only (a tensor or a tuple of them), each with the batch as its first dimension"
                        )));
                    }
                    Ok(out.tensors)
                })
            }),
            None => Function::new(name, move |call| with_gil(|py| run(py, call.inputs, &call.args))),
        };
        f.doc(self.doc.clone())
    }
}

/// The server (see `tensorwire.Server` for the documented API).
#[pyclass(frozen, module = "tensorwire._native")]
pub struct NativeServer {
    functions: Mutex<Vec<Registration>>,
    handlers: Mutex<[Option<Arc<Py<PyAny>>>; 3]>,
    running: Mutex<Option<Running>>,
    /// A start is binding (without `running`'s lock held: it releases the
    /// GIL meanwhile, and a thread holding the GIL may be waiting for that
    /// lock in `serving` or `stop`).
    starting: AtomicBool,
    urls: Mutex<Vec<String>>,
}

impl Drop for NativeServer {
    /// A server dropped while running (no `stop()`, e.g. at interpreter
    /// exit) stops without waiting: its runtime may be running a Python
    /// handler that waits for the GIL this thread may hold.
    fn drop(&mut self) {
        if let Some(Running { rt, server }) = lock(&self.running).take() {
            drop(server);
            rt.shutdown_background();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[pymethods]
impl NativeServer {
    #[new]
    fn new() -> Self {
        Self {
            functions: Mutex::new(Vec::new()),
            handlers: Mutex::new([None, None, None]),
            running: Mutex::new(None),
            starting: AtomicBool::new(false),
            urls: Mutex::new(Vec::new()),
        }
    }

    /// Registers `dispatch(received_list, kwargs) -> (descriptions, value)`
    /// as function `name`; with `batch`, calls are stacked up to that many.
    #[pyo3(signature = (name, dispatch, batch=None, max_wait_ms=None, doc=String::new()))]
    fn add_function(
        &self,
        name: String,
        dispatch: Py<PyAny>,
        batch: Option<usize>,
        max_wait_ms: Option<f64>,
        doc: String,
    ) -> PyResult<()> {
        let batch = match batch {
            Some(max_batch) if max_batch > 1 => {
                let mut cfg = BatchConfig { max_batch, ..BatchConfig::default() };
                if let Some(ms) = max_wait_ms {
                    cfg.max_wait = crate::client::seconds(ms / 1e3, "max_wait_ms")?;
                }
                Some(cfg)
            }
            _ => None,
        };
        lock(&self.functions).push(Registration { name, dispatch: Arc::new(dispatch), batch, doc });
        Ok(())
    }

    /// Sets the streaming handlers (None: the default).
    #[pyo3(signature = (on_send=None, on_fetch=None, on_exchange=None))]
    fn set_handlers(&self, on_send: Option<Py<PyAny>>, on_fetch: Option<Py<PyAny>>, on_exchange: Option<Py<PyAny>>) {
        *lock(&self.handlers) = [on_send.map(Arc::new), on_fetch.map(Arc::new), on_exchange.map(Arc::new)];
    }

    /// Starts listening on `listen`; returns the bound URLs.
    #[pyo3(signature = (listen, service_name=None, auth_token=None, max_store_bytes=None, workers=2))]
    fn start(
        &self,
        py: Python<'_>,
        listen: Vec<String>,
        service_name: Option<String>,
        auth_token: Option<String>,
        max_store_bytes: Option<u64>,
        workers: usize,
    ) -> PyResult<Vec<String>> {
        {
            let running = lock(&self.running);
            if running.is_some() || self.starting.swap(true, Ordering::AcqRel) {
                return Err(PyRuntimeError::new_err("server already started"));
            }
        }
        // Cleared however this start ends.
        struct Started<'a>(&'a AtomicBool);
        impl Drop for Started<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _started = Started(&self.starting);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .thread_name("tensorwire-server")
            .enable_all()
            .build()
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start the server runtime: {e}")))?;
        let mut config = ServerConfig { auth_token, ..ServerConfig::default() };
        if let Some(n) = service_name {
            config.service_name = n;
        }
        let [on_send, on_fetch, on_exchange] = lock(&self.handlers).clone();
        let store = StoreService::new(max_store_bytes.unwrap_or(tensorwire::DEFAULT_MAX_STORE_BYTES));
        let mut b = Server::builder().config(config).service(PyService { store, on_send, on_fetch, on_exchange });
        // Kept: a later start (after stop, or after a failed one) serves them too.
        for r in lock(&self.functions).iter() {
            b = b.function(r.function());
        }
        let server = b.build();
        let started = py.detach(|| rt.block_on(server.start(listen)));
        let server = started.map_err(|e| raise(py, "ConnectError", e.to_string(), tensorwire::Code::Unavailable))?;
        let urls: Vec<String> = server.endpoints().iter().map(|e| e.to_string()).collect();
        *lock(&self.urls) = urls.clone();
        *lock(&self.running) = Some(Running { rt, server });
        Ok(urls)
    }

    /// The URLs it listens on.
    #[getter]
    fn urls(&self) -> Vec<String> {
        lock(&self.urls).clone()
    }

    /// True between start() and stop().
    #[getter]
    fn serving(&self) -> bool {
        lock(&self.running).as_ref().is_some_and(|r| r.server.is_serving())
    }

    /// The server's description and totals.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let running = lock(&self.running);
        let r = running.as_ref().ok_or_else(|| PyRuntimeError::new_err("server not started"))?;
        crate::client::info_dict(py, &r.server.info())
    }

    /// Stops: gracefully (waits for calls in flight) unless `now`.
    #[pyo3(signature = (now=false))]
    fn stop(&self, py: Python<'_>, now: bool) {
        // A start in progress (on another thread) finishes first, then is
        // stopped like any: waited for without the GIL, which it needs to
        // publish the server.
        if lock(&self.running).is_none() && self.starting.load(Ordering::Acquire) {
            py.detach(|| {
                while self.starting.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
        }
        let taken = lock(&self.running).take();
        let Some(Running { rt, server }) = taken else { return };
        py.detach(move || {
            rt.block_on(async move { if now { server.abort().await } else { server.shutdown().await } });
            rt.shutdown_timeout(Duration::from_secs(1));
        });
    }
}
