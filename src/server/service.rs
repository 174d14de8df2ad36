//! What a server does with calls: the [`TensorService`] trait for the three
//! streaming modes (send, fetch, exchange), and [`EchoService`].

use async_trait::async_trait;
use tensorwire_codecs::Tensor;

use crate::error::Status;
use crate::pipeline::tensors::{TensorSink, TensorStream};
use crate::rpc::call::{CallContext, FetchRequest, SendSummary};
use crate::rpc::listing::{Selector, StoreUsage, StoredTensor};

/// The streaming modes of the first seed. Every method has a default, so an
/// implementation overrides only what it serves; [`TensorService::process`]
/// is the override point of the default `exchange` (the seed's
/// `_process_tensor`).
#[async_trait]
pub trait TensorService: Send + Sync + 'static {
    /// Client → server stream. The default reads and counts everything.
    async fn send(&self, ctx: &CallContext, tensors: &mut TensorStream) -> Result<SendSummary, Status> {
        let _ = ctx;
        let mut s = SendSummary::default();
        while let Some(t) = tensors.next().await {
            let t = t.map_err(Status::from)?;
            s.received += 1;
            s.bytes += t.nbytes() as u64;
        }
        s.message = format!("received {} tensors", s.received);
        Ok(s)
    }

    /// Server → client stream. The default serves nothing.
    async fn fetch(&self, ctx: &CallContext, request: &FetchRequest, out: &mut TensorSink<'_>) -> Result<(), Status> {
        let _ = (ctx, request, out);
        Err(Status::unimplemented("this server does not serve fetch"))
    }

    /// Both directions: each input becomes zero or more outputs through
    /// [`TensorService::process`].
    async fn exchange(
        &self,
        ctx: &CallContext,
        input: &mut TensorStream,
        out: &mut TensorSink<'_>,
    ) -> Result<(), Status> {
        while let Some(t) = input.next().await {
            for o in self.process(ctx, t.map_err(Status::from)?).await? {
                out.send(o).await?;
            }
        }
        Ok(())
    }

    /// Maps one exchanged tensor to outputs. The default echoes it.
    async fn process(&self, ctx: &CallContext, tensor: Tensor) -> Result<Vec<Tensor>, Status> {
        let _ = ctx;
        Ok(vec![tensor])
    }

    /// Called when a reservation from the server's memory budget does not
    /// fit: free about `wanted` bytes if the service can (a store evicting
    /// by its policy) and return how many were freed. The default frees none.
    fn reclaim(&self, wanted: u64) -> u64 {
        let _ = wanted;
        0
    }

    /// What the service holds (`tensorwire ls`). The default stores nothing.
    async fn list(&self, ctx: &CallContext, which: &Selector) -> Result<Vec<StoredTensor>, Status> {
        let _ = (ctx, which);
        Err(Status::unimplemented("this server stores no tensors to list"))
    }

    /// Deletes what `which` selects and returns it (`tensorwire rm`).
    async fn remove(&self, ctx: &CallContext, which: &Selector) -> Result<Vec<StoredTensor>, Status> {
        let _ = (ctx, which);
        Err(Status::unimplemented("this server stores no tensors to remove"))
    }

    /// How much the service holds, for `info` and metrics (None: it stores nothing).
    fn usage(&self) -> Option<StoreUsage> {
        None
    }

    /// True when the service applies delta tensors it is sent and answers
    /// fetches with `delta_base` (`tensorwire_codecs::delta`); announced in
    /// the handshake as the feature `"delta"`, so a client never sends a
    /// delta to a service that would store it as if it were the tensor.
    fn supports_delta(&self) -> bool {
        false
    }
}

/// A service that counts what it is sent, serves no fetch, and echoes exchanges.
#[derive(Debug, Default, Clone, Copy)]
pub struct EchoService;

#[async_trait]
impl TensorService for EchoService {}
