//! The zip container of `torch.save`: stored (uncompressed) entries whose
//! data starts on 64-byte boundaries, found through the central directory.
//!
//! The reader trusts nothing: every offset and length is checked against the
//! buffer before use, counts against [`DecodeLimits`], and compressed entries
//! are refused (torch never writes them). Entry data is returned as slices of
//! the input buffer, so tensors read from a file share its memory.
//!
//! The writer emits what torch 2.x emits: a local header with general-purpose
//! flag bit 3 (sizes follow the data in a data descriptor) and an `FB` extra
//! field padding the data to the alignment, a CRC-32 per entry, a central
//! directory, and zip64 end records. Entry data is passed through as
//! [`Bytes`] segments, so large tensors are never copied.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::DecodeError;
use crate::limits::DecodeLimits;
use crate::torch::cursor::Cursor;

const LFH_SIG: u32 = 0x0403_4b50;
const CDH_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOC_SIG: u32 = 0x0706_4b50;
const DD_SIG: u32 = 0x0807_4b50;
const FLAGS: u16 = 0x0808; // bit 3: data descriptor; bit 11: UTF-8 names
const ZIP64_EXTRA: u16 = 0x0001;

fn malformed(reason: impl Into<String>) -> DecodeError {
    DecodeError::Malformed { format: "torch zip archive", reason: reason.into() }
}

/// One stored entry of an archive.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Full name inside the archive (`archive/data/0`).
    pub name: String,
    /// The entry's bytes, a slice of the archive buffer.
    pub data: Bytes,
    /// CRC-32 recorded in the central directory.
    pub crc32: u32,
}

/// Parses the central directory of `buf` and returns its stored entries.
pub fn read_entries(buf: &Bytes, limits: &DecodeLimits) -> Result<Vec<Entry>, DecodeError> {
    let (count, cd_offset, cd_size) = find_central_directory(buf)?;
    if count > limits.max_entries as u64 {
        return Err(DecodeError::LimitExceeded { what: "zip entries", count, limit: limits.max_entries as u64 });
    }
    let cd_end = cd_offset.checked_add(cd_size).filter(|&e| e <= buf.len() as u64).ok_or_else(|| {
        malformed(format!(
            "central directory at {cd_offset} of {cd_size} bytes lies outside the {} byte file",
            buf.len()
        ))
    })?;
    // Each central record is at least 46 bytes: bound the count by the size
    // before reserving anything.
    if count.saturating_mul(46) > cd_size {
        return Err(malformed(format!("{count} entries cannot fit in a {cd_size} byte central directory")));
    }
    let mut entries = Vec::with_capacity(count as usize);
    let mut c = Cursor::at("zip record", &buf[..cd_end as usize], cd_offset as usize);
    for _ in 0..count {
        if c.u32()? != CDH_SIG {
            return Err(malformed("bad central directory record signature"));
        }
        let _made_by = c.u16()?;
        let _needed = c.u16()?;
        let _flags = c.u16()?;
        let method = c.u16()?;
        let _time = c.u32()?;
        let crc32 = c.u32()?;
        let mut csize = u64::from(c.u32()?);
        let mut usize_ = u64::from(c.u32()?);
        let name_len = c.u16()? as usize;
        let extra_len = c.u16()? as usize;
        let comment_len = c.u16()? as usize;
        let _disk = c.u16()?;
        let _int_attr = c.u16()?;
        let _ext_attr = c.u32()?;
        let mut lfh_offset = u64::from(c.u32()?);
        let name =
            std::str::from_utf8(c.take(name_len)?).map_err(|_| malformed("entry name is not UTF-8"))?.to_string();
        let extra = c.take(extra_len)?;
        c.take(comment_len)?;
        // Zip64 extra: the 8-byte values of fields set to 0xFFFFFFFF, in order.
        let mut e = Cursor::at("zip record", extra, 0);
        while e.pos() + 4 <= extra.len() {
            let id = e.u16()?;
            let len = e.u16()? as usize;
            let body = e.take(len)?;
            if id == ZIP64_EXTRA {
                let mut z = Cursor::at("zip record", body, 0);
                if usize_ == 0xFFFF_FFFF {
                    usize_ = z.u64()?;
                }
                if csize == 0xFFFF_FFFF {
                    csize = z.u64()?;
                }
                if lfh_offset == 0xFFFF_FFFF {
                    lfh_offset = z.u64()?;
                }
            }
        }
        if method != 0 {
            return Err(malformed(format!(
                "entry {name} uses compression method {method}; torch archives store entries uncompressed"
            )));
        }
        if csize != usize_ {
            return Err(malformed(format!("stored entry {name} has compressed size {csize} != size {usize_}")));
        }
        let data_start = local_data_start(buf, lfh_offset, &name)?;
        let data_end = data_start.checked_add(usize_).filter(|&e| e <= buf.len() as u64).ok_or_else(|| {
            malformed(format!("entry {name} ({usize_} bytes at {data_start}) runs past the end of the file"))
        })?;
        entries.push(Entry { name, data: buf.slice(data_start as usize..data_end as usize), crc32 });
    }
    Ok(entries)
}

