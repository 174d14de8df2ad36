//! Writes pickles (protocol 2) with the opcodes and globals `torch.save` uses.

use bytes::{BufMut, Bytes, BytesMut};

use crate::torch::pickle_model::{PickleValue, TensorRef, storage_class};

/// Writes pickles (protocol 2) the way `torch.save` does.
pub struct PickleWriter {
    out: BytesMut,
}

impl Default for PickleWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl PickleWriter {
    /// Starts a protocol-2 pickle.
    pub fn new() -> Self {
        let mut out = BytesMut::with_capacity(256);
        out.put_slice(&[0x80, 2]);
        Self { out }
    }

    fn global(&mut self, module: &str, name: &str) {
        self.out.put_u8(b'c');
        self.out.put_slice(module.as_bytes());
        self.out.put_u8(b'\n');
        self.out.put_slice(name.as_bytes());
        self.out.put_u8(b'\n');
    }

    fn int(&mut self, v: i64) {
        if (0..256).contains(&v) {
            self.out.put_u8(b'K');
            self.out.put_u8(v as u8);
        } else if (0..65536).contains(&v) {
            self.out.put_u8(b'M');
            self.out.put_u16_le(v as u16);
        } else if let Ok(v) = i32::try_from(v) {
            self.out.put_u8(b'J');
            self.out.put_i32_le(v);
        } else {
            self.out.put_slice(&[0x8a, 8]);
            self.out.put_i64_le(v);
        }
    }

    fn str(&mut self, s: &str) {
        self.out.put_u8(b'X');
        self.out.put_u32_le(s.len() as u32);
        self.out.put_slice(s.as_bytes());
    }

    fn ints(&mut self, v: &[u64]) {
        match v.len() {
            0 => self.out.put_u8(b')'),
            1..=3 => {
                for &x in v {
                    self.int(x as i64);
                }
                self.out.put_u8([0x85, 0x86, 0x87][v.len() - 1]);
            }
            _ => {
                self.out.put_u8(b'(');
                for &x in v {
                    self.int(x as i64);
                }
                self.out.put_u8(b't');
            }
        }
    }

    fn empty_ordered_dict(&mut self) {
        self.global("collections", "OrderedDict");
        self.out.put_u8(b')');
        self.out.put_u8(b'R');
    }

    /// Appends `v`.
    pub fn value(&mut self, v: &PickleValue) {
        match v {
            PickleValue::None => self.out.put_u8(b'N'),
            PickleValue::Bool(b) => self.out.put_u8(if *b { 0x88 } else { 0x89 }),
            PickleValue::Int(i) => self.int(*i),
            PickleValue::Float(f) => {
                self.out.put_u8(b'G');
                self.out.put_f64(*f);
            }
            PickleValue::Str(s) => self.str(s),
            PickleValue::Bytes(b) => {
                // Protocol 2 has no bytes opcode: Python 3 pickles bytes as
                // _codecs.encode(latin1 text, 'latin1').
                self.global("_codecs", "encode");
                let text: String = b.iter().map(|&c| char::from(c)).collect();
                self.str(&text);
                self.str("latin1");
                self.out.put_u8(0x86);
                self.out.put_u8(b'R');
            }
            PickleValue::Tuple(items) => match items.len() {
                0 => self.out.put_u8(b')'),
                1..=3 => {
                    for i in items {
                        self.value(i);
                    }
                    self.out.put_u8([0x85, 0x86, 0x87][items.len() - 1]);
                }
                _ => {
                    self.out.put_u8(b'(');
                    for i in items {
                        self.value(i);
                    }
                    self.out.put_u8(b't');
                }
            },
            PickleValue::List(items) => {
                self.out.put_u8(b']');
                if !items.is_empty() {
                    self.out.put_u8(b'(');
                    for i in items {
                        self.value(i);
                    }
                    self.out.put_u8(b'e');
                }
            }
            PickleValue::Dict(items) | PickleValue::OrderedDict(items) => {
                if matches!(v, PickleValue::OrderedDict(_)) {
                    self.empty_ordered_dict();
                } else {
                    self.out.put_u8(b'}');
                }
                if !items.is_empty() {
                    self.out.put_u8(b'(');
                    for (k, x) in items {
                        self.value(k);
                        self.value(x);
                    }
                    self.out.put_u8(b'u');
                }
            }
            PickleValue::Tensor(t) => self.tensor(t),
        }
    }

    fn tensor(&mut self, t: &TensorRef) {
        let class = storage_class(t.dtype);
        self.global("torch._utils", if class.is_some() { "_rebuild_tensor_v2" } else { "_rebuild_tensor_v3" });
        self.out.put_u8(b'(');
        // Persistent id ('storage', type, key, location, numel).
        self.out.put_u8(b'(');
        self.str("storage");
        match class {
            Some(c) => self.global("torch", c),
            None => self.global("torch.storage", "UntypedStorage"),
        }
        self.str(&t.storage.key);
        self.str(&t.storage.location);
        self.int(t.storage.numel as i64);
        self.out.put_u8(b't');
        self.out.put_u8(b'Q');
        self.int(t.offset as i64);
        self.ints(&t.shape);
        self.ints(&t.strides);
        self.out.put_u8(0x89); // requires_grad = False
        self.empty_ordered_dict(); // backward hooks
        if class.is_none() {
            self.global("torch", t.dtype.name());
        }
        self.out.put_u8(b't');
        self.out.put_u8(b'R');
    }

    /// Ends the pickle and returns its bytes.
    pub fn finish(mut self) -> Bytes {
        self.out.put_u8(b'.');
        self.out.freeze()
    }
}
