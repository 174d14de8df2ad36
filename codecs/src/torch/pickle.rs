//! A safe interpreter for the pickles `torch.save` writes (the writer is
//! [`crate::torch::pickle_write`]; the value tree both share is re-exported here).
//!
//! The reader is a stack machine over the opcodes of pickle protocols 0–5
//! that build data (numbers, strings, tuples, lists, dicts, memo, persistent
//! ids). Callables are limited to a fixed allow-list of globals — the tensor
//! rebuild functions, storage types, dtypes, `OrderedDict` and a few more —
//! and each is *interpreted* here, never looked up or called: the reader
//! cannot execute anything. Any other global (`os.system`, `builtins.eval`,
//! ...) fails at the `GLOBAL` opcode with [`DecodeError::ForbiddenGlobal`],
//! before any reduce. Objects live in an arena bounded by the pickle's size;
//! turning the result into a [`PickleValue`] tree counts nodes and depth, so
//! shared or self-referencing structures cannot blow up memory or the stack.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::DecodeError;
use crate::limits::DecodeLimits;
use crate::torch::cursor::Cursor;
pub use crate::torch::pickle_model::{PickleValue, StorageRef, TensorRef, storage_class, storage_dtype};

/// Globals a pickle may name. Everything else is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Global {
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    OrderedDict,
    TypedStorage(DType),
    UntypedStorage,
    DTypeObj(DType),
    TensorType,
    ParameterType,
    TorchSize,
    TorchDevice,
    CodecsEncode,
}

fn lookup_global(module: &str, name: &str) -> Option<Global> {
    use Global::*;
    Some(match (module, name) {
        ("torch._utils", "_rebuild_tensor_v2") => RebuildTensorV2,
        ("torch._utils", "_rebuild_tensor_v3") => RebuildTensorV3,
        ("torch._utils", "_rebuild_parameter") => RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => RebuildParameterWithState,
        ("torch._tensor", "_rebuild_from_type_v2") => RebuildFromTypeV2,
        ("collections", "OrderedDict") => OrderedDict,
        ("torch.storage", "UntypedStorage") | ("torch", "UntypedStorage") => UntypedStorage,
        ("torch", "Tensor") | ("torch._tensor", "Tensor") => TensorType,
        ("torch.nn.parameter", "Parameter") | ("torch.nn", "Parameter") => ParameterType,
        ("torch", "Size") => TorchSize,
        ("torch", "device") => TorchDevice,
        ("_codecs", "encode") => CodecsEncode,
        ("torch", storage) if storage.ends_with("Storage") => TypedStorage(storage_dtype(storage)?),
        ("torch", dtype) => DTypeObj(torch_dtype(dtype)?),
        _ => return None,
    })
}

fn torch_dtype(name: &str) -> Option<DType> {
    // Only exact torch dtype attribute names, not the CLI's aliases.
    DType::ALL.into_iter().find(|d| d.name() == name).or(match name {
        "float" => Some(DType::Float32),
        "double" => Some(DType::Float64),
        "half" => Some(DType::Float16),
        "long" => Some(DType::Int64),
        "int" => Some(DType::Int32),
        "short" => Some(DType::Int16),
        "cfloat" => Some(DType::Complex64),
        "cdouble" => Some(DType::Complex128),
        _ => None,
    })
}

/// Objects of the interpreter's arena.
#[derive(Debug, Clone)]
enum Obj {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<usize>),
    List(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    OrderedDict(Vec<(usize, usize)>),
    Global(Global),
    Storage(StorageRef),
    Tensor(TensorRef),
}

fn bad(reason: impl Into<String>) -> DecodeError {
    DecodeError::Malformed { format: "pickle", reason: reason.into() }
}

/// How much the result tree may hold once shared objects are expanded.
struct Budget {
    nodes: u64,
    bytes: u64,
}

