//! [`StoreService`]: what `tensorwire serve` runs. `send` stores tensors by
//! name, `fetch` returns them (or generates random ones, like the Python
//! seed's `SendTensors`), `exchange` echoes; `list` and `remove` show and
//! delete what it holds.
//!
//! **State dicts.** A send whose request carries `state_dict = m` stores its
//! tensors as one state dict: each under `m.<key>` (its name on the wire is
//! the key), in the order sent. It replaces the state dict `m` as a whole
//! once every tensor has arrived, and not at all if the call fails, so
//! readers never see half of an update. `fetch` with `name = m` (when no
//! tensor is named `m`) or `state_dict = m` returns the tensors in that
//! order, each storage once (tied weights and views stay shared). The
//! catalog beside the tensors (`catalog.rs`) records state dicts and ages.
//!
//! **Deltas** (`tensorwire_codecs::delta`). A sent tensor carrying a delta
//! header is applied to the tensor stored under its name (the base its hash
//! must match) and the result, checked by CRC-32C, is stored. When a named
//! tensor is replaced, the version it replaces is kept as a *base* so that a
//! client still holding it can `fetch` with `delta_base = HASH` and receive
//! only the difference. Bases count against the store's byte budget and are
//! the first thing dropped when room is needed (they are a cache: losing one
//! only means the next delta fetch fails with the base hash named, and the
//! client fetches whole). State dicts keep no bases.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use async_trait::async_trait;
use tensorwire_codecs::delta::{self, ContentHash, DeltaError, DeltaHeader};
use tensorwire_codecs::{DType, Tensor};

use crate::error::Status;
use crate::pipeline::tensors::{TensorSink, TensorStream};
use crate::rpc::builtins::random_tensor;
use crate::rpc::call::{CallContext, FetchRequest, SendSummary};
use crate::rpc::listing::{Selector, StoreUsage, StoredTensor};
use crate::server::catalog::Catalog;
use crate::server::service::TensorService;
use crate::util::sync::{lock, read, write};

/// What a full store does with a new tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictPolicy {
    /// Refuse it (`RESOURCE_EXHAUSTED`); nothing stored is dropped. The default.
    #[default]
    Refuse,
    /// Drop the least recently stored or fetched tensors (a state dict as a
    /// whole) until it fits, and give memory back the same way when the
    /// server's memory budget runs out.
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

