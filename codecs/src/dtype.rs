//! Element types: [`DType`], the [`Element`] trait for typed views, and the
//! small value types torch has and Rust lacks ([`Complex`], [`F8E4M3`], [`F8E5M2`]).

use std::fmt;
use std::str::FromStr;

use bytemuck::{Pod, Zeroable};

/// Element type of a tensor: every dtype a PyTorch user meets.
///
/// Names follow torch (`float32`, `bfloat16`, `float8_e4m3fn`, ...). All
/// multi-byte types are little-endian on the wire and in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// `torch.bool`: one byte, 0 or 1.
    Bool,
    /// `torch.uint8`
    UInt8,
    /// `torch.int8`
    Int8,
    /// `torch.int16`
    Int16,
    /// `torch.int32`
    Int32,
    /// `torch.int64`
    Int64,
    /// `torch.uint16`
    UInt16,
    /// `torch.uint32`
    UInt32,
    /// `torch.uint64`
    UInt64,
    /// `torch.float16` (IEEE half)
    Float16,
    /// `torch.bfloat16`
    BFloat16,
    /// `torch.float32`
    Float32,
    /// `torch.float64`
    Float64,
    /// `torch.complex64`: two float32 (real, imaginary).
    Complex64,
    /// `torch.complex128`: two float64.
    Complex128,
    /// `torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, no infinities.
    Float8E4M3Fn,
    /// `torch.float8_e5m2`: 5 exponent bits, 2 mantissa bits.
    Float8E5M2,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 17] = [
        DType::Bool,
        DType::UInt8,
        DType::Int8,
        DType::Int16,
        DType::Int32,
        DType::Int64,
        DType::UInt16,
        DType::UInt32,
        DType::UInt64,
        DType::Float16,
        DType::BFloat16,
        DType::Float32,
        DType::Float64,
        DType::Complex64,
        DType::Complex128,
        DType::Float8E4M3Fn,
        DType::Float8E5M2,
    ];

    /// Bytes per element.
    pub const fn itemsize(self) -> usize {
        match self {
            DType::Bool | DType::UInt8 | DType::Int8 | DType::Float8E4M3Fn | DType::Float8E5M2 => 1,
            DType::Int16 | DType::UInt16 | DType::Float16 | DType::BFloat16 => 2,
            DType::Int32 | DType::UInt32 | DType::Float32 => 4,
            DType::Int64 | DType::UInt64 | DType::Float64 | DType::Complex64 => 8,
            DType::Complex128 => 16,
        }
    }

    /// Alignment an element needs in memory for a typed view.
    pub const fn align(self) -> usize {
        match self {
            DType::Complex64 => 4,
            DType::Complex128 => 8,
            other => other.itemsize(),
        }
    }

    /// The torch name without the `torch.` prefix (`"float32"`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::UInt8 => "uint8",
            DType::Int8 => "int8",
            DType::Int16 => "int16",
            DType::Int32 => "int32",
            DType::Int64 => "int64",
            DType::UInt16 => "uint16",
            DType::UInt32 => "uint32",
            DType::UInt64 => "uint64",
            DType::Float16 => "float16",
            DType::BFloat16 => "bfloat16",
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::Complex64 => "complex64",
            DType::Complex128 => "complex128",
            DType::Float8E4M3Fn => "float8_e4m3fn",
            DType::Float8E5M2 => "float8_e5m2",
        }
    }

    /// True for floating point and complex types (including float8).
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::Float16
                | DType::BFloat16
                | DType::Float32
                | DType::Float64
                | DType::Complex64
                | DType::Complex128
                | DType::Float8E4M3Fn
                | DType::Float8E5M2
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A string that names no dtype.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown dtype {0:?}: expected a torch name such as float32, bfloat16, int64, bool, complex64, float8_e4m3fn (short forms like f32, bf16, i64 work too)"
)]
pub struct UnknownDType(pub String);

impl FromStr for DType {
    type Err = UnknownDType;

