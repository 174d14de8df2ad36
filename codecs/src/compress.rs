//! Per-chunk compression: none, lz4, zstd with a level; an optional
//! byte-shuffle filter; and an auto mode that picks per tensor.
//!
//! Compression applies to each chunk on its own, so a large tensor streams
//! while it compresses, and any codec's payload (raw, torch, safetensors) can
//! be compressed. Each chunk header says how its chunk was compressed, and
//! the receiver decompresses into the tensor's buffer at the chunk's offset:
//! a decompressor is handed exactly `raw_len` bytes of room and fails if the
//! data wants more (decompression bombs end there).
//!
//! **Byte shuffle** groups byte 0 of every element, then byte 1, and so on,
//! before compressing. Smooth float data has slowly changing high bytes, so
//! the shuffled stream compresses far better (10–100× on ramps, where the
//! unshuffled bytes barely compress).

use std::fmt;
use std::str::FromStr;
use std::time::Instant;

use crate::error::{DecodeError, EncodeError};

/// A chunk's compression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Compression {
    /// Bytes as they are.
    #[default]
    None,
    /// lz4 block format (fast; ~GB/s per core).
    Lz4,
    /// zstd at a level (1 = fastest; 3 = zstd's default; up to 22).
    Zstd(i32),
    /// Float planes: exponent and sign+mantissa byte planes, each
    /// zstd-coded or stored raw (see the `planes` module); the chunk's shuffle
    /// field carries the element size. Needs the `zstd` feature.
    Planes,
}

impl Compression {
    /// `"none"`, `"lz4"` or `"zstd"`.
    pub const fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
            Compression::Zstd(_) => "zstd",
            Compression::Planes => "planes",
        }
    }

    /// True when this build can (de)compress it.
    pub const fn is_available(self) -> bool {
        match self {
            Compression::None => true,
            Compression::Lz4 => cfg!(feature = "lz4"),
            Compression::Zstd(_) | Compression::Planes => cfg!(feature = "zstd"),
        }
    }

    /// Compressions compiled into this build (zstd at level 3 as the representative).
    pub fn available() -> Vec<Compression> {
        [Compression::None, Compression::Lz4, Compression::Zstd(3), Compression::Planes]
            .into_iter()
            .filter(|c| c.is_available())
            .collect()
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Compression::Zstd(l) => write!(f, "zstd:{l}"),
            other => f.write_str(other.name()),
        }
    }
}

/// A compression name that is not `none`, `lz4`, `zstd`, `zstd:LEVEL` or `planes`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown compression {0:?}: expected none, lz4, zstd, zstd:LEVEL (1..=22), planes or auto")]
pub struct UnknownCompression(pub String);

impl FromStr for Compression {
    type Err = UnknownCompression;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "none" | "off" | "" => return Ok(Compression::None),
            "lz4" => return Ok(Compression::Lz4),
            "zstd" => return Ok(Compression::Zstd(3)),
            "planes" => return Ok(Compression::Planes),
            _ => {}
        }
        if let Some(level) = t.strip_prefix("zstd:").and_then(|l| l.parse::<i32>().ok())
            && (1..=22).contains(&level)
        {
            return Ok(Compression::Zstd(level));
        }
        Err(UnknownCompression(s.to_string()))
    }
}

/// What a sender does about compression: a fixed choice, or auto.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum CompressionMode {
    /// Always this compression (chunks that do not shrink go uncompressed).
    Fixed(Compression),
    /// Choose per tensor from a sample of its first chunk and the link's
    /// bandwidth (see [`choose_auto`]); never slower than no compression
    /// by the estimate. Over shared memory tensorwire does not compress in
    /// this mode.
    #[default]
    Auto,
}

impl FromStr for CompressionMode {
    type Err = UnknownCompression;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("auto") {
            Ok(CompressionMode::Auto)
        } else {
            s.parse().map(CompressionMode::Fixed)
        }
    }
}

impl fmt::Display for CompressionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompressionMode::Fixed(c) => c.fmt(f),
            CompressionMode::Auto => f.write_str("auto"),
        }
    }
}

