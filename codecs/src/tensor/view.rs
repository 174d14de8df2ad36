//! Views that share a tensor's storage: [`Tensor::permute`],
//! [`Tensor::transpose`], [`Tensor::narrow`], and [`Tensor::reshape`]
//! (which copies only a non-contiguous tensor).

use crate::tensor::error::TensorError;
use crate::tensor::layout::{checked_numel, contiguous_dims, dims_from_vec};
use crate::tensor::model::Tensor;

impl Tensor {
    /// A view with dimensions reordered: dimension `i` of the result is
    /// dimension `perm[i]` of `self`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor, TensorError> {
        let dims = self.dim();
        let mut seen = vec![false; dims];
        if perm.len() != dims || perm.iter().any(|&p| p >= dims || std::mem::replace(&mut seen[p], true)) {
            return Err(TensorError::InvalidPermutation { perm: perm.to_vec(), dims });
        }
        let mut t = self.clone();
        t.shape = perm.iter().map(|&p| self.shape[p]).collect();
        t.strides = perm.iter().map(|&p| self.strides[p]).collect();
        Ok(t)
    }

    /// A view with dimensions `a` and `b` swapped.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Tensor, TensorError> {
        let dims = self.dim();
        for d in [a, b] {
            if d >= dims {
                return Err(TensorError::InvalidDim { dim: d, dims });
            }
        }
        let mut perm: Vec<usize> = (0..dims).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// A view of `len` indices of dimension `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor, TensorError> {
        let dims = self.dim();
        if dim >= dims {
            return Err(TensorError::InvalidDim { dim, dims });
        }
        let size = self.shape[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(TensorError::Narrow { dim, start, len, size });
        }
        let mut t = self.clone();
        if len > 0 {
            t.offset += start * self.strides[dim];
        }
        t.shape[dim] = len;
        Ok(t)
    }

    /// The same elements with another shape; copies when not contiguous.
    pub fn reshape(&self, shape: impl Into<Vec<usize>>) -> Result<Tensor, TensorError> {
        let shape = shape.into();
        if checked_numel(&shape) != Some(self.numel()) {
            return Err(TensorError::Reshape { from: self.shape.to_vec(), to: shape });
        }
        let mut t = if self.is_contiguous() { self.clone() } else { self.contiguous()? };
        t.strides = contiguous_dims(&shape);
        t.shape = dims_from_vec(shape);
        Ok(t)
    }
}