/// Offset of an entry's data: after its local header, name and extra field.
fn local_data_start(buf: &[u8], lfh_offset: u64, name: &str) -> Result<u64, DecodeError> {
    let off = usize::try_from(lfh_offset).map_err(|_| malformed("local header offset overflows"))?;
    let mut c = Cursor::at("zip record", buf, off);
    if c.u32()? != LFH_SIG {
        return Err(malformed(format!("entry {name}: no local header at offset {lfh_offset}")));
    }
    c.take(22)?;
    let name_len = c.u16()? as u64;
    let extra_len = c.u16()? as u64;
    Ok(lfh_offset + 30 + name_len + extra_len)
}

/// Finds (entry count, central directory offset, size), preferring zip64 records.
fn find_central_directory(buf: &[u8]) -> Result<(u64, u64, u64), DecodeError> {
    if buf.len() < 22 {
        return Err(DecodeError::Truncated { what: "zip archive", needed: 22, available: buf.len() as u64 });
    }
    // The end record is within the last 22 + 65535 bytes (its comment is at
    // most 65535 bytes long).
    let lo = buf.len().saturating_sub(22 + 0xFFFF);
    let eocd = (lo..=buf.len() - 22)
        .rev()
        .find(|&i| buf[i..i + 4] == EOCD_SIG.to_le_bytes())
        .ok_or_else(|| malformed("no end of central directory record (not a zip file, or truncated)"))?;
    let mut c = Cursor::at("zip record", buf, eocd + 4);
    let _disk = c.u16()?;
    let _cd_disk = c.u16()?;
    let _n_disk = c.u16()?;
    let n = c.u16()?;
    let size = c.u32()?;
    let offset = c.u32()?;
    if eocd >= 20 && buf[eocd - 20..eocd - 16] == ZIP64_LOC_SIG.to_le_bytes() {
        let mut l = Cursor::at("zip record", buf, eocd - 16);
        let _disk = l.u32()?;
        let z_off = l.u64()?;
        let z = usize::try_from(z_off).map_err(|_| malformed("zip64 end record offset overflows"))?;
        let mut r = Cursor::at("zip record", buf, z);
        if r.u32()? != ZIP64_EOCD_SIG {
            return Err(malformed("zip64 locator points at no zip64 end record"));
        }
        let _rec_size = r.u64()?;
        let _made = r.u16()?;
        let _need = r.u16()?;
        let _disk = r.u32()?;
        let _cd_disk = r.u32()?;
        let _n_disk = r.u64()?;
        let n64 = r.u64()?;
        let size64 = r.u64()?;
        let off64 = r.u64()?;
        return Ok((n64, off64, size64));
    }
    Ok((u64::from(n), u64::from(offset), u64::from(size)))
}

/// Builds an archive as a list of segments: small headers written here,
/// entry data passed through as it is.
pub struct ZipWriter {
    align: usize,
    compute_crc: bool,
    segments: Vec<Bytes>,
    pending: BytesMut,
    offset: u64,
    central: Vec<CentralRecord>,
}

struct CentralRecord {
    name: String,
    crc: u32,
    size: u64,
    lfh_offset: u64,
}

