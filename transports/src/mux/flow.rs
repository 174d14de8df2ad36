//! Credit-based flow control, sans-IO: numbers in, decisions out.
//!
//! The receiver grants each stream a window of bytes (header plus payload of
//! DATA frames). The sender spends credit before it sends and waits when it
//! has none; the receiver returns credit as its consumer takes frames. So a
//! slow reader slows the writer and memory stays within the window; a peer
//! that sends past its credit is caught by [`RecvWindow::on_receive`].

/// Flow-control violations.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FlowError {
    /// The peer sent more than the credit it had.
    #[error("peer sent {size} bytes with only {available} bytes of credit left")]
    Overrun {
        /// Bytes in the frame.
        size: u64,
        /// Credit the peer had.
        available: u64,
    },
    /// A credit update would overflow the window.
    #[error("credit update of {increment} overflows the window ({available} already available)")]
    Overflow {
        /// The increment.
        increment: u64,
        /// Credit before it.
        available: u64,
    },
}

/// The sender's view: credit it may spend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendWindow {
    available: u64,
    limit: u64,
}

impl SendWindow {
    /// A window starting with `initial` bytes of credit (the peer's announced window).
    pub fn new(initial: u32) -> Self {
        Self { available: initial.into(), limit: initial.into() }
    }

    /// Credit left.
    pub fn available(&self) -> u64 {
        self.available
    }

    /// The peer's full window: a frame larger than this can never be sent.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Spends `n` bytes if the credit allows; false means wait for an update.
    pub fn try_consume(&mut self, n: u64) -> bool {
        if n <= self.available {
            self.available -= n;
            true
        } else {
            false
        }
    }

    /// Adds credit from the peer. More than the full window outstanding is
    /// a peer bug.
    pub fn grant(&mut self, increment: u32) -> Result<(), FlowError> {
        let inc = u64::from(increment);
        let next = self.available + inc;
        if next > self.limit {
            return Err(FlowError::Overflow { increment: inc, available: self.available });
        }
        self.available = next;
        Ok(())
    }
}

/// The receiver's view: what the peer may still send, and when to give credit back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWindow {
    window: u64,
    /// Bytes received and not yet credited back.
    outstanding: u64,
    /// Bytes consumed since the last credit update.
    consumed: u64,
}

impl RecvWindow {
    /// A window of `window` bytes (what this side announced).
    pub fn new(window: u32) -> Self {
        Self { window: window.into(), outstanding: 0, consumed: 0 }
    }

    /// Bytes received and not yet credited back: at most the window.
    pub fn outstanding(&self) -> u64 {
        self.outstanding
    }

    /// Accounts for a received frame of `n` bytes; fails if the peer had
    /// no credit for it.
    pub fn on_receive(&mut self, n: u64) -> Result<(), FlowError> {
        let available = self.window - self.outstanding;
        if n > available {
            return Err(FlowError::Overrun { size: n, available });
        }
        self.outstanding += n;
        Ok(())
    }

    /// Accounts for `n` bytes the consumer took. Returns the credit to send
    /// back once a quarter of the window was consumed (batching updates).
    pub fn on_consume(&mut self, n: u64) -> Option<u32> {
        self.consumed += n;
        if self.consumed >= self.window / 4 || (self.consumed > 0 && self.consumed == self.outstanding) {
            let inc = self.consumed.min(self.outstanding);
            self.outstanding -= inc;
            self.consumed = 0;
            return (inc > 0).then_some(inc as u32);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slow_reader_bounds_the_sender() {
        // A sender with 1 MiB frames against an 8 MiB window and a reader
        // that consumes nothing: the sender stops after 8 frames.
        let window = 8 << 20;
        let mut send = SendWindow::new(window);
        let mut recv = RecvWindow::new(window);
        let frame = 1u64 << 20;
        let mut sent = 0;
        while send.try_consume(frame) {
            recv.on_receive(frame).unwrap();
            sent += 1;
            assert!(sent <= 8);
        }
        assert_eq!(sent, 8);
        assert_eq!(recv.outstanding(), u64::from(window));
        // The reader consumes one frame: not yet a quarter, no update.
        assert_eq!(recv.on_consume(frame), None);
        assert!(!send.try_consume(frame));
        // A second frame reaches a quarter: 2 MiB of credit goes back.
        let inc = recv.on_consume(frame).unwrap();
        assert_eq!(u64::from(inc), 2 * frame);
        send.grant(inc).unwrap();
        assert!(send.try_consume(frame) && send.try_consume(frame));
        assert!(!send.try_consume(frame));
    }

    #[test]
    fn misbehaving_peers_are_caught() {
        let mut recv = RecvWindow::new(100);
        recv.on_receive(60).unwrap();
        assert_eq!(recv.on_receive(41), Err(FlowError::Overrun { size: 41, available: 40 }));
        let mut send = SendWindow::new(100);
        assert!(send.grant(1).is_err(), "credit beyond the window");
        assert!(send.try_consume(100));
        send.grant(100).unwrap();
        assert!(send.grant(1).is_err());
    }

    #[test]
    fn a_small_stream_gets_its_credit_back_when_drained() {
        let mut recv = RecvWindow::new(1 << 20);
        recv.on_receive(300).unwrap();
        recv.on_receive(200).unwrap();
        assert_eq!(recv.on_consume(300), None);
        assert_eq!(recv.on_consume(200), Some(500));
        assert_eq!(recv.outstanding(), 0);
    }
}
