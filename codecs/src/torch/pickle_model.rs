//! What the pickle reader ([`crate::torch::pickle`]) and writer
//! ([`crate::torch::pickle_write`]) share: the value tree of the pickle
//! subset torch.save uses ([`PickleValue`], with tensors as [`TensorRef`]s
//! into [`StorageRef`]s), and the table of legacy storage classes.

use crate::dtype::DType;

/// A storage reference from a persistent id: `('storage', type, key, location, numel)`.
#[derive(Debug, Clone, PartialEq)]
pub struct StorageRef {
    /// Storage dtype; `None` for `UntypedStorage` (bytes; the dtype comes from the rebuild call).
    pub dtype: Option<DType>,
    /// The record key (`archive/data/<key>`).
    pub key: String,
    /// Location the storage was saved from (`"cpu"`, `"cuda:0"`).
    pub location: String,
    /// Elements of `dtype` (bytes when untyped).
    pub numel: u64,
}

/// A tensor described by a rebuild call.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRef {
    /// The storage it views.
    pub storage: StorageRef,
    /// Element type.
    pub dtype: DType,
    /// Offset in elements.
    pub offset: u64,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides in elements.
    pub strides: Vec<u64>,
}

/// What a pickle evaluates to, in the subset torch.save produces.
#[derive(Debug, Clone, PartialEq)]
pub enum PickleValue {
    /// `None`
    None,
    /// `bool`
    Bool(bool),
    /// `int` (within i64)
    Int(i64),
    /// `float`
    Float(f64),
    /// `str`
    Str(String),
    /// `bytes`
    Bytes(Vec<u8>),
    /// `tuple`
    Tuple(Vec<PickleValue>),
    /// `list`
    List(Vec<PickleValue>),
    /// `dict` (insertion order kept)
    Dict(Vec<(PickleValue, PickleValue)>),
    /// `collections.OrderedDict`
    OrderedDict(Vec<(PickleValue, PickleValue)>),
    /// A tensor (also an `nn.Parameter`).
    Tensor(TensorRef),
}

/// The legacy typed storage classes (`torch.FloatStorage`, ...) and their
/// dtypes. Dtypes not listed are saved as `UntypedStorage` with
/// `_rebuild_tensor_v3`.
const STORAGE_CLASSES: [(DType, &str); 12] = [
    (DType::Bool, "BoolStorage"),
    (DType::UInt8, "ByteStorage"),
    (DType::Int8, "CharStorage"),
    (DType::Int16, "ShortStorage"),
    (DType::Int32, "IntStorage"),
    (DType::Int64, "LongStorage"),
    (DType::Float16, "HalfStorage"),
    (DType::BFloat16, "BFloat16Storage"),
    (DType::Float32, "FloatStorage"),
    (DType::Float64, "DoubleStorage"),
    (DType::Complex64, "ComplexFloatStorage"),
    (DType::Complex128, "ComplexDoubleStorage"),
];

/// dtype of a legacy typed storage class (`torch.FloatStorage`).
pub fn storage_dtype(class: &str) -> Option<DType> {
    STORAGE_CLASSES.iter().find(|(_, c)| *c == class).map(|&(d, _)| d)
}

/// The legacy storage class torch writes for `dtype`, or None for dtypes
/// saved as `UntypedStorage` with `_rebuild_tensor_v3`.
pub fn storage_class(dtype: DType) -> Option<&'static str> {
    STORAGE_CLASSES.iter().find(|(d, _)| *d == dtype).map(|&(_, c)| c)
}