    /// Parses torch names (`float32`, `torch.float32`), torch aliases
    /// (`float`, `half`, `double`, `long`, `int`, `short`, `cfloat`) and short
    /// forms (`f32`, `bf16`, `i64`, `u8`, `c64`, `f8e4m3`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let t = t.strip_prefix("torch.").unwrap_or(t).to_ascii_lowercase();
        let d = match t.as_str() {
            "bool" | "b1" => DType::Bool,
            "uint8" | "u8" | "byte" => DType::UInt8,
            "int8" | "i8" | "char" => DType::Int8,
            "int16" | "i16" | "short" => DType::Int16,
            "int32" | "i32" | "int" => DType::Int32,
            "int64" | "i64" | "long" => DType::Int64,
            "uint16" | "u16" => DType::UInt16,
            "uint32" | "u32" => DType::UInt32,
            "uint64" | "u64" => DType::UInt64,
            "float16" | "f16" | "half" | "fp16" => DType::Float16,
            "bfloat16" | "bf16" => DType::BFloat16,
            "float32" | "f32" | "float" | "fp32" => DType::Float32,
            "float64" | "f64" | "double" | "fp64" => DType::Float64,
            "complex64" | "c64" | "cfloat" => DType::Complex64,
            "complex128" | "c128" | "cdouble" => DType::Complex128,
            "float8_e4m3fn" | "f8e4m3" | "f8e4m3fn" | "f8_e4m3" | "fp8_e4m3" => DType::Float8E4M3Fn,
            "float8_e5m2" | "f8e5m2" | "f8_e5m2" | "fp8_e5m2" => DType::Float8E5M2,
            _ => return Err(UnknownDType(s.to_string())),
        };
        Ok(d)
    }
}

/// A Rust type that can view tensor elements of one [`DType`].
///
/// Implemented for the integer and float primitives, [`half::f16`],
/// [`half::bf16`], [`Complex<f32>`], [`Complex<f64>`], [`F8E4M3`] and
/// [`F8E5M2`]. `bool` is not `Pod` (only 0 and 1 are valid), so bool
/// tensors use [`crate::Tensor::from_bools`] and [`crate::Tensor::to_bools`].
pub trait Element: Pod + Send + Sync + 'static {
    /// The dtype this type views.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DType = DType::$d; })*
    };
}

element! {
    u8 => UInt8, i8 => Int8, i16 => Int16, i32 => Int32, i64 => Int64,
    u16 => UInt16, u32 => UInt32, u64 => UInt64,
    half::f16 => Float16, half::bf16 => BFloat16, f32 => Float32, f64 => Float64,
    Complex<f32> => Complex64, Complex<f64> => Complex128,
    F8E4M3 => Float8E4M3Fn, F8E5M2 => Float8E5M2,
}

/// A complex number laid out as torch stores it: real part, then imaginary.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct Complex<T> {
    /// Real part.
    pub re: T,
    /// Imaginary part.
    pub im: T,
}

impl<T> Complex<T> {
    /// `re + im·i`.
    pub const fn new(re: T, im: T) -> Self {
        Self { re, im }
    }
}

// SAFETY: `Complex<T>` is `repr(C)` of two `T` with no padding (both fields
// have the same size and alignment), so it is Pod whenever T is.
unsafe impl Zeroable for Complex<f32> {}
unsafe impl Pod for Complex<f32> {}
unsafe impl Zeroable for Complex<f64> {}
unsafe impl Pod for Complex<f64> {}

/// `float8_e4m3fn`: sign, 4 exponent bits (bias 7), 3 mantissa bits; no
/// infinities, `0x7f`/`0xff` are NaN, largest finite value 448.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// `float8_e5m2`: sign, 5 exponent bits (bias 15), 2 mantissa bits; the top
/// byte of an IEEE half, with infinities and NaN.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
#[repr(transparent)]
pub struct F8E5M2(pub u8);