/// Writes `input` byte-shuffled by `elem` into `out` (same length): all byte
/// 0s of the elements, then all byte 1s, ... A tail shorter than one element
/// is copied as is.
pub fn shuffle(input: &[u8], elem: usize, out: &mut [u8]) {
    assert_eq!(input.len(), out.len(), "shuffle needs equal lengths");
    if elem <= 1 {
        out.copy_from_slice(input);
        return;
    }
    let n = input.len() / elem;
    let body = n * elem;
    match elem {
        2 => shuffle_n::<2>(&input[..body], &mut out[..body], n),
        4 => shuffle_n::<4>(&input[..body], &mut out[..body], n),
        8 => shuffle_n::<8>(&input[..body], &mut out[..body], n),
        16 => shuffle_n::<16>(&input[..body], &mut out[..body], n),
        _ => {
            for (i, e) in input[..body].chunks_exact(elem).enumerate() {
                for (b, &byte) in e.iter().enumerate() {
                    out[b * n + i] = byte;
                }
            }
        }
    }
    out[body..].copy_from_slice(&input[body..]);
}

/// Elements transposed per block: small enough to stay in registers,
/// large enough that each plane gets whole 16-byte stores.
const BLOCK: usize = 16;

fn shuffle_n<const E: usize>(input: &[u8], out: &mut [u8], n: usize) {
    let blocks = n / BLOCK;
    for k in 0..blocks {
        let src = &input[k * BLOCK * E..(k + 1) * BLOCK * E];
        let mut rows = [[0u8; BLOCK]; E];
        for (j, e) in src.as_chunks::<E>().0.iter().take(BLOCK).enumerate() {
            for b in 0..E {
                rows[b][j] = e[b];
            }
        }
        for (b, row) in rows.iter().enumerate() {
            out[b * n + k * BLOCK..b * n + (k + 1) * BLOCK].copy_from_slice(row);
        }
    }
    for i in blocks * BLOCK..n {
        for b in 0..E {
            out[b * n + i] = input[i * E + b];
        }
    }
}

/// Inverse of [`shuffle`].
pub fn unshuffle(input: &[u8], elem: usize, out: &mut [u8]) {
    assert_eq!(input.len(), out.len(), "unshuffle needs equal lengths");
    if elem <= 1 {
        out.copy_from_slice(input);
        return;
    }
    let n = input.len() / elem;
    let body = n * elem;
    match elem {
        2 => unshuffle_n::<2>(&input[..body], &mut out[..body], n),
        4 => unshuffle_n::<4>(&input[..body], &mut out[..body], n),
        8 => unshuffle_n::<8>(&input[..body], &mut out[..body], n),
        16 => unshuffle_n::<16>(&input[..body], &mut out[..body], n),
        _ => {
            for (i, e) in out[..body].chunks_exact_mut(elem).enumerate() {
                for (b, byte) in e.iter_mut().enumerate() {
                    *byte = input[b * n + i];
                }
            }
        }
    }
    out[body..].copy_from_slice(&input[body..]);
}

fn unshuffle_n<const E: usize>(input: &[u8], out: &mut [u8], n: usize) {
    let blocks = n / BLOCK;
    for k in 0..blocks {
        let mut rows = [[0u8; BLOCK]; E];
        for (b, row) in rows.iter_mut().enumerate() {
            row.copy_from_slice(&input[b * n + k * BLOCK..b * n + (k + 1) * BLOCK]);
        }
        let dst = &mut out[k * BLOCK * E..(k + 1) * BLOCK * E];
        for (j, e) in dst.as_chunks_mut::<E>().0.iter_mut().take(BLOCK).enumerate() {
            for b in 0..E {
                e[b] = rows[b][j];
            }
        }
    }
    for i in blocks * BLOCK..n {
        for b in 0..E {
            out[i * E + b] = input[b * n + i];
        }
    }
}

/// Compresses chunks, reusing its buffers and zstd context between calls.
#[derive(Default)]
pub struct Compressor {
    scratch: Vec<u8>,
    #[cfg(feature = "zstd")]
    zstd: Option<(i32, zstd::bulk::Compressor<'static>)>,
}

impl fmt::Debug for Compressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Compressor").finish_non_exhaustive()
    }
}

