//! JSON ⇄ tensors and scalar values, and a call's params ⇄ a function's
//! tensor inputs and [`Args`], sans-IO (the fuzz target drives it).
//!
//! A tensor is `{"dtype": "float32", "shape": [2, 3], "data": "<base64>"}`
//! (`data`: the elements' raw little-endian bytes in row-major order,
//! standard base64; `name` optional), or `{"safetensors": "<base64>"}` (a
//! whole safetensors file: each tensor in it, in file order). Every other
//! JSON value is a scalar: null, bools, integers (64-bit), floats,
//! strings, lists and objects.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Map, Value as Json, json};
use tensorwire_codecs::{AlignedBuf, DType, DecodeLimits, Tensor};

use super::protocol::{Params, RpcError};
use crate::rpc::call::Output;
use crate::rpc::value::{Args, Value};

/// What a function declares about its params (from its `FunctionInfo`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Signature {
    /// Names of its tensor inputs, in order, when declared.
    pub(crate) inputs: Option<Vec<String>>,
    /// Names of its scalar arguments, in positional order, when declared.
    pub(crate) args: Vec<String>,
}

fn invalid(m: impl Into<String>) -> RpcError {
    RpcError::invalid_params(m)
}

/// True when `o` is meant as a tensor (and must then be a valid one).
fn is_tensor(o: &Map<String, Json>) -> bool {
    (o.contains_key("dtype") && o.contains_key("data")) || (o.len() == 1 && o.contains_key("safetensors"))
}

fn b64(s: &Json, what: &str) -> Result<Vec<u8>, RpcError> {
    let s = s.as_str().ok_or_else(|| invalid(format!("{what} must be a base64 string")))?;
    STANDARD.decode(s).map_err(|e| invalid(format!("{what} is not valid base64: {e}")))
}

/// The tensors a tensor object stands for (one, or a safetensors file's).
pub(crate) fn tensors_from_json(o: &Map<String, Json>, limits: &DecodeLimits) -> Result<Vec<Tensor>, RpcError> {
    if let Some(st) = o.get("safetensors") {
        let file = b64(st, "\"safetensors\"")?;
        let loaded = tensorwire_codecs::safetensors::load(file.into(), limits)
            .map_err(|e| invalid(format!("\"safetensors\": {e}")))?;
        return Ok(loaded.tensors.into_iter().map(|(k, t)| t.with_name(k)).collect());
    }
    for k in o.keys() {
        if !matches!(k.as_str(), "dtype" | "shape" | "data" | "name") {
            return Err(invalid(format!("a tensor has dtype, shape, data and name; {k:?} is none of them")));
        }
    }
    let dtype: DType = o["dtype"]
        .as_str()
        .ok_or_else(|| invalid("a tensor's dtype must be a string such as \"float32\""))?
        .parse()
        .map_err(|e: tensorwire_codecs::dtype::UnknownDType| invalid(e.to_string()))?;
    let data = o["data"].as_str().ok_or_else(|| invalid("a tensor's data must be a base64 string"))?;
    // What the data holds, from its length (nothing is decoded before the
    // sizes check out: a shape above the limits, or data too short or too
    // long for the shape, is refused as it is).
    let pad = data.bytes().rev().take_while(|&b| b == b'=').count().min(2) as u64;
    let holds = (data.len() as u64 / 4 * 3).saturating_sub(pad) + [0, 0, 1, 2][data.len() % 4];
    let shape: Vec<usize> = match o.get("shape") {
        // Without a shape: one dimension, as many elements as the data holds.
        None => vec![usize::try_from(holds / dtype.itemsize() as u64).unwrap_or(usize::MAX)],
        Some(Json::Array(dims)) => dims
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid("a tensor's shape must be a list of sizes (non-negative integers)"))?,
        Some(_) => return Err(invalid("a tensor's shape must be a list of sizes")),
    };
    let need = tensorwire_codecs::limits::check_shape(dtype, &shape, limits)
        .map_err(|e| invalid(format!("tensor {shape:?} of {dtype}: {e}")))?;
    if holds != need {
        return Err(invalid(format!("shape {shape:?} of {dtype} needs {need} bytes, but data holds {holds}")));
    }
    let mut buf = AlignedBuf::zeroed(data.len().div_ceil(4) * 3);
    let n = STANDARD
        .decode_slice(data, buf.as_mut_slice())
        .map_err(|e| invalid(format!("data is not valid base64: {e}")))?;
    if n as u64 != need {
        return Err(invalid(format!("shape {shape:?} of {dtype} needs {need} bytes, but data holds {n}")));
    }
    let t = Tensor::new(dtype, shape, buf.freeze().slice(..n)).map_err(|e| invalid(e.to_string()))?;
    Ok(match o.get("name").and_then(Json::as_str) {
        Some(name) => vec![t.with_name(name)],
        None => vec![t],
    })
}

