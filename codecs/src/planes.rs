//! Float-plane compression (`Compression::Planes` in `compress`):
//! split each float element into an exponent plane and sign+mantissa
//! planes, then entropy-code every plane on its own.
//!
//! Trained weights have a narrow exponent distribution (2–3 bits of entropy
//! in an 8-bit field) and nearly random mantissas; a general-purpose
//! compressor on the interleaved bytes sees neither. Following ZipNN
//! (arXiv 2411.05239) each element, read as a little-endian integer of
//! `elem` bytes, is **rotated left by one bit**, which moves the sign bit
//! from the top to the bottom: the top byte of bf16/f32 is then exactly the
//! 8-bit exponent (f16: 5 exponent bits and the top 3 mantissa bits; f64: 8
//! of its 11 exponent bits). The rotated elements are byte-shuffled, so byte
//! plane `elem - 1` holds every exponent, and each plane is compressed with
//! zstd (its Huffman/FSE stage does the entropy coding) or, when that does
//! not shrink it, stored raw — random mantissa planes then cost a copy, not
//! a failed compression on the receiver. The transform is a bijection on
//! bit patterns, so NaN payloads, infinities, signed zeros and denormals
//! round-trip bit-exact, and any element type of 1, 2, 4 or 8 bytes is
//! accepted (only floats benefit).
//!
//! ## Format (version 1), one per chunk
//!
//! ```text
//! u8  version = 1
//! u8  elem    (1, 2, 4 or 8; equals the chunk's shuffle field)
//! elem × { u8 method (0 = raw, 1 = zstd), u32 LE stored length }
//! the planes' stored bytes, in order (plane b = byte b of every rotated element)
//! the tail: raw_len % elem bytes, as they are
//! ```
//!
//! Every plane decodes to exactly `raw_len / elem` bytes. The decoder checks
//! the version, the element size, each method and that the declared lengths
//! plus the tail add up to the payload exactly before it decodes anything,
//! and decodes into the caller's buffer of the declared size (no
//! allocation beyond one scratch buffer of that size).

use crate::error::{DecodeError, EncodeError};

/// The format version this build writes and reads.
pub const VERSION: u8 = 1;
const METHOD_RAW: u8 = 0;
const METHOD_ZSTD: u8 = 1;
/// zstd level used for each plane (level 1 already runs the Huffman/FSE
/// stage that does the work here; higher levels gain <1% on these planes).
pub const PLANE_ZSTD_LEVEL: i32 = 1;

fn header_len(elem: usize) -> usize {
    2 + 5 * elem
}

/// True for the element sizes the plane transform supports.
pub const fn supports(elem: usize) -> bool {
    matches!(elem, 1 | 2 | 4 | 8)
}

fn err(reason: impl Into<String>) -> DecodeError {
    DecodeError::Decompress { compression: "planes", reason: reason.into() }
}

/// Writes the rotate-left-by-one transform of each `elem`-byte element of
/// `input` byte-shuffled into `out` (same length, whole elements only).
fn rotate_shuffle(input: &[u8], elem: usize, out: &mut [u8]) {
    let n = input.len() / elem;
    macro_rules! go {
        ($t:ty, $w:expr) => {{
            let (planes, _) = out.split_at_mut(n * $w);
            for (i, e) in input.chunks_exact($w).enumerate() {
                let v = <$t>::from_le_bytes(e.try_into().expect("chunks_exact")).rotate_left(1).to_le_bytes();
                for (b, byte) in v.iter().enumerate() {
                    planes[b * n + i] = *byte;
                }
            }
        }};
    }
    match elem {
        2 => go!(u16, 2),
        4 => go!(u32, 4),
        8 => go!(u64, 8),
        _ => out[..n].copy_from_slice(&input[..n]),
    }
}

