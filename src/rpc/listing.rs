//! What a storing service holds, as `list` and `remove` report it
//! (`tensorwire ls`, `tensorwire rm`): [`StoredTensor`], [`StoreUsage`],
//! and the [`Selector`] both calls take.

use std::time::Duration;

use tensorwire_codecs::DType;
use tensorwire_proto::v1;

use crate::pipeline::wire::{dtype_from_wire, dtype_to_wire};

/// One tensor a store holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// Its name (`"m.layer.0.weight"` for a tensor of state dict `m`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes of its elements.
    pub bytes: u64,
    /// The state dict it belongs to, if any.
    pub state_dict: Option<String>,
    /// Time since it was stored.
    pub age: Duration,
}

impl StoredTensor {
    /// The key within its state dict (`"layer.0.weight"`), or the name.
    pub fn key(&self) -> &str {
        match &self.state_dict {
            Some(g) => self.name.strip_prefix(g.as_str()).and_then(|k| k.strip_prefix('.')).unwrap_or(&self.name),
            None => &self.name,
        }
    }

    pub(crate) fn to_wire(&self) -> v1::StoredTensor {
        v1::StoredTensor {
            name: self.name.clone(),
            dtype: dtype_to_wire(self.dtype) as i32,
            shape: self.shape.iter().map(|&d| d as u64).collect(),
            bytes: self.bytes,
            state_dict: self.state_dict.clone().unwrap_or_default(),
            age_ms: self.age.as_millis() as u64,
        }
    }

    pub(crate) fn from_wire(w: &v1::StoredTensor) -> Result<Self, String> {
        Ok(Self {
            name: w.name.clone(),
            dtype: dtype_from_wire(w.dtype)?.ok_or_else(|| format!("stored tensor {:?} has no dtype", w.name))?,
            shape: w
                .shape
                .iter()
                .map(|&d| usize::try_from(d).map_err(|_| format!("{d} overflows")))
                .collect::<Result<_, _>>()?,
            bytes: w.bytes,
            state_dict: (!w.state_dict.is_empty()).then(|| w.state_dict.clone()),
            age: Duration::from_millis(w.age_ms),
        })
    }
}

/// How much a store holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Tensors held.
    pub tensors: u64,
    /// Bytes of their elements.
    pub bytes: u64,
    /// The store's budget in bytes.
    pub max_bytes: u64,
}

/// Which stored tensors a `list` or `remove` call means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    /// The tensor of this name, or else every tensor of the state dict of
    /// this name (in the state dict's order).
    Name(String),
    /// Every tensor whose name starts with this (`""`: all), by name.
    Prefix(String),
}

impl Selector {
    /// From a request's parameters (`name` or `prefix`; neither: everything).
    pub(crate) fn from_params<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Selector {
        match (get("name"), get("prefix")) {
            (Some(n), _) => Selector::Name(n.to_string()),
            (None, p) => Selector::Prefix(p.unwrap_or_default().to_string()),
        }
    }

    /// For a `remove`: `name` or `prefix` given explicitly (`prefix=""`
    /// removes everything); a request naming neither is refused rather than
    /// read as "everything", so a client that forgets the parameter deletes
    /// nothing.
    pub(crate) fn for_remove<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Result<Selector, String> {
        if get("name").is_none() && get("prefix").is_none() {
            return Err("remove needs a parameter: name=N (a tensor or a state dict) or prefix=P".to_string());
        }
        Ok(Selector::from_params(get))
    }

    pub(crate) fn to_params(&self) -> (&'static str, String) {
        match self {
            Selector::Name(n) => ("name", n.clone()),
            Selector::Prefix(p) => ("prefix", p.clone()),
        }
    }
}
