//! Delta tensors: a new version of a tensor sent as its XOR against a base
//! the receiver already holds (sans-IO; the store and client use it).
//!
//! Consecutive checkpoints differ in few bits: most elements are equal (XOR
//! zero) and changed floats keep sign, exponent and the top mantissa bits
//! (XOR zero in the high bytes), so the XOR compresses far better than the
//! tensor itself with any compressor of [`crate::compress`].
//!
//! ## The delta header
//!
//! A delta is a tensor of the new version's dtype and shape whose elements
//! are `new XOR base`, carrying in its metadata (which travels in
//! `TensorInfo.metadata` on the wire):
//!
//! | key | value |
//! |---|---|
//! | [`KEY_VERSION`] `tensorwire.delta` | `1` |
//! | [`KEY_BASE`] `tensorwire.delta.base` | SHA-256 [`ContentHash`] of the base, 64 hex digits |
//! | [`KEY_CRC`] `tensorwire.delta.crc32c` | CRC-32C of the new version's bytes, 8 hex digits |
//!
//! [`apply`] checks the version, that the base it is given has exactly that
//! hash (else an error naming both hashes), dtype and shape, XORs, and
//! checks the result's CRC-32C: the outcome is bit-exact or an error, never
//! a silently wrong tensor.

use std::fmt;
use std::str::FromStr;

use crate::tensor::{AlignedBuf, Tensor, TensorError};

/// Metadata key marking a delta; its value is the header version.
pub const KEY_VERSION: &str = "tensorwire.delta";
/// Metadata key of the base's content hash.
pub const KEY_BASE: &str = "tensorwire.delta.base";
/// Metadata key of the result's CRC-32C.
pub const KEY_CRC: &str = "tensorwire.delta.crc32c";
/// The header version this build writes and reads.
pub const VERSION: &str = "1";

/// SHA-256 of a tensor's dtype, shape and element bytes in row-major order
/// (layout-independent: a transposed copy and its contiguous version hash
/// alike; names and metadata do not count).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    /// The hash of `t`'s content.
    pub fn of(t: &Tensor) -> Result<Self, TensorError> {
        let bytes = t.to_contiguous_bytes()?;
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(t.dtype().name().as_bytes());
        for d in t.shape() {
            ctx.update(&(*d as u64).to_le_bytes());
        }
        ctx.update(&bytes);
        let mut h = [0u8; 32];
        h.copy_from_slice(ctx.finish().as_ref());
        Ok(Self(h))
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({self})")
    }
}

impl FromStr for ContentHash {
    type Err = DeltaError;
    fn from_str(s: &str) -> Result<Self, DeltaError> {
        let bad = || DeltaError::Header(format!("base hash {s:?} is not 64 hex digits"));
        if s.len() != 64 || !s.is_ascii() {
            return Err(bad());
        }
        let mut h = [0u8; 32];
        for (i, b) in h.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(Self(h))
    }
}

/// Why a delta could not be made or applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeltaError {
    /// The delta header in the metadata is missing a key or malformed.
    #[error("delta header: {0}")]
    Header(String),
    /// The receiver's base is not the one the delta was made against.
    #[error("delta made against base {expected} but the base held has hash {held}")]
    WrongBase {
        /// The base hash the delta names.
        expected: ContentHash,
        /// The hash of the base the receiver holds.
        held: ContentHash,
    },
    /// No base is held for the tensor.
    #[error("delta needs base {expected} for {name:?}, and none is held")]
    MissingBase {
        /// The tensor's name.
        name: String,
        /// The base hash the delta names.
        expected: ContentHash,
    },
    /// Dtype or shape of delta and base differ.
    #[error("delta is {delta} but base {base} is {held}")]
    Mismatch {
        /// Dtype and shape of the delta.
        delta: String,
        /// The base hash.
        base: ContentHash,
        /// Dtype and shape of the base.
        held: String,
    },
    /// The result's CRC-32C differs from the one the sender computed.
    #[error("delta against base {base}: result CRC-32C {got:08x}, the sender's is {want:08x}")]
    Checksum {
        /// The base hash.
        base: ContentHash,
        /// CRC-32C of the reconstructed tensor.
        got: u32,
        /// CRC-32C the sender stated.
        want: u32,
    },
    /// The tensors could not be read (not on the host).
    #[error("delta: {0}")]
    Tensor(String),
}

