//! Reading and writing whole `torch.save` files: the zip records
//! (`data.pkl`, `data/<key>`, `byteorder`, ...) around the pickle, and the
//! conversion between the pickle's [`PickleValue`] tree and [`Object`]s with
//! real tensors. See the [torch module docs](crate::torch).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::dtype::DType;
use crate::error::{DecodeError, EncodeError};
use crate::limits::{DecodeLimits, check_shape};
use crate::tensor::{Storage, Tensor, aligned};
use crate::torch::object::Object;
use crate::torch::pickle::load as run_pickle;
use crate::torch::pickle_model::{PickleValue, StorageRef, TensorRef, storage_class};
use crate::torch::pickle_write::PickleWriter;
use crate::torch::zip::{ZipWriter, read_entries};

/// Reads a `torch.save` file. See the [torch module docs](crate::torch).
pub fn load(file: Bytes, limits: &DecodeLimits) -> Result<Object, DecodeError> {
    let entries = read_entries(&file, limits)?;
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
    let root = run_pickle(&pkl.data, limits)?;
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
    check_shape(t.dtype, &shape, limits)?;
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
) -> Result<Object, DecodeError> {
    let pairs = |items: Vec<(PickleValue, PickleValue)>,
                 conv: &mut dyn FnMut(&TensorRef) -> Result<Tensor, DecodeError>| {
        items
            .into_iter()
            .map(|(k, x)| Ok((from_pickle(k, conv)?, from_pickle(x, conv)?)))
            .collect::<Result<Vec<_>, DecodeError>>()
    };
    Ok(match v {
        PickleValue::None => Object::None,
        PickleValue::Bool(b) => Object::Bool(b),
        PickleValue::Int(i) => Object::Int(i),
        PickleValue::Float(f) => Object::Float(f),
        PickleValue::Str(s) => Object::Str(s),
        PickleValue::Bytes(b) => Object::Bytes(Bytes::from(b)),
        PickleValue::Tensor(t) => Object::Tensor(conv(&t)?),
        PickleValue::List(v) => Object::List(v.into_iter().map(|x| from_pickle(x, conv)).collect::<Result<_, _>>()?),
        PickleValue::Tuple(v) => Object::Tuple(v.into_iter().map(|x| from_pickle(x, conv)).collect::<Result<_, _>>()?),
        PickleValue::Dict(v) => Object::Dict(pairs(v, conv)?),
        PickleValue::OrderedDict(v) => Object::OrderedDict(pairs(v, conv)?),
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
pub fn save(value: &Object, options: &SaveOptions) -> Result<Vec<Bytes>, EncodeError> {
    let mut storages: Vec<(Bytes, DType)> = Vec::new();
    let mut keys: HashMap<(usize, usize, DType), usize> = HashMap::new();
    let pv = to_pickle(value, &mut storages, &mut keys)?;
    let mut w = PickleWriter::new();
    w.value(&pv);
    let name = if options.archive_name.is_empty() { "archive" } else { options.archive_name.as_str() };
    let mut z = ZipWriter::new(64, options.compute_crc32);
    pickle_records(&mut z, name, w.finish());
    for (i, (data, _)) in storages.iter().enumerate() {
        z.add(&format!("{name}/data/{i}"), data.clone());
    }
    trailer_records(&mut z, name);
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
    v: &Object,
    storages: &mut Vec<(Bytes, DType)>,
    keys: &mut HashMap<(usize, usize, DType), usize>,
) -> Result<PickleValue, EncodeError> {
    let pairs = |items: &[(Object, Object)],
                 storages: &mut Vec<(Bytes, DType)>,
                 keys: &mut HashMap<(usize, usize, DType), usize>| {
        items
            .iter()
            .map(|(k, x)| Ok((to_pickle(k, storages, keys)?, to_pickle(x, storages, keys)?)))
            .collect::<Result<Vec<_>, EncodeError>>()
    };
    Ok(match v {
        Object::None => PickleValue::None,
        Object::Bool(b) => PickleValue::Bool(*b),
        Object::Int(i) => PickleValue::Int(*i),
        Object::Float(f) => PickleValue::Float(*f),
        Object::Str(s) => PickleValue::Str(s.clone()),
        Object::Bytes(b) => PickleValue::Bytes(b.to_vec()),
        Object::List(x) => PickleValue::List(x.iter().map(|i| to_pickle(i, storages, keys)).collect::<Result<_, _>>()?),
        Object::Tuple(x) => {
            PickleValue::Tuple(x.iter().map(|i| to_pickle(i, storages, keys)).collect::<Result<_, _>>()?)
        }
        Object::Dict(x) => PickleValue::Dict(pairs(x, storages, keys)?),
        Object::OrderedDict(x) => PickleValue::OrderedDict(pairs(x, storages, keys)?),
        Object::Tensor(t) => {
            let data = t.host_storage()?.clone();
            let dtype = t.dtype();
            // Views of one storage share one record, as in torch.
            let id = (data.as_ptr() as usize, data.len(), dtype);
            let record = storage_record(t)?;
            let key = *keys.entry(id).or_insert_with(|| {
                storages.push((record, dtype));
                storages.len() - 1
            });
            PickleValue::Tensor(tensor_ref(t, key)?)
        }
    })
}

/// The bytes of the record holding `t`'s storage: the whole storage, in
/// whole elements.
pub(crate) fn storage_record(t: &Tensor) -> Result<Bytes, EncodeError> {
    let data = t.host_storage()?;
    let item = t.dtype().itemsize();
    Ok(data.slice(..data.len() / item * item))
}

/// How the pickle refers to `t`, whose storage is record `data/<key>`.
pub(crate) fn tensor_ref(t: &Tensor, key: usize) -> Result<TensorRef, EncodeError> {
    let dtype = t.dtype();
    let item = dtype.itemsize();
    let numel = (t.host_storage()?.len() / item) as u64;
    let typed = storage_class(dtype).is_some();
    Ok(TensorRef {
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

/// Writes the pickle and the small records torch writes beside it.
pub(crate) fn pickle_records(z: &mut ZipWriter, name: &str, pickle: Bytes) {
    z.add(&format!("{name}/data.pkl"), pickle);
    z.add(&format!("{name}/.format_version"), Bytes::from_static(b"1"));
    z.add(&format!("{name}/.storage_alignment"), Bytes::from_static(b"64"));
    z.add(&format!("{name}/byteorder"), Bytes::from_static(b"little"));
}

/// The records torch writes after the storages.
pub(crate) fn trailer_records(z: &mut ZipWriter, name: &str) {
    z.add(&format!("{name}/version"), Bytes::from_static(b"3\n"));
    z.add(&format!("{name}/.data/serialization_id"), Bytes::from(serialization_id().into_bytes()));
}
