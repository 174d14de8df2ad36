//! Connections and logical streams over QUIC.
//!
//! A logical stream is one bidirectional QUIC stream on the primary
//! connection. Each frame on it is
//!
//! ```text
//!  u32 LE: stripe (high 8 bits) | header length (low 24 bits)
//!  u32 LE: payload length
//!  header (protobuf FrameHeader)
//!  payload, when stripe = 0
//! ```
//!
//! With stripe = i > 0 the payload is the next `payload length` bytes of the
//! stream's stripe stream on connection i of its [`Group`] instead. The end
//! of the logical stream is the QUIC stream's FIN.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use quinn::VarInt;

use super::errors::conn_error;
use super::group::{CONTROL_TIMEOUT, Group, STRIPE_MIN_PAYLOAD};
use crate::{
    Connection, ConnectionInfo, Frame, FrameHeader, Incoming, Payload, Placement, Received, RecvStream, SendStream,
    StreamError, StreamKind, TransportConfig,
};

/// Largest header length the 24-bit field holds.
const MAX_META: u32 = (1 << 24) - 1;

/// A QUIC connection (with its stripes, if any); keeps a client's endpoints alive.
pub struct QuicConnection {
    conn: quinn::Connection,
    group: Arc<Group>,
    _endpoints: Vec<quinn::Endpoint>,
    peer: String,
    max_meta: u32,
    max_payload: u32,
}

impl QuicConnection {
    pub(crate) fn new(
        conn: quinn::Connection,
        group: Arc<Group>,
        endpoints: Vec<quinn::Endpoint>,
        config: &TransportConfig,
    ) -> Self {
        let peer = conn.remote_address().to_string();
        Self {
            conn,
            group,
            _endpoints: endpoints,
            peer,
            max_meta: config.max_header_bytes.min(MAX_META),
            max_payload: config.max_frame_payload,
        }
    }

    /// Connections carrying this one's streams: 1 + joined stripes.
    pub fn stripes(&self) -> usize {
        let mut v = Vec::new();
        self.group.live_stripes(&mut v);
        1 + v.len()
    }

    /// UDP payload bytes received on each connection of the group (primary
    /// first; 0 for a stripe not joined): shows how the load spread.
    pub fn bytes_received(&self) -> Vec<u64> {
        (0..self.group.size()).map(|i| self.group.conn(i as u8).map_or(0, |c| c.stats().udp_rx.bytes)).collect()
    }

    /// The two halves of a stream. `accepted`: the peer opened it (we
    /// answer on it), so finishing waits until the peer has the data.
    fn halves(
        &self,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
        accepted: bool,
    ) -> (Box<dyn SendStream>, Box<dyn RecvStream>) {
        let wire_id = u64::from(VarInt::from(send.id()));
        let id = send.id().index();
        (
            Box::new(QuicSend {
                inner: send,
                group: self.group.clone(),
                stripes: Vec::new(),
                live: Vec::new(),
                turn: 0,
                peer: self.peer.clone(),
                id,
                wire_id,
                wait_acked: accepted,
                ended: false,
            }),
            Box::new(QuicRecv {
                inner: recv,
                group: self.group.clone(),
                stripes: Vec::new(),
                peer: self.peer.clone(),
                id,
                wire_id,
                max_meta: self.max_meta,
                max_payload: self.max_payload,
                placement: None,
            }),
        )
    }
}

impl Drop for QuicConnection {
    fn drop(&mut self) {
        self.group.close("connection dropped");
    }
}

#[async_trait]
impl Connection for QuicConnection {
    async fn open(&self, _kind: StreamKind) -> Result<(Box<dyn SendStream>, Box<dyn RecvStream>), StreamError> {
        let (s, r) = self.conn.open_bi().await.map_err(|e| conn_error(&self.peer, &e))?;
        Ok(self.halves(s, r, false))
    }

    async fn accept(&self) -> Result<Incoming, StreamError> {
        let (s, r) = self.conn.accept_bi().await.map_err(|e| conn_error(&self.peer, &e))?;
        let (send, recv) = self.halves(s, r, true);
        Ok(Incoming { kind: None, send, recv, peer: None })
    }