impl From<TensorError> for DeltaError {
    fn from(e: TensorError) -> Self {
        DeltaError::Tensor(e.to_string())
    }
}

/// The parsed header of a delta tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaHeader {
    /// Content hash of the base it was made against.
    pub base: ContentHash,
    /// CRC-32C of the new version's bytes.
    pub crc32c: u32,
}

impl DeltaHeader {
    /// The header of `t`: None when `t` is not a delta, an error when its
    /// header is malformed or of another version.
    pub fn of(t: &Tensor) -> Result<Option<Self>, DeltaError> {
        let m = t.metadata();
        let Some(v) = m.get(KEY_VERSION) else { return Ok(None) };
        if v != VERSION {
            return Err(DeltaError::Header(format!("version {v:?} (this build reads {VERSION})")));
        }
        let base = m.get(KEY_BASE).ok_or_else(|| DeltaError::Header(format!("no {KEY_BASE}")))?.parse()?;
        let crc = m.get(KEY_CRC).ok_or_else(|| DeltaError::Header(format!("no {KEY_CRC}")))?;
        let crc32c = (crc.len() == 8)
            .then(|| u32::from_str_radix(crc, 16).ok())
            .flatten()
            .ok_or_else(|| DeltaError::Header(format!("{KEY_CRC} {crc:?} is not 8 hex digits")))?;
        Ok(Some(Self { base, crc32c }))
    }
}

fn describe(t: &Tensor) -> String {
    format!("{} {:?}", t.dtype(), t.shape())
}

fn xor_into(a: &[u8], b: &[u8], out: &mut [u8]) {
    // Word-wide where aligned lengths allow; the compiler vectorises this.
    for ((o, x), y) in out.chunks_exact_mut(8).zip(a.chunks_exact(8)).zip(b.chunks_exact(8)) {
        let v = u64::from_ne_bytes(x.try_into().expect("8")) ^ u64::from_ne_bytes(y.try_into().expect("8"));
        o.copy_from_slice(&v.to_ne_bytes());
    }
    let done = out.len() / 8 * 8;
    for ((o, x), y) in out[done..].iter_mut().zip(&a[done..]).zip(&b[done..]) {
        *o = x ^ y;
    }
}

fn xor_tensor(a: &Tensor, b: &Tensor) -> Result<Tensor, DeltaError> {
    let (x, y) = (a.to_contiguous_bytes()?, b.to_contiguous_bytes()?);
    let mut out = AlignedBuf::try_zeroed(x.len())
        .ok_or_else(|| DeltaError::Tensor(format!("cannot allocate {} bytes", x.len())))?;
    xor_into(&x, &y, out.as_mut_slice());
    Ok(Tensor::with_shape(a.dtype(), a.shape(), out.freeze())?)
}

/// The delta of `new` against `base` (same dtype and shape), keeping
/// `new`'s name and metadata plus the delta header.
pub fn encode(new: &Tensor, base: &Tensor) -> Result<Tensor, DeltaError> {
    let base_hash = ContentHash::of(base)?;
    if new.dtype() != base.dtype() || new.shape() != base.shape() {
        return Err(DeltaError::Mismatch { delta: describe(new), base: base_hash, held: describe(base) });
    }
    let mut d = xor_tensor(new, base)?;
    if let Some(n) = new.name() {
        d.set_name(n);
    }
    let m = d.metadata_mut();
    m.extend(new.metadata().iter().map(|(k, v)| (k.clone(), v.clone())));
    m.insert(KEY_VERSION.into(), VERSION.into());
    m.insert(KEY_BASE.into(), base_hash.to_string());
    m.insert(KEY_CRC.into(), format!("{:08x}", new.crc32c()?));
    Ok(d)
}

