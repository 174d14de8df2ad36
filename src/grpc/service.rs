//! What a gRPC listener serves beside `tensorwire.v1.TensorService`:
//!
//! - **`grpc.health.v1.Health`** (Check and Watch): overall status `""`,
//!   `tensorwire.v1.TensorService` and `skytorch.torch.Service`, all
//!   SERVING until graceful shutdown begins, NOT_SERVING from then on, so
//!   `grpc-health-probe` and Kubernetes probes see a draining server.
//! - **Server reflection** (`grpc.reflection.v1` and `v1alpha`), so
//!   `grpcurl -plaintext host:port list` and `describe` work.
//! - **`skytorch.torch.Service`**, the protocol of the Python tensor server
//!   (`proto/skytorch/torch/service.proto`), served unchanged: existing
//!   grpcio clients send `torch.save()` bytes in chunks and get them back.
//!   Each compat call runs through the same dispatcher, handlers, limits
//!   and statistics as a native call (`ReceiveTensors` → the service's
//!   `send`, `SendTensors` → `fetch` with `count` and the request's
//!   parameters, `StreamTensors` → `exchange`).
//!
//! [`CompatClient`](super::CompatClient) is the other direction.

use std::sync::Arc;

use tensorwire_proto::compat::service_server::{Service as CompatApi, ServiceServer};
use tensorwire_proto::compat::{TensorChunk, TensorRequest, TensorResponse};
use tensorwire_proto::v1::{self, Method};
use tensorwire_transports::grpc::{self as tgrpc, Routes};
use tensorwire_transports::{Endpoint, ListenError, Listener, StreamKind};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Streaming};

use super::chunks::{Assembler, decode_tensor, encode_chunks};
use super::status::{call_status, to_tonic};
use crate::config::Limits;
use crate::pipeline::pool::RecvPool;
use crate::pipeline::tensors::TensorStream;
use crate::pipeline::writer::FrameWriter;
use crate::server::inproc;
use crate::server::state::ServerInner;

/// The gRPC service names reported by the health service.
pub const HEALTH_SERVICES: [&str; 3] = ["", "tensorwire.v1.TensorService", "skytorch.torch.Service"];

/// Listens on a gRPC endpoint with every service of this module mounted.
pub(crate) async fn listen(ep: &Endpoint, inner: &Arc<ServerInner>) -> Result<Box<dyn Listener>, ListenError> {
    let config_err = |reason: String| ListenError::Config { endpoint: ep.to_string(), reason };
    let (reporter, health) = tonic_health::server::health_reporter();
    for s in HEALTH_SERVICES {
        reporter.set_service_status(s, tonic_health::ServingStatus::Serving).await;
    }
    let shutdown = inner.shutdown.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        for s in HEALTH_SERVICES {
            reporter.set_service_status(s, tonic_health::ServingStatus::NotServing).await;
        }
    });
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tensorwire_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let v1 = reflection().build_v1().map_err(|e| config_err(format!("reflection: {e}")))?;
    let v1alpha = reflection().build_v1alpha().map_err(|e| config_err(format!("reflection: {e}")))?;
    let limit = tgrpc::message_limit(&inner.config.transport);
    let compat = ServiceServer::new(Compat { inner: inner.clone() })
        .max_decoding_message_size(limit)
        .max_encoding_message_size(limit);
    // The token is checked before a request message is read: an
    // unauthenticated `SendTensors` would otherwise have its request (up to
    // the message limit) decoded first.
    let auth = inner.clone();
    let compat = InterceptedService::new(compat, move |req: Request<()>| {
        Compat::authorize(&auth, &req)?;
        Ok(req)
    });
    let routes = Routes::new(health).add_service(v1).add_service(v1alpha).add_service(compat);
    // The server's connection cap applies to its gRPC listener too.
    let mut transport = inner.config.transport.clone();
    transport.max_connections.get_or_insert(inner.config.max_connections);
    transport.max_connections_per_peer.get_or_insert(inner.config.max_connections_per_peer);
    tgrpc::listen_with(ep, &transport, routes).await
}

// ---------------------------------------------------------------------------
// The compat service

struct Compat {
    inner: Arc<ServerInner>,
}

type ChunkStream = ReceiverStream<Result<TensorChunk, tonic::Status>>;

/// Both ends of one dispatched call.
struct Piped {
    writer: FrameWriter,
    output: TensorStream,
}

impl Compat {
    /// Checks the caller's token (metadata `authorization: Bearer …`),
    /// before its messages are read (see the interceptor in `listen`).
    fn authorize<T>(inner: &ServerInner, req: &Request<T>) -> Result<(), tonic::Status> {
        let given = req.metadata().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("");
        let given = given.strip_prefix("Bearer ").unwrap_or("");
        inner
            .auth
            .check(&Self::peer(req), given)
            .map_err(|s| tonic::Status::unauthenticated(format!("{} (metadata authorization: Bearer …)", s.message)))
    }

    /// Starts `request` as a native call from the (authorized) caller would.
    async fn begin<T>(&self, req: &Request<T>, kind: StreamKind, request: v1::Request) -> Result<Piped, tonic::Status> {
        self.start(kind, Self::peer(req), request).await
    }

    fn chunk_size(&self) -> usize {
        let c = &self.inner.config;
        c.encoding.effective_chunk_size().min(c.transport.max_frame_payload as usize)
    }

    /// Starts `kind` in the dispatcher, as a native call from `peer` would.
    async fn start(&self, kind: StreamKind, peer: String, request: v1::Request) -> Result<Piped, tonic::Status> {
        let c = inproc::start(&self.inner, "grpc", peer, kind, request).await.map_err(call_status)?;
        Ok(Piped { writer: c.writer, output: c.output })
    }