    fn info(&self) -> ConnectionInfo {
        ConnectionInfo {
            transport: "quic",
            peer: self.peer.clone(),
            max_frame_payload: self.max_payload.into(),
            local: self.conn.remote_address().ip().is_loopback(),
            stateless: false,
        }
    }

    fn close(&self, reason: &str) {
        self.group.close(reason);
    }

    fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }

    async fn closed(&self) {
        self.conn.closed().await;
    }
}

struct QuicSend {
    inner: quinn::SendStream,
    group: Arc<Group>,
    /// Stripe streams opened so far, by stripe index (0 unused).
    stripes: Vec<Option<quinn::SendStream>>,
    /// Finishing waits until the peer acknowledged every byte (answers a
    /// server sends): a graceful shutdown that closes the connection after
    /// the call ends must not discard a reply still in flight, which QUIC,
    /// unlike TCP, would.
    wait_acked: bool,
    /// Set by `finish` (and `reset`): a stream dropped before is reset, not
    /// finished as quinn finishes a dropped stream, so the peer never takes
    /// a cancelled call's cut for a clean end of its inputs.
    ended: bool,
    /// Scratch: live stripe indices.
    live: Vec<u8>,
    turn: usize,
    peer: String,
    id: u64,
    wire_id: u64,
}

impl Drop for QuicSend {
    fn drop(&mut self) {
        if !self.ended {
            // The mux's code for a handle dropped before its stream ended.
            SendStream::reset(self, crate::mux::frame::code::CANCELLED);
        }
    }
}

fn write_error(peer: &str, id: u64, e: quinn::WriteError) -> StreamError {
    match e {
        quinn::WriteError::Stopped(code) => {
            StreamError::Stopped { peer: peer.into(), stream: id, code: code.into_inner() as u32 }
        }
        quinn::WriteError::ConnectionLost(c) => conn_error(peer, &c),
        quinn::WriteError::ClosedStream => StreamError::Finished { peer: peer.into(), stream: id },
        other => StreamError::Protocol { peer: peer.into(), reason: other.to_string() },
    }
}

fn head(f: &Frame, stripe: u8) -> Bytes {
    let meta_len = tensorwire_proto::header::encoded_len(&f.header);
    let mut head = BytesMut::with_capacity(8 + meta_len);
    head.put_u32_le((u32::from(stripe) << 24) | meta_len as u32);
    head.put_u32_le(f.payload.len() as u32);
    tensorwire_proto::header::encode(&f.header, &mut head);
    head.freeze()
}

impl QuicSend {
    /// The stripe (0: inline) for a payload of `len` bytes: large payloads
    /// go round-robin over the primary and the live stripes.
    fn pick(&mut self, len: usize) -> u8 {
        if len < STRIPE_MIN_PAYLOAD || self.group.size() < 2 {
            return 0;
        }
        let mut live = std::mem::take(&mut self.live);
        self.group.live_stripes(&mut live);
        let n = live.len() + 1;
        let turn = self.turn % n;
        self.turn = self.turn.wrapping_add(1);
        let s = if turn == 0 { 0 } else { live[turn - 1] };
        self.live = live;
        s
    }

    async fn stripe(&mut self, s: u8) -> Result<&mut quinn::SendStream, StreamError> {
        let i = usize::from(s);
        if self.stripes.len() <= i {
            self.stripes.resize_with(i + 1, || None);
        }
        if self.stripes[i].is_none() {
            let conn = self.group.conn(s).ok_or_else(|| StreamError::ConnectionClosed {
                peer: self.peer.clone(),
                reason: format!("stripe {s} is gone"),
            })?;
            let mut st = conn.open_uni().await.map_err(|e| conn_error(&self.peer, &e))?;
            st.write_chunk(Bytes::copy_from_slice(&self.wire_id.to_le_bytes()))
                .await
                .map_err(|e| write_error(&self.peer, self.id, e))?;
            self.stripes[i] = Some(st);
        }
        Ok(self.stripes[i].as_mut().expect("opened above"))
    }
}

