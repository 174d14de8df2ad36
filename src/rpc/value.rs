//! Scalar values: the arguments and non-tensor results of named functions
//! (ints, floats, bools, strings, bytes, lists, maps, None).

use std::collections::BTreeMap;
use std::fmt;

use bytes::Bytes;
use tensorwire_proto::v1;

/// A scalar argument or result.
#[derive(Clone, Debug, PartialEq, Default)]
pub enum Value {
    /// No value (Python's None).
    #[default]
    None,
    /// A boolean.
    Bool(bool),
    /// A 64-bit integer.
    Int(i64),
    /// A 64-bit float.
    Float(f64),
    /// A string.
    Str(String),
    /// Bytes.
    Bytes(Bytes),
    /// A list.
    List(Vec<Value>),
    /// A map with string keys.
    Map(BTreeMap<String, Value>),
}

impl Value {
    /// The integer, if this is an int.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The number as f64, if this is an int or a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// The bool, if this is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The map, if this is one.
    pub fn as_map(&self) -> Option<&BTreeMap<String, Value>> {
        match self {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }

    /// Parses a command-line value: `true`/`false`, `none`, integers,
    /// floats, `[a,b]` lists; anything else is a string.
    pub fn parse_cli(s: &str) -> Value {
        let t = s.trim();
        match t {
            "true" | "True" => return Value::Bool(true),
            "false" | "False" => return Value::Bool(false),
            "none" | "None" | "null" => return Value::None,
            _ => {}
        }
        if let Ok(i) = t.parse::<i64>() {
            return Value::Int(i);
        }
        if let Ok(f) = t.parse::<f64>() {
            return Value::Float(f);
        }
        if let Some(inner) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            if inner.trim().is_empty() {
                return Value::List(vec![]);
            }
            return Value::List(inner.split(',').map(Value::parse_cli).collect());
        }
        Value::Str(s.to_string())
    }

    /// The wire form.
    pub fn to_wire(&self) -> v1::Value {
        use v1::value::Kind;
        let kind = match self {
            Value::None => Kind::None(true),
            Value::Bool(b) => Kind::Bool(*b),
            Value::Int(i) => Kind::Int(*i),
            Value::Float(f) => Kind::Float(*f),
            Value::Str(s) => Kind::Str(s.clone()),
            Value::Bytes(b) => Kind::Bytes(b.clone()),
            Value::List(l) => Kind::List(v1::ValueList { items: l.iter().map(Value::to_wire).collect() }),
            Value::Map(m) => {
                Kind::Map(v1::ValueMap { entries: m.iter().map(|(k, v)| (k.clone(), v.to_wire())).collect() })
            }
        };
        v1::Value { kind: Some(kind) }
    }

    /// From the wire form (a missing value is None).
    pub fn from_wire(v: &v1::Value) -> Value {
        use v1::value::Kind;
        match &v.kind {
            None | Some(Kind::None(_)) => Value::None,
            Some(Kind::Bool(b)) => Value::Bool(*b),
            Some(Kind::Int(i)) => Value::Int(*i),
            Some(Kind::Float(f)) => Value::Float(*f),
            Some(Kind::Str(s)) => Value::Str(s.clone()),
            Some(Kind::Bytes(b)) => Value::Bytes(b.clone()),
            Some(Kind::List(l)) => Value::List(l.items.iter().map(Value::from_wire).collect()),
            Some(Kind::Map(m)) => Value::Map(m.entries.iter().map(|(k, v)| (k.clone(), Value::from_wire(v))).collect()),
        }
    }

    /// Short type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "none",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Map(_) => "map",
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::None => f.write_str("None"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x}"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Bytes(b) => write!(f, "<{} bytes>", b.len()),
            Value::List(l) => {
                f.write_str("[")?;
                for (i, v) in l.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("]")
            }
            Value::Map(m) => {
                f.write_str("{")?;
                for (i, (k, v)) in m.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k:?}: {v}")?;
                }
                f.write_str("}")
            }
        }
    }
}

macro_rules! from_impl {
    ($($t:ty => $v:ident $(as $c:ty)?),* $(,)?) => {
        $(impl From<$t> for Value {
            fn from(x: $t) -> Self { Value::$v(x $(as $c)?) }
        })*
    };
}

from_impl! {
    bool => Bool, i64 => Int, i32 => Int as i64, u32 => Int as i64, f64 => Float, f32 => Float as f64,
    String => Str, Bytes => Bytes,
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_string())
    }
}

impl<T: Into<Value>> From<Vec<T>> for Value {
    fn from(v: Vec<T>) -> Self {
        Value::List(v.into_iter().map(Into::into).collect())
    }
}

/// Named scalar arguments of a call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Args(pub BTreeMap<String, Value>);

impl Args {
    /// No arguments.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builder form: adds an argument.
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.0.insert(name.into(), value.into());
        self
    }

    /// An argument.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name)
    }

    /// A float argument (ints convert), or `default` when absent.
    pub fn f64_or(&self, name: &str, default: f64) -> Result<f64, crate::Status> {
        match self.0.get(name) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| {
                crate::Status::invalid_argument(format!("argument {name:?} must be a number, got {}", v.type_name()))
            }),
        }
    }

    /// Parses `key=value` pairs (values as in [`Value::parse_cli`]).
    pub fn from_cli<'a>(pairs: impl IntoIterator<Item = &'a str>) -> Result<Args, String> {
        let mut a = Args::new();
        for p in pairs {
            let (k, v) = p.split_once('=').ok_or_else(|| format!("argument {p:?} is not KEY=VALUE"))?;
            a.0.insert(k.to_string(), Value::parse_cli(v));
        }
        Ok(a)
    }

    pub(crate) fn to_wire(&self) -> Option<v1::Value> {
        (!self.0.is_empty()).then(|| Value::Map(self.0.clone()).to_wire())
    }

    pub(crate) fn from_wire(v: Option<&v1::Value>) -> Result<Args, String> {
        match v.map(Value::from_wire) {
            None | Some(Value::None) => Ok(Args::new()),
            Some(Value::Map(m)) => Ok(Args(m)),
            Some(other) => Err(format!("arguments must be a map, got {}", other.type_name())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip_and_cli() {
        let v = Value::Map(BTreeMap::from([
            ("a".to_string(), Value::Int(-3)),
            ("b".to_string(), Value::List(vec![Value::Float(1.5), Value::None, Value::Bool(true)])),
            ("c".to_string(), Value::Bytes(Bytes::from_static(b"xy"))),
        ]));
        assert_eq!(Value::from_wire(&v.to_wire()), v);
        let a = Args::from_cli(["factor=2.5", "n=3", "name=w", "flags=[1,2]", "ok=true"]).unwrap();
        assert_eq!(a.get("factor"), Some(&Value::Float(2.5)));
        assert_eq!(a.get("n"), Some(&Value::Int(3)));
        assert_eq!(a.get("name"), Some(&Value::Str("w".into())));
        assert_eq!(a.get("flags"), Some(&Value::List(vec![Value::Int(1), Value::Int(2)])));
        assert!(Args::from_cli(["novalue"]).is_err());
        assert_eq!(Args::from_wire(Some(&a.to_wire().unwrap())).unwrap(), a);
    }
}
