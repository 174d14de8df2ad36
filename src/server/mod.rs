//! The server side: what a server serves and how it serves it.
//!
//! - [`builder`]: `ServerBuilder` and `Server` (the face), [`running`]:
//!   `RunningServer` (shutdown, abort).
//! - [`state`]: what every connection and call of one server shares.
//! - [`accept`]: listeners, the accept loop, the per-connection loop.
//! - [`dispatch`]: one stream, from its `Request` to its `Reply`: the
//!   handshake, method routing, deadlines, auth.
//! - [`inproc`]: calls from front ends in this process (gRPC compat,
//!   JSON-RPC) run through the dispatcher like native ones.
//! - [`service`]: the `TensorService` trait users implement; [`store`]: the
//!   store-by-name service the CLI serves, with [`catalog`], its index of
//!   state dicts and ages.
//!
//! May import: `pipeline`, `rpc`, `observe`, `util`, `config`, `error`, and
//! (for gRPC and HTTP listeners) `grpc` and `jsonrpc`. Nothing here is
//! imported by `client`.

pub(crate) mod accept;
pub(crate) mod auth;
pub(crate) mod builder;
pub(crate) mod catalog;
pub(crate) mod dispatch;
#[cfg(any(feature = "grpc", feature = "http"))]
pub(crate) mod inproc;
pub(crate) mod running;
pub(crate) mod service;
pub(crate) mod state;
pub(crate) mod store;