impl Compressor {
    /// A compressor with no buffers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Compresses `input` (byte-shuffled first when `shuffle > 1`) and returns
    /// the compressed bytes, or `None` when compression would not shrink the
    /// chunk (send it uncompressed then).
    pub fn compress(
        &mut self,
        compression: Compression,
        shuffle_elem: u32,
        input: &[u8],
    ) -> Result<Option<Vec<u8>>, EncodeError> {
        if compression == Compression::Planes {
            return self.compress_planes(shuffle_elem, input);
        }
        let src: &[u8] = if shuffle_elem > 1 && compression != Compression::None {
            self.scratch.resize(input.len(), 0);
            shuffle(input, shuffle_elem as usize, &mut self.scratch);
            &self.scratch
        } else {
            input
        };
        let out: Vec<u8> = match compression {
            Compression::None => return Ok(None),
            #[cfg(feature = "lz4")]
            Compression::Lz4 => {
                let mut out = vec![0u8; lz4_flex::block::get_maximum_output_size(src.len())];
                let n = lz4_flex::block::compress_into(src, &mut out)
                    .map_err(|e| EncodeError::Compress { compression: "lz4", reason: e.to_string() })?;
                out.truncate(n);
                out
            }
            #[cfg(feature = "zstd")]
            Compression::Zstd(level) => {
                let ctx = Self::zstd_ctx(&mut self.zstd, level)?;
                let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(src.len()));
                ctx.compress_to_buffer(src, &mut out)
                    .map_err(|e| EncodeError::Compress { compression: "zstd", reason: e.to_string() })?;
                out
            }
            #[allow(unreachable_patterns)]
            other => return Err(EncodeError::NotEnabled(other.name())),
        };
        Ok((out.len() < input.len()).then_some(out))
    }

    #[cfg(feature = "zstd")]
    fn zstd_ctx<'a>(
        slot: &'a mut Option<(i32, zstd::bulk::Compressor<'static>)>,
        level: i32,
    ) -> Result<&'a mut zstd::bulk::Compressor<'static>, EncodeError> {
        if slot.as_ref().is_none_or(|(l, _)| *l != level) {
            let c = zstd::bulk::Compressor::new(level)
                .map_err(|e| EncodeError::Compress { compression: "zstd", reason: e.to_string() })?;
            *slot = Some((level, c));
        }
        Ok(&mut slot.as_mut().expect("set above").1)
    }

    /// Float planes of `elem`-byte elements (0 or 1: one plane).
    fn compress_planes(&mut self, elem: u32, input: &[u8]) -> Result<Option<Vec<u8>>, EncodeError> {
        #[cfg(feature = "zstd")]
        {
            let mut scratch = std::mem::take(&mut self.scratch);
            let out = Self::zstd_ctx(&mut self.zstd, crate::planes::PLANE_ZSTD_LEVEL)
                .and_then(|ctx| crate::planes::encode(input, elem.max(1) as usize, &mut scratch, ctx));
            self.scratch = scratch;
            let out = out?;
            Ok((out.len() < input.len()).then_some(out))
        }
        #[cfg(not(feature = "zstd"))]
        {
            let _ = (elem, input);
            Err(EncodeError::NotEnabled("planes"))
        }
    }
}

/// Decompresses chunks into caller-provided buffers of the declared size.
#[derive(Default)]
pub struct Decompressor {
    scratch: Vec<u8>,
    #[cfg(feature = "zstd")]
    zstd: Option<zstd::bulk::Decompressor<'static>>,
}

impl fmt::Debug for Decompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decompressor").finish_non_exhaustive()
    }
}

impl Decompressor {
    /// A decompressor with no buffers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of scratch memory that decompressing a chunk of `raw_len`
    /// bytes takes with this `compression` and `shuffle_elem`: a shuffled
    /// or planes chunk is decoded into scratch first, any other straight
    /// into its destination (0).
    pub fn scratch_needed(compression: Compression, shuffle_elem: u32, raw_len: usize) -> usize {
        match compression {
            Compression::None => 0,
            Compression::Planes => raw_len,
            _ if shuffle_elem > 1 => raw_len,
            _ => 0,
        }
    }

