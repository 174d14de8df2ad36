//! The torch.save-compatible codec: reads and writes the zip format of
//! `torch.save` (PyTorch ≥ 1.6), so Python peers exchange bytes with
//! `torch.load(..., weights_only=True)` and `torch.save`.
//!
//! * [`load`] reads a file into a [`Value`]: single tensors, and lists,
//!   tuples, dicts and OrderedDicts (state dicts) with str/int/float/bool/None
//!   leaves. Every dtype of the tensor model; strides, storage offsets, and
//!   several tensors viewing one storage (they share memory after loading).
//! * [`save`] writes a [`Value`] the way torch 2.x does: legacy storage types
//!   with `_rebuild_tensor_v2`, `UntypedStorage` with `_rebuild_tensor_v3`
//!   for uint16/32/64 and float8, stored zip entries aligned to 64 bytes,
//!   each storage written once. Tensor bytes are passed through as segments,
//!   never copied.
//!
//! **Safe by construction**: the pickle inside is run by a small interpreter
//! ([`pickle`]) with a fixed allow-list of globals; anything else — an
//! `os.system` reduce, `builtins.eval`, an unknown class — is an error naming
//! the global, and nothing is ever executed. Stricter than
//! `torch.load(weights_only=False)`, and than `weights_only=True` too.

pub mod pickle;
pub mod pickle_write;
pub mod zip;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::codec::{Codec, CodecKind, DecodeError, DecodeLimits, EncodeError, Encoded, TensorInfo, aligned};
use crate::dtype::DType;
use crate::tensor::{Storage, Tensor};
use pickle::{PickleValue, StorageRef, TensorRef};

/// A value stored in a torch file: the Python objects `torch.save` writes
/// for tensors and state dicts.
#[derive(Debug, Clone)]
pub enum Value {
    /// `None`
    None,
    /// `bool`
    Bool(bool),
    /// `int`
    Int(i64),
    /// `float`
    Float(f64),
    /// `str`
    Str(String),
    /// `bytes`
    Bytes(Bytes),
    /// A tensor (saved parameters load as tensors).
    Tensor(Tensor),
    /// `list`
    List(Vec<Value>),
    /// `tuple`
    Tuple(Vec<Value>),
    /// `dict`, in insertion order.
    Dict(Vec<(Value, Value)>),
    /// `collections.OrderedDict` (what `state_dict()` returns).
    OrderedDict(Vec<(Value, Value)>),
}

impl Value {
    /// The tensor, if this is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// Every tensor inside, with a path built from dict keys and list indices
    /// (`"layer.0.weight"`, `"2"`); a bare tensor has the path `""`.
    pub fn tensors(&self) -> Vec<(String, &Tensor)> {
        let mut out = Vec::new();
        self.collect_tensors(String::new(), &mut out);
        out
    }

    fn collect_tensors<'a>(&'a self, path: String, out: &mut Vec<(String, &'a Tensor)>) {
        let join = |k: String| {
            if path.is_empty() { k } else { format!("{path}.{k}") }
        };
        match self {
            Value::Tensor(t) => out.push((path, t)),
            Value::List(v) | Value::Tuple(v) => {
                for (i, x) in v.iter().enumerate() {
                    x.collect_tensors(join(i.to_string()), out);
                }
            }
            Value::Dict(v) | Value::OrderedDict(v) => {
                for (k, x) in v {
                    let key = match k {
                        Value::Str(s) => s.clone(),
                        Value::Int(i) => i.to_string(),
                        other => format!("{other:?}"),
                    };
                    x.collect_tensors(join(key), out);
                }
            }
            _ => {}
        }
    }

    /// An OrderedDict of named tensors (a state dict).
    pub fn state_dict<S: Into<String>>(items: impl IntoIterator<Item = (S, Tensor)>) -> Value {
        Value::OrderedDict(items.into_iter().map(|(k, t)| (Value::Str(k.into()), Value::Tensor(t))).collect())
    }
}

