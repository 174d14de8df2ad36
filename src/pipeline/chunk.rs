//! Chunking and reassembly, sans-IO: no sockets, no tokio.
//!
//! [`Chunker`] cuts an encoded payload (a list of segments) into chunk
//! headers and payload slices. Large segments are sliced without copying;
//! runs of small segments (codec headers) are merged into one chunk.
//!
//! [`Reassembler`] checks each incoming chunk header against the tensor's
//! first chunk and the limits — tensor id, index, offset, sizes, compression
//! — and says where its bytes go in the tensor's buffer. The buffer is
//! allocated once, from the declared total, after the limit check; chunks
//! are written at their offsets (or placed there by the transport), so
//! there is no reassembly copy.

use std::collections::VecDeque;

use bytes::Bytes;
use tensorwire_codecs::checksum;
use tensorwire_codecs::compress::Decompressor;
use tensorwire_codecs::{Compression, Encoded};
use tensorwire_proto::v1;

use tensorwire_transports::RecvBuf;
use tensorwire_transports::copy::{STREAMED_DESTINATIONS_FROM, copy_streaming};

use super::budget::{MemoryBudget, OverBudget, Reservation};
use super::pool::{AcquireError, Lease, RecvPool};
use crate::pipeline::wire::compression_from_wire;

/// Segments at most this long are merged with their neighbours (copying
/// them); longer ones are sliced in place.
const SMALL_SEGMENT: usize = 64 << 10;

/// Cuts one tensor's payload into chunks.
#[derive(Debug)]
pub struct Chunker {
    tensor_id: u64,
    info: Option<v1::TensorInfo>,
    segments: VecDeque<Bytes>,
    total: u64,
    offset: u64,
    index: u32,
    chunk_size: usize,
    /// Most bytes of the first chunk (at most `chunk_size`).
    first_chunk: usize,
    crc32c: Option<u32>,
}

impl Chunker {
    /// A chunker for `encoded`, whose header is `info`. `chunk_size` is in bytes.
    pub fn new(tensor_id: u64, info: v1::TensorInfo, encoded: Encoded, chunk_size: usize) -> Self {
        let total = encoded.len();
        Self {
            tensor_id,
            info: Some(info),
            segments: encoded.segments.into_iter().filter(|s| !s.is_empty()).collect(),
            total,
            offset: 0,
            index: 0,
            chunk_size: chunk_size.max(1),
            first_chunk: chunk_size.max(1),
            crc32c: None,
        }
    }

    /// Makes the first chunk at most `n` bytes (the others keep the chunk
    /// size): over `ucx://` the first chunk asks the receiver for memory to
    /// put the rest into, so the sooner it arrives the more goes by put.
    pub fn with_first_chunk(mut self, n: usize) -> Self {
        self.first_chunk = n.clamp(1, self.chunk_size);
        self
    }

    /// Puts a CRC-32C of the whole payload into the last chunk.
    pub fn with_crc32c(mut self, crc: u32) -> Self {
        self.crc32c = Some(crc);
        self
    }

    /// The next chunk header and its (uncompressed) payload, or None when done.
    pub fn next_chunk(&mut self) -> Option<(v1::Chunk, Bytes)> {
        if self.info.is_none() && self.offset >= self.total {
            return None;
        }
        let payload = self.take_payload();
        let offset = self.offset;
        self.offset += payload.len() as u64;
        let last = self.offset >= self.total;
        let chunk = v1::Chunk {
            tensor_id: self.tensor_id,
            index: self.index,
            offset,
            total_bytes: self.total,
            last,
            compression: v1::Compression::None as i32,
            shuffle: 0,
            raw_len: payload.len() as u64,
            info: self.info.take().map(Box::new),
            crc32c: if last { self.crc32c } else { None },
            ..Default::default()
        };
        self.index += 1;
        Some((chunk, payload))
    }

    fn take_payload(&mut self) -> Bytes {
        if self.segments.is_empty() {
            return Bytes::new();
        }
        let limit = if self.index == 0 { self.first_chunk } else { self.chunk_size };
        // A large segment, or a small one not followed by another small one,
        // is sliced in place.
        let next_small = self.segments.get(1).is_some_and(|s| s.len() <= SMALL_SEGMENT);
        let front = self.segments.front_mut().expect("checked");
        if front.len() > SMALL_SEGMENT || !next_small || front.len() >= limit {
            let n = front.len().min(limit);
            let p = front.split_to(n);
            if front.is_empty() {
                self.segments.pop_front();
            }
            return p;
        }
        // Merge a run of small segments (codec headers) up to the chunk size.
        let run: usize = self.segments.iter().take_while(|s| s.len() <= SMALL_SEGMENT).map(Bytes::len).sum();
        let mut out = Vec::with_capacity(run.min(limit));
        while let Some(s) = self.segments.front_mut() {
            if s.len() > SMALL_SEGMENT || out.len() >= limit {
                break;
            }
            let n = s.len().min(limit - out.len());
            out.extend_from_slice(&s.split_to(n));
            if s.is_empty() {
                self.segments.pop_front();
            }
        }
        Bytes::from(out)
    }
}

