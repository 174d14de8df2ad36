//! Tensors over a transport stream: `FrameWriter` encodes, chunks and
//! compresses; `FrameReader` reassembles (into a [`Placement`] buffer when
//! the transport can write there directly), checks and decodes.
//! [`TensorStream`] and [`TensorSink`] are the handles users see.

use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use tensorwire_codecs::compress::{Compressor, Decompressor, choose_auto};
use tensorwire_codecs::{CodecKind, Compression, CompressionMode, Device, Tensor};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{Frame, FrameHeader, Payload, Placement, RecvStream, SendStream};

use crate::chunk::{ChunkError, Chunker, Reassembler, ReassemblyLimits};
use crate::config::{Encoding, Limits};
use crate::error::{CallError, Status};
use crate::wire::{codec_from_wire, codec_to_wire, compression_to_wire, info_from_wire, info_to_wire};

/// Estimates a connection's throughput from large transfers, for auto compression.
#[derive(Debug, Default)]
pub(crate) struct LinkEstimator {
    bytes_per_sec: Mutex<Option<f64>>,
}

impl LinkEstimator {
    /// Transfers shorter than this say little about the link.
    const MIN_BYTES: u64 = 16 << 20;

    pub(crate) fn record(&self, bytes: u64, secs: f64) {
        if bytes < Self::MIN_BYTES || secs <= 0.0 {
            return;
        }
        let rate = bytes as f64 / secs;
        let mut g = self.bytes_per_sec.lock().unwrap_or_else(|e| e.into_inner());
        *g = Some(match *g {
            Some(old) => 0.7 * old + 0.3 * rate,
            None => rate,
        });
    }