impl F8E4M3 {
    /// Exact conversion to f32.
    pub fn to_f32(self) -> f32 {
        let b = self.0;
        let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let exp = (b >> 3) & 0x0f;
        let man = b & 0x07;
        if exp == 0x0f && man == 0x07 {
            return f32::NAN;
        }
        if exp == 0 {
            // Subnormal: man/8 · 2^-6.
            return sign * (man as f32) * 2f32.powi(-9);
        }
        sign * (1.0 + man as f32 / 8.0) * 2f32.powi(exp as i32 - 7)
    }

    /// Nearest value, ties to even; NaN and values past ±448 (after rounding)
    /// become NaN, as torch's conversion does.
    pub fn from_f32(x: f32) -> Self {
        if x.is_nan() {
            return F8E4M3(0x7f);
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        // Round to the nearest representable magnitude by scanning the 127
        // non-negative finite codes: exact, and fast enough for conversions.
        let code = nearest_code(a, 0x7e, |c| F8E4M3(c).to_f32());
        match code {
            Some(c) => F8E4M3(sign | c),
            None => F8E4M3(sign | 0x7f),
        }
    }
}

impl F8E5M2 {
    /// Exact conversion to f32.
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits(u16::from(self.0) << 8).to_f32()
    }

    /// Nearest value, ties to even; overflow gives ±inf.
    pub fn from_f32(x: f32) -> Self {
        if x.is_nan() {
            return F8E5M2(0x7f);
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = x.abs();
        match nearest_code(a, 0x7b, |c| F8E5M2(c).to_f32()) {
            Some(c) => F8E5M2(sign | c),
            None => F8E5M2(sign | 0x7c), // infinity
        }
    }
}

/// Nearest non-negative code in `0..=max_code` to `a` (ties to the even
/// code), or None when `a` lies past the largest finite value by more than
/// half an ulp.
fn nearest_code(a: f32, max_code: u8, value: impl Fn(u8) -> f32) -> Option<u8> {
    let max = value(max_code);
    if a >= max {
        let below = value(max_code - 1);
        let half_ulp = (max - below) / 2.0;
        return if a < max + half_ulp || (a == max + half_ulp && max_code.is_multiple_of(2)) {
            Some(max_code)
        } else {
            None
        };
    }
    // Values are increasing in the code; binary search the first code >= a.
    let (mut lo, mut hi) = (0u8, max_code);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if value(mid) < a {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        return Some(0);
    }
    let (up, down) = (value(lo), value(lo - 1));
    let (du, dd) = (up - a, a - down);
    Some(if du < dd || (du == dd && lo % 2 == 0) { lo } else { lo - 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names_and_aliases() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(format!("torch.{d}").parse::<DType>().unwrap(), d);
        }
        assert_eq!("f32".parse::<DType>().unwrap(), DType::Float32);
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::BFloat16);
        assert_eq!("long".parse::<DType>().unwrap(), DType::Int64);
        let e = "float33".parse::<DType>().unwrap_err();
        assert!(e.to_string().contains("float33"));
    }

    #[test]
    fn float8_round_trips_every_code() {
        for c in 0..=255u8 {
            let v = F8E4M3(c).to_f32();
            if v.is_nan() {
                assert!(F8E4M3::from_f32(v).to_f32().is_nan());
            } else {
                assert_eq!(F8E4M3::from_f32(v).to_f32(), v, "e4m3 code {c:#x}");
            }
            let w = F8E5M2(c).to_f32();
            if w.is_nan() {
                assert!(F8E5M2::from_f32(w).to_f32().is_nan());
            } else {
                assert_eq!(F8E5M2::from_f32(w).to_f32(), w, "e5m2 code {c:#x}");
            }
        }
        assert_eq!(F8E4M3(0x7e).to_f32(), 448.0);
        assert!(F8E4M3::from_f32(1000.0).to_f32().is_nan());
        assert_eq!(F8E5M2::from_f32(1e9).to_f32(), f32::INFINITY);
        // Ties to even: 1.0625 lies halfway between 1.0 (code 0x38) and 1.125 (0x39).
        assert_eq!(F8E4M3::from_f32(1.0625).0, 0x38);
    }
}
