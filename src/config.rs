//! Client and server settings: plain structs with documented units and
//! defaults. This file is the one home of every default of the `tensorwire`
//! crate (the CLI's flags read them from here), and of the tuning numbers
//! the pipeline uses on its hot paths.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tensorwire_codecs::{CodecKind, Compression, CompressionMode, DecodeLimits};
use tensorwire_proto::v1;
use tensorwire_transports::TransportConfig;

use crate::rpc::retry::RetryPolicy;
use crate::transport::Transports;

/// This crate's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Default chunk size: 1 MiB, as the Python seed uses.
pub const DEFAULT_CHUNK_SIZE: usize = 1 << 20;
/// Default largest tensor a receiver accepts: 16 GiB.
pub const DEFAULT_MAX_TENSOR_BYTES: u64 = 16 << 30;
/// Default most dimensions of a received tensor.
pub const DEFAULT_MAX_DIMS: usize = 64;
/// Default most tensors in one call.
pub const DEFAULT_MAX_TENSORS_PER_CALL: u32 = 100_000;
/// Default memory budget of the [`StoreService`](crate::StoreService): 8 GiB.
pub const DEFAULT_MAX_STORE_BYTES: u64 = 8 << 30;
/// Default largest JSON-RPC request body over HTTP: 64 MiB (JSON and base64
/// suit small calls; large tensors travel faster on the native protocol).
pub const DEFAULT_MAX_HTTP_BODY_BYTES: u64 = 64 << 20;
/// Default largest JSON-RPC response over HTTP: 256 MiB, a batch's answers
/// together (a tensor travels as base64, 4/3 of its bytes).
pub const DEFAULT_MAX_HTTP_RESPONSE_BYTES: u64 = 256 << 20;
/// Default most bytes of receive buffers kept idle for reuse (the receive
/// pool): 1 GiB, and never more than a quarter of the memory budget.
pub const DEFAULT_RECV_POOL_BYTES: u64 = 1 << 30;
/// Receives smaller than this (1 MiB) are not pooled: the allocator
/// recycles small buffers well on its own.
pub const DEFAULT_RECV_POOL_MIN_BYTES: usize = 1 << 20;
/// A pooled receive buffer unused this long (30 s) is freed.
pub const DEFAULT_RECV_POOL_IDLE: Duration = Duration::from_secs(30);
/// Default service name reported in the handshake and by `info`.
pub const DEFAULT_SERVICE_NAME: &str = "tensorwire";
/// Default time a client has to complete the handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time a graceful shutdown waits for calls in flight.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Default wrong auth tokens a peer (by IP) may present within
/// a minute before it is refused for the rest of that minute.
pub const DEFAULT_MAX_AUTH_FAILURES: u32 = 5;
/// The window over which wrong auth tokens are counted.
pub const AUTH_FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// How often expired task results are swept even when nobody asks.
pub(crate) const TASK_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// Half of this process's open-file limit (each connection holds at least
/// one descriptor; shared memory ones several), at most 65,536: the default
/// `max_connections`.
pub fn default_max_connections() -> usize {
    // SAFETY: getrlimit only writes the struct it is given.
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 { r.rlim_cur } else { 1024 };
    (soft / 2).clamp(16, 65_536) as usize
}

// Tuning of the pipeline's hot paths (not settings: named here so they have
// one home and a reason).

/// Chunk size over `ucx://`, at least: each chunk is one UCX rendezvous
/// (a request, the zero-copy get, an acknowledgement, and the frame naming
/// it on the control socket), so 1 MiB chunks spend more time in those
/// round trips than in moving bytes; 16 MiB ones amortise them.
pub(crate) const UCX_CHUNK_BYTES: usize = 16 << 20;
/// Over `ucx://`, a tensor's first chunk is at most this: it travels by
/// tag and, for a large tensor on shared memory, asks the receiver for
/// memory to put the rest into (see `tensorwire_transports::ucx`), so a
/// small one starts the puts sooner.
pub(crate) const UCX_FIRST_CHUNK_BYTES: usize = 1 << 20;