#[async_trait]
impl SendStream for QuicSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        self.send_batch(vec![frame], false).await
    }

    async fn send_last(&mut self, frame: Frame) -> Result<(), StreamError> {
        self.send_batch(vec![frame], true).await
    }

    async fn send_batch(&mut self, frames: Vec<Frame>, fin: bool) -> Result<(), StreamError> {
        let mut chunks = Vec::with_capacity(frames.len() * 2);
        // The head carries the header's length in 24 bits and the
        // payload's in 32: a larger one would be misread by the peer.
        // Checked for the whole batch before any of it is written.
        for f in &frames {
            let meta_len = tensorwire_proto::header::encoded_len(&f.header);
            if meta_len > MAX_META as usize || u32::try_from(f.payload.len()).is_err() {
                return Err(StreamError::Protocol {
                    peer: self.peer.clone(),
                    reason: format!(
                        "a frame of {meta_len} header and {} payload bytes is too large for a QUIC frame head",
                        f.payload.len()
                    ),
                });
            }
        }
        for f in frames {
            let s = self.pick(f.payload.len());
            chunks.push(head(&f, s));
            if s == 0 {
                if !f.payload.is_empty() {
                    chunks.push(f.payload);
                }
                continue;
            }
            // The stripe's stream is opened before its first header goes
            // out, so a header on the primary always has its stream (see
            // `reset`). Headers stay in order on the primary; this payload
            // goes on stripe s.
            self.stripe(s).await?;
            self.inner.write_all_chunks(&mut chunks).await.map_err(|e| write_error(&self.peer, self.id, e))?;
            chunks.clear();
            let stripe = self.stripes[usize::from(s)].as_mut().expect("opened above");
            stripe.write_chunk(f.payload).await.map_err(|e| write_error(&self.peer, self.id, e))?;
        }
        self.inner.write_all_chunks(&mut chunks).await.map_err(|e| write_error(&self.peer, self.id, e))?;
        if fin {
            self.finish().await?;
        }
        Ok(())
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        // Finishing twice has nothing left to do.
        self.ended = true;
        let _ = self.inner.finish();
        for s in self.stripes.iter_mut().flatten() {
            let _ = s.finish();
        }
        if self.wait_acked {
            self.wait_acked = false;
            // Ok(None): all acknowledged; Some(code) or an error: the peer
            // stopped reading or the connection is gone, nothing to wait for.
            let _ = self.inner.stopped().await;
            for s in self.stripes.iter().flatten() {
                let _ = s.stopped().await;
            }
        }
        Ok(())
    }

    /// Resets the primary stream; the stripe streams are finished instead:
    /// a reset would discard what they have not sent yet, their opening
    /// bytes (the stream's id) too, and a receiver that already read a
    /// header naming the stripe would wait for a stream that never comes.
    /// Finished, they arrive cut short, and the receiver reports the
    /// primary's reset.
    fn reset(&mut self, code: u32) {
        self.ended = true;
        let _ = self.inner.reset(VarInt::from_u32(code));
        for s in self.stripes.iter_mut().flatten() {
            let _ = s.finish();
        }
    }

    fn id(&self) -> u64 {
        self.id
    }

    fn stop_signal(&self) -> Option<Arc<dyn crate::StopSignal>> {
        let (stopped, peer, id) = (self.inner.stopped(), self.peer.clone(), self.id);
        Some(Arc::new(QuicStop(std::sync::Mutex::new(Box::pin(async move {
            match stopped.await {
                Ok(Some(code)) => StreamError::Stopped {
                    peer,
                    stream: id,
                    code: u32::try_from(code.into_inner()).unwrap_or(u32::MAX),
                },
                // Read to its end: a finished stream has nothing to stop.
                Ok(None) => std::future::pending().await,
                Err(quinn::StoppedError::ConnectionLost(c)) => conn_error(&peer, &c),
                Err(e) => StreamError::Protocol { peer, reason: e.to_string() },
            }
        })))))
    }
}

