//! Observability: call statistics and latency histograms ([`stats`]),
//! service and function descriptions ([`info`]), and the Prometheus
//! endpoint ([`metrics`], feature `metrics`).
//!
//! `stats` and `info` import nothing above `pipeline`/`rpc`'s level and
//! are used by client and server; `metrics` reads a running server.

pub(crate) mod info;
#[cfg(feature = "metrics")]
pub(crate) mod metrics;
pub(crate) mod stats;