    fn peer<T>(req: &Request<T>) -> String {
        req.remote_addr().map_or_else(|| "skytorch client".to_string(), |a| a.to_string())
    }
}

/// Feeds compat chunks into a call as tensors; ends the call's input.
async fn feed(
    mut chunks: Streaming<TensorChunk>,
    writer: &mut FrameWriter,
    limits: &Limits,
    pool: &RecvPool,
) -> Result<u64, tonic::Status> {
    let mut asm = Assembler::new(limits.max_tensor_bytes, Some(pool.budget())).with_pool(pool.clone());
    let mut n = 0;
    while let Some(c) = chunks.message().await? {
        if let Some(a) = asm.push(c).map_err(|s| to_tonic(&s))? {
            // Named by the sender's metadata, else by its tensor_id (so a
            // store service keeps it under a name the sender knows).
            let name = a.metadata.get("name").cloned().unwrap_or(a.id);
            let t = decode_tensor(a.bytes, limits).map_err(|s| to_tonic(&s))?.with_name(name);
            writer.send_tensor(&t, false).await.map_err(call_status)?;
            n += 1;
        }
    }
    asm.finish().map_err(|s| to_tonic(&s))?;
    writer.finish().await.map_err(call_status)?;
    Ok(n)
}

/// Streams a call's output tensors as compat chunks. When the call failed
/// because its input could not be decoded, `why` carries the decoder's
/// reason, which the caller sees instead of the bare reset it caused.
fn drain(mut output: TensorStream, chunk: usize, mut why: Option<oneshot::Receiver<tonic::Status>>) -> ChunkStream {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        while let Some(t) = output.next().await {
            let t = t.map_err(|e| match why.as_mut().and_then(|w| w.try_recv().ok()) {
                Some(reason) => reason,
                None => call_status(e),
            });
            let chunks = t.and_then(|t| encode_chunks(&t, chunk).map_err(|s| to_tonic(&s)));
            match chunks {
                Ok(cs) => {
                    for c in cs {
                        if tx.send(Ok(c)).await.is_err() {
                            return;
                        }
                    }
                }
                Err(s) => {
                    let _ = tx.send(Err(s)).await;
                    return;
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

#[tonic::async_trait]
impl CompatApi for Compat {
    async fn receive_tensors(
        &self,
        req: Request<Streaming<TensorChunk>>,
    ) -> Result<Response<TensorResponse>, tonic::Status> {
        let request = v1::Request { method: Method::Send as i32, ..Default::default() };
        let Piped { mut writer, mut output } = self.begin(&req, StreamKind::Send, request).await?;
        let fed = feed(req.into_inner(), &mut writer, &self.inner.config.limits, &self.inner.pool).await;
        if fed.is_err() {
            // The handler must not take a cut-off stream for a complete one.
            writer.reset(1);
        }
        // The handler's verdict explains a failure better than the feed's.
        let mut outcome = Ok(());
        while let Some(t) = output.next().await {
            if let Err(e) = t {
                outcome = Err(call_status(e));
                break;
            }
        }
        match (fed, outcome) {
            // The handler failed (refused the call, say) and the feed then
            // found its stream stopped: the handler's reason is the answer.
            // (A handler cut off by a failed feed says CANCELLED: the
            // feed's reason is the answer then.)
            (Err(_), Err(o)) if o.code() != tonic::Code::Cancelled => return Err(o),
            (Err(e), _) | (Ok(_), Err(e)) => return Err(e),
            (Ok(_), Ok(())) => {}
        }
        let reply = output.reply().cloned().unwrap_or_default();
        Ok(Response::new(TensorResponse {
            success: true,
            message: reply.message,
            received_count: i32::try_from(reply.received_count).unwrap_or(i32::MAX),
        }))
    }

    type SendTensorsStream = ChunkStream;

    async fn send_tensors(&self, req: Request<TensorRequest>) -> Result<Response<ChunkStream>, tonic::Status> {
        let TensorRequest { count, parameters } = req.get_ref().clone();
        let mut params: std::collections::HashMap<String, String> = parameters;
        if count > 0 {
            params.insert("count".into(), count.to_string());
        }
        let request = v1::Request { method: Method::Fetch as i32, params, ..Default::default() };
        let Piped { mut writer, output } = self.begin(&req, StreamKind::Fetch, request).await?;
        writer.finish().await.map_err(call_status)?;
        Ok(Response::new(drain(output, self.chunk_size(), None)))
    }

    type StreamTensorsStream = ChunkStream;

    async fn stream_tensors(
        &self,
        req: Request<Streaming<TensorChunk>>,
    ) -> Result<Response<ChunkStream>, tonic::Status> {
        let request = v1::Request { method: Method::Exchange as i32, ..Default::default() };
        let Piped { mut writer, output } = self.begin(&req, StreamKind::Exchange, request).await?;
        let limits = self.inner.config.limits.clone();
        let pool = self.inner.pool.clone();
        let chunks = req.into_inner();
        let (why_tx, why_rx) = oneshot::channel();
        tokio::spawn(async move {
            if let Err(e) = feed(chunks, &mut writer, &limits, &pool).await {
                tracing::debug!(error = %e, "compat StreamTensors input failed");
                // The reason first, then the reset that ends the call.
                let _ = why_tx.send(e);
                writer.reset(1);
            }
        });
        Ok(Response::new(drain(output, self.chunk_size(), Some(why_rx))))
    }
}
