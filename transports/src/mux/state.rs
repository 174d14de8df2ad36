//! The mux stream state machine, sans-IO: events in, decisions out.
//!
//! No sockets, no tasks, no clocks: the tokio drivers (`conn`, `reader`,
//! `writer`, `handles`) feed this module what happened (a frame arrived, a
//! handle sent, finished or was dropped) and carry out what it answers (send
//! a WINDOW, a STOP or a RESET, deliver a frame, wake a sender, forget a
//! stream). Everything here is deterministic and tested on its own.
//!
//! * [`Streams`]: the connection's stream table: stream ids (clients open
//!   odd ids, servers even ones, each side in increasing order), which
//!   incoming DATA opens, refuses or is late for a stream, and how many
//!   remote streams are open.
//! * [`StreamState`]: one stream: the two half-closes (FIN, RESET, STOP,
//!   a dropped handle) and the credit windows of [`flow`](super::flow).
//! * [`goaway_reason`]: what a GOAWAY from the peer means for the user.

use std::collections::HashMap;

use super::flow::{FlowError, RecvWindow, SendWindow};
use super::frame::code;

/// Which end of the connection this is: clients open odd stream ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The connecting side.
    Client,
    /// The accepting side.
    Server,
}

/// A protocol violation by the peer: the connection must close with a
/// GOAWAY naming it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// DATA on stream 0 (the connection itself).
    #[error("DATA on stream 0")]
    DataOnStreamZero,
    /// DATA after the peer's FIN or RESET on that stream.
    #[error("data after the end of the stream")]
    DataAfterEnd,
    /// The peer broke flow control.
    #[error(transparent)]
    Flow(#[from] FlowError),
}

/// No more stream ids on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stream ids exhausted on this connection; reconnect")]
pub struct IdsExhausted;

/// Where a DATA frame goes, from [`Streams::route_data`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route<T> {
    /// A stream in the table.
    Existing(T),
    /// A new remote stream, now in the table: hand it to `accept`.
    Opened(T),
    /// A new remote stream above the limit: answer RESET with
    /// [`code::REFUSED`] and discard the frame.
    Refused,
    /// A stream that is closed here (or was never opened): discard.
    Ignored,
}

/// Hashes stream ids for the stream table: one multiplication (Fibonacci
/// hashing) instead of SipHash, which cost ~110 instructions per lookup, a
/// few lookups per call. A peer choosing its ids could still pick ones that
/// share a bucket (about one odd id in 2^18 does), but it can only open ids
/// above the last it used and at most `max_remote` at once: a lookup costs
/// at most that many comparisons, which bounds what such a peer gains.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IdHash(u64);

