//! The read side of a mux connection: the reader task parses frames,
//! enforces limits and credit before allocating anything, and hands each
//! frame to its stream. Payloads go straight into a stream's [`Placement`]
//! buffer when one is registered for their tensor. It stops reading the
//! socket while more than the connection window sits unconsumed, so memory is
//! bounded per connection too.
//!
//! [`Placement`]: crate::Placement

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::conn::{Event, MuxRecv, MuxSend, RecvHalf, SendHalf, Shared, StreamShared, lock};
use super::frame::{HEAD_LEN, Head, Kind, code};
use super::writer::Out;
use crate::{FrameHeader, Incoming, Payload, Received, StreamError};

/// Read buffer size: many small frames per read, and at most this much of a
/// large payload is copied out of it (the rest is read in place).
const READ_BUF: usize = 64 << 10;

pub(crate) async fn run<R: AsyncRead + Unpin>(shared: Arc<Shared>, mut rd: R) {
    let mut buf = BytesMut::with_capacity(READ_BUF);
    let result = tokio::select! {
        r = read_frames(&shared, &mut rd, &mut buf) => r,
        _ = shared.wait_closed() => return,
    };
    let err = match result {
        Ok(()) => {
            StreamError::ConnectionClosed { peer: shared.peer.clone(), reason: "the peer closed the connection".into() }
        }
        Err(e) => {
            if let StreamError::Protocol { reason, .. } = &e {
                tracing::warn!(peer = %shared.peer, %reason, "closing connection: protocol violation");
                let _ = shared.writer.push(Out::GoAway { code: code::PROTOCOL, reason: reason.clone() });
            }
            e
        }
    };
    shared.fail(err);
}

/// Reads until `buf` holds `n` bytes. Ok(false): clean EOF before any byte.
async fn fill<R: AsyncRead + Unpin>(
    shared: &Shared,
    rd: &mut R,
    buf: &mut BytesMut,
    n: usize,
) -> Result<bool, StreamError> {
    while buf.len() < n {
        let (spare, need) = (buf.capacity() - buf.len(), n - buf.len());
        if spare < need || spare < 4096 {
            buf.reserve(need.max(READ_BUF));
        }
        let read = rd.read_buf(buf);
        let got = match shared.idle_timeout {
            Some(t) => tokio::time::timeout(t, read).await.map_err(|_| StreamError::ConnectionClosed {
                peer: shared.peer.clone(),
                reason: format!("idle for {t:?}"),
            })?,
            None => read.await,
        }
        .map_err(|e| StreamError::io(&shared.peer, &e))?;
        if got == 0 {
            if buf.is_empty() {
                return Ok(false);
            }
            return Err(
                shared.protocol(format!("connection closed in the middle of a frame ({} of {n} bytes)", buf.len()))
            );
        }
    }
    Ok(true)
}

