//! [`BlockingClient`]: the client for programs without an async runtime.

use std::time::Duration;

use tensorwire_codecs::Tensor;
use tensorwire_transports::ConnectError;

use super::session::Client;
use crate::config::ClientConfig;
use crate::error::CallError;
use crate::observe::stats::Statistics;
use crate::rpc::call::{FetchRequest, Output, SendSummary};
use crate::rpc::listing::StoredTensor;
use crate::rpc::value::Args;

/// A client for programs without an async runtime. Owns a small runtime;
/// closes its connection and stops the runtime when dropped.
pub struct BlockingClient {
    client: Option<Client>,
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for BlockingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockingClient").field("client", &self.client).finish()
    }
}

impl BlockingClient {
    /// Connects to `url` with default settings.
    pub fn connect(url: &str) -> Result<Self, ConnectError> {
        Self::connect_with(url, ClientConfig::default())
    }

    /// Connects to `url`.
    pub fn connect_with(url: &str, config: ClientConfig) -> Result<Self, ConnectError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tensorwire-client")
            .enable_all()
            .build()
            .map_err(|source| ConnectError::Io { endpoint: url.to_string(), source })?;
        let client = rt.block_on(Client::connect_with(url, config))?;
        Ok(Self { client: Some(client), rt: Some(rt) })
    }

    /// Runs any async client method to completion.
    pub fn run<T>(&self, f: impl AsyncFnOnce(&Client) -> T) -> T {
        let (rt, c) = (self.rt.as_ref().expect("live"), self.client.as_ref().expect("live"));
        rt.block_on(f(c))
    }

    /// See [`Client::send`].
    pub fn send(&self, tensors: Vec<Tensor>) -> Result<SendSummary, CallError> {
        self.run(async |c| c.send(tensors).await)
    }

    /// See [`Client::fetch`].
    pub fn fetch(&self, request: FetchRequest) -> Result<Vec<Tensor>, CallError> {
        self.run(async |c| c.fetch(request).await)
    }

    /// See [`Client::fetch_into`]: the tensor `name` straight into `dst`.
    pub fn fetch_into<T: tensorwire_codecs::Element>(
        &self,
        name: &str,
        dst: &mut [T],
    ) -> Result<Vec<usize>, CallError> {
        self.run(async |c| c.fetch_into(name, dst).await)
    }

    /// See [`Client::exchange_all`].
    pub fn exchange(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        self.run(async |c| c.exchange_all(inputs).await)
    }

    /// See [`Client::compute`].
    pub fn compute(&self, function: &str, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, CallError> {
        self.run(async |c| c.compute(function, inputs).await)
    }

    /// See [`Client::call`].
    pub fn call(&self, function: &str, inputs: Vec<Tensor>, args: Args) -> Result<Output, CallError> {
        self.run(async |c| c.call(function, inputs, args).await)
    }

    /// See [`Client::put_state_dict`].
    pub fn put_state_dict(&self, name: &str, items: &[(String, Tensor)]) -> Result<SendSummary, CallError> {
        self.run(async |c| c.put_state_dict(name, items).await)
    }

    /// See [`Client::get_state_dict`].
    pub fn get_state_dict(&self, name: &str) -> Result<Vec<(String, Tensor)>, CallError> {
        self.run(async |c| c.get_state_dict(name).await)
    }

    /// See [`Client::list`].
    pub fn list(&self, prefix: &str) -> Result<Vec<StoredTensor>, CallError> {
        self.run(async |c| c.list(prefix).await)
    }

    /// See [`Client::remove`].
    pub fn remove(&self, name: &str) -> Result<Vec<StoredTensor>, CallError> {
        self.run(async |c| c.remove(name).await)
    }

    /// See [`Client::statistics`].
    pub fn statistics(&self) -> Statistics {
        self.client.as_ref().expect("live").statistics()
    }
}

impl Drop for BlockingClient {
    fn drop(&mut self) {
        if let (Some(c), Some(rt)) = (self.client.take(), self.rt.as_ref()) {
            // Drop inside the runtime so the close reaches the connection's tasks.
            rt.block_on(async move {
                c.disconnect();
                drop(c);
                tokio::task::yield_now().await;
            });
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}
