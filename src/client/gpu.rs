//! GPU tensors on the client (feature `cuda`): sends staged device→host
//! through pinned buffers chunk by chunk, fetches uploaded host→device
//! chunk by chunk as they arrive.

use std::sync::Arc;

use tensorwire_codecs::TensorInfo;
use tensorwire_proto::v1::frame_header::Kind;

use super::session::{CallOptions, Client, explain};
use crate::cuda::{DeviceTensor, Gpu, GpuError};
use crate::error::{CallError, Status};
use crate::pipeline::gpu::next_to_gpu;
use crate::pipeline::reader::{IntoItem, Item};
use crate::rpc::call::{FetchRequest, SendSummary};

/// Logs once per process how GPU tensors travel over `ucx://`: staged
/// through pinned host memory, whether or not this process's UCX could
/// move device memory itself.
#[cfg(feature = "cuda")]
fn note_ucx_staging(transport: Option<&str>) {
    #[cfg(feature = "ucx")]
    if transport == Some("ucx") {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| match tensorwire_transports::ucx::ucx_memory_types() {
            Ok(types) if types.contains(&"cuda") => tracing::info!(
                memory_types = ?types,
                "ucx://: this UCX is CUDA-aware, but tensorwire still stages GPU tensors through pinned host memory (device registration is not implemented)"
            ),
            Ok(types) => tracing::info!(
                memory_types = ?types,
                "ucx://: this UCX was built without CUDA support; GPU tensors are staged through pinned host memory"
            ),
            Err(e) => tracing::info!(error = %e, "ucx://: GPU tensors are staged through pinned host memory"),
        });
    }
    #[cfg(not(feature = "ucx"))]
    let _ = transport;
}

impl Client {
    /// Sends tensors that live in GPU memory to the server's `send` handler.
    /// Each is copied device→host through `gpu`'s pinned buffers chunk by
    /// chunk (double-buffered), and each chunk goes on the wire while the
    /// next is being copied. The client's timeout bounds the whole call.
    #[cfg(feature = "cuda")]
    pub async fn send_gpu(&self, gpu: &Arc<Gpu>, tensors: Vec<Arc<DeviceTensor>>) -> Result<SendSummary, CallError> {
        let opts = crate::client::session::CallOptions::default();
        self.within_timeout(&opts, std::time::Instant::now(), self.send_gpu_now(gpu, tensors)).await
    }

    /// [`Client::send_gpu`] without its timeout.
    #[cfg(feature = "cuda")]
    async fn send_gpu_now(&self, gpu: &Arc<Gpu>, tensors: Vec<Arc<DeviceTensor>>) -> Result<SendSummary, CallError> {
        let (mut w, mut r, started) = self.begin_send().await?;
        note_ucx_staging(self.transport());
        for d in tensors {
            let (tx, mut rx) = tokio::sync::mpsc::channel(2);
            let (g, dd) = (gpu.clone(), d.clone());
            let producer = tokio::task::spawn_blocking(move || {
                let r = g.download_chunks(&dd, |c| {
                    tx.blocking_send(Ok(c)).map_err(|_| GpuError::Invalid("the send was abandoned".into()))
                });
                if let Err(e) = &r {
                    let _ = tx.blocking_send(Err(CallError::InvalidArgument(e.to_string())));
                }
                r
            });
            let info = TensorInfo {
                dtype: Some(d.dtype()),
                shape: d.shape().to_vec(),
                strides: None,
                storage_offset: 0,
                device: d.device(),
                name: d.name().map(str::to_string),
                metadata: Default::default(),
            };
            let sent = w.send_streamed(info, d.nbytes() as u64, &mut rx).await;
            drop(rx);
            let produced = producer.await;
            if let Err(e) = sent {
                return Err(explain(e, &mut r).await);
            }
            match produced {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(CallError::InvalidArgument(e.to_string())),
                Err(e) => return Err(CallError::InvalidArgument(format!("GPU copy task failed: {e}"))),
            }
        }
        self.finish_send(w, r, started).await
    }

    /// Fetches tensors into GPU memory. A tensor that arrives as plain
    /// bytes (raw codec, contiguous; compressed or not) goes to the device
    /// chunk by chunk as it arrives, staged through `gpu`'s pinned buffers
    /// on a blocking thread, so the copy overlaps the network; any other is
    /// fetched whole, then uploaded. Retried on failure like
    /// [`Client::fetch`].
    #[cfg(feature = "cuda")]
    pub async fn fetch_to_gpu(&self, gpu: &Arc<Gpu>, request: FetchRequest) -> Result<Vec<DeviceTensor>, CallError> {
        note_ucx_staging(self.transport());
        let opts = &CallOptions { idempotent: true, ..CallOptions::default() };
        let request = &request;
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (w, mut r) = self.begin_fetch(&s, opts, request, started).await?;
                sent.set();
                let mut out = Vec::new();
                loop {
                    match next_to_gpu(&mut r, gpu).await? {
                        IntoItem::Tensor(d) => out.push(d),
                        IntoItem::Control(h) => match h.kind {
                            Some(Kind::Reply(_)) => match r.next().await? {
                                Item::End => break,
                                _ => return Err(r.protocol("frames after the reply")),
                            },
                            Some(Kind::Error(e)) => return Err(CallError::Remote(Status::from_wire(&e))),
                            _ => return Err(r.protocol(format!("unexpected {} frame in a reply", h.kind_name()))),
                        },
                        IntoItem::End => return Err(r.protocol("the server ended the call without a reply")),
                    }
                }
                self.count(&w, &r);
                Ok((out, None))
            })
        })
        .await
    }
}
