//! [`StateDictWriter`]: a state dict written as a `torch.save` file while
//! its tensors arrive, one at a time, to any [`Write`]r: each tensor's
//! storage record goes out as soon as the tensor is given (and the tensor
//! may then be dropped), the pickle and the zip directory at the end. The
//! memory held is one tensor plus a few bytes per entry, whatever the size
//! of the checkpoint.
//!
//! Storages shared by several tensors (tied weights, views) are written
//! once when the caller says which tensors share one (a storage id, as
//! `tensorwire`'s state dict stream reports it); the file then loads with
//! the same sharing, strides and offsets (`torch.load(weights_only=True)`).

use std::collections::HashMap;
use std::io::Write;

use crate::dtype::DType;
use crate::error::EncodeError;
use crate::tensor::Tensor;
use crate::torch::file::{SaveOptions, pickle_records, storage_record, tensor_ref, trailer_records};
use crate::torch::pickle_model::{PickleValue, TensorRef};
use crate::torch::pickle_write::PickleWriter;
use crate::torch::zip::ZipWriter;

/// A state dict written as a `torch.save` file while its tensors arrive,
/// one at a time: each tensor's storage record goes out as soon as the
/// tensor is given, the pickle and the zip directory at the end, so the
/// memory held is one tensor whatever the size of the checkpoint. Storages
/// shared by several tensors are written once when the caller gives them
/// one storage id; the file loads with the same sharing, strides and
/// offsets (`torch.load(weights_only=True)`).
pub struct StateDictWriter<W: Write> {
    out: W,
    zip: ZipWriter,
    archive: String,
    entries: Vec<(String, TensorRef)>,
    storages: HashMap<u64, (usize, DType, usize)>,
    records: usize,
    written: u64,
}

impl<W: Write> StateDictWriter<W> {
    /// A writer of one state dict (an `OrderedDict`) to `out`.
    pub fn new(out: W, options: &SaveOptions) -> Self {
        let archive = if options.archive_name.is_empty() { "archive" } else { options.archive_name.as_str() };
        Self {
            out,
            zip: ZipWriter::new(64, options.compute_crc32),
            archive: archive.to_string(),
            entries: Vec::new(),
            storages: HashMap::new(),
            records: 0,
            written: 0,
        }
    }

    /// Adds the entry `key` (written out now). Tensors given the same
    /// `storage` id view one storage: the first one's storage is written,
    /// the later ones refer to it (they must hold the same storage bytes).
    /// With None, the tensor's storage gets a record of its own.
    pub fn write(&mut self, key: &str, tensor: &Tensor, storage: Option<u64>) -> Result<(), EncodeError> {
        let len = tensor.host_storage()?.len();
        let known = storage.and_then(|id| self.storages.get(&id).copied());
        let record = match known {
            Some((record, dtype, size)) => {
                if dtype != tensor.dtype() || size != len {
                    return Err(EncodeError::Unsupported {
                        codec: "torch",
                        reason: format!(
                            "{key:?} claims the storage of an earlier tensor but is {} over {len} bytes, not {dtype} over {size}",
                            tensor.dtype()
                        ),
                    });
                }
                record
            }
            None => {
                let record = self.records;
                self.records += 1;
                self.zip.add(&format!("{}/data/{record}", self.archive), storage_record(tensor)?);
                if let Some(id) = storage {
                    self.storages.insert(id, (record, tensor.dtype(), len));
                }
                self.drain()?;
                record
            }
        };
        self.entries.push((key.to_string(), tensor_ref(tensor, record)?));
        Ok(())
    }

    /// Entries written so far.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True before the first entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes written to the output so far.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    fn drain(&mut self) -> Result<(), EncodeError> {
        for s in self.zip.take_segments() {
            self.out.write_all(&s)?;
            self.written += s.len() as u64;
        }
        Ok(())
    }

    /// Writes the pickle and the zip directory, flushes, and returns the output.
    pub fn finish(mut self) -> Result<W, EncodeError> {
        let items = std::mem::take(&mut self.entries)
            .into_iter()
            .map(|(k, t)| (PickleValue::Str(k), PickleValue::Tensor(t)))
            .collect();
        let mut w = PickleWriter::new();
        w.value(&PickleValue::OrderedDict(items));
        let archive = self.archive.clone();
        pickle_records(&mut self.zip, &archive, w.finish());
        trailer_records(&mut self.zip, &archive);
        let zip = std::mem::replace(&mut self.zip, ZipWriter::new(64, false));
        for s in zip.finish() {
            self.out.write_all(&s)?;
            self.written += s.len() as u64;
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::DecodeLimits;
    use crate::torch::file::load;
    use crate::torch::object::Object;
    use bytes::Bytes;

    #[test]
    fn streamed_state_dict_loads_with_sharing_and_strides() {
        let w = Tensor::from_vec([3, 4], (0..12).map(|x| x as f32).collect::<Vec<_>>()).unwrap();
        let wt = w.transpose(0, 1).unwrap();
        let row = w.narrow(0, 1, 1).unwrap();
        let b = Tensor::from_vec([2], vec![7i64, 8]).unwrap();
        let mut out = StateDictWriter::new(Vec::new(), &SaveOptions::default());
        out.write("w", &w, Some(1)).unwrap();
        out.write("b", &b, None).unwrap();
        out.write("wt", &wt, Some(1)).unwrap();
        out.write("row", &row, Some(1)).unwrap();
        assert!(out.write("bad", &b, Some(1)).is_err(), "another storage under a known id");
        let file = Bytes::from(out.finish().unwrap());
        let v = load(file, &DecodeLimits::default()).unwrap();
        let Object::OrderedDict(items) = &v else { panic!("{v:?}") };
        let keys: Vec<String> = items.iter().map(|(k, _)| format!("{k:?}")).collect();
        assert_eq!(keys.len(), 4, "{keys:?}");
        let ts: HashMap<String, Tensor> = v.tensors().into_iter().map(|(k, t)| (k, t.clone())).collect();
        assert!(ts["w"].data_eq(&w) && ts["b"].data_eq(&b) && ts["wt"].data_eq(&wt) && ts["row"].data_eq(&row));
        assert_eq!(ts["wt"].strides(), &[1, 4]);
        assert_eq!(ts["row"].storage_offset(), 4);
        let p = |k: &str| ts[k].host_storage().unwrap().as_ptr();
        assert_eq!(p("w"), p("wt"));
        assert_eq!(p("w"), p("row"));
        assert_ne!(p("w"), p("b"));
    }
}
