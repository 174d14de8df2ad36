//! The server side: what a server serves and how it serves it.
//!
//! - [`builder`]: `ServerBuilder` and `Server` (the face), [`running`]:
//!   `RunningServer` (shutdown, abort).
//! - [`state`]: what every connection and call of one server shares.
//! - [`accept`]: listeners, the accept loop, the per-connection loop.
//! - [`dispatch`]: one stream, from its `Request` to its `Reply`: the
//!   handshake, method routing, deadlines, auth.
//! - [`service`]: the `TensorService` trait users implement; [`store`]: the
//!   store-by-name service the CLI serves.
//!
//! May import: `pipeline`, `rpc`, `observe`, `util`, `config`, `error`, and
//! (for gRPC listeners) `grpc`. Nothing here is imported by `client`.

pub(crate) mod accept;
pub(crate) mod auth;
pub(crate) mod builder;
pub(crate) mod dispatch;
pub(crate) mod running;
pub(crate) mod service;
pub(crate) mod state;
pub(crate) mod store;
