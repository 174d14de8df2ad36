#![allow(dead_code)] // each bench uses part of it
//! Collects the time criterion measures for each benchmark so a group can
//! print `ours / baseline` ratios at its end (criterion itself reports each
//! function alone).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// Total time and iterations per benchmark id.
#[derive(Default)]
pub struct Ratios(Mutex<BTreeMap<String, (Duration, u64)>>);

impl Ratios {
    /// Records `iters` iterations that took `d` in all.
    pub fn record(&self, id: &str, iters: u64, d: Duration) -> Duration {
        let mut m = self.0.lock().unwrap();
        let e = m.entry(id.to_string()).or_default();
        e.0 += d;
        e.1 += iters;
        d
    }

    /// Mean time per iteration of `id`.
    pub fn mean(&self, id: &str) -> Option<f64> {
        let m = self.0.lock().unwrap();
        m.get(id).filter(|e| e.1 > 0).map(|e| e.0.as_secs_f64() / e.1 as f64)
    }

    /// Prints `what: ours/base` as a throughput ratio (base time / our time).
    pub fn print_speed(&self, what: &str, ours: &str, base: &str) {
        if let (Some(o), Some(b)) = (self.mean(ours), self.mean(base)) {
            println!("RATIO {what}: {:.2}x of {base} (throughput; >1 is faster)", b / o);
        }
    }

    /// Prints `what: ours/base` as a latency ratio (our time / base time).
    pub fn print_latency(&self, what: &str, ours: &str, base: &str) {
        if let (Some(o), Some(b)) = (self.mean(ours), self.mean(base)) {
            println!("RATIO {what}: {:.2}x the latency of {base} (<1 is faster)", o / b);
        }
    }
}