/// Inverse of [`rotate_shuffle`].
fn unshuffle_rotate(planes: &[u8], elem: usize, out: &mut [u8]) {
    let n = planes.len() / elem;
    macro_rules! go {
        ($t:ty, $w:expr) => {{
            for (i, e) in out.chunks_exact_mut($w).enumerate() {
                let mut v = [0u8; $w];
                for (b, byte) in v.iter_mut().enumerate() {
                    *byte = planes[b * n + i];
                }
                e.copy_from_slice(&<$t>::from_le_bytes(v).rotate_right(1).to_le_bytes());
            }
        }};
    }
    match elem {
        2 => go!(u16, 2),
        4 => go!(u32, 4),
        8 => go!(u64, 8),
        _ => out[..n].copy_from_slice(&planes[..n]),
    }
}

/// Encodes `input` as planes of `elem`-byte elements. `scratch` is reused
/// between calls; `zstd` is the caller's compression context at
/// [`PLANE_ZSTD_LEVEL`].
#[cfg(feature = "zstd")]
pub(crate) fn encode(
    input: &[u8],
    elem: usize,
    scratch: &mut Vec<u8>,
    zstd: &mut zstd::bulk::Compressor<'static>,
) -> Result<Vec<u8>, EncodeError> {
    if !supports(elem) {
        return Err(EncodeError::Compress {
            compression: "planes",
            reason: format!("element size {elem} (1, 2, 4 or 8)"),
        });
    }
    let n = input.len() / elem;
    let body = n * elem;
    scratch.resize(body, 0);
    rotate_shuffle(&input[..body], elem, scratch);
    let mut out = vec![0u8; header_len(elem)];
    out[0] = VERSION;
    out[1] = elem as u8;
    let mut packed = Vec::with_capacity(zstd::zstd_safe::compress_bound(n));
    for (b, plane) in scratch.chunks(n.max(1)).take(elem).enumerate() {
        packed.clear();
        zstd.compress_to_buffer(plane, &mut packed)
            .map_err(|e| EncodeError::Compress { compression: "planes", reason: e.to_string() })?;
        let (method, stored): (u8, &[u8]) =
            if packed.len() < plane.len() { (METHOD_ZSTD, &packed) } else { (METHOD_RAW, plane) };
        let len = u32::try_from(stored.len())
            .map_err(|_| EncodeError::Compress { compression: "planes", reason: "a plane above 4 GiB".into() })?;
        out[2 + 5 * b] = method;
        out[3 + 5 * b..7 + 5 * b].copy_from_slice(&len.to_le_bytes());
        out.extend_from_slice(stored);
    }
    // With no whole element every plane is empty (chunks() yields none).
    if n == 0 {
        for b in 0..elem {
            out[2 + 5 * b] = METHOD_RAW;
        }
    }
    out.extend_from_slice(&input[body..]);
    Ok(out)
}

/// Decodes a planes payload into exactly `out.len()` bytes (the chunk's
/// declared `raw_len`) of `elem`-byte elements. `scratch` is reused between
/// calls and grows to at most `out.len()`.
#[cfg(feature = "zstd")]
pub(crate) fn decode(
    input: &[u8],
    elem: usize,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
    zstd: &mut zstd::bulk::Decompressor<'static>,
) -> Result<(), DecodeError> {
    if !supports(elem) {
        return Err(err(format!("element size {elem} in the chunk header (expected 1, 2, 4 or 8)")));
    }
    let head = input.get(..header_len(elem)).ok_or_else(|| {
        err(format!("payload of {} bytes is shorter than the {}-byte plane table", input.len(), header_len(elem)))
    })?;
    if head[0] != VERSION {
        return Err(err(format!("format version {} (this build reads {VERSION})", head[0])));
    }
    if usize::from(head[1]) != elem {
        return Err(err(format!("payload says element size {} but the chunk header says {elem}", head[1])));
    }
    let n = out.len() / elem;
    let tail = out.len() - n * elem;
    let mut planes = Vec::with_capacity(elem);
    let mut stored_total = 0u64;
    for b in 0..elem {
        let method = head[2 + 5 * b];
        let len = u32::from_le_bytes(head[3 + 5 * b..7 + 5 * b].try_into().expect("4 bytes")) as usize;
        match method {
            METHOD_RAW if len != n => {
                return Err(err(format!("raw plane {b} stores {len} bytes, expected {n}")));
            }
            METHOD_RAW | METHOD_ZSTD => {}
            m => return Err(err(format!("plane {b} has unknown method {m} (0 = raw, 1 = zstd)"))),
        }
        stored_total += len as u64;
        planes.push((method, len));
    }
    let expected = header_len(elem) as u64 + stored_total + tail as u64;
    if expected != input.len() as u64 {
        return Err(err(format!(
            "plane table declares {expected} bytes (with a {tail}-byte tail) but the payload has {}",
            input.len()
        )));
    }
    crate::scratch::grow(scratch, n * elem)?;
    let mut at = header_len(elem);
    for (b, (method, len)) in planes.into_iter().enumerate() {
        let src = &input[at..at + len];
        let dst = &mut scratch[b * n..(b + 1) * n];
        if method == METHOD_RAW {
            dst.copy_from_slice(src);
        } else {
            let got = zstd
                .decompress_to_buffer(src, dst)
                .map_err(|e| err(format!("plane {b}: {e} (the plane must decode to {n} bytes)")))?;
            if got != n {
                return Err(err(format!("plane {b} decoded to {got} bytes, expected {n}")));
            }
        }
        at += len;
    }
    unshuffle_rotate(scratch, elem, &mut out[..n * elem]);
    out[n * elem..].copy_from_slice(&input[at..]);
    Ok(())
}

