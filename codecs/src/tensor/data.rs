//! Reading a tensor's elements: host bytes, contiguous copies, typed views,
//! checksums and comparison, all layout-aware (strided views are walked in
//! row-major order, one run of consecutive bytes at a time).

use bytes::Bytes;

use crate::dtype::{DType, Element};
use crate::tensor::error::TensorError;
use crate::tensor::model::Tensor;
use crate::tensor::storage::{AlignedBuf, Storage};

impl Tensor {
    /// The host storage, or an error for device tensors.
    pub fn host_storage(&self) -> Result<&Bytes, TensorError> {
        match &self.storage {
            Storage::Host(b) => Ok(b),
            Storage::Device(d) => Err(TensorError::NotOnHost { device: d.device() }),
        }
    }

    /// For a dense tensor (see [`Tensor::is_dense`]) on the host: the storage
    /// bytes its elements occupy, without copying. None otherwise.
    pub fn dense_span(&self) -> Option<Bytes> {
        let Storage::Host(b) = &self.storage else {
            return None;
        };
        if !self.is_dense() {
            return None;
        }
        let it = self.dtype.itemsize();
        let start = self.offset * it;
        Some(b.slice(start..start + self.nbytes()))
    }

    /// The elements' bytes in row-major order: a slice of the storage when
    /// contiguous, otherwise a copy.
    pub fn to_contiguous_bytes(&self) -> Result<Bytes, TensorError> {
        let storage = self.host_storage()?;
        let it = self.dtype.itemsize();
        if self.is_contiguous() {
            let start = self.offset * it;
            return Ok(storage.slice(start..start + self.nbytes()));
        }
        let mut out = AlignedBuf::zeroed(self.nbytes());
        let dst = out.as_mut_slice();
        let mut at = 0;
        self.for_each_run(|off, len| {
            dst[at..at + len].copy_from_slice(&storage[off..off + len]);
            at += len;
        });
        Ok(out.freeze())
    }

    /// A contiguous tensor with the same elements (no copy when already
    /// contiguous). Keeps name and metadata.
    pub fn contiguous(&self) -> Result<Tensor, TensorError> {
        let data = self.to_contiguous_bytes()?;
        let mut t = Tensor::with_shape(self.dtype, &self.shape, data)?;
        t.name = self.name.clone();
        t.metadata = self.metadata.clone();
        Ok(t)
    }

    /// The elements' bytes, borrowed; the tensor must be contiguous and on the host.
    pub fn as_bytes(&self) -> Result<&[u8], TensorError> {
        let storage = self.host_storage()?;
        if !self.is_contiguous() {
            return Err(TensorError::NotContiguous { strides: self.strides.to_vec() });
        }
        let start = self.offset * self.dtype.itemsize();
        Ok(&storage[start..start + self.nbytes()])
    }

    /// A borrowed typed view. Needs matching dtype, a contiguous host tensor
    /// and aligned data (buffers tensorwire allocates always are).
    pub fn as_slice<T: Element>(&self) -> Result<&[T], TensorError> {
        self.check_dtype(T::DTYPE)?;
        let bytes = self.as_bytes()?;
        bytemuck::try_cast_slice(bytes)
            .map_err(|_| TensorError::Misaligned { dtype: self.dtype, align: self.dtype.align() })
    }

    /// The elements copied into a `Vec<T>`, in row-major order; works for any
    /// layout and alignment.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, TensorError> {
        self.check_dtype(T::DTYPE)?;
        let bytes = self.to_contiguous_bytes()?;
        let mut out = vec![T::zeroed(); self.numel()];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&bytes);
        Ok(out)
    }

    /// The elements of a bool tensor; fails on bytes other than 0 or 1.
    pub fn to_bools(&self) -> Result<Vec<bool>, TensorError> {
        self.check_dtype(DType::Bool)?;
        let bytes = self.to_contiguous_bytes()?;
        bytes
            .iter()
            .enumerate()
            .map(|(index, &value)| match value {
                0 => Ok(false),
                1 => Ok(true),
                _ => Err(TensorError::InvalidBool { index, value }),
            })
            .collect()
    }

    fn check_dtype(&self, requested: DType) -> Result<(), TensorError> {
        if self.dtype != requested {
            return Err(TensorError::DTypeMismatch { actual: self.dtype, requested });
        }
        Ok(())
    }

    /// CRC-32C of the elements' bytes in row-major order (what the CLI prints,
    /// so that sender and receiver agree whatever the layout).
    pub fn crc32c(&self) -> Result<u32, TensorError> {
        let storage = self.host_storage()?;
        let mut crc = crate::checksum::Crc32c::new();
        self.for_each_run(|off, len| crc.update(&storage[off..off + len]));
        Ok(crc.finish())
    }

    /// True when both tensors have the same dtype, shape and element bytes
    /// (layouts may differ). Names and metadata are not compared.
    pub fn data_eq(&self, other: &Tensor) -> bool {
        if self.dtype != other.dtype || self.shape != other.shape {
            return false;
        }
        match (self.to_contiguous_bytes(), other.to_contiguous_bytes()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }

    /// Calls `f(byte_offset, byte_len)` for each run of storage bytes that
    /// holds consecutive elements, in row-major element order.
    fn for_each_run(&self, mut f: impl FnMut(usize, usize)) {
        let it = self.dtype.itemsize();
        if self.numel() == 0 {
            return;
        }
        // Drop size-1 dimensions, then merge neighbours that are contiguous
        // with each other, so a contiguous tensor is one run.
        let mut dims: Vec<(usize, usize)> = Vec::with_capacity(self.dim());
        for (&d, &s) in self.shape.iter().zip(&self.strides) {
            if d == 1 {
                continue;
            }
            if let Some(last) = dims.last_mut()
                && last.1 == s * d
            {
                last.0 *= d;
                last.1 = s;
                continue;
            }
            dims.push((d, s));
        }
        let base = self.offset * it;
        let (run_elems, outer) = match dims.last() {
            None => (1, &dims[..0]),
            Some(&(d, 1)) => (d, &dims[..dims.len() - 1]),
            Some(_) => (1, &dims[..]),
        };
        let run = run_elems * it;
        if outer.is_empty() {
            f(base, run);
            return;
        }
        let mut idx = vec![0usize; outer.len()];
        let mut off = base;
        loop {
            f(off, run);
            // Odometer increment over the outer dimensions.
            let mut k = outer.len();
            loop {
                if k == 0 {
                    return;
                }
                k -= 1;
                idx[k] += 1;
                off += outer[k].1 * it;
                if idx[k] < outer[k].0 {
                    break;
                }
                off -= outer[k].0 * outer[k].1 * it;
                idx[k] = 0;
            }
        }
    }
}
