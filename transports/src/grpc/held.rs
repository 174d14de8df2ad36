//! What one HTTP/2 connection of a gRPC server holds in unfinished
//! messages. hyper returns a stream's flow-control credit as soon as its
//! DATA frames are read, and a message is collected whole before the
//! pipeline sees it, so HTTP/2's windows alone do not bound what a peer
//! makes the server hold: `max_concurrent_streams` calls, each in the
//! middle of a message of up to the message limit (64 MiB), before any of
//! them has shown an auth token. Each call's [`Share`] counts the bytes its
//! decoder holds against the connection's [`Held`], whose cap is
//! [`TransportConfig::connection_window`](crate::TransportConfig::connection_window)
//! (as the mux's reader stops reading at it): a call that would pass it
//! stops reading its body (so HTTP/2 flow control stops its sender) until
//! room frees up.
//!
//! The call whose unfinished message began first may always go on (the
//! leader), so calls waiting for each other's room cannot deadlock: the
//! leader completes its message, which the pipeline then takes (and counts
//! in its own memory budget), freeing its bytes. A connection so holds at
//! most its cap plus one message.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::sync::lock;

/// The unfinished-message bytes of one connection.
#[derive(Debug)]
pub(crate) struct Held {
    cap: usize,
    state: Mutex<State>,
    room: Notify,
}

/// The sans-IO part: totals and who holds what, in order of arrival.
#[derive(Debug, Default)]
struct State {
    total: usize,
    next_ticket: u64,
    /// The tickets of the calls holding bytes (the smallest leads).
    holders: BTreeSet<u64>,
}

impl State {
    /// Whether `n` more bytes may be held by the call with `ticket` (None:
    /// it holds nothing yet).
    fn admits(&self, cap: usize, ticket: Option<u64>, n: usize) -> bool {
        self.total.saturating_add(n) <= cap
            || self.holders.is_empty()
            || (ticket.is_some() && ticket == self.holders.first().copied())
    }

    /// A ticket for a call that starts holding bytes.
    fn ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.holders.insert(self.next_ticket);
        self.next_ticket
    }
}

impl Held {
    /// A connection's account, capped at `cap` bytes.
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self { cap, state: Mutex::new(State::default()), room: Notify::new() })
    }

    /// The bytes held now, across the connection's calls.
    #[cfg(test)]
    fn total(&self) -> usize {
        lock(&self.state).total
    }
}

/// One call's part of its connection's [`Held`]; gives its bytes back when
/// dropped.
#[derive(Debug)]
pub(crate) struct Share {
    conn: Arc<Held>,
    bytes: usize,
    ticket: Option<u64>,
}

impl Share {
    /// A call's share, holding nothing yet.
    pub(crate) fn new(conn: Arc<Held>) -> Self {
        Self { conn, bytes: 0, ticket: None }
    }

    /// Waits until `n` more bytes may be held, then holds them.
    /// Cancel-safe: nothing is held until it returns.
    pub(crate) async fn grow(&mut self, n: usize) {
        loop {
            let room = self.conn.room.notified();
            let mut room = std::pin::pin!(room);
            room.as_mut().enable();
            {
                let mut st = lock(&self.conn.state);
                if st.admits(self.conn.cap, self.ticket, n) {
                    st.total += n;
                    self.bytes += n;
                    if self.ticket.is_none() && self.bytes > 0 {
                        self.ticket = Some(st.ticket());
                    }
                    return;
                }
            }
            room.await;
        }
    }

    /// The call's decoder holds `now` bytes (at most what it held): the
    /// rest was handed on. `completed`: a message was taken, so what is
    /// left starts a new one (which queues behind the others).
    pub(crate) fn settle(&mut self, now: usize, completed: bool) {
        let now = now.min(self.bytes);
        if now == self.bytes && !completed {
            return;
        }
        {
            let mut st = lock(&self.conn.state);
            st.total -= self.bytes - now;
            self.bytes = now;
            if completed || now == 0 {
                if let Some(t) = self.ticket.take() {
                    st.holders.remove(&t);
                }
                if now > 0 {
                    self.ticket = Some(st.ticket());
                }
            }
        }
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

    #[test]
    fn the_first_unfinished_message_always_goes_on() {
        let mut st = State::default();
        // Room: anyone; full: only the leader (or anyone when nobody holds).
        assert!(st.admits(10, None, 10));
        assert!(st.admits(10, None, 11), "nobody holds anything: a frame larger than the cap still goes");
        let a = st.ticket();
        let b = st.ticket();
        st.total = 9;
        assert!(st.admits(10, Some(b), 1));
        assert!(!st.admits(10, Some(b), 2));
        assert!(!st.admits(10, None, 2));
        assert!(st.admits(10, Some(a), 100), "the leader");
        st.holders.remove(&a);
        assert!(st.admits(10, Some(b), 100), "the next one leads");
    }

    #[tokio::test]
    async fn a_waiting_call_goes_on_when_the_leader_completes() {
        let conn = Held::new(100);
        let mut a = Share::new(conn.clone());
        let mut b = Share::new(conn.clone());
        a.grow(80).await;
        let waiting = tokio::spawn(async move {
            b.grow(30).await;
            b
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        // The leader may pass the cap to complete its message.
        a.grow(40).await;
        assert_eq!(conn.total(), 120);
        a.settle(0, true);
        let b = waiting.await.unwrap();
        assert_eq!(conn.total(), 30);
        drop(b);
        assert_eq!(conn.total(), 0);
        drop(a);
        assert!(lock(&conn.state).holders.is_empty());
    }

    #[tokio::test]
    async fn what_is_left_of_a_frame_queues_behind_the_others() {
        let conn = Held::new(100);
        let (mut a, mut b) = (Share::new(conn.clone()), Share::new(conn.clone()));
        a.grow(10).await;
        b.grow(10).await;
        // `a` completes a message; 4 bytes of its next one stay: `b` leads.
        a.settle(4, true);
        assert_eq!(conn.total(), 14);
        let st = lock(&conn.state);
        assert_eq!(st.holders.first().copied(), b.ticket);
        assert!(a.ticket > b.ticket);
    }
}
