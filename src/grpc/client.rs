//! [`CompatClient`]: a Rust client of the skytorch protocol
//! (`skytorch.torch.Service`), for existing Python tensor servers or a
//! tensorwire gRPC server.

use tensorwire_codecs::Tensor;
use tensorwire_proto::compat::service_client::ServiceClient;
use tensorwire_proto::compat::{TensorChunk, TensorRequest};
use tensorwire_transports::grpc::{self as tgrpc, GrpcChannel};
use tensorwire_transports::{ConnectError, Endpoint, Scheme};
use tonic::{Request, Streaming};

use super::chunks::{Assembler, decode_tensor, encode_chunks};
use super::status::from_tonic;
use crate::config::{ClientConfig, Limits};
use crate::error::CallError;

/// What a skytorch server answers to [`CompatClient::send_tensors`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompatResponse {
    /// The server's success flag.
    pub success: bool,
    /// Its message.
    pub message: String,
    /// Tensors it says it received.
    pub received_count: i32,
}

/// A client of the skytorch protocol (`skytorch.torch.Service`): talks to
/// existing Python tensor servers, or to a tensorwire gRPC server, over
/// `grpc://`, `grpcs://` or `grpc+unix://`. Tensors travel as `torch.save()`
/// bytes in chunks (1 MiB by default), as the Python client sends them.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tensorwire::{Tensor, grpc::CompatClient};
/// let mut c = CompatClient::connect("grpc://127.0.0.1:50051").await?;
/// let r = c.send_tensors(vec![Tensor::from_slice([2], &[1.0f32, 2.0])?]).await?;
/// let back = c.receive_tensors(2, [("shape", "50,50")]).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct CompatClient {
    client: ServiceClient<GrpcChannel>,
    chunk_size: usize,
    limits: Limits,
    auth: Option<String>,
}

impl CompatClient {
    /// Connects with default settings.
    pub async fn connect(url: &str) -> Result<Self, CallError> {
        Self::connect_with(url, &ClientConfig::default()).await
    }

    /// Connects with `config`'s transport settings (TLS, windows), limits,
    /// chunk size and auth token (sent as `authorization: Bearer …`).
    pub async fn connect_with(url: &str, config: &ClientConfig) -> Result<Self, CallError> {
        let ep = Endpoint::parse(url).map_err(ConnectError::from)?;
        if !matches!(ep.scheme(), Scheme::Grpc | Scheme::Grpcs | Scheme::GrpcUnix) {
            return Err(CallError::Unsupported(format!(
                "the skytorch protocol is gRPC: use grpc://, grpcs:// or grpc+unix://, not {}://",
                ep.scheme()
            )));
        }
        let chan = tokio::time::timeout(config.transport.connect_timeout, tgrpc::channel(&ep, &config.transport))
            .await
            .map_err(|_| ConnectError::Timeout {
                endpoint: ep.to_string(),
                after: config.transport.connect_timeout,
            })??;
        let limit = tgrpc::message_limit(&config.transport);
        let origin = chan.origin().clone();
        let client =
            ServiceClient::with_origin(chan, origin).max_decoding_message_size(limit).max_encoding_message_size(limit);
        Ok(Self {
            client,
            chunk_size: config.encoding.effective_chunk_size().min(config.transport.max_frame_payload as usize),
            limits: config.limits.clone(),
            auth: config.auth_token.clone(),
        })
    }

    fn request<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        if let Some(token) = &self.auth
            && let Ok(v) = format!("Bearer {token}").parse()
        {
            r.metadata_mut().insert("authorization", v);
        }
        r
    }

    fn chunks_of(&self, tensors: Vec<Tensor>) -> Result<Vec<TensorChunk>, CallError> {
        let mut out = Vec::new();
        for t in &tensors {
            out.extend(encode_chunks(t, self.chunk_size).map_err(CallError::Remote)?);
        }
        Ok(out)
    }

    async fn collect(&self, mut s: Streaming<TensorChunk>) -> Result<Vec<Tensor>, CallError> {
        let mut asm = Assembler::new(self.limits.max_tensor_bytes, None);
        let mut out = Vec::new();
        while let Some(c) = s.message().await.map_err(|e| CallError::Remote(from_tonic(&e)))? {
            if let Some(a) = asm.push(c).map_err(CallError::Remote)? {
                let name = a.metadata.get("name").cloned().unwrap_or(a.id);
                out.push(decode_tensor(a.bytes, &self.limits).map_err(CallError::Remote)?.with_name(name));
            }
        }
        asm.finish().map_err(CallError::Remote)?;
        Ok(out)
    }

    /// `ReceiveTensors`: streams the tensors to the server.
    pub async fn send_tensors(&mut self, tensors: Vec<Tensor>) -> Result<CompatResponse, CallError> {
        let chunks = self.chunks_of(tensors)?;
        let req = self.request(tokio_stream::iter(chunks));
        let r = self.client.receive_tensors(req).await.map_err(|e| CallError::Remote(from_tonic(&e)))?.into_inner();
        Ok(CompatResponse { success: r.success, message: r.message, received_count: r.received_count })
    }

    /// `SendTensors`: asks for `count` tensors with `parameters` (the seed
    /// server generates tensors of `shape`, e.g. `"50,50"`).
    pub async fn receive_tensors<K: Into<String>, V: Into<String>>(
        &mut self,
        count: i32,
        parameters: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Vec<Tensor>, CallError> {
        let parameters = parameters.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        let req = self.request(TensorRequest { count, parameters });
        let s = self.client.send_tensors(req).await.map_err(|e| CallError::Remote(from_tonic(&e)))?.into_inner();
        self.collect(s).await
    }

    /// `StreamTensors`: sends tensors and collects what the server's
    /// processing returns.
    pub async fn stream_tensors(&mut self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        let chunks = self.chunks_of(tensors)?;
        let req = self.request(tokio_stream::iter(chunks));
        let s = self.client.stream_tensors(req).await.map_err(|e| CallError::Remote(from_tonic(&e)))?.into_inner();
        self.collect(s).await
    }
}