#[cfg(all(test, feature = "zstd"))]
mod tests {
    use crate::error::DecodeError;
    use crate::planes::{PLANE_ZSTD_LEVEL, decode, encode};

    /// The encoder and decoder with their own zstd contexts (the
    /// `Compressor`/`Decompressor` route is tested in `compress`).
    struct Codec {
        c: zstd::bulk::Compressor<'static>,
        d: zstd::bulk::Decompressor<'static>,
        scratch: Vec<u8>,
    }

    impl Codec {
        fn new() -> Self {
            Self {
                c: zstd::bulk::Compressor::new(PLANE_ZSTD_LEVEL).unwrap(),
                d: zstd::bulk::Decompressor::new().unwrap(),
                scratch: vec![],
            }
        }
        fn encode(&mut self, input: &[u8], elem: u32) -> Vec<u8> {
            encode(input, elem as usize, &mut self.scratch, &mut self.c).unwrap()
        }
        fn decode(&mut self, input: &[u8], elem: u32, out: &mut [u8]) -> Result<(), DecodeError> {
            decode(input, elem as usize, out, &mut self.scratch, &mut self.d)
        }
    }

    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    /// Gaussian-ish values (sum of uniforms) scaled like trained weights.
    fn weights(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rng(seed);
        (0..n)
            .map(|_| {
                let s: f64 = (0..4).map(|_| (r() >> 11) as f64 / (1u64 << 53) as f64).sum::<f64>() - 2.0;
                (s * 0.04) as f32
            })
            .collect()
    }

