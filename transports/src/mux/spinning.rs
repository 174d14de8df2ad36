//! A connection's socket halves, counted so that its reader spins (see
//! [`crate::spin`]): [`SpinRead`] keeps polling a socket with nothing to
//! read for [`TransportConfig::spin`] after the connection last moved
//! bytes, and [`SpinWrite`] counts writes and wakes a sleeping reader, so
//! that a reply within the spin costs no thread wake-up. With a zero spin
//! (transports that spin on their own, or spinning turned off) both are
//! pass-throughs that count.
//!
//! [`TransportConfig::spin`]: crate::TransportConfig::spin

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::writer::MuxWrite;
use crate::spin::{Activity, Spin, spin_again};

/// The read half: spins while the connection is busy.
pub(crate) struct SpinRead<R> {
    rd: R,
    activity: Arc<Activity>,
    spin: Spin,
}

/// The write half: counts what it writes.
pub(crate) struct SpinWrite<W> {
    wr: W,
    activity: Arc<Activity>,
}

/// Wraps both halves of one connection around one [`Activity`].
pub(crate) fn halves<R, W>(rd: R, wr: W, activity: Activity) -> (SpinRead<R>, SpinWrite<W>) {
    let activity = Arc::new(activity);
    (SpinRead { rd, activity: activity.clone(), spin: Spin::new() }, SpinWrite { wr, activity })
}

impl<R: AsyncRead + Unpin> AsyncRead for SpinRead<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.rd).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.activity.read();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            // The socket has registered the task for readiness either way.
            Poll::Pending if this.spin.reading(&this.activity) => spin_again(cx),
            Poll::Pending => {
                this.activity.sleep(cx.waker());
                Poll::Pending
            }
        }
    }
}

impl<W: MuxWrite> SpinWrite<W> {
    fn counted(&self, r: io::Result<usize>) -> io::Result<usize> {
        if matches!(r, Ok(n) if n > 0) {
            self.activity.wrote();
        }
        r
    }
}

impl<W: MuxWrite> AsyncWrite for SpinWrite<W> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = std::task::ready!(Pin::new(&mut self.wr).poll_write(cx, buf));
        Poll::Ready(self.counted(r))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = std::task::ready!(Pin::new(&mut self.wr).poll_write_vectored(cx, bufs));
        Poll::Ready(self.counted(r))
    }

    fn is_write_vectored(&self) -> bool {
        self.wr.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.wr).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.wr).poll_shutdown(cx)
    }
}

impl<W: MuxWrite> MuxWrite for SpinWrite<W> {
    fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.counted(self.wr.try_write_now(bufs))
    }

    fn syscall_free(&self) -> bool {
        self.wr.syscall_free()
    }

    fn spins(&self) -> bool {
        self.wr.spins()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spin::WakeCount;
    use std::task::Waker;
    use std::time::Duration;

    /// A write half that takes everything at once.
    struct Sink;
    impl AsyncWrite for Sink {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }
    impl MuxWrite for Sink {
        fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            Ok(bufs.iter().map(|b| b.len()).sum())
        }
        fn spins(&self) -> bool {
            true
        }
    }

    fn poll(rd: &mut SpinRead<tokio::io::DuplexStream>, waker: &Waker) -> Poll<usize> {
        let mut cx = Context::from_waker(waker);
        let mut b = [0u8; 16];
        let mut buf = ReadBuf::new(&mut b);
        match Pin::new(rd).poll_read(&mut cx, &mut buf) {
            Poll::Ready(r) => Poll::Ready(r.map(|()| buf.filled().len()).unwrap()),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Polls an idle reader until it stops spinning (outside a runtime a
    /// spinning poll wakes its task at once) and goes to sleep.
    fn until_asleep(rd: &mut SpinRead<tokio::io::DuplexStream>, count: &Arc<WakeCount>) {
        let waker = count.waker();
        for _ in 0..100_000 {
            let before = count.get();
            assert!(poll(rd, &waker).is_pending(), "nothing to read");
            if count.get() == before {
                return;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        panic!("the reader never stopped spinning");
    }

    #[test]
    fn a_write_wakes_a_sleeping_reader_once_and_reads_keep_it_spinning() {
        let (a, mut b) = tokio::io::duplex(64);
        let (mut rd, wr) = halves(a, Sink, Activity::new(Duration::from_micros(200)));
        let count = WakeCount::new();
        until_asleep(&mut rd, &count);
        let woken = count.get();
        wr.try_write_now(&[IoSlice::new(b"request")]).unwrap();
        assert_eq!(count.get(), woken + 1, "the write woke the sleeping reader");
        wr.try_write_now(&[IoSlice::new(b"more")]).unwrap();
        assert_eq!(count.get(), woken + 1, "one wake per sleep");
        // Woken, it spins for the answer, and reads it.
        let waker = count.waker();
        assert!(poll(&mut rd, &waker).is_pending());
        assert!(count.get() > woken + 1, "woken by a write, the reader spins");
        tokio_test_write(&mut b, b"reply");
        assert_eq!(poll(&mut rd, &waker), Poll::Ready(5));
        // Writes alone after that quiet spell: the reader sleeps, and a
        // further write in the same spell wakes it once but it sleeps on.
        until_asleep(&mut rd, &count);
        drop(b);
        let before = count.get();
        assert_eq!(poll(&mut rd, &waker), Poll::Ready(0), "end of stream: ready, no spin");
        assert_eq!(count.get(), before);
    }

    /// Writes `data` into the duplex end without a runtime.
    fn tokio_test_write(b: &mut tokio::io::DuplexStream, data: &[u8]) {
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        match Pin::new(b).poll_write(&mut cx, data) {
            Poll::Ready(Ok(n)) => assert_eq!(n, data.len()),
            other => panic!("write: {other:?}"),
        }
    }

    #[test]
    fn zero_spin_is_a_pass_through() {
        let (a, mut b) = tokio::io::duplex(64);
        let (mut rd, wr) = halves(a, Sink, Activity::new(Duration::ZERO));
        let count = WakeCount::new();
        let waker = count.waker();
        assert!(poll(&mut rd, &waker).is_pending());
        assert_eq!(count.get(), 0, "no spin: pending without waking itself");
        wr.try_write_now(&[IoSlice::new(b"x")]).unwrap();
        assert_eq!(count.get(), 0, "no spin: a write wakes nobody");
        tokio_test_write(&mut b, b"abc");
        assert_eq!(poll(&mut rd, &waker), Poll::Ready(3));
    }
}
