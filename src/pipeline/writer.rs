//! `FrameWriter`: encodes, chunks, compresses and sends the tensors of one
//! stream, holding small frames back so a small call leaves in one write.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use tensorwire_codecs::checksum;
use tensorwire_codecs::compress::{Compressor, choose_auto};
use tensorwire_codecs::{CodecKind, Compression, CompressionMode, Device, Encoded, Tensor, TensorInfo};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{Frame, FrameHeader, SendStream};

use super::chunk::Chunker;
use super::link::{LinkEstimator, SharedCaps};
use super::storages::Share;
use super::wire::{compression_to_wire, info_to_wire};
use crate::config::{
    AUTO_COMPRESS_MIN_BYTES, AUTO_COMPRESS_SAMPLE_BYTES, Encoding, HOLD_FLUSH_BYTES, LINK_ESTIMATE_MIN_BYTES,
    MIN_COMPRESS_BYTES, UCX_CHUNK_BYTES, UCX_FIRST_CHUNK_BYTES,
};
use crate::error::CallError;

/// Sends frames and tensors on one stream.
pub(crate) struct FrameWriter {
    send: Box<dyn SendStream>,
    pub(crate) encoding: Encoding,
    caps: SharedCaps,
    max_frame_payload: u64,
    next_tensor_id: u64,
    compressor: Compressor,
    link: Option<Arc<LinkEstimator>>,
    /// Leave the link estimate to [`FrameWriter::record_call`] (send calls:
    /// the time until the server's reply is the link's, while a tensor that
    /// fits in the credit window leaves at memory speed).
    pub(crate) defer_link: bool,
    /// Bytes handed to the transport (after compression) and when the first was.
    wire_bytes: u64,
    first_sent: Option<Instant>,
    pub(crate) bytes_sent: u64,
    pub(crate) tensors_sent: u64,
    /// Payload bytes are added here as each chunk is handed to the
    /// transport, which takes no more than the stream's credit window ahead
    /// of what the peer has read (progress bars).
    pub(crate) progress: Option<Arc<AtomicU64>>,
    /// Small frames held back to go out together with the next ones (a
    /// small call is then one write on each side).
    pending: Vec<Frame>,
    pending_bytes: usize,
    /// Chunks carry a CRC-32C of their payload.
    chunk_checksums: bool,
    /// Chunks are at least this large (the transport's preference; 0: none).
    min_chunk: usize,
}

impl FrameWriter {
    pub(crate) fn new(
        send: Box<dyn SendStream>,
        encoding: Encoding,
        caps: SharedCaps,
        max_frame_payload: u64,
        link: Option<Arc<LinkEstimator>>,
    ) -> Self {
        Self {
            send,
            encoding,
            caps,
            max_frame_payload,
            next_tensor_id: 1,
            compressor: Compressor::new(),
            link,
            defer_link: false,
            wire_bytes: 0,
            first_sent: None,
            bytes_sent: 0,
            tensors_sent: 0,
            progress: None,
            pending: Vec::new(),
            pending_bytes: 0,
            chunk_checksums: false,
            min_chunk: 0,
        }
    }

