//! # tensorwire-proto
//!
//! The wire schema of tensorwire, generated from the `.proto` files beside this
//! crate with prost (and tonic for the gRPC services):
//!
//! | module | proto package | what |
//! |---|---|---|
//! | [`v1`] | `tensorwire.v1` | frame headers (`FrameHeader`, `Chunk`, `Hello`, ...) and, with the `grpc` feature, `TensorService` |
//! | [`compat`] | `skytorch.torch` | the Python skytorch tensor-streaming protocol, served unchanged |
//! | [`bench`](mod@bench) | `tensorwire.bench.v1` | a plain byte stream, the bench's gRPC peer |
//!
//! All `bytes` fields are [`bytes::Bytes`], so payloads decoded from a buffer
//! are slices of it, not copies.
//!
//! ## Feature flags
//!
//! | feature | default | enables |
//! |---|---|---|
//! | `grpc` | no | tonic client and server code for both services |
//!
//! This crate is separate from `tensorwire-transports` and `tensorwire` because
//! both need the header types (transports carry them, the pipeline fills them)
//! and cargo forbids the cycle a shared module would create.
#![warn(missing_docs)]

/// `tensorwire.v1`: frame headers and the gRPC `TensorService`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/tensorwire.v1.rs"));
}

/// `skytorch.torch`: the compat protocol of the Python tensor server.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod compat {
    include!(concat!(env!("OUT_DIR"), "/skytorch.torch.rs"));
}

/// `tensorwire.bench.v1`: a plain gRPC byte stream, the peer `tensorwire
/// bench` compares the gRPC and tcp transports with (not part of the wire).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod bench {
    include!(concat!(env!("OUT_DIR"), "/tensorwire.bench.v1.rs"));
}

pub mod header;

/// The protocol version this crate speaks (`Hello.version`).
pub const PROTOCOL_VERSION: u32 = v1::ProtocolVersion::ProtocolVersion1 as u32;

/// Encoded `FileDescriptorSet` of all `.proto` files, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptor.bin"));

impl v1::FrameHeader {
    /// A header holding `kind`.
    pub fn new(kind: v1::frame_header::Kind) -> Self {
        Self { kind: Some(kind) }
    }

    /// The chunk header, when this frame is a chunk.
    pub fn as_chunk(&self) -> Option<&v1::Chunk> {
        match &self.kind {
            Some(v1::frame_header::Kind::Chunk(c)) => Some(c),
            _ => None,
        }
    }

    /// `(tensor id, byte offset)` at which this frame's payload may be
    /// written directly into the tensor's buffer: `Some` only for
    /// uncompressed chunks after the first (the first one is what tells the
    /// receiver to allocate), whose payload maps one to one onto
    /// `offset..offset+len` of the decoded payload.
    pub fn placement_offset(&self) -> Option<(u64, u64)> {
        let c = self.as_chunk()?;
        let none = v1::Compression::None as i32;
        let plain = c.compression == none || c.compression == v1::Compression::Unspecified as i32;
        (plain && c.index > 0).then_some((c.tensor_id, c.offset))
    }

    /// Short name of the frame kind, for logs and error messages.
    pub fn kind_name(&self) -> &'static str {
        use v1::frame_header::Kind;
        match &self.kind {
            None => "empty",
            Some(Kind::Hello(_)) => "hello",
            Some(Kind::Welcome(_)) => "welcome",
            Some(Kind::Request(_)) => "request",
            Some(Kind::Chunk(_)) => "chunk",
            Some(Kind::Reply(_)) => "reply",
            Some(Kind::Error(_)) => "error",
        }
    }
}
