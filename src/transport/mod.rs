//! The transport seam: how a client and a server reach each other.
//!
//! A transport turns an [`Endpoint`] into a [`Connection`] of many logical
//! streams that carry [`Frame`]s; everything above it (handshake, calls,
//! tensors) is the same on every transport. The built-in transports
//! ([`Builtin`]: `tcp://`, `unix://`, `shm://`, `quic://`, `grpc://`…) live in
//! the `tensorwire-transports` crate. A transport of your own implements
//! [`Transport`] and is handed to the client
//! ([`ClientConfig::transports`](crate::ClientConfig::transports)) and the
//! server ([`ServerBuilder::transport`](crate::ServerBuilder::transport));
//! it then serves the schemes it names in [`Transport::schemes`] in place of
//! the built-in one, for example a tunnel that reaches `tcp://` hosts
//! through a proxy, or an in-process pipe for tests. Byte-stream
//! transports need not write a multiplexer: [`mux::establish`] runs
//! tensorwire's over any `AsyncRead`/`AsyncWrite` pair.
//!
//! ```no_run
//! use std::sync::Arc;
//! use tensorwire::transport::{Transport, Transports};
//! # fn demo(mine: Arc<dyn Transport>) {
//! let config = tensorwire::ClientConfig { transports: Transports::default().with(mine), ..Default::default() };
//! # }
//! ```
//!
//! Imports nothing from the rest of the crate.

use std::fmt;
use std::sync::Arc;

pub use tensorwire_transports::config::{Congestion, GrpcConfig, QuicConfig, ShmConfig, TlsConfig};
pub use tensorwire_transports::mux;
pub use tensorwire_transports::{
    AcceptError, Builtin, ConnectError, Connection, ConnectionInfo, Endpoint, EndpointError, Frame, FrameHeader,
    Incoming, ListenError, Listener, Payload, Placement, Received, RecvStream, Scheme, SendStream, StreamError,
    StreamKind, Transport, TransportConfig,
};

/// The transports a client or server uses: those you add, each for the
/// schemes it names, then the built-in ones for every other scheme.
#[derive(Clone, Default)]
pub struct Transports {
    added: Vec<Arc<dyn Transport>>,
}

impl fmt::Debug for Transports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let schemes: Vec<&str> = self.added.iter().flat_map(|t| t.schemes().iter().map(|s| s.as_str())).collect();
        f.debug_struct("Transports").field("added", &schemes).finish()
    }
}

impl Transports {
    /// Adds `transport`: it serves the schemes it names, in place of the
    /// built-in transport (the last one added wins).
    pub fn with(mut self, transport: Arc<dyn Transport>) -> Self {
        self.added.insert(0, transport);
        self
    }

    /// The transport added for `scheme`, if any.
    pub fn added_for(&self, scheme: Scheme) -> Option<&Arc<dyn Transport>> {
        self.added.iter().find(|t| t.schemes().contains(&scheme))
    }

    /// Connects to `endpoint` (within `config.connect_timeout`).
    pub async fn connect(
        &self,
        endpoint: &Endpoint,
        config: &TransportConfig,
    ) -> Result<Arc<dyn Connection>, ConnectError> {
        match self.added_for(endpoint.scheme()) {
            Some(t) => match tokio::time::timeout(config.connect_timeout, t.connect(endpoint, config)).await {
                Ok(r) => r,
                Err(_) => Err(ConnectError::Timeout { endpoint: endpoint.to_string(), after: config.connect_timeout }),
            },
            None => tensorwire_transports::connect(endpoint, config).await,
        }
    }
}
