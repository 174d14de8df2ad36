//! Retry policies for connection failures and idempotent calls.
//!
//! A call is retried only when it is safe: when the request never reached
//! the server (connecting failed, or the server refused it unprocessed), or
//! when the caller marked it idempotent. A non-idempotent call whose request
//! may have reached the server is never retried, so nothing runs twice
//! without the caller asking for it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::CallError;

/// Decides whether and when to try again.
pub trait RetryStrategy: Send + Sync + fmt::Debug {
    /// The delay before attempt number `attempt + 1` (attempt 1 is the first
    /// retry), or None to give up.
    fn delay(&self, attempt: u32, error: &CallError) -> Option<Duration>;
}

/// How failed calls are retried.
#[derive(Clone, Debug)]
pub enum RetryPolicy {
    /// Never retry.
    None,
    /// A fixed delay between attempts.
    Fixed {
        /// Delay between attempts.
        delay: Duration,
        /// Retries after the first attempt.
        max_retries: u32,
    },
    /// Exponential backoff with jitter (the default).
    Exponential {
        /// First delay (default 50 ms).
        initial: Duration,
        /// Largest delay (default 2 s).
        max_delay: Duration,
        /// Growth per attempt (default 2.0).
        multiplier: f64,
        /// Random spread as a fraction of the delay, 0..=1 (default 0.2).
        jitter: f64,
        /// Retries after the first attempt (default 3).
        max_retries: u32,
    },
    /// Your own strategy.
    Custom(Arc<dyn RetryStrategy>),
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::Exponential {
            initial: Duration::from_millis(50),
            max_delay: Duration::from_secs(2),
            multiplier: 2.0,
            jitter: 0.2,
            max_retries: 3,
        }
    }
}

impl RetryPolicy {
    /// The delay before retry number `attempt` (1-based), or None to stop.
    pub fn delay(&self, attempt: u32, error: &CallError) -> Option<Duration> {
        match self {
            RetryPolicy::None => None,
            RetryPolicy::Fixed { delay, max_retries } => (attempt <= *max_retries).then_some(*delay),
            RetryPolicy::Exponential { initial, max_delay, multiplier, jitter, max_retries } => {
                if attempt > *max_retries {
                    return None;
                }
                let base = initial.as_secs_f64() * multiplier.max(1.0).powi(attempt.saturating_sub(1) as i32);
                let base = base.min(max_delay.as_secs_f64());
                let j = jitter.clamp(0.0, 1.0);
                let spread = if j > 0.0 { 1.0 + j * (2.0 * rand::random::<f64>() - 1.0) } else { 1.0 };
                Some(Duration::from_secs_f64((base * spread).max(0.0)))
            }
            RetryPolicy::Custom(s) => s.delay(attempt, error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_grows_and_stops() {
        let p = RetryPolicy::Exponential {
            initial: Duration::from_millis(100),
            max_delay: Duration::from_millis(350),
            multiplier: 2.0,
            jitter: 0.0,
            max_retries: 4,
        };
        let e = CallError::Timeout(Duration::ZERO);
        let d: Vec<_> = (1..=5).map(|a| p.delay(a, &e)).collect();
        assert_eq!(
            d,
            vec![
                Some(Duration::from_millis(100)),
                Some(Duration::from_millis(200)),
                Some(Duration::from_millis(350)),
                Some(Duration::from_millis(350)),
                None
            ]
        );
        assert_eq!(RetryPolicy::None.delay(1, &e), None);
        let f = RetryPolicy::Fixed { delay: Duration::from_millis(5), max_retries: 1 };
        assert_eq!(f.delay(1, &e), Some(Duration::from_millis(5)));
        assert_eq!(f.delay(2, &e), None);
    }

    #[test]
    fn jitter_stays_in_range() {
        let p = RetryPolicy::Exponential {
            initial: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            multiplier: 1.0,
            jitter: 0.5,
            max_retries: 100,
        };
        let e = CallError::Timeout(Duration::ZERO);
        for a in 1..100 {
            let d = p.delay(a, &e).unwrap();
            assert!(d >= Duration::from_millis(50) && d <= Duration::from_millis(150), "{d:?}");
        }
    }
}