/// Small frames are held back and leave together once this many payload
/// bytes are pending (a small call is then one write on each side).
pub(crate) const HOLD_FLUSH_BYTES: usize = 64 << 10;
/// Chunks shorter than this are sent uncompressed: compression cannot save
/// the cost of its own framing on them.
pub(crate) const MIN_COMPRESS_BYTES: usize = 512;
/// Below this, `auto` compression cannot save enough time to pay for
/// trying (sampling costs tens of microseconds).
pub(crate) const AUTO_COMPRESS_MIN_BYTES: usize = 256 << 10;
/// `auto` compression decides from a sample of this many bytes.
pub(crate) const AUTO_COMPRESS_SAMPLE_BYTES: usize = 256 << 10;
/// Most requests in one JSON-RPC batch.
#[cfg(feature = "http")]
pub(crate) const JSONRPC_MAX_BATCH: usize = 1024;
/// Requests of one JSON-RPC batch run at once, at most.
#[cfg(feature = "http")]
pub(crate) const JSONRPC_BATCH_CONCURRENCY: usize = 16;
/// Time an HTTP request body has to arrive once its headers have.
#[cfg(feature = "http")]
pub(crate) const HTTP_BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest `tensorwire.result` wait over HTTP (a longer `wait_ms` is cut
/// to this; the client asks again): a client that went away stops holding
/// the server's call slot after this long.
#[cfg(feature = "http")]
pub(crate) const JSONRPC_MAX_WAIT_MS: u64 = 60_000;
/// Memory a parsed JSON value may take beyond its text: a
/// `serde_json::Value` (order-preserving maps) in a vector that grew by
/// doubling. A request body is reserved against the memory budget as its
/// bytes three times (the body, its parsed strings, the tensors decoded
/// from them) plus this per value in it.
#[cfg(feature = "http")]
pub(crate) const JSON_VALUE_BYTES: u64 = 160;
/// A JSON-RPC request whose parse is estimated below this (64 KiB) is not
/// reserved against the memory budget (a health check always gets
/// through); and a response may pass `max_http_response_bytes` by this
/// much, so a small answer fits whatever the limit.
#[cfg(feature = "http")]
pub(crate) const HTTP_SMALL_BYTES: u64 = 64 << 10;
/// A JSON-RPC request is not run once its response has less room than this
/// (4 KiB) left: a call that runs has room to say what it did.
#[cfg(feature = "http")]
pub(crate) const MIN_ANSWER_ROOM: u64 = 4 << 10;
// Requests of a batch in flight at once hold at most the slack between
// them, so a batch whose answers fit the limit never starves.
#[cfg(feature = "http")]
const _: () = assert!(JSONRPC_BATCH_CONCURRENCY as u64 * MIN_ANSWER_ROOM <= HTTP_SMALL_BYTES);
/// Transfers shorter than this say little about a link's throughput.
pub(crate) const LINK_ESTIMATE_MIN_BYTES: u64 = 16 << 20;
/// Weight of the newest transfer in the link throughput estimate
/// (an exponentially weighted moving average).
pub(crate) const LINK_ESTIMATE_WEIGHT: f64 = 0.3;

/// Limits a receiver enforces on what it is sent. Checked before anything
/// is allocated; the sender learns the peer's in the handshake and refuses
/// oversized tensors before sending them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest tensor payload, in bytes (default 16 GiB).
    pub max_tensor_bytes: u64,
    /// Most dimensions (default 64).
    pub max_dims: usize,
    /// Most tensors in one call (default 100,000).
    pub max_tensors_per_call: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_tensor_bytes: DEFAULT_MAX_TENSOR_BYTES,
            max_dims: DEFAULT_MAX_DIMS,
            max_tensors_per_call: DEFAULT_MAX_TENSORS_PER_CALL,
        }
    }
}

impl Limits {
    /// The codec decoder's limits for these.
    pub fn decode_limits(&self) -> DecodeLimits {
        DecodeLimits { max_tensor_bytes: self.max_tensor_bytes, max_dims: self.max_dims, ..DecodeLimits::default() }
    }

    pub(crate) fn to_wire(&self, transport: &TransportConfig) -> v1::Limits {
        v1::Limits {
            max_tensor_bytes: self.max_tensor_bytes,
            max_header_bytes: transport.max_header_bytes.into(),
            max_chunk_bytes: transport.max_frame_payload.into(),
            max_dims: self.max_dims as u32,
            max_tensors_per_call: self.max_tensors_per_call,
            max_concurrent_streams: transport.max_concurrent_streams,
        }
    }
}

