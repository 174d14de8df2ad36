//! Tensors across the language boundary, without copies.
//!
//! In: the Python side describes a contiguous CPU tensor as `(name, dtype,
//! shape, data_ptr, nbytes, owner, metadata)`; [`from_py`] wraps that memory
//! in [`Bytes`] whose owner holds a reference to the Python object, so the
//! tensor is sent from its own memory and cannot be freed while in flight.
//!
//! Out: a received tensor becomes a [`Received`]: the tensor's facts plus a
//! DLPack capsule over its receive buffer (see `dlpack.rs`).

use std::collections::BTreeMap;

use bytes::Bytes;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tensorwire::{DType, Storage, Tensor};

use crate::dlpack;

/// Python memory lent to a [`Bytes`]: the owner object keeps it alive.
struct PyMemory {
    ptr: *const u8,
    len: usize,
    _owner: Py<PyAny>,
}

// SAFETY: the memory is a torch/numpy buffer that the owner keeps alive; it
// is only read. Dropping `Py` without the GIL is deferred by PyO3 until a
// thread holds it.
unsafe impl Send for PyMemory {}
unsafe impl Sync for PyMemory {}

impl AsRef<[u8]> for PyMemory {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the Python side passed data_ptr/nbytes of a live contiguous
        // CPU buffer, kept alive by `_owner`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// A tensor from its Python description (see the module docs).
pub fn from_py(desc: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let t = desc.cast::<PyTuple>().map_err(|_| PyTypeError::new_err("tensor description must be a tuple"))?;
    if t.len() != 7 {
        return Err(PyTypeError::new_err(
            "tensor description: (name, dtype, shape, data_ptr, nbytes, owner, metadata)",
        ));
    }
    let name: Option<String> = t.get_item(0)?.extract()?;
    let dtype: String = t.get_item(1)?.extract()?;
    let dtype: DType = dtype.parse().map_err(|e| PyValueError::new_err(format!("{e}")))?;
    let shape: Vec<usize> = t.get_item(2)?.extract()?;
    let ptr: usize = t.get_item(3)?.extract()?;
    let len: usize = t.get_item(4)?.extract()?;
    let owner = t.get_item(5)?.unbind();
    let meta: Option<BTreeMap<String, String>> = t.get_item(6)?.extract()?;
    if ptr == 0 && len != 0 {
        return Err(PyValueError::new_err("tensor has no data pointer"));
    }
    let bytes = Bytes::from_owner(PyMemory { ptr: ptr as *const u8, len, _owner: owner });
    let mut tensor = Tensor::new(dtype, shape, bytes).map_err(|e| PyValueError::new_err(e.to_string()))?;
    if let Some(n) = name {
        tensor.set_name(n);
    }
    if let Some(m) = meta {
        tensor.metadata_mut().extend(m);
    }
    Ok(tensor)
}

/// Every description in a list.
pub fn all_from_py(list: &Bound<'_, PyAny>) -> PyResult<Vec<Tensor>> {
    list.try_iter()?.map(|d| from_py(&d?)).collect()
}

/// A received tensor, ready for `tensorwire` to hand to torch.
#[pyclass(frozen, module = "tensorwire._native")]
pub struct Received {
    tensor: Tensor,
}

impl Received {
    /// Wraps a received tensor.
    pub fn new(tensor: Tensor) -> Self {
        Self { tensor }
    }

    /// Wraps every tensor.
    pub fn all(tensors: Vec<Tensor>) -> Vec<Received> {
        tensors.into_iter().map(Received::new).collect()
    }

    fn host(&self) -> PyResult<&Bytes> {
        match self.tensor.storage() {
            Storage::Host(b) => Ok(b),
            Storage::Device(d) => Err(PyValueError::new_err(format!(
                "tensor is in {} memory; this build hands only host tensors to Python",
                d.device()
            ))),
        }
    }
}

#[pymethods]
impl Received {
    /// The tensor's name, if it has one.
    #[getter]
    fn name(&self) -> Option<String> {
        self.tensor.name().map(str::to_string)
    }

    /// The dtype's torch name (`"bfloat16"`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.tensor.dtype().name()
    }

    /// The shape.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.tensor.shape().to_vec()
    }

    /// The strides, in elements.
    #[getter]
    fn strides(&self) -> Vec<usize> {
        self.tensor.strides().to_vec()
    }

    /// Offset of the first element in the storage, in elements.
    #[getter]
    fn storage_offset(&self) -> usize {
        self.tensor.storage_offset()
    }

    /// String metadata sent with the tensor.
    #[getter]
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.tensor.metadata() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Address of the receive buffer (for checking that nothing was copied).
    #[getter]
    fn address(&self) -> PyResult<usize> {
        Ok(self.host()?.as_ptr() as usize)
    }

    /// Length of the receive buffer in bytes.
    #[getter]
    fn storage_nbytes(&self) -> PyResult<usize> {
        Ok(self.host()?.len())
    }

    /// A DLPack capsule over the whole receive buffer as 1-D uint8; torch
    /// adopts it with `torch.from_dlpack` and frees it with the tensor.
    fn capsule<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        dlpack::capsule(py, self.host()?.clone())
    }

    fn __repr__(&self) -> String {
        format!("Received({:?})", self.tensor)
    }
}
