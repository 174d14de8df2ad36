//! What one HTTP/2 connection of a gRPC server holds in unfinished
//! messages. hyper returns a stream's flow-control credit as soon as its
//! DATA frames are read, and a message is collected whole before the
//! pipeline sees it, so HTTP/2's windows alone do not bound what a peer
//! makes the server hold: `max_concurrent_streams` calls, each in the
//! middle of a message of up to the message limit (64 MiB), before any of
//! them has shown an auth token.
//!
//! Each call's [`Share`] counts the DATA frames its decoder holds (the
//! message being collected; frames it keeps are copied out of hyper's
//! read buffers, see `body`, so what is counted is what is held) against
//! its connection's [`Held`], whose cap is
//! [`TransportConfig::connection_window`](crate::TransportConfig::connection_window)
//! (at least one whole message). A frame that would take the connection
//! past twice its cap fails its call with `RESOURCE_EXHAUSTED` (which gives
//! its bytes and its HTTP/2 credit back). A frame that takes it past its
//! cap is held, counted, while its call waits for the others' messages to
//! complete; meanwhile the call that began waiting first (in its current
//! message) goes on, so calls that each hold part of a message do not wait
//! for each other. A waiting call fails too once no message on the
//! connection has completed (nor the leader's message come closer to) for
//! [`GrpcConfig::room_wait`](crate::config::GrpcConfig::room_wait) (and it
//! has waited that long): that undoes the waits that room alone cannot end
//! (a leader whose handler stopped reading, or whose next frames HTTP/2
//! flow control holds behind the waiting calls' unread ones). So a
//! connection holds at most twice its cap, besides what HTTP/2's own
//! connection window lets hyper buffer unread.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sync::lock;

/// What every gRPC server connection of this process holds in unfinished
/// messages.
static HELD: AtomicU64 = AtomicU64::new(0);

/// Bytes of unfinished gRPC messages that the gRPC servers of this process
/// hold now, across their connections (each connection's share is bounded
/// by [`TransportConfig::connection_window`](crate::TransportConfig::connection_window)).
pub fn unfinished_message_bytes() -> u64 {
    HELD.load(Ordering::Relaxed)
}

/// The unfinished-message bytes of one connection.
#[derive(Debug)]
pub(crate) struct Held {
    cap: usize,
    /// How long a frame past the cap may wait for room.
    wait: Duration,
    state: Mutex<State>,
    room: Notify,
}

/// The bytes held, the calls that have waited for room in their current
/// message, in the order they began to (the first goes on), and when a
/// message last completed (or a call gave its bytes back).
#[derive(Debug)]
struct State {
    total: usize,
    next_ticket: u64,
    waited: BTreeSet<u64>,
    progress: Instant,
}

impl State {
    /// The place of a call (`ticket`) among those that waited in their
    /// current message, taken now if it has none.
    fn ticket(&mut self, ticket: &mut Option<u64>) -> u64 {
        *ticket.get_or_insert_with(|| {
            self.next_ticket += 1;
            self.waited.insert(self.next_ticket);
            self.next_ticket
        })
    }

    /// Whether the call with `ticket` may go on: the connection is within
    /// `cap`, or the call leads those that waited (it takes its place now).
    fn goes_on(&mut self, cap: usize, ticket: &mut Option<u64>) -> bool {
        let t = self.ticket(ticket);
        self.total <= cap || self.waited.first() == Some(&t)
    }
}

