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
//!  user code ──► Client / Server           client/  server/   send · fetch · exchange · call(name) · tasks
//!                  │  calls, functions      rpc/               values, functions, batching, tasks, retry
//!                  │  grpc extras           grpc/              health, reflection, skytorch compat
//!                  │  JSON-RPC over HTTP    jsonrpc/           the function-sharing seed's protocol
//!                  │  Tensor ⇄ chunks       pipeline/          sans-IO chunker/reassembler + async drivers
//!                  │  Tensor ⇄ payload      tensorwire-codecs  raw │ torch │ safetensors × none │ lz4 │ zstd
//!                  ▼  frames                tensorwire-transports  tcp │ unix │ quic │ grpc │ shm (+ yours)
//!                the wire                   tensorwire-proto   FrameHeader (prost) + raw payload bytes
//! ```
//!
//! ## Layout
//!
//! Folders by concern; a file imports only from its own folder and the
//! folders below it in this list, never upward (checked by
//! `python3 tools/import_cycles.py`, which CI runs):
//!
//! | folder | what lives there |
//! |---|---|
//! | `client/` | [`Client`]: session and retries, tensor calls, RPC calls, coalescing, [`BlockingClient`], GPU sends |
//! | `server/` | [`ServerBuilder`], [`RunningServer`], accept loop, dispatcher, [`TensorService`], [`StoreService`] |
//! | `grpc/` | gRPC health/reflection, the skytorch compat service and its chunk format, [`grpc::CompatClient`] |
//! | `jsonrpc/` | JSON-RPC 2.0 over HTTP (`http://host:port`, `POST /rpc`): functions, tasks, info for any language |
//! | `rpc/` | [`Call`], [`Output`], [`Value`]/[`Args`], [`Function`], batching, tasks, [`builtins`], [`RetryPolicy`] |
//! | `observe/` | [`Statistics`], [`Histogram`], [`ServiceInfo`], the Prometheus endpoint |
//! | `pipeline/` | the sans-IO chunker/reassembler, frame reader/writer, [`TensorStream`]/[`TensorSink`] |
//! | `cuda/` | GPU tensors (feature `cuda`) |
//! | `util/` | poison-tolerant locks, host facts |
//! | `config.rs`, `error.rs` | every default (one home), the error types |
//!
//! The `tensorwire` command-line program (`src/bin/tensorwire/`) is a user
//! of this library like any other.
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
//! | `tcps://host:port` | the same over TLS (rustls), certificate options as QUIC |
//! | `unix:///path/to.sock` (`unix://@name`: abstract) | Unix stream socket, same multiplexer |
//! | `quic://host:port` | QUIC (quinn + rustls), one QUIC stream per call |
//! | `grpc://host:port`, `grpcs://…`, `grpc+unix:///path` | gRPC (tonic), `tensorwire.v1.TensorService` |
//! | `shm://name` | shared-memory payloads, control over a Unix socket |
//! | `http://host:port` | listen only: JSON-RPC 2.0 over HTTP for clients in any language (see below) |
//!
//! ## Feature flags
//!
//! | feature | default | what |
//! |---|---|---|
//! | `tcp`, `unix` | yes | byte-stream transports |
//! | `tcps` | yes | `tcps://` (TLS over TCP) |
//! | `quic` | yes | QUIC transport |
//! | `grpc` | yes | gRPC transport, compat service, health, reflection |
//! | `shm` | yes | shared-memory transport |
//! | `lz4`, `zstd` | yes | compression |
//! | `torch`, `safetensors` | yes | codecs |
//! | `http` | yes | JSON-RPC 2.0 over HTTP listeners (`http://`) |
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
//! the whole payload rides on the last chunk. Tensors of one stream that
//! view one storage (a state dict's tied weights and views) carry a
//! `storage_id`: the first brings the whole storage, the later ones no
//! payload, and all arrive sharing it with their strides and offsets.
//!
//! **State dicts and the store.** A `send` whose request names a
//! `state_dict` stores its tensors as one object, replaced whole;
//! `fetch` returns it in order; `LIST` and `REMOVE` show and delete what
//! the store holds (see `Request.params` in `wire.proto`).
//!
//! **JSON-RPC 2.0 over HTTP** (`http://host:port`, `POST /rpc`, feature
//! `http`) serves the same functions and tasks to clients in any language;
//! each request runs through the same dispatcher as a native call.
#![warn(missing_docs)]

mod client;
mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "grpc")]
pub mod grpc;
#[cfg(feature = "http")]
mod jsonrpc;
mod observe;
mod pipeline;
mod rpc;
mod server;
pub mod transport;
mod util;

pub use client::blocking::BlockingClient;
pub use client::session::{CallOptions, Client};
pub use client::store::{StateDictEntry, StateDictStream};
pub use config::{
    ClientConfig, DEFAULT_CHUNK_SIZE, DEFAULT_MAX_AUTH_FAILURES, DEFAULT_MAX_DIMS, DEFAULT_MAX_HTTP_BODY_BYTES,
    DEFAULT_MAX_HTTP_RESPONSE_BYTES, DEFAULT_MAX_STORE_BYTES, DEFAULT_MAX_TENSOR_BYTES, DEFAULT_MAX_TENSORS_PER_CALL,
    DEFAULT_RECV_POOL_BYTES, DEFAULT_RECV_POOL_IDLE, DEFAULT_RECV_POOL_MIN_BYTES, DEFAULT_SERVICE_NAME, Encoding,
    Limits, ServerConfig, VERSION,
};
pub use error::{CallError, Code, Status};
pub use observe::info::{FunctionInfo, FunctionStatistics, ServiceInfo};
#[cfg(feature = "metrics")]
pub use observe::metrics::MetricsEndpoint;
pub use observe::stats::{Histogram, Statistics};
pub use pipeline::budget::{MemoryBudget, OverBudget, Reclaimer, Reservation};
pub use pipeline::tensors::{TensorSink, TensorStream};
pub use pipeline::wire::PROTOCOL_VERSION;
pub use rpc::batch::BatchConfig;
pub use rpc::builtins;
pub use rpc::call::{Call, CallContext, Cancellation, FetchRequest, Output, SendSummary};
pub use rpc::function::{Function, TensorSpec};
pub use rpc::listing::{Selector, StoreUsage, StoredTensor};
pub use rpc::retry::{RetryPolicy, RetryStrategy};
pub use rpc::tasks::{TaskConfig, TaskState};
pub use rpc::value::{Args, Value};
pub use server::builder::{ServeError, Server, ServerBuilder};
pub use server::running::RunningServer;
pub use server::service::{EchoService, TensorService};
pub use server::store::{EvictPolicy, StoreService, parse_shape};
pub use util::malloc::tune_allocator;

/// The tensor model and the file formats (torch.save, safetensors) and
/// compressors: the `tensorwire-codecs` crate.
pub use tensorwire_codecs as codecs;
pub use tensorwire_codecs::{
    AlignedBuf, CodecKind, Complex, Compression, CompressionMode, DType, Device, Element, F8E4M3, F8E5M2, Storage,
    Tensor, TensorError,
};
pub use tensorwire_transports::{ConnectError, Endpoint, ListenError, Scheme, StreamError, TransportConfig};