    /// Frees the scratch buffer (the next chunk that needs one allocates it).
    pub fn release_scratch(&mut self) {
        self.scratch = Vec::new();
    }

    /// Decompresses `input` into exactly `out.len()` bytes (the chunk's
    /// declared `raw_len`), then un-shuffles when `shuffle_elem > 1`. Fails
    /// when the data decodes to more or fewer bytes than that.
    pub fn decompress(
        &mut self,
        compression: Compression,
        shuffle_elem: u32,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DecodeError> {
        if compression == Compression::None {
            if input.len() != out.len() {
                return Err(DecodeError::Decompress {
                    compression: "none",
                    reason: format!("chunk has {} bytes but declares {}", input.len(), out.len()),
                });
            }
            out.copy_from_slice(input);
            return Ok(());
        }
        if compression == Compression::Planes {
            return self.decompress_planes(shuffle_elem, input, out);
        }
        let shuffled = shuffle_elem > 1;
        let mut scratch = std::mem::take(&mut self.scratch);
        if shuffled {
            crate::scratch::grow(&mut scratch, out.len())?;
        }
        let dst: &mut [u8] = if shuffled { &mut scratch } else { out };
        let result = self.decompress_raw(compression, input, dst);
        if result.is_ok() && shuffled {
            unshuffle(&scratch, shuffle_elem as usize, out);
        }
        self.scratch = scratch;
        result
    }

    #[cfg(feature = "zstd")]
    fn zstd_ctx(&mut self) -> Result<&mut zstd::bulk::Decompressor<'static>, DecodeError> {
        Ok(match &mut self.zstd {
            Some(d) => d,
            slot => slot.insert(
                zstd::bulk::Decompressor::new()
                    .map_err(|e| DecodeError::Decompress { compression: "zstd", reason: e.to_string() })?,
            ),
        })
    }

    fn decompress_planes(&mut self, elem: u32, input: &[u8], out: &mut [u8]) -> Result<(), DecodeError> {
        #[cfg(feature = "zstd")]
        {
            let mut scratch = std::mem::take(&mut self.scratch);
            let r = self
                .zstd_ctx()
                .and_then(|ctx| crate::planes::decode(input, elem.max(1) as usize, out, &mut scratch, ctx));
            self.scratch = scratch;
            r
        }
        #[cfg(not(feature = "zstd"))]
        {
            let _ = (elem, input, out);
            Err(DecodeError::NotEnabled("planes"))
        }
    }

    fn decompress_raw(&mut self, compression: Compression, input: &[u8], dst: &mut [u8]) -> Result<(), DecodeError> {
        let want = dst.len();
        let got: usize = match compression {
            Compression::None | Compression::Planes => unreachable!("handled by decompress"),
            #[cfg(feature = "lz4")]
            Compression::Lz4 => lz4_flex::block::decompress_into(input, dst)
                .map_err(|e| DecodeError::Decompress { compression: "lz4", reason: e.to_string() })?,
            #[cfg(feature = "zstd")]
            Compression::Zstd(_) => {
                let d = self.zstd_ctx()?;
                d.decompress_to_buffer(input, dst).map_err(|e| DecodeError::Decompress {
                    compression: "zstd",
                    reason: format!("{e} (the chunk declares {want} decoded bytes)"),
                })?
            }
            #[allow(unreachable_patterns)]
            other => return Err(DecodeError::NotEnabled(other.name())),
        };
        if got != want {
            return Err(DecodeError::Decompress {
                compression: compression.name(),
                reason: format!("decoded {got} bytes, the chunk declares {want}"),
            });
        }
        Ok(())
    }
}

/// The outcome of [`choose_auto`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AutoChoice {
    /// The compression to use.
    pub compression: Compression,
    /// Shuffle element size (0 or 1: none).
    pub shuffle: u32,
    /// Estimated end-to-end rate in bytes of tensor per second.
    pub estimated_rate: f64,
    /// Compression ratio measured on the sample (1.0 for none).
    pub ratio: f64,
}

