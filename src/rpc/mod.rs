//! The RPC layer, shared by client and server: what a call carries
//! ([`call`]), scalar values ([`value`]), named functions with signatures
//! ([`function`]), server-side dynamic batching ([`batch`]), background
//! tasks ([`tasks`]), the built-in functions ([`builtins`]) and the retry
//! policy ([`retry`]), and what a store reports holding ([`listing`]).
//!
//! May import: `pipeline::wire`, `observe::stats`, `config`, `error`, `util`.
//! Nothing from `client`, `server` or `grpc`.

pub(crate) mod batch;
pub mod builtins;
pub(crate) mod call;
pub(crate) mod function;
pub(crate) mod listing;
pub(crate) mod retry;
pub(crate) mod tasks;
pub(crate) mod value;
