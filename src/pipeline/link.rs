//! What a connection knows about its peer and its link, shared by every
//! call on it: the peer's announced limits and codecs (from the handshake)
//! and a throughput estimate that `auto` compression reads.

use std::sync::Mutex;

use tensorwire_codecs::{CodecKind, Compression};
use tensorwire_proto::v1;

use super::wire::{codec_to_wire, compression_to_wire};
use crate::config::{LINK_ESTIMATE_MIN_BYTES, LINK_ESTIMATE_WEIGHT};
use crate::error::CallError;
use crate::util::sync::lock;

/// Estimates a connection's throughput from large transfers, for auto compression.
#[derive(Debug, Default)]
pub(crate) struct LinkEstimator {
    bytes_per_sec: Mutex<Option<f64>>,
}

impl LinkEstimator {
    pub(crate) fn record(&self, bytes: u64, secs: f64) {
        if bytes < LINK_ESTIMATE_MIN_BYTES || secs <= 0.0 {
            return;
        }
        let rate = bytes as f64 / secs;
        let mut g = lock(&self.bytes_per_sec);
        *g = Some(match *g {
            Some(old) => (1.0 - LINK_ESTIMATE_WEIGHT) * old + LINK_ESTIMATE_WEIGHT * rate,
            None => rate,
        });
    }

    pub(crate) fn get(&self) -> Option<f64> {
        *lock(&self.bytes_per_sec)
    }
}

/// What the peer accepts, from the handshake (None: unknown, send what is
/// configured). Shared by every call of a connection.
pub(crate) type SharedCaps = std::sync::Arc<PeerCaps>;

/// See [`SharedCaps`].
#[derive(Debug, Clone, Default)]
pub(crate) struct PeerCaps {
    pub(crate) limits: Option<v1::Limits>,
    pub(crate) codecs: Option<Vec<i32>>,
    pub(crate) compressions: Option<Vec<i32>>,
}

/// Codec and compression ids kept from a peer's announcement, at most:
/// more than the protocol has, so nothing real is lost, while a hostile
/// Hello cannot make every call of its session scan a long list.
const MAX_ANNOUNCED: usize = 32;

impl PeerCaps {
    /// What a Hello or Welcome announces (lists cut to [`MAX_ANNOUNCED`]).
    pub(crate) fn announced(limits: Option<v1::Limits>, codecs: &[i32], compressions: &[i32]) -> Self {
        let keep = |l: &[i32]| l.iter().copied().take(MAX_ANNOUNCED).collect::<Vec<_>>();
        Self { limits, codecs: Some(keep(codecs)), compressions: Some(keep(compressions)) }
    }

    /// Fails when the peer announced codecs and `codec` is not among them.
    pub(crate) fn check_codec(&self, codec: CodecKind) -> Result<(), CallError> {
        if let Some(accepted) = &self.codecs
            && !accepted.is_empty()
            && !accepted.contains(&(codec_to_wire(codec) as i32))
        {
            return Err(CallError::Unsupported(format!("the peer does not accept the {codec} codec")));
        }
        Ok(())
    }

    /// Whether `c` may be sent: built here, and accepted by the peer when
    /// it announced a list.
    pub(crate) fn accepts(&self, c: Compression) -> bool {
        c.is_available()
            && match &self.compressions {
                Some(list) if !list.is_empty() => list.contains(&(compression_to_wire(c) as i32)),
                _ => true,
            }
    }

    /// Fails when a tensor of `total` bytes exceeds the peer's announced limit.
    pub(crate) fn check_tensor_bytes(&self, total: u64) -> Result<(), CallError> {
        match &self.limits {
            Some(l) if l.max_tensor_bytes > 0 && total > l.max_tensor_bytes => Err(CallError::Limit {
                what: "tensor (the peer's max_tensor_bytes)",
                size: total,
                limit: l.max_tensor_bytes,
            }),
            _ => Ok(()),
        }
    }
}
