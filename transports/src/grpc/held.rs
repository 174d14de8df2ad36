//! What one HTTP/2 connection of a gRPC server holds in unfinished
//! messages. hyper returns a stream's flow-control credit as soon as its
//! DATA frames are read, and a message is collected whole before the
//! pipeline sees it, so HTTP/2's windows alone do not bound what a peer
//! makes the server hold: `max_concurrent_streams` calls, each in the
//! middle of a message of up to the message limit (64 MiB), before any of
//! them has shown an auth token.
//!
//! Each call's [`Share`] counts the DATA frames its decoder holds (the
//! message being collected) against its connection's [`Held`], whose cap
//! is [`TransportConfig::connection_window`](crate::TransportConfig::connection_window)
//! (at least one whole message). A frame that would take the connection
//! past twice its cap fails its call with `RESOURCE_EXHAUSTED` (which gives
//! its bytes and its HTTP/2 credit back). A frame that takes it past its
//! cap is held, counted, while its call waits for the others' messages to
//! complete; meanwhile the call that began waiting first (in its current
//! message) goes on, so calls that each hold part of a message do not wait
//! for each other. A call that waits [`ROOM_WAIT`] fails too: that undoes
//! the waits that room alone cannot end (a leader whose handler stopped
//! reading, or whose next frames HTTP/2 flow control holds behind the
//! waiting calls' unread ones). So a connection holds at most twice its cap.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sync::lock;

/// Longest a call's frame waits for room (see the module doc).
pub(crate) const ROOM_WAIT: Duration = Duration::from_secs(2);

/// The unfinished-message bytes of one connection.
#[derive(Debug)]
pub(crate) struct Held {
    cap: usize,
    /// How long a frame past the cap may wait for room.
    wait: Duration,
    state: Mutex<State>,
    room: Notify,
}

/// The bytes held, and the calls that have waited for room in their
/// current message, in the order they began to (the first goes on).
#[derive(Debug, Default)]
struct State {
    total: usize,
    next_ticket: u64,
    waited: BTreeSet<u64>,
}

impl Held {
    /// A connection's account, capped at `cap` bytes.
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        Self::waiting(cap, ROOM_WAIT)
    }

    fn waiting(cap: usize, wait: Duration) -> Arc<Self> {
        Arc::new(Self { cap, wait, state: Mutex::new(State::default()), room: Notify::new() })
    }

    /// The bytes held now, across the connection's calls.
    #[cfg(test)]
    fn total(&self) -> usize {
        lock(&self.state).total
    }
}

/// Why a call's frame was refused: the connection holds too much.
#[derive(Debug)]
pub(crate) struct Full {
    total: usize,
    cap: usize,
    /// How long it waited for room (None: refused at once).
    waited: Option<Duration>,
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (total, cap) = (self.total, self.cap);
        if let Some(waited) = self.waited {
            write!(
                f,
                "this connection's calls held {total} bytes of unfinished messages, over its {cap} \
                 (TransportConfig::connection_window), for {waited:?}: the call was not read further"
            )
        } else {
            write!(
                f,
                "this connection's calls would hold {total} bytes of unfinished messages, over twice its {cap} \
                 (TransportConfig::connection_window): the call was not read further"
            )
        }
    }
}

/// One call's part of its connection's [`Held`]; gives its bytes back when
/// dropped.
#[derive(Debug)]
pub(crate) struct Share {
    conn: Arc<Held>,
    bytes: usize,
    /// Until when the frame counted last may wait for room.
    deadline: Option<Instant>,
    /// Its place among the calls that have waited in their current message.
    ticket: Option<u64>,
}

impl Share {
    /// A call's share, holding nothing yet.
    pub(crate) fn new(conn: Arc<Held>) -> Self {
        Self { conn, bytes: 0, deadline: None, ticket: None }
    }

