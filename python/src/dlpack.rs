//! A DLPack capsule over received bytes, so torch adopts the receive buffer
//! as a tensor's storage without a copy (`torch.from_dlpack(capsule)`).
//!
//! The capsule exports the buffer as a 1-D `uint8` CPU tensor; the Python
//! side reinterprets it (`.view(dtype)`, `.as_strided(...)`), which is how
//! every dtype — bfloat16, float8, complex, bool — gets through without
//! depending on which DLPack version the installed torch speaks. The
//! [`Bytes`] handle rides in `manager_ctx` and is dropped by the deleter,
//! which torch calls when the tensor's storage dies (or the capsule's
//! destructor calls, if nobody consumed it).

use std::ffi::{CStr, c_void};

use bytes::Bytes;
use pyo3::ffi;
use pyo3::prelude::*;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// What the managed tensor points into; freed with it.
struct Context {
    _bytes: Bytes,
    shape: [i64; 1],
    strides: [i64; 1],
}

const K_DL_CPU: i32 = 1;
const K_DL_UINT: u8 = 1;
const NAME: &CStr = c"dltensor";

unsafe extern "C" fn deleter(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its context were made by `Box::into_raw` in `capsule`
    // and are freed exactly once: torch calls the deleter after renaming the
    // capsule, and the capsule destructor calls it only while it was not
    // consumed.
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx.cast::<Context>()));
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule; a consumed capsule was
    // renamed ("used_dltensor") and its tensor belongs to the consumer.
    unsafe {
        // IsValid sets no error either way (GetPointer would, with another
        // name). Nothing is cleared here: a capsule may be freed while an
        // exception propagates, and that exception is not ours to drop.
        if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()).cast::<DLManagedTensor>();
            deleter(m);
        }
    }
}

/// A `dltensor` capsule exporting `bytes` as a writable 1-D uint8 CPU
/// tensor (the receiver owns the buffer alone: nothing else reads it; a
/// shared-memory segment it lies in is mapped writable for this).
pub fn capsule(py: Python<'_>, bytes: Bytes) -> PyResult<Bound<'_, PyAny>> {
    let len = bytes.len() as i64;
    let data = bytes.as_ptr() as *mut c_void;
    let ctx = Box::into_raw(Box::new(Context { _bytes: bytes, shape: [len], strides: [1] }));
    // SAFETY: ctx was just leaked and lives until the deleter runs.
    let (shape, strides) = unsafe { ((*ctx).shape.as_mut_ptr(), (*ctx).strides.as_mut_ptr()) };
    let managed = Box::into_raw(Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data,
            device: DLDevice { device_type: K_DL_CPU, device_id: 0 },
            ndim: 1,
            dtype: DLDataType { code: K_DL_UINT, bits: 8, lanes: 1 },
            shape,
            strides,
            byte_offset: 0,
        },
        manager_ctx: ctx.cast(),
        deleter: Some(deleter),
    }));
    // SAFETY: the name is 'static; on failure we free what we allocated.
    unsafe {
        let cap = ffi::PyCapsule_New(managed.cast(), NAME.as_ptr(), Some(capsule_destructor));
        if cap.is_null() {
            deleter(managed);
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, cap))
    }
}
