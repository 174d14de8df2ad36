//! `tensorwire._native`: the compiled half of the `tensorwire` Python
//! package. It moves bytes; the Python half (`python/tensorwire/`) turns
//! torch tensors into the raw descriptions this module takes and the
//! [`tensors::Received`] buffers it returns back into torch tensors.
//!
//! The split keeps torch out of the Rust build (no libtorch link, any torch
//! version works): a tensor crosses as `(name, dtype, shape, data_ptr,
//! nbytes, owner, metadata)` and is sent straight from the owner's memory,
//! which stays alive until the last byte left; a received tensor crosses as
//! a DLPack capsule over the receive buffer itself, which torch adopts.
//!
//! Every blocking call releases the GIL while bytes move and polls for
//! signals, so Ctrl-C cancels a long transfer.

mod aclient;
mod client;
mod dlpack;
mod errors;
mod server;
mod tensors;
mod values;

use pyo3::prelude::*;

/// Fixes glibc's allocator thresholds for bulk transfers (see
/// `tensorwire::tune_allocator`): process-wide, so only on request.
#[pyfunction]
fn tune_allocator() -> bool {
    tensorwire::tune_allocator()
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", tensorwire::VERSION)?;
    m.add("CUDA", cfg!(feature = "cuda"))?;
    m.add_class::<tensors::Received>()?;
    m.add_class::<client::NativeClient>()?;
    m.add_class::<client::Exchange>()?;
    m.add_class::<aclient::NativeAsyncClient>()?;
    m.add_function(wrap_pyfunction!(aclient::async_in_flight, m)?)?;
    m.add_function(wrap_pyfunction!(tune_allocator, m)?)?;
    m.add_class::<server::NativeServer>()?;
    Ok(())
}