    /// Adapts to the connection's `transport`: a CRC-32C with every chunk
    /// when the encoding asks for it there (see [`Encoding::chunk_checksums`]),
    /// the compression used there ([`Encoding::compression_on`]), and over
    /// `ucx://` chunks of at least [`UCX_CHUNK_BYTES`].
    pub(crate) fn for_transport(mut self, transport: &str) -> Self {
        self.chunk_checksums = self.encoding.chunk_checksums_on(transport);
        self.encoding.compression = self.encoding.compression_on(transport);
        if transport == "ucx" {
            self.min_chunk = UCX_CHUNK_BYTES;
        }
        self
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

    /// Resolves once the peer stops reading this stream or the connection
    /// fails, on transports that can tell (see
    /// [`SendStream::stop_signal`](tensorwire_transports::SendStream::stop_signal)).
    pub(crate) fn stop_signal(&self) -> Option<std::sync::Arc<dyn tensorwire_transports::StopSignal>> {
        self.send.stop_signal()
    }

    /// Sends what is held (and with `fin`, ends the stream).
    pub(crate) async fn flush(&mut self, fin: bool) -> Result<(), CallError> {
        let frames = std::mem::take(&mut self.pending);
        self.pending_bytes = 0;
        if frames.is_empty() {
            return if fin { Ok(self.send.finish().await?) } else { Ok(()) };
        }
        // Most flushes need no wait: then no boxed future is made.
        let frames = match self.send.try_send_batch(frames, fin) {
            Ok(sent) => return Ok(sent?),
            Err(frames) => frames,
        };
        Ok(self.send.send_batch(frames, fin).await?)
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
        self.caps.check_codec(codec_kind)?;
        let codec = tensorwire_codecs::codec(codec_kind).map_err(|e| CallError::Unsupported(e.to_string()))?;
        let encoded = codec.encode(t)?;
        self.send_encoded(encoded, codec_kind, t.dtype().itemsize(), 0, hold_last).await
    }

    /// Sends one tensor of a batch planned by `storages::plan`: plain
    /// tensors as [`FrameWriter::send_tensor`] does, the first view of a
    /// shared storage with the whole storage as its payload, later views
    /// with none (raw codec; `TensorInfo.storage_id` on the wire).
    pub(crate) async fn send_shared(&mut self, t: &Tensor, share: Share, hold_last: bool) -> Result<u64, CallError> {
        let (id, first) = match share {
            Share::Plain => return self.send_tensor(t, hold_last).await,
            Share::First(id) => (id, true),
            Share::Again(id) => (id, false),
        };
        self.caps.check_codec(CodecKind::Raw)?;
        let storage = t.host_storage().map_err(tensorwire_codecs::EncodeError::from)?;
        let item = t.dtype().itemsize();
        let mut info = TensorInfo::of(t);
        info.strides = Some(t.strides().to_vec());
        info.storage_offset = t.storage_offset();
        let segments = if first { vec![storage.slice(..storage.len() / item * item)] } else { vec![] };
        self.send_encoded(Encoded { info, segments }, CodecKind::Raw, item, id, hold_last).await
    }

    async fn send_encoded(
        &mut self,
        mut encoded: Encoded,
        codec_kind: CodecKind,
        itemsize: usize,
        storage_id: u64,
        hold_last: bool,
    ) -> Result<u64, CallError> {
        let total = encoded.len();
        self.caps.check_tensor_bytes(total)?;
        let mut info = info_to_wire(std::mem::take(&mut encoded.info), codec_kind);
        info.storage_id = storage_id;
        let crc = self.encoding.checksums.then(|| {
            let mut crc = checksum::Crc32c::new();
            encoded.segments.iter().for_each(|s| crc.update(s));
            crc.finish()
        });
        let (compression, shuffle) = self.choose_compression(&encoded.segments, itemsize);
        let chunk_size = self.chunk_size(compression == Compression::None);
        let id = self.next_tensor_id;
        self.next_tensor_id += 1;
        let mut chunker = Chunker::new(id, info, encoded, chunk_size);
        if self.min_chunk > 0 && compression == Compression::None {
            chunker = chunker.with_first_chunk(UCX_FIRST_CHUNK_BYTES);
        }
        if let Some(crc) = crc {
            chunker = chunker.with_crc32c(crc);
        }
        // The link estimate ignores transfers below LINK_ESTIMATE_MIN_BYTES:
        // a small tensor reads no clock (a deferred estimate times the call
        // from its first tensor).
        let timed = self.link.is_some()
            && if self.defer_link { self.first_sent.is_none() } else { total >= LINK_ESTIMATE_MIN_BYTES };
        let started = timed.then(Instant::now);
        let mut wire_bytes = 0u64;
        while let Some((mut c, mut payload)) = chunker.next_chunk() {
            if compression != Compression::None
                && payload.len() >= MIN_COMPRESS_BYTES
                && let Some(z) = self.compressor.compress(compression, shuffle, &payload)?
            {
                c.compression = compression_to_wire(compression) as i32;
                c.shuffle = shuffle;
                payload = Bytes::from(z);
            }
            if self.chunk_checksums {
                c.chunk_crc32c = Some(checksum::crc32c(&payload));
            }
            wire_bytes += payload.len() as u64;
            let raw_len = c.raw_len;
            let last = c.last;
            self.hold(Frame { header: FrameHeader::new(Kind::Chunk(c)), payload });
            if !(last && hold_last) || self.pending_bytes > HOLD_FLUSH_BYTES {
                self.flush(false).await?;
            }
            if let Some(p) = &self.progress {
                p.fetch_add(raw_len, Ordering::Relaxed);
            }
        }
        if self.first_sent.is_none() {
            self.first_sent = started;
        }
        self.wire_bytes += wire_bytes;
        if let (Some(link), Some(started)) = (&self.link, started)
            && !self.defer_link
        {
            link.record(wire_bytes, started.elapsed().as_secs_f64());
        }
        self.bytes_sent += total;
        self.tensors_sent += 1;
        Ok(total)
    }

    /// Records the whole call in the link estimate: the bytes it put on the
    /// wire over the time from the first of them until now (call it when
    /// the peer's reply has arrived).
    pub(crate) fn record_call(&self) {
        if let (Some(link), Some(t0)) = (&self.link, self.first_sent) {
            link.record(self.wire_bytes, t0.elapsed().as_secs_f64());
        }
    }

    /// Payload bytes per chunk: the configured chunk size, within the
    /// peer's largest frame (kept a multiple of 64). The transport's
    /// minimum (UCX's rendezvous chunks) applies to uncompressed tensors
    /// only: compressed chunks travel on the control stream, within its
    /// window.
    fn chunk_size(&self, uncompressed: bool) -> usize {
        let min = if uncompressed { self.min_chunk } else { 0 };
        let mut chunk_size = self.encoding.effective_chunk_size().max(min) as u64;
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
        self.caps.check_tensor_bytes(total)?;
        let chunk_size = self.chunk_size(true);
        let id = self.next_tensor_id;
        self.next_tensor_id += 1;
        let mut winfo = Some(Box::new(info_to_wire(info, CodecKind::Raw)));
        let checksums = self.chunk_checksums;
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
                chunk_crc32c: checksums.then(|| checksum::crc32c(&payload)),
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
                    p.fetch_add(n, Ordering::Relaxed);
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
                if c == Compression::None || !self.caps.accepts(c) {
                    return (Compression::None, 0);
                }
                if c == Compression::Planes {
                    // Planes carry the element size in the shuffle field.
                    let elem = if tensorwire_codecs::planes::supports(itemsize) { itemsize } else { 1 };
                    return (c, elem as u32);
                }
                (c, if self.encoding.shuffle && itemsize > 1 { itemsize as u32 } else { 0 })
            }
            CompressionMode::Auto => {
                if segments.iter().map(Bytes::len).sum::<usize>() < AUTO_COMPRESS_MIN_BYTES {
                    return (Compression::None, 0);
                }
                let Some(bw) = self.encoding.link_bandwidth.or_else(|| self.link.as_ref().and_then(|l| l.get())) else {
                    return (Compression::None, 0);
                };
                let Some(sample) = segments.iter().max_by_key(|s| s.len()) else { return (Compression::None, 0) };
                let sample = &sample[..sample.len().min(AUTO_COMPRESS_SAMPLE_BYTES)];
                let choice = choose_auto(&mut self.compressor, sample, itemsize, bw);
                if self.caps.accepts(choice.compression) {
                    (choice.compression, choice.shuffle)
                } else {
                    (Compression::None, 0)
                }
            }
        }
    }
}
