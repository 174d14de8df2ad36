//! Picks the transport for a URL. The byte-stream and QUIC transports live
//! in `tensorwire-transports`; schemes whose servers also mount services of
//! this crate (gRPC's compat and health services) are wired up here.

use std::sync::Arc;

#[cfg(feature = "grpc")]
use tensorwire_transports::Scheme;
use tensorwire_transports::{ConnectError, Connection, Endpoint, ListenError, Listener, TransportConfig};

/// Connects to `endpoint` with the transport its scheme names.
pub(crate) async fn connect(
    endpoint: &Endpoint,
    config: &TransportConfig,
) -> Result<Arc<dyn Connection>, ConnectError> {
    tensorwire_transports::connect(endpoint, config).await
}

/// Listens on `endpoint` with the transport its scheme names; gRPC
/// listeners also serve health, reflection and the skytorch compat service.
pub(crate) async fn listen(
    endpoint: &Endpoint,
    inner: &Arc<crate::server::ServerInner>,
) -> Result<Box<dyn Listener>, ListenError> {
    #[cfg(feature = "grpc")]
    if matches!(endpoint.scheme(), Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix) {
        return crate::grpc::listen(endpoint, inner).await;
    }
    tensorwire_transports::listen(endpoint, &inner.config.transport).await
}