impl std::hash::Hasher for IdHash {
    fn finish(&self) -> u64 {
        // The product's well-mixed high half where the table looks first
        // (its bucket index comes from the low bits).
        self.0.rotate_left(32)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u8(b);
        }
    }

    fn write_u8(&mut self, b: u8) {
        self.write_u64(u64::from(b));
    }

    fn write_u32(&mut self, id: u32) {
        self.write_u64(u64::from(id));
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type IdMap<T> = HashMap<u32, T, std::hash::BuildHasherDefault<IdHash>>;

/// The connection's stream table. `T` is the driver's per-stream value (the
/// tokio driver keeps an `Arc` of the stream's shared state; tests use ids).
#[derive(Debug)]
pub struct Streams<T> {
    role: Role,
    max_remote: u32,
    map: IdMap<T>,
    next_id: u32,
    last_remote: u32,
    remote_open: u32,
}

impl<T: Clone> Streams<T> {
    /// An empty table; at most `max_remote` streams opened by the peer at once.
    pub fn new(role: Role, max_remote: u32) -> Self {
        let next_id = if role == Role::Client { 1 } else { 2 };
        Self { role, max_remote, map: IdMap::default(), next_id, last_remote: 0, remote_open: 0 }
    }

    /// True when the peer opens `id` (clients open odd ids, servers even ones).
    pub fn is_remote_id(&self, id: u32) -> bool {
        (id % 2 == 1) == (self.role == Role::Server)
    }

    /// Gives a locally opened stream the next id and puts it in the table.
    /// The caller must put the stream's first frame on the wire before
    /// another id is assigned: the peer takes any id at or below the
    /// highest it has seen for an old stream.
    pub fn open_local(&mut self, value: T) -> Result<u32, IdsExhausted> {
        let id = self.next_id;
        self.next_id = id.checked_add(2).ok_or(IdsExhausted)?;
        self.map.insert(id, value);
        Ok(id)
    }

    /// Routes a DATA frame for stream `id`; `make` builds the value of a
    /// stream the frame opens.
    pub fn route_data(&mut self, id: u32, make: impl FnOnce() -> T) -> Result<Route<T>, Violation> {
        if id == 0 {
            return Err(Violation::DataOnStreamZero);
        }
        if let Some(v) = self.map.get(&id) {
            return Ok(Route::Existing(v.clone()));
        }
        if !self.is_remote_id(id) || id <= self.last_remote {
            return Ok(Route::Ignored);
        }
        self.last_remote = id;
        if self.remote_open >= self.max_remote {
            return Ok(Route::Refused);
        }
        self.remote_open += 1;
        let v = make();
        self.map.insert(id, v.clone());
        Ok(Route::Opened(v))
    }

    /// The stream `id`, for control frames (WINDOW, RESET, STOP); None for
    /// streams closed or never opened, whose control frames are ignored.
    pub fn get(&self, id: u32) -> Option<&T> {
        self.map.get(&id)
    }

    /// Removes a stream both of whose handles are gone. True if it was there.
    pub fn forget(&mut self, id: u32) -> bool {
        let removed = self.map.remove(&id).is_some();
        if removed && self.is_remote_id(id) {
            self.remote_open -= 1;
        }
        removed
    }

    /// Streams in the table.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no stream is open.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Every stream, for a connection-wide failure.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.map.values()
    }

    /// Remote streams open now.
    pub fn remote_open(&self) -> u32 {
        self.remote_open
    }
}

/// The sending direction of a stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SendHalf {
    /// Frames may be sent.
    Open,
    /// FIN or RESET sent (or the handle dropped).
    Done,
    /// The peer sent STOP with this code.
    Stopped(u32),
}

/// The receiving direction of a stream.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum RecvHalf {
    /// Frames are delivered.
    Open,
    /// The peer sent FIN.
    Fin,
    /// The peer sent RESET.
    Reset,
    /// The receiving handle was dropped (STOP sent): frames are discarded.
    Dropped,
}

/// What a sender may do now, from [`StreamState::poll_send`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SendPoll {
    /// Credit taken (and with `fin` the direction closed): send the frames.
    Ready,
    /// Not enough credit: wait for a WINDOW (or a STOP).
    Blocked,
    /// This direction already ended.
    Finished,
    /// The peer asked to stop with this code.
    Stopped(u32),
}

/// What to do with an arriving DATA frame, from [`StreamState::on_data_head`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Admit {
    /// Read its payload for the stream.
    Deliver,
    /// Nobody reads this stream any more: skip the payload.
    Discard,
}

/// What a dropped receiving handle asks for, from [`StreamState::recv_dropped`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct RecvDropped {
    /// Send STOP with [`code::CANCELLED`] (the peer was still sending).
    pub stop: bool,
    /// Both handles are gone: remove the stream from the table.
    pub forget: bool,
}

/// One stream's state: both half-closes, both windows, and which handles
/// are alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamState {
    send: SendWindow,
    send_half: SendHalf,
    recv: RecvWindow,
    recv_half: RecvHalf,
    send_alive: bool,
    recv_alive: bool,
    /// The code of the peer's STOP, if it sent one (also after this side
    /// finished sending: its frames may still be arriving there).
    peer_stopped: Option<u32>,
}