impl ZipWriter {
    /// A writer aligning entry data to `align` bytes (torch uses 64).
    /// With `compute_crc` false, CRC fields are written as 0 (torch reads
    /// them anyway, as with `torch.serialization.set_crc32_options(False)`;
    /// Python's `zipfile` would refuse them).
    pub fn new(align: usize, compute_crc: bool) -> Self {
        Self {
            align: align.max(1),
            compute_crc,
            segments: Vec::new(),
            pending: BytesMut::with_capacity(4096),
            offset: 0,
            central: Vec::new(),
        }
    }

    /// Appends an entry holding `data` (not copied when large).
    pub fn add(&mut self, name: &str, data: Bytes) {
        let lfh_offset = self.offset + self.pending.len() as u64;
        let size = data.len() as u64;
        let zip64 = size >= 0xFFFF_FFFF;
        // Local header: sizes and CRC are zero here; they follow the data.
        let fixed = 30 + name.len();
        let zip64_extra_len = if zip64 { 20 } else { 0 };
        let unpadded = lfh_offset as usize + fixed + zip64_extra_len + 4;
        let pad = (self.align - unpadded % self.align) % self.align;
        let p = &mut self.pending;
        p.put_u32_le(LFH_SIG);
        p.put_u16_le(if zip64 { 45 } else { 20 });
        p.put_u16_le(FLAGS);
        p.put_u16_le(0); // stored
        p.put_u16_le(0); // time
        p.put_u16_le(0x21); // date: 1980-01-01
        p.put_u32_le(0);
        p.put_u32_le(if zip64 { 0xFFFF_FFFF } else { 0 });
        p.put_u32_le(if zip64 { 0xFFFF_FFFF } else { 0 });
        p.put_u16_le(name.len() as u16);
        p.put_u16_le((zip64_extra_len + 4 + pad) as u16);
        p.put_slice(name.as_bytes());
        if zip64 {
            p.put_u16_le(ZIP64_EXTRA);
            p.put_u16_le(16);
            p.put_u64_le(0);
            p.put_u64_le(0);
        }
        p.put_slice(b"FB");
        p.put_u16_le(pad as u16);
        p.put_bytes(b'Z', pad);
        let crc = if self.compute_crc { crate::checksum::crc32(&data) } else { 0 };
        // Small entries join the header buffer; large ones stay separate.
        if data.len() <= 4096 {
            self.pending.put_slice(&data);
        } else {
            self.flush_pending();
            self.offset += size;
            self.segments.push(data);
        }
        let p = &mut self.pending;
        p.put_u32_le(DD_SIG);
        p.put_u32_le(crc);
        if zip64 {
            p.put_u64_le(size);
            p.put_u64_le(size);
        } else {
            p.put_u32_le(size as u32);
            p.put_u32_le(size as u32);
        }
        self.central.push(CentralRecord { name: name.to_string(), crc, size, lfh_offset });
    }

    /// Takes the segments written so far (for writing an archive out as it
    /// is built); the next ones, and [`ZipWriter::finish`], follow them.
    pub fn take_segments(&mut self) -> Vec<Bytes> {
        self.flush_pending();
        std::mem::take(&mut self.segments)
    }

    fn flush_pending(&mut self) {
        if !self.pending.is_empty() {
            self.offset += self.pending.len() as u64;
            self.segments.push(self.pending.split().freeze());
        }
    }