/// quinn's `stopped` future behind [`crate::StopSignal`].
struct QuicStop(std::sync::Mutex<std::pin::Pin<Box<dyn std::future::Future<Output = StreamError> + Send>>>);

impl crate::StopSignal for QuicStop {
    fn poll_stopped(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<StreamError> {
        crate::sync::lock(&self.0).as_mut().poll(cx)
    }
}

struct QuicRecv {
    inner: quinn::RecvStream,
    group: Arc<Group>,
    /// Stripe streams received so far, by stripe index (0 unused).
    stripes: Vec<Option<quinn::RecvStream>>,
    peer: String,
    id: u64,
    wire_id: u64,
    max_meta: u32,
    max_payload: u32,
    placement: Option<Placement>,
}

impl Drop for QuicRecv {
    fn drop(&mut self) {
        if self.group.size() > 1 {
            self.group.forget(self.wire_id);
        }
    }
}

fn read_error(peer: &str, id: u64, e: quinn::ReadError) -> StreamError {
    match e {
        quinn::ReadError::Reset(code) => {
            StreamError::Reset { peer: peer.into(), stream: id, code: code.into_inner() as u32 }
        }
        quinn::ReadError::ConnectionLost(c) => conn_error(peer, &c),
        other => StreamError::Protocol { peer: peer.into(), reason: other.to_string() },
    }
}

fn exact_error(peer: &str, id: u64, e: quinn::ReadExactError, what: &str) -> StreamError {
    match e {
        quinn::ReadExactError::FinishedEarly(n) => {
            StreamError::Protocol { peer: peer.into(), reason: format!("stream ended {n} bytes into a {what}") }
        }
        quinn::ReadExactError::ReadError(e) => read_error(peer, id, e),
    }
}

/// Reads `len` bytes; often one chunk holds them all, and then with no copy.
async fn read_payload(r: &mut quinn::RecvStream, len: usize, peer: &str, id: u64) -> Result<Bytes, StreamError> {
    let mut out: Option<BytesMut> = None;
    let mut first: Option<Bytes> = None;
    let mut got = 0;
    while got < len {
        let chunk = r.read_chunk(len - got, true).await.map_err(|e| read_error(peer, id, e))?;
        let Some(chunk) = chunk else {
            return Err(StreamError::Protocol {
                peer: peer.into(),
                reason: format!("stream ended {got} bytes into a {len} byte payload"),
            });
        };
        got += chunk.bytes.len();
        match (&mut out, first.take()) {
            (None, None) if got == len => return Ok(chunk.bytes),
            (None, None) => first = Some(chunk.bytes),
            (None, Some(f)) => {
                let mut b = BytesMut::with_capacity(len);
                b.extend_from_slice(&f);
                b.extend_from_slice(&chunk.bytes);
                out = Some(b);
            }
            (Some(b), _) => b.extend_from_slice(&chunk.bytes),
        }
    }
    Ok(out.map(BytesMut::freeze).or(first).unwrap_or_default())
}

impl QuicRecv {
    /// `e` (a stripe stream that failed), or the reset of this stream that
    /// explains it: the primary is read (the stream is broken either way)
    /// until its reset arrives, for at most the stripes' control timeout.
    async fn reset_or(&mut self, e: StreamError) -> StreamError {
        if !matches!(e, StreamError::Protocol { .. }) {
            return e;
        }
        let reset = tokio::time::timeout(CONTROL_TIMEOUT, async {
            loop {
                match self.inner.read_chunk(usize::MAX, true).await {
                    Err(quinn::ReadError::Reset(code)) => return Some(code),
                    // More on the primary than a cut sender leaves: read on.
                    Ok(Some(_)) => continue,
                    _ => return None,
                }
            }
        });
        match reset.await {
            Ok(Some(code)) => {
                StreamError::Reset { peer: self.peer.clone(), stream: self.id, code: code.into_inner() as u32 }
            }
            _ => e,
        }
    }
}

/// The stream on which the payloads of stripe `s` (≥ 1) of the logical
/// stream `wire_id` arrive, waited for on first use.
async fn stripe_source<'a>(
    stripes: &'a mut Vec<Option<quinn::RecvStream>>,
    group: &Group,
    wire_id: u64,
    s: u8,
    peer: &str,
) -> Result<&'a mut quinn::RecvStream, StreamError> {
    let i = usize::from(s);
    // (Before the group's announcement arrives its size is unknown: `take`
    // waits for it, bounded.)
    if group.announced() && i >= group.size() {
        return Err(StreamError::Protocol {
            peer: peer.to_string(),
            reason: format!("a payload on stripe {s}, but the connection has {} stripes", group.size()),
        });
    }
    if stripes.len() <= i {
        stripes.resize_with(i + 1, || None);
    }
    if stripes[i].is_none() {
        stripes[i] = Some(group.take(wire_id, s, peer).await?);
    }
    Ok(stripes[i].as_mut().expect("taken above"))
}

