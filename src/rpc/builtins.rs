//! Built-in functions and tensor helpers: `identity`, `scale`, `sum`,
//! `add`, and random tensors for the CLI and benchmarks.

use rand::{Rng, RngCore, SeedableRng};
use tensorwire_codecs::{AlignedBuf, DType, Tensor};

use crate::error::Status;
use crate::rpc::call::Output;
use crate::rpc::function::Function;
use crate::rpc::value::Value;

/// The built-in functions every `tensorwire serve` offers:
///
/// * `identity`: returns its inputs (runs inline: it only moves references).
/// * `scale`: multiplies every input by the argument `factor` (default 1).
/// * `sum`: one input → the sum of its elements (a 0-d tensor, float64 for
///   floats and int64 for integers); several inputs → their elementwise sum.
/// * `add`: two numbers, the arguments `a` and `b` (by name, or by position
///   over JSON-RPC) → `a + b` (an int for two ints): the function-sharing
///   seed's `add_numbers`.
pub fn builtin_functions() -> Vec<Function> {
    vec![
        Function::inline("identity", |c| Ok(Output::tensors(c.inputs))).doc("returns its inputs unchanged"),
        Function::new("scale", |c| {
            let factor = c.args.f64_or("factor", 1.0)?;
            let out = c.inputs.iter().map(|t| map_f64(t, |x| x * factor)).collect::<Result<Vec<_>, _>>()?;
            Ok(out.into())
        })
        .arg_names(["factor"])
        .doc("multiplies each input by the argument `factor`"),
        Function::new("sum", |c| match c.inputs.len() {
            0 => Err(Status::invalid_argument("sum needs at least one tensor")),
            1 => Ok(reduce_sum(&c.inputs[0])?.into()),
            _ => Ok(elementwise_sum(&c.inputs)?.into()),
        })
        .doc("one input: sum of its elements; several: elementwise sum"),
        Function::inline("add", |c| {
            let arg = |n: &str| {
                c.args.get(n).cloned().ok_or_else(|| Status::invalid_argument(format!("add needs the argument {n:?}")))
            };
            match (arg("a")?, arg("b")?) {
                (Value::Int(a), Value::Int(b)) => a
                    .checked_add(b)
                    .map(Output::value)
                    .ok_or_else(|| Status::invalid_argument(format!("{a} + {b} overflows 64 bits"))),
                (a, b) => match (a.as_f64(), b.as_f64()) {
                    (Some(a), Some(b)) => Ok(Output::value(a + b)),
                    _ => Err(Status::invalid_argument(format!(
                        "add takes two numbers, got {} and {}",
                        a.type_name(),
                        b.type_name()
                    ))),
                },
            }
        })
        .arg_names(["a", "b"])
        .doc("a + b for two numbers (the arguments a and b)"),
    ]
}

fn to_f64s(t: &Tensor) -> Result<Vec<f64>, Status> {
    use half::{bf16, f16};
    Ok(match t.dtype() {
        DType::Float32 => t.to_vec::<f32>()?.into_iter().map(f64::from).collect(),
        DType::Float64 => t.to_vec::<f64>()?,
        DType::Float16 => t.to_vec::<f16>()?.into_iter().map(f64::from).collect(),
        DType::BFloat16 => t.to_vec::<bf16>()?.into_iter().map(f64::from).collect(),
        DType::Int8 => t.to_vec::<i8>()?.into_iter().map(f64::from).collect(),
        DType::Int16 => t.to_vec::<i16>()?.into_iter().map(f64::from).collect(),
        DType::Int32 => t.to_vec::<i32>()?.into_iter().map(f64::from).collect(),
        DType::Int64 => t.to_vec::<i64>()?.into_iter().map(|x| x as f64).collect(),
        DType::UInt8 => t.to_vec::<u8>()?.into_iter().map(f64::from).collect(),
        DType::UInt16 => t.to_vec::<u16>()?.into_iter().map(f64::from).collect(),
        DType::UInt32 => t.to_vec::<u32>()?.into_iter().map(f64::from).collect(),
        DType::UInt64 => t.to_vec::<u64>()?.into_iter().map(|x| x as f64).collect(),
        DType::Bool => t.to_bools()?.into_iter().map(|b| f64::from(u8::from(b))).collect(),
        other => return Err(Status::invalid_argument(format!("arithmetic on {other} is not supported"))),
    })
}

