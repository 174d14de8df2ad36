//! Delta calls of [`Client`]: `send_delta` sends a new version of a named
//! tensor as its XOR against the base the server stores under that name;
//! `fetch_delta` fetches one as the difference from a base this side
//! holds. Both check the base by content hash at both ends and the result
//! by CRC-32C (`tensorwire_codecs::delta`): bit-exact or an error naming
//! the base hash.

use tensorwire_codecs::Tensor;
use tensorwire_codecs::delta::{self, ContentHash, DeltaHeader};

use super::session::{CallOptions, Client};
use crate::error::CallError;
use crate::pipeline::wire::FEATURE_DELTA;
use crate::rpc::call::{FetchRequest, SendSummary};

impl Client {
    /// True when the server's service applies deltas (handshake feature `"delta"`).
    pub async fn supports_delta(&self) -> Result<bool, CallError> {
        Ok(self.session().await?.welcome.features.iter().any(|f| f == FEATURE_DELTA))
    }

    async fn require_delta(&self) -> Result<(), CallError> {
        if self.supports_delta().await? {
            return Ok(());
        }
        Err(CallError::Unsupported(format!(
            "the server at {} does not apply deltas (no \"delta\" feature in its handshake); send the tensor whole",
            self.inner.endpoint
        )))
    }

    /// Sends `new` (named: the server replaces the tensor of that name) as
    /// its XOR against `base`, the version the server stores under that
    /// name. The server checks that its stored tensor has `base`'s content
    /// hash (else FAILED_PRECONDITION naming the hash) and the result's
    /// CRC-32C. Compression follows the client's encoding (`auto`, `zstd`
    /// with shuffle or `planes` shrink the mostly-zero XOR).
    pub async fn send_delta(&self, new: &Tensor, base: &Tensor) -> Result<SendSummary, CallError> {
        self.send_delta_with(new, base, &CallOptions::default()).await
    }

    /// [`Client::send_delta`] with options.
    pub async fn send_delta_with(
        &self,
        new: &Tensor,
        base: &Tensor,
        opts: &CallOptions,
    ) -> Result<SendSummary, CallError> {
        if new.name().is_none_or(str::is_empty) {
            return Err(CallError::InvalidArgument(
                "a delta needs the tensor's name (its base is stored under it)".into(),
            ));
        }
        self.require_delta().await?;
        let d = delta::encode(new, base).map_err(|e| CallError::InvalidArgument(e.to_string()))?;
        self.send_with([d], opts).await
    }

    /// Fetches the tensor `name` as the difference from `base`, a version
    /// of it this side holds (the current one, or the one the current one
    /// replaced on the server), and returns the current version, checked
    /// by CRC-32C. A base the server no longer has fails with
    /// FAILED_PRECONDITION naming its hash: fetch whole then.
    pub async fn fetch_delta(&self, name: &str, base: &Tensor) -> Result<Tensor, CallError> {
        self.require_delta().await?;
        let hash = ContentHash::of(base).map_err(|e| CallError::InvalidArgument(e.to_string()))?;
        let mut v = self.fetch(FetchRequest::name(name).param("delta_base", hash.to_string())).await?;
        let protocol = |reason: String| CallError::Protocol { peer: self.inner.endpoint.to_string(), reason };
        let d = match (v.pop(), v.is_empty()) {
            (Some(d), true) => d,
            _ => return Err(protocol(format!("asked for one delta of {name:?}, got {}", v.len() + 1))),
        };
        match DeltaHeader::of(&d) {
            Ok(Some(h)) if h.base == hash => {}
            Ok(Some(h)) => {
                return Err(protocol(format!("asked for a delta against {hash}, got one against {}", h.base)));
            }
            Ok(None) => {
                return Err(protocol(format!("asked for a delta of {name:?}, got a tensor without a delta header")));
            }
            Err(e) => return Err(protocol(e.to_string())),
        }
        delta::apply(&d, base).map_err(|e| protocol(e.to_string()))
    }
}