/// Reconstructs the new version from `delta` and the `base` the receiver
/// holds: checks the header, the base's hash, dtype and shape, and the
/// result's CRC-32C. The result keeps the delta's name and its metadata
/// minus the delta header.
pub fn apply(delta: &Tensor, base: &Tensor) -> Result<Tensor, DeltaError> {
    let h = DeltaHeader::of(delta)?.ok_or_else(|| DeltaError::Header(format!("no {KEY_VERSION} key")))?;
    let held = ContentHash::of(base)?;
    if held != h.base {
        return Err(DeltaError::WrongBase { expected: h.base, held });
    }
    if delta.dtype() != base.dtype() || delta.shape() != base.shape() {
        return Err(DeltaError::Mismatch { delta: describe(delta), base: h.base, held: describe(base) });
    }
    let mut out = xor_tensor(delta, base)?;
    let got = out.crc32c()?;
    if got != h.crc32c {
        return Err(DeltaError::Checksum { base: h.base, got, want: h.crc32c });
    }
    if let Some(n) = delta.name() {
        out.set_name(n);
    }
    let m = out.metadata_mut();
    let header = [KEY_VERSION, KEY_BASE, KEY_CRC];
    m.extend(
        delta.metadata().iter().filter(|(k, _)| !header.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.clone())),
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn weights(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) as f32 / u32::MAX as f32 - 0.5) * 0.1).collect()
    }

    #[test]
    fn round_trip_bit_exact_and_mostly_zero() {
        let old = weights(10_000, 1);
        let mut new = old.clone();
        for v in new.iter_mut().step_by(50) {
            *v += 1e-4;
        }
        new[7] = f32::NAN;
        let (a, b) = (
            Tensor::from_vec([100, 100], new).unwrap().with_name("w").with_metadata("step", "200"),
            Tensor::from_vec([100, 100], old).unwrap(),
        );
        let d = encode(&a, &b).unwrap();
        let zeros = d.as_bytes().unwrap().iter().filter(|&&x| x == 0).count();
        assert!(zeros > d.nbytes() * 9 / 10, "{zeros} of {}", d.nbytes());
        assert_eq!(DeltaHeader::of(&d).unwrap().unwrap().base, ContentHash::of(&b).unwrap());
        let back = apply(&d, &b).unwrap();
        assert!(back.data_eq(&a));
        assert_eq!(back.name(), Some("w"));
        assert_eq!(back.metadata().get("step").map(String::as_str), Some("200"));
        assert!(!back.metadata().contains_key(KEY_BASE));
        // A transposed (non-contiguous) base hashes and XORs in logical order.
        let bt = b.transpose(0, 1).unwrap();
        let ct = bt.contiguous().unwrap();
        assert_eq!(ContentHash::of(&bt).unwrap(), ContentHash::of(&ct).unwrap());
    }

    #[test]
    fn wrong_base_and_bad_headers_are_clear_errors() {
        let a = Tensor::from_vec([4], vec![1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let b = Tensor::from_vec([4], vec![1.0f32, 2.0, 3.0, 5.0]).unwrap();
        let c = Tensor::from_vec([4], vec![0.0f32; 4]).unwrap();
        let d = encode(&a, &b).unwrap();
        let hb = ContentHash::of(&b).unwrap().to_string();
        let e = apply(&d, &c).unwrap_err();
        assert!(matches!(e, DeltaError::WrongBase { .. }));
        assert!(e.to_string().contains(&hb), "{e}");
        // Shape mismatch against a base with the right hash cannot happen
        // (shape is hashed), so a different shape is a wrong base.
        let s = Tensor::from_vec([2, 2], vec![1.0f32, 2.0, 3.0, 5.0]).unwrap();
        assert!(matches!(apply(&d, &s).unwrap_err(), DeltaError::WrongBase { .. }));
        assert!(matches!(encode(&a, &s).unwrap_err(), DeltaError::Mismatch { .. }));
        for (k, v, want) in [
            (KEY_VERSION, "2", "version \"2\""),
            (KEY_BASE, "zz", "not 64 hex"),
            (KEY_CRC, "123", "not 8 hex"),
            (KEY_CRC, "0000000g", "not 8 hex"),
        ] {
            let bad = d.clone().with_metadata(k, v);
            let msg = apply(&bad, &b).unwrap_err().to_string();
            assert!(msg.contains(want), "{msg}");
        }
        // A flipped payload bit is caught by the CRC.
        let mut bytes = d.as_bytes().unwrap().to_vec();
        bytes[0] ^= 1;
        let mut flipped = Tensor::new(DType::Float32, [4], bytes).unwrap();
        *flipped.metadata_mut() = d.metadata().clone();
        assert!(matches!(apply(&flipped, &b).unwrap_err(), DeltaError::Checksum { .. }));
        assert!(apply(&a, &b).unwrap_err().to_string().contains("no tensorwire.delta"));
    }
}
