//! gRPC extras served beside `tensorwire.v1.TensorService` (which the
//! `tensorwire-transports` crate carries like any other transport):
//! health, reflection and the skytorch compat service (`service.rs`), the
//! skytorch chunk format (`chunks.rs`), status mapping (`status.rs`), and
//! [`CompatClient`] for servers that speak the skytorch protocol.
//!
//! May import: `server::state`, `server::dispatch` and `server::inproc`
//! (compat calls run through the same dispatcher), `pipeline`, `config`, `error`.

pub(crate) mod chunks;
mod client;
pub(crate) mod service;
mod status;

pub use client::{CompatClient, CompatResponse};
pub use service::HEALTH_SERVICES;