impl Budget {
    fn spend(&mut self, bytes: usize) -> Result<(), DecodeError> {
        if self.nodes == 0 || self.bytes < bytes as u64 {
            return Err(DecodeError::LimitExceeded {
                what: "pickle result size once shared objects expand",
                count: u64::MAX,
                limit: 0,
            });
        }
        self.nodes -= 1;
        self.bytes -= bytes as u64;
        Ok(())
    }
}

struct Machine<'a> {
    cur: Cursor<'a>,
    arena: Vec<Obj>,
    stack: Vec<usize>,
    marks: Vec<usize>,
    memo: HashMap<u32, usize>,
    next_memo: u32,
}

/// Runs a pickle and returns its value. See the [module docs](self).
pub fn load(data: &[u8], limits: &DecodeLimits) -> Result<PickleValue, DecodeError> {
    if data.len() as u64 > limits.max_pickle_bytes {
        return Err(DecodeError::TooLarge { what: "pickle", size: data.len() as u64, limit: limits.max_pickle_bytes });
    }
    let mut m = Machine {
        cur: Cursor::at("pickle", data, 0),
        arena: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        next_memo: 0,
    };
    let root = m.run()?;
    // Bound the tree by the arena size times a small factor: a DAG shared
    // many times over expands; stop it before it eats memory.
    let mut budget = Budget {
        nodes: (m.arena.len() as u64).saturating_mul(4).saturating_add(1024).min(50_000_000),
        bytes: (data.len() as u64).saturating_mul(2).saturating_add(4096),
    };
    m.to_value(root, 0, limits.max_depth, &mut budget)
}