fn from_f64s(dtype: DType, shape: &[usize], v: Vec<f64>) -> Result<Tensor, Status> {
    use half::{bf16, f16};
    let shape = shape.to_vec();
    Ok(match dtype {
        DType::Float32 => Tensor::from_vec(shape, v.into_iter().map(|x| x as f32).collect::<Vec<_>>())?,
        DType::Float64 => Tensor::from_vec(shape, v)?,
        DType::Float16 => Tensor::from_vec(shape, v.into_iter().map(f16::from_f64).collect::<Vec<_>>())?,
        DType::BFloat16 => Tensor::from_vec(shape, v.into_iter().map(bf16::from_f64).collect::<Vec<_>>())?,
        DType::Int8 => Tensor::from_vec(shape, v.into_iter().map(|x| x as i8).collect::<Vec<_>>())?,
        DType::Int16 => Tensor::from_vec(shape, v.into_iter().map(|x| x as i16).collect::<Vec<_>>())?,
        DType::Int32 => Tensor::from_vec(shape, v.into_iter().map(|x| x as i32).collect::<Vec<_>>())?,
        DType::Int64 => Tensor::from_vec(shape, v.into_iter().map(|x| x as i64).collect::<Vec<_>>())?,
        DType::UInt8 => Tensor::from_vec(shape, v.into_iter().map(|x| x as u8).collect::<Vec<_>>())?,
        DType::UInt16 => Tensor::from_vec(shape, v.into_iter().map(|x| x as u16).collect::<Vec<_>>())?,
        DType::UInt32 => Tensor::from_vec(shape, v.into_iter().map(|x| x as u32).collect::<Vec<_>>())?,
        DType::UInt64 => Tensor::from_vec(shape, v.into_iter().map(|x| x as u64).collect::<Vec<_>>())?,
        DType::Bool => Tensor::from_bools(shape, &v.into_iter().map(|x| x != 0.0).collect::<Vec<_>>())?,
        other => return Err(Status::invalid_argument(format!("arithmetic on {other} is not supported"))),
    })
}

