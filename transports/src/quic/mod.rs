//! `quic://host:port`: QUIC with quinn and rustls (ring), ALPN `tensorwire/1`.
//!
//! Each logical stream is one bidirectional QUIC stream, so concurrent calls
//! never block each other (no head-of-line blocking between streams), and
//! QUIC's per-stream flow control bounds what each may buffer. The framing
//! on a stream is in [`stream`](self) (`QuicConnection`); striping one
//! logical connection over several QUIC connections is in [`group`].
//!
//! TLS (see [`crate::tls`]): a server without a certificate generates a
//! self-signed one and puts its fingerprint in its URL
//! (`quic://host:port?pin-sha256=...`), so the URL it prints is all a client
//! needs; CA files, mutual TLS and an explicit opt-out exist too.
//!
//! Tuning (see [`QuicConfig`](crate::config::QuicConfig)): stream and connection windows sized for a
//! large bandwidth-delay product, a selectable congestion controller, larger
//! UDP socket buffers, keep-alive and idle timeout, striping.
//!
//! Files: `settings` (quinn configs, sockets), `client` (connect),
//! `server` (listen, admit), `stream` (framing on a QUIC stream,
//! [`QuicConnection`]), [`group`] (striping), `errors` (error mapping). This
//! file only declares and re-exports; children import each other through
//! `super::child`, never through this file's re-exports.

mod client;
mod errors;
pub mod group;
mod server;
mod settings;
mod stream;

pub use client::connect;
pub use server::listen;
pub use settings::{ALPN, DEFAULT_IDLE_TIMEOUT, endpoint_config, transport_config, udp_socket};
pub use stream::QuicConnection;

/// The quinn this transport is built on, for code that needs the same
/// version (the raw-stream baseline of the benchmarks).
pub use quinn;
