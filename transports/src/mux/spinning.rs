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
            Poll::Pending if this.spin.spinning(&this.activity) => spin_again(cx),
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
