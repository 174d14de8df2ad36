//! `FrameReader`: reads the frames of one stream and reassembles tensors
//! (into a [`Placement`] buffer when the transport can write there
//! directly), checks their checksums and decodes them.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tensorwire_codecs::checksum;
use tensorwire_codecs::tensor::aligned;
use tensorwire_codecs::{CodecKind, DType, DecodeError, Storage, Tensor, TensorInfo};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{FrameHeader, Payload, Placement, Received, RecvStream, StreamError};

use super::chunk::{Assembly, ChunkError, Piece, ReassemblyLimits, Step};
use super::pool::RecvPool;
use super::wire::{codec_from_wire, info_from_wire};
use crate::config::Limits;
use crate::error::CallError;

/// One thing read from a stream.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Item {
    Tensor(Tensor),
    Control(FrameHeader),
    End,
}

/// One thing read from a stream by [`FrameReader::next_into`] (or by
/// another reader that puts tensors somewhere of the caller's).
pub(crate) enum IntoItem<T = TensorInfo> {
    /// A tensor, now in the caller's buffer: its header (or what the
    /// reader made of it).
    Tensor(T),
    Control(FrameHeader),
    End,
}

/// What [`FrameReader::start_pieces`] read.
#[allow(clippy::large_enum_variant)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU receive path
pub(crate) enum Pieces {
    /// A tensor arriving as its plain bytes, handed on piece by piece:
    /// its header, dtype and size, and its first piece.
    Stream {
        info: TensorInfo,
        dtype: DType,
        nbytes: u64,
        first: Piece,
    },
    /// A tensor that does not arrive as plain bytes, read whole.
    Whole(Tensor),
    Control(FrameHeader),
    End,
}

/// Reads frames and tensors from one stream: the async driver of the
/// sans-IO [`Assembly`].
pub(crate) struct FrameReader {
    recv: Box<dyn RecvStream>,
    pub(crate) peer: Arc<str>,
    asm: Assembly,
    limits: Limits,
    placement: bool,
    pub(crate) tensors: u64,
    pub(crate) bytes: u64,
    /// Payload bytes received so far are added here chunk by chunk (progress bars).
    pub(crate) progress: Option<Arc<AtomicU64>>,
    /// Storages shared by tensors of this stream (`TensorInfo.storage_id`),
    /// and their bytes in all (at most `max_tensor_bytes`).
    storages: HashMap<u64, Bytes>,
    kept: u64,
    /// The storage id of the tensor read last (0: none).
    pub(crate) last_storage: u64,
}

impl FrameReader {
    pub(crate) fn new(recv: Box<dyn RecvStream>, peer: Arc<str>, limits: Limits, placement: bool) -> Self {
        let asm = Assembly::new(ReassemblyLimits { max_tensor_bytes: limits.max_tensor_bytes }, None);
        Self::with_assembly(recv, peer, limits, placement, asm)
    }

    /// A reader that takes large tensors' buffers from `pool` (reserved
    /// from its budget; smaller ones are reserved from it too). Made in
    /// place: a reader is ~0.5 KB, built for every call.
    pub(crate) fn pooled(
        recv: Box<dyn RecvStream>,
        peer: Arc<str>,
        limits: Limits,
        placement: bool,
        pool: RecvPool,
    ) -> Self {
        let asm = Assembly::with_pool(ReassemblyLimits { max_tensor_bytes: limits.max_tensor_bytes }, pool);
        Self::with_assembly(recv, peer, limits, placement, asm)
    }

    fn with_assembly(
        recv: Box<dyn RecvStream>,
        peer: Arc<str>,
        limits: Limits,
        placement: bool,
        asm: Assembly,
    ) -> Self {
        Self {
            recv,
            peer,
            asm,
            limits,
            placement,
            tensors: 0,
            bytes: 0,
            progress: None,
            storages: HashMap::new(),
            kept: 0,
            last_storage: 0,
        }
    }

