//! The pipeline: tensors ⇄ frames on one transport stream.
//!
//! - [`chunk`]: the sans-IO core: `Chunker` splits an encoded tensor into
//!   chunk headers + payload slices; `Reassembler` checks each arriving
//!   chunk against the declared size and limits and says where it goes.
//!   No tokio, no sockets: unit-, property- and fuzz-tested.
//! - [`wire`]: conversions between the tensor model and the protobuf headers,
//!   the protocol version.
//! - [`writer`]: `FrameWriter`, the async driver that sends a tensor chunk by
//!   chunk (encoding, compression, progress, holding small frames back).
//! - [`reader`]: `FrameReader`, the async driver that feeds arriving chunks to
//!   the `Reassembler` (or lets the transport place them), checks and decodes.
//! - [`tensors`]: `TensorStream` and `TensorSink`, the handles users see.
//! - [`budget`]: the one memory budget every receive buffer is reserved from.
//! - [`pool`]: the receive pool of recycled, already-faulted buffers,
//!   reserved from that budget.
//! - [`link`]: what a connection knows of its peer (limits, codecs) and link.
//! - [`pipe`]: an in-process stream pair (gRPC compat calls, tests).
//! - [`storages`]: which tensors of a batch share a storage sent once
//!   (state dicts: tied weights, views), sans-IO.
//! - `gpu` (feature `cuda`): tensors received chunk by chunk straight into
//!   GPU memory (`TensorStream::next_to_gpu`, `Client::fetch_to_gpu`).
//!
//! May import: `config`, `error`, `util`, `cuda`, and the codecs, proto and
//! transports crates. Nothing above it (rpc, client, server, grpc).

pub(crate) mod budget;
pub(crate) mod chunk;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
pub(crate) mod link;
pub(crate) mod pipe;
pub(crate) mod pool;
pub(crate) mod reader;
pub(crate) mod storages;
pub(crate) mod tensors;
pub(crate) mod wire;
pub(crate) mod writer;