/// A chunk that does not fit the tensor it claims to belong to, or the limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChunkError {
    /// The chunk breaks the sequence or its own sizes.
    #[error("{0}")]
    Protocol(String),
    /// The tensor's buffer could not be allocated (the declared size was
    /// within the limits, but this process has not got the memory).
    #[error("cannot allocate {size} bytes for tensor {tensor_id}")]
    OutOfMemory {
        /// The tensor.
        tensor_id: u64,
        /// Its declared size.
        size: u64,
    },
    /// The tensor does not fit the memory budget (checked before allocating).
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
    /// A chunk's payload does not match the checksum it was sent with.
    #[error("chunk {index} of tensor {tensor_id} is corrupt: CRC-32C {actual:08x}, sent as {expected:08x}")]
    Checksum {
        /// The tensor.
        tensor_id: u64,
        /// The chunk.
        index: u32,
        /// The checksum it was sent with.
        expected: u32,
        /// The checksum of what arrived.
        actual: u32,
    },
    /// The tensor declares more than `max_tensor_bytes`.
    #[error("tensor {tensor_id} declares {size} bytes, above the limit of {limit} (max_tensor_bytes)")]
    TooLarge {
        /// The tensor's id in the stream.
        tensor_id: u64,
        /// Declared size.
        size: u64,
        /// The limit.
        limit: u64,
    },
}

/// Where one chunk's bytes go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlan {
    /// This is the tensor's first chunk: allocate `total` bytes first.
    pub first: bool,
    /// This is the tensor's last chunk.
    pub last: bool,
    /// Offset of the chunk's decoded bytes in the tensor buffer.
    pub offset: usize,
    /// Decoded length of the chunk.
    pub raw_len: usize,
    /// Total decoded payload of the tensor.
    pub total: usize,
    /// How the chunk is compressed.
    pub compression: Compression,
    /// Shuffle element size (0 or 1: none).
    pub shuffle: u32,
}

impl ChunkPlan {
    /// Writes the chunk's wire payload into `buf` (the tensor buffer):
    /// a copy, or a bounded decompression into exactly `raw_len` bytes.
    pub fn write(&self, payload: &[u8], buf: &mut [u8], dec: &mut Decompressor) -> Result<(), ChunkError> {
        let len = buf.len();
        let dst = buf.get_mut(self.offset..self.offset + self.raw_len).ok_or_else(|| {
            ChunkError::Protocol(format!("chunk at {} does not fit a {len} byte buffer", self.offset))
        })?;
        // An uncompressed chunk into a large buffer bypasses the cache
        // (non-temporal stores, see `tensorwire_transports::copy`).
        if self.compression == Compression::None && len >= STREAMED_DESTINATIONS_FROM && payload.len() == dst.len() {
            copy_streaming(dst, payload);
            return Ok(());
        }
        dec.decompress(self.compression, self.shuffle, payload, dst).map_err(|e| ChunkError::Protocol(e.to_string()))
    }
}

/// The limits a reassembler enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReassemblyLimits {
    /// Largest decoded payload of one tensor.
    pub max_tensor_bytes: u64,
}

#[derive(Debug)]
struct Partial {
    tensor_id: u64,
    total: u64,
    next_index: u32,
    next_offset: u64,
}

/// Follows the chunks of one tensor at a time on a stream.
#[derive(Debug)]
pub struct Reassembler {
    limits: ReassemblyLimits,
    current: Option<Partial>,
    info: Option<v1::TensorInfo>,
    crc32c: Option<u32>,
}

impl Reassembler {
    /// A reassembler enforcing `limits`.
    pub fn new(limits: ReassemblyLimits) -> Self {
        Self { limits, current: None, info: None, crc32c: None }
    }

