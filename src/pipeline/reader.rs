//! `FrameReader`: reads the frames of one stream and reassembles tensors
//! (into a [`Placement`] buffer when the transport can write there
//! directly), checks their checksums and decodes them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tensorwire_codecs::Tensor;
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{FrameHeader, Payload, Placement, RecvStream};

use super::budget::MemoryBudget;
use super::chunk::{Assembly, ChunkError, ReassemblyLimits, Step};
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

/// Reads frames and tensors from one stream: the async driver of the
/// sans-IO [`Assembly`].
pub(crate) struct FrameReader {
    recv: Box<dyn RecvStream>,
    pub(crate) peer: String,
    asm: Assembly,
    limits: Limits,
    placement: bool,
    pub(crate) tensors: u64,
    pub(crate) bytes: u64,
    /// Payload bytes received so far are added here chunk by chunk (progress bars).
    pub(crate) progress: Option<Arc<AtomicU64>>,
}

impl FrameReader {
    pub(crate) fn new(recv: Box<dyn RecvStream>, peer: String, limits: Limits, placement: bool) -> Self {
        Self {
            recv,
            peer,
            asm: Assembly::new(ReassemblyLimits { max_tensor_bytes: limits.max_tensor_bytes }, None),
            limits,
            placement,
            tensors: 0,
            bytes: 0,
            progress: None,
        }
    }

    /// Reserves every tensor's buffer from `budget` before allocating it.
    pub(crate) fn with_budget(mut self, budget: MemoryBudget) -> Self {
        self.asm = Assembly::new(ReassemblyLimits { max_tensor_bytes: self.limits.max_tensor_bytes }, Some(budget));
        self
    }

    fn count_progress(&self, n: u64) {
        if let Some(p) = &self.progress {
            p.fetch_add(n, Ordering::Relaxed);
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
            e @ (ChunkError::OverBudget(_) | ChunkError::OutOfMemory { .. }) => CallError::OutOfMemory(e.to_string()),
            ChunkError::Checksum { expected, actual, .. } => {
                CallError::Decode(tensorwire_codecs::DecodeError::Checksum { what: "chunk payload", expected, actual })
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
        let step = self.asm.push(&first, p0).map_err(|e| self.chunk_error(e))?;
        self.count_progress(first.raw_len);
        if let Step::Done(payload) = step {
            return self.finish_tensor(payload);
        }
        if !self.placement {
            loop {
                let (c, payload) = self.next_chunk().await?;
                let Payload::Bytes(b) = payload else {
                    return Err(self.protocol("a chunk was placed without a placement buffer"));
                };
                let step = self.asm.push(&c, b).map_err(|e| self.chunk_error(e))?;
                self.count_progress(c.raw_len);
                if let Step::Done(payload) = step {
                    return self.finish_tensor(payload);
                }
            }
        }
        // The transport writes the rest of the chunks straight into the buffer.
        let placement = Placement::new(self.asm.lend(), first.tensor_id);
        self.recv.place(Some(placement.clone()));
        let result = self.read_placed(&placement).await;
        self.recv.place(None);
        let buf = placement.into_inner().await;
        result?;
        let payload = self.asm.finish_lent(buf);
        self.finish_tensor(payload)
    }

    /// The next frame, which must be a chunk of the tensor in progress.
    async fn next_chunk(&mut self) -> Result<(v1::Chunk, Payload), CallError> {
        let Some(r) = self.recv.recv().await? else {
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
            let (c, payload) = self.next_chunk().await?;
            let last = match payload {
                Payload::Bytes(b) => {
                    let mut g = placement.lock().await;
                    self.asm.push_into(&c, &b, &mut g)
                }
                Payload::Placed { offset, len } => {
                    let g = placement.lock().await;
                    self.asm.placed(&c, offset, len, &g)
                }
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
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Encoding;
    use crate::pipeline::link::SharedCaps;
    use crate::pipeline::pipe::pipe;
    use crate::pipeline::writer::FrameWriter;

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
