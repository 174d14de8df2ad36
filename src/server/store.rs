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

/// Keeps tensors in memory by name, up to a byte budget.
#[derive(Debug)]
pub struct StoreService {
    tensors: RwLock<BTreeMap<String, Tensor>>,
    max_bytes: u64,
    used: AtomicU64,
    unnamed: AtomicU64,
}

impl StoreService {
    /// A store holding at most `max_bytes` of tensor data.
    pub fn new(max_bytes: u64) -> Self {
        Self { tensors: RwLock::new(BTreeMap::new()), max_bytes, used: AtomicU64::new(0), unnamed: AtomicU64::new(0) }
    }

    /// A stored tensor.
    pub fn get(&self, name: &str) -> Option<Tensor> {
        read(&self.tensors).get(name).cloned()
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
        let used = self.used.load(Ordering::Acquire);
        if used - freed + n > self.max_bytes {
            return Err(Status::resource_exhausted(format!(
                "storing {name:?} ({n} bytes) would exceed the store's {} byte budget ({used} used)",
                self.max_bytes
            )));
        }
        map.insert(name, t);
        self.used.store(used - freed + n, Ordering::Release);
        Ok(())
    }

    fn missing(&self, name: &str) -> Status {
        let names = self.names();
        Status::not_found(format!(
            "no tensor named {name:?}; stored: {}",
            if names.is_empty() { "none".to_string() } else { names.join(", ") }
        ))
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

    async fn fetch(&self, _ctx: &CallContext, req: &FetchRequest, out: &mut TensorSink<'_>) -> Result<(), Status> {
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
            for i in 0..count {
                out.send(random_tensor(dtype, &shape, i)?.with_name(format!("random-{i}"))).await?;
            }
            return Ok(());
        }
        Err(Status::invalid_argument(
            "fetch needs a parameter: name=N, names=A,B, all=1, or shape=D1,D2[,count=K][,dtype=D]",
        ))
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
    }
}