impl Machine<'_> {
    fn len64(&mut self) -> Result<usize, DecodeError> {
        let n = self.cur.u64()?;
        usize::try_from(n).map_err(|_| bad(format!("length {n} overflows")))
    }
    fn line(&mut self) -> Result<&str, DecodeError> {
        let data = self.cur.buf();
        let rest = &data[self.cur.pos()..];
        let n = rest.iter().position(|&b| b == b'\n').ok_or(DecodeError::Truncated {
            what: "pickle text argument",
            needed: data.len() as u64 + 1,
            available: data.len() as u64,
        })?;
        let line = &self.cur.take(n + 1)?[..n];
        std::str::from_utf8(line).map_err(|_| bad("text argument is not UTF-8"))
    }

    fn alloc(&mut self, o: Obj) -> usize {
        self.arena.push(o);
        self.arena.len() - 1
    }
    fn push(&mut self, o: Obj) {
        let id = self.alloc(o);
        self.stack.push(id);
    }
    fn pop(&mut self) -> Result<usize, DecodeError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(bad("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked"))
    }
    fn top(&self) -> Result<usize, DecodeError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(bad("stack underflow"));
        }
        Ok(*self.stack.last().expect("checked"))
    }
    fn pop_mark(&mut self) -> Result<Vec<usize>, DecodeError> {
        let m = self.marks.pop().ok_or_else(|| bad("no MARK on the stack"))?;
        Ok(self.stack.split_off(m))
    }
    fn memo_put(&mut self, key: u32) -> Result<(), DecodeError> {
        let top = self.top()?;
        self.memo.insert(key, top);
        Ok(())
    }
    fn memo_get(&mut self, key: u32) -> Result<(), DecodeError> {
        let id = *self.memo.get(&key).ok_or_else(|| bad(format!("memo key {key} was never stored")))?;
        self.stack.push(id);
        Ok(())
    }

    fn run(&mut self) -> Result<usize, DecodeError> {
        loop {
            let op = self.cur.u8()?;
            match op {
                0x80 => {
                    let proto = self.cur.u8()?;
                    if proto > 5 {
                        return Err(bad(format!("pickle protocol {proto} is newer than 5")));
                    }
                }
                0x95 => {
                    self.cur.u64()?; // FRAME: a length hint; frames are transparent.
                }
                b'.' => {
                    let r = self.pop()?;
                    if !self.marks.is_empty() {
                        return Err(bad("STOP with an open MARK"));
                    }
                    return Ok(r);
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let t = self.top()?;
                    self.stack.push(t);
                }
                b'N' => self.push(Obj::None),
                0x88 => self.push(Obj::Bool(true)),
                0x89 => self.push(Obj::Bool(false)),
                b'I' => {
                    let s = self.line()?.to_string();
                    let o = match s.as_str() {
                        "00" => Obj::Bool(false),
                        "01" => Obj::Bool(true),
                        _ => Obj::Int(s.parse().map_err(|_| bad(format!("bad INT {s:?}")))?),
                    };
                    self.push(o);
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.cur.array()?);
                    self.push(Obj::Int(v.into()));
                }
                b'K' => {
                    let v = self.cur.u8()?;
                    self.push(Obj::Int(v.into()));
                }
                b'M' => {
                    let v = self.cur.u16()?;
                    self.push(Obj::Int(v.into()));
                }
                b'L' => {
                    let s = self.line()?.trim_end_matches('L').to_string();
                    let v = s.parse::<i64>().map_err(|_| bad(format!("integer {s} does not fit in 64 bits")))?;
                    self.push(Obj::Int(v));
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a { self.cur.u8()? as usize } else { self.cur.u32()? as usize };
                    let bytes = self.cur.take(n)?;
                    let v = long_le(bytes)?;
                    self.push(Obj::Int(v));
                }
                b'F' => {
                    let s = self.line()?.to_string();
                    self.push(Obj::Float(s.trim().parse().map_err(|_| bad(format!("bad FLOAT {s:?}")))?));
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.cur.array()?);
                    self.push(Obj::Float(v));
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => self.cur.u32()? as usize,
                        0x8c => self.cur.u8()? as usize,
                        _ => self.len64()?,
                    };
                    let s = std::str::from_utf8(self.cur.take(n)?).map_err(|_| bad("string is not UTF-8"))?.to_string();
                    self.push(Obj::Str(s));
                }
                b'V' => {
                    let s = self.line()?.to_string();
                    self.push(Obj::Str(s));
                }
                b'T' | b'U' => {
                    // Python 2 str: bytes.
                    let n = if op == b'T' { self.cur.u32()? as usize } else { self.cur.u8()? as usize };
                    let b = self.cur.take(n)?.to_vec();
                    self.push(Obj::Bytes(b));
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'B' => self.cur.u32()? as usize,
                        b'C' => self.cur.u8()? as usize,
                        _ => self.len64()?,
                    };
                    let b = self.cur.take(n)?.to_vec();
                    self.push(Obj::Bytes(b));
                }
                b')' => self.push(Obj::Tuple(vec![])),
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Obj::Tuple(items));
                }
                0x85 => {
                    let a = self.pop()?;
                    self.push(Obj::Tuple(vec![a]));
                }
                0x86 => {
                    let b = self.pop()?;
                    let a = self.pop()?;
                    self.push(Obj::Tuple(vec![a, b]));
                }
                0x87 => {
                    let c = self.pop()?;
                    let b = self.pop()?;
                    let a = self.pop()?;
                    self.push(Obj::Tuple(vec![a, b, c]));
                }
                b']' => self.push(Obj::List(vec![])),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Obj::List(items));
                }
                b'a' => {
                    let v = self.pop()?;
                    let l = self.top()?;
                    self.list_extend(l, vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    let l = self.top()?;
                    self.list_extend(l, items)?;
                }
                b'}' => self.push(Obj::Dict(vec![])),
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(items)?;
                    self.push(Obj::Dict(pairs));
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let d = self.top()?;
                    self.dict_extend(d, vec![(k, v)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let d = self.top()?;
                    self.dict_extend(d, pairs(items)?)?;
                }
                b'p' => {
                    let k = self.line()?.parse::<u32>().map_err(|_| bad("bad PUT key"))?;
                    self.memo_put(k)?;
                }
                b'q' => {
                    let k = self.cur.u8()?.into();
                    self.memo_put(k)?;
                }
                b'r' => {
                    let k = self.cur.u32()?;
                    self.memo_put(k)?;
                }
                0x94 => {
                    let k = self.next_memo;
                    self.next_memo += 1;
                    self.memo_put(k)?;
                }
                b'g' => {
                    let k = self.line()?.parse::<u32>().map_err(|_| bad("bad GET key"))?;
                    self.memo_get(k)?;
                }
                b'h' => {
                    let k = self.cur.u8()?.into();
                    self.memo_get(k)?;
                }
                b'j' => {
                    let k = self.cur.u32()?;
                    self.memo_get(k)?;
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    self.push_global(module, name)?;
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Obj::Str(module), Obj::Str(name)) = (self.arena[module].clone(), self.arena[name].clone())
                    else {
                        return Err(bad("STACK_GLOBAL needs two strings"));
                    };
                    self.push_global(module, name)?;
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let o = self.reduce(func, args)?;
                    self.push(o);
                }
                b'b' => {
                    // BUILD sets an object's state. Tensors and dicts may carry
                    // Python attributes (a state_dict's `_metadata`): drop them.
                    let _state = self.pop()?;
                    let target = self.top()?;
                    match &self.arena[target] {
                        Obj::Tensor(_) | Obj::Dict(_) | Obj::OrderedDict(_) => {}
                        other => {
                            return Err(bad(format!("BUILD on {} is not allowed", obj_name(other))));
                        }
                    }
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let s = self.persistent(pid)?;
                    self.push(Obj::Storage(s));
                }
                b'P' => return Err(bad("text persistent ids are not used by torch.save")),
                b'i' | b'o' | 0x81 | 0x92 => {
                    return Err(bad(format!("opcode {op:#04x} builds arbitrary objects and is not allowed")));
                }
                0x82..=0x84 => return Err(bad("extension registry opcodes are not allowed")),
                0x8f..=0x91 => return Err(bad("sets are not used by torch.save")),
                0x97 | 0x98 => return Err(bad("out-of-band buffers are not supported")),
                other => {
                    return Err(bad(format!("unknown opcode {other:#04x} at byte {}", self.cur.pos() - 1)));
                }
            }
        }
    }

    fn push_global(&mut self, module: String, name: String) -> Result<(), DecodeError> {
        let g = lookup_global(&module, &name).ok_or(DecodeError::ForbiddenGlobal { module, name })?;
        self.push(Obj::Global(g));
        Ok(())
    }

    fn list_extend(&mut self, l: usize, items: Vec<usize>) -> Result<(), DecodeError> {
        match &mut self.arena[l] {
            Obj::List(v) => {
                v.extend(items);
                Ok(())
            }
            other => Err(bad(format!("APPEND to {}", obj_name(other)))),
        }
    }

    fn dict_extend(&mut self, d: usize, items: Vec<(usize, usize)>) -> Result<(), DecodeError> {
        match &mut self.arena[d] {
            Obj::Dict(v) | Obj::OrderedDict(v) => {
                v.extend(items);
                Ok(())
            }
            other => Err(bad(format!("SETITEM on {}", obj_name(other)))),
        }
    }

    fn tuple(&self, id: usize, what: &str) -> Result<Vec<usize>, DecodeError> {
        match &self.arena[id] {
            Obj::Tuple(v) => Ok(v.clone()),
            other => Err(bad(format!("{what}: expected a tuple, found {}", obj_name(other)))),
        }
    }

    fn int(&self, id: usize, what: &str) -> Result<i64, DecodeError> {
        match &self.arena[id] {
            Obj::Int(v) => Ok(*v),
            Obj::Bool(b) => Ok(i64::from(*b)),
            other => Err(bad(format!("{what}: expected an int, found {}", obj_name(other)))),
        }
    }

    fn uint(&self, id: usize, what: &str) -> Result<u64, DecodeError> {
        let v = self.int(id, what)?;
        u64::try_from(v).map_err(|_| bad(format!("{what}: {v} is negative")))
    }

    fn uints(&self, id: usize, what: &str) -> Result<Vec<u64>, DecodeError> {
        self.tuple(id, what)?.into_iter().map(|i| self.uint(i, what)).collect()
    }

    fn persistent(&self, pid: usize) -> Result<StorageRef, DecodeError> {
        let t = self.tuple(pid, "persistent id")?;
        let [tag, ty, key, location, numel] = t.as_slice() else {
            return Err(bad(format!("persistent id has {} fields, expected 5", t.len())));
        };
        if !matches!(&self.arena[*tag], Obj::Str(s) if s == "storage") {
            return Err(bad("persistent id is not a storage"));
        }
        let dtype = match &self.arena[*ty] {
            Obj::Global(Global::TypedStorage(d)) => Some(*d),
            Obj::Global(Global::UntypedStorage) => None,
            other => return Err(bad(format!("storage type is {}", obj_name(other)))),
        };
        let key = match &self.arena[*key] {
            Obj::Str(s) => s.clone(),
            Obj::Int(i) => i.to_string(),
            other => return Err(bad(format!("storage key is {}", obj_name(other)))),
        };
        if key.is_empty() || key.contains(['/', '\\']) || key.contains("..") {
            return Err(bad(format!("storage key {key:?} is not a plain name")));
        }
        let location = match &self.arena[*location] {
            Obj::Str(s) => s.clone(),
            other => return Err(bad(format!("storage location is {}", obj_name(other)))),
        };
        let numel = self.uint(*numel, "storage size")?;
        Ok(StorageRef { dtype, key, location, numel })
    }

    fn reduce(&mut self, func: usize, args: usize) -> Result<Obj, DecodeError> {
        let Obj::Global(g) = self.arena[func].clone() else {
            return Err(bad(format!("REDUCE on {}, which is not an allowed callable", obj_name(&self.arena[func]))));
        };
        let a = self.tuple(args, "call arguments")?;
        match g {
            Global::OrderedDict => {
                let mut items = vec![];
                if let Some(&src) = a.first() {
                    match self.arena[src].clone() {
                        Obj::List(l) | Obj::Tuple(l) => {
                            for p in l {
                                let kv = self.tuple(p, "OrderedDict item")?;
                                let [k, v] = kv.as_slice() else {
                                    return Err(bad("OrderedDict item is not a pair"));
                                };
                                items.push((*k, *v));
                            }
                        }
                        Obj::Dict(d) | Obj::OrderedDict(d) => items = d,
                        other => return Err(bad(format!("OrderedDict({})", obj_name(&other)))),
                    }
                }
                Ok(Obj::OrderedDict(items))
            }
            Global::RebuildTensorV2 | Global::RebuildTensorV3 => {
                let need = if g == Global::RebuildTensorV2 { 6 } else { 7 };
                if a.len() < need {
                    return Err(bad(format!("tensor rebuild with {} arguments, expected {need}", a.len())));
                }
                let Obj::Storage(storage) = self.arena[a[0]].clone() else {
                    return Err(bad("tensor rebuild without a storage"));
                };
                let dtype = if g == Global::RebuildTensorV3 {
                    match &self.arena[a[6]] {
                        Obj::Global(Global::DTypeObj(d)) => *d,
                        other => return Err(bad(format!("tensor dtype is {}", obj_name(other)))),
                    }
                } else {
                    storage.dtype.ok_or_else(|| bad("_rebuild_tensor_v2 with an untyped storage"))?
                };
                if let Some(sd) = storage.dtype
                    && sd != dtype
                {
                    return Err(bad(format!("a {sd} storage rebuilt as {dtype}")));
                }
                let offset = self.uint(a[1], "storage offset")?;
                let shape = self.uints(a[2], "tensor size")?;
                let strides = self.uints(a[3], "tensor stride")?;
                if shape.len() != strides.len() {
                    return Err(bad(format!("{} sizes but {} strides", shape.len(), strides.len())));
                }
                Ok(Obj::Tensor(TensorRef { storage, dtype, offset, shape, strides }))
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => match a.first().map(|&i| &self.arena[i]) {
                Some(Obj::Tensor(t)) => Ok(Obj::Tensor(t.clone())),
                _ => Err(bad("parameter rebuild without a tensor")),
            },
            Global::RebuildFromTypeV2 => {
                // (func, new_type, args, state): only plain tensors and parameters.
                let [f, ty, inner, _state] = a.as_slice() else {
                    return Err(bad("_rebuild_from_type_v2 needs 4 arguments"));
                };
                if !matches!(self.arena[*ty], Obj::Global(Global::TensorType | Global::ParameterType)) {
                    return Err(bad("_rebuild_from_type_v2 for a type other than Tensor or Parameter"));
                }
                self.reduce(*f, *inner)
            }
            Global::TorchSize => match a.first() {
                Some(&t) => Ok(Obj::Tuple(self.tuple(t, "torch.Size")?)),
                None => Ok(Obj::Tuple(vec![])),
            },
            Global::TorchDevice => {
                let mut s = String::new();
                for (i, &x) in a.iter().enumerate() {
                    match &self.arena[x] {
                        Obj::Str(v) => s.push_str(v),
                        Obj::Int(v) if i == 1 => s.push_str(&format!(":{v}")),
                        other => return Err(bad(format!("torch.device({})", obj_name(other)))),
                    }
                }
                Ok(Obj::Str(s))
            }
            Global::CodecsEncode => match a.as_slice() {
                [s, enc] => match (&self.arena[*s], &self.arena[*enc]) {
                    (Obj::Str(text), Obj::Str(e)) if e == "latin1" || e == "latin-1" => {
                        let mut out = Vec::with_capacity(text.len());
                        for ch in text.chars() {
                            out.push(
                                u8::try_from(u32::from(ch))
                                    .map_err(|_| bad("latin1 text holds a character above U+00FF"))?,
                            );
                        }
                        Ok(Obj::Bytes(out))
                    }
                    _ => Err(bad("_codecs.encode needs (str, 'latin1')")),
                },
                _ => Err(bad("_codecs.encode needs 2 arguments")),
            },
            other => Err(bad(format!("{other:?} is not callable"))),
        }
    }

    fn to_value(
        &self,
        id: usize,
        depth: usize,
        max_depth: usize,
        budget: &mut Budget,
    ) -> Result<PickleValue, DecodeError> {
        if depth > max_depth {
            return Err(DecodeError::LimitExceeded {
                what: "pickle nesting depth",
                count: depth as u64,
                limit: max_depth as u64,
            });
        }
        budget.spend(match &self.arena[id] {
            Obj::Str(s) => s.len(),
            Obj::Bytes(b) => b.len(),
            _ => 0,
        })?;
        let rec = |i: usize, budget: &mut Budget| self.to_value(i, depth + 1, max_depth, budget);
        Ok(match &self.arena[id] {
            Obj::None => PickleValue::None,
            Obj::Bool(b) => PickleValue::Bool(*b),
            Obj::Int(i) => PickleValue::Int(*i),
            Obj::Float(f) => PickleValue::Float(*f),
            Obj::Str(s) => PickleValue::Str(s.clone()),
            Obj::Bytes(b) => PickleValue::Bytes(b.clone()),
            Obj::Tuple(v) => PickleValue::Tuple(v.iter().map(|&i| rec(i, budget)).collect::<Result<_, _>>()?),
            Obj::List(v) => PickleValue::List(v.iter().map(|&i| rec(i, budget)).collect::<Result<_, _>>()?),
            Obj::Dict(v) | Obj::OrderedDict(v) => {
                let items = v
                    .iter()
                    .map(|&(k, x)| Ok((rec(k, budget)?, rec(x, budget)?)))
                    .collect::<Result<Vec<_>, DecodeError>>()?;
                if matches!(self.arena[id], Obj::OrderedDict(_)) {
                    PickleValue::OrderedDict(items)
                } else {
                    PickleValue::Dict(items)
                }
            }
            Obj::Tensor(t) => PickleValue::Tensor(t.clone()),
            other => {
                return Err(bad(format!("the pickle's result holds a bare {}", obj_name(other))));
            }
        })
    }
}

