//! `grpc://host:port`, `grpcs://host:port` and `grpc+unix:///path`: the
//! `tensorwire.v1.TensorService` of `proto/tensorwire/v1/service.proto`
//! over HTTP/2 (hyper; tonic's router and services beside it).
//!
//! Each logical stream is one gRPC call whose messages are frames (a
//! `FrameHeader` and its payload as a `bytes` field, kept as the received
//! DATA frames' bytes until copied once, see below). The method names the call kind:
//! `Handshake` (unary), `Send` (client stream), `Fetch` (server stream),
//! `Exchange` and `Call` (bidirectional).
//!
//! **Speed.** hyper's HTTP/2 defaults (1 MiB server windows, 16 KiB frames,
//! adaptive windows off) move large messages at 0.1–0.3× of raw TCP. Both
//! ends here use [`GrpcConfig`](crate::config::GrpcConfig): 16 MiB stream
//! windows, 64 MiB connection windows and 1 MiB HTTP/2 frames. Message size
//! limits follow the frame limits ([`TransportConfig::max_frame_payload`](crate::TransportConfig::max_frame_payload)
//! plus header room), never tonic's hidden 4 MiB default.
//!
//! **Server.** A gRPC server is stateless: calls from every HTTP/2
//! connection reach the pipeline as the streams of one [`Connection`](crate::Connection) whose
//! [`ConnectionInfo::stateless`](crate::ConnectionInfo::stateless) is true (the pipeline then checks
//! authentication per call). Other tonic services (health, reflection, the
//! skytorch compat service) are mounted beside it with [`listen_with`].
//! Closing that connection stops the server gracefully (HTTP/2 GOAWAY).
//!
//! **Client.** One HTTP/2 connection per [`Connection`](crate::Connection); [`channel`] gives
//! the raw [`GrpcChannel`] for tonic clients of other services.
//!
//! **TLS** (`grpcs://`) uses the same certificate options as QUIC
//! ([`TlsConfig`](crate::config::TlsConfig): PEM files or a self-signed
//! certificate whose fingerprint the client pins, CA files, mutual TLS),
//! with ALPN `h2`.
//!
//! **Messages without tonic's codec.** The calls of
//! `tensorwire.v1.TensorService` are made and served by hand over hyper
//! (the same messages, methods and statuses as the generated tonic code,
//! so grpcio and tonic peers are served as before): a chunk's payload goes
//! to HTTP/2 as its own buffer after a small head instead of being copied
//! into an encode buffer, and a received payload stays in the DATA frames'
//! own bytes until it is copied once, into the tensor's buffer when the
//! pipeline placed one (see `wire`).
//!
//! **Bounds.** A server connection's calls hold at most
//! [`TransportConfig::connection_window`](crate::TransportConfig::connection_window)
//! bytes of unfinished messages (plus one message; see `held`), and a
//! listener keeps at most
//! [`TransportConfig::max_connections`](crate::TransportConfig::max_connections)
//! connections open, refusing more with an HTTP/2 GOAWAY that says why.
//!
//! Files: `wire` (the message format, sans-IO), `body` (call bodies out
//! and in), `held` (what a connection's unfinished messages hold),
//! `settings` (ALPN, message limit, socket tuning), `client`
//! ([`GrpcChannel`], [`connect`]), `server` (the service, [`listen`],
//! [`listen_with`]), `io` (accepted sockets for tonic), `streams` (the
//! stream handles over calls). This file only declares and re-exports;
//! children import each other through `super::child`.

mod body;
mod client;
#[cfg(feature = "fuzzing")]
pub mod fuzz;
mod held;
mod io;
mod server;
mod settings;
mod streams;
mod wire;

pub use client::{GrpcChannel, RequestBody, channel, connect};
pub use held::unfinished_message_bytes;
pub use io::ConnectInfo;
pub use server::{listen, listen_with};
pub use settings::message_limit;
pub use tonic::service::Routes;