    /// Checks the header of the next chunk, whose wire payload has
    /// `payload_len` bytes, and returns where its bytes go. The tensor's
    /// info is taken out of its first chunk (kept for [`Self::finished`]).
    pub fn plan(&mut self, c: &mut v1::Chunk, payload_len: usize) -> Result<ChunkPlan, ChunkError> {
        let compression = compression_from_wire(c.compression).map_err(ChunkError::Protocol)?;
        if compression == Compression::None && c.raw_len != payload_len as u64 {
            return Err(ChunkError::Protocol(format!(
                "uncompressed chunk {} declares {} bytes but carries {payload_len}",
                c.index, c.raw_len
            )));
        }
        if c.shuffle > 16 {
            return Err(ChunkError::Protocol(format!("shuffle element size {} is above 16", c.shuffle)));
        }
        let first = self.current.is_none();
        if first {
            if c.index != 0 || c.offset != 0 {
                return Err(ChunkError::Protocol(format!(
                    "tensor {} starts with chunk {} at offset {} (expected chunk 0 at 0)",
                    c.tensor_id, c.index, c.offset
                )));
            }
            if c.info.is_none() {
                return Err(ChunkError::Protocol(format!("first chunk of tensor {} has no tensor info", c.tensor_id)));
            }
            if c.total_bytes > self.limits.max_tensor_bytes {
                return Err(ChunkError::TooLarge {
                    tensor_id: c.tensor_id,
                    size: c.total_bytes,
                    limit: self.limits.max_tensor_bytes,
                });
            }
            if usize::try_from(c.total_bytes).is_err() {
                return Err(ChunkError::Protocol(format!("tensor of {} bytes does not fit in memory", c.total_bytes)));
            }
            self.info = c.info.take().map(|i| *i);
            self.crc32c = None;
            self.current =
                Some(Partial { tensor_id: c.tensor_id, total: c.total_bytes, next_index: 0, next_offset: 0 });
        }
        let p = self.current.as_mut().expect("set above");
        if c.tensor_id != p.tensor_id
            || c.index != p.next_index
            || c.offset != p.next_offset
            || c.total_bytes != p.total
        {
            return Err(ChunkError::Protocol(format!(
                "chunk (tensor {}, index {}, offset {}, total {}) out of sequence: expected tensor {} index {} offset {} total {}",
                c.tensor_id, c.index, c.offset, c.total_bytes, p.tensor_id, p.next_index, p.next_offset, p.total
            )));
        }
        if !first && c.info.is_some() {
            return Err(ChunkError::Protocol(format!(
                "chunk {} of tensor {} repeats the tensor info",
                c.index, c.tensor_id
            )));
        }
        let end = c.offset.checked_add(c.raw_len).filter(|&e| e <= p.total).ok_or_else(|| {
            ChunkError::Protocol(format!(
                "chunk {} ({} bytes at {}) runs past the tensor's {} bytes",
                c.index, c.raw_len, c.offset, p.total
            ))
        })?;
        if c.last != (end == p.total) {
            return Err(ChunkError::Protocol(format!(
                "chunk {} ends at {end} of {} but is {}marked last",
                c.index,
                p.total,
                if c.last { "" } else { "not " }
            )));
        }
        if c.raw_len == 0 && !c.last {
            return Err(ChunkError::Protocol(format!("empty chunk {} before the end", c.index)));
        }
        p.next_index = p.next_index.checked_add(1).ok_or_else(|| ChunkError::Protocol("too many chunks".into()))?;
        p.next_offset = end;
        let plan = ChunkPlan {
            first,
            last: c.last,
            offset: c.offset as usize,
            raw_len: c.raw_len as usize,
            total: p.total as usize,
            compression,
            shuffle: c.shuffle,
        };
        if c.last {
            self.crc32c = c.crc32c;
            self.current = None;
        }
        Ok(plan)
    }

    /// After the last chunk: the tensor's header and, if the sender sent
    /// one, the payload's CRC-32C.
    pub fn finished(&mut self) -> Option<(v1::TensorInfo, Option<u32>)> {
        if self.current.is_some() {
            return None;
        }
        Some((self.info.take()?, self.crc32c.take()))
    }
}

/// Checks a chunk's payload against the checksum it was sent with, if any.
fn verify(c: &v1::Chunk, payload: &[u8]) -> Result<(), ChunkError> {
    match c.chunk_crc32c {
        Some(expected) => {
            let actual = checksum::crc32c(payload);
            if actual == expected {
                Ok(())
            } else {
                Err(ChunkError::Checksum { tensor_id: c.tensor_id, index: c.index, expected, actual })
            }
        }
        None => Ok(()),
    }
}