/// How tensors are encoded and compressed when sent.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoding {
    /// Codec (default raw).
    pub codec: CodecKind,
    /// Compression (default auto: on only when the link is measured or
    /// configured slow enough for it to pay; off over shared memory unless
    /// `link_bandwidth` is set).
    pub compression: CompressionMode,
    /// Byte-shuffle multi-byte elements before compressing with a fixed
    /// compression (auto decides for itself). Default false.
    pub shuffle: bool,
    /// Link bandwidth in bytes per second, for auto compression. None:
    /// measured from previous transfers on the connection.
    pub link_bandwidth: Option<f64>,
    /// Chunk size in bytes (default 1 MiB; rounded to a multiple of 64).
    pub chunk_size: usize,
    /// Send a CRC-32C of each tensor and check it on receipt (default false:
    /// TCP, QUIC and TLS already protect the bytes; costs one pass over the data).
    pub checksums: bool,
    /// Send a CRC-32C with every chunk, checked before the chunk is used
    /// (None, the default: on over `tcp://`, whose 16-bit checksum lets
    /// corruption through; off where TLS (`tcps://`, `grpcs://`) or QUIC
    /// authenticate every record, and on same-host transports).
    pub chunk_checksums: Option<bool>,
}

impl Default for Encoding {
    fn default() -> Self {
        Self {
            codec: CodecKind::Raw,
            compression: CompressionMode::Auto,
            shuffle: false,
            link_bandwidth: None,
            chunk_size: DEFAULT_CHUNK_SIZE,
            checksums: false,
            chunk_checksums: None,
        }
    }
}

impl Encoding {
    /// Whether chunks carry checksums over `transport` (a
    /// [`ConnectionInfo::transport`](crate::transport::ConnectionInfo) name).
    pub fn chunk_checksums_on(&self, transport: &str) -> bool {
        self.chunk_checksums.unwrap_or(transport == "tcp")
    }

    /// The compression used over `transport`: as configured, except that
    /// `auto` is off over shared memory (`shm`, `unix+shm`) unless
    /// `link_bandwidth` is given: no compressor outruns a copy between
    /// processes, only uncompressed tensors go into shared segments, and
    /// the trial on every tensor's sample would cost more than it could save.
    pub fn compression_on(&self, transport: &str) -> CompressionMode {
        let shared_memory = transport == "shm" || transport.ends_with("+shm");
        if shared_memory && self.compression == CompressionMode::Auto && self.link_bandwidth.is_none() {
            return CompressionMode::Fixed(Compression::None);
        }
        self.compression
    }

    /// The chunk size actually used: at least 4 KiB, a multiple of 64 so
    /// chunks split on element boundaries of every dtype.
    pub fn effective_chunk_size(&self) -> usize {
        (self.chunk_size.max(4096) / 64) * 64
    }
}

