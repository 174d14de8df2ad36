//! [`StoreService`]: what `tensorwire serve` runs. `send` stores tensors by
//! name, `fetch` returns them (or generates random ones, like the Python
//! seed's `SendTensors`), `exchange` echoes.

use std::collections::BTreeMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use tensorwire_codecs::{DType, Tensor};

use crate::error::Status;
use crate::pipeline::tensors::{TensorSink, TensorStream};
use crate::rpc::builtins::random_tensor;
use crate::rpc::call::{CallContext, FetchRequest, SendSummary};
use crate::server::service::TensorService;
use crate::util::sync::{read, write};

/// What a full store does with a new tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictPolicy {
    /// Refuse it (`RESOURCE_EXHAUSTED`); nothing stored is dropped. The default.
    #[default]
    Refuse,
    /// Drop the least recently stored or fetched tensors until it fits, and
    /// give memory back the same way when the server's memory budget runs out.
    Lru,
}

impl std::str::FromStr for EvictPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "refuse" => Ok(Self::Refuse),
            "lru" => Ok(Self::Lru),
            other => Err(format!("unknown eviction policy {other:?} (refuse, lru)")),
        }
    }
}

impl std::fmt::Display for EvictPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Refuse => "refuse",
            Self::Lru => "lru",
        })
    }
}

#[derive(Debug)]
struct Entry {
    tensor: Tensor,
    /// Tick of the last store or fetch, for LRU eviction.
    used: AtomicU64,
}

/// Keeps tensors in memory by name, up to a byte budget.
#[derive(Debug)]
pub struct StoreService {
    tensors: RwLock<BTreeMap<String, Entry>>,
    max_bytes: u64,
    policy: EvictPolicy,
    used: AtomicU64,
    unnamed: AtomicU64,
    tick: AtomicU64,
    evicted: AtomicU64,
}

impl StoreService {
    /// A store holding at most `max_bytes` of tensor data; a full store refuses.
    pub fn new(max_bytes: u64) -> Self {
        Self::with_policy(max_bytes, EvictPolicy::Refuse)
    }

    /// A store holding at most `max_bytes`, full by `policy`.
    pub fn with_policy(max_bytes: u64, policy: EvictPolicy) -> Self {
        Self {
            tensors: RwLock::new(BTreeMap::new()),
            max_bytes,
            policy,
            used: AtomicU64::new(0),
            unnamed: AtomicU64::new(0),
            tick: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed)
    }

    /// A stored tensor.
    pub fn get(&self, name: &str) -> Option<Tensor> {
        read(&self.tensors).get(name).map(|e| {
            e.used.store(self.now(), Ordering::Relaxed);
            e.tensor.clone()
        })
    }

    /// Names of stored tensors, sorted.
    pub fn names(&self) -> Vec<String> {
        read(&self.tensors).keys().cloned().collect()
    }

    /// Payload bytes stored.
    pub fn bytes(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Tensors dropped by eviction so far.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Acquire)
    }

    /// Drops least recently used tensors (never `keep`) until `wanted`
    /// bytes are freed or none is left; returns the bytes freed. Call with
    /// the map locked.
    fn evict(&self, map: &mut BTreeMap<String, Entry>, wanted: u64, keep: Option<&str>) -> u64 {
        let mut freed = 0;
        while freed < wanted {
            let Some(victim) = map
                .iter()
                .filter(|(k, _)| Some(k.as_str()) != keep)
                .min_by_key(|(_, e)| e.used.load(Ordering::Relaxed))
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(e) = map.remove(&victim) {
                let n = e.tensor.nbytes() as u64;
                freed += n;
                self.used.fetch_sub(n, Ordering::AcqRel);
                self.evicted.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(name = %victim, bytes = n, "evicted from the store");
            }
        }
        freed
    }

    /// Stores `t` under `name`, replacing any tensor of that name.
    pub fn put(&self, name: String, t: Tensor) -> Result<(), Status> {
        let n = t.nbytes() as u64;
        let mut map = write(&self.tensors);
        let freed = map.get(&name).map_or(0, |old| old.tensor.nbytes() as u64);
        let over = |used: u64| (used - freed).saturating_add(n).saturating_sub(self.max_bytes);
        let short = over(self.used.load(Ordering::Acquire));
        if short > 0 && self.policy == EvictPolicy::Lru && n <= self.max_bytes {
            self.evict(&mut map, short, Some(&name));
        }
        let used = self.used.load(Ordering::Acquire);
        if over(used) > 0 {
            return Err(Status::resource_exhausted(format!(
                "storing {name:?} ({n} bytes) would exceed the store's {} byte budget ({used} used; policy {})",
                self.max_bytes, self.policy
            )));
        }
        map.insert(name, Entry { tensor: t, used: AtomicU64::new(self.now()) });
        self.used.store(used - freed + n, Ordering::Release);
        Ok(())
    }

    /// The error for a name not stored: names the tensor and how many are
    /// stored, never the stored names (they may be many, and not the
    /// caller's to know).
    fn missing(&self, name: &str) -> Status {
        let count = read(&self.tensors).len();
        Status::not_found(format!("no tensor named {name:?} (the store holds {count} tensors)"))
    }
}

impl Default for StoreService {
    fn default() -> Self {
        Self::new(crate::config::DEFAULT_MAX_STORE_BYTES)
    }
}

