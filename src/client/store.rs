//! The store calls of [`Client`]: whole state dicts (`put_state_dict`,
//! `get_state_dict`, streamed with [`StateDictStream`]) and what a server
//! holds (`list`, `stat`, `remove`).

use tensorwire_codecs::{CodecKind, Tensor};
use tensorwire_proto::v1::{Method, frame_header::Kind};
use tensorwire_transports::StreamKind;

use super::session::{CallOptions, Client, send_summary};
use crate::error::CallError;
use crate::pipeline::storages::{self, Share};
use crate::pipeline::tensors::TensorStream;
use crate::rpc::call::{FetchRequest, SendSummary};
use crate::rpc::listing::{Selector, StoredTensor};

/// One tensor of a state dict as it arrives ([`Client::state_dict_stream`]).
#[derive(Debug, Clone)]
pub struct StateDictEntry {
    /// Its key in the state dict (`"layer.0.weight"`).
    pub key: String,
    /// The tensor, with the strides and storage offset it was stored with.
    pub tensor: Tensor,
    /// Entries of one state dict with the same storage id view one storage
    /// (tied weights, a transposed view, a slice): the first brought it, the
    /// later ones share its memory. None for tensors that own their storage.
    pub storage: Option<u64>,
}

/// The tensors of a state dict, arriving one by one with backpressure: the
/// server sends the next only as this side reads.
pub struct StateDictStream {
    stream: TensorStream,
    prefix: String,
}

impl StateDictStream {
    /// The next tensor, or None after the last.
    pub async fn next(&mut self) -> Option<Result<StateDictEntry, CallError>> {
        let t = match self.stream.next().await? {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        Some(Ok(StateDictEntry { key: key_of(&t, &self.prefix), tensor: t, storage: self.stream.storage_of_last() }))
    }

    /// Tensors and payload bytes received so far.
    pub fn received(&self) -> (u64, u64) {
        self.stream.received()
    }
}

fn key_of(t: &Tensor, prefix: &str) -> String {
    t.name().map(|n| n.strip_prefix(prefix).unwrap_or(n).to_string()).unwrap_or_default()
}

impl Client {
    /// Stores `items` on the server as the state dict `name`, in this order
    /// (the store keeps each as `name.<key>`, and replaces any state dict
    /// `name` as a whole once all have arrived). Tensors stream one by one
    /// with the usual backpressure; tensors that view one storage (tied
    /// weights, a transposed view, a strided slice) send it once and arrive
    /// sharing it, with their strides, as `torch.save` writes them.
    pub async fn put_state_dict(&self, name: &str, items: &[(String, Tensor)]) -> Result<SendSummary, CallError> {
        if name.is_empty() {
            return Err(CallError::InvalidArgument("a state dict needs a name".into()));
        }
        let opts = &CallOptions::default();
        let shares = if self.encoding(opts).codec == CodecKind::Raw {
            storages::plan(items.iter().map(|(_, t)| t))
        } else {
            vec![Share::Plain; items.len()]
        };
        let shares = &shares;
        self.run(opts, move |s, sent, started| {
            Box::pin(async move {
                let (mut w, mut r) = self.open(&s, StreamKind::Send, opts).await?;
                let mut req = self.request(Method::Send, opts, started);
                req.params.insert("state_dict".into(), name.to_string());
                w.control(Kind::Request(Box::new(req)));
                sent.set();
                let mut sent_ok = Ok(());
                for ((key, t), share) in items.iter().zip(shares) {
                    let t = t.clone().with_name(key.clone());
                    if let Err(e) = w.send_shared(&t, *share, true).await {
                        sent_ok = Err(e);
                        break;
                    }
                }
                if sent_ok.is_ok() {
                    sent_ok = w.finish().await;
                }
                Ok((send_summary(self, &mut w, &mut r, sent_ok).await?, None))
            })
        })
        .await
    }

    /// The state dict `name`: its keys and tensors in the order they were
    /// put (retried on failure: fetching twice is harmless). Tensors that
    /// viewed one storage share its memory again.
    pub async fn get_state_dict(&self, name: &str) -> Result<Vec<(String, Tensor)>, CallError> {
        let prefix = format!("{name}.");
        let tensors = self.fetch(FetchRequest::default().param("state_dict", name)).await?;
        Ok(tensors.into_iter().map(|t| (key_of(&t, &prefix), t)).collect())
    }

    /// The state dict `name` as a stream, tensor by tensor: for writing a
    /// checkpoint to a file while it arrives (`tensorwire fetch`), without
    /// holding it all in memory.
    pub async fn state_dict_stream(&self, name: &str) -> Result<StateDictStream, CallError> {
        let stream = self.fetch_stream(FetchRequest::default().param("state_dict", name)).await?;
        Ok(StateDictStream { stream, prefix: format!("{name}.") })
    }

    async fn store_call(&self, method: Method, which: &Selector) -> Result<Vec<StoredTensor>, CallError> {
        let (k, v) = which.to_params();
        let idempotent = method == Method::List;
        let (_, reply) = self
            .control(
                method,
                |r| {
                    r.params.insert(k.to_string(), v.clone());
                },
                idempotent,
            )
            .await?;
        let listing = reply.listing.unwrap_or_default();
        listing
            .tensors
            .iter()
            .map(StoredTensor::from_wire)
            .collect::<Result<_, _>>()
            .map_err(|reason| CallError::Protocol { peer: self.inner.endpoint.to_string(), reason })
    }

    /// What the server's store holds under names starting with `prefix`
    /// (`""`: everything), sorted by name.
    pub async fn list(&self, prefix: &str) -> Result<Vec<StoredTensor>, CallError> {
        self.store_call(Method::List, &Selector::Prefix(prefix.to_string())).await
    }

    /// What `fetch` of `name` returns: the tensor `name`, or else the
    /// tensors of the state dict `name` in order (NOT_FOUND: neither).
    pub async fn stat(&self, name: &str) -> Result<Vec<StoredTensor>, CallError> {
        self.store_call(Method::List, &Selector::Name(name.to_string())).await
    }

    /// Deletes the tensor `name`, or else the whole state dict `name`
    /// (NOT_FOUND: neither); returns what was removed.
    pub async fn remove(&self, name: &str) -> Result<Vec<StoredTensor>, CallError> {
        self.store_call(Method::Remove, &Selector::Name(name.to_string())).await
    }

    /// Deletes every stored tensor whose name starts with `prefix` (none
    /// matching is not an error); returns what was removed.
    pub async fn remove_prefix(&self, prefix: &str) -> Result<Vec<StoredTensor>, CallError> {
        self.store_call(Method::Remove, &Selector::Prefix(prefix.to_string())).await
    }
}
