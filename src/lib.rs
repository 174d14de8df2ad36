//! # tensorwire
//!
//! Move tensors between processes and machines, fast and safely. A
//! **transport** (TCP, Unix socket, QUIC, gRPC, shared memory) and a **codec**
//! (raw bytes, torch.save-compatible, safetensors; lz4/zstd compression)
//! compose into client/server pipelines in which large tensors flow as
//! chunks with backpressure. The transport is picked per deployment by URL:
//! the same client and server code runs over every one.
//!
//! ```text
//!  user code ──► Client / Server          send · fetch · exchange · call(name) · batched · tasks
//!                  │  Tensor ⇄ payload     codecs: raw │ torch │ safetensors  ×  none │ lz4 │ zstd (+shuffle)
//!                  │  payload ⇄ chunks     sans-IO chunker/reassembler (chunk module)
//!                  ▼  frames               transports: tcp │ unix │ quic │ grpc │ shm
//!                the wire                  proto: FrameHeader (prost) + raw payload bytes
//! ```
//!
//! ## Quick start
//!
//! ```no_run
//! use tensorwire::{Client, Server, Tensor};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let server = Server::builder()
//!     .compute("double", |inputs| {
//!         let x = inputs[0].to_vec::<f32>()?;
//!         let y: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
//!         Ok(vec![Tensor::from_vec(inputs[0].shape(), y)?])
//!     })
//!     .build()
//!     .start(["tcp://127.0.0.1:0"])
//!     .await?;
//!
//! let client = Client::connect(&server.url()).await?;
//! let x = Tensor::from_vec([2, 2], vec![1.0f32, 2.0, 3.0, 4.0])?;
//! let y = client.compute("double", vec![x]).await?;
//! assert_eq!(y[0].as_slice::<f32>()?, &[2.0, 4.0, 6.0, 8.0]);
//! # Ok(()) }
//! ```
//!
//! ## URL schemes
//!
//! | URL | transport |
//! |---|---|
//! | `tcp://host:port` | TCP, streams multiplexed with per-stream credit |
//! | `unix:///path/to.sock` (`unix://@name`: abstract) | Unix stream socket, same multiplexer |
//! | `quic://host:port` | QUIC (quinn + rustls), one QUIC stream per call |
//! | `grpc://host:port`, `grpcs://…`, `grpc+unix:///path` | gRPC (tonic), `tensorwire.v1.TensorService` |
//! | `shm://name` | shared-memory payloads, control over a Unix socket |
//!
//! ## Feature flags
//!
//! | feature | default | what |
//! |---|---|---|
//! | `tcp`, `unix` | yes | byte-stream transports |
//! | `quic` | yes | QUIC transport |
//! | `grpc` | yes | gRPC transport, compat service, health, reflection |
//! | `shm` | yes | shared-memory transport |
//! | `lz4`, `zstd` | yes | compression |
//! | `torch`, `safetensors` | yes | codecs |
//! | `metrics` | yes | Prometheus text endpoint |
//! | `cli` | yes | the `tensorwire` binary |
//! | `cuda` | no | GPU tensors (cudarc, loaded at run time) |
//!
//! # Protocol
//!
//! Version 1; see `proto/tensorwire/v1/wire.proto` for every field.
//!
//! **Byte streams (TCP, Unix, shm control).** Each side first sends a
//! 16-byte preface: `"TWMX"`, the mux version (u16, 1), flags (u16), its
//! per-stream window (u32) and largest frame payload (u32). Then frames,
//! each a 16-byte head — stream id (u32), type (u8), flags (u8), reserved
//! (u16), meta length (u32), value (u32) — followed by meta bytes and, for
//! DATA, `value` payload bytes. All little-endian. DATA carries a protobuf
//! `FrameHeader` as meta; WINDOW returns credit; RESET/STOP abort one
//! direction of a stream; GOAWAY closes the connection with a reason.
//! Clients open odd stream ids, servers even. A receiver that gets more than
//! a stream's credit, a frame above its limits, or an unknown type closes the
//! connection with a GOAWAY naming the cause. (See `tensorwire_transports::mux`.)
//!
//! **QUIC**: one bidirectional stream per logical stream; each frame is
//! `u32 meta length, u32 payload length, meta, payload`.
//! **gRPC**: one call per logical stream; frames are `tensorwire.v1.Frame`
//! messages (header and payload `bytes`).
//!
//! **Logical streams.** The first stream of a connection is the handshake:
//! `Hello` (version, codecs and compressions the client decodes, chunk size,
//! limits, auth token, host id) answered by `Welcome` (the same from the
//! server) or `Error` (`UNSUPPORTED_VERSION`, `UNAUTHENTICATED`). Every other
//! stream is one call: the client sends a `Request` (method, function, params,
//! args, timeout, idempotent, wanted response encoding), then input tensors,
//! then ends its direction; the server sends output tensors, then a `Reply`
//! (summary, values, server time) or an `Error` (code and message), then ends.
//!
//! **Tensors** travel as chunks: a `Chunk` header (tensor id, index, byte
//! offset, total bytes, last flag, compression, shuffle element size,
//! decoded length; the first chunk also carries `TensorInfo`: dtype, shape,
//! strides, device, name, metadata, codec) followed by the chunk's payload.
//! The receiver checks the declared total against `max_tensor_bytes`,
//! allocates the tensor once, and writes every chunk at its offset
//! (decompressing into exactly the declared length). An optional CRC-32C of
//! the whole payload rides on the last chunk.
#![warn(missing_docs)]

