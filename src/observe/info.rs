//! What a server says about itself: functions, statistics, health.

use std::time::Duration;

use tensorwire_proto::v1;

use crate::rpc::function::TensorSpec;
use crate::rpc::listing::StoreUsage;

/// A function as `list_functions` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionInfo {
    /// Name.
    pub name: String,
    /// Declared inputs, if any.
    pub inputs: Option<Vec<TensorSpec>>,
    /// Description.
    pub doc: String,
    /// For batched functions: largest batch and longest wait.
    pub batch: Option<(usize, Duration)>,
    /// True for async functions.
    pub is_async: bool,
    /// Names of its scalar arguments in positional order, if declared.
    pub arg_names: Vec<String>,
}

impl FunctionInfo {
    pub(crate) fn from_wire(w: &v1::FunctionInfo) -> Self {
        Self {
            name: w.name.clone(),
            inputs: (!w.inputs.is_empty()).then(|| w.inputs.iter().map(TensorSpec::from_wire).collect()),
            doc: w.doc.clone(),
            batch: (w.max_batch > 0).then(|| (w.max_batch as usize, Duration::from_micros(w.max_wait_us))),
            is_async: w.is_async,
            arg_names: w.arg_names.clone(),
        }
    }
}

/// Per-function server statistics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FunctionStatistics {
    /// Function name.
    pub name: String,
    /// Calls (examples, for batched functions).
    pub calls: u64,
    /// Failed calls.
    pub failures: u64,
    /// Runs of the function (batches, for batched functions).
    pub batches: u64,
    /// Time spent in the function.
    pub total_time: Duration,
}

/// The server's name, capabilities and totals (`service_info`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceInfo {
    /// Configured service name.
    pub service_name: String,
    /// tensorwire version of the server.
    pub version: String,
    /// Transports it listens on.
    pub transports: Vec<String>,
    /// Codecs it accepts.
    pub codecs: Vec<String>,
    /// Compressions it accepts.
    pub compressions: Vec<String>,
    /// Devices it has (`cpu`, `cuda:0`, ...).
    pub devices: Vec<String>,
    /// Time since it started.
    pub uptime: Duration,
    /// Calls served.
    pub calls: u64,
    /// Calls that failed.
    pub failures: u64,
    /// Tensor payload bytes received.
    pub bytes_received: u64,
    /// Tensor payload bytes sent.
    pub bytes_sent: u64,
    /// Calls in progress.
    pub active_calls: u64,
    /// Per-function statistics.
    pub functions: Vec<FunctionStatistics>,
    /// The memory budget every receive buffer is reserved from, in bytes.
    pub memory_limit: u64,
    /// Bytes reserved from it now.
    pub memory_used: u64,
    /// Reservations refused (RESOURCE_EXHAUSTED) since start.
    pub memory_refused: u64,
    /// Receives served by a recycled buffer of the receive pool.
    pub recv_pool_hits: u64,
    /// Pooled-size receives that allocated a new buffer.
    pub recv_pool_misses: u64,
    /// Bytes of receive buffers idle in the pool now (counted in `memory_used`).
    pub recv_pool_idle_bytes: u64,
    /// What the store service holds (zeros for services that store nothing).
    pub store: StoreUsage,
}

impl ServiceInfo {
    pub(crate) fn to_wire(&self) -> v1::ServiceInfo {
        v1::ServiceInfo {
            service_name: self.service_name.clone(),
            version: self.version.clone(),
            transports: self.transports.clone(),
            codecs: self.codecs.clone(),
            compressions: self.compressions.clone(),
            devices: self.devices.clone(),
            uptime_ms: self.uptime.as_millis() as u64,
            calls: self.calls,
            failures: self.failures,
            bytes_received: self.bytes_received,
            bytes_sent: self.bytes_sent,
            active_calls: self.active_calls,
            functions: self
                .functions
                .iter()
                .map(|f| v1::FunctionStats {
                    name: f.name.clone(),
                    calls: f.calls,
                    failures: f.failures,
                    batches: f.batches,
                    examples: f.calls,
                    total_time_us: f.total_time.as_micros() as u64,
                })
                .collect(),
            memory_limit: self.memory_limit,
            memory_used: self.memory_used,
            memory_refused: self.memory_refused,
            recv_pool_hits: self.recv_pool_hits,
            recv_pool_misses: self.recv_pool_misses,
            recv_pool_idle_bytes: self.recv_pool_idle_bytes,
            stored_tensors: self.store.tensors,
            stored_bytes: self.store.bytes,
            store_max_bytes: self.store.max_bytes,
        }
    }

    pub(crate) fn from_wire(w: &v1::ServiceInfo) -> Self {
        Self {
            service_name: w.service_name.clone(),
            version: w.version.clone(),
            transports: w.transports.clone(),
            codecs: w.codecs.clone(),
            compressions: w.compressions.clone(),
            devices: w.devices.clone(),
            uptime: Duration::from_millis(w.uptime_ms),
            calls: w.calls,
            failures: w.failures,
            bytes_received: w.bytes_received,
            bytes_sent: w.bytes_sent,
            active_calls: w.active_calls,
            functions: w
                .functions
                .iter()
                .map(|f| FunctionStatistics {
                    name: f.name.clone(),
                    calls: f.calls,
                    failures: f.failures,
                    batches: f.batches,
                    total_time: Duration::from_micros(f.total_time_us),
                })
                .collect(),
            memory_limit: w.memory_limit,
            memory_used: w.memory_used,
            memory_refused: w.memory_refused,
            recv_pool_hits: w.recv_pool_hits,
            recv_pool_misses: w.recv_pool_misses,
            recv_pool_idle_bytes: w.recv_pool_idle_bytes,
            store: StoreUsage { tensors: w.stored_tensors, bytes: w.stored_bytes, max_bytes: w.store_max_bytes },
        }
    }
}
