//! [`Cursor`]: bounds-checked little-endian reads over a byte slice, shared
//! by the zip reader and the pickle interpreter. Running past the end is a
//! [`DecodeError::Truncated`] naming what was being read, never a panic.

use crate::error::DecodeError;

/// Little-endian reads with bounds checks.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    /// Reads `buf` from `pos`; errors name `what` (`"zip record"`, `"pickle"`).
    pub(crate) fn at(what: &'static str, buf: &'a [u8], pos: usize) -> Self {
        Self { buf, pos, what }
    }

    /// The offset of the next read.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// The whole buffer.
    pub(crate) fn buf(&self) -> &'a [u8] {
        self.buf
    }

    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(DecodeError::Truncated {
            what: self.what,
            needed: (self.pos as u64).saturating_add(n as u64),
            available: self.buf.len() as u64,
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next `N` bytes as an array.
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    /// One byte.
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    /// A little-endian u16.
    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array().map(u16::from_le_bytes)
    }

    /// A little-endian u32.
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }

    /// A little-endian u64.
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }
}
