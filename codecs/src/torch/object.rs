//! [`Object`]: the Python object tree a torch.save file holds (tensors,
//! containers, scalars), and the walks over it.

use bytes::Bytes;

use crate::tensor::Tensor;

/// The object tree of a torch file: the Python objects `torch.save` writes
/// for tensors and state dicts (what [`load`](crate::torch::load) returns
/// and [`save`](crate::torch::save) takes).
#[derive(Debug, Clone)]
pub enum Object {
    /// `None`
    None,
    /// `bool`
    Bool(bool),
    /// `int`
    Int(i64),
    /// `float`
    Float(f64),
    /// `str`
    Str(String),
    /// `bytes`
    Bytes(Bytes),
    /// A tensor (saved parameters load as tensors).
    Tensor(Tensor),
    /// `list`
    List(Vec<Object>),
    /// `tuple`
    Tuple(Vec<Object>),
    /// `dict`, in insertion order.
    Dict(Vec<(Object, Object)>),
    /// `collections.OrderedDict` (what `state_dict()` returns).
    OrderedDict(Vec<(Object, Object)>),
}

impl Object {
    /// The tensor, if this is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Object::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// Every tensor inside, with a path built from dict keys and list indices
    /// (`"layer.0.weight"`, `"2"`); a bare tensor has the path `""`.
    pub fn tensors(&self) -> Vec<(String, &Tensor)> {
        let mut out = Vec::new();
        self.collect_tensors(String::new(), &mut out);
        out
    }

    fn collect_tensors<'a>(&'a self, path: String, out: &mut Vec<(String, &'a Tensor)>) {
        let join = |k: String| {
            if path.is_empty() { k } else { format!("{path}.{k}") }
        };
        match self {
            Object::Tensor(t) => out.push((path, t)),
            Object::List(v) | Object::Tuple(v) => {
                for (i, x) in v.iter().enumerate() {
                    x.collect_tensors(join(i.to_string()), out);
                }
            }
            Object::Dict(v) | Object::OrderedDict(v) => {
                for (k, x) in v {
                    let key = match k {
                        Object::Str(s) => s.clone(),
                        Object::Int(i) => i.to_string(),
                        other => format!("{other:?}"),
                    };
                    x.collect_tensors(join(key), out);
                }
            }
            _ => {}
        }
    }

    /// An OrderedDict of named tensors (a state dict).
    pub fn state_dict<S: Into<String>>(items: impl IntoIterator<Item = (S, Tensor)>) -> Object {
        Object::OrderedDict(items.into_iter().map(|(k, t)| (Object::Str(k.into()), Object::Tensor(t))).collect())
    }

    /// The Python type, with an article (`"a tensor"`), for error messages.
    pub(crate) fn type_name(&self) -> &'static str {
        match self {
            Object::None => "None",
            Object::Bool(_) => "a bool",
            Object::Int(_) => "an int",
            Object::Float(_) => "a float",
            Object::Str(_) => "a str",
            Object::Bytes(_) => "bytes",
            Object::Tensor(_) => "a tensor",
            Object::List(_) => "a list",
            Object::Tuple(_) => "a tuple",
            Object::Dict(_) => "a dict",
            Object::OrderedDict(_) => "an OrderedDict",
        }
    }
}