    fn specials_f32() -> Vec<f32> {
        vec![
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7fa0_0001), // signalling NaN with a payload
            f32::MIN_POSITIVE,
            f32::from_bits(1), // smallest denormal
            -f32::from_bits(0x007f_ffff),
            f32::MAX,
            f32::MIN,
        ]
    }

    fn round_trip(bytes: &[u8], elem: u32) -> usize {
        let mut c = Codec::new();
        let packed = c.encode(bytes, elem);
        let mut out = vec![0u8; bytes.len()];
        c.decode(&packed, elem, &mut out).unwrap();
        assert_eq!(out, bytes, "elem {elem}");
        packed.len()
    }

    #[test]
    fn every_float_dtype_round_trips_bit_exact_with_specials() {
        let w = weights(5000, 7);
        let mut f32s = w.clone();
        f32s.extend(specials_f32());
        let f32b: Vec<u8> = f32s.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f64b: Vec<u8> = f32s
            .iter()
            .map(|&v| v as f64)
            .chain([f64::from_bits(1), f64::from_bits(0x7ff0_0000_dead_beef), -0.0])
            .flat_map(|v| v.to_le_bytes())
            .collect();
        // bf16 = top half of f32; f16 via bit patterns covering every class
        // (0x7c00 inf, 0x7e01 NaN, 0x0001 denormal, 0x8000 -0).
        let bf16b: Vec<u8> = f32s.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        let f16b: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 20) as u16 & 0x3bff)
            .chain([0x7c00, 0xfc00, 0x7e01, 0x0001, 0x8000, 0x8001, 0x03ff])
            .flat_map(u16::to_le_bytes)
            .collect();
        for (bytes, elem) in [(&bf16b, 2), (&f16b, 2), (&f32b, 4), (&f64b, 8)] {
            round_trip(bytes, elem);
            // Tails shorter than an element and tiny inputs too.
            for cut in [0usize, 1, 3, 7, 9] {
                round_trip(&bytes[..bytes.len().saturating_sub(cut)], elem);
                round_trip(&bytes[..cut.min(bytes.len())], elem);
            }
        }
    }

    #[test]
    fn planes_beat_plain_zstd_on_weights() {
        let w = weights(1 << 18, 3);
        let f32b: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bf16b: Vec<u8> = w.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        for (bytes, elem) in [(&f32b, 4u32), (&bf16b, 2)] {
            let planes = round_trip(bytes, elem);
            let zstd = zstd::bulk::compress(bytes, 3).unwrap().len().min(bytes.len());
            assert!(planes < zstd, "elem {elem}: planes {planes} vs zstd {zstd}");
        }
    }

    #[test]
    fn malformed_payloads_are_clear_errors() {
        let w = weights(4096, 5);
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut d = Codec::new();
        let packed = d.encode(&bytes, 4);
        let mut out = vec![0u8; bytes.len()];
        let e = |d: &mut Codec, p: &[u8], elem: u32, out: &mut [u8]| d.decode(p, elem, out).unwrap_err().to_string();
        // Every truncation.
        for cut in [0, 1, 5, 21, packed.len() / 2, packed.len() - 1] {
            let msg = e(&mut d, &packed[..cut], 4, &mut out);
            assert!(msg.contains("planes"), "{msg}");
        }
        // A plane that lies about its size: the raw low mantissa plane, and
        // the zstd-coded exponent plane (the sum no longer matches).
        let mut lie = packed.clone();
        lie[3] = lie[3].wrapping_add(1);
        assert!(e(&mut d, &lie, 4, &mut out).contains("raw plane 0 stores"));
        assert_eq!(packed[17], 1, "the exponent plane is zstd-coded");
        let mut lie = packed.clone();
        lie[18] = lie[18].wrapping_add(1);
        assert!(e(&mut d, &lie, 4, &mut out).contains("plane table declares"));
        // Two lengths that still add up but split wrong: a zstd plane decodes to the wrong size.
        let mut swap = packed.clone();
        let l2 = u32::from_le_bytes(swap[13..17].try_into().unwrap());
        swap[13..17].copy_from_slice(&(l2 + 1).to_le_bytes());
        let l3 = u32::from_le_bytes(swap[18..22].try_into().unwrap());
        swap[18..22].copy_from_slice(&(l3 - 1).to_le_bytes());
        let msg = e(&mut d, &swap, 4, &mut out);
        assert!(msg.contains("plane 2") || msg.contains("plane 3"), "{msg}");
        // Version, element size, method.
        let mut v = packed.clone();
        v[0] = 9;
        assert!(e(&mut d, &v, 4, &mut out).contains("version 9"));
        assert!(e(&mut d, &packed, 2, &mut out).contains("element size"));
        assert!(e(&mut d, &packed, 3, &mut out).contains("element size 3"));
        let mut m = packed.clone();
        m[2] = 7;
        assert!(e(&mut d, &m, 4, &mut out).contains("unknown method 7"));
        // A declared size that differs from what the planes hold.
        let mut small = vec![0u8; bytes.len() - 4];
        assert!(e(&mut d, &packed, 4, &mut small).contains("planes"));
    }
}