/// A tensor as JSON (raw bytes in logical order, base64).
pub(crate) fn tensor_to_json(t: &Tensor) -> Result<Json, RpcError> {
    let data = t.to_contiguous_bytes().map_err(|e| RpcError::from_status(&e.into()))?;
    let mut o = Map::new();
    o.insert("dtype".into(), json!(t.dtype().name()));
    o.insert("shape".into(), json!(t.shape()));
    o.insert("data".into(), json!(STANDARD.encode(&data)));
    if let Some(n) = t.name() {
        o.insert("name".into(), json!(n));
    }
    Ok(Json::Object(o))
}

/// A scalar from JSON; tensors are not scalars (nor inside them).
pub(crate) fn value_from_json(v: &Json) -> Result<Value, RpcError> {
    Ok(match v {
        Json::Null => Value::None,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => Value::Int(i),
            (None, Some(_)) if n.is_u64() => {
                return Err(invalid(format!("integer {n} does not fit in 64 signed bits")));
            }
            (None, Some(f)) => Value::Float(f),
            _ => return Err(invalid(format!("number {n} is not representable"))),
        },
        Json::String(s) => Value::Str(s.clone()),
        Json::Array(a) => Value::List(a.iter().map(value_from_json).collect::<Result<_, _>>()?),
        Json::Object(o) if is_tensor(o) => {
            return Err(invalid("tensors may be params themselves, not inside lists or objects"));
        }
        Json::Object(o) => {
            Value::Map(o.iter().map(|(k, v)| Ok((k.clone(), value_from_json(v)?))).collect::<Result<_, RpcError>>()?)
        }
    })
}

/// A scalar as JSON (bytes as `{"bytes": "<base64>"}`; NaN and infinities as null).
pub(crate) fn value_to_json(v: &Value) -> Json {
    match v {
        Value::None => Json::Null,
        Value::Bool(b) => json!(b),
        Value::Int(i) => json!(i),
        Value::Float(f) => serde_json::Number::from_f64(*f).map_or(Json::Null, Json::Number),
        Value::Str(s) => json!(s),
        Value::Bytes(b) => json!({ "bytes": STANDARD.encode(b) }),
        Value::List(l) => Json::Array(l.iter().map(value_to_json).collect()),
        Value::Map(m) => Json::Object(m.iter().map(|(k, v)| (k.clone(), value_to_json(v))).collect()),
    }
}

/// A function's result: its values when it returned no tensors, its
/// tensor when it returned one and no values, a list of tensors for
/// several; `{"tensors": [...], "values": ...}` when it returned both.
pub(crate) fn output_to_json(out: &Output) -> Result<Json, RpcError> {
    let tensors = out.tensors.iter().map(tensor_to_json).collect::<Result<Vec<_>, _>>()?;
    Ok(match (tensors.len(), &out.values) {
        (0, v) => value_to_json(v),
        (1, Value::None) => tensors.into_iter().next().unwrap_or_default(),
        (_, Value::None) => Json::Array(tensors),
        (_, v) => json!({ "tensors": tensors, "values": value_to_json(v) }),
    })
}