impl StreamState {
    /// A fresh stream: `peer_window` bytes of credit to send, `my_window`
    /// bytes the peer may send.
    pub fn new(peer_window: u32, my_window: u32) -> Self {
        Self {
            send: SendWindow::new(peer_window),
            send_half: SendHalf::Open,
            recv: RecvWindow::new(my_window),
            recv_half: RecvHalf::Open,
            send_alive: true,
            recv_alive: true,
            peer_stopped: None,
        }
    }

    /// The sending direction.
    pub fn send_half(&self) -> SendHalf {
        self.send_half
    }

    /// The receiving direction.
    pub fn recv_half(&self) -> RecvHalf {
        self.recv_half
    }

    /// Send credit left.
    pub fn send_credit(&self) -> u64 {
        self.send.available()
    }

    // --- the local sender ---

    /// A sender wants to send `cost` bytes (headers plus payloads), closing
    /// its direction with them when `fin`.
    pub fn poll_send(&mut self, cost: u64, fin: bool) -> SendPoll {
        match self.send_half {
            SendHalf::Done => SendPoll::Finished,
            SendHalf::Stopped(c) => SendPoll::Stopped(c),
            SendHalf::Open if self.send.try_consume(cost) => {
                if fin {
                    self.send_half = SendHalf::Done;
                }
                SendPoll::Ready
            }
            SendHalf::Open => SendPoll::Blocked,
        }
    }

    /// The sender finishes without a frame. True: send an empty DATA with
    /// FIN (false: already finished or stopped, nothing to do).
    pub fn finish(&mut self) -> bool {
        self.close_send()
    }

    /// The sender abandons its direction. True: send RESET (if the stream
    /// is on the wire yet).
    pub fn reset(&mut self) -> bool {
        self.close_send()
    }

    fn close_send(&mut self) -> bool {
        let open = self.send_half == SendHalf::Open;
        if open {
            self.send_half = SendHalf::Done;
        }
        open
    }

    /// The sending handle is dropped (after [`reset`](Self::reset)). True:
    /// both handles are gone, forget the stream.
    pub fn send_dropped(&mut self) -> bool {
        self.send_alive = false;
        !self.recv_alive
    }

    // --- the local receiver ---

    /// The consumer took a frame of `cost` bytes. Some: send a WINDOW with
    /// this increment (none once the peer finished: it sends nothing more).
    pub fn on_consumed(&mut self, cost: u64) -> Option<u32> {
        let inc = self.recv.on_consume(cost);
        inc.filter(|_| self.recv_half == RecvHalf::Open)
    }

    /// The receiving handle is dropped.
    pub fn recv_dropped(&mut self) -> RecvDropped {
        let stop = self.recv_half == RecvHalf::Open;
        if stop {
            self.recv_half = RecvHalf::Dropped;
        }
        self.recv_alive = false;
        RecvDropped { stop, forget: !self.send_alive }
    }

    // --- frames from the peer ---

    /// The head of a DATA frame of `cost` bytes (meta plus payload) arrived:
    /// checks credit before anything is read or allocated.
    pub fn on_data_head(&mut self, cost: u64) -> Result<Admit, Violation> {
        match self.recv_half {
            RecvHalf::Fin | RecvHalf::Reset => Err(Violation::DataAfterEnd),
            RecvHalf::Dropped => Ok(Admit::Discard),
            RecvHalf::Open => {
                self.recv.on_receive(cost)?;
                Ok(Admit::Deliver)
            }
        }
    }

    /// The payload of an admitted DATA frame was read. True: deliver it (the
    /// receiving handle may have gone meanwhile); with `fin` the receiving
    /// direction then ends and the end is delivered after it.
    pub fn on_data_end(&mut self, fin: bool) -> bool {
        let deliver = self.recv_half == RecvHalf::Open;
        if deliver && fin {
            self.recv_half = RecvHalf::Fin;
        }
        deliver
    }

    /// WINDOW from the peer: more send credit (wake the sender).
    pub fn on_window(&mut self, increment: u32) -> Result<(), Violation> {
        Ok(self.send.grant(increment)?)
    }