impl Held {
    /// A connection's account, capped at `cap` bytes; a call waits for
    /// room while messages complete, and at most `wait` after the last did.
    pub(crate) fn new(cap: usize, wait: Duration) -> Arc<Self> {
        let state = State { total: 0, next_ticket: 0, waited: BTreeSet::new(), progress: Instant::now() };
        Arc::new(Self { cap, wait, state: Mutex::new(state), room: Notify::new() })
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
                "this connection's calls held {total} bytes of unfinished messages, over its cap of {cap} \
                 (TransportConfig::connection_window, at least one message), and none completed for {waited:?}: \
                 the call was not read further"
            )
        } else {
            write!(
                f,
                "this connection's calls would hold {total} bytes of unfinished messages, over twice its cap of \
                 {cap} (TransportConfig::connection_window, at least one message): the call was not read further"
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
    /// When the frame counted last found the connection over its cap (it
    /// waits for room).
    over_since: Option<Instant>,
    /// Its place among the calls that have waited in their current message.
    ticket: Option<u64>,
}

impl Share {
    /// A call's share, holding nothing yet.
    pub(crate) fn new(conn: Arc<Held>) -> Self {
        Self { conn, bytes: 0, over_since: None, ticket: None }
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
        HELD.fetch_add(n as u64, Ordering::Relaxed);
        self.bytes += n;
        self.over_since = (st.total > cap).then(Instant::now);
        // The leader's message coming in is progress too: those behind it
        // wait while it does.
        if self.ticket.is_some_and(|t| st.waited.first() == Some(&t)) {
            st.progress = Instant::now();
        }
        Ok(())
    }

    /// Whether the frame counted last may be decoded now (see
    /// [`room`](Self::room), which waits otherwise).
    pub(crate) fn ready(&mut self) -> bool {
        if self.over_since.is_none() {
            return true;
        }
        let ok = lock(&self.conn.state).goes_on(self.conn.cap, &mut self.ticket);
        if ok {
            self.over_since = None;
        }
        ok
    }

    /// Waits until the connection is within its cap again, or this call is
    /// the first that waited (at once when either holds); fails once no
    /// message has completed for the connection's wait, counted from when
    /// the frame began to wait at the earliest. Cancel-safe: it takes a
    /// place among the waiting calls, which it keeps until its message is
    /// complete.
    pub(crate) async fn room(&mut self) -> Result<(), Full> {
        let Some(since) = self.over_since else { return Ok(()) };
        let cap = self.conn.cap;
        loop {
            let notified = self.conn.room.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let (total, deadline) = {
                let mut st = lock(&self.conn.state);
                if st.goes_on(cap, &mut self.ticket) {
                    self.over_since = None;
                    return Ok(());
                }
                (st.total, st.progress.max(since) + self.conn.wait)
            };
            if Instant::now() >= deadline {
                return Err(Full { total, cap, waited: Some(self.conn.wait) });
            }
            // Woken by any change; the deadline is looked at again then.
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    /// The call's decoder holds `now` bytes (at most what it held): a
    /// whole message was handed on (`completed`: the pipeline takes it and
    /// counts it in its own budget; what is left starts the next one; the
    /// connection made progress), or the call ended. Its place among the
    /// waiting calls goes too.
    pub(crate) fn settle(&mut self, now: usize, completed: bool) {
        let now = now.min(self.bytes);
        let ticket = self.ticket.take();
        if now == self.bytes && ticket.is_none() {
            return;
        }
        {
            let mut st = lock(&self.conn.state);
            let freed = self.bytes - now;
            st.total -= freed;
            HELD.fetch_sub(freed as u64, Ordering::Relaxed);
            if completed {
                st.progress = Instant::now();
            }
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
        self.settle(0, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_past_the_cap_wait_for_room_and_past_twice_it_are_refused() {
        let conn = Held::new(100, Duration::from_secs(60));
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
        b.settle(0, true);
        let c = waiting.await.unwrap();
        assert_eq!(conn.total(), 100);
        // `a`'s does: room.
        a.settle(0, true);
        drop(c);
        assert_eq!(conn.total(), 0);
        assert!(lock(&conn.state).waited.is_empty());
    }

    #[tokio::test]
    async fn a_frame_that_waits_too_long_fails_its_call() {
        let conn = Held::new(100, Duration::from_millis(50));
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

    #[tokio::test]
    async fn progress_is_a_completed_message_or_the_leaders_frames() {
        let conn = Held::new(100, Duration::from_secs(60));
        let progress = || lock(&conn.state).progress;
        let (mut a, mut b, mut c) = (Share::new(conn.clone()), Share::new(conn.clone()), Share::new(conn.clone()));
        a.add(90).unwrap();
        b.add(20).unwrap();
        assert!(b.ready(), "b waited first: it leads");
        let t0 = progress();
        tokio::time::sleep(Duration::from_millis(5)).await;
        c.add(10).unwrap();
        assert!(!c.ready(), "c waits behind b");
        assert_eq!(progress(), t0, "another call's frame is no progress");
        // A call that fails (or goes) gives its bytes back, but no message
        // completed: those waiting do not wait longer for it.
        drop(c);
        assert_eq!(progress(), t0);
        // The leader's next frame is.
        b.add(5).unwrap();
        let t1 = progress();
        assert!(t1 > t0);
        tokio::time::sleep(Duration::from_millis(5)).await;
        // So is a completed message.
        a.settle(0, true);
        assert!(progress() > t1);
    }
}
