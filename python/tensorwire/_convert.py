"""torch tensors ⇄ what the native module moves.

A tensor goes out as a description ``(name, dtype, shape, data_ptr, nbytes,
owner, metadata)``: the native side sends straight from ``data_ptr`` and
holds ``owner`` (the tensor) until the last byte left, so a contiguous CPU
tensor is never copied. A tensor comes in as a ``Received`` whose DLPack
capsule torch adopts: the tensor's storage *is* the receive buffer.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from ._errors import Error

if TYPE_CHECKING:
    import torch

    from ._native import Received

Description = Tuple[Optional[str], str, List[int], int, int, Any, Optional[Dict[str, str]]]

# Attribute under which received tensors carry their name and metadata
# (torch tensors accept Python attributes).
_META = "_tensorwire_meta"
_NAME = "_tensorwire_name"


def _torch() -> Any:
    import torch

    return torch


def _dtype_names() -> Dict[Any, str]:
    import torch
    names = [
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
        "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
    ]
    return {getattr(torch, n): n for n in names if hasattr(torch, n)}


_BY_DTYPE: Dict[Any, str] = {}
_BY_NAME: Dict[str, Any] = {}


def dtype_name(dtype: Any) -> str:
    """The wire name of a torch dtype; ``Error`` for dtypes the wire lacks."""
    if not _BY_DTYPE:
        _BY_DTYPE.update(_dtype_names())
        _BY_NAME.update({v: k for k, v in _BY_DTYPE.items()})
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise Error(f"tensorwire cannot carry {dtype} tensors", "INVALID_ARGUMENT") from None


def torch_dtype(name: str) -> Any:
    """The torch dtype of a wire name."""
    if not _BY_NAME:
        dtype_name(_torch().float32)
    try:
        return _BY_NAME[name]
    except KeyError:
        raise Error(f"this torch has no dtype {name}", "UNIMPLEMENTED") from None


def as_tensor(x: Any) -> "torch.Tensor":
    """A torch tensor for ``x`` (a tensor, or a numpy array shared without a copy)."""
    import torch
    if isinstance(x, torch.Tensor):
        return x
    if _is_ndarray(x):
        # What torch.from_numpy refuses: another byte order, negative strides.
        if not x.dtype.isnative:
            x = x.astype(x.dtype.newbyteorder("="))
        if any(s < 0 for s in x.strides):
            x = sys.modules["numpy"].ascontiguousarray(x)
        with warnings.catch_warnings():
            # Read-only arrays: torch warns that writes would be undefined;
            # tensorwire only reads them.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    raise TypeError(f"expected a torch.Tensor or numpy array, got {type(x).__name__}")


def describe(x: Any, name: Optional[str] = None, metadata: Optional[Mapping[str, str]] = None) -> Description:
    """The native description of a tensor, sent from its own memory when it
    is a contiguous CPU tensor (otherwise from a contiguous copy)."""
    t = as_tensor(x)
    if t.device.type != "cpu":
        if t.device.type == "cuda":
            raise Error(
                "CUDA tensors are not sent directly by this build of tensorwire's Python package; "
                "move them with .cpu() (the Rust library's `cuda` feature sends device memory)",
                "UNIMPLEMENTED",
            )
        raise Error(f"cannot send a tensor on device {t.device}", "INVALID_ARGUMENT")
    if t.layout != _torch().strided:
        raise Error(f"cannot send a {t.layout} tensor; call .to_dense() first", "INVALID_ARGUMENT")
    if t.is_quantized:
        raise Error("cannot send a quantized tensor; call .dequantize() first", "INVALID_ARGUMENT")
    wire = dtype_name(t.dtype)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if name is None:
        name = getattr(x, _NAME, None)
    if metadata is None:
        metadata = getattr(x, _META, None)
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    return (name, wire, list(t.shape), int(t.data_ptr()), t.numel() * t.element_size(), t, meta)


def describe_all(tensors: Any) -> List[Description]:
    """Descriptions of a tensor, a ``{name: tensor}`` mapping (a state dict)
    or an iterable of tensors / ``(name, tensor)`` pairs."""
    return list(describe_each(tensors))


def describe_each(tensors: Any) -> Iterator[Description]:
    """:func:`describe_all`, one description at a time: an iterable is
    consumed only as far as the caller reads."""
    if is_tensor(tensors):
        yield describe(tensors)
        return
    if isinstance(tensors, Mapping):
        for k, t in tensors.items():
            yield describe(t, str(k))
        return
    for item in tensors:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield describe(item[1], item[0])
        else:
            yield describe(item)


def _is_ndarray(x: Any) -> bool:
    """A numpy array, subclasses (``np.memmap``) included; numpy is not
    imported for this (an array exists only if numpy was)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def is_tensor(x: Any) -> bool:
    """True for torch tensors and numpy arrays (what travels as tensors)."""
    return isinstance(x, _torch().Tensor) or _is_ndarray(x)


