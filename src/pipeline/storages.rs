//! Storages shared by the tensors of one stream (a state dict's tied
//! weights, a transposed view next to its base, a strided slice): which
//! tensors travel as a reference to a storage sent once
//! (`TensorInfo.storage_id` on the wire), sans-IO.
//!
//! A tensor gets a storage id when its storage is viewed by another tensor
//! of the same batch, or when it is not dense (a strided slice, whose
//! strides would otherwise be lost to a contiguous copy). Every other tensor
//! travels as usual. The first tensor of an id carries the whole storage;
//! the later ones carry nothing and point into it, as `torch.save` writes
//! one record per storage.

use std::collections::HashMap;

use tensorwire_codecs::{DType, Storage, Tensor};

/// How one tensor of a batch travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Share {
    /// On its own, as any tensor.
    Plain,
    /// First view of storage `id`: the payload is the whole storage.
    First(u64),
    /// A later view of storage `id`, already sent: no payload.
    Again(u64),
}

/// Identifies a host storage while the tensors holding it are alive: its
/// address, length and dtype (views of one buffer as two dtypes are two
/// storages, as `torch.save` writes them).
fn key(t: &Tensor) -> Option<(usize, usize, DType)> {
    match t.storage() {
        Storage::Host(b) if !b.is_empty() => Some((b.as_ptr() as usize, b.len(), t.dtype())),
        _ => None,
    }
}

/// Decides how each of `tensors` travels (all alive at once, so equal
/// addresses mean one storage).
pub(crate) fn plan<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Vec<Share> {
    let tensors: Vec<&Tensor> = tensors.into_iter().collect();
    let mut uses: HashMap<(usize, usize, DType), usize> = HashMap::new();
    for k in tensors.iter().filter_map(|t| key(t)) {
        *uses.entry(k).or_default() += 1;
    }
    let mut ids: HashMap<(usize, usize, DType), u64> = HashMap::new();
    tensors
        .iter()
        .map(|t| {
            let Some(k) = key(t) else { return Share::Plain };
            if uses[&k] < 2 && t.is_dense() {
                return Share::Plain;
            }
            match ids.get(&k) {
                Some(&id) => Share::Again(id),
                None => {
                    let id = ids.len() as u64 + 1;
                    ids.insert(k, id);
                    Share::First(id)
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_and_strided_tensors_get_ids() {
        let w = Tensor::from_vec([3, 4], (0..12).map(|x| x as f32).collect::<Vec<_>>()).unwrap();
        let b = Tensor::from_vec([4], vec![1u8, 2, 3, 4]).unwrap();
        let other = Tensor::from_vec([4, 4], (0..16i64).collect::<Vec<_>>()).unwrap();
        let cols = other.narrow(1, 1, 2).unwrap();
        let p = plan([&w, &b, &w.transpose(0, 1).unwrap(), &cols, &w]);
        assert_eq!(p, vec![Share::First(1), Share::Plain, Share::Again(1), Share::First(2), Share::Again(1)]);
        // A lone dense tensor, even a transposed one, travels as it is.
        assert_eq!(plan([&w.transpose(0, 1).unwrap()]), vec![Share::Plain]);
        // An empty storage is nothing to share.
        let e = Tensor::zeros(DType::Float32, [0]).unwrap();
        assert_eq!(plan([&e, &e]), vec![Share::Plain, Share::Plain]);
    }
}