fn pairs(items: Vec<usize>) -> Result<Vec<(usize, usize)>, DecodeError> {
    if !items.len().is_multiple_of(2) {
        return Err(bad("odd number of items for a dict"));
    }
    Ok(items.chunks_exact(2).map(|c| (c[0], c[1])).collect())
}

/// Two's complement little-endian integer of any length, if it fits i64.
fn long_le(bytes: &[u8]) -> Result<i64, DecodeError> {
    let Some(&last) = bytes.last() else {
        return Ok(0);
    };
    let sign = if last & 0x80 != 0 { 0xffu8 } else { 0 };
    if bytes.len() > 8 && bytes[8..].iter().any(|&b| b != sign) {
        return Err(bad("integer does not fit in 64 bits"));
    }
    let mut buf = [sign; 8];
    let n = bytes.len().min(8);
    buf[..n].copy_from_slice(&bytes[..n]);
    let v = i64::from_le_bytes(buf);
    // The low 8 bytes must carry the same sign as the whole number.
    if (v < 0) != (sign == 0xff) {
        return Err(bad("integer does not fit in 64 bits"));
    }
    Ok(v)
}

fn obj_name(o: &Obj) -> &'static str {
    match o {
        Obj::None => "None",
        Obj::Bool(_) => "bool",
        Obj::Int(_) => "int",
        Obj::Float(_) => "float",
        Obj::Str(_) => "str",
        Obj::Bytes(_) => "bytes",
        Obj::Tuple(_) => "tuple",
        Obj::List(_) => "list",
        Obj::Dict(_) => "dict",
        Obj::OrderedDict(_) => "OrderedDict",
        Obj::Global(_) => "global",
        Obj::Storage(_) => "storage",
        Obj::Tensor(_) => "tensor",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch::pickle_write::PickleWriter;

    fn limits() -> DecodeLimits {
        DecodeLimits::default()
    }

    #[test]
    fn writer_output_reads_back() {
        let t = TensorRef {
            storage: StorageRef { dtype: Some(DType::Float32), key: "0".into(), location: "cpu".into(), numel: 6 },
            dtype: DType::Float32,
            offset: 0,
            shape: vec![2, 3],
            strides: vec![3, 1],
        };
        let u = TensorRef {
            storage: StorageRef { dtype: None, key: "1".into(), location: "cpu".into(), numel: 8 },
            dtype: DType::UInt16,
            offset: 1,
            shape: vec![3],
            strides: vec![1],
        };
        let v = PickleValue::OrderedDict(vec![
            (PickleValue::Str("a".into()), PickleValue::Tensor(t)),
            (PickleValue::Str("b".into()), PickleValue::Tensor(u)),
            (PickleValue::Str("n".into()), PickleValue::Int(-70000)),
            (PickleValue::Str("big".into()), PickleValue::Int(1 << 40)),
            (PickleValue::Str("f".into()), PickleValue::Float(1.5)),
            (PickleValue::Str("l".into()), PickleValue::List(vec![PickleValue::None, PickleValue::Bool(true)])),
            (PickleValue::Str("t".into()), PickleValue::Tuple(vec![PickleValue::Int(1); 5])),
            (PickleValue::Str("b".into()), PickleValue::Bytes(vec![0, 200, 255])),
            (PickleValue::Int(3), PickleValue::Dict(vec![])),
        ]);
        let mut w = PickleWriter::new();
        w.value(&v);
        let bytes = w.finish();
        assert_eq!(load(&bytes, &limits()).unwrap(), v);
    }

    #[test]
    fn forbidden_globals_fail_before_reduce() {
        // The classic: cos\nsystem\n(S'echo pwned'\ntR.
        let p = b"cos\nsystem\n(S'echo pwned'\ntR.";
        let e = load(p, &limits()).unwrap_err();
        assert_eq!(e, DecodeError::ForbiddenGlobal { module: "os".into(), name: "system".into() });
        let p = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x8c\x04eval\x93.";
        assert!(matches!(load(p, &limits()), Err(DecodeError::ForbiddenGlobal { .. })));
        let p = b"\x80\x02ctorch\nload\n.";
        assert!(matches!(load(p, &limits()), Err(DecodeError::ForbiddenGlobal { .. })));
    }

    #[test]
    fn object_building_opcodes_are_refused() {
        assert!(load(b"\x80\x02ccollections\nOrderedDict\n)\x81.", &limits()).is_err());
        assert!(load(b"(ccollections\nOrderedDict\no.", &limits()).is_err());
    }

    #[test]
    fn truncation_and_garbage() {
        let mut w = PickleWriter::new();
        w.value(&PickleValue::List(vec![PickleValue::Str("hello".into()), PickleValue::Int(1 << 20)]));
        let bytes = w.finish();
        for cut in 0..bytes.len() {
            assert!(load(&bytes[..cut], &limits()).is_err(), "cut {cut}");
        }
        assert!(load(b"X\xff\xff\xff\xff", &limits()).is_err());
        assert!(load(b"\x8e\xff\xff\xff\xff\xff\xff\xff\xff", &limits()).is_err());
        assert!(load(b"h\x05.", &limits()).is_err());
        assert!(load(b"a.", &limits()).is_err());
    }

    #[test]
    fn deep_nesting_and_sharing_blowups_are_bounded() {
        // 100k nested lists: depth limit.
        let mut p = vec![0x80, 2];
        p.extend(std::iter::repeat_n(b']', 100_000));
        p.extend(std::iter::repeat_n(b'a', 99_999));
        p.push(b'.');
        assert!(matches!(load(&p, &limits()), Err(DecodeError::LimitExceeded { .. })));
        // Billion laughs: each level holds the previous one twice.
        let mut p = vec![0x80, 2, b']', b'q', 0];
        for i in 0..60u8 {
            p.extend_from_slice(&[b']', b'h', i, b'a', b'h', i, b'a', b'q', i + 1]);
        }
        p.push(b'.');
        let l = DecodeLimits { max_depth: 100, ..limits() };
        assert!(matches!(load(&p, &l), Err(DecodeError::LimitExceeded { .. })));
        // A list that contains itself.
        let p = b"\x80\x02]q\x00h\x00a.";
        assert!(matches!(load(p, &limits()), Err(DecodeError::LimitExceeded { .. })));
    }

    #[test]
    fn protocol_zero_and_four() {
        // pickle.dumps([1, 'a', None], protocol=0)
        let p0 = b"(lp0\nI1\naVa\np1\naNa.";
        assert_eq!(
            load(p0, &limits()).unwrap(),
            PickleValue::List(vec![PickleValue::Int(1), PickleValue::Str("a".into()), PickleValue::None])
        );
        // pickle.dumps({'k': (1, 2.5)}, protocol=4)
        let p4 = b"\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01k\x94K\x01G@\x04\x00\x00\x00\x00\x00\x00\x86\x94s.";
        assert_eq!(
            load(p4, &limits()).unwrap(),
            PickleValue::Dict(vec![(
                PickleValue::Str("k".into()),
                PickleValue::Tuple(vec![PickleValue::Int(1), PickleValue::Float(2.5)])
            )])
        );
        assert_eq!(long_le(&[0xff]).unwrap(), -1);
        assert_eq!(long_le(&[0x00, 0x80, 0x00]).unwrap(), 32768);
        assert!(long_le(&[0, 0, 0, 0, 0, 0, 0, 0, 1]).is_err());
        assert!(long_le(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0]).is_err());
        assert_eq!(long_le(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0xff]).unwrap(), i64::MIN);
        // One big string shared a thousand times cannot expand into gigabytes.
        let mut p = vec![0x80, 2, b'X'];
        p.extend_from_slice(&(1u32 << 20).to_le_bytes());
        p.extend(std::iter::repeat_n(b'a', 1 << 20));
        p.extend_from_slice(b"q\x00(");
        for _ in 0..1000 {
            p.extend_from_slice(b"h\x00");
        }
        p.extend_from_slice(b"l.");
        assert!(matches!(load(&p, &limits()), Err(DecodeError::LimitExceeded { .. })));
    }
}