/// A chunk's decoded bytes, handed on by [`Assembly::push_out`].
#[derive(Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU receive path
pub struct Piece {
    /// Where the bytes go in the tensor.
    pub offset: usize,
    /// The decoded bytes.
    pub bytes: Bytes,
    /// This is the tensor's last piece.
    pub last: bool,
    /// The CRC-32C these bytes were sent with, when the consumer must still
    /// verify them before use.
    pub check: Option<u32>,
}

/// What feeding a chunk to an [`Assembly`] gave.
#[derive(Debug)]
pub enum Step {
    /// More chunks follow.
    More,
    /// The tensor's whole payload (its header: [`Assembly::finished`]).
    Done(Bytes),
}

/// The reassembly of the tensors of one stream, sans-IO: the frame reader
/// feeds it each chunk as it arrives (and so does the `reassembly` fuzz
/// target), and it checks the chunk ([`Reassembler`]), allocates the
/// tensor's buffer once from the declared size (fallibly), writes or
/// decompresses the chunk at its offset, and hands back the payload after
/// the last chunk. A tensor that fits one uncompressed chunk is handed back
/// as the chunk's own bytes (no copy).
///
/// While a transport writes chunks into the buffer itself (placement), the
/// buffer is lent out ([`Assembly::lend`]) and chunks are fed with
/// [`Assembly::push_into`] and [`Assembly::placed`].
#[derive(Debug)]
pub struct Assembly {
    reasm: Reassembler,
    dec: Decompressor,
    /// The buffer of the tensor in progress (pooled or not), with its
    /// budget reservation.
    lease: Option<Lease>,
    budget: Option<MemoryBudget>,
    pool: Option<RecvPool>,
    /// The budget held for a tensor that is one chunk's own bytes.
    held: Option<Reservation>,
    /// The budget held for the decompressor's scratch buffer (shuffled
    /// and planes chunks are decoded there first): a few bytes of chunk
    /// may declare a chunk of up to a tensor's size.
    scratch: Option<Reservation>,
}

impl Assembly {
    /// An assembly enforcing `limits`; with a `budget`, every tensor's
    /// buffer is reserved from it before it is allocated, and stays
    /// reserved until the last view of the tensor's bytes is dropped.
    pub fn new(limits: ReassemblyLimits, budget: Option<MemoryBudget>) -> Self {
        Self {
            reasm: Reassembler::new(limits),
            dec: Decompressor::new(),
            lease: None,
            budget,
            pool: None,
            held: None,
            scratch: None,
        }
    }

    /// An assembly whose large buffers come from `pool` (and are reserved
    /// from the pool's budget, as every other buffer is).
    pub fn with_pool(limits: ReassemblyLimits, pool: RecvPool) -> Self {
        let mut a = Self::new(limits, Some(pool.budget().clone()));
        a.pool = Some(pool);
        a
    }

    fn reserve(&mut self, n: usize) -> Result<Option<Reservation>, ChunkError> {
        match &self.budget {
            Some(b) => Ok(Some(b.try_reserve(n as u64, "tensor")?)),
            None => Ok(None),
        }
    }

    /// Reserves what the decompressor's scratch buffer needs for `plan`
    /// from the budget before the buffer grows to it (a larger reservation
    /// replaces the smaller one, the buffer freed first).
    fn reserve_scratch(&mut self, plan: &ChunkPlan) -> Result<(), ChunkError> {
        let need = Decompressor::scratch_needed(plan.compression, plan.shuffle, plan.raw_len) as u64;
        if need <= self.scratch.as_ref().map_or(0, Reservation::bytes) {
            return Ok(());
        }
        if let Some(b) = &self.budget {
            self.scratch = None;
            self.dec.release_scratch();
            self.scratch = Some(b.try_reserve(need, "decompression scratch")?);
        }
        Ok(())
    }

    /// A buffer of `n` bytes for tensor `tensor_id`: from the pool when it
    /// pools that size, else a new zeroed one; reserved from the budget first.
    fn lease(&self, tensor_id: u64, n: usize) -> Result<Lease, ChunkError> {
        let r = match &self.pool {
            Some(p) if p.pools(n) => p.acquire(n, "tensor"),
            _ => Lease::unpooled(n, self.budget.as_ref(), "tensor"),
        };
        r.map_err(|e| match e {
            AcquireError::OverBudget(o) => ChunkError::OverBudget(o),
            _ => ChunkError::OutOfMemory { tensor_id, size: n as u64 },
        })
    }

    /// The finished payload, carrying its reservation.
    fn done(&mut self, data: Bytes) -> Bytes {
        match self.held.take() {
            Some(r) => r.attach(data),
            None => data,
        }
    }