    fn count_progress(&self, n: u64) {
        if let Some(p) = &self.progress {
            p.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn protocol(&self, reason: impl Into<String>) -> CallError {
        CallError::Protocol { peer: self.peer.to_string(), reason: reason.into() }
    }

    fn chunk_error(&self, e: ChunkError) -> CallError {
        match e {
            ChunkError::TooLarge { size, limit, .. } => {
                CallError::Limit { what: "tensor payload (max_tensor_bytes)", size, limit }
            }
            e @ (ChunkError::OverBudget(_) | ChunkError::OutOfMemory { .. }) => CallError::OutOfMemory(e.to_string()),
            ChunkError::Checksum { expected, actual, .. } => {
                CallError::Decode(tensorwire_codecs::DecodeError::Checksum { what: "chunk payload", expected, actual })
            }
            other => self.protocol(other.to_string()),
        }
    }

    /// The stream's next frame: taken at once when the transport already
    /// holds it, else awaited.
    async fn recv_frame(&mut self) -> Result<Option<Received>, StreamError> {
        match self.recv.try_recv() {
            Some(r) => r,
            None => self.recv.recv().await,
        }
    }

    pub(crate) async fn next(&mut self) -> Result<Item, CallError> {
        let Some(r) = self.recv_frame().await? else { return Ok(Item::End) };
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

    /// Refuses one tensor more than `max_tensors_per_call`.
    fn check_count(&self) -> Result<(), CallError> {
        if self.tensors >= u64::from(self.limits.max_tensors_per_call) {
            return Err(CallError::Limit {
                what: "tensors in one call (max_tensors_per_call)",
                size: self.tensors + 1,
                limit: self.limits.max_tensors_per_call.into(),
            });
        }
        Ok(())
    }

    /// The tensor whose first chunk is `first`. A tensor in one chunk
    /// (every small call's) is done at once; the rest of a larger one is
    /// read by a boxed future, which then does not set the size of every
    /// caller's.
    async fn read_tensor(&mut self, first: v1::Chunk, p0: Bytes) -> Result<Tensor, CallError> {
        let tensor_id = first.tensor_id;
        match self.first_chunk(first, p0)? {
            Some(t) => Ok(t),
            None => Box::pin(self.read_rest(tensor_id)).await,
        }
    }

    /// Feeds a tensor's first chunk: the tensor when it was its only one,
    /// None when more follow ([`Self::read_rest`]).
    fn first_chunk(&mut self, mut first: v1::Chunk, p0: Bytes) -> Result<Option<Tensor>, CallError> {
        self.check_count()?;
        let step = self.asm.push(&mut first, p0).map_err(|e| self.chunk_error(e))?;
        self.count_progress(first.raw_len);
        match step {
            Step::Done(payload) => self.finish_tensor(payload).map(Some),
            _ => Ok(None),
        }
    }

    /// Reads the chunks after the first of tensor `tensor_id`.
    async fn read_rest(&mut self, tensor_id: u64) -> Result<Tensor, CallError> {
        if !self.placement {
            loop {
                let (mut c, payload) = self.next_chunk().await?;
                let Payload::Bytes(b) = payload else {
                    return Err(self.protocol("a chunk was placed without a placement buffer"));
                };
                let step = self.asm.push(&mut c, b).map_err(|e| self.chunk_error(e))?;
                self.count_progress(c.raw_len);
                if let Step::Done(payload) = step {
                    return self.finish_tensor(payload);
                }
            }
        }
        // The transport writes the rest of the chunks straight into the buffer.
        let placement = Placement::new(self.asm.lend(), tensor_id);
        self.recv.place(Some(placement.clone()));
        let result = self.read_placed(&placement).await;
        self.recv.place(None);
        let buf = placement.into_inner().await;
        if let Err(e) = result {
            self.asm.abandon(buf);
            return Err(e);
        }
        let payload = self.asm.finish_lent(buf);
        self.finish_tensor(payload)
    }

    /// Reads the next item of the stream; a tensor is written straight into
    /// `dst` (caller memory), chunk by chunk, after its header was checked:
    /// raw codec, contiguous, of dtype `want` (when given) and exactly
    /// `dst.len()` bytes. A tensor that does not match is refused with
    /// [`CallError::InvalidArgument`] before any byte is written, and no
    /// chunk is ever written past `dst`.
    pub(crate) async fn next_into(&mut self, dst: &mut [u8], want: Option<DType>) -> Result<IntoItem, CallError> {
        let Some(r) = self.recv_frame().await? else { return Ok(IntoItem::End) };
        let c = match r.header.kind {
            Some(Kind::Chunk(c)) => c,
            Some(_) => return Ok(IntoItem::Control(r.header)),
            None => return Err(self.protocol("frame without a header kind")),
        };
        self.check_count()?;
        let refuse = |why: String| CallError::InvalidArgument(format!("cannot receive into the given buffer: {why}"));
        let (info, dtype) = self.plain(&c)?.map_err(refuse)?;
        if want.is_some_and(|w| w != dtype) {
            return Err(refuse(format!(
                "the tensor is {dtype}, the buffer holds {}",
                want.map(|w| w.to_string()).unwrap_or_default()
            )));
        }
        let nbytes = tensorwire_codecs::limits::check_shape(dtype, &info.shape, &self.limits.decode_limits())?;
        if nbytes != dst.len() as u64 || c.total_bytes != nbytes {
            return Err(refuse(format!(
                "the tensor (shape {:?}, {dtype}) has {nbytes} bytes, the buffer {}",
                info.shape,
                dst.len()
            )));
        }
        let mut c = c;
        let mut payload = match r.payload {
            Payload::Bytes(b) => b,
            Payload::Placed { .. } => return Err(self.protocol("a chunk was placed without a placement buffer")),
        };
        loop {
            let last = self.asm.push_to(&mut c, &payload, dst).map_err(|e| self.chunk_error(e))?;
            self.count_progress(c.raw_len);
            if last {
                break;
            }
            let (next, p) = self.next_chunk().await?;
            let Payload::Bytes(b) = p else {
                return Err(self.protocol("a chunk was placed without a placement buffer"));
            };
            (c, payload) = (next, b);
        }
        let (_, crc) = self.asm.finished().ok_or_else(|| self.protocol("tensor ended early"))?;
        if let Some(expected) = crc {
            let actual = checksum::crc32c(dst);
            if actual != expected {
                return Err(CallError::Decode(DecodeError::Checksum { what: "tensor payload", expected, actual }));
            }
        }
        self.tensors += 1;
        self.bytes += nbytes;
        Ok(IntoItem::Tensor(info))
    }

    /// The header of a tensor whose first chunk is `c`, when its payload is
    /// the tensor's plain bytes (raw codec, contiguous, its own storage):
    /// `Ok(Err(why))` when it is not; `Err` when the header is malformed.
    fn plain(&self, c: &v1::Chunk) -> Result<Result<(TensorInfo, DType), String>, CallError> {
        let wire = c.info.as_deref().ok_or_else(|| self.protocol("a tensor's first chunk has no tensor info"))?;
        let (info, codec) = info_from_wire(wire.clone()).map_err(|e| self.protocol(e))?;
        if wire.storage_id != 0 {
            return Ok(Err("the tensor arrives as a view of a shared storage, not as plain bytes".into()));
        }
        if codec != CodecKind::Raw {
            return Ok(Err(format!("the tensor arrives in the {codec} codec, not as plain bytes (raw codec)")));
        }
        let dtype = info.dtype.ok_or_else(|| self.protocol("a raw tensor without a dtype"))?;
        if info.strides.as_ref().is_some_and(|s| !tensorwire_codecs::tensor::is_row_major(&info.shape, s)) {
            return Ok(Err("the tensor arrives strided (a view), not contiguous".into()));
        }
        Ok(Ok((info, dtype)))
    }

    /// Starts reading the next item of the stream; a tensor whose payload
    /// is its plain bytes (see [`FrameReader::plain`]) is handed on piece by
    /// piece as its chunks arrive (the first here, the rest from
    /// [`FrameReader::next_piece`], then [`FrameReader::finish_pieces`]),
    /// any other tensor is read whole.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU receive path
    pub(crate) async fn start_pieces(&mut self) -> Result<Pieces, CallError> {
        let Some(r) = self.recv_frame().await? else { return Ok(Pieces::End) };
        let c = match r.header.kind {
            Some(Kind::Chunk(c)) => c,
            Some(_) => return Ok(Pieces::Control(r.header)),
            None => return Err(self.protocol("frame without a header kind")),
        };
        let Payload::Bytes(p) = r.payload else {
            return Err(self.protocol("a tensor's first chunk was placed without a placement buffer"));
        };
        let Ok((info, dtype)) = self.plain(&c)? else {
            return self.read_tensor(c, p).await.map(Pieces::Whole);
        };
        self.check_count()?;
        let nbytes = tensorwire_codecs::limits::check_shape(dtype, &info.shape, &self.limits.decode_limits())?;
        if c.total_bytes != nbytes {
            return Err(self.protocol(format!(
                "a tensor of shape {:?} ({dtype}, {nbytes} bytes) declares {} bytes of payload",
                info.shape, c.total_bytes
            )));
        }
        let first = self.piece(c, p)?;
        Ok(Pieces::Stream { info, dtype, nbytes, first })
    }

    /// The next piece of the tensor [`FrameReader::start_pieces`] started.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU receive path
    pub(crate) async fn next_piece(&mut self) -> Result<Piece, CallError> {
        let (c, p) = self.next_chunk().await?;
        let Payload::Bytes(b) = p else {
            return Err(self.protocol("a chunk was placed without a placement buffer"));
        };
        self.piece(c, b)
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU receive path
    fn piece(&mut self, mut c: v1::Chunk, payload: Bytes) -> Result<Piece, CallError> {
        let piece = self.asm.push_out(&mut c, payload).map_err(|e| self.chunk_error(e))?;
        self.count_progress(c.raw_len);
        Ok(piece)
    }

    /// After the last piece of a tensor of `nbytes`: the CRC-32C of the
    /// whole payload, when the sender sent one (the caller, who saw the
    /// bytes, checks it).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU receive path
    pub(crate) fn finish_pieces(&mut self, nbytes: u64) -> Result<Option<u32>, CallError> {
        let (_, crc) = self.asm.finished().ok_or_else(|| self.protocol("tensor ended early"))?;
        self.tensors += 1;
        self.bytes += nbytes;
        self.last_storage = 0;
        Ok(crc)
    }

    /// The next frame, which must be a chunk of the tensor in progress.
    async fn next_chunk(&mut self) -> Result<(v1::Chunk, Payload), CallError> {
        let Some(r) = self.recv_frame().await? else {
            return Err(self.protocol("the stream ended in the middle of a tensor"));
        };
        match r.header.kind {
            Some(Kind::Chunk(c)) => Ok((c, r.payload)),
            _ => Err(self.protocol(format!("expected the next chunk, got a {} frame", r.header.kind_name()))),
        }
    }

    /// Reads chunks until the last one while the buffer is lent to the transport.
    async fn read_placed(&mut self, placement: &Placement) -> Result<(), CallError> {
        loop {
            let (mut c, payload) = self.next_chunk().await?;
            let last = match payload {
                Payload::Bytes(b) => {
                    let mut g = placement.lock().await;
                    self.asm.push_into(&mut c, &b, &mut g)
                }
                // Only a checksum needs the bytes: without one the buffer
                // stays with the transport (UCX may be writing the next
                // chunks into it).
                Payload::Placed { offset, len } if c.chunk_crc32c.is_some() => {
                    let g = placement.lock().await;
                    self.asm.placed(&mut c, offset, len, g.len(), Some(&g))
                }
                Payload::Placed { offset, len } => self.asm.placed(&mut c, offset, len, placement.len(), None),
            }
            .map_err(|e| self.chunk_error(e))?;
            self.count_progress(c.raw_len);
            if last {
                return Ok(());
            }
        }
    }

    /// Checks the checksum and decodes a complete payload.
    fn finish_tensor(&mut self, payload: Bytes) -> Result<Tensor, CallError> {
        let (info, crc) = self.asm.finished().ok_or_else(|| self.protocol("tensor ended early"))?;
        if let Some(expected) = crc {
            let actual = checksum::crc32c(&payload);
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
        let storage_id = info.storage_id;
        let (tinfo, codec_kind) = info_from_wire(info).map_err(|e| self.protocol(e))?;
        let n = payload.len() as u64;
        self.last_storage = storage_id;
        let t = if storage_id != 0 {
            self.shared_view(storage_id, &tinfo, codec_kind, payload)?
        } else {
            let codec = tensorwire_codecs::codec(codec_kind)?;
            codec.decode(&tinfo, payload, &self.limits.decode_limits())?
        };
        self.tensors += 1;
        self.bytes += n;
        Ok(t)
    }

    /// A tensor placed in a storage shared within the stream: the payload
    /// is the storage (first view) or empty (later views).
    fn shared_view(
        &mut self,
        id: u64,
        info: &TensorInfo,
        codec: CodecKind,
        payload: Bytes,
    ) -> Result<Tensor, CallError> {
        if codec != CodecKind::Raw {
            return Err(self.protocol(format!("storage {id} is shared by a {codec} tensor (raw codec only)")));
        }
        let dtype = info.dtype.ok_or_else(|| self.protocol(format!("a view of storage {id} has no dtype")))?;
        let storage = match self.storages.get(&id) {
            Some(s) if payload.is_empty() => s.clone(),
            Some(_) => return Err(self.protocol(format!("storage {id} sent twice"))),
            None => {
                // Kept until the stream ends: bounded like one tensor.
                let kept = self.kept + payload.len() as u64;
                if kept > self.limits.max_tensor_bytes {
                    return Err(CallError::Limit {
                        what: "storages kept for sharing in one stream (max_tensor_bytes)",
                        size: kept,
                        limit: self.limits.max_tensor_bytes,
                    });
                }
                self.kept = kept;
                let s = aligned(payload, dtype.align());
                self.storages.insert(id, s.clone());
                s
            }
        };
        tensorwire_codecs::limits::check_shape(dtype, &info.shape, &self.limits.decode_limits())?;
        let strides =
            info.strides.clone().unwrap_or_else(|| tensorwire_codecs::tensor::contiguous_strides(&info.shape));
        let t = Tensor::from_strided(dtype, info.shape.clone(), strides, info.storage_offset, Storage::Host(storage))
            .map_err(DecodeError::from)?;
        Ok(info.apply_names(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Encoding;
    use crate::pipeline::link::SharedCaps;
    use crate::pipeline::pipe::pipe;
    use crate::pipeline::writer::FrameWriter;
    use tensorwire_transports::SendStream;

    /// A tensor whose payload arrives in uneven pieces (as from GPU staging
    /// buffers) is chunked as it comes and reassembled bit-exact.
    #[tokio::test]
    async fn streamed_payload_pieces_reassemble() {
        for total in [0usize, 1, 100_000, (3 << 20) + 7] {
            let t = Tensor::from_vec([total], (0..total).map(|i| (i * 31 + 7) as u8).collect::<Vec<u8>>()).unwrap();
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

    /// Pieces (the GPU receive path): a raw tensor's chunks are handed on in
    /// order (compressed ones decoded, uncompressed ones as their own
    /// bytes) with the whole payload's checksum at the end; a tensor that
    /// is not plain bytes (another codec) is read whole instead.
    #[tokio::test]
    async fn pieces_hand_on_a_raw_tensor_chunk_by_chunk() {
        use tensorwire_codecs::{Compression, CompressionMode};
        for (total, compression) in [
            (0usize, Compression::None),
            (1, Compression::None),
            ((3 << 20) + 7, Compression::None),
            ((3 << 20) + 7, Compression::Lz4),
        ] {
            // Compressible: runs of one byte value.
            let data: Vec<u8> = (0..total).map(|i| (i / 4096) as u8).collect();
            let t = Tensor::from_vec([total], data).unwrap().with_name("x");
            let torch = Tensor::from_vec([2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
            let (tx, rx) = pipe(1, "test");
            let enc = Encoding {
                chunk_size: 1 << 20,
                compression: CompressionMode::Fixed(compression),
                checksums: true,
                chunk_checksums: Some(true),
                ..Default::default()
            };
            let mut w = FrameWriter::new(Box::new(tx), enc, SharedCaps::default(), 1 << 20, None).for_transport("test");
            let sender = tokio::spawn(async move {
                w.send_tensor(&t, false).await.unwrap();
                w.encoding.codec = CodecKind::Torch;
                w.send_tensor(&torch, false).await.unwrap();
                w.finish().await.unwrap();
                (t, torch)
            });
            let mut r = FrameReader::new(Box::new(rx), "test".into(), Limits::default(), false);
            let Pieces::Stream { info, dtype, nbytes, first } = r.start_pieces().await.unwrap() else {
                panic!("a raw tensor arrives in pieces")
            };
            assert_eq!((dtype, nbytes, info.name.as_deref()), (DType::UInt8, total as u64, Some("x")));
            let (mut got, mut piece, mut pieces, mut checks, mut combined) = (Vec::new(), first, 0, 0, 0u32);
            loop {
                assert_eq!(piece.offset, got.len(), "pieces come in order");
                if let Some(expected) = piece.check {
                    assert_eq!(expected, checksum::crc32c(&piece.bytes), "a piece's checksum is left to check");
                    checks += 1;
                }
                got.extend_from_slice(&piece.bytes);
                // As the GPU upload thread builds the whole payload's checksum.
                combined = checksum::crc32c_combine(combined, checksum::crc32c(&piece.bytes), piece.bytes.len());
                pieces += 1;
                if piece.last {
                    break;
                }
                piece = r.next_piece().await.unwrap();
            }
            let crc = r.finish_pieces(nbytes).unwrap();
            let torch = match r.start_pieces().await.unwrap() {
                Pieces::Whole(t) => t,
                _ => panic!("a torch-coded tensor is read whole"),
            };
            let (t, sent_torch) = sender.await.unwrap();
            assert!(got == t.as_bytes().unwrap(), "{total} bytes, {compression:?}");
            assert_eq!(pieces, total.div_ceil(1 << 20).max(1));
            // Uncompressed pieces leave their chunk checksums to the
            // consumer; compressed ones are verified before decoding (the
            // 7-byte last chunk does not shrink, and goes uncompressed).
            let compressed = if compression == Compression::None { 0 } else { pieces - 1 };
            assert_eq!(checks, pieces - compressed, "{compression:?}");
            assert_eq!(crc, Some(checksum::crc32c(&got)));
            assert_eq!(crc, Some(combined));
            assert!(torch.data_eq(&sent_torch));
            assert!(matches!(r.start_pieces().await.unwrap(), Pieces::End));
        }
    }

    /// Reads every tensor `frames` make, with each one's storage id.
    async fn read_all(frames: Vec<(v1::TensorInfo, Bytes)>, limits: Limits) -> Result<Vec<(Tensor, u64)>, CallError> {
        let (mut tx, rx) = pipe(1, "test");
        for (i, (info, payload)) in frames.into_iter().enumerate() {
            let c = v1::Chunk {
                tensor_id: i as u64 + 1,
                total_bytes: payload.len() as u64,
                last: true,
                compression: v1::Compression::None as i32,
                raw_len: payload.len() as u64,
                info: Some(Box::new(info)),
                ..Default::default()
            };
            tx.send(tensorwire_transports::Frame { header: FrameHeader::new(Kind::Chunk(c)), payload }).await.unwrap();
        }
        tx.finish().await.unwrap();
        let mut r = FrameReader::new(Box::new(rx), "test".into(), limits, false);
        let mut out = Vec::new();
        while let Item::Tensor(t) = r.next().await? {
            out.push((t, r.last_storage));
        }
        Ok(out)
    }

    fn view(shape: &[u64], strides: &[u64], offset: u64, id: u64) -> v1::TensorInfo {
        v1::TensorInfo {
            dtype: v1::Dtype::Float32 as i32,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            storage_offset: offset,
            storage_id: id,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn shared_storages_arrive_shared_and_lies_are_refused() {
        use crate::pipeline::storages::plan;
        let w = Tensor::from_vec([3, 4], (0..12).map(|x| x as f32).collect::<Vec<_>>()).unwrap();
        let sent = [
            w.clone(),
            w.transpose(0, 1).unwrap(),
            w.narrow(1, 1, 2).unwrap(),
            Tensor::from_vec([2], vec![7u8, 8]).unwrap(),
        ];
        let (tx, rx) = pipe(1, "test");
        let mut wr = FrameWriter::new(Box::new(tx), Encoding::default(), SharedCaps::default(), 1 << 20, None);
        let reader = tokio::spawn(async move {
            let mut r = FrameReader::new(Box::new(rx), "test".into(), Limits::default(), false);
            let mut v = Vec::new();
            while let Item::Tensor(t) = r.next().await.unwrap() {
                v.push(t);
            }
            v
        });
        for (t, share) in sent.iter().zip(plan(&sent)) {
            wr.send_shared(t, share, false).await.unwrap();
        }
        wr.finish().await.unwrap();
        let got = reader.await.unwrap();
        // 48 bytes of storage crossed once, not three times.
        assert_eq!(wr.bytes_sent, 48 + 2);
        for (a, b) in sent.iter().zip(&got) {
            assert!(a.data_eq(b));
            assert_eq!((a.strides(), a.storage_offset()), (b.strides(), b.storage_offset()));
        }
        let p = |t: &Tensor| t.host_storage().unwrap().as_ptr();
        assert_eq!(p(&got[0]), p(&got[1]));
        assert_eq!(p(&got[0]), p(&got[2]));

        let storage = Bytes::from(vec![0u8; 16]);
        let ok = read_all(
            vec![(view(&[2, 2], &[], 0, 5), storage.clone()), (view(&[2], &[2], 1, 5), Bytes::new())],
            Limits::default(),
        )
        .await
        .unwrap();
        assert_eq!((ok[1].1, ok[1].0.storage_offset()), (5, 1));
        for (frames, needle) in [
            (vec![(view(&[2, 2], &[4, 1], 0, 5), storage.clone())], "the storage has 16"),
            (vec![(view(&[2], &[], 0, 9), storage.clone()), (view(&[2], &[], 0, 9), storage.clone())], "sent twice"),
            // A later view naming a storage never sent.
            (vec![(view(&[2], &[], 0, 9), Bytes::new())], "the storage has 0"),
            (vec![(view(&[5], &[], 0, 3), storage.clone())], "the storage has 16"),
        ] {
            let e = read_all(frames, Limits::default()).await.unwrap_err();
            assert!(e.to_string().to_lowercase().contains(needle), "{needle}: {e}");
        }
        // Storages kept for later views are bounded like one tensor.
        let small = Limits { max_tensor_bytes: 20, ..Limits::default() };
        let e = read_all(vec![(view(&[4], &[], 0, 1), storage.clone()), (view(&[4], &[], 0, 2), storage)], small)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("storages kept for sharing"), "{e}");
    }

    #[tokio::test]
    async fn a_streamed_source_that_ends_early_is_an_error() {
        let (tx, _rx) = pipe(1, "test");
        let mut w = FrameWriter::new(Box::new(tx), Encoding::default(), SharedCaps::default(), 1 << 20, None);
        let (ptx, mut prx) = tokio::sync::mpsc::channel(2);
        ptx.send(Ok(Bytes::from_static(b"abc"))).await.unwrap();
        drop(ptx);
        let t = Tensor::from_vec([10], vec![1u8; 10]).unwrap();
        let e = w.send_streamed(tensorwire_codecs::TensorInfo::of(&t), 10, &mut prx).await.unwrap_err();
        assert!(e.to_string().contains("ended after 3 of 10 bytes"), "{e}");
    }
}
