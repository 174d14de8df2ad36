//! The skytorch chunk format: a tensor's `torch.save()` bytes cut into
//! `TensorChunk`s (`proto/skytorch/torch/service.proto`). [`Assembler`]
//! reassembles chunks arriving in any order within byte and count limits;
//! [`encode_chunks`] cuts a tensor with the seed's metadata. Used by the gRPC
//! compat service and client, and fuzzed (`fuzzing::compat_chunks`).

use std::collections::{BTreeMap, HashMap};

use bytes::{Bytes, BytesMut};
use tensorwire_codecs::Tensor;
use tensorwire_codecs::torch::{self, Object as TorchObject, SaveOptions};
use tensorwire_proto::compat::TensorChunk;

use crate::config::Limits;
use crate::error::{Code, Status};
use crate::pipeline::budget::{MemoryBudget, Reservation};
use crate::pipeline::pool::RecvPool;

/// Reassembles `TensorChunk`s (in any order, interleaved between tensors)
/// into the `torch.save()` bytes of each tensor, within byte limits.
pub(crate) struct Assembler {
    partial: HashMap<String, Partial>,
    max_bytes: u64,
    /// Bytes buffered, each chunk counted with [`CHUNK_OVERHEAD`].
    buffered: u64,
    /// `buffered`, held against the server's memory budget.
    held: Option<Reservation>,
    /// Where a tensor's contiguous buffer comes from (recycled, reserved
    /// from the same budget), when set.
    pool: Option<RecvPool>,
}

#[derive(Default)]
struct Partial {
    chunks: BTreeMap<u32, Bytes>,
    total: Option<u32>,
    last: Option<u32>,
    bytes: u64,
    metadata: HashMap<String, String>,
}

/// One tensor's `torch.save()` bytes, reassembled.
#[derive(Debug)]
pub(crate) struct Assembled {
    pub(crate) id: String,
    pub(crate) bytes: Bytes,
    pub(crate) metadata: HashMap<String, String>,
}

/// Chunks of one tensor, at most (a 1 MiB-chunked tensor of 1 TiB).
const MAX_CHUNKS: usize = 1 << 20;

/// Tensors being reassembled at once on one call, at most.
const MAX_PARTIAL: usize = 256;

/// What one buffered chunk costs beyond its data (its map node and `Bytes`
/// handle, and the allocator's rounding), so a peer sending 1-byte chunks
/// is charged for what it really makes the server hold.
const CHUNK_OVERHEAD: u64 = 128;

impl Assembler {
    /// Buffers at most `max_bytes` (per tensor and in all, overhead
    /// counted), reserved from `budget` when given.
    pub(crate) fn new(max_bytes: u64, budget: Option<&MemoryBudget>) -> Self {
        let held = budget.map(|b| b.try_reserve(0, "compat reassembly").expect("zero bytes always fit"));
        Self { partial: HashMap::new(), max_bytes, buffered: 0, held, pool: None }
    }