    /// Feeds a chunk whose payload arrived in memory.
    pub fn push(&mut self, c: &mut v1::Chunk, payload: Bytes) -> Result<Step, ChunkError> {
        verify(c, &payload)?;
        let plan = self.reasm.plan(c, payload.len())?;
        if plan.first {
            self.lease = None;
            if plan.last && plan.compression == Compression::None {
                self.held = self.reserve(plan.total)?;
                return Ok(Step::Done(self.done(payload)));
            }
            self.lease = Some(self.lease(c.tensor_id, plan.total)?);
        }
        self.reserve_scratch(&plan)?;
        let lease = self.lease.as_mut().ok_or_else(|| ChunkError::Protocol("no tensor in progress".into()))?;
        plan.write(&payload, lease.buf(), &mut self.dec)?;
        Ok(if plan.last {
            let lease = self.lease.take().expect("checked above");
            Step::Done(lease.into_bytes())
        } else {
            Step::More
        })
    }

    /// Lends the partly filled buffer of the tensor in progress (for a
    /// transport to write chunks into); [`Assembly::finish_lent`] takes it back.
    pub fn lend(&mut self) -> RecvBuf {
        self.lease.as_mut().map(Lease::take).unwrap_or_default()
    }

    /// Takes back the lent buffer after the last chunk: the tensor's payload.
    pub fn finish_lent(&mut self, buf: RecvBuf) -> Bytes {
        match self.lease.take() {
            Some(mut lease) => {
                lease.put(buf);
                lease.into_bytes()
            }
            None => Bytes::from_owner(buf),
        }
    }

    /// Takes back the lent buffer of a tensor that will not finish (the
    /// stream failed): a pooled buffer goes back to the pool.
    pub fn abandon(&mut self, buf: RecvBuf) {
        if let Some(mut lease) = self.lease.take() {
            lease.put(buf);
        }
    }

    /// Feeds a chunk of a tensor received into memory its caller owns
    /// (`dst`, which the caller checked against the tensor's declared size
    /// before the first chunk): writes or decompresses the chunk at its
    /// offset, never past `dst`. Returns true after the last chunk.
    pub fn push_to(&mut self, c: &mut v1::Chunk, payload: &[u8], dst: &mut [u8]) -> Result<bool, ChunkError> {
        verify(c, payload)?;
        let plan = self.reasm.plan(c, payload.len())?;
        if plan.total != dst.len() {
            return Err(ChunkError::Protocol(format!(
                "tensor {} declares {} bytes, the destination has {}",
                c.tensor_id,
                plan.total,
                dst.len()
            )));
        }
        self.reserve_scratch(&plan)?;
        plan.write(payload, dst, &mut self.dec)?;
        Ok(plan.last)
    }

    /// Feeds a chunk of a tensor whose bytes are handed on piece by piece
    /// (to a GPU upload, say) instead of being assembled here: returns the
    /// chunk's decoded bytes and their offset in the tensor. An
    /// uncompressed chunk is handed on as its own bytes (no copy), with the
    /// checksum it was sent with, if any, left to the consumer
    /// ([`Piece::check`]: verified there, off the thread that reads the
    /// network, in the same pass that computes the whole payload's); a
    /// compressed or shuffled one is verified here and decoded into a
    /// buffer of its declared length, which the tensor's size bounds.
    /// Pieces come in order, each starting where the previous one ended.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the GPU receive path
    pub fn push_out(&mut self, c: &mut v1::Chunk, payload: Bytes) -> Result<Piece, ChunkError> {
        if c.compression == v1::Compression::None as i32 && c.shuffle <= 1 {
            let plan = self.reasm.plan(c, payload.len())?;
            let check = c.chunk_crc32c;
            return Ok(Piece { offset: plan.offset, bytes: payload, last: plan.last, check });
        }
        verify(c, &payload)?;
        let plan = self.reasm.plan(c, payload.len())?;
        // Reserved from the budget like every receive buffer: a few bytes
        // of compressed chunk may declare a tensor's worth.
        let reservation = self.reserve(plan.raw_len)?;
        self.reserve_scratch(&plan)?;
        let mut out = Vec::new();
        out.try_reserve_exact(plan.raw_len)
            .map_err(|_| ChunkError::OutOfMemory { tensor_id: c.tensor_id, size: plan.raw_len as u64 })?;
        out.resize(plan.raw_len, 0);
        self.dec
            .decompress(plan.compression, plan.shuffle, &payload, &mut out)
            .map_err(|e| ChunkError::Protocol(e.to_string()))?;
        let bytes = match reservation {
            Some(r) => r.attach(Bytes::from(out)),
            None => Bytes::from(out),
        };
        Ok(Piece { offset: plan.offset, bytes, last: plan.last, check: None })
    }