async fn read_frames<R: AsyncRead + Unpin>(
    shared: &Arc<Shared>,
    rd: &mut R,
    buf: &mut BytesMut,
) -> Result<(), StreamError> {
    loop {
        if !fill(shared, rd, buf, HEAD_LEN).await? {
            return Ok(());
        }
        let hb: [u8; HEAD_LEN] = buf[..HEAD_LEN].try_into().expect("filled");
        let head = Head::decode(&hb, &shared.limits).map_err(|e| shared.protocol(e.to_string()))?;
        buf.advance(HEAD_LEN);
        let meta_len = head.meta_len as usize;
        fill(shared, rd, buf, meta_len).await.and_then(|ok| {
            if ok || meta_len == 0 { Ok(()) } else { Err(shared.protocol("connection closed inside a frame header")) }
        })?;
        let meta = buf.split_to(meta_len).freeze();
        match head.kind {
            Kind::Data => on_data(shared, rd, buf, head, meta).await?,
            Kind::Window => {
                if let Some(s) = lookup(shared, head.stream) {
                    let r = lock(&s.inner).send.grant(head.value);
                    r.map_err(|e| shared.protocol(format!("stream {}: {e}", head.stream)))?;
                    s.send_notify.notify_waiters();
                }
            }
            Kind::Reset => {
                if let Some(s) = lookup(shared, head.stream) {
                    let mut inner = lock(&s.inner);
                    if inner.recv_half == RecvHalf::Open {
                        inner.recv_half = RecvHalf::Reset;
                        if let Some(tx) = &inner.events {
                            let _ = tx.send(Event::Reset(head.value));
                        }
                    }
                }
            }
            Kind::Stop => {
                if let Some(s) = lookup(shared, head.stream) {
                    let mut inner = lock(&s.inner);
                    if inner.send_half == SendHalf::Open {
                        inner.send_half = SendHalf::Stopped(head.value);
                    }
                    drop(inner);
                    s.send_notify.notify_waiters();
                }
            }
            Kind::GoAway => {
                let reason = String::from_utf8_lossy(&meta).into_owned();
                return Err(StreamError::ConnectionClosed {
                    peer: shared.peer.clone(),
                    reason: if head.value == code::NO_ERROR {
                        format!("the peer closed the connection ({reason})")
                    } else {
                        format!("the peer closed the connection with error {}: {reason}", head.value)
                    },
                });
            }
            Kind::Ping => {
                let _ = shared.writer.write_or_push([Out::Pong(head.value)]);
            }
            Kind::Pong => {}
        }
    }
}

fn lookup(shared: &Shared, id: u32) -> Option<Arc<StreamShared>> {
    lock(&shared.state).streams.get(&id).cloned()
}

/// Finds or opens the stream a DATA frame belongs to. None: discard the frame.
fn stream_for_data(shared: &Arc<Shared>, id: u32) -> Result<Option<Arc<StreamShared>>, StreamError> {
    if id == 0 {
        return Err(shared.protocol("DATA on stream 0"));
    }
    let mut st = lock(&shared.state);
    if let Some(s) = st.streams.get(&id) {
        return Ok(Some(s.clone()));
    }
    if !shared.is_remote_id(id) || id <= st.last_remote {
        // A stream already closed here (or never opened): late data is dropped.
        return Ok(None);
    }
    st.last_remote = id;
    if st.remote_open >= shared.max_streams {
        drop(st);
        let _ = shared.writer.write_or_push([Out::Reset { id, code: code::REFUSED }]);
        return Ok(None);
    }
    st.remote_open += 1;
    let (s, rx) = shared.new_stream(id, true);
    st.streams.insert(id, s.clone());
    shared.writer.open_streams.fetch_add(1, Ordering::Relaxed);
    drop(st);
    let incoming = Incoming {
        kind: None,
        send: Box::new(MuxSend { shared: shared.clone(), stream: s.clone() }),
        recv: Box::new(MuxRecv { shared: shared.clone(), stream: s.clone(), events: rx, done: false }),
    };
    if shared.accept_tx.send(incoming).is_err() {
        return Ok(None);
    }
    Ok(Some(s))
}

