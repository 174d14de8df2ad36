//! GPU tensors on the client (feature `cuda`): sends staged device→host
//! through pinned buffers chunk by chunk, fetches uploaded host→device.

use std::sync::Arc;

use tensorwire_codecs::TensorInfo;

use super::session::{Client, explain};
use crate::cuda::{DeviceTensor, Gpu, GpuError};
use crate::error::CallError;
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
    /// next is being copied.
    #[cfg(feature = "cuda")]
    pub async fn send_gpu(&self, gpu: &Arc<Gpu>, tensors: Vec<Arc<DeviceTensor>>) -> Result<SendSummary, CallError> {
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

    /// Fetches tensors into GPU memory: they arrive in host memory and are
    /// copied host→device through `gpu`'s pinned buffers (the host copy of
    /// each chunk overlapping the DMA of the previous one).
    #[cfg(feature = "cuda")]
    pub async fn fetch_to_gpu(&self, gpu: &Arc<Gpu>, request: FetchRequest) -> Result<Vec<DeviceTensor>, CallError> {
        let host = self.fetch(request).await?;
        note_ucx_staging(self.transport());
        let g = gpu.clone();
        tokio::task::spawn_blocking(move || host.iter().map(|t| g.upload(t)).collect::<Result<Vec<_>, _>>())
            .await
            .map_err(|e| CallError::InvalidArgument(format!("GPU copy task failed: {e}")))?
            .map_err(|e| CallError::InvalidArgument(e.to_string()))
    }
}