    /// RESET from the peer with `code`. True: deliver the reset to the
    /// receiver. A [`code::REFUSED`] stream is read by nobody: its sending
    /// direction stops as on a STOP (wake the sender).
    pub fn on_reset(&mut self, code: u32) -> bool {
        if code == code::REFUSED {
            self.on_stop(code);
        }
        let open = self.recv_half == RecvHalf::Open;
        if open {
            self.recv_half = RecvHalf::Reset;
        }
        open
    }

    /// STOP from the peer: the sender's next call fails with `code` (wake it).
    pub fn on_stop(&mut self, code: u32) {
        if self.send_half == SendHalf::Open {
            self.send_half = SendHalf::Stopped(code);
        }
        self.peer_stopped.get_or_insert(code);
    }

    /// The code of the peer's STOP: it reads nothing more of this stream
    /// (set whatever this side's sending direction was doing).
    pub fn peer_stopped(&self) -> Option<u32> {
        self.peer_stopped
    }
}

/// Why the connection closed, from a GOAWAY's code and UTF-8 reason.
pub fn goaway_reason(error_code: u32, reason: &[u8]) -> String {
    let reason = String::from_utf8_lossy(reason);
    if error_code == code::NO_ERROR {
        format!("the peer closed the connection ({reason})")
    } else {
        format!("the peer closed the connection with error {error_code}: {reason}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A STOP is remembered also when this side had finished sending (its
    /// frames may still be arriving there, unread): a sender waiting on
    /// something else (UCX sends) learns of it; the first code stays.
    #[test]
    fn a_stop_after_finishing_is_remembered() {
        let mut st = StreamState::new(1 << 20, 1 << 20);
        assert_eq!(st.peer_stopped(), None);
        assert!(st.finish());
        st.on_stop(8);
        st.on_stop(9);
        assert_eq!((st.send_half(), st.peer_stopped()), (SendHalf::Done, Some(8)));
        let mut open = StreamState::new(1 << 20, 1 << 20);
        open.on_stop(7);
        assert_eq!((open.send_half(), open.peer_stopped()), (SendHalf::Stopped(7), Some(7)));
        assert_eq!(open.poll_send(1, false), SendPoll::Stopped(7));
    }

    #[test]
    fn ids_have_the_role_parity_and_increase() {
        let mut c = Streams::new(Role::Client, 10);
        let mut s = Streams::new(Role::Server, 10);
        assert_eq!((c.open_local(()).unwrap(), c.open_local(()).unwrap()), (1, 3));
        assert_eq!((s.open_local(()).unwrap(), s.open_local(()).unwrap()), (2, 4));
        assert!(s.is_remote_id(1) && !s.is_remote_id(2) && c.is_remote_id(2) && !c.is_remote_id(1));
        let mut last = Streams::<()>::new(Role::Client, 1);
        last.next_id = u32::MAX;
        assert_eq!(last.open_local(()), Err(IdsExhausted));
    }

    #[test]
    fn incoming_data_opens_refuses_or_ignores() {
        let mut s = Streams::new(Role::Server, 1);
        assert_eq!(s.route_data(0, || 0), Err(Violation::DataOnStreamZero));
        assert_eq!(s.route_data(3, || 3), Ok(Route::Opened(3)));
        assert_eq!(s.route_data(3, || 99), Ok(Route::Existing(3)));
        // Above the limit of one remote stream.
        assert_eq!(s.route_data(5, || 5), Ok(Route::Refused));
        // Late data for the refused stream, an older id, and a server id: ignored.
        assert_eq!(s.route_data(5, || 5), Ok(Route::Ignored));
        assert_eq!(s.route_data(1, || 1), Ok(Route::Ignored));
        assert_eq!(s.route_data(2, || 2), Ok(Route::Ignored));
        assert!(s.forget(3));
        assert_eq!(s.remote_open(), 0);
        assert_eq!(s.route_data(3, || 3), Ok(Route::Ignored), "a closed stream does not reopen");
        assert_eq!(s.route_data(7, || 7), Ok(Route::Opened(7)));
    }

    #[test]
    fn fin_reset_stop_and_dropped_handles() {
        let mut st = StreamState::new(100, 100);
        assert_eq!(st.poll_send(60, false), SendPoll::Ready);
        assert_eq!(st.poll_send(60, false), SendPoll::Blocked);
        st.on_window(50).unwrap();
        assert_eq!(st.poll_send(60, true), SendPoll::Ready);
        assert_eq!(st.poll_send(0, false), SendPoll::Finished);
        assert!(!st.finish(), "finishing twice sends nothing");
        assert!(!st.reset());

        let mut st = StreamState::new(100, 100);
        st.on_stop(9);
        assert_eq!(st.poll_send(1, false), SendPoll::Stopped(9));
        assert!(!st.finish(), "nothing to finish after STOP");

        let mut st = StreamState::new(100, 100);
        assert_eq!(st.on_data_head(10), Ok(Admit::Deliver));
        assert!(st.on_data_end(true));
        assert_eq!(st.on_data_head(0), Err(Violation::DataAfterEnd));
        assert_eq!(st.on_consumed(10), None, "no credit back after FIN");
        assert!(!st.on_reset(code::CANCELLED), "RESET after FIN is not delivered");

        let mut st = StreamState::new(100, 100);
        assert!(st.on_reset(code::CANCELLED));
        assert_eq!(st.on_data_head(1), Err(Violation::DataAfterEnd));

        let mut st = StreamState::new(100, 100);
        assert_eq!(st.recv_dropped(), RecvDropped { stop: true, forget: false });
        assert_eq!(st.on_data_head(1000), Ok(Admit::Discard), "discarded data is not charged");
        assert!(st.reset());
        assert!(st.send_dropped());

        let mut st = StreamState::new(100, 100);
        assert_eq!(st.on_data_head(10), Ok(Admit::Deliver));
        st.recv_dropped();
        assert!(!st.on_data_end(false), "the receiver left while the payload was read");
    }

    #[test]
    fn credit_overrun_is_a_violation() {
        let mut st = StreamState::new(100, 100);
        st.on_data_head(100).unwrap();
        assert!(matches!(st.on_data_head(1), Err(Violation::Flow(FlowError::Overrun { .. }))));
        assert!(matches!(st.on_window(1), Err(Violation::Flow(FlowError::Overflow { .. }))));
        assert!(Violation::Flow(FlowError::Overrun { size: 1, available: 0 }).to_string().contains("credit"));
    }

    #[test]
    fn goaway_reasons() {
        assert_eq!(goaway_reason(code::NO_ERROR, b"bye"), "the peer closed the connection (bye)");
        assert!(goaway_reason(code::PROTOCOL, b"bad").contains("error 3: bad"));
    }

    /// Something a stream's two ends may do, for the property tests.
    #[derive(Debug, Clone)]
    enum Op {
        Send(u16, bool),
        Consume,
        Finish,
        Reset,
        DropRecv,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u16..2000, any::<bool>()).prop_map(|(n, fin)| Op::Send(n, fin)),
            4 => Just(Op::Consume),
            1 => Just(Op::Finish),
            1 => Just(Op::Reset),
            1 => Just(Op::DropRecv),
        ]
    }

    proptest! {
        /// A sender and a receiver joined by an in-order wire: the receiver
        /// never sees an overrun or data after the end, unconsumed bytes stay
        /// within the window, frames arrive in order and nothing is sent
        /// after FIN or RESET.
        #[test]
        fn a_well_behaved_pair_never_violates(window in 2000u32..20_000, ops in proptest::collection::vec(op(), 1..200)) {
            let mut tx = StreamState::new(window, window); // the sending end
            let mut rx = StreamState::new(window, window); // the receiving end
            let mut unconsumed: std::collections::VecDeque<u64> = Default::default();
            let mut sent_after_end = false;
            for op in ops {
                match op {
                    Op::Send(n, fin) => {
                        let cost = u64::from(n);
                        let before = tx.send_half();
                        match tx.poll_send(cost, fin) {
                            SendPoll::Ready => {
                                sent_after_end |= before != SendHalf::Open;
                                if rx.on_data_head(cost).unwrap() == Admit::Deliver && rx.on_data_end(fin) {
                                    unconsumed.push_back(cost);
                                }
                            }
                            SendPoll::Blocked => prop_assert!(tx.send_credit() < cost),
                            SendPoll::Finished => prop_assert_eq!(before, SendHalf::Done),
                            SendPoll::Stopped(c) => prop_assert_eq!(c, code::CANCELLED),
                        }
                    }
                    Op::Consume => {
                        if let Some(cost) = unconsumed.pop_front()
                            && let Some(inc) = rx.on_consumed(cost)
                        {
                            tx.on_window(inc).unwrap();
                        }
                    }
                    Op::Finish => {
                        // An empty DATA with FIN costs no credit.
                        if tx.finish() && rx.on_data_head(0).unwrap() == Admit::Deliver {
                            rx.on_data_end(true);
                        }
                    }
                    Op::Reset => {
                        if tx.reset() {
                            rx.on_reset(code::CANCELLED);
                        }
                    }
                    Op::DropRecv => {
                        if rx.recv_dropped().stop {
                            tx.on_stop(code::CANCELLED);
                        }
                        unconsumed.clear();
                    }
                }
                prop_assert!(!sent_after_end);
                prop_assert!(unconsumed.iter().sum::<u64>() <= u64::from(window));
                prop_assert!(tx.send_credit() <= u64::from(window));
            }
        }

        /// The table never holds more remote streams than the limit, never
        /// opens an id twice, and local ids keep the role's parity.
        #[test]
        fn the_table_keeps_its_limits(
            role in prop_oneof![Just(Role::Client), Just(Role::Server)],
            max in 0u32..8,
            events in proptest::collection::vec((0u32..64, 0u8..3), 0..300),
        ) {
            let mut t = Streams::new(role, max);
            let mut opened = std::collections::HashSet::new();
            let mut last_local = 0;
            for (id, what) in events {
                match what {
                    0 => {
                        if let Route::Opened(v) = t.route_data(id, || id).unwrap_or(Route::Ignored) {
                            prop_assert!(t.is_remote_id(v));
                            prop_assert!(opened.insert(v), "stream {} opened twice", v);
                        }
                    }
                    1 => {
                        let id = t.open_local(0).unwrap();
                        prop_assert!(!t.is_remote_id(id) && id > last_local);
                        last_local = id;
                    }
                    _ => {
                        t.forget(id);
                    }
                }
                prop_assert!(t.remote_open() <= max);
                let remote = t.map.keys().filter(|&&k| t.is_remote_id(k)).count() as u32;
                prop_assert_eq!(remote, t.remote_open());
            }
        }

        /// Whatever the peer sends, a stream answers with a decision or a
        /// violation, never a panic, and after a violation-free FIN or RESET
        /// all further DATA is a violation.
        #[test]
        fn arbitrary_peer_frames(frames in proptest::collection::vec((0u8..4, any::<u32>(), any::<bool>()), 0..100)) {
            let mut st = StreamState::new(1 << 16, 1 << 16);
            let mut ended = false;
            for (kind, v, fin) in frames {
                match kind {
                    0 => match st.on_data_head(u64::from(v % (1 << 18))) {
                        Ok(Admit::Deliver) => {
                            prop_assert!(!ended);
                            ended |= st.on_data_end(fin) && fin;
                        }
                        Ok(Admit::Discard) => unreachable!("the receiver is alive"),
                        Err(Violation::DataAfterEnd) => prop_assert!(ended),
                        Err(_) => {}
                    },
                    1 => { let _ = st.on_window(v); }
                    2 => ended |= st.on_reset(v),
                    _ => st.on_stop(v),
                }
                prop_assert!(st.send_credit() <= 1 << 16);
            }
        }
    }
}