#[async_trait]
impl TensorService for StoreService {
    async fn send(&self, _ctx: &CallContext, tensors: &mut TensorStream) -> Result<SendSummary, Status> {
        let mut s = SendSummary::default();
        let mut names = Vec::new();
        while let Some(t) = tensors.next().await {
            let t = t.map_err(Status::from)?;
            let name = match t.name() {
                Some(n) => n.to_string(),
                None => format!("tensor-{}", self.unnamed.fetch_add(1, Ordering::Relaxed)),
            };
            s.received += 1;
            s.bytes += t.nbytes() as u64;
            self.put(name.clone(), t)?;
            names.push(name);
        }
        s.message = format!("stored {}", names.join(", "));
        Ok(s)
    }

    async fn fetch(&self, ctx: &CallContext, req: &FetchRequest, out: &mut TensorSink<'_>) -> Result<(), Status> {
        if let Some(name) = req.get("name") {
            let t = self.get(name).ok_or_else(|| self.missing(name))?;
            return out.send(t).await;
        }
        if let Some(list) = req.get("names") {
            for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                let t = self.get(name).ok_or_else(|| self.missing(name))?;
                out.send(t).await?;
            }
            return Ok(());
        }
        if req.get("all").is_some() {
            let all: Vec<Tensor> = read(&self.tensors).values().map(|e| e.tensor.clone()).collect();
            for t in all {
                out.send(t).await?;
            }
            return Ok(());
        }
        if let Some(shape) = req.get("shape") {
            // The seed's SendTensors: `count` random tensors of `shape`,
            // made one at a time, each checked against the limits first.
            let shape = parse_shape(shape).map_err(Status::invalid_argument)?;
            let count: u64 = req
                .get("count")
                .unwrap_or("1")
                .parse()
                .map_err(|_| Status::invalid_argument("count must be a number"))?;
            let dtype: DType = req
                .get("dtype")
                .unwrap_or("float32")
                .parse()
                .map_err(|e: tensorwire_codecs::dtype::UnknownDType| Status::invalid_argument(e.to_string()))?;
            let n = tensorwire_codecs::tensor::byte_size(dtype, &shape)
                .map_err(|e| Status::invalid_argument(e.to_string()))? as u64;
            if n > ctx.max_tensor_bytes() {
                return Err(Status::limit_exceeded(format!(
                    "a {dtype} tensor of shape {shape:?} is {n} bytes, above the server's max_tensor_bytes of {}",
                    ctx.max_tensor_bytes()
                )));
            }
            for i in 0..count {
                // Held against the memory budget while it is sent.
                let held = match ctx.budget() {
                    Some(b) => Some(
                        b.try_reserve(n, "generated tensor").map_err(|e| Status::resource_exhausted(e.to_string()))?,
                    ),
                    None => None,
                };
                let t = random_tensor(dtype, &shape, i)?.with_name(format!("random-{i}"));
                out.send(t).await?;
                drop(held);
            }
            return Ok(());
        }
        Err(Status::invalid_argument(
            "fetch needs a parameter: name=N, names=A,B, all=1, or shape=D1,D2[,count=K][,dtype=D]",
        ))
    }

    fn reclaim(&self, wanted: u64) -> u64 {
        if self.policy != EvictPolicy::Lru {
            return 0;
        }
        let mut map = write(&self.tensors);
        self.evict(&mut map, wanted, None)
    }
}

/// Parses `"64,1024"` (or `"[64, 1024]"`) into a shape.
pub fn parse_shape(s: &str) -> Result<Vec<usize>, String> {
    let t = s.trim().trim_start_matches(['[', '(']).trim_end_matches([']', ')']);
    if t.trim().is_empty() {
        return Ok(vec![]);
    }
    t.split(',')
        .map(|d| d.trim().parse::<usize>().map_err(|_| format!("bad shape {s:?}: {d:?} is not a size")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        assert_eq!(parse_shape("64,1024").unwrap(), vec![64, 1024]);
        assert_eq!(parse_shape("[50, 50]").unwrap(), vec![50, 50]);
        assert_eq!(parse_shape("").unwrap(), Vec::<usize>::new());
        assert!(parse_shape("3,x").is_err());
    }

    #[test]
    fn budget() {
        let s = StoreService::new(100);
        s.put("a".into(), Tensor::zeros(DType::UInt8, [60]).unwrap()).unwrap();
        assert_eq!(
            s.put("b".into(), Tensor::zeros(DType::UInt8, [60]).unwrap()).unwrap_err().code,
            crate::Code::ResourceExhausted
        );
        s.put("a".into(), Tensor::zeros(DType::UInt8, [90]).unwrap()).unwrap();
        assert_eq!(s.names(), vec!["a"]);
        let e = s.missing("zz");
        assert_eq!(e.code, crate::Code::NotFound);
        assert_eq!(e.message, "no tensor named \"zz\" (the store holds 1 tensors)");
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let s = StoreService::with_policy(100, EvictPolicy::Lru);
        let t = |n: usize| Tensor::zeros(DType::UInt8, [n]).unwrap();
        s.put("a".into(), t(40)).unwrap();
        s.put("b".into(), t(40)).unwrap();
        assert!(s.get("a").is_some()); // a is now more recent than b
        s.put("c".into(), t(40)).unwrap();
        assert_eq!(s.names(), vec!["a", "c"]);
        assert_eq!((s.bytes(), s.evicted()), (80, 1));
        assert_eq!(s.reclaim(50), 80, "reclaim drops whole tensors, oldest first");
        assert_eq!(s.bytes(), 0);
        assert!(s.put("huge".into(), t(101)).is_err(), "a tensor above the whole store is refused");
        assert_eq!(StoreService::new(10).reclaim(5), 0, "refuse never evicts");
    }
}