    /// Feeds a chunk whose payload arrived in memory while the buffer is
    /// lent: writes it into `lent`. Returns true after the last chunk.
    pub fn push_into(&mut self, c: &mut v1::Chunk, payload: &[u8], lent: &mut [u8]) -> Result<bool, ChunkError> {
        verify(c, payload)?;
        let plan = self.reasm.plan(c, payload.len())?;
        if plan.first {
            return Err(ChunkError::Protocol(format!("tensor {} started while another was in progress", c.tensor_id)));
        }
        self.reserve_scratch(&plan)?;
        plan.write(payload, lent, &mut self.dec)?;
        Ok(plan.last)
    }

    /// Feeds a chunk the transport already wrote into the lent buffer, at
    /// `offset` with `len` bytes; `lent_len` is that buffer's length.
    /// Returns true after the last chunk. A chunk with a checksum needs its
    /// bytes (`lent`: the buffer, locked by the caller); one without is
    /// checked against the header alone, so a transport may still be
    /// writing the next chunks into the buffer meanwhile.
    pub fn placed(
        &mut self,
        c: &mut v1::Chunk,
        offset: u64,
        len: usize,
        lent_len: usize,
        lent: Option<&[u8]>,
    ) -> Result<bool, ChunkError> {
        let plan = self.reasm.plan(c, len)?;
        if plan.first || offset as usize != plan.offset || len != plan.raw_len || plan.compression != Compression::None
        {
            return Err(ChunkError::Protocol("a placed chunk does not match its header".into()));
        }
        let end = plan.offset.checked_add(len).filter(|&end| end <= lent_len);
        let range =
            plan.offset..end.ok_or_else(|| ChunkError::Protocol("a placed chunk lies outside its buffer".into()))?;
        if c.chunk_crc32c.is_some() {
            let bytes = lent
                .and_then(|b| b.get(range))
                .ok_or_else(|| ChunkError::Protocol("a placed chunk's checksum needs its bytes".into()))?;
            verify(c, bytes)?;
        }
        Ok(plan.last)
    }