/// Reads a `torch.save` file. See the [module docs](self).
pub fn load(file: Bytes, limits: &DecodeLimits) -> Result<Value, DecodeError> {
    let entries = zip::read_entries(&file, limits)?;
    let pkl = entries
        .iter()
        .find(|e| e.name.ends_with("/data.pkl") && e.name.matches('/').count() == 1)
        .or_else(|| entries.iter().find(|e| e.name == "data.pkl"))
        .ok_or_else(|| DecodeError::Malformed {
            format: "torch file",
            reason: "no data.pkl record (not a torch.save archive, or saved with the legacy pre-1.6 format)".into(),
        })?;
    let prefix = pkl.name.strip_suffix("data.pkl").unwrap_or_default().to_string();
    let record = |rel: &str| {
        entries
            .iter()
            .find(|e| e.name.len() == prefix.len() + rel.len() && e.name.starts_with(&prefix) && e.name.ends_with(rel))
    };
    if let Some(order) = record("byteorder")
        && order.data.as_ref() != b"little"
    {
        return Err(DecodeError::Malformed {
            format: "torch file",
            reason: format!(
                "byteorder {:?} is not supported (only little-endian)",
                String::from_utf8_lossy(&order.data)
            ),
        });
    }
    let root = pickle::load(&pkl.data, limits)?;
    let mut storages: HashMap<String, Bytes> = HashMap::new();
    let mut count = 0usize;
    let mut conv = |t: &TensorRef| -> Result<Tensor, DecodeError> {
        count += 1;
        if count > limits.max_tensors {
            return Err(DecodeError::LimitExceeded {
                what: "tensors in file",
                count: count as u64,
                limit: limits.max_tensors as u64,
            });
        }
        let data = match storages.get(&t.storage.key) {
            Some(d) => d.clone(),
            None => {
                let entry = record(&format!("data/{}", t.storage.key)).ok_or_else(|| DecodeError::Malformed {
                    format: "torch file",
                    reason: format!("storage {:?} has no data record", t.storage.key),
                })?;
                let item = t.storage.dtype.map_or(1, DType::itemsize) as u64;
                let need = t.storage.numel.checked_mul(item).ok_or_else(|| DecodeError::Malformed {
                    format: "torch file",
                    reason: "storage size overflows".into(),
                })?;
                if need > entry.data.len() as u64 {
                    return Err(DecodeError::Truncated {
                        what: "torch storage record",
                        needed: need,
                        available: entry.data.len() as u64,
                    });
                }
                let d = aligned(entry.data.slice(..need as usize), 16);
                storages.insert(t.storage.key.clone(), d.clone());
                d
            }
        };
        build_tensor(t, data, limits)
    };
    from_pickle(root, &mut conv)
}

fn build_tensor(t: &TensorRef, data: Bytes, limits: &DecodeLimits) -> Result<Tensor, DecodeError> {
    let shape = to_usizes(&t.shape)?;
    let strides = to_usizes(&t.strides)?;
    crate::codec::check_shape(t.dtype, &shape, limits)?;
    let offset = usize::try_from(t.offset)
        .map_err(|_| DecodeError::Malformed { format: "torch file", reason: "offset overflows".into() })?;
    Ok(Tensor::from_strided(t.dtype, shape, strides, offset, Storage::Host(data))?)
}

fn to_usizes(v: &[u64]) -> Result<Vec<usize>, DecodeError> {
    v.iter()
        .map(|&x| {
            usize::try_from(x)
                .map_err(|_| DecodeError::Malformed { format: "torch file", reason: format!("{x} overflows") })
        })
        .collect()
}

fn from_pickle(
    v: PickleValue,
    conv: &mut dyn FnMut(&TensorRef) -> Result<Tensor, DecodeError>,
) -> Result<Value, DecodeError> {
    let pairs = |items: Vec<(PickleValue, PickleValue)>,
                 conv: &mut dyn FnMut(&TensorRef) -> Result<Tensor, DecodeError>| {
        items
            .into_iter()
            .map(|(k, x)| Ok((from_pickle(k, conv)?, from_pickle(x, conv)?)))
            .collect::<Result<Vec<_>, DecodeError>>()
    };
    Ok(match v {
        PickleValue::None => Value::None,
        PickleValue::Bool(b) => Value::Bool(b),
        PickleValue::Int(i) => Value::Int(i),
        PickleValue::Float(f) => Value::Float(f),
        PickleValue::Str(s) => Value::Str(s),
        PickleValue::Bytes(b) => Value::Bytes(Bytes::from(b)),
        PickleValue::Tensor(t) => Value::Tensor(conv(&t)?),
        PickleValue::List(v) => Value::List(v.into_iter().map(|x| from_pickle(x, conv)).collect::<Result<_, _>>()?),
        PickleValue::Tuple(v) => Value::Tuple(v.into_iter().map(|x| from_pickle(x, conv)).collect::<Result<_, _>>()?),
        PickleValue::Dict(v) => Value::Dict(pairs(v, conv)?),
        PickleValue::OrderedDict(v) => Value::OrderedDict(pairs(v, conv)?),
    })
}

/// Options for [`save`].
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Top folder inside the zip (torch uses the file's stem, or `archive`).
    pub archive_name: String,
    /// Compute CRC-32s of entries (default true). torch.load ignores them,
    /// but Python's `zipfile` checks them.
    pub compute_crc32: bool,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self { archive_name: "archive".into(), compute_crc32: true }
    }
}