/// Keeps tensors in memory by name, up to a byte budget.
#[derive(Debug)]
pub struct StoreService {
    tensors: RwLock<BTreeMap<String, Tensor>>,
    max_bytes: u64,
    policy: EvictPolicy,
    used: AtomicU64,
    unnamed: AtomicU64,
    catalog: Catalog,
    /// Tick of each name's last store or fetch (LRU order).
    last_used: Mutex<HashMap<String, u64>>,
    tick: AtomicU64,
    evicted: AtomicU64,
    /// The version each named tensor replaced, kept as a delta base.
    bases: Mutex<HashMap<String, Tensor>>,
    /// Bytes held by `bases` (within `max_bytes` together with `used`).
    base_bytes: AtomicU64,
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
            catalog: Catalog::default(),
            last_used: Mutex::new(HashMap::new()),
            tick: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            bases: Mutex::new(HashMap::new()),
            base_bytes: AtomicU64::new(0),
        }
    }

    /// Drops every kept delta base; returns the bytes freed.
    fn drop_bases(&self) -> u64 {
        let mut b = lock(&self.bases);
        b.clear();
        self.base_bytes.swap(0, Ordering::AcqRel)
    }

    /// Drops the delta base kept for `name`.
    fn drop_base(&self, name: &str) {
        if let Some(t) = lock(&self.bases).remove(name) {
            self.base_bytes.fetch_sub(t.nbytes() as u64, Ordering::AcqRel);
        }
    }

    /// Bytes held as delta bases (the versions stored tensors replaced).
    pub fn base_bytes(&self) -> u64 {
        self.base_bytes.load(Ordering::Acquire)
    }

    /// The tensor `t` stands for: itself, or when it is a delta, the delta
    /// applied to the tensor stored as `name` (its base).
    fn resolve(&self, name: &str, t: Tensor) -> Result<Tensor, Status> {
        let Some(h) = DeltaHeader::of(&t).map_err(|e| Status::invalid_argument(format!("{name:?}: {e}")))? else {
            return Ok(t);
        };
        let base = read(&self.tensors)
            .get(name)
            .cloned()
            .ok_or_else(|| delta_status(name, DeltaError::MissingBase { name: name.to_string(), expected: h.base }))?;
        delta::apply(&t, &base).map_err(|e| delta_status(name, e))
    }

    /// `name` as a delta against the base whose hash is `base_hex`: the
    /// stored tensor when it has that hash (an all-zero delta), else the
    /// version it replaced when that has it.
    fn delta_for(&self, name: &str, base_hex: &str) -> Result<Tensor, Status> {
        let want: ContentHash = base_hex.parse().map_err(|e: DeltaError| Status::invalid_argument(e.to_string()))?;
        let current = self.get(name).ok_or_else(|| self.missing(name))?;
        let hash = |t: &Tensor| ContentHash::of(t).map_err(|e| Status::invalid_argument(e.to_string()));
        let base = if hash(&current)? == want {
            current.clone()
        } else {
            match lock(&self.bases).get(name).cloned() {
                Some(b) if hash(&b)? == want => b,
                _ => {
                    return Err(delta_status(name, DeltaError::MissingBase { name: name.to_string(), expected: want }));
                }
            }
        };
        delta::encode(&current, &base).map_err(|e| delta_status(name, e))
    }

    fn touch(&self, name: &str) {
        let t = self.tick.fetch_add(1, Ordering::Relaxed);
        lock(&self.last_used).insert(name.to_string(), t);
    }

    /// Forgets everything kept beside the tensor `name` once it is gone
    /// from the map: its delta base, its catalog entry (and place in its
    /// state dict), its LRU tick. Call with the map locked.
    fn forget(&self, name: &str) {
        self.drop_base(name);
        self.catalog.forget(name);
        lock(&self.last_used).remove(name);
    }

    /// A stored tensor.
    pub fn get(&self, name: &str) -> Option<Tensor> {
        // Touched under the map's lock: a remove in between would leave a
        // tick for a name no longer stored.
        let map = read(&self.tensors);
        let t = map.get(name).cloned();
        if t.is_some() {
            self.touch(name);
        }
        t
    }

    /// Payload bytes stored.
    pub fn bytes(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Tensors dropped by eviction so far.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Ordering::Acquire)
    }

    /// Drops least recently used tensors until `wanted` bytes are freed;
    /// returns the bytes freed. A member of a state dict takes its whole
    /// state dict with it, so none is left partial. Never drops a name in
    /// `keep` (what the caller is storing or replacing), nor a state dict
    /// one of them belongs to: evicting it would take the kept name too,
    /// under the caller's accounting. Drops nothing when all it may drop
    /// would not free `wanted` (the caller is refused either way, and keeps
    /// what is stored). Call with the map locked.
    fn evict(&self, map: &mut BTreeMap<String, Tensor>, wanted: u64, keep: &[&str]) -> u64 {
        let kept_groups: HashSet<String> = keep.iter().filter_map(|k| self.catalog.describe(k).0).collect();
        // A name that may go, with the state dict it belongs to.
        let candidate = |k: &str| {
            let group = self.catalog.describe(k).0;
            let may = !keep.contains(&k) && group.as_ref().is_none_or(|g| !kept_groups.contains(g));
            may.then_some(group)
        };
        let evictable: u64 = map.iter().filter(|(k, _)| candidate(k).is_some()).map(|(_, t)| t.nbytes() as u64).sum();
        if evictable < wanted {
            return 0;
        }
        let mut freed = 0;
        while freed < wanted {
            let victim = {
                let lu = lock(&self.last_used);
                map.keys()
                    .filter_map(|k| Some((k, candidate(k)?)))
                    .min_by_key(|(k, _)| lu.get(*k).copied().unwrap_or(0))
                    .map(|(k, g)| (k.clone(), g))
            };
            let Some((victim, group)) = victim else { break };
            let mut names = group.and_then(|g| self.catalog.members(&g)).unwrap_or_default();
            if !names.contains(&victim) {
                names.push(victim);
            }
            for n in names {
                if let Some(t) = map.remove(&n) {
                    let b = t.nbytes() as u64;
                    freed += b;
                    self.used.fetch_sub(b, Ordering::AcqRel);
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(name = %n, bytes = b, "evicted from the store");
                }
                self.forget(&n);
            }
        }
        freed
    }

    /// Names of stored tensors, sorted.
    pub fn names(&self) -> Vec<String> {
        read(&self.tensors).keys().cloned().collect()
    }

    /// Stores `t` under `name`, replacing any tensor of that name.
    pub fn put(&self, name: String, t: Tensor) -> Result<(), Status> {
        let n = t.nbytes() as u64;
        let mut map = write(&self.tensors);
        let freed = map.get(&name).map_or(0, |old| old.nbytes() as u64);
        let over = |used: u64| used.saturating_sub(freed).saturating_add(n).saturating_sub(self.max_bytes);
        // Delta bases are a cache: they make room before anything stored does.
        if over(self.used.load(Ordering::Acquire) + self.base_bytes()) > 0 {
            self.drop_bases();
        }
        let short = over(self.used.load(Ordering::Acquire));
        if short > 0 && self.policy == EvictPolicy::Lru && n <= self.max_bytes {
            // Never `name` itself nor its state dict, so `freed` still holds.
            self.evict(&mut map, short, &[name.as_str()]);
        }
        let used = self.used.load(Ordering::Acquire);
        if over(used) > 0 {
            return Err(Status::resource_exhausted(format!(
                "storing {name:?} ({n} bytes) would exceed the store's {} byte budget ({used} used; policy {})",
                self.max_bytes, self.policy
            )));
        }
        self.catalog.stored(&name);
        self.touch(&name);
        let replaced = map.insert(name.clone(), t);
        let used = used.saturating_sub(freed) + n;
        self.used.store(used, Ordering::Release);
        self.drop_base(&name);
        if let Some(old) = replaced {
            let b = old.nbytes() as u64;
            if used + self.base_bytes() + b <= self.max_bytes {
                lock(&self.bases).insert(name, old);
                self.base_bytes.fetch_add(b, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    /// Stores `items` as the state dict `name`: each tensor under
    /// `name.<key>`, in this order, replacing any state dict `name` (and
    /// tensors of the new names) as a whole, or nothing when the budget
    /// does not allow it.
    pub fn put_state_dict(&self, name: &str, items: Vec<(String, Tensor)>) -> Result<(), Status> {
        check_state_dict_name(name)?;
        let names: Vec<String> = items.iter().map(|(k, _)| format!("{name}.{k}")).collect();
        let mut seen = HashSet::new();
        if let Some(k) = items.iter().map(|(k, _)| k).find(|k| !seen.insert(*k)) {
            return Err(Status::invalid_argument(format!("state dict {name:?} has the key {k:?} twice")));
        }
        let new: u64 = items.iter().map(|(_, t)| t.nbytes() as u64).sum();
        let mut map = write(&self.tensors);
        let old = self.catalog.members(name).unwrap_or_default();
        let replaced: Vec<&str> =
            old.iter().chain(&names).map(String::as_str).collect::<HashSet<_>>().into_iter().collect();
        let freed: u64 = replaced.iter().filter_map(|n| map.get(*n)).map(|t| t.nbytes() as u64).sum();
        let over = |used: u64| used.saturating_sub(freed).saturating_add(new).saturating_sub(self.max_bytes);
        // As in `put`: delta bases make room first, then (LRU) the least
        // recently used tensors other than those this update replaces.
        if over(self.used.load(Ordering::Acquire) + self.base_bytes()) > 0 {
            self.drop_bases();
        }
        let short = over(self.used.load(Ordering::Acquire));
        if short > 0 && self.policy == EvictPolicy::Lru && new <= self.max_bytes {
            self.evict(&mut map, short, &replaced);
        }
        let used = self.used.load(Ordering::Acquire);
        if over(used) > 0 {
            return Err(Status::resource_exhausted(format!(
                "storing state dict {name:?} ({new} bytes) would exceed the store's {} byte budget ({used} used, {freed} freed by what it replaces; policy {})",
                self.max_bytes, self.policy
            )));
        }
        for n in &replaced {
            map.remove(*n);
            // State dicts keep no delta bases, nor LRU ticks of old members
            // (their catalog entries are set anew just below).
            self.forget(n);
        }
        for (n, (_, t)) in names.iter().zip(items) {
            map.insert(n.clone(), t.with_name(n.clone()));
            self.touch(n);
        }
        self.catalog.set_state_dict(name, &names);
        self.used.store(used.saturating_sub(freed) + new, Ordering::Release);
        Ok(())
    }

    /// The state dict `name`: its keys and tensors, in order.
    pub fn get_state_dict(&self, name: &str) -> Option<Vec<(String, Tensor)>> {
        let map = read(&self.tensors);
        let members = self.catalog.members(name)?;
        let prefix = format!("{name}.");
        // A fetch counts as a use of every member (LRU order).
        members.iter().for_each(|n| self.touch(n));
        Some(
            members
                .iter()
                .filter_map(|n| Some((n.strip_prefix(&prefix).unwrap_or(n).to_string(), map.get(n)?.clone())))
                .collect(),
        )
    }

    /// Receives the tensors of a send as the state dict `name`, checking
    /// the budget as they arrive; stores them once all are there.
    async fn receive_state_dict(&self, name: &str, tensors: &mut TensorStream) -> Result<SendSummary, Status> {
        check_state_dict_name(name)?;
        let replaced: u64 = {
            let map = read(&self.tensors);
            self.catalog
                .members(name)
                .unwrap_or_default()
                .iter()
                .filter_map(|n| map.get(n))
                .map(|t| t.nbytes() as u64)
                .sum()
        };
        let mut items: Vec<(String, Tensor)> = Vec::new();
        let mut keys = HashSet::new();
        let mut staged = 0u64;
        while let Some(t) = tensors.next().await {
            let t = t.map_err(Status::from)?;
            let key = t.name().filter(|k| !k.is_empty()).map(str::to_string).ok_or_else(|| {
                Status::invalid_argument(format!("tensor {} of state dict {name:?} has no name (its key)", items.len()))
            })?;
            if !keys.insert(key.clone()) {
                return Err(Status::invalid_argument(format!("state dict {name:?} has the key {key:?} twice")));
            }
            staged += t.nbytes() as u64;
            // Early refusal of what cannot fit: under LRU, eviction can make
            // room for anything up to the whole budget (`put_state_dict`).
            let used = match self.policy {
                EvictPolicy::Lru => 0,
                EvictPolicy::Refuse => self.used.load(Ordering::Acquire),
            };
            if used.saturating_sub(replaced) + staged > self.max_bytes {
                return Err(Status::resource_exhausted(format!(
                    "state dict {name:?}: {staged} bytes so far would exceed the store's {} byte budget ({used} used)",
                    self.max_bytes
                )));
            }
            items.push((key, t));
        }
        let n = items.len();
        self.put_state_dict(name, items)?;
        Ok(SendSummary {
            received: n as u64,
            bytes: staged,
            message: format!("stored state dict {name} ({n} tensors)"),
        })
    }

    fn stored(&self, name: &str, t: &Tensor) -> StoredTensor {
        let (state_dict, age) = self.catalog.describe(name);
        StoredTensor {
            name: name.to_string(),
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            bytes: t.nbytes() as u64,
            state_dict,
            age,
        }
    }

    /// What `which` selects: by name (a tensor, else a state dict's tensors
    /// in order; None: neither), or by prefix (sorted by name).
    fn select(&self, map: &BTreeMap<String, Tensor>, which: &Selector) -> Option<Vec<String>> {
        match which {
            Selector::Name(n) if map.contains_key(n) => Some(vec![n.clone()]),
            Selector::Name(n) => self.catalog.members(n),
            Selector::Prefix(p) => Some(
                map.range(p.clone()..).take_while(|(k, _)| k.starts_with(p.as_str())).map(|(k, _)| k.clone()).collect(),
            ),
        }
    }

    /// NOT_FOUND for what `which` names (built without the map's lock held).
    fn not_selected(&self, which: &Selector) -> Status {
        match which {
            Selector::Name(n) | Selector::Prefix(n) => self.missing(n),
        }
    }

    /// The error for a name not stored: names the tensor and how many are
    /// stored, never the stored names (they may be many, and not the
    /// caller's to know). Takes the map's read lock: call it without the
    /// write lock held.
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
    async fn send(&self, ctx: &CallContext, tensors: &mut TensorStream) -> Result<SendSummary, Status> {
        if let Some(name) = ctx.param("state_dict") {
            return self.receive_state_dict(name, tensors).await;
        }
        let mut s = SendSummary::default();
        let mut names = Vec::new();
        while let Some(t) = tensors.next().await {
            let t = t.map_err(Status::from)?;
            let name = match t.name() {
                Some(n) => n.to_string(),
                // The next `tensor-N` no stored tensor has (never a
                // tensor a client named so).
                None => loop {
                    let n = format!("tensor-{}", self.unnamed.fetch_add(1, Ordering::Relaxed));
                    if !read(&self.tensors).contains_key(&n) {
                        break n;
                    }
                },
            };
            s.received += 1;
            s.bytes += t.nbytes() as u64;
            let t = self.resolve(&name, t)?;
            self.put(name.clone(), t)?;
            names.push(name);
        }
        s.message = format!("stored {}", names.join(", "));
        Ok(s)
    }

    async fn fetch(&self, ctx: &CallContext, req: &FetchRequest, out: &mut TensorSink<'_>) -> Result<(), Status> {
        if let Some(name) = req.get("state_dict") {
            let sd = self.get_state_dict(name).ok_or_else(|| self.missing(name))?;
            return out.send_state_dict(&sd.into_iter().map(|(_, t)| t).collect::<Vec<_>>()).await;
        }
        if let (Some(name), Some(base)) = (req.get("name"), req.get("delta_base")) {
            return out.send(self.delta_for(name, base)?).await;
        }
        if let Some(name) = req.get("name") {
            if let Some(t) = self.get(name) {
                return out.send(t).await;
            }
            let sd = self.get_state_dict(name).ok_or_else(|| self.missing(name))?;
            return out.send_state_dict(&sd.into_iter().map(|(_, t)| t).collect::<Vec<_>>()).await;
        }
        if let Some(list) = req.get("names") {
            for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                let t = self.get(name).ok_or_else(|| self.missing(name))?;
                out.send(t).await?;
            }
            return Ok(());
        }
        if req.get("all").is_some() {
            let all: Vec<Tensor> = read(&self.tensors).values().cloned().collect();
            for t in all {
                out.send(t).await?;
            }
            return Ok(());
        }
        if let Some(shape) = req.get("shape") {
            // The seed's SendTensors: `count` random tensors of `shape`.
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
            "fetch needs a parameter: name=N, state_dict=N, names=A,B, all=1, or shape=D1,D2[,count=K][,dtype=D]",
        ))
    }

    async fn list(&self, _ctx: &CallContext, which: &Selector) -> Result<Vec<StoredTensor>, Status> {
        let map = read(&self.tensors);
        let Some(names) = self.select(&map, which) else {
            drop(map);
            return Err(self.not_selected(which));
        };
        Ok(names.iter().filter_map(|n| Some(self.stored(n, map.get(n)?))).collect())
    }

    async fn remove(&self, _ctx: &CallContext, which: &Selector) -> Result<Vec<StoredTensor>, Status> {
        let mut map = write(&self.tensors);
        let Some(names) = self.select(&map, which) else {
            drop(map);
            return Err(self.not_selected(which));
        };
        let mut removed = Vec::with_capacity(names.len());
        for n in names {
            if let Some(t) = map.remove(&n) {
                removed.push(self.stored(&n, &t));
                self.used.fetch_sub(t.nbytes() as u64, Ordering::AcqRel);
            }
            self.forget(&n);
        }
        Ok(removed)
    }

    fn reclaim(&self, wanted: u64) -> u64 {
        let freed = self.drop_bases();
        if self.policy != EvictPolicy::Lru || freed >= wanted {
            return freed;
        }
        let mut map = write(&self.tensors);
        freed + self.evict(&mut map, wanted - freed, &[])
    }

    fn supports_delta(&self) -> bool {
        true
    }

    fn usage(&self) -> Option<StoreUsage> {
        let map = read(&self.tensors);
        Some(StoreUsage {
            tensors: map.len() as u64,
            bytes: self.used.load(Ordering::Acquire),
            max_bytes: self.max_bytes,
        })
    }
}

/// The status of a delta that cannot be applied or made: the base hash is
/// in the message (wrong or missing base: FAILED_PRECONDITION, so the
/// client knows to send or fetch whole; corrupt: DATA_LOSS).
fn delta_status(name: &str, e: DeltaError) -> Status {
    let msg = format!("{name:?}: {e}");
    match e {
        DeltaError::Checksum { .. } => Status::data_loss(msg),
        DeltaError::Header(_) | DeltaError::Tensor(_) => Status::invalid_argument(msg),
        _ => Status::failed_precondition(msg),
    }
}

fn check_state_dict_name(name: &str) -> Result<(), Status> {
    if name.is_empty() {
        return Err(Status::invalid_argument("a state dict needs a name"));
    }
    Ok(())
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
        s.put("a".into(), u8s(40)).unwrap();
        s.put("b".into(), u8s(40)).unwrap();
        assert!(s.get("a").is_some()); // a is now more recent than b
        s.put("c".into(), u8s(40)).unwrap();
        assert_eq!(s.names(), vec!["a", "c"]);
        assert_eq!((s.bytes(), s.evicted()), (80, 1));
        assert_eq!(s.reclaim(50), 80, "reclaim drops whole tensors, oldest first");
        assert_eq!(s.bytes(), 0);
        assert!(s.put("huge".into(), u8s(101)).is_err(), "a tensor above the whole store is refused");
        assert_eq!(StoreService::new(10).reclaim(5), 0, "refuse never evicts");
    }

    /// The store's byte count is the sum of what it holds.
    fn consistent(s: &StoreService) {
        let held: u64 = read(&s.tensors).values().map(|t| t.nbytes() as u64).sum();
        assert_eq!(s.bytes(), held, "stored bytes drifted from what is held");
        let lu = lock(&s.last_used);
        assert!(lu.keys().all(|k| read(&s.tensors).contains_key(k)), "LRU ticks of names no longer stored");
    }

    #[test]
    fn lru_never_evicts_the_name_being_stored_nor_its_state_dict() {
        // Replacing a member of a state dict: the state dict is the only
        // victim, and evicting it would take the name being stored.
        let s = StoreService::with_policy(100, EvictPolicy::Lru);
        s.put_state_dict("m", vec![("w".into(), u8s(40)), ("b".into(), u8s(40))]).unwrap();
        let e = s.put("m.w".into(), u8s(70)).unwrap_err();
        assert_eq!(e.code, crate::Code::ResourceExhausted);
        assert_eq!(s.names(), vec!["m.b", "m.w"], "a refused store drops nothing");
        consistent(&s);
        // Nor when some victim exists but too small to make room.
        s.put("z".into(), u8s(10)).unwrap();
        assert!(s.put("m.w".into(), u8s(75)).is_err());
        assert_eq!(s.names(), vec!["m.b", "m.w", "z"], "a store refused anyway evicts nothing");
        assert_eq!(s.evicted(), 0);
        consistent(&s);
        // With another victim at hand, that one goes and the count holds.
        let s = StoreService::with_policy(200, EvictPolicy::Lru);
        s.put_state_dict("m", vec![("w".into(), u8s(40)), ("b".into(), u8s(40))]).unwrap();
        s.put("z".into(), u8s(60)).unwrap();
        s.put("a".into(), u8s(10)).unwrap();
        assert!(s.get("m.w").is_some() && s.get("a").is_some());
        s.put("m.w".into(), u8s(120)).unwrap();
        assert_eq!(s.names(), vec!["a", "m.b", "m.w"]);
        assert_eq!(s.bytes(), 170);
        consistent(&s);
        let ctx = CallContext::local();
        run(s.remove(&ctx, &Selector::Name("m.w".into()))).unwrap();
        run(s.remove(&ctx, &Selector::Name("a".into()))).unwrap();
        assert_eq!(s.bytes(), 40);
        consistent(&s);
    }

    #[test]
    fn state_dicts_take_part_in_lru() {
        let s = StoreService::with_policy(100, EvictPolicy::Lru);
        s.put("old".into(), u8s(30)).unwrap();
        s.put_state_dict("m", vec![("w".into(), u8s(30))]).unwrap();
        s.put("new".into(), u8s(30)).unwrap();
        // Fetched: the state dict is now the most recently used.
        assert!(s.get_state_dict("m").is_some());
        s.put("more".into(), u8s(30)).unwrap();
        assert_eq!(s.names(), vec!["m.w", "more", "new"], "the oldest plain tensor went, not the state dict");
        // A state dict stored into a full store makes room the same way.
        s.put_state_dict("n", vec![("a".into(), u8s(20)), ("b".into(), u8s(20))]).unwrap();
        assert_eq!(s.names(), vec!["m.w", "more", "n.a", "n.b"]);
        // Replacing it frees its old members first; nothing else goes.
        s.put_state_dict("n", vec![("a".into(), u8s(40))]).unwrap();
        assert_eq!(s.names(), vec!["m.w", "more", "n.a"]);
        consistent(&s);
        assert!(s.put_state_dict("big", vec![("x".into(), u8s(101))]).is_err(), "above the whole store");
        // Under refuse, nothing is evicted for a state dict either.
        let r = StoreService::new(50);
        r.put("a".into(), u8s(30)).unwrap();
        assert!(r.put_state_dict("m", vec![("w".into(), u8s(30))]).is_err());
        assert_eq!(r.names(), vec!["a"]);
    }

    #[test]
    fn state_dict_updates_count_delta_bases() {
        let s = StoreService::new(100);
        s.put("a".into(), u8s(50)).unwrap();
        s.put("a".into(), u8s(50)).unwrap();
        assert_eq!(s.base_bytes(), 50, "the replaced version is kept as a base");
        s.put_state_dict("m", vec![("w".into(), u8s(50))]).unwrap();
        assert_eq!(s.base_bytes(), 0, "bases make room for what is stored");
        assert!(s.bytes() + s.base_bytes() <= 100);
        consistent(&s);
    }

    #[test]
    fn removed_names_leave_no_lru_ticks() {
        let s = StoreService::with_policy(1000, EvictPolicy::Lru);
        let ctx = CallContext::local();
        for i in 0..50 {
            let name = format!("t{i}");
            s.put(name.clone(), u8s(1)).unwrap();
            run(s.remove(&ctx, &Selector::Name(name))).unwrap();
        }
        s.put_state_dict("m", vec![("a".into(), u8s(1)), ("b".into(), u8s(1))]).unwrap();
        s.put_state_dict("m", vec![("c".into(), u8s(1))]).unwrap();
        assert_eq!(lock(&s.last_used).len(), 1);
        consistent(&s);
    }

    #[test]
    fn a_remove_names_what_it_removes() {
        let get = |k: &str| if k == "prefix" { Some("") } else { None };
        assert_eq!(Selector::for_remove(get).unwrap(), Selector::Prefix(String::new()));
        let e = Selector::for_remove(|_| None).unwrap_err();
        assert!(e.contains("name=N") && e.contains("prefix=P"), "{e}");
        assert_eq!(Selector::from_params(|_| None), Selector::Prefix(String::new()), "list: everything");
    }

    fn run<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    fn u8s(n: usize) -> Tensor {
        Tensor::zeros(DType::UInt8, [n]).unwrap()
    }

    #[test]
    fn state_dicts_replace_whole_list_and_remove() {
        let s = StoreService::new(100);
        let ctx = CallContext::local();
        s.put("m.stale".into(), u8s(5)).unwrap();
        s.put_state_dict("m", vec![("w".into(), u8s(30)), ("b".into(), u8s(10))]).unwrap();
        let sd = s.get_state_dict("m").unwrap();
        assert_eq!(sd.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), vec!["w", "b"]);
        assert_eq!(sd[0].1.name(), Some("m.w"));
        // A new version replaces the old one as a whole (40 + 50 fits only
        // because the old 40 bytes are freed).
        s.put_state_dict("m", vec![("b".into(), u8s(50))]).unwrap();
        assert_eq!(s.get_state_dict("m").unwrap().len(), 1);
        assert!(s.get("m.w").is_none());
        assert_eq!(s.usage().unwrap().bytes, 55);
        let e = s.put_state_dict("m", vec![("b".into(), u8s(50)), ("c".into(), u8s(50))]).unwrap_err();
        assert_eq!(e.code, crate::Code::ResourceExhausted);
        assert_eq!(s.get_state_dict("m").unwrap().len(), 1, "a refused update changes nothing");
        assert!(s.put_state_dict("m", vec![("x".into(), u8s(1)), ("x".into(), u8s(1))]).is_err());
        // Listing: by name (the state dict, in order) or by prefix.
        let by_name = run(s.list(&ctx, &Selector::Name("m".into()))).unwrap();
        assert_eq!(by_name.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), vec!["m.b"]);
        assert_eq!((by_name[0].state_dict.as_deref(), by_name[0].key()), (Some("m"), "b"));
        let by_prefix = run(s.list(&ctx, &Selector::Prefix("m.".into()))).unwrap();
        assert_eq!(by_prefix.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), vec!["m.b", "m.stale"]);
        assert_eq!(run(s.list(&ctx, &Selector::Name("zz".into()))).unwrap_err().code, crate::Code::NotFound);
        assert_eq!(run(s.remove(&ctx, &Selector::Name("zz".into()))).unwrap_err().code, crate::Code::NotFound);
        // Removing the state dict takes its tensors and nothing else.
        let gone = run(s.remove(&ctx, &Selector::Name("m".into()))).unwrap();
        assert_eq!(gone.len(), 1);
        assert!(s.get_state_dict("m").is_none());
        assert_eq!(s.names(), vec!["m.stale"]);
        assert_eq!(run(s.remove(&ctx, &Selector::Prefix("m".into()))).unwrap().len(), 1);
        assert_eq!(s.usage().unwrap(), StoreUsage { tensors: 0, bytes: 0, max_bytes: 100 });
    }
}
