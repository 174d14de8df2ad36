//! `NativeAsyncClient`: the client behind `tensorwire.AsyncClient`. Every
//! method returns an awaitable of the running asyncio loop
//! (`pyo3-async-runtimes`): the call runs on a shared tokio runtime and
//! completes the loop's future when done, so thousands of calls can wait at
//! once without a thread each. Cancelling the awaitable (a task's
//! `cancel()`, `asyncio.wait_for`) drops the call, which resets its stream.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tensorwire::{Client, FetchRequest};

use crate::client::{config, seconds, task_state};
use crate::errors::call_error_nogil;
use crate::tensors::{Received, all_from_py};
use crate::values::{PyValue, to_args};

/// Async calls whose Rust future has not finished yet.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Counts one call in [`IN_FLIGHT`] while it lives.
struct InFlight;

impl InFlight {
    fn new() -> Self {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `pyo3_async_runtimes::tokio::future_into_py`, counted: the loop's
/// future is completed from a thread of the tokio runtime that takes the
/// GIL, and a thread taking the GIL while the interpreter finalizes aborts
/// the process ("PyGILState_Release: thread state … must be current"). The
/// package's exit hook waits for the count to reach zero (see
/// `async_in_flight`).
fn future_into_py<F, T>(py: Python<'_>, fut: F) -> PyResult<Bound<'_, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: for<'py> IntoPyObject<'py> + Send + 'static,
{
    let counted = InFlight::new();
    pyo3_async_runtimes::tokio::future_into_py(py, async move {
        let _counted = counted;
        fut.await
    })
}

/// Async calls still running (for the exit hook of `tensorwire.AsyncClient`).
#[pyfunction]
pub fn async_in_flight() -> usize {
    IN_FLIGHT.load(Ordering::SeqCst)
}

/// The async client (see `tensorwire.AsyncClient` for the documented API).
#[pyclass(frozen, module = "tensorwire._native")]
pub struct NativeAsyncClient {
    client: Client,
}

#[pymethods]
impl NativeAsyncClient {
    /// Connects to `url`: an awaitable of the client.
    #[staticmethod]
    #[pyo3(signature = (url, timeout=None, retries=None, retry_backoff=None, auth_token=None, chunk_size=None, compression=None, codec=None, coalesce=true))]
    #[allow(clippy::too_many_arguments)]
    fn connect<'py>(
        py: Python<'py>,
        url: String,
        timeout: Option<f64>,
        retries: Option<u32>,
        retry_backoff: Option<f64>,
        auth_token: Option<String>,
        chunk_size: Option<usize>,
        compression: Option<String>,
        codec: Option<String>,
        coalesce: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
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
        future_into_py(py, async move {
            let client = Client::connect_with(&url, cfg)
                .await
                .map_err(|e| call_error_nogil(tensorwire::CallError::Connect(e)))?;
            Ok(NativeAsyncClient { client })
        })
    }

    /// Closes the connection.
    fn close(&self) {
        self.client.disconnect();
    }

    /// Sends tensor descriptions: awaitable of (received, bytes, message).
    fn send<'py>(&self, py: Python<'py>, tensors: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let tensors = all_from_py(tensors)?;
        let c = self.client.clone();
        future_into_py(py, async move {
            let s = c.send(tensors).await.map_err(call_error_nogil)?;
            Ok((s.received, s.bytes, s.message))
        })
    }

    /// Fetches with string parameters: awaitable of a list of `Received`.
    fn fetch<'py>(
        &self,
        py: Python<'py>,
        params: std::collections::BTreeMap<String, String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let c = self.client.clone();
        future_into_py(py, async move {
            let out = c.fetch(FetchRequest { params }).await.map_err(call_error_nogil)?;
            Ok(Received::all(out))
        })
    }

    /// Exchanges all of `tensors`: awaitable of the list of answers.
    fn exchange<'py>(&self, py: Python<'py>, tensors: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let tensors = all_from_py(tensors)?;
        let c = self.client.clone();
        future_into_py(py, async move {
            let out = c.exchange_all(tensors).await.map_err(call_error_nogil)?;
            Ok(Received::all(out))
        })
    }

    /// Calls a function: awaitable of (tensors, value).
    #[pyo3(signature = (function, tensors, kwargs=None, timeout=None))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        function: String,
        tensors: &Bound<'py, PyAny>,
        kwargs: Option<&Bound<'py, PyDict>>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tensors = all_from_py(tensors)?;
        let args = to_args(kwargs)?;
        let opts = timeout.map(|t| seconds(t, "timeout")).transpose()?.map(tensorwire::CallOptions::timeout);
        let c = self.client.clone();
        future_into_py(py, async move {
            let out = match opts {
                Some(o) => c.call_with(&function, tensors, args, &o).await,
                None => c.call(&function, tensors, args).await,
            }
            .map_err(call_error_nogil)?;
            Ok((Received::all(out.tensors), PyValue(out.values)))
        })
    }

    /// Starts a background task: awaitable of its id.
    #[pyo3(signature = (function, tensors, kwargs=None))]
    fn submit<'py>(
        &self,
        py: Python<'py>,
        function: String,
        tensors: &Bound<'py, PyAny>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tensors = all_from_py(tensors)?;
        let args = to_args(kwargs)?;
        let c = self.client.clone();
        future_into_py(py, async move { c.submit(&function, tensors, args).await.map_err(call_error_nogil) })
    }

    /// A task's state: awaitable of a string.
    fn status<'py>(&self, py: Python<'py>, task_id: String) -> PyResult<Bound<'py, PyAny>> {
        let c = self.client.clone();
        future_into_py(py, async move { Ok(task_state(&c.task_status(&task_id).await.map_err(call_error_nogil)?)) })
    }

    /// A task's result: awaitable of (tensors, value).
    #[pyo3(signature = (task_id, wait=0.0))]
    fn result<'py>(&self, py: Python<'py>, task_id: String, wait: f64) -> PyResult<Bound<'py, PyAny>> {
        let wait = seconds(wait, "wait")?;
        let c = self.client.clone();
        future_into_py(py, async move {
            let out = c.task_result(&task_id, wait).await.map_err(call_error_nogil)?;
            Ok((Received::all(out.tensors), PyValue(out.values)))
        })
    }

    /// Cancels a task: awaitable of its state afterwards.
    fn cancel<'py>(&self, py: Python<'py>, task_id: String) -> PyResult<Bound<'py, PyAny>> {
        let c = self.client.clone();
        future_into_py(py, async move { Ok(task_state(&c.cancel_task(&task_id).await.map_err(call_error_nogil)?)) })
    }

    /// Awaitable of True while the server serves.
    fn health<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.client.clone();
        future_into_py(py, async move { c.health().await.map_err(call_error_nogil) })
    }

    /// Awaitable of the server's description and totals (a dict).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.client.clone();
        future_into_py(py, async move {
            let i = c.service_info().await.map_err(call_error_nogil)?;
            Python::attach(|py| crate::client::info_dict(py, &i).map(|d| d.unbind()))
        })
    }

    /// Awaitable of the server's functions (a list of dicts).
    fn functions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.client.clone();
        future_into_py(py, async move {
            let fs = c.list_functions().await.map_err(call_error_nogil)?;
            Python::attach(|py| crate::client::functions_list(py, &fs).map(|l| l.unbind()))
        })
    }

    /// This client's counters and latencies (a dict; no network).
    fn statistics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        crate::client::statistics_dict(py, &self.client.statistics())
    }
}
