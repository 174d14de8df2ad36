//! Python values ⇄ the RPC layer's [`Value`]s: None, bool, int, float, str,
//! bytes, lists/tuples and dicts with str keys. Anything else is a
//! `TypeError`: arguments travel as values, never as pickles.

use std::collections::BTreeMap;

use bytes::Bytes;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use tensorwire::{Args, Value};

/// Deeper nesting than this is refused (a cycle would otherwise recurse
/// until the stack overflows).
const MAX_DEPTH: usize = 64;

/// A Python object as a [`Value`].
pub fn to_value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    to_value_at(obj, 0)
}

fn to_value_at(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > MAX_DEPTH {
        return Err(PyTypeError::new_err(format!("values nest deeper than {MAX_DEPTH} levels")));
    }
    if obj.is_none() {
        return Ok(Value::None);
    }
    // bool before int: Python's bool is an int.
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj
            .extract::<i64>()
            .map(Value::Int)
            .map_err(|_| PyTypeError::new_err("int argument does not fit in 64 bits (tensorwire values are i64)"));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(s.extract::<String>()?));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Value::Bytes(Bytes::copy_from_slice(b.as_bytes())));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l.iter().map(|x| to_value_at(&x, depth + 1)).collect::<PyResult<_>>().map(Value::List);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t.iter().map(|x| to_value_at(&x, depth + 1)).collect::<PyResult<_>>().map(Value::List);
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut m = BTreeMap::new();
        for (k, v) in d.iter() {
            let k: String = k.extract().map_err(|_| PyTypeError::new_err("dict keys of values must be str"))?;
            m.insert(k, to_value_at(&v, depth + 1)?);
        }
        return Ok(Value::Map(m));
    }
    // numpy's bool scalar (`arr.any()`): a bool, not the int `__index__`
    // would make of it (or refuse to, in newer numpy).
    if let Ok(kind) = obj.getattr("dtype").and_then(|d| d.getattr("kind"))
        && kind.extract::<String>().is_ok_and(|k| k == "b")
        && obj.getattr("shape").and_then(|s| s.len()).is_ok_and(|n| n == 0)
    {
        return Ok(Value::Bool(obj.is_truthy()?));
    }
    // Numbers that are not builtins (numpy scalars, 0-dim tensors' .item()).
    if obj.hasattr("__index__")? {
        return Ok(Value::Int(obj.call_method0("__index__")?.extract()?));
    }
    if obj.hasattr("__float__")? {
        return Ok(Value::Float(obj.call_method0("__float__")?.extract()?));
    }
    let type_name = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
    Err(PyTypeError::new_err(format!(
        "cannot send a {type_name} as a value: use None, bool, int, float, str, bytes, lists/tuples or dicts of them"
    )))
}

/// A [`Value`] as a Python object.
pub fn from_value<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => f.into_pyobject(py)?.into_any(),
        Value::Str(s) => PyString::new(py, s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::List(l) => {
            let items = l.iter().map(|x| from_value(py, x)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Map(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, from_value(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// Keyword values (a dict, or None) as [`Args`].
pub fn to_args(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Args> {
    let mut args = Args::new();
    if let Some(d) = kwargs {
        for (k, v) in d.iter() {
            let k: String = k.extract().map_err(|_| PyTypeError::new_err("argument names must be str"))?;
            args.0.insert(k, to_value(&v)?);
        }
    }
    Ok(args)
}

/// [`Args`] as a dict.
pub fn from_args<'py>(py: Python<'py>, args: &Args) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in &args.0 {
        d.set_item(k, from_value(py, v)?)?;
    }
    Ok(d)
}

/// A value moved into Python later (the result of an async call).
pub struct PyValue(pub Value);

impl<'py> IntoPyObject<'py> for PyValue {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        from_value(py, &self.0)
    }
}
