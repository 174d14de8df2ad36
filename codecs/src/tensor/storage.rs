//! The bytes behind a tensor: [`Storage`] (host [`Bytes`] or a device
//! buffer), [`AlignedBuf`] for 16-byte aligned host allocations, and the
//! zero-copy owners that turn buffers into [`Bytes`].

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use crate::dtype::Element;
use crate::tensor::device::{Device, DeviceBuffer};

/// The bytes behind a tensor.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Host memory, shared by reference count.
    Host(Bytes),
    /// Device memory.
    Device(Arc<dyn DeviceBuffer>),
}

impl Storage {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Storage::Host(b) => b.len(),
            Storage::Device(d) => d.len(),
        }
    }

    /// True when the storage holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the bytes live.
    pub fn device(&self) -> Device {
        match self {
            Storage::Host(_) => Device::Cpu,
            Storage::Device(d) => d.device(),
        }
    }
}

/// A zero-initialised byte buffer aligned to 16 bytes (enough for every
/// dtype), which freezes into [`Bytes`] without a copy. Receivers allocate
/// tensors with it, so typed views of received data never fail on alignment.
pub struct AlignedBuf {
    words: Vec<u128>,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes. Large buffers come from `calloc`, so untouched pages
    /// cost nothing until written.
    pub fn zeroed(len: usize) -> Self {
        Self { words: vec![0u128; len.div_ceil(16)], len }
    }

    /// `len` zero bytes, or None when the allocator has not got the memory
    /// (for sizes that came from a peer or a user: an error, never an abort).
    pub fn try_zeroed(len: usize) -> Option<Self> {
        let words = len.div_ceil(16);
        if words == 0 {
            return Some(Self::zeroed(0));
        }
        let layout = std::alloc::Layout::array::<u128>(words).ok()?;
        // SAFETY: `layout` has a non-zero size. A non-null pointer from
        // `alloc_zeroed` points to `words` zero-initialised u128s allocated by
        // the global allocator with the layout `Vec<u128>` uses for that
        // capacity, so the Vec may own and free it.
        let words = unsafe {
            let p = std::alloc::alloc_zeroed(layout) as *mut u128;
            if p.is_null() {
                return None;
            }
            Vec::from_raw_parts(p, words, words)
        };
        Some(Self { words, len })
    }

    /// A copy of `src`.
    pub fn from_slice(src: &[u8]) -> Self {
        let mut b = Self::zeroed(src.len());
        b.as_mut_slice().copy_from_slice(src);
        b
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// Converts into [`Bytes`] without copying.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish()
    }
}

/// Keeps a `Vec<T>` alive as the owner of a [`Bytes`] without copying it.
pub(crate) struct VecOwner<T: Element>(pub(crate) Vec<T>);

impl<T: Element> AsRef<[u8]> for VecOwner<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// Returns `data` if its address suits `align`, otherwise a 16-byte aligned copy.
pub fn aligned(data: Bytes, align: usize) -> Bytes {
    if (data.as_ptr() as usize).is_multiple_of(align.max(1)) { data } else { AlignedBuf::from_slice(&data).freeze() }
}
