//! Picks the transport for a URL. The byte-stream and QUIC transports live
//! in `tensorwire-transports`; schemes whose servers also mount services of
//! this crate (gRPC's compat and health services) are wired up here.

use std::sync::Arc;

use tensorwire_transports::{ConnectError, Connection, Endpoint, ListenError, Listener, TransportConfig};

/// Connects to `endpoint` with the transport its scheme names.
pub(crate) async fn connect(
    endpoint: &Endpoint,
    config: &TransportConfig,
) -> Result<Arc<dyn Connection>, ConnectError> {
    tensorwire_transports::connect(endpoint, config).await
}

/// Listens on `endpoint` with the transport its scheme names.
pub(crate) async fn listen(endpoint: &Endpoint, config: &TransportConfig) -> Result<Box<dyn Listener>, ListenError> {
    tensorwire_transports::listen(endpoint, config).await
}
