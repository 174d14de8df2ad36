//! Scratch buffers the decoders reuse, grown fallibly: their sizes come
//! from a peer's chunk headers.

use crate::error::DecodeError;

/// Makes `scratch` `n` bytes long; a failed allocation is an error, not
/// an abort (`n` comes from a peer's chunk header).
pub(crate) fn grow(scratch: &mut Vec<u8>, n: usize) -> Result<(), DecodeError> {
    if scratch.capacity() < n {
        scratch.clear();
        scratch.try_reserve_exact(n).map_err(|_| DecodeError::Decompress {
            compression: "scratch",
            reason: format!("cannot allocate {n} bytes to decode a chunk into"),
        })?;
    }
    scratch.resize(n, 0);
    Ok(())
}