mod batch;
pub mod bench;
pub mod builtins;
pub mod chunk;
mod client;
mod coalesce;
#[cfg(feature = "torch")]
pub(crate) mod compat;
pub mod config;
mod connect;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dispatch;
pub mod error;
mod function;
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "grpc")]
pub mod grpc;
mod info;
#[cfg(feature = "metrics")]
pub mod metrics;
mod pipe;
pub mod retry;
mod server;
mod service;
mod stats;
pub mod store;
pub mod stream;
mod tasks;
pub mod value;
pub mod wire;

pub use batch::BatchConfig;
pub use client::{BlockingClient, CallOptions, Client};
pub use config::{ClientConfig, Encoding, Limits, ServerConfig};
pub use error::{CallError, Code, Status};
pub use function::{Call, Function, Output, TensorSpec};
pub use info::{FunctionInfo, FunctionStatistics, ServiceInfo};
pub use retry::{RetryPolicy, RetryStrategy};
pub use server::{RunningServer, ServeError, Server, ServerBuilder};
pub use service::{CallContext, Cancellation, EchoService, FetchRequest, SendSummary, TensorService};
pub use stats::{Histogram, Statistics};
pub use stream::{TensorSink, TensorStream};
pub use tasks::{TaskConfig, TaskState};
pub use value::{Args, Value};

pub use tensorwire_codecs as codecs;
pub use tensorwire_codecs::{
    AlignedBuf, CodecKind, Complex, Compression, CompressionMode, DType, Device, Element, F8E4M3, F8E5M2, Storage,
    Tensor, TensorError,
};
pub use tensorwire_proto as proto;
pub use tensorwire_transports as transports;
pub use tensorwire_transports::{ConnectError, Endpoint, ListenError, Scheme, StreamError, TransportConfig};

/// The wire protocol version.
pub const PROTOCOL_VERSION: u32 = tensorwire_proto::PROTOCOL_VERSION;

/// This crate's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Identifies this host for same-host detection: the kernel's boot id.
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Devices this process can put tensors on.
pub(crate) fn devices() -> Vec<String> {
    #[allow(unused_mut)]
    let mut d = vec!["cpu".to_string()];
    #[cfg(feature = "cuda")]
    d.extend(cuda::device_names());
    d
}
