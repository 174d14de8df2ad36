//! The frame stream of a `ucx://` connection: the mux's bytes (frame
//! headers and small payloads) travel as a UCP stream (`ucp_stream_send_nbx`
//! / `ucp_stream_recv_data_nb`) on the connection's endpoint, so a small
//! call crosses RDMA (or UCX's shared memory on one host) instead of the
//! TCP control socket.
//!
//! A UCP stream has no half-close, and the control socket may deliver its
//! end before the stream's last bytes arrive. So the writer's shutdown
//! flushes the endpoint (everything sent has reached the peer), then writes
//! the stream's total byte count on the control socket and shuts it down;
//! the peer's stream ends (a clean end of file) once exactly that many
//! bytes arrived. A control socket that ends without a count (a killed
//! peer) fails the connection.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::oneshot;

use super::worker::WorkerHandle;

/// Frame bytes handed to UCX and not completed, beyond which writes wait.
const OUT_MAX: usize = 8 << 20;
/// Largest single stream send (bigger writes are taken in parts).
const SEND_MAX: usize = 1 << 20;

fn broken(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, why)
}

/// The read half: bytes the worker's thread pulled from the stream.
pub(crate) struct UcxReader {
    pub(crate) worker: Arc<WorkerHandle>,
}

impl AsyncRead for UcxReader {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.worker.poll_stream_read(cx, buf)
    }
}

enum Closing {
    Open,
    /// Waiting for the endpoint flush.
    Flushing(oneshot::Receiver<Result<(), String>>),
    /// Writing the byte count on the control socket (this many of its
    /// 8 bytes written).
    Announcing(usize),
    /// Shutting the control socket's write side.
    Shutting,
    Closed,
}

/// The write half: copies what it is given and hands it to the worker's
/// thread (a socket's kernel buffer, in effect); [`OUT_MAX`] bytes not yet
/// completed by UCX make writers wait.
pub(crate) struct UcxWriter {
    worker: Arc<WorkerHandle>,
    control: OwnedWriteHalf,
    /// Bytes handed over so far (what the shutdown announces).
    sent: AtomicU64,
    closing: Closing,
    /// Dropped with the writer: tells the connection its frames are out.
    _gone: oneshot::Sender<()>,
}

impl UcxWriter {
    pub(crate) fn new(worker: Arc<WorkerHandle>, control: OwnedWriteHalf, gone: oneshot::Sender<()>) -> Self {
        Self { worker, control, sent: AtomicU64::new(0), closing: Closing::Open, _gone: gone }
    }

    /// Copies up to [`SEND_MAX`] bytes of `bufs` into one send.
    fn hand_over(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if !matches!(self.closing, Closing::Open) {
            return Err(broken("write after shutdown".into()));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum::<usize>().min(SEND_MAX);
        if total == 0 {
            return Ok(0);
        }
        let mut data = BytesMut::with_capacity(total);
        for b in bufs {
            let take = b.len().min(total - data.len());
            data.extend_from_slice(&b[..take]);
            if data.len() == total {
                break;
            }
        }
        self.worker.stream_send(Bytes::from(data)).map_err(broken)?;
        self.sent.fetch_add(total as u64, Ordering::Relaxed);
        Ok(total)
    }
}

impl AsyncWrite for UcxWriter {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        ready!(self.worker.poll_stream_room(cx, OUT_MAX)).map_err(broken)?;
        Poll::Ready(self.hand_over(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Handed to the worker is as far as a socket's flush goes too.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            match &mut this.closing {
                Closing::Open => this.closing = Closing::Flushing(this.worker.flush()),
                Closing::Flushing(rx) => {
                    let r = ready!(Pin::new(rx).poll(cx));
                    r.map_err(|_| broken("the UCX worker stopped".into()))?.map_err(broken)?;
                    this.closing = Closing::Announcing(0);
                }
                Closing::Announcing(done) => {
                    let count = this.sent.load(Ordering::Relaxed).to_le_bytes();
                    let n = ready!(Pin::new(&mut this.control).poll_write(cx, &count[*done..]))?;
                    if n == 0 {
                        return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                    }
                    *done += n;
                    if *done == count.len() {
                        this.closing = Closing::Shutting;
                    }
                }
                Closing::Shutting => {
                    ready!(Pin::new(&mut this.control).poll_shutdown(cx))?;
                    this.closing = Closing::Closed;
                }
                Closing::Closed => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl crate::mux::MuxWrite for UcxWriter {
    fn try_write_now(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        if self.worker.stream_pending() >= OUT_MAX {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.hand_over(bufs)
    }
}