/// A call's params as the function's tensor inputs and scalar arguments.
///
/// Positional: tensors are the inputs in order; scalars are the arguments
/// named by the function's declared names in order (`"0"`, `"1"`, … when it
/// declared none). Named: tensor-valued entries are the inputs (in the
/// order of the declared input names, else as written), the rest arguments.
pub(crate) fn call_params(
    function: &str,
    params: &Params,
    sig: &Signature,
    limits: &DecodeLimits,
) -> Result<(Vec<Tensor>, Args), RpcError> {
    let mut inputs = Vec::new();
    let mut args = Args::new();
    match params {
        Params::None => {}
        Params::Positional(items) => {
            let mut scalars = 0;
            for v in items {
                if let Json::Object(o) = v
                    && is_tensor(o)
                {
                    inputs.extend(tensors_from_json(o, limits)?);
                    continue;
                }
                let name = match (sig.args.is_empty(), sig.args.get(scalars)) {
                    (true, _) => scalars.to_string(),
                    (false, Some(n)) => n.clone(),
                    (false, None) => {
                        return Err(invalid(format!(
                            "{function} takes {} argument(s) ({}), got more",
                            sig.args.len(),
                            sig.args.join(", ")
                        )));
                    }
                };
                args.0.insert(name, value_from_json(v)?);
                scalars += 1;
            }
        }
        Params::Named(map) => {
            let mut named: Vec<(&String, Vec<Tensor>)> = Vec::new();
            for (k, v) in map {
                match v {
                    Json::Object(o) if is_tensor(o) => named.push((k, tensors_from_json(o, limits)?)),
                    _ => {
                        args.0.insert(k.clone(), value_from_json(v)?);
                    }
                }
            }
            match &sig.inputs {
                None => {
                    for (k, ts) in named {
                        inputs.extend(
                            ts.into_iter().map(|t| if t.name().is_none() { t.with_name(k.clone()) } else { t }),
                        );
                    }
                }
                Some(order) => {
                    if let Some((k, _)) = named.iter().find(|(k, _)| !order.contains(k)) {
                        return Err(invalid(format!(
                            "{function} has no tensor argument {k:?} (its tensors: {})",
                            order.join(", ")
                        )));
                    }
                    for want in order {
                        let (_, ts) = named
                            .iter_mut()
                            .find(|(k, _)| *k == want)
                            .ok_or_else(|| invalid(format!("{function} needs the tensor argument {want:?}")))?;
                        inputs.append(ts);
                    }
                }
            }
        }
    }
    Ok((inputs, args))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> DecodeLimits {
        DecodeLimits { max_tensor_bytes: 1 << 20, ..DecodeLimits::default() }
    }

    fn tensor_json(dtype: &str, shape: &[usize], bytes: &[u8]) -> Json {
        json!({ "dtype": dtype, "shape": shape, "data": STANDARD.encode(bytes) })
    }

    #[test]
    fn tensors_round_trip_and_lies_are_refused() {
        let t = Tensor::from_vec([2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let j = tensor_to_json(&t.transpose(0, 1).unwrap()).unwrap();
        let back = &tensors_from_json(j.as_object().unwrap(), &limits()).unwrap()[0];
        assert!(back.data_eq(&t.transpose(0, 1).unwrap()));
        for (j, needle) in [
            (tensor_json("float32", &[2, 3], &[0; 20]), "needs 24 bytes, but data holds 20"),
            (tensor_json("float32", &[2, 3], &[0; 28]), "needs 24 bytes, but data holds 28"),
            (tensor_json("float32", &[1 << 30], &[0; 4]), "above the limit"),
            (tensor_json("nope", &[1], &[0]), "nope"),
            (json!({"dtype": "uint8", "shape": [-1], "data": ""}), "non-negative"),
            (json!({"dtype": "uint8", "shape": [3], "data": "!!!!"}), "base64"),
            (json!({"dtype": "uint8", "shape": [1], "data": "AA==", "extra": 1}), "\"extra\""),
            (json!({"safetensors": "AAAA"}), "safetensors"),
        ] {
            let e = tensors_from_json(j.as_object().unwrap(), &limits()).unwrap_err();
            assert_eq!(e.code, super::super::protocol::INVALID_PARAMS);
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        }
        // No shape: one dimension, as long as the data.
        let j = json!({"dtype": "int16", "data": STANDARD.encode([1u8, 0, 2, 0])});
        assert_eq!(tensors_from_json(j.as_object().unwrap(), &limits()).unwrap()[0].shape(), &[2]);
    }

    #[test]
    fn params_map_onto_inputs_and_args() {
        let x = tensor_json("uint8", &[2], &[1, 2]);
        let y = tensor_json("uint8", &[1], &[3]);
        let sig = Signature { inputs: None, args: vec!["a".into(), "b".into()] };
        let (i, a) =
            call_params("f", &Params::Positional(vec![json!(10), x.clone(), json!(2.5)]), &sig, &limits()).unwrap();
        assert_eq!(i.len(), 1);
        assert_eq!((a.get("a"), a.get("b")), (Some(&Value::Int(10)), Some(&Value::Float(2.5))));
        let e = call_params("f", &Params::Positional(vec![json!(1), json!(2), json!(3)]), &sig, &limits()).unwrap_err();
        assert!(e.message.contains("takes 2 argument(s) (a, b)"), "{}", e.message);
        let (_, a) =
            call_params("g", &Params::Positional(vec![json!(1), json!("s")]), &Signature::default(), &limits())
                .unwrap();
        assert_eq!((a.get("0"), a.get("1")), (Some(&Value::Int(1)), Some(&Value::Str("s".into()))));
        // Named: declared input order wins over the document's.
        let named = |m: Json| Params::Named(m.as_object().unwrap().clone());
        let sig = Signature { inputs: Some(vec!["x".into(), "y".into()]), args: vec![] };
        let (i, a) = call_params("h", &named(json!({"y": y, "k": {"n": [1]}, "x": x})), &sig, &limits()).unwrap();
        assert_eq!(i.iter().map(Tensor::numel).collect::<Vec<_>>(), vec![2, 1]);
        assert_eq!(a.get("k").unwrap().as_map().unwrap()["n"], Value::List(vec![Value::Int(1)]));
        assert!(call_params("h", &named(json!({"x": x})), &sig, &limits()).unwrap_err().message.contains("\"y\""));
        let nested = Params::Positional(vec![json!([x])]);
        assert!(call_params("h", &nested, &Signature::default(), &limits()).is_err());
        let big = Params::Positional(vec![json!(u64::MAX)]);
        assert!(call_params("h", &big, &Signature::default(), &limits()).is_err());
    }

    #[test]
    fn outputs_take_the_simplest_form() {
        assert_eq!(output_to_json(&Output::value(30)).unwrap(), json!(30));
        let t = Tensor::from_vec([1], vec![7u8]).unwrap();
        assert_eq!(output_to_json(&Output::tensors(vec![t.clone()])).unwrap()["dtype"], "uint8");
        assert!(output_to_json(&Output::tensors(vec![t.clone(), t.clone()])).unwrap().is_array());
        let both = Output { tensors: vec![t], values: Value::from("ok") };
        assert_eq!(output_to_json(&both).unwrap()["values"], "ok");
        assert_eq!(value_to_json(&Value::Float(f64::NAN)), Json::Null);
    }
}
