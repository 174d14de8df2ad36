//! What a connection knows about its peer and its link, shared by every
//! call on it: the peer's announced limits and codecs (from the handshake)
//! and a throughput estimate that `auto` compression reads.

use std::sync::Mutex;

use tensorwire_proto::v1;

use crate::config::{LINK_ESTIMATE_MIN_BYTES, LINK_ESTIMATE_WEIGHT};
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
