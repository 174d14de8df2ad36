//! Token checks for every transport, and the limit on guessing: a peer
//! (by IP address; local sockets share one key) that presents a wrong token
//! `max_auth_failures` times within [`AUTH_FAILURE_WINDOW`] is refused
//! until the window has passed, whatever it presents. The comparison takes
//! the same time for every guess.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::config::AUTH_FAILURE_WINDOW;
use crate::error::Status;
use crate::util::sync::lock;

/// Peers remembered at most (the oldest are forgotten first), so a flood of
/// addresses cannot grow the table without bound.
const MAX_TRACKED_PEERS: usize = 4096;

/// The server's token and the failed attempts per peer.
#[derive(Debug)]
pub(crate) struct Auth {
    token: Option<String>,
    max_failures: u32,
    failures: Mutex<HashMap<String, (u32, Instant)>>,
}

/// The key a peer address is counted under: its IP, without the port.
pub(crate) fn peer_key(peer: &str) -> String {
    match peer.parse::<std::net::SocketAddr>() {
        Ok(a) => a.ip().to_string(),
        Err(_) => "local".to_string(),
    }
}

impl Auth {
    pub(crate) fn new(token: Option<String>, max_failures: u32) -> Self {
        Self { token, max_failures, failures: Mutex::new(HashMap::new()) }
    }

    /// Ok when no token is configured or `given` is it; counts failures.
    pub(crate) fn check(&self, peer: &str, given: &str) -> Result<(), Status> {
        let Some(token) = &self.token else { return Ok(()) };
        let key = peer_key(peer);
        let now = Instant::now();
        let mut map = lock(&self.failures);
        if let Some((n, since)) = map.get(&key) {
            if now.duration_since(*since) >= AUTH_FAILURE_WINDOW {
                map.remove(&key);
            } else if self.max_failures > 0 && *n >= self.max_failures {
                let left = AUTH_FAILURE_WINDOW.saturating_sub(now.duration_since(*since));
                return Err(Status::unauthenticated(format!(
                    "too many wrong auth tokens from {key}; refused for another {}s",
                    left.as_secs().max(1)
                )));
            }
        }
        if constant_time_eq(given.as_bytes(), token.as_bytes()) {
            return Ok(());
        }
        if map.len() >= MAX_TRACKED_PEERS
            && !map.contains_key(&key)
            && let Some(oldest) = map.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| k.clone())
        {
            map.remove(&oldest);
        }
        let e = map.entry(key).or_insert((0, now));
        e.0 += 1;
        tracing::warn!(peer, failures = e.0, "wrong auth token");
        Err(Status::unauthenticated("missing or wrong auth token"))
    }

    /// Failed attempts counted for `peer` now.
    #[cfg(test)]
    fn failures(&self, peer: &str) -> u32 {
        lock(&self.failures).get(&peer_key(peer)).map_or(0, |e| e.0)
    }
}

/// Compares a presented token with the expected one in time that depends
/// only on the expected token's length (not on where they differ, nor on
/// the presented length).
pub(crate) fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != expected.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= given.get(i).copied().unwrap_or(!e) ^ e;
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secreT", b"secret"));
        assert!(!constant_time_eq(b"secret-and-more", b"secret"));
        assert!(!constant_time_eq(b"sec", b"secret"));
        assert!(!constant_time_eq(b"", b"secret"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn guessing_is_limited_per_peer() {
        let a = Auth::new(Some("right".into()), 3);
        for _ in 0..3 {
            assert!(a.check("10.0.0.1:1000", "wrong").is_err());
        }
        assert_eq!(a.failures("10.0.0.1:2000"), 3, "counted per IP, whatever the port");
        let e = a.check("10.0.0.1:3000", "right").unwrap_err();
        assert!(e.message.contains("too many wrong auth tokens"), "{e}");
        assert!(a.check("10.0.0.2:1000", "right").is_ok(), "other peers are not affected");
        assert!(Auth::new(None, 3).check("x", "anything").is_ok());
    }
}