/// Reads a frame's `len`-byte payload from `src`: into the placement
/// buffer at `place`, or as bytes.
async fn read_frame_payload(
    src: &mut quinn::RecvStream,
    place: Option<(Placement, u64)>,
    len: usize,
    peer: &str,
    id: u64,
) -> Result<Payload, StreamError> {
    Ok(match place {
        Some((p, off)) => {
            let mut g = p.lock().await;
            let dst = &mut g[off as usize..off as usize + len];
            src.read_exact(dst).await.map_err(|e| exact_error(peer, id, e, "payload"))?;
            Payload::Placed { offset: off, len }
        }
        None if len == 0 => Payload::Bytes(Bytes::new()),
        None => Payload::Bytes(read_payload(src, len, peer, id).await?),
    })
}

#[async_trait]
impl RecvStream for QuicRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        let (peer, id) = (self.peer.clone(), self.id);
        let mut h = [0u8; 8];
        match self.inner.read_exact(&mut h).await {
            Ok(()) => {}
            Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
            Err(e) => return Err(exact_error(&peer, id, e, "frame head")),
        }
        let first = u32::from_le_bytes(h[..4].try_into().expect("4"));
        let (stripe, meta_len) = ((first >> 24) as u8, first & MAX_META);
        let payload_len = u32::from_le_bytes(h[4..].try_into().expect("4"));
        if meta_len > self.max_meta || payload_len > self.max_payload {
            let (what, size, limit) = if meta_len > self.max_meta {
                ("frame header", meta_len, self.max_meta)
            } else {
                ("frame payload", payload_len, self.max_payload)
            };
            let _ = self.inner.stop(VarInt::from_u32(5));
            return Err(StreamError::LimitExceeded { peer, what, size: size.into(), limit: limit.into() });
        }
        let mut meta = vec![0u8; meta_len as usize];
        self.inner.read_exact(&mut meta).await.map_err(|e| exact_error(&peer, id, e, "frame header"))?;
        let header = FrameHeader::decode(&meta[..]).map_err(|e| StreamError::Protocol {
            peer: peer.clone(),
            reason: format!("undecodable frame header: {e}"),
        })?;
        let len = payload_len as usize;
        let place = match (&self.placement, header.placement_offset()) {
            (Some(p), Some((tid, off))) if p.accepts(tid, off, len) => Some((p.clone(), off)),
            _ => None,
        };
        let payload = if stripe == 0 {
            read_frame_payload(&mut self.inner, place, len, &peer, id).await?
        } else {
            let src = stripe_source(&mut self.stripes, &self.group, self.wire_id, stripe, &peer).await?;
            match read_frame_payload(src, place, len, &peer, id).await {
                Ok(p) => p,
                // A sender cut short finishes its stripe streams (so they
                // always arrive, see `QuicSend::reset`) and resets this one:
                // a stripe that ended early is explained by that reset.
                Err(e) => return Err(self.reset_or(e).await),
            }
        };
        Ok(Some(Received { header, payload }))
    }

    fn place(&mut self, target: Option<Placement>) {
        self.placement = target;
    }

    fn id(&self) -> u64 {
        self.id
    }
}