/// Writes `value` in the format of `torch.save`; returns the file as
/// segments (join them, or send them one after another).
pub fn save(value: &Value, options: &SaveOptions) -> Result<Vec<Bytes>, EncodeError> {
    let mut storages: Vec<(Bytes, DType)> = Vec::new();
    let mut keys: HashMap<(usize, usize, DType), usize> = HashMap::new();
    let pv = to_pickle(value, &mut storages, &mut keys)?;
    let mut w = pickle_write::PickleWriter::new();
    w.value(&pv);
    let name = if options.archive_name.is_empty() { "archive" } else { options.archive_name.as_str() };
    let mut z = zip::ZipWriter::new(64, options.compute_crc32);
    z.add(&format!("{name}/data.pkl"), w.finish());
    z.add(&format!("{name}/.format_version"), Bytes::from_static(b"1"));
    z.add(&format!("{name}/.storage_alignment"), Bytes::from_static(b"64"));
    z.add(&format!("{name}/byteorder"), Bytes::from_static(b"little"));
    for (i, (data, _)) in storages.iter().enumerate() {
        z.add(&format!("{name}/data/{i}"), data.clone());
    }
    z.add(&format!("{name}/version"), Bytes::from_static(b"3\n"));
    z.add(&format!("{name}/.data/serialization_id"), Bytes::from(serialization_id().into_bytes()));
    Ok(z.finish())
}

/// A 40-digit decimal id, as torch writes (unique per file, not secret).
fn serialization_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mixed = (nanos ^ (u128::from(c) << 64) ^ (u128::from(std::process::id()) << 96))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
    let (hi, lo) = ((mixed >> 64) as u64, mixed as u64);
    format!("{:020}{:020}", hi % 10u64.pow(19), lo % 10u64.pow(19))
}

fn to_pickle(
    v: &Value,
    storages: &mut Vec<(Bytes, DType)>,
    keys: &mut HashMap<(usize, usize, DType), usize>,
) -> Result<PickleValue, EncodeError> {
    let pairs = |items: &[(Value, Value)],
                 storages: &mut Vec<(Bytes, DType)>,
                 keys: &mut HashMap<(usize, usize, DType), usize>| {
        items
            .iter()
            .map(|(k, x)| Ok((to_pickle(k, storages, keys)?, to_pickle(x, storages, keys)?)))
            .collect::<Result<Vec<_>, EncodeError>>()
    };
    Ok(match v {
        Value::None => PickleValue::None,
        Value::Bool(b) => PickleValue::Bool(*b),
        Value::Int(i) => PickleValue::Int(*i),
        Value::Float(f) => PickleValue::Float(*f),
        Value::Str(s) => PickleValue::Str(s.clone()),
        Value::Bytes(b) => PickleValue::Bytes(b.to_vec()),
        Value::List(x) => PickleValue::List(x.iter().map(|i| to_pickle(i, storages, keys)).collect::<Result<_, _>>()?),
        Value::Tuple(x) => {
            PickleValue::Tuple(x.iter().map(|i| to_pickle(i, storages, keys)).collect::<Result<_, _>>()?)
        }
        Value::Dict(x) => PickleValue::Dict(pairs(x, storages, keys)?),
        Value::OrderedDict(x) => PickleValue::OrderedDict(pairs(x, storages, keys)?),
        Value::Tensor(t) => {
            let data = t.host_storage()?.clone();
            let dtype = t.dtype();
            let item = dtype.itemsize();
            // Views of one storage share one record, as in torch.
            let id = (data.as_ptr() as usize, data.len(), dtype);
            let key = *keys.entry(id).or_insert_with(|| {
                storages.push((data.slice(..data.len() / item * item), dtype));
                storages.len() - 1
            });
            let numel = (data.len() / item) as u64;
            let typed = pickle::storage_class(dtype).is_some();
            PickleValue::Tensor(TensorRef {
                storage: StorageRef {
                    dtype: typed.then_some(dtype),
                    key: key.to_string(),
                    location: "cpu".into(),
                    numel: if typed { numel } else { numel * item as u64 },
                },
                dtype,
                offset: t.storage_offset() as u64,
                shape: t.shape().iter().map(|&d| d as u64).collect(),
                strides: t.strides().iter().map(|&s| s as u64).collect(),
            })
        }
    })
}

/// The torch codec for the pipeline: one tensor per payload, as the Python
/// skytorch server sends (`torch.save(tensor)` bytes).
#[derive(Debug, Clone, Copy, Default)]
pub struct TorchCodec;

impl Codec for TorchCodec {
    fn kind(&self) -> CodecKind {
        CodecKind::Torch
    }