    /// Joins each tensor's chunks into a buffer from `pool` (recycled,
    /// already faulted) instead of a new allocation.
    pub(crate) fn with_pool(mut self, pool: RecvPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Adds a chunk; returns a tensor's id, bytes and first-chunk metadata
    /// once all its chunks are in.
    pub(crate) fn push(&mut self, c: TensorChunk) -> Result<Option<Assembled>, Status> {
        let bad = |m: String| Status::new(Code::InvalidArgument, m);
        if c.tensor_id.is_empty() {
            return Err(bad("a chunk without a tensor_id".into()));
        }
        if !self.partial.contains_key(&c.tensor_id) && self.partial.len() >= MAX_PARTIAL {
            return Err(Status::new(
                Code::ResourceExhausted,
                format!("more than {MAX_PARTIAL} tensors incomplete at once on one call"),
            ));
        }
        if c.data.is_empty() {
            return Err(bad(format!("tensor {}: chunk {} has no data", c.tensor_id, c.chunk_number)));
        }
        let len = c.data.len() as u64;
        // The id (the map's key) and the metadata kept with the tensor
        // count too: a 1-byte chunk may carry megabytes of either.
        let (new_id, keeps_metadata) = match self.partial.get(&c.tensor_id) {
            None => (c.tensor_id.len() as u64, true),
            Some(p) => (0, p.metadata.is_empty()),
        };
        let kept_metadata: u64 =
            if keeps_metadata { c.metadata.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum() } else { 0 };
        let cost = len + CHUNK_OVERHEAD + new_id + kept_metadata;
        if self.buffered + cost > self.max_bytes {
            return Err(Status::new(
                Code::ResourceExhausted,
                format!(
                    "tensor {} and those incomplete with it exceed the limit of {} bytes",
                    c.tensor_id, self.max_bytes
                ),
            ));
        }
        if let Some(h) = &mut self.held {
            h.grow(cost, "compat reassembly").map_err(|e| Status::new(Code::ResourceExhausted, e.to_string()))?;
        }
        let id = c.tensor_id;
        let p = self.partial.entry(id.clone()).or_default();
        if c.total_chunks > 0 {
            match p.total {
                Some(t) if t != c.total_chunks => {
                    return Err(bad(format!("tensor {id}: total_chunks changed from {t} to {}", c.total_chunks)));
                }
                _ => p.total = Some(c.total_chunks),
            }
        }
        if let Some(t) = p.total
            && c.chunk_number >= t
        {
            return Err(bad(format!("tensor {id}: chunk {} of a tensor with {t} chunks", c.chunk_number)));
        }
        if c.is_last {
            p.last = Some(c.chunk_number);
        }
        if p.chunks.len() >= MAX_CHUNKS {
            return Err(Status::new(Code::ResourceExhausted, format!("tensor {id}: more than {MAX_CHUNKS} chunks")));
        }
        // A copy: the chunk's bytes would otherwise pin the whole gRPC
        // message buffer they were decoded from.
        if p.chunks.insert(c.chunk_number, Bytes::copy_from_slice(&c.data)).is_some() {
            return Err(bad(format!("tensor {id}: chunk {} sent twice", c.chunk_number)));
        }
        if p.metadata.is_empty() {
            p.metadata = c.metadata;
        }
        p.bytes += cost;
        self.buffered += cost;
        let expected = p.total.or(p.last.and_then(|l| l.checked_add(1)));
        if expected != Some(p.chunks.len() as u32) {
            return Ok(None);
        }
        let p = self.partial.remove(&id).unwrap_or_default();
        self.buffered -= p.bytes;
        if let Some(h) = &mut self.held {
            h.shrink(p.bytes);
        }
        if p.chunks.keys().copied().ne(0..p.chunks.len() as u32) {
            return Err(bad(format!("tensor {id}: chunk numbers are not 0..{}", p.chunks.len())));
        }
        let bytes = if p.chunks.len() == 1 {
            p.chunks.into_values().next().unwrap_or_default()
        } else {
            let total: usize = p.chunks.values().map(Bytes::len).sum();
            match &self.pool {
                Some(pool) if pool.pools(total) => {
                    let mut lease = pool
                        .acquire(total, "compat reassembly")
                        .map_err(|e| Status::new(Code::ResourceExhausted, format!("tensor {id}: {e}")))?;
                    let mut at = 0;
                    for v in p.chunks.values() {
                        lease.buf()[at..at + v.len()].copy_from_slice(v);
                        at += v.len();
                    }
                    lease.into_bytes()
                }
                _ => {
                    let mut b = BytesMut::with_capacity(total);
                    for v in p.chunks.values() {
                        b.extend_from_slice(v);
                    }
                    b.freeze()
                }
            }
        };
        Ok(Some(Assembled { id, bytes, metadata: p.metadata }))
    }

    /// Fails when a tensor was left incomplete.
    pub(crate) fn finish(&self) -> Result<(), Status> {
        match self.partial.iter().next() {
            None => Ok(()),
            Some((id, p)) => Err(Status::new(
                Code::InvalidArgument,
                format!(
                    "the stream ended with tensor {id} incomplete ({} chunks of {})",
                    p.chunks.len(),
                    p.total.map_or("unknown".to_string(), |t| t.to_string())
                ),
            )),
        }
    }
}

/// Decodes `torch.save()` bytes of one tensor (safely: no pickle code runs).
pub(crate) fn decode_tensor(bytes: Bytes, limits: &Limits) -> Result<Tensor, Status> {
    let v = torch::load(bytes, &limits.decode_limits())
        .map_err(|e| Status::new(Code::InvalidArgument, format!("not a torch.save() file: {e}")))?;
    match v {
        TorchObject::Tensor(t) => Ok(t),
        other => match other.as_tensor() {
            Some(t) => Ok(t.clone()),
            None => Err(Status::new(Code::InvalidArgument, "the torch.save() data does not hold one tensor")),
        },
    }
}

fn random_id() -> String {
    use rand::RngCore;
    let mut b = [0u8; 16];
    rand::rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `torch.save()`s a tensor and cuts the bytes into chunks of at most
/// `chunk` bytes; the first carries the seed's metadata.
pub(crate) fn encode_chunks(t: &Tensor, chunk: usize) -> Result<Vec<TensorChunk>, Status> {
    let chunk = chunk.max(1);
    let pieces = torch::save(&TorchObject::Tensor(t.clone()), &SaveOptions::default())
        .map_err(|e| Status::new(Code::Internal, format!("torch.save encoding failed: {e}")))?;
    let size: usize = pieces.iter().map(Bytes::len).sum();
    // Large pieces are sliced (no copy); small ones are gathered.
    let mut out: Vec<Bytes> = Vec::with_capacity(size / chunk + 2);
    let mut buf = BytesMut::new();
    for mut p in pieces {
        while !p.is_empty() {
            if buf.is_empty() && p.len() >= chunk {
                out.push(p.split_to(chunk));
                continue;
            }
            let n = (chunk - buf.len()).min(p.len());
            buf.extend_from_slice(&p.split_to(n));
            if buf.len() == chunk {
                out.push(buf.split().freeze());
            }
        }
    }
    if !buf.is_empty() {
        out.push(buf.freeze());
    }
    let id = random_id();
    let total = out.len() as u32;
    let shape = format!("[{}]", t.shape().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "));
    Ok(out
        .into_iter()
        .enumerate()
        .map(|(i, data)| TensorChunk {
            tensor_id: id.clone(),
            chunk_number: i as u32,
            data,
            total_chunks: total,
            is_last: i as u32 + 1 == total,
            metadata: if i == 0 {
                let mut m = HashMap::from([
                    ("shape".to_string(), shape.clone()),
                    ("dtype".to_string(), format!("torch.{}", t.dtype().name())),
                    ("device".to_string(), t.device().to_string()),
                    ("size_bytes".to_string(), size.to_string()),
                ]);
                if let Some(n) = t.name() {
                    m.insert("name".to_string(), n.to_string());
                }
                m
            } else {
                HashMap::new()
            },
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: &str, n: u32, total: u32, data: &'static [u8]) -> TensorChunk {
        TensorChunk {
            tensor_id: id.into(),
            chunk_number: n,
            data: Bytes::from_static(data),
            total_chunks: total,
            is_last: n + 1 == total,
            metadata: HashMap::new(),
        }
    }

    #[test]
    fn out_of_order_interleaved_chunks_reassemble() {
        let mut a = Assembler::new(1 << 20, None);
        assert!(a.push(chunk("x", 1, 3, b"bb")).unwrap().is_none());
        assert!(a.push(chunk("y", 0, 1, b"yy")).unwrap().is_some_and(|a| &a.bytes[..] == b"yy" && a.id == "y"));
        assert!(a.push(chunk("x", 2, 3, b"c")).unwrap().is_none());
        let x = a.push(chunk("x", 0, 3, b"aa")).unwrap().unwrap();
        assert_eq!(&x.bytes[..], b"aabbc");
        a.finish().unwrap();
    }

    /// A tensor's id and metadata count against the limit: a one-byte
    /// chunk with megabytes of metadata is refused.
    #[test]
    fn ids_and_metadata_count() {
        let mut a = Assembler::new(1 << 20, None);
        let mut c = chunk("x", 0, 2, b"a");
        c.metadata.insert("k".into(), "v".repeat(2 << 20));
        assert_eq!(a.push(c).unwrap_err().code, Code::ResourceExhausted);
        let c = TensorChunk { tensor_id: "i".repeat(2 << 20), ..chunk("x", 0, 2, b"a") };
        assert_eq!(a.push(c).unwrap_err().code, Code::ResourceExhausted);
        assert!(a.push(chunk("x", 0, 2, b"a")).unwrap().is_none());
    }

    #[test]
    fn bad_chunks_are_refused() {
        let mut a = Assembler::new(2 * (1 + CHUNK_OVERHEAD), None);
        assert_eq!(a.push(chunk("", 0, 1, b"a")).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(a.push(chunk("x", 5, 3, b"a")).unwrap_err().code, Code::InvalidArgument);
        assert!(a.push(chunk("x", 0, 3, b"a")).unwrap().is_none());
        assert_eq!(a.push(chunk("x", 0, 3, b"a")).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(a.push(chunk("x", 1, 4, b"a")).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(a.push(chunk("x", 1, 3, b"aaaa")).unwrap_err().code, Code::ResourceExhausted);
        assert!(a.finish().unwrap_err().message.contains("incomplete"));
    }

    #[test]
    fn one_budget_bounds_every_call_and_counts_the_overhead() {
        // Room for three such chunks and two one-byte ids.
        let budget = MemoryBudget::new(3 * (100 + CHUNK_OVERHEAD) + 2);
        let mut a = Assembler::new(1 << 20, Some(&budget));
        let mut b = Assembler::new(1 << 20, Some(&budget));
        assert!(a.push(chunk("x", 0, 3, &[1; 100])).unwrap().is_none());
        assert!(a.push(chunk("x", 1, 3, &[1; 100])).unwrap().is_none());
        // (The tensor's id, "x", counts once.)
        assert_eq!(budget.used(), 2 * (100 + CHUNK_OVERHEAD) + 1);
        let e = b.push(chunk("y", 0, 3, &[1; 200])).unwrap_err();
        assert_eq!(e.code, Code::ResourceExhausted, "{e}");
        assert!(b.push(chunk("y", 0, 3, &[1; 100])).unwrap().is_none());
        drop(a);
        assert_eq!(budget.used(), 100 + CHUNK_OVERHEAD + 1, "a dropped call gives its reservation back");
        assert!(b.push(chunk("y", 1, 3, &[1; 1])).unwrap().is_none());
        assert!(b.push(chunk("y", 2, 3, &[1; 1])).unwrap().is_some());
        assert_eq!(budget.used(), 0, "a finished tensor leaves the reassembly budget");
    }

    #[test]
    fn chunks_carry_the_seed_metadata_and_round_trip() {
        let t = Tensor::from_slice([250, 400], &(0..100_000).map(|i| i as f32).collect::<Vec<_>>()).unwrap();
        let cs = encode_chunks(&t, 64 << 10).unwrap();
        assert!(cs.len() > 5);
        assert!(cs.iter().all(|c| c.data.len() <= 64 << 10 && c.total_chunks == cs.len() as u32));
        let m = &cs[0].metadata;
        assert_eq!(m["shape"], "[250, 400]");
        assert_eq!(m["dtype"], "torch.float32");
        assert_eq!(m["device"], "cpu");
        let size: usize = cs.iter().map(|c| c.data.len()).sum();
        assert_eq!(m["size_bytes"], size.to_string());
        let mut a = Assembler::new(1 << 30, None);
        let mut out = None;
        for c in cs.into_iter().rev() {
            out = a.push(c).unwrap().or(out);
        }
        let back = decode_tensor(out.unwrap().bytes, &Limits::default()).unwrap();
        assert_eq!(back.as_slice::<f32>().unwrap(), t.as_slice::<f32>().unwrap());
    }
}
