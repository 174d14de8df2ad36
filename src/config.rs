//! Client and server settings: plain structs with documented units and defaults.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tensorwire_codecs::{CodecKind, CompressionMode, DecodeLimits};
use tensorwire_proto::v1;
use tensorwire_transports::TransportConfig;

use crate::retry::RetryPolicy;

/// Default chunk size: 1 MiB, as the Python seed uses.
pub const DEFAULT_CHUNK_SIZE: usize = 1 << 20;

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
        Self { max_tensor_bytes: 16 << 30, max_dims: 64, max_tensors_per_call: 100_000 }
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
    /// configured slow enough for it to pay).
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
        }
    }
}

impl Encoding {
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
    /// (default true; see the `coalesce` notes on [`crate::Client::call`]).
    pub coalesce: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            transport: TransportConfig::default(),
            encoding: Encoding::default(),
            limits: Limits::default(),
            timeout: None,
            retry: RetryPolicy::default(),
            auth_token: None,
            placement: true,
            progress: None,
            coalesce: true,
        }
    }
}

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Transport settings.
    pub transport: TransportConfig,
    /// How tensors the server sends are encoded, unless a call asks otherwise.
    pub encoding: Encoding,
    /// Limits on what the server receives.
    pub limits: Limits,
    /// Name reported by `service_info` and in the handshake (default "tensorwire").
    pub service_name: String,
    /// When set, clients must present this token in the handshake.
    pub auth_token: Option<String>,
    /// Time a client has to complete the handshake (default 10 s).
    pub handshake_timeout: Duration,
    /// How long a graceful shutdown waits for calls in flight (default 30 s).
    pub shutdown_grace: Duration,
    /// Let transports write received chunks straight into the tensor buffer
    /// (default true).
    pub placement: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            transport: TransportConfig::default(),
            encoding: Encoding::default(),
            limits: Limits::default(),
            service_name: "tensorwire".into(),
            auth_token: None,
            handshake_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(30),
            placement: true,
        }
    }
}