/// Auto mode: compresses a sample of the tensor (`sample`, typically the
/// first 256 KiB of its first chunk) with lz4 and zstd(1), with and without
/// byte-shuffle, and as float planes for 2-, 4- and 8-byte elements, times each, and picks the one whose estimated end-to-end
/// rate — the slowest of compressing, sending the smaller bytes over a link of
/// `link_bytes_per_sec`, and decompressing — beats sending uncompressed by at
/// least 10%. An unknown or very fast link (e.g. loopback) therefore keeps
/// compression off.
pub fn choose_auto(compressor: &mut Compressor, sample: &[u8], itemsize: usize, link_bytes_per_sec: f64) -> AutoChoice {
    let none =
        AutoChoice { compression: Compression::None, shuffle: 0, estimated_rate: link_bytes_per_sec, ratio: 1.0 };
    if sample.len() < 1024 || !link_bytes_per_sec.is_finite() || link_bytes_per_sec <= 0.0 {
        return none;
    }
    let shuffle = if itemsize > 1 { itemsize as u32 } else { 0 };
    let mut candidates = vec![];
    if Compression::Lz4.is_available() {
        candidates.push((Compression::Lz4, 0));
        if shuffle > 1 {
            candidates.push((Compression::Lz4, shuffle));
        }
    }
    if Compression::Zstd(1).is_available() {
        candidates.push((Compression::Zstd(1), shuffle));
        if matches!(itemsize, 2 | 4 | 8) {
            candidates.push((Compression::Planes, itemsize as u32));
        }
    }
    let mut decompressor = Decompressor::new();
    let mut best = none;
    let mut out = vec![0u8; sample.len()];
    for (c, s) in candidates {
        let t0 = Instant::now();
        let Ok(Some(packed)) = compressor.compress(c, s, sample) else {
            continue;
        };
        let tc = t0.elapsed().as_secs_f64().max(1e-9);
        let t1 = Instant::now();
        if decompressor.decompress(c, s, &packed, &mut out).is_err() {
            continue;
        }
        let td = t1.elapsed().as_secs_f64().max(1e-9);
        let n = sample.len() as f64;
        let ratio = n / packed.len() as f64;
        let rate = (n / tc).min(link_bytes_per_sec * ratio).min(n / td);
        if rate > best.estimated_rate * 1.1 && rate > best.estimated_rate {
            best = AutoChoice { compression: c, shuffle: s, estimated_rate: rate, ratio };
        }
    }
    if best.compression != Compression::None && best.estimated_rate < link_bytes_per_sec * 1.1 {
        return none;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp_f32(n: usize) -> Vec<u8> {
        (0..n).flat_map(|i| (i as f32 * 1e-3).to_le_bytes()).collect()
    }

    #[test]
    fn shuffle_round_trips_every_size() {
        for elem in [1usize, 2, 3, 4, 8, 16] {
            for len in [0usize, 1, 7, 64, 1001] {
                let input: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
                let mut s = vec![0; len];
                let mut back = vec![0; len];
                shuffle(&input, elem, &mut s);
                unshuffle(&s, elem, &mut back);
                assert_eq!(back, input, "elem {elem} len {len}");
            }
        }
        let mut s = vec![0; 8];
        shuffle(&[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut s);
        assert_eq!(s, [1, 5, 2, 6, 3, 7, 4, 8]);
    }

    #[test]
    fn parse_names() {
        assert_eq!("zstd:7".parse::<Compression>().unwrap(), Compression::Zstd(7));
        assert_eq!("lz4".parse::<Compression>().unwrap(), Compression::Lz4);
        assert!("zstd:99".parse::<Compression>().is_err());
        assert_eq!("auto".parse::<CompressionMode>().unwrap(), CompressionMode::Auto);
        assert_eq!(Compression::Zstd(3).to_string(), "zstd:3");
    }

    #[cfg(all(feature = "lz4", feature = "zstd"))]
    #[test]
    fn round_trip_and_bombs() {
        let data = ramp_f32(100_000);
        let mut c = Compressor::new();
        let mut d = Decompressor::new();
        for comp in [Compression::Lz4, Compression::Zstd(1), Compression::Zstd(9)] {
            for sh in [0, 4] {
                let Some(packed) = c.compress(comp, sh, &data).unwrap() else {
                    // lz4 cannot shrink an unshuffled float ramp: the chunk goes uncompressed.
                    assert_eq!((comp, sh), (Compression::Lz4, 0));
                    continue;
                };
                let mut out = vec![0; data.len()];
                d.decompress(comp, sh, &packed, &mut out).unwrap();
                assert_eq!(out, data);
                // Declaring fewer bytes than the data decodes to is an error, not an overflow.
                let mut small = vec![0; data.len() / 2];
                assert!(d.decompress(comp, sh, &packed, &mut small).is_err());
                // And more is an error too.
                let mut big = vec![0; data.len() + 1];
                assert!(d.decompress(comp, sh, &packed, &mut big).is_err());
            }
        }
        let mut out = vec![0; 100];
        assert!(d.decompress(Compression::Lz4, 0, &[0xff; 10], &mut out).is_err());
        assert!(d.decompress(Compression::Zstd(1), 0, &[0x28, 0xb5, 0x2f, 0xfd, 0, 0], &mut out).is_err());
    }

    #[cfg(feature = "zstd")]
    #[test]
    fn planes_round_trip_through_the_compressor_and_auto_picks_them() {
        // Weight-like bf16: a narrow exponent range, random mantissas.
        let mut x = 0x9e3779b97f4a7c15u64;
        let data: Vec<u8> = (0..1 << 17)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let e = 0x3c + (x >> 60) as u16 % 3;
                ((e << 7) | (x >> 20) as u16 & 0x807f).to_le_bytes()
            })
            .collect();
        let mut c = Compressor::new();
        let mut d = Decompressor::new();
        let packed = c.compress(Compression::Planes, 2, &data).unwrap().unwrap();
        let mut out = vec![0; data.len()];
        d.decompress(Compression::Planes, 2, &packed, &mut out).unwrap();
        assert_eq!(out, data);
        assert!(d.decompress(Compression::Planes, 2, &packed[..packed.len() - 1], &mut out).is_err());
        // Auto weighs planes against zstd+shuffle on a slow link (either wins here).
        let slow = choose_auto(&mut c, &data[..256 << 10], 2, 10e6);
        assert!(slow.compression != Compression::None && slow.ratio > 1.3, "{slow:?}");
        assert_eq!("planes".parse::<Compression>().unwrap(), Compression::Planes);
    }

    #[cfg(feature = "zstd")]
    #[test]
    fn shuffle_makes_ramps_compress() {
        let data = ramp_f32(1 << 18);
        let mut c = Compressor::new();
        let plain = c.compress(Compression::Zstd(1), 0, &data).unwrap().map_or(data.len(), |v| v.len());
        let shuffled = c.compress(Compression::Zstd(1), 4, &data).unwrap().unwrap().len();
        let r_plain = data.len() as f64 / plain as f64;
        let r_shuf = data.len() as f64 / shuffled as f64;
        assert!(r_shuf > 4.0 * r_plain, "plain {r_plain:.1}x shuffled {r_shuf:.1}x");
    }

    #[cfg(all(feature = "lz4", feature = "zstd"))]
    #[test]
    fn auto_keeps_fast_links_uncompressed_and_compresses_slow_ones() {
        let data = ramp_f32(1 << 16);
        let mut c = Compressor::new();
        let fast = choose_auto(&mut c, &data, 4, 1e12);
        assert_eq!(fast.compression, Compression::None);
        let slow = choose_auto(&mut c, &data, 4, 10e6);
        assert_ne!(slow.compression, Compression::None);
        assert!(slow.ratio > 2.0);
        // Random bytes never compress.
        let mut x = 0x9e3779b97f4a7c15u64;
        let noise: Vec<u8> = (0..1 << 18)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        let n = choose_auto(&mut c, &noise, 1, 10e6);
        assert_eq!(n.compression, Compression::None);
    }
}