    /// After the last chunk: the tensor's header and, if the sender sent
    /// one, the payload's CRC-32C.
    pub fn finished(&mut self) -> Option<(v1::TensorInfo, Option<u32>)> {
        self.reasm.finished()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tensorwire_codecs::compress::Compressor;

    fn encoded(segs: &[usize]) -> Encoded {
        let mut k = 0u8;
        Encoded {
            info: Default::default(),
            segments: segs
                .iter()
                .map(|&n| {
                    Bytes::from(
                        (0..n)
                            .map(|_| {
                                k = k.wrapping_add(1);
                                k
                            })
                            .collect::<Vec<u8>>(),
                    )
                })
                .collect(),
        }
    }

    fn reassemble(chunks: &[(v1::Chunk, Bytes)], limit: u64) -> Result<Vec<u8>, ChunkError> {
        let mut a = Assembly::new(ReassemblyLimits { max_tensor_bytes: limit }, None);
        let mut out = None;
        for (c, p) in chunks {
            if let Step::Done(b) = a.push(&mut c.clone(), p.clone())? {
                out = Some(b.to_vec());
            }
        }
        a.finished().ok_or_else(|| ChunkError::Protocol("unfinished".into()))?;
        out.ok_or_else(|| ChunkError::Protocol("no last chunk".into()))
    }

    fn chunks_of(e: Encoded, size: usize) -> Vec<(v1::Chunk, Bytes)> {
        let mut c = Chunker::new(7, v1::TensorInfo::default(), e, size);
        std::iter::from_fn(|| c.next_chunk()).collect()
    }

    /// Pieces (the GPU receive path): an uncompressed chunk is handed on as
    /// its own bytes with its checksum left to check; a compressed one that
    /// declares more than the memory budget allows is refused before
    /// anything is allocated.
    #[test]
    fn pieces_keep_uncompressed_bytes_and_budget_decoded_ones() {
        let info = || Some(Box::new(v1::TensorInfo { dtype: v1::Dtype::Uint8 as i32, ..Default::default() }));
        let mut a = Assembly::new(ReassemblyLimits { max_tensor_bytes: 1 << 30 }, Some(MemoryBudget::new(1 << 20)));
        let payload = Bytes::from(vec![5u8; 4096]);
        let mut c = v1::Chunk {
            tensor_id: 1,
            total_bytes: 4096,
            raw_len: 4096,
            last: true,
            chunk_crc32c: Some(77),
            compression: v1::Compression::None as i32,
            info: info(),
            ..Default::default()
        };
        let p = a.push_out(&mut c, payload.clone()).unwrap();
        assert_eq!((p.offset, p.last, p.check), (0, true, Some(77)));
        assert_eq!(p.bytes.as_ptr(), payload.as_ptr(), "no copy");
        let mut bomb = v1::Chunk {
            tensor_id: 2,
            total_bytes: 64 << 20,
            raw_len: 64 << 20,
            last: true,
            compression: v1::Compression::Lz4 as i32,
            info: info(),
            ..Default::default()
        };
        let e = a.push_out(&mut bomb, Bytes::from_static(&[0; 16])).unwrap_err();
        assert!(matches!(e, ChunkError::OverBudget(_)), "{e}");
    }

    /// A shuffled chunk is decoded in a scratch buffer as large as the
    /// chunk: that buffer is reserved from the budget too (a 16-byte chunk
    /// declaring more than the budget has left is refused before anything
    /// is allocated), and given back with the assembly.
    #[test]
    fn decompression_scratch_is_budgeted() {
        let info = || Some(Box::new(v1::TensorInfo { dtype: v1::Dtype::Float32 as i32, ..Default::default() }));
        let n = 256 << 10;
        let data: Vec<u8> = (0..n as u32 / 4).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let packed = Compressor::default().compress(Compression::Lz4, 4, &data).unwrap().expect("compresses");
        let budget = MemoryBudget::new(4 << 20);
        let mut a = Assembly::new(ReassemblyLimits { max_tensor_bytes: 1 << 30 }, Some(budget.clone()));
        let chunk = |id: u64, total: usize| v1::Chunk {
            tensor_id: id,
            total_bytes: total as u64,
            raw_len: total as u64,
            last: true,
            compression: v1::Compression::Lz4 as i32,
            shuffle: 4,
            info: info(),
            ..Default::default()
        };
        let Step::Done(t) = a.push(&mut chunk(1, n), Bytes::from(packed)).unwrap() else { panic!("one chunk") };
        assert_eq!(&t[..], &data[..]);
        assert_eq!(budget.used(), 2 * n as u64, "the tensor and the scratch it was decoded in");
        // 3.5 MiB more: the tensor's buffer fits what is left, its scratch does not.
        let big = 7 << 19;
        let e = a.push(&mut chunk(2, big), Bytes::from_static(&[0; 16])).unwrap_err();
        assert!(matches!(e, ChunkError::OverBudget(_)), "{e}");
        drop(a);
        assert_eq!(budget.used(), n as u64, "only the tensor is held");
        drop(t);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn large_segments_are_sliced_without_copy() {
        let e = encoded(&[300, 3 << 20, 200]);
        let big = e.segments[1].clone();
        let chunks = chunks_of(e.clone(), 1 << 20);
        // header (300 B), then 3 × 1 MiB slices of the big segment, then the trailer.
        assert_eq!(chunks.iter().map(|(_, p)| p.len()).collect::<Vec<_>>(), vec![300, 1 << 20, 1 << 20, 1 << 20, 200]);
        assert_eq!(chunks[1].1.as_ptr(), big.as_ptr());
        assert!(chunks[0].0.info.is_some() && chunks[1].0.info.is_none());
        assert!(chunks[4].0.last && !chunks[3].0.last);
        assert_eq!(reassemble(&chunks, u64::MAX).unwrap(), e.to_bytes().to_vec());
    }

    #[test]
    fn a_smaller_first_chunk_only_changes_the_first() {
        let e = encoded(&[5 << 20]);
        let mut c = Chunker::new(7, v1::TensorInfo::default(), e.clone(), 2 << 20).with_first_chunk(1 << 20);
        let chunks: Vec<_> = std::iter::from_fn(|| c.next_chunk()).collect();
        let lens: Vec<usize> = chunks.iter().map(|(_, p)| p.len()).collect();
        assert_eq!(lens, vec![1 << 20, 2 << 20, 2 << 20]);
        assert_eq!(chunks.iter().map(|(c, _)| c.offset).collect::<Vec<_>>(), vec![0, 1 << 20, 3 << 20]);
        assert_eq!(reassemble(&chunks, u64::MAX).unwrap(), e.to_bytes().to_vec());
        // Never above the chunk size, never zero.
        let mut c = Chunker::new(7, v1::TensorInfo::default(), e, 1 << 20).with_first_chunk(usize::MAX);
        assert_eq!(c.next_chunk().unwrap().1.len(), 1 << 20);
        let mut c = Chunker::new(7, v1::TensorInfo::default(), encoded(&[10]), 4).with_first_chunk(0);
        assert_eq!(c.next_chunk().unwrap().1.len(), 1);
    }

    #[test]
    fn empty_tensor_is_one_chunk() {
        let chunks = chunks_of(encoded(&[]), 1024);
        assert_eq!(chunks.len(), 1);
        assert!(chunks[0].0.last && chunks[0].0.total_bytes == 0);
        assert_eq!(reassemble(&chunks, 0).unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn limits_and_lies_are_refused() {
        let chunks = chunks_of(encoded(&[5000]), 1024);
        let e = reassemble(&chunks, 4999).unwrap_err();
        assert!(matches!(e, ChunkError::TooLarge { size: 5000, limit: 4999, .. }), "{e}");
        let mut bad = chunks.clone();
        bad.swap(1, 2);
        assert!(reassemble(&bad, u64::MAX).unwrap_err().to_string().contains("out of sequence"));
        let mut bad = chunks.clone();
        bad[1].0.raw_len += 1;
        assert!(reassemble(&bad, u64::MAX).is_err());
        let mut bad = chunks.clone();
        bad[4].0.last = false;
        assert!(reassemble(&bad, u64::MAX).is_err());
        let mut bad = chunks.clone();
        bad[2].0.tensor_id = 99;
        assert!(reassemble(&bad, u64::MAX).is_err());
        let mut bad = chunks.clone();
        bad[0].0.info = None;
        assert!(reassemble(&bad, u64::MAX).unwrap_err().to_string().contains("no tensor info"));
        let mut bad = chunks;
        bad[1].0.compression = 42;
        assert!(reassemble(&bad, u64::MAX).unwrap_err().to_string().contains("unknown compression"));
    }

    #[test]
    fn compressed_chunks_decompress_in_place_and_bombs_fail() {
        let data: Vec<u8> = (0..200_000u32).flat_map(|i| ((i / 100) as f32).to_le_bytes()).collect();
        let e = Encoded { info: Default::default(), segments: vec![Bytes::from(data.clone())] };
        let mut comp = Compressor::new();
        let mut chunks = chunks_of(e, 100_000);
        for (c, p) in &mut chunks {
            if let Some(z) = comp.compress(Compression::Lz4, 4, p).unwrap() {
                c.compression = v1::Compression::Lz4 as i32;
                c.shuffle = 4;
                *p = Bytes::from(z);
            }
        }
        assert_eq!(reassemble(&chunks, u64::MAX).unwrap(), data);
        // A chunk whose data decodes to more than it declares.
        let mut bomb = chunks.clone();
        bomb[0].0.raw_len -= 8;
        bomb[0].0.total_bytes -= 8;
        for c in &mut bomb[1..] {
            c.0.total_bytes -= 8;
            c.0.offset -= 8;
        }
        assert!(reassemble(&bomb, u64::MAX).is_err());
    }

    /// A tensor large enough to be assembled with non-temporal stores
    /// (chunks of odd sizes, so that pieces start anywhere in a cache line)
    /// arrives bit-exact, compressed chunks among the plain ones included.
    #[test]
    fn a_large_tensor_assembled_with_streaming_copies_is_bit_exact() {
        let n = STREAMED_DESTINATIONS_FROM + 12_345;
        let e = encoded(&[n / 3, n - n / 3]);
        let whole = e.to_bytes().to_vec();
        let mut chunks = chunks_of(e, (1 << 20) + 17);
        // One chunk compressed: decompressed, not copied, at its offset.
        let (c, p) = &mut chunks[2];
        let z = Compressor::new().compress(Compression::Lz4, 1, p).unwrap().expect("a repeating pattern compresses");
        *p = Bytes::from(z);
        c.compression = v1::Compression::Lz4 as i32;
        assert_eq!(reassemble(&chunks, u64::MAX).unwrap(), whole);
    }

    proptest! {
        #[test]
        fn any_segmentation_round_trips(segs in proptest::collection::vec(0usize..200_000, 0..6), size in 4096usize..300_000) {
            let e = encoded(&segs);
            let whole = e.to_bytes().to_vec();
            let chunks = chunks_of(e, size);
            for (c, p) in &chunks {
                prop_assert!(p.len() <= size);
                prop_assert_eq!(c.raw_len as usize, p.len());
            }
            prop_assert_eq!(reassemble(&chunks, u64::MAX).unwrap(), whole);
        }
    }
}