def to_torch(r: "Received") -> "torch.Tensor":
    """A torch tensor over the receive buffer of ``r`` (no copy)."""
    import torch
    import torch.utils.dlpack
    dtype = torch_dtype(r.dtype)
    shape, strides, offset = r.shape, r.strides, r.storage_offset
    if r.storage_nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        raw = torch.utils.dlpack.from_dlpack(r.capsule())
        t = raw.view(dtype).as_strided(shape, strides, offset)
    if r.name is not None:
        setattr(t, _NAME, r.name)
    meta = r.metadata
    if meta:
        setattr(t, _META, meta)
    return t


def to_torch_all(rs: Iterable["Received"]) -> List["torch.Tensor"]:
    """Every received tensor as torch."""
    return [to_torch(r) for r in rs]


def name_of(t: Any) -> Optional[str]:
    """The name a received tensor arrived with (None if it had none)."""
    return getattr(t, _NAME, None)


def metadata_of(t: Any) -> Dict[str, str]:
    """The string metadata a received tensor arrived with."""
    return dict(getattr(t, _META, None) or {})


def with_metadata(t: "torch.Tensor", name: Optional[str] = None, **metadata: str) -> "torch.Tensor":
    """Marks ``t`` with a name and metadata that travel when it is sent; returns ``t``."""
    if name is not None:
        setattr(t, _NAME, name)
    if metadata:
        merged = metadata_of(t)
        merged.update({k: str(v) for k, v in metadata.items()})
        setattr(t, _META, merged)
    return t


# --- calls: positional arguments and results --------------------------------
#
# A call's positional arguments mix tensors and plain values. Tensors travel
# as the call's inputs, in order; a plain value at position i travels as the
# keyword value named str(i), so the server can rebuild the exact positional
# order (positions without a value are the next tensor).


def split_args(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[List[Description], Dict[str, Any]]:
    """Inputs and keyword values of a call (see the comment above)."""
    inputs: List[Description] = []
    values = dict(kwargs)
    for k, v in kwargs.items():
        if is_tensor(v):
            raise TypeError(
                f"keyword argument {k!r} is a tensor: pass tensors positionally (keyword arguments carry plain values)"
            )
    for i, a in enumerate(args):
        if is_tensor(a):
            inputs.append(describe(a))
        else:
            key = str(i)
            if key in values:
                raise TypeError(f"keyword argument {key!r} collides with positional argument {i}")
            values[key] = a
    return inputs, values


def join_args(tensors: List[Any], values: Dict[str, Any]) -> Tuple[List[Any], Dict[str, Any]]:
    """The positional and keyword arguments a handler is called with."""
    named = {k: v for k, v in values.items() if not k.isdigit()}
    positional_values = {int(k): v for k, v in values.items() if k.isdigit()}
    n = len(tensors) + len(positional_values)
    it = iter(tensors)
    args = [positional_values[i] if i in positional_values else next(it) for i in range(n)]
    return args, named


def encode_result(result: Any) -> Tuple[List[Description], Any]:
    """A handler's return value as (tensor descriptions, value): a tensor, a
    tuple/list of tensors (optionally ending with one plain value), a dict of
    tensors (sent with their names), or a plain value."""
    if is_tensor(result):
        return [describe(result)], None
    if isinstance(result, Mapping) and result and all(is_tensor(v) for v in result.values()):
        return [describe(t, str(k)) for k, t in result.items()], {"__tensor_names__": [str(k) for k in result]}
    if isinstance(result, (tuple, list)) and result and any(is_tensor(x) for x in result):
        tensors = [x for x in result if is_tensor(x)]
        rest = [x for x in result if not is_tensor(x)]
        if len(rest) > 1 or (rest and is_tensor(result[-1])):
            raise TypeError("return tensors, optionally followed by one plain value")
        return [describe(t) for t in tensors], rest[0] if rest else None
    return [], result


def decode_result(received: List["Received"], value: Any) -> Any:
    """What ``Client.call`` returns for a call's outputs (the inverse of
    :func:`encode_result`)."""
    tensors = to_torch_all(received)
    if isinstance(value, dict) and set(value) == {"__tensor_names__"}:
        return dict(zip(value["__tensor_names__"], tensors))
    if not tensors:
        return value
    if value is None:
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
    return (*tensors, value)