    /// Counts a frame of `n` bytes that arrived; refused (nothing counted)
    /// when the connection would hold more than twice its cap.
    pub(crate) fn add(&mut self, n: usize) -> Result<(), Full> {
        if n == 0 {
            return Ok(());
        }
        let cap = self.conn.cap;
        let mut st = lock(&self.conn.state);
        if st.total.saturating_add(n) > cap.saturating_mul(2) {
            return Err(Full { total: st.total.saturating_add(n), cap, waited: None });
        }
        st.total += n;
        self.bytes += n;
        self.deadline = (st.total > cap).then(|| Instant::now() + self.conn.wait);
        Ok(())
    }

    /// Waits until the connection is within its cap again, or this call is
    /// the first that waited (at once when either holds), at most until
    /// the deadline of the frame counted last. Cancel-safe: it takes a
    /// place among the waiting calls, which it keeps until its message is
    /// complete.
    pub(crate) async fn room(&mut self) -> Result<(), Full> {
        let Some(deadline) = self.deadline else { return Ok(()) };
        let cap = self.conn.cap;
        loop {
            let notified = self.conn.room.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let total = {
                let mut st = lock(&self.conn.state);
                let ticket = match self.ticket {
                    Some(t) => t,
                    None => {
                        st.next_ticket += 1;
                        let t = st.next_ticket;
                        st.waited.insert(t);
                        self.ticket = Some(t);
                        t
                    }
                };
                if st.total <= cap || st.waited.first() == Some(&ticket) {
                    self.deadline = None;
                    return Ok(());
                }
                st.total
            };
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Full { total, cap, waited: Some(self.conn.wait) });
            }
        }
    }

    /// The call's decoder holds `now` bytes (at most what it held): a
    /// whole message was handed on (the pipeline takes it and counts it in
    /// its own budget; what is left starts the next one), or the call
    /// ended. Its place among the waiting calls goes too.
    pub(crate) fn settle(&mut self, now: usize) {
        let now = now.min(self.bytes);
        let ticket = self.ticket.take();
        if now == self.bytes && ticket.is_none() {
            return;
        }
        {
            let mut st = lock(&self.conn.state);
            st.total -= self.bytes - now;
            if let Some(t) = ticket {
                st.waited.remove(&t);
            }
        }
        self.bytes = now;
        self.conn.room.notify_waiters();
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.settle(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_past_the_cap_wait_for_room_and_past_twice_it_are_refused() {
        let conn = Held::new(100);
        let (mut a, mut b, mut c) = (Share::new(conn.clone()), Share::new(conn.clone()), Share::new(conn.clone()));
        a.add(90).unwrap();
        a.room().await.unwrap();
        b.add(0).unwrap();
        b.add(30).unwrap();
        assert_eq!(conn.total(), 120);
        let e = b.add(81).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");
        assert_eq!(conn.total(), 120, "a refused frame is not counted");
        // The first call to wait goes on (past the cap); the next one waits.
        b.room().await.unwrap();
        c.add(10).unwrap();
        let waiting = tokio::spawn(async move {
            c.room().await.unwrap();
            c
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "past the cap, behind b: waits");
        // `b`'s message completes (the pipeline takes it): `c` leads now.
        b.settle(0);
        let c = waiting.await.unwrap();
        assert_eq!(conn.total(), 100);
        // `a`'s does: room.
        a.settle(0);
        drop(c);
        assert_eq!(conn.total(), 0);
        assert!(lock(&conn.state).waited.is_empty());
    }

    #[tokio::test]
    async fn a_frame_that_waits_too_long_fails_its_call() {
        let conn = Held::waiting(100, Duration::from_millis(50));
        let (mut a, mut b, mut c) = (Share::new(conn.clone()), Share::new(conn.clone()), Share::new(conn.clone()));
        a.add(90).unwrap();
        b.add(20).unwrap();
        b.room().await.unwrap();
        // `b` leads but never completes its message: `c` gives up.
        c.add(30).unwrap();
        let e = c.room().await.unwrap_err();
        assert!(e.to_string().contains("was not read further"), "{e}");
        drop(c);
        assert_eq!(conn.total(), 110, "the failed call's bytes come back");
    }
}
