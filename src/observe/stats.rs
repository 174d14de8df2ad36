//! Call statistics (the split-learning seed's `get_statistics`), and a small
//! log-bucketed latency histogram for p50/p99 without storing samples.

use crate::util::sync::lock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Latency histogram: 8 buckets per power of two from 1 µs to ~1 hour,
/// so percentiles are within ~9% of the true value and memory is fixed.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    sum_us: u64,
}

const SUB: usize = 8;
const OCTAVES: usize = 32;

impl Default for Histogram {
    fn default() -> Self {
        Self { counts: vec![0; SUB * OCTAVES], total: 0, sum_us: 0 }
    }
}

impl Histogram {
    fn bucket(us: u64) -> usize {
        let us = us.max(1);
        let octave = 63 - us.leading_zeros() as usize;
        let frac = if octave >= 3 { ((us >> (octave - 3)) & 7) as usize } else { ((us << (3 - octave)) & 7) as usize };
        (octave * SUB + frac).min(SUB * OCTAVES - 1)
    }

    fn bucket_value(b: usize) -> f64 {
        let octave = b / SUB;
        let frac = b % SUB;
        // Midpoint of the bucket.
        (1u64 << octave) as f64 * (1.0 + (frac as f64 + 0.5) / SUB as f64)
    }

    /// Adds one sample.
    pub fn record(&mut self, d: Duration) {
        let us = d.as_micros().min(u64::MAX as u128) as u64;
        self.counts[Self::bucket(us)] += 1;
        self.total += 1;
        self.sum_us = self.sum_us.saturating_add(us);
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The `q` quantile (0..=1) in milliseconds, or 0 with no samples.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::bucket_value(b) / 1000.0;
            }
        }
        0.0
    }

    /// Mean in milliseconds.
    pub fn mean_ms(&self) -> f64 {
        if self.total == 0 { 0.0 } else { self.sum_us as f64 / self.total as f64 / 1000.0 }
    }
}

/// A snapshot of a client's statistics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Statistics {
    /// Calls made (each retry counts once more in `retries`, not here).
    pub requests: u64,
    /// Calls that succeeded.
    pub successes: u64,
    /// Calls that failed after all retries.
    pub failures: u64,
    /// Retries made.
    pub retries: u64,
    /// Connections made after the first (the server restarted, the
    /// connection dropped or idled out, or [`crate::Client::disconnect`]).
    pub reconnects: u64,
    /// Tensor payload bytes sent.
    pub bytes_sent: u64,
    /// Tensor payload bytes received.
    pub bytes_received: u64,
    /// Median call latency, ms.
    pub latency_p50_ms: f64,
    /// 99th percentile call latency, ms.
    pub latency_p99_ms: f64,
    /// Mean call latency, ms.
    pub latency_mean_ms: f64,
    /// Mean time the server spent in handlers, ms (calls that report it).
    pub avg_server_time_ms: f64,
    /// Mean latency minus server time: transfer, encoding, queueing, ms.
    pub avg_network_time_ms: f64,
}

/// Live client counters.
#[derive(Debug, Default)]
pub(crate) struct ClientStats {
    pub(crate) requests: AtomicU64,
    pub(crate) successes: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) connects: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    timing: Mutex<Timing>,
}

#[derive(Debug, Default)]
struct Timing {
    latency: Histogram,
    server_us: u64,
    server_calls: u64,
    latency_us_with_server: u64,
}

impl ClientStats {
    pub(crate) fn record(&self, ok: bool, took: Duration, server_time: Option<Duration>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if ok { &self.successes } else { &self.failures }.fetch_add(1, Ordering::Relaxed);
        let mut t = lock(&self.timing);
        t.latency.record(took);
        if let Some(s) = server_time {
            t.server_us += s.as_micros() as u64;
            t.server_calls += 1;
            t.latency_us_with_server += took.as_micros() as u64;
        }
    }

    pub(crate) fn snapshot(&self) -> Statistics {
        let t = lock(&self.timing);
        let (server, network) = if t.server_calls > 0 {
            let s = t.server_us as f64 / t.server_calls as f64 / 1000.0;
            let l = t.latency_us_with_server as f64 / t.server_calls as f64 / 1000.0;
            (s, (l - s).max(0.0))
        } else {
            (0.0, t.latency.mean_ms())
        };
        Statistics {
            requests: self.requests.load(Ordering::Relaxed),
            successes: self.successes.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            reconnects: self.connects.load(Ordering::Relaxed).saturating_sub(1),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            latency_p50_ms: t.latency.quantile_ms(0.5),
            latency_p99_ms: t.latency.quantile_ms(0.99),
            latency_mean_ms: t.latency.mean_ms(),
            avg_server_time_ms: server,
            avg_network_time_ms: network,
        }
    }
}

/// Live server counters.
#[derive(Debug, Default)]
pub(crate) struct ServerStats {
    pub(crate) calls: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) active: AtomicU64,
}

/// Per-function counters.
#[derive(Debug, Clone, Default)]
pub(crate) struct FunctionStats(Arc<FunctionCounters>);

#[derive(Debug, Default)]
pub(crate) struct FunctionCounters {
    pub(crate) calls: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) examples: AtomicU64,
    pub(crate) total_us: AtomicU64,
}

impl FunctionStats {
    /// Records one run covering `examples` calls.
    pub(crate) fn record(&self, took: std::time::Duration, ok: bool, examples: u64) {
        let c = &self.0;
        c.calls.fetch_add(examples, Ordering::Relaxed);
        if !ok {
            c.failures.fetch_add(examples, Ordering::Relaxed);
        }
        c.batches.fetch_add(1, Ordering::Relaxed);
        c.examples.fetch_add(examples, Ordering::Relaxed);
        c.total_us.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    pub(crate) fn counters(&self) -> &FunctionCounters {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_close() {
        let mut h = Histogram::default();
        for us in 1..=10_000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile_ms(0.5);
        let p99 = h.quantile_ms(0.99);
        assert!((p50 - 5.0).abs() / 5.0 < 0.1, "p50 {p50}");
        assert!((p99 - 9.9).abs() / 9.9 < 0.1, "p99 {p99}");
        assert_eq!(Histogram::default().quantile_ms(0.5), 0.0);
    }
}
