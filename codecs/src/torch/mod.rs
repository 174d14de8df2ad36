//! The torch.save-compatible codec: reads and writes the zip format of
//! `torch.save` (PyTorch ≥ 1.6), so Python peers exchange bytes with
//! `torch.load(..., weights_only=True)` and `torch.save`.
//!
//! * [`load`] reads a file into a [`Object`]: single tensors, and lists,
//!   tuples, dicts and OrderedDicts (state dicts) with str/int/float/bool/None
//!   leaves. Every dtype of the tensor model; strides, storage offsets, and
//!   several tensors viewing one storage (they share memory after loading).
//! * [`save`] writes a [`Object`] the way torch 2.x does: legacy storage types
//!   with `_rebuild_tensor_v2`, `UntypedStorage` with `_rebuild_tensor_v3`
//!   for uint16/32/64 and float8, stored zip entries aligned to 64 bytes,
//!   each storage written once. Tensor bytes are passed through as segments,
//!   never copied.
//!
//! **Safe by construction**: the pickle inside is run by a small interpreter
//! ([`pickle`]) with a fixed allow-list of globals; anything else — an
//! `os.system` reduce, `builtins.eval`, an unknown class — is an error naming
//! the global, and nothing is ever executed. Stricter than
//! `torch.load(weights_only=False)`, and than `weights_only=True` too.
//!
//! | file | holds |
//! |---|---|
//! | `object.rs` | [`Object`], the object tree a file holds |
//! | `file.rs` | [`load`], [`save`], [`SaveOptions`]: whole torch.save files |
//! | `stream.rs` | [`StateDictWriter`]: a state dict written to a file while its tensors arrive |
//! | `codec.rs` | [`TorchCodec`], one tensor per payload for the pipeline |
//! | `cursor.rs` | bounds-checked little-endian reads, for the zip reader and the pickle interpreter |
//! | `zip.rs` | [`zip`]: the zip container (stored entries, aligned) |
//! | `pickle_model.rs` | what reader and writer share: [`pickle::PickleValue`], [`pickle::TensorRef`], [`pickle::StorageRef`], the storage-class table |
//! | `pickle.rs` | [`pickle`]: the safe pickle interpreter (reader) |
//! | `pickle_write.rs` | [`pickle_write`]: the pickle writer |

mod codec;
mod cursor;
mod file;
mod object;
pub mod pickle;
mod pickle_model;
pub mod pickle_write;
mod stream;
#[cfg(test)]
mod tests;
pub mod zip;

pub use codec::TorchCodec;
pub use file::{SaveOptions, load, save};
pub use object::Object;
pub use stream::StateDictWriter;