async fn on_data<R: AsyncRead + Unpin>(
    shared: &Arc<Shared>,
    rd: &mut R,
    buf: &mut BytesMut,
    head: Head,
    meta: Bytes,
) -> Result<(), StreamError> {
    let plen = head.payload_len() as usize;
    let header = if meta.is_empty() {
        if plen > 0 {
            return Err(shared.protocol(format!("stream {}: payload without a frame header", head.stream)));
        }
        None
    } else {
        Some(
            FrameHeader::decode(meta)
                .map_err(|e| shared.protocol(format!("stream {}: undecodable frame header: {e}", head.stream)))?,
        )
    };
    let Some(s) = stream_for_data(shared, head.stream)? else {
        return skip(shared, rd, buf, plen).await;
    };
    let cost = head.meta_len as u64 + plen as u64;
    let (placement, deliver) = {
        let mut inner = lock(&s.inner);
        match inner.recv_half {
            RecvHalf::Fin | RecvHalf::Reset => {
                return Err(shared.protocol(format!("stream {}: data after the end of the stream", head.stream)));
            }
            RecvHalf::Dropped => (None, false),
            RecvHalf::Open => {
                inner.recv.on_receive(cost).map_err(|e| shared.protocol(format!("stream {}: {e}", head.stream)))?;
                let place = match (&inner.placement, &header) {
                    (Some(p), Some(h)) => h
                        .placement_offset()
                        .filter(|&(id, off)| p.accepts(id, off, plen))
                        .map(|(_, off)| (p.clone(), off)),
                    _ => None,
                };
                (place, true)
            }
        }
    };
    if !deliver {
        return skip(shared, rd, buf, plen).await;
    }
    let payload = match placement {
        Some((p, off)) => {
            let mut g = p.lock().await;
            let dst = &mut g[off as usize..off as usize + plen];
            let have = buf.len().min(plen);
            dst[..have].copy_from_slice(&buf[..have]);
            buf.advance(have);
            if have < plen {
                rd.read_exact(&mut dst[have..]).await.map_err(|e| read_err(shared, &e))?;
            }
            Payload::Placed { offset: off, len: plen }
        }
        None => Payload::Bytes(read_payload(shared, rd, buf, plen).await?),
    };
    {
        let mut inner = lock(&s.inner);
        if inner.recv_alive && inner.recv_half == RecvHalf::Open {
            if let (Some(tx), Some(header)) = (&inner.events, header)
                && tx.send(Event::Frame(Received { header, payload }, cost)).is_ok()
            {
                shared.buffered.fetch_add(cost, Ordering::AcqRel);
            }
            if head.fin() {
                inner.recv_half = RecvHalf::Fin;
                if let Some(tx) = &inner.events {
                    let _ = tx.send(Event::Fin);
                }
            }
        }
    }
    // Connection window: stop reading while too much sits unconsumed.
    loop {
        let n = shared.budget_notify.notified();
        let mut n = pin!(n);
        n.as_mut().enable();
        if shared.buffered.load(Ordering::Acquire) <= shared.conn_window || shared.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        n.await;
    }
}

fn read_err(shared: &Shared, e: &std::io::Error) -> StreamError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        shared.protocol("connection closed in the middle of a payload")
    } else {
        StreamError::io(&shared.peer, e)
    }
}

async fn read_payload<R: AsyncRead + Unpin>(
    shared: &Shared,
    rd: &mut R,
    buf: &mut BytesMut,
    n: usize,
) -> Result<Bytes, StreamError> {
    if buf.len() >= n {
        return Ok(buf.split_to(n).freeze());
    }
    if n <= READ_BUF {
        if !fill(shared, rd, buf, n).await? {
            return Err(shared.protocol("connection closed in the middle of a payload"));
        }
        return Ok(buf.split_to(n).freeze());
    }
    // Large: one allocation of exactly n (checked against max_frame_payload
    // by Head::decode), filled by reading straight into it.
    let mut dst = BytesMut::with_capacity(n);
    dst.extend_from_slice(&buf[..]);
    buf.clear();
    while dst.len() < n {
        let room = n - dst.len();
        let mut limited = (&mut dst).limit(room);
        let got = rd.read_buf(&mut limited).await.map_err(|e| read_err(shared, &e))?;
        if got == 0 {
            return Err(shared.protocol("connection closed in the middle of a payload"));
        }
    }
    Ok(dst.freeze())
}

async fn skip<R: AsyncRead + Unpin>(
    shared: &Shared,
    rd: &mut R,
    buf: &mut BytesMut,
    mut n: usize,
) -> Result<(), StreamError> {
    let have = buf.len().min(n);
    buf.advance(have);
    n -= have;
    let mut sink = [0u8; 8192];
    while n > 0 {
        let k = n.min(sink.len());
        rd.read_exact(&mut sink[..k]).await.map_err(|e| read_err(shared, &e))?;
        n -= k;
    }
    Ok(())
}