    pub(crate) fn get(&self) -> Option<f64> {
        *self.bytes_per_sec.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What the peer accepts, from the handshake (None: unknown, send what is
/// configured). Shared by every call of a connection.
pub(crate) type SharedCaps = std::sync::Arc<PeerCaps>;

/// See [`SharedCaps`].
#[derive(Debug, Clone, Default)]
pub(crate) struct PeerCaps {
    pub(crate) limits: Option<v1::Limits>,
    pub(crate) codecs: Option<Vec<i32>>,
    pub(crate) compressions: Option<Vec<i32>>,
}

/// Sends frames and tensors on one stream.
pub(crate) struct FrameWriter {
    send: Box<dyn SendStream>,
    pub(crate) encoding: Encoding,
    caps: SharedCaps,
    max_frame_payload: u64,
    next_tensor_id: u64,
    compressor: Compressor,
    link: Option<std::sync::Arc<LinkEstimator>>,
    pub(crate) bytes_sent: u64,
    pub(crate) tensors_sent: u64,
    pub(crate) progress: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    /// Small frames held back to go out together with the next ones (a
    /// small call is then one write on each side).
    pending: Vec<Frame>,
    pending_bytes: usize,
}

impl FrameWriter {
    pub(crate) fn new(
        send: Box<dyn SendStream>,
        encoding: Encoding,
        caps: SharedCaps,
        max_frame_payload: u64,
        link: Option<std::sync::Arc<LinkEstimator>>,
    ) -> Self {
        Self {
            send,
            encoding,
            caps,
            max_frame_payload,
            next_tensor_id: 1,
            compressor: Compressor::new(),
            link,
            bytes_sent: 0,
            tensors_sent: 0,
            progress: None,
            pending: Vec::new(),
            pending_bytes: 0,
        }
    }

    /// Queues a control frame; it leaves with the next frames sent.
    pub(crate) fn control(&mut self, kind: Kind) {
        self.hold(Frame::header_only(FrameHeader::new(kind)));
    }

    /// Sends a control frame (and anything held) and ends the stream.
    pub(crate) async fn control_last(&mut self, kind: Kind) -> Result<(), CallError> {
        self.hold(Frame::header_only(FrameHeader::new(kind)));
        self.flush(true).await
    }

    /// Abandons the stream: the peer sees a reset, never a clean end.
    pub(crate) fn reset(&mut self, code: u32) {
        self.pending.clear();
        self.pending_bytes = 0;
        self.send.reset(code);
    }

    /// Sends anything held and ends the stream.
    pub(crate) async fn finish(&mut self) -> Result<(), CallError> {
        self.flush(true).await
    }

    fn hold(&mut self, f: Frame) {
        self.pending_bytes += f.payload.len();
        self.pending.push(f);
    }

    /// Sends what is held (and with `fin`, ends the stream).
    pub(crate) async fn flush(&mut self, fin: bool) -> Result<(), CallError> {
        let frames = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        if frames.is_empty() {
            return if fin { Ok(self.send.finish().await?) } else { Ok(()) };
        }
        Ok(self.send.send_batch(frames, fin).await?)
    }

    fn check_codec(&self, codec: CodecKind) -> Result<(), CallError> {
        if let Some(accepted) = &self.caps.codecs
            && !accepted.is_empty()
            && !accepted.contains(&(codec_to_wire(codec) as i32))
        {
            return Err(CallError::Unsupported(format!("the peer does not accept the {codec} codec")));
        }
        Ok(())
    }

    fn peer_accepts(&self, c: Compression) -> bool {
        match &self.caps.compressions {
            Some(list) if !list.is_empty() => list.contains(&(compression_to_wire(c) as i32)),
            _ => c.is_available(),
        }
    }

    /// Encodes, chunks, compresses and sends one tensor; returns payload
    /// bytes sent. With `hold_last`, a small final chunk waits to leave with
    /// whatever is sent next (the caller sends or finishes right after).
    pub(crate) async fn send_tensor(&mut self, t: &Tensor, hold_last: bool) -> Result<u64, CallError> {
        if t.device() != Device::Cpu {
            return Err(CallError::Unsupported(format!(
                "a tensor on {} must be staged through host memory first (Client::send_gpu, cargo feature cuda)",
                t.device()
            )));
        }
        let codec_kind = self.encoding.codec;
        self.check_codec(codec_kind)?;
        let codec = tensorwire_codecs::codec(codec_kind).map_err(|e| CallError::Unsupported(e.to_string()))?;
        let encoded = codec.encode(t)?;
        let total = encoded.len();
        self.check_peer_limit(total)?;
        let info = info_to_wire(&encoded.info, codec_kind);
        let crc =
            self.encoding.checksums.then(|| encoded.segments.iter().fold(0u32, |c, s| crc32c::crc32c_append(c, s)));
        let itemsize = t.dtype().itemsize();
        let (compression, shuffle) = self.choose_compression(&encoded.segments, itemsize);
        let chunk_size = self.chunk_size();
        let id = self.next_tensor_id;
        self.next_tensor_id += 1;
        let mut chunker = Chunker::new(id, info, encoded, chunk_size);
        if let Some(crc) = crc {
            chunker = chunker.with_crc32c(crc);
        }
        let started = Instant::now();
        let mut wire_bytes = 0u64;
        while let Some((mut c, mut payload)) = chunker.next_chunk() {
            if compression != Compression::None
                && payload.len() >= 512
                && let Some(z) = self.compressor.compress(compression, shuffle, &payload)?
            {
                c.compression = compression_to_wire(compression) as i32;
                c.shuffle = shuffle;
                payload = Bytes::from(z);
            }
            wire_bytes += payload.len() as u64;
            let raw_len = c.raw_len;
            let last = c.last;
            self.hold(Frame { header: FrameHeader::new(Kind::Chunk(c)), payload });
            if !(last && hold_last) || self.pending_bytes > (64 << 10) {
                self.flush(false).await?;
            }
            if let Some(p) = &self.progress {
                p.fetch_add(raw_len, std::sync::atomic::Ordering::Relaxed);
            }
        }
        if let Some(link) = &self.link {
            link.record(wire_bytes, started.elapsed().as_secs_f64());
        }
        self.bytes_sent += total;
        self.tensors_sent += 1;
        Ok(total)
    }

    /// Fails when a tensor of `total` bytes exceeds the peer's announced limit.
    fn check_peer_limit(&self, total: u64) -> Result<(), CallError> {
        match &self.caps.limits {
            Some(l) if l.max_tensor_bytes > 0 && total > l.max_tensor_bytes => Err(CallError::Limit {
                what: "tensor (the peer's max_tensor_bytes)",
                size: total,
                limit: l.max_tensor_bytes,
            }),
            _ => Ok(()),
        }
    }

    /// Payload bytes per chunk: the configured chunk size, within the
    /// peer's largest frame (kept a multiple of 64).
    fn chunk_size(&self) -> usize {
        let mut chunk_size = self.encoding.effective_chunk_size() as u64;
        if self.max_frame_payload > 0 {
            chunk_size = chunk_size.min(self.max_frame_payload / 64 * 64);
        }
        chunk_size.max(1) as usize
    }

    /// Sends a raw-codec tensor of `total` bytes whose payload arrives in
    /// pieces (GPU staging buffers): each piece leaves as soon as it
    /// arrives, so producing piece k+1 overlaps sending piece k.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) async fn send_streamed(
        &mut self,
        info: tensorwire_codecs::TensorInfo,
        total: u64,
        pieces: &mut tokio::sync::mpsc::Receiver<Result<Bytes, CallError>>,
    ) -> Result<u64, CallError> {
        self.check_peer_limit(total)?;
        let chunk_size = self.chunk_size();
        let id = self.next_tensor_id;
        self.next_tensor_id += 1;
        let mut winfo = Some(Box::new(info_to_wire(&info, CodecKind::Raw)));
        let (mut offset, mut index) = (0u64, 0u32);
        let mut emit = |w: &mut Self, payload: Bytes, offset: u64, index: u32| {
            let last = offset + payload.len() as u64 >= total;
            let c = v1::Chunk {
                tensor_id: id,
                index,
                offset,
                total_bytes: total,
                last,
                compression: v1::Compression::None as i32,
                raw_len: payload.len() as u64,
                info: winfo.take(),
                ..Default::default()
            };
            w.hold(Frame { header: FrameHeader::new(Kind::Chunk(c)), payload });
        };
        if total == 0 {
            emit(self, Bytes::new(), 0, 0);
            self.flush(false).await?;
        }
        while offset < total {
            let mut piece = match pieces.recv().await {
                Some(p) => p?,
                None => {
                    return Err(CallError::InvalidArgument(format!(
                        "the tensor's source ended after {offset} of {total} bytes"
                    )));
                }
            };
            if offset + piece.len() as u64 > total {
                return Err(CallError::InvalidArgument(format!("the tensor's source gave more than {total} bytes")));
            }
            while !piece.is_empty() {
                let part = piece.split_to(piece.len().min(chunk_size));
                let n = part.len() as u64;
                emit(self, part, offset, index);
                self.flush(false).await?;
                offset += n;
                index += 1;
                if let Some(p) = &self.progress {
                    p.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        self.bytes_sent += total;
        self.tensors_sent += 1;
        Ok(total)
    }

    fn choose_compression(&mut self, segments: &[Bytes], itemsize: usize) -> (Compression, u32) {
        match self.encoding.compression {
            CompressionMode::Fixed(c) => {
                if c == Compression::None || !self.peer_accepts(c) {
                    return (Compression::None, 0);
                }
                (c, if self.encoding.shuffle && itemsize > 1 { itemsize as u32 } else { 0 })
            }
            CompressionMode::Auto => {
                // Below this, compressing cannot save enough time to pay for
                // trying (sampling costs tens of microseconds).
                const AUTO_MIN: usize = 256 << 10;
                if segments.iter().map(Bytes::len).sum::<usize>() < AUTO_MIN {
                    return (Compression::None, 0);
                }
                let Some(bw) = self.encoding.link_bandwidth.or_else(|| self.link.as_ref().and_then(|l| l.get())) else {
                    return (Compression::None, 0);
                };
                let Some(sample) = segments.iter().max_by_key(|s| s.len()) else { return (Compression::None, 0) };
                let sample = &sample[..sample.len().min(256 << 10)];
                let choice = choose_auto(&mut self.compressor, sample, itemsize, bw);
                if self.peer_accepts(choice.compression) {
                    (choice.compression, choice.shuffle)
                } else {
                    (Compression::None, 0)
                }
            }
        }
    }
}

/// One thing read from a stream.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Item {
    Tensor(Tensor),
    Control(FrameHeader),
    End,
}

/// Reads frames and tensors from one stream.
pub(crate) struct FrameReader {
    recv: Box<dyn RecvStream>,
    pub(crate) peer: String,
    reasm: Reassembler,
    dec: Decompressor,
    limits: Limits,
    placement: bool,
    pub(crate) tensors: u64,
    pub(crate) bytes: u64,
    pub(crate) progress: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

impl FrameReader {
    pub(crate) fn new(recv: Box<dyn RecvStream>, peer: String, limits: Limits, placement: bool) -> Self {
        Self {
            recv,
            peer,
            reasm: Reassembler::new(ReassemblyLimits { max_tensor_bytes: limits.max_tensor_bytes }),
            dec: Decompressor::new(),
            limits,
            placement,
            tensors: 0,
            bytes: 0,
            progress: None,
        }
    }

    pub(crate) fn protocol(&self, reason: impl Into<String>) -> CallError {
        CallError::Protocol { peer: self.peer.clone(), reason: reason.into() }
    }

    fn chunk_error(&self, e: ChunkError) -> CallError {
        match e {
            ChunkError::TooLarge { size, limit, .. } => {
                CallError::Limit { what: "tensor payload (max_tensor_bytes)", size, limit }
            }
            other => self.protocol(other.to_string()),
        }
    }

    pub(crate) async fn next(&mut self) -> Result<Item, CallError> {
        let Some(r) = self.recv.recv().await? else { return Ok(Item::End) };
        match r.header.kind {
            Some(Kind::Chunk(c)) => {
                let Payload::Bytes(p) = r.payload else {
                    return Err(self.protocol("a tensor's first chunk was placed without a placement buffer"));
                };
                self.read_tensor(c, p).await.map(Item::Tensor)
            }
            Some(_) => Ok(Item::Control(r.header)),
            None => Err(self.protocol("frame without a header kind")),
        }
    }

    async fn read_tensor(&mut self, first: v1::Chunk, p0: Bytes) -> Result<Tensor, CallError> {
        if self.tensors >= u64::from(self.limits.max_tensors_per_call) {
            return Err(CallError::Limit {
                what: "tensors in one call (max_tensors_per_call)",
                size: self.tensors + 1,
                limit: self.limits.max_tensors_per_call.into(),
            });
        }
        let plan = self.reasm.plan(&first, p0.len()).map_err(|e| self.chunk_error(e))?;
        if plan.last && plan.compression == Compression::None {
            // One uncompressed chunk: the payload is the tensor, no copy.
            return self.finish_tensor(p0);
        }
        // Allocated once from the declared total, which `plan` checked against the limit.
        let mut buf = vec![0u8; plan.total];
        plan.write(&p0, &mut buf, &mut self.dec).map_err(|e| self.chunk_error(e))?;
        let mut last = plan.last;
        let placement = (!last && self.placement).then(|| {
            let p = Placement::new(std::mem::take(&mut buf), first.tensor_id);
            self.recv.place(Some(p.clone()));
            p
        });
        let result = self.read_rest(&mut buf, placement.as_ref(), &mut last).await;
        if let Some(p) = placement {
            self.recv.place(None);
            buf = p.into_inner().await;
        }
        result?;
        self.finish_tensor(Bytes::from(buf))
    }

    /// Checks the checksum and decodes a complete payload.
    fn finish_tensor(&mut self, payload: Bytes) -> Result<Tensor, CallError> {
        let (info, crc) = self.reasm.finished().ok_or_else(|| self.protocol("tensor ended early"))?;
        if let Some(expected) = crc {
            let actual = crc32c::crc32c(&payload);
            if actual != expected {
                return Err(CallError::Decode(tensorwire_codecs::DecodeError::Checksum {
                    what: "tensor payload",
                    expected,
                    actual,
                }));
            }
        }
        if let Err(e) = codec_from_wire(info.codec) {
            return Err(CallError::Decode(tensorwire_codecs::DecodeError::UnknownCodec(e)));
        }
        let (tinfo, codec_kind) = info_from_wire(&info).map_err(|e| self.protocol(e))?;
        let codec = tensorwire_codecs::codec(codec_kind)?;
        let n = payload.len() as u64;
        let t = codec.decode(&tinfo, payload, &self.limits.decode_limits())?;
        self.tensors += 1;
        self.bytes += n;
        if let Some(p) = &self.progress {
            p.fetch_add(n.min(1 << 20), std::sync::atomic::Ordering::Relaxed);
        }
        Ok(t)
    }

    async fn read_rest(
        &mut self,
        buf: &mut [u8],
        placement: Option<&Placement>,
        last: &mut bool,
    ) -> Result<(), CallError> {
        while !*last {
            let Some(r) = self.recv.recv().await? else {
                return Err(self.protocol("the stream ended in the middle of a tensor"));
            };
            let Some(Kind::Chunk(c)) = r.header.kind else {
                return Err(self.protocol(format!("expected the next chunk, got a {} frame", r.header.kind_name())));
            };
            let plan = self.reasm.plan(&c, r.payload.len()).map_err(|e| self.chunk_error(e))?;
            match r.payload {
                Payload::Bytes(b) => match placement {
                    Some(p) => {
                        let mut g = p.lock().await;
                        plan.write(&b, &mut g, &mut self.dec).map_err(|e| self.chunk_error(e))?;
                    }
                    None => plan.write(&b, buf, &mut self.dec).map_err(|e| self.chunk_error(e))?,
                },
                Payload::Placed { offset, len } => {
                    if offset as usize != plan.offset || len != plan.raw_len || plan.compression != Compression::None {
                        return Err(self.protocol("a placed chunk does not match its header"));
                    }
                }
            }
            *last = plan.last;
            if let Some(p) = &self.progress {
                p.fetch_add(plan.raw_len as u64, std::sync::atomic::Ordering::Relaxed);
            }
        }
        Ok(())
    }
}

/// Tensors arriving on a call: a server handler's inputs, or a client's
/// fetch/exchange outputs.
pub struct TensorStream {
    reader: FrameReader,
    client_side: bool,
    done: bool,
    reply: Option<v1::Reply>,
    pending: Option<Tensor>,
    sender: Option<tokio::task::JoinHandle<Result<(), CallError>>>,
}

impl TensorStream {
    pub(crate) fn new(reader: FrameReader, client_side: bool) -> Self {
        Self { reader, client_side, done: false, reply: None, pending: None, sender: None }
    }

    pub(crate) fn reader_mut(&mut self) -> &mut FrameReader {
        &mut self.reader
    }

    /// Makes `t` the next tensor returned.
    pub(crate) fn push_front(&mut self, t: Tensor) {
        self.pending = Some(t);
    }

    /// Ties the task sending this call's inputs to the stream: its error
    /// is reported once the outputs end (exchange).
    pub(crate) fn with_sender(mut self, h: tokio::task::JoinHandle<Result<(), CallError>>) -> Self {
        self.sender = Some(h);
        self
    }

    /// The next tensor, or None at the end of the stream.
    pub async fn next(&mut self) -> Option<Result<Tensor, CallError>> {
        if let Some(t) = self.pending.take() {
            return Some(Ok(t));
        }
        if self.done {
            return None;
        }
        let mut r = self.step().await;
        if !matches!(r, Some(Ok(_))) {
            self.done = true;
            if let Some(h) = self.sender.take() {
                // A failed send explains a missing reply better than the reply does.
                match h.await {
                    Ok(Err(e)) if !matches!(r, Some(Err(CallError::Remote(_)))) => r = Some(Err(e)),
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    _ => {}
                }
            }
        }
        r
    }

    async fn step(&mut self) -> Option<Result<Tensor, CallError>> {
        match self.reader.next().await {
            Ok(Item::Tensor(t)) => Some(Ok(t)),
            Ok(Item::End) if self.client_side && self.reply.is_none() => {
                Some(Err(self.reader.protocol("the server ended the call without a reply")))
            }
            Ok(Item::End) => None,
            Ok(Item::Control(h)) => match h.kind {
                Some(Kind::Error(e)) => Some(Err(CallError::Remote(Status::from_wire(&e)))),
                Some(Kind::Reply(r)) if self.client_side => {
                    self.reply = Some(*r);
                    match self.reader.next().await {
                        Ok(Item::End) => None,
                        Ok(_) => Some(Err(self.reader.protocol("frames after the reply"))),
                        Err(e) => Some(Err(e)),
                    }
                }
                _ => Some(Err(self.reader.protocol(format!("unexpected {} frame among tensors", h.kind_name())))),
            },
            Err(e) => Some(Err(e)),
        }
    }

    /// Reads every remaining tensor.
    pub async fn collect_all(mut self) -> Result<Vec<Tensor>, CallError> {
        let mut out = Vec::new();
        while let Some(t) = self.next().await {
            out.push(t?);
        }
        Ok(out)
    }

    /// The server's closing reply, once the stream has ended (client side).
    pub fn reply(&self) -> Option<&v1::Reply> {
        self.reply.as_ref()
    }

    /// Tensors and payload bytes read so far.
    pub fn received(&self) -> (u64, u64) {
        (self.reader.tensors, self.reader.bytes)
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.reader.peer
    }
}

/// Where a server handler writes the tensors it returns.
pub struct TensorSink<'a> {
    pub(crate) writer: &'a mut FrameWriter,
}

impl TensorSink<'_> {
    /// Sends one tensor to the caller (waits while the caller is slow to read).
    pub async fn send(&mut self, tensor: Tensor) -> Result<(), Status> {
        self.writer.send_tensor(&tensor, false).await.map(|_| ()).map_err(Status::from)
    }

    /// Tensors and payload bytes sent so far.
    pub fn sent(&self) -> (u64, u64) {
        (self.writer.tensors_sent, self.writer.bytes_sent)
    }

    /// The codec tensors are sent with.
    pub fn codec(&self) -> CodecKind {
        self.writer.encoding.codec
    }
}

/// Codec and compression a request asks for, applied to an encoding.
pub(crate) fn apply_response_encoding(mut enc: Encoding, req: &v1::Request) -> Encoding {
    if req.response_codec != 0
        && let Ok(c) = codec_from_wire(req.response_codec)
    {
        enc.codec = c;
    }
    if req.response_compression != 0
        && let Ok(c) = crate::wire::compression_from_wire(req.response_compression)
    {
        enc.compression = CompressionMode::Fixed(c);
        enc.shuffle = req.response_shuffle > 1;
    }
    enc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipe::pipe;
    use tensorwire_codecs::DType;

    /// A tensor whose payload arrives in uneven pieces (as from GPU staging
    /// buffers) is chunked as it comes and reassembled bit-exact.
    #[tokio::test]
    async fn streamed_payload_pieces_reassemble() {
        for total in [0usize, 1, 100_000, (3 << 20) + 7] {
            let t = crate::builtins::random_tensor(DType::UInt8, &[total], 5).unwrap();
            let (tx, rx) = pipe(1, "test");
            let enc = Encoding { chunk_size: 1 << 20, ..Default::default() };
            let mut w = FrameWriter::new(Box::new(tx), enc, SharedCaps::default(), 1 << 20, None);
            let (ptx, mut prx) = tokio::sync::mpsc::channel(2);
            let data = Bytes::copy_from_slice(t.as_bytes().unwrap());
            let feeder = tokio::spawn(async move {
                let mut off = 0;
                let mut step = 1;
                while off < data.len() {
                    let end = (off + step).min(data.len());
                    ptx.send(Ok(data.slice(off..end))).await.unwrap();
                    off = end;
                    step = step * 7 + 13;
                }
            });
            let info = tensorwire_codecs::TensorInfo::of(&t);
            let reader = tokio::spawn(async move {
                let mut r = FrameReader::new(Box::new(rx), "test".into(), Limits::default(), false);
                match r.next().await.unwrap() {
                    Item::Tensor(t) => t,
                    _ => panic!("expected a tensor"),
                }
            });
            assert_eq!(w.send_streamed(info, total as u64, &mut prx).await.unwrap(), total as u64);
            w.finish().await.unwrap();
            feeder.await.unwrap();
            let back = reader.await.unwrap();
            assert!(back.data_eq(&t), "{total} bytes");
        }
    }

    #[tokio::test]
    async fn a_streamed_source_that_ends_early_is_an_error() {
        let (tx, _rx) = pipe(1, "test");
        let mut w = FrameWriter::new(Box::new(tx), Encoding::default(), SharedCaps::default(), 1 << 20, None);
        let (ptx, mut prx) = tokio::sync::mpsc::channel(2);
        ptx.send(Ok(Bytes::from_static(b"abc"))).await.unwrap();
        drop(ptx);
        let t = crate::builtins::random_tensor(DType::UInt8, &[10], 1).unwrap();
        let e = w.send_streamed(tensorwire_codecs::TensorInfo::of(&t), 10, &mut prx).await.unwrap_err();
        assert!(e.to_string().contains("ended after 3 of 10 bytes"), "{e}");
    }
}
