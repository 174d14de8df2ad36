//! The plain tonic peer of `tensorwire bench`: a gRPC byte stream of 1 MiB
//! `bytes` messages (`tensorwire.bench.v1.BytesPeer`), served by the same
//! tuned HTTP/2 server as `grpc://` (16 MiB stream windows, 1 MiB frames)
//! and called through the same HTTP/2 client, with none of tensorwire's
//! framing: what a tonic user streaming a tensor would write. The receiver
//! copies every message into a warm, reused buffer, as tensorwire's receive
//! pool lets its reader do, so both sides do the same work per byte.

use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::Stream;
use tensorwire::{Endpoint, TransportConfig};
use tensorwire_proto::bench::bytes_peer_client::BytesPeerClient;
use tensorwire_proto::bench::bytes_peer_server::{BytesPeer, BytesPeerServer};
use tensorwire_proto::bench::{Ack, Blob, PullRequest};
use tonic::{Request, Response, Status, Streaming};

use super::{Background, warm_buffer};

/// Bytes per message, as the seed streams its chunks.
pub const MESSAGE_BYTES: usize = 1 << 20;

struct Peer {
    /// Where pushed messages are copied (warm, reused).
    sink: tokio::sync::Mutex<Vec<u8>>,
    /// What Pull streams slices of (warm).
    source: Bytes,
}

#[tonic::async_trait]
impl BytesPeer for Peer {
    async fn push(&self, req: Request<Streaming<Blob>>) -> Result<Response<Ack>, Status> {
        let mut s = req.into_inner();
        let mut sink = self.sink.lock().await;
        let mut n = 0usize;
        while let Some(b) = s.message().await? {
            let end = n + b.data.len();
            let dst =
                sink.get_mut(n..end).ok_or_else(|| Status::resource_exhausted("more bytes than the peer's buffer"))?;
            dst.copy_from_slice(&b.data);
            n = end;
        }
        Ok(Response::new(Ack { bytes: n as u64 }))
    }

    type PullStream = Pin<Box<dyn Stream<Item = Result<Blob, Status>> + Send>>;

    async fn pull(&self, req: Request<PullRequest>) -> Result<Response<Self::PullStream>, Status> {
        let r = req.into_inner();
        let total = usize::try_from(r.total_bytes).unwrap_or(usize::MAX).min(self.source.len());
        let step = (r.message_bytes as usize).clamp(1, MESSAGE_BYTES * 16);
        let src = self.source.slice(..total);
        let blobs = (0..total).step_by(step).map(move |o| Ok(Blob { data: src.slice(o..(o + step).min(total)) }));
        Ok(Response::new(Box::pin(futures_util::stream::iter(blobs))))
    }
}

/// A running peer server (its own thread and runtime) and a client of it.
pub struct TonicPeer {
    client: BytesPeerClient<tensorwire_transports::grpc::GrpcChannel>,
    /// The client's warm receive buffer and send source.
    buf: Vec<u8>,
    source: Bytes,
    _server: Background,
}

impl TonicPeer {
    /// Starts a peer for transfers of up to `max_bytes`; `rt` runs the client.
    pub fn start(
        rt: &tokio::runtime::Runtime,
        max_bytes: usize,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let config = TransportConfig::default();
        let cfg = config.clone();
        let (server, url) = Background::start("tonic-peer", 1, move |ready, stop| async move {
            let peer = Peer {
                sink: tokio::sync::Mutex::new(warm_buffer(max_bytes)),
                source: Bytes::from(warm_buffer(max_bytes)),
            };
            let routes = tonic::service::Routes::default().add_service(
                BytesPeerServer::new(peer).max_decoding_message_size(usize::MAX).max_encoding_message_size(usize::MAX),
            );
            let ep = Endpoint::parse("grpc://127.0.0.1:0").expect("a valid URL");
            match tensorwire_transports::grpc::listen_with(&ep, &cfg, routes).await {
                Ok(l) => {
                    let _ = ready.send(Ok(l.local_endpoint().to_string()));
                    let _ = stop.await;
                }
                Err(e) => drop(ready.send(Err(e.to_string()))),
            }
        })?;
        let ep = Endpoint::parse(&url)?;
        let chan = rt.block_on(tensorwire_transports::grpc::channel(&ep, &config))?;
        let client = BytesPeerClient::with_origin(chan.clone(), chan.origin().clone())
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        Ok(Self { client, buf: warm_buffer(max_bytes), source: Bytes::from(warm_buffer(max_bytes)), _server: server })
    }

    /// Mean time to push `bytes` to the peer (over `reps` pushes).
    pub async fn push_time(&mut self, bytes: usize, reps: usize) -> Result<Duration, Status> {
        let t0 = Instant::now();
        for _ in 0..reps {
            let src = self.source.slice(..bytes.min(self.source.len()));
            let n = src.len();
            let blobs =
                (0..n).step_by(MESSAGE_BYTES).map(move |o| Blob { data: src.slice(o..(o + MESSAGE_BYTES).min(n)) });
            let ack = self.client.push(futures_util::stream::iter(blobs)).await?.into_inner();
            if ack.bytes != n as u64 {
                return Err(Status::data_loss(format!("the peer received {} of {n} bytes", ack.bytes)));
            }
        }
        Ok(t0.elapsed() / reps.max(1) as u32)
    }

    /// Mean time to pull `bytes` from the peer (over `reps` pulls, each
    /// copied into a warm buffer).
    pub async fn pull_time(&mut self, bytes: usize, reps: usize) -> Result<Duration, Status> {
        let t0 = Instant::now();
        for _ in 0..reps {
            let req = PullRequest { total_bytes: bytes as u64, message_bytes: MESSAGE_BYTES as u32 };
            let mut s = self.client.pull(req).await?.into_inner();
            let mut n = 0usize;
            while let Some(b) = s.message().await? {
                let end = n + b.data.len();
                let dst = self.buf.get_mut(n..end).ok_or_else(|| Status::data_loss("more bytes than asked for"))?;
                dst.copy_from_slice(&b.data);
                n = end;
            }
            if n != bytes {
                return Err(Status::data_loss(format!("pulled {n} of {bytes} bytes")));
            }
        }
        Ok(t0.elapsed() / reps.max(1) as u32)
    }
}
