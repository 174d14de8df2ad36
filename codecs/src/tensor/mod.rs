//! The tensor model: a dtype, a shape, strides and a storage of bytes.
//!
//! A [`Tensor`] is a strided view (shape, strides in elements, storage offset)
//! into a [`Storage`]: host bytes held as [`bytes::Bytes`] (so chunking and
//! slicing never copy) or a device buffer (GPU memory, see [`DeviceBuffer`]).
//! Views made by [`Tensor::permute`], [`Tensor::transpose`] and
//! [`Tensor::narrow`] share the storage; [`Tensor::contiguous`] copies only
//! when the layout needs it.
//!
//! | file | holds |
//! |---|---|
//! | `model.rs` | [`Tensor`]: fields, constructors, accessors, layout predicates |
//! | `data.rs` | reading elements: bytes, typed views, `to_vec`, CRC, `data_eq` |
//! | `view.rs` | views sharing storage: permute, transpose, narrow, reshape |
//! | `storage.rs` | [`Storage`], [`AlignedBuf`], [`aligned`] |
//! | `device.rs` | [`Device`], [`UnknownDevice`], the [`DeviceBuffer`] trait |
//! | `layout.rs` | shape arithmetic: [`byte_size`], [`view_extent`], [`contiguous_strides`], [`is_row_major`], [`checked_numel`] |
//! | `error.rs` | [`TensorError`] |

mod data;
mod device;
mod error;
mod layout;
mod model;
mod storage;
#[cfg(test)]
mod tests;
mod view;

pub use device::{Device, DeviceBuffer, UnknownDevice};
pub use error::TensorError;
pub use layout::{byte_size, checked_numel, contiguous_strides, is_row_major, view_extent};
pub use model::Tensor;
pub use storage::{AlignedBuf, Storage, aligned};