/// Applies `f` to every element (computed in f64, stored in the input's dtype).
pub fn map_f64(t: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor, Status> {
    let v = to_f64s(t)?.into_iter().map(f).collect();
    let mut out = from_f64s(t.dtype(), t.shape(), v)?;
    if let Some(n) = t.name() {
        out.set_name(n);
    }
    Ok(out)
}

fn reduce_sum(t: &Tensor) -> Result<Tensor, Status> {
    let s: f64 = to_f64s(t)?.into_iter().sum();
    if t.dtype().is_float() {
        Ok(Tensor::from_vec(Vec::<usize>::new(), vec![s])?)
    } else {
        Ok(Tensor::from_vec(Vec::<usize>::new(), vec![s as i64])?)
    }
}

fn elementwise_sum(ts: &[Tensor]) -> Result<Tensor, Status> {
    let first = &ts[0];
    let mut acc = to_f64s(first)?;
    for (i, t) in ts.iter().enumerate().skip(1) {
        if t.shape() != first.shape() || t.dtype() != first.dtype() {
            return Err(Status::invalid_argument(format!(
                "sum: input {i} is {} {:?}, input 0 is {} {:?}",
                t.dtype(),
                t.shape(),
                first.dtype(),
                first.shape()
            )));
        }
        for (a, b) in acc.iter_mut().zip(to_f64s(t)?) {
            *a += b;
        }
    }
    from_f64s(first.dtype(), first.shape(), acc)
}

/// A tensor of random values: floats uniform in [-1, 1), integers uniform
/// over their range, bools 0/1. Fast enough for gigabyte benchmarks.
pub fn random_tensor(dtype: DType, shape: &[usize], seed: u64) -> Result<Tensor, Status> {
    let n = tensorwire_codecs::tensor::byte_size(dtype, shape)?;
    let mut buf = AlignedBuf::try_zeroed(n).ok_or_else(|| {
        Status::resource_exhausted(format!("cannot allocate {n} bytes for a random {dtype} tensor of shape {shape:?}"))
    })?;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let b = buf.as_mut_slice();
    match dtype {
        DType::Float32 => {
            for c in b.chunks_exact_mut(4) {
                c.copy_from_slice(&(rng.random::<f32>() * 2.0 - 1.0).to_le_bytes());
            }
        }
        DType::Float64 => {
            for c in b.chunks_exact_mut(8) {
                c.copy_from_slice(&(rng.random::<f64>() * 2.0 - 1.0).to_le_bytes());
            }
        }
        DType::Float16 => {
            for c in b.chunks_exact_mut(2) {
                c.copy_from_slice(&half::f16::from_f32(rng.random::<f32>() * 2.0 - 1.0).to_le_bytes());
            }
        }
        DType::BFloat16 => {
            for c in b.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.random::<f32>() * 2.0 - 1.0).to_le_bytes());
            }
        }
        DType::Complex64 | DType::Complex128 | DType::Float8E4M3Fn | DType::Float8E5M2 => {
            // Random finite values: small integers' bit patterns would be
            // denormal-heavy; use uniform floats per component instead.
            match dtype {
                DType::Complex64 => {
                    for c in b.chunks_exact_mut(4) {
                        c.copy_from_slice(&(rng.random::<f32>() * 2.0 - 1.0).to_le_bytes());
                    }
                }
                DType::Complex128 => {
                    for c in b.chunks_exact_mut(8) {
                        c.copy_from_slice(&(rng.random::<f64>() * 2.0 - 1.0).to_le_bytes());
                    }
                }
                DType::Float8E4M3Fn => {
                    for x in b.iter_mut() {
                        *x = tensorwire_codecs::F8E4M3::from_f32(rng.random::<f32>() * 2.0 - 1.0).0;
                    }
                }
                _ => {
                    for x in b.iter_mut() {
                        *x = tensorwire_codecs::F8E5M2::from_f32(rng.random::<f32>() * 2.0 - 1.0).0;
                    }
                }
            }
        }
        DType::Bool => {
            rng.fill_bytes(b);
            for x in b.iter_mut() {
                *x &= 1;
            }
        }
        _ => rng.fill_bytes(b),
    }
    Ok(Tensor::with_shape(dtype, shape, buf.freeze())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::call::Call;
    use crate::rpc::call::CallContext;
    use crate::rpc::value::{Args, Value};
    use std::collections::BTreeMap;

    fn run(name: &str, inputs: Vec<Tensor>, args: Args) -> Result<Output, Status> {
        let f = builtin_functions().into_iter().find(|f| f.name() == name).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(f.run(Call { inputs, args, ctx: CallContext::local() }))
    }

    #[test]
    fn scale_and_sum() {
        let x = Tensor::from_vec([3], vec![1.0f32, 2.0, 3.0]).unwrap();
        let y = run("scale", vec![x.clone()], Args::new().with("factor", 2.5)).unwrap();
        assert_eq!(y.tensors[0].as_slice::<f32>().unwrap(), &[2.5, 5.0, 7.5]);
        let s = run("sum", vec![x.clone()], Args::new()).unwrap();
        assert_eq!(s.tensors[0].as_slice::<f64>().unwrap(), &[6.0]);
        let s2 = run("sum", vec![x.clone(), x.clone()], Args::new()).unwrap();
        assert_eq!(s2.tensors[0].as_slice::<f32>().unwrap(), &[2.0, 4.0, 6.0]);
        let i = Tensor::from_vec([2], vec![3i64, 4]).unwrap();
        assert_eq!(
            run("scale", vec![i], Args::new().with("factor", 3)).unwrap().tensors[0].as_slice::<i64>().unwrap(),
            &[9, 12]
        );
        let e = run("scale", vec![x], Args::new().with("factor", "big")).unwrap_err();
        assert!(e.message.contains("must be a number"), "{e}");
        let add = |a: Value, b: Value| run("add", vec![], Args(BTreeMap::from([("a".into(), a), ("b".into(), b)])));
        assert_eq!(add(Value::Int(10), Value::Int(20)).unwrap().values, Value::Int(30));
        assert_eq!(add(Value::Int(1), Value::Float(0.5)).unwrap().values, Value::Float(1.5));
        assert!(add(Value::Int(i64::MAX), Value::Int(1)).is_err());
        assert!(add(Value::Str("x".into()), Value::Int(1)).unwrap_err().message.contains("two numbers"));
    }

    #[test]
    fn random_tensors_are_deterministic_per_seed() {
        let a = random_tensor(DType::Float32, &[1000], 7).unwrap();
        let b = random_tensor(DType::Float32, &[1000], 7).unwrap();
        assert!(a.data_eq(&b));
        assert!(a.as_slice::<f32>().unwrap().iter().all(|v| (-1.0..1.0).contains(v)));
        let c = random_tensor(DType::Bool, &[100], 1).unwrap();
        assert!(c.to_bools().is_ok());
    }
}
