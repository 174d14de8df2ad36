//! The client side.
//!
//! - [`session`]: `Client` itself: connecting by URL, the handshake,
//!   reconnecting, the call skeleton with timeouts and retries.
//! - [`calls`]: send, fetch and exchange; [`rpc`]: named functions, tasks
//!   and control calls; [`coalesce`]: stacking concurrent calls of a
//!   batched function into one; [`gpu`]: device tensors (feature `cuda`);
//!   [`store`]: whole state dicts, and listing and removing what a server holds;
//!   [`delta`]: sending and fetching a new version as the difference from a base.
//! - [`blocking`]: `BlockingClient` for programs without an async runtime.
//!
//! May import: `pipeline`, `rpc`, `observe`, `util`, `config`, `error`.
//! Nothing from `server` or `grpc`.

pub(crate) mod blocking;
pub(crate) mod calls;
pub(crate) mod coalesce;
pub(crate) mod delta;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
pub(crate) mod rpc;
pub(crate) mod session;
pub(crate) mod store;
