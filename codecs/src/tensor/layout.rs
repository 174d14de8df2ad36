//! Shape arithmetic shared by the tensor model and the decoders: element
//! counts, row-major strides, byte sizes and the storage extent of a view,
//! all checked for overflow.

use smallvec::SmallVec;

use crate::dtype::DType;
use crate::tensor::error::TensorError;

/// Number of elements of `shape`, or None on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// A shape or strides, kept inline up to four dimensions (most tensors):
/// making, cloning and dropping a tensor then allocates nothing for them.
pub(crate) type Dims = SmallVec<[usize; 4]>;

/// `v` as [`Dims`]: copied inline when it fits, else its allocation is kept.
pub(crate) fn dims_from_vec(v: Vec<usize>) -> Dims {
    if v.len() <= 4 { Dims::from_slice(&v) } else { Dims::from_vec(v) }
}

/// Row-major (C order) strides of `shape`, in elements, as [`Dims`].
pub(crate) fn contiguous_dims(shape: &[usize]) -> Dims {
    // Filled from the last dimension and reversed: no zeroed allocation
    // for a shape too long to keep inline (`vec![0; n]` asks the allocator
    // for zeroed memory, a slower path).
    let mut strides = Dims::with_capacity(shape.len());
    let mut acc = 1usize;
    for &d in shape.iter().rev() {
        strides.push(acc);
        acc = acc.saturating_mul(d.max(1));
    }
    strides.reverse();
    strides
}

/// Row-major (C order) strides of `shape`, in elements.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    contiguous_dims(shape).into_vec()
}

/// Whether `strides` are `shape`'s row-major strides (what
/// [`contiguous_strides`] returns), without making them.
pub fn is_row_major(shape: &[usize], strides: &[usize]) -> bool {
    if shape.len() != strides.len() {
        return false;
    }
    let mut acc = 1usize;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if s != acc {
            return false;
        }
        acc = acc.saturating_mul(d.max(1));
    }
    true
}

/// Bytes needed for `shape` of `dtype`, checked for overflow.
pub fn byte_size(dtype: DType, shape: &[usize]) -> Result<usize, TensorError> {
    checked_numel(shape)
        .and_then(|n| n.checked_mul(dtype.itemsize()))
        .ok_or_else(|| TensorError::Overflow { dtype, shape: shape.to_vec() })
}

/// Storage bytes a strided view reaches: `(offset + Σ(dᵢ-1)·sᵢ + 1) × itemsize`,
/// or 0 for an empty view.
pub fn view_extent(dtype: DType, shape: &[usize], strides: &[usize], offset: usize) -> Result<usize, TensorError> {
    if byte_size(dtype, shape)? == 0 {
        return Ok(0);
    }
    let overflow = || TensorError::Overflow { dtype, shape: shape.to_vec() };
    let mut last = offset;
    for (&d, &s) in shape.iter().zip(strides) {
        last = (d - 1).checked_mul(s).and_then(|x| x.checked_add(last)).ok_or_else(overflow)?;
    }
    last.checked_add(1).and_then(|x| x.checked_mul(dtype.itemsize())).ok_or_else(overflow)
}