    fn encode(&self, tensor: &Tensor) -> Result<Encoded, EncodeError> {
        // Send only the tensor's own elements, not a whole shared storage.
        let compact = if tensor.is_contiguous() {
            tensor.contiguous()?
        } else if let Some(span) = tensor.dense_span() {
            Tensor::from_strided(tensor.dtype(), tensor.shape(), tensor.strides(), 0, Storage::Host(span))?
        } else {
            tensor.contiguous()?
        };
        let segments = save(&Value::Tensor(compact), &SaveOptions::default())?;
        Ok(Encoded { info: TensorInfo::of(tensor), segments })
    }

    fn decode(&self, info: &TensorInfo, payload: Bytes, limits: &DecodeLimits) -> Result<Tensor, DecodeError> {
        match load(payload, limits)? {
            Value::Tensor(t) => Ok(info.apply_names(t)),
            other => Err(DecodeError::Malformed {
                format: "torch payload",
                reason: format!("expected one tensor, found {}", kind_name(&other)),
            }),
        }
    }
}

fn kind_name(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) => "a str",
        Value::Bytes(_) => "bytes",
        Value::Tensor(_) => "a tensor",
        Value::List(_) => "a list",
        Value::Tuple(_) => "a tuple",
        Value::Dict(_) => "a dict",
        Value::OrderedDict(_) => "an OrderedDict",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(segs: Vec<Bytes>) -> Bytes {
        let mut v = Vec::new();
        for s in segs {
            v.extend_from_slice(&s);
        }
        Bytes::from(v)
    }

    #[test]
    fn state_dict_with_shared_storage_round_trips() {
        let w = Tensor::from_vec([2, 3], (0..6).map(|x| x as f32).collect::<Vec<_>>()).unwrap();
        let wt = w.transpose(0, 1).unwrap();
        let row = w.narrow(0, 1, 1).unwrap();
        let u = Tensor::from_vec([3], vec![1u16, 2, 3]).unwrap();
        let sd = Value::OrderedDict(vec![
            (Value::Str("w".into()), Value::Tensor(w.clone())),
            (Value::Str("wt".into()), Value::Tensor(wt.clone())),
            (Value::Str("row".into()), Value::Tensor(row.clone())),
            (Value::Str("u".into()), Value::Tensor(u.clone())),
            (Value::Str("n".into()), Value::Int(3)),
        ]);
        let file = join(save(&sd, &SaveOptions::default()).unwrap());
        let back = load(file.clone(), &DecodeLimits::default()).unwrap();
        let ts = back.tensors();
        assert_eq!(ts.len(), 4);
        assert!(ts[0].1.data_eq(&w));
        assert!(ts[1].1.data_eq(&wt));
        assert_eq!(ts[1].1.strides(), &[1, 3]);
        assert!(ts[2].1.data_eq(&row));
        assert_eq!(ts[2].1.storage_offset(), 3);
        assert!(ts[3].1.data_eq(&u));
        // One storage record for the three views of w.
        let entries = zip::read_entries(&file, &DecodeLimits::default()).unwrap();
        assert_eq!(entries.iter().filter(|e| e.name.contains("/data/")).count(), 2);
        // And the views share memory after loading.
        let (Storage::Host(a), Storage::Host(b)) = (ts[0].1.storage(), ts[1].1.storage()) else { panic!() };
        assert_eq!(a.as_ptr(), b.as_ptr());
    }

    #[test]
    fn codec_round_trips_every_dtype() {
        for dtype in DType::ALL {
            let t = Tensor::new(dtype, [3, 2], (0..6 * dtype.itemsize() as u8).map(|b| b % 2).collect::<Vec<u8>>())
                .unwrap()
                .with_name("x");
            let e = TorchCodec.encode(&t).unwrap();
            let back = TorchCodec.decode(&e.info, e.to_bytes(), &DecodeLimits::default()).unwrap();
            assert!(back.data_eq(&t), "{dtype}");
            assert_eq!(back.dtype(), dtype);
            assert_eq!(back.name(), Some("x"));
        }
    }

    #[test]
    fn limits_apply() {
        let t = Tensor::zeros(DType::Float32, [1024]).unwrap();
        let file = join(save(&Value::Tensor(t), &SaveOptions::default()).unwrap());
        let l = DecodeLimits { max_tensor_bytes: 100, ..Default::default() };
        assert!(matches!(load(file.clone(), &l), Err(DecodeError::TooLarge { .. })));
        // Truncated anywhere: an error, never a panic.
        for cut in (0..file.len()).step_by(7) {
            assert!(load(file.slice(..cut), &DecodeLimits::default()).is_err());
        }
    }
}