/// Client settings.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Transport settings (windows, TLS, QUIC, ...).
    pub transport: TransportConfig,
    /// Transports of your own, used for the schemes they name (default:
    /// none, the built-in transports serve every scheme).
    pub transports: Transports,
    /// How tensors this client sends are encoded.
    pub encoding: Encoding,
    /// Limits on what this client receives.
    pub limits: Limits,
    /// Default per-call timeout (None: no timeout).
    pub timeout: Option<Duration>,
    /// Retries of failed connections and idempotent calls.
    pub retry: RetryPolicy,
    /// Shared-secret token sent in the handshake.
    pub auth_token: Option<String>,
    /// Let transports write received chunks straight into the tensor buffer
    /// (default true).
    pub placement: bool,
    /// When set, tensor payload bytes sent and received are added here as
    /// each chunk moves (for progress bars).
    pub progress: Option<Arc<AtomicU64>>,
    /// Stack concurrent calls of the same batched function into one call
    /// (default true; see [`Client::call`](crate::Client::call)).
    pub coalesce: bool,
    /// Most bytes of large receive buffers kept for reuse after the tensors
    /// received into them are dropped, so that fetching tensor after tensor
    /// pays no page faults (default [`DEFAULT_RECV_POOL_BYTES`]; 0: none).
    pub recv_pool_bytes: u64,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            transport: TransportConfig::default(),
            transports: Transports::default(),
            encoding: Encoding::default(),
            limits: Limits::default(),
            timeout: None,
            retry: RetryPolicy::default(),
            auth_token: None,
            placement: true,
            progress: None,
            coalesce: true,
            recv_pool_bytes: DEFAULT_RECV_POOL_BYTES,
        }
    }
}

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Transport settings.
    pub transport: TransportConfig,
    /// Transports of your own, used for the schemes they name (default:
    /// none). See [`ServerBuilder::transport`](crate::ServerBuilder::transport).
    pub transports: Transports,
    /// How tensors the server sends are encoded, unless a call asks otherwise.
    pub encoding: Encoding,
    /// Limits on what the server receives.
    pub limits: Limits,
    /// Name reported by `service_info` and in the handshake (default "tensorwire").
    pub service_name: String,
    /// When set, clients must present this token in the handshake.
    pub auth_token: Option<String>,
    /// Wrong tokens a peer (by IP) may present within a minute before every
    /// attempt of it is refused for the rest of that minute (default 5; 0:
    /// no limit).
    pub max_auth_failures: u32,
    /// Most connections open at once (default: half the process's open-file
    /// limit, at most 65,536). At the cap the oldest idle connection is
    /// closed to make room; with none idle a new one is refused. A gRPC
    /// listener counts its HTTP/2 connections on their own against it
    /// (unless `transport.max_connections` says otherwise) and refuses
    /// new ones at the cap.
    pub max_connections: usize,
    /// Most connections open at once from one peer IP (local sockets count
    /// as one peer; default: `max_connections`).
    pub max_connections_per_peer: usize,
    /// Time a client has to complete the handshake (default 10 s).
    pub handshake_timeout: Duration,
    /// How long a graceful shutdown waits for calls in flight (default 30 s).
    pub shutdown_grace: Duration,
    /// Let transports write received chunks straight into the tensor buffer
    /// (default true).
    pub placement: bool,
    /// The memory budget, in bytes, that every receive buffer (tensors in
    /// flight and everything holding them: the store, batch queues, task
    /// results, compat reassembly) is reserved from before it is allocated
    /// (default: half of this machine's memory). Over it, calls fail with
    /// `RESOURCE_EXHAUSTED` before their bytes are read.
    pub max_memory_bytes: u64,
    /// Most bytes of large receive buffers kept for reuse (the receive
    /// pool) after the tensors received into them are dropped, so that
    /// steady traffic pays no page faults (default
    /// [`DEFAULT_RECV_POOL_BYTES`], at most a quarter of
    /// `max_memory_bytes`; 0: none). Pooled buffers, idle or in use, count
    /// against `max_memory_bytes`; idle ones are freed first when it is short.
    pub recv_pool_bytes: u64,
    /// Largest JSON-RPC request body on `http://` listeners, in bytes
    /// (default 64 MiB); larger ones are refused with 413 unread.
    pub max_http_body_bytes: u64,
    /// Largest JSON-RPC response on `http://` listeners, in bytes (default
    /// [`DEFAULT_MAX_HTTP_RESPONSE_BYTES`]): an answer that would pass it,
    /// alone or with the batch's answers before it, is an error instead
    /// (a result's tensors are checked before they are encoded). A
    /// response may pass it by 64 KiB, so a small answer fits whatever the
    /// limit (0 allows only small answers).
    pub max_http_response_bytes: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            transport: TransportConfig::default(),
            transports: Transports::default(),
            encoding: Encoding::default(),
            limits: Limits::default(),
            service_name: DEFAULT_SERVICE_NAME.into(),
            auth_token: None,
            max_auth_failures: DEFAULT_MAX_AUTH_FAILURES,
            max_connections: default_max_connections(),
            max_connections_per_peer: default_max_connections(),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            placement: true,
            max_memory_bytes: crate::pipeline::budget::default_limit(),
            recv_pool_bytes: DEFAULT_RECV_POOL_BYTES,
            max_http_body_bytes: DEFAULT_MAX_HTTP_BODY_BYTES,
            max_http_response_bytes: DEFAULT_MAX_HTTP_RESPONSE_BYTES,
        }
    }
}