    /// Writes the central directory and end records; returns the segments.
    pub fn finish(mut self) -> Vec<Bytes> {
        let cd_offset = self.offset + self.pending.len() as u64;
        let start = self.pending.len();
        for r in &self.central {
            let big_size = r.size >= 0xFFFF_FFFF;
            let big_off = r.lfh_offset >= 0xFFFF_FFFF;
            let extra_len = 8 * (2 * usize::from(big_size) + usize::from(big_off));
            let p = &mut self.pending;
            p.put_u32_le(CDH_SIG);
            p.put_u16_le(if extra_len > 0 { 45 } else { 20 });
            p.put_u16_le(if extra_len > 0 { 45 } else { 20 });
            p.put_u16_le(FLAGS);
            p.put_u16_le(0);
            p.put_u16_le(0);
            p.put_u16_le(0x21);
            p.put_u32_le(r.crc);
            let s32 = if big_size { 0xFFFF_FFFF } else { r.size as u32 };
            p.put_u32_le(s32);
            p.put_u32_le(s32);
            p.put_u16_le(r.name.len() as u16);
            p.put_u16_le(if extra_len > 0 { extra_len as u16 + 4 } else { 0 });
            p.put_u16_le(0); // comment
            p.put_u16_le(0); // disk
            p.put_u16_le(0); // internal attributes
            p.put_u32_le(0); // external attributes
            p.put_u32_le(if big_off { 0xFFFF_FFFF } else { r.lfh_offset as u32 });
            p.put_slice(r.name.as_bytes());
            if extra_len > 0 {
                p.put_u16_le(ZIP64_EXTRA);
                p.put_u16_le(extra_len as u16);
                if big_size {
                    p.put_u64_le(r.size);
                    p.put_u64_le(r.size);
                }
                if big_off {
                    p.put_u64_le(r.lfh_offset);
                }
            }
        }
        let cd_size = (self.pending.len() - start) as u64;
        let n = self.central.len() as u64;
        let zip64_eocd = cd_offset + cd_size;
        let p = &mut self.pending;
        p.put_u32_le(ZIP64_EOCD_SIG);
        p.put_u64_le(44);
        p.put_u16_le(45);
        p.put_u16_le(45);
        p.put_u32_le(0);
        p.put_u32_le(0);
        p.put_u64_le(n);
        p.put_u64_le(n);
        p.put_u64_le(cd_size);
        p.put_u64_le(cd_offset);
        p.put_u32_le(ZIP64_LOC_SIG);
        p.put_u32_le(0);
        p.put_u64_le(zip64_eocd);
        p.put_u32_le(1);
        p.put_u32_le(EOCD_SIG);
        p.put_u16_le(0);
        p.put_u16_le(0);
        p.put_u16_le(n.min(0xFFFF) as u16);
        p.put_u16_le(n.min(0xFFFF) as u16);
        p.put_u32_le(cd_size.min(0xFFFF_FFFF) as u32);
        p.put_u32_le(cd_offset.min(0xFFFF_FFFF) as u32);
        p.put_u16_le(0);
        self.flush_pending();
        self.segments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(segs: &[Bytes]) -> Bytes {
        let mut v = Vec::new();
        for s in segs {
            v.extend_from_slice(s);
        }
        Bytes::from(v)
    }

    #[test]
    fn write_then_read() {
        let big = Bytes::from(vec![7u8; 10_000]);
        let mut w = ZipWriter::new(64, true);
        w.add("archive/data.pkl", Bytes::from_static(b"\x80\x02N."));
        w.add("archive/data/0", big.clone());
        w.add("archive/version", Bytes::from_static(b"3\n"));
        let segs = w.finish();
        // The big entry is passed through, not copied.
        assert!(segs.iter().any(|s| s.as_ptr() == big.as_ptr()));
        let file = join(&segs);
        let entries = read_entries(&file, &DecodeLimits::default()).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[1].name, "archive/data/0");
        assert_eq!(entries[1].data, big);
        assert_eq!(entries[1].crc32, crate::checksum::crc32(&big));
        for e in &entries {
            assert_eq!((e.data.as_ptr() as usize - file.as_ptr() as usize) % 64, 0, "{} aligned", e.name);
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        let mut w = ZipWriter::new(64, true);
        w.add("a/data.pkl", Bytes::from_static(b"\x80\x02N."));
        w.add("a/data/0", Bytes::from(vec![1u8; 100]));
        let file = join(&w.finish());
        for cut in 0..file.len() {
            let part = file.slice(..cut);
            assert!(read_entries(&part, &DecodeLimits::default()).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn entry_limit() {
        let mut w = ZipWriter::new(64, false);
        for i in 0..10 {
            w.add(&format!("a/{i}"), Bytes::from_static(b"x"));
        }
        let file = join(&w.finish());
        let limits = DecodeLimits { max_entries: 5, ..Default::default() };
        assert!(matches!(read_entries(&file, &limits), Err(DecodeError::LimitExceeded { .. })));
    }
}
