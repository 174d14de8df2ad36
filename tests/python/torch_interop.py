"""Real PyTorch on the other side of the torch.save codec.

    write DIR   torch.save reference files + manifest.json for tensorwire to read
    check DIR   torch.load(weights_only=True) what tensorwire wrote and compare
    evil DIR    pickles that must never run (os.system in __reduce__, ...)
"""
import collections
import io
import json
import os
import pickle
import sys
import zipfile

import torch

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
]


def name(dt):
    return str(dt).replace("torch.", "")


def sample(dt, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dt.is_floating_point or dt.is_complex:
        base = torch.randn(shape, generator=g, dtype=torch.float64 if dt.is_floating_point else torch.complex128)
        return base.to(dt)
    info = torch.iinfo(dt)
    lo, hi = max(info.min, -(2 ** 62)), min(info.max, 2 ** 62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dt)


def raw_bytes(t):
    """Bytes of t's elements in logical (row-major) order."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def describe(t):
    return {
        "dtype": name(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "data": raw_bytes(t).hex(),
    }


def write(d):
    os.makedirs(d, exist_ok=True)
    manifest = {}
    for i, dt in enumerate(DTYPES):
        t = sample(dt, (3, 4), i)
        torch.save(t, os.path.join(d, f"{name(dt)}.pt"))
        manifest[f"{name(dt)}.pt"] = {"": describe(t)}
    # A state dict: shared storage, a transposed view, a slice with an offset.
    w = sample(torch.float32, (4, 6), 100)
    sd = collections.OrderedDict()
    sd["w"] = w
    sd["w_t"] = w.t()
    sd["row2"] = w[2]
    sd["cols"] = w[:, 1:3]
    sd["bias"] = sample(torch.bfloat16, (6,), 101)
    sd["steps"] = torch.tensor(7)
    torch.save(sd, os.path.join(d, "state_dict.pt"))
    manifest["state_dict.pt"] = {k: describe(v) for k, v in sd.items()}
    # A module's state dict (OrderedDict with _metadata) and nested containers.
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    torch.save(m.state_dict(), os.path.join(d, "module.pt"))
    manifest["module.pt"] = {k: describe(v) for k, v in m.state_dict().items()}
    nested = {"layers": [sample(torch.float16, (2, 2), 7), sample(torch.int64, (3,), 8)], "meta": {"lr": 0.1, "name": "x", "ok": True, "none": None}}
    torch.save(nested, os.path.join(d, "nested.pt"))
    manifest["nested.pt"] = {"layers.0": describe(nested["layers"][0]), "layers.1": describe(nested["layers"][1])}
    # Older but still zip-based writers: pickle protocol 4, and a parameter.
    p = torch.nn.Parameter(sample(torch.float64, (2, 3), 9))
    torch.save({"p": p}, os.path.join(d, "param_proto4.pt"), pickle_protocol=4)
    manifest["param_proto4.pt"] = {"p": describe(p.detach())}
    # safetensors, with a metadata map (complex128 has no safetensors dtype).
    from safetensors.torch import save_file
    st = {name(dt): sample(dt, (2, 5), 200 + i) for i, dt in enumerate(DTYPES) if dt != torch.complex128}
    save_file(st, os.path.join(d, "all.safetensors"), metadata={"format": "pt", "source": "python"})
    manifest["all.safetensors"] = {k: describe(v) for k, v in st.items()}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    print(f"wrote {len(manifest)} files")


def from_raw(desc):
    dt = getattr(torch, desc["dtype"])
    flat = torch.frombuffer(bytearray(bytes.fromhex(desc["data"])) or bytearray(1), dtype=torch.uint8)
    n = 1
    for s in desc["shape"]:
        n *= s
    size = torch.empty((), dtype=dt).element_size()
    flat = flat[: n * size]
    return flat.view(dt).reshape(desc["shape"]) if n else torch.empty(desc["shape"], dtype=dt)


def same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # Bitwise: NaNs in float8 and friends compare unequal with torch.equal.
    return raw_bytes(a) == raw_bytes(b)


def check(d):
    with open(os.path.join(d, "manifest.json")) as f:
        manifest = json.load(f)
    n = 0
    for fname, entries in manifest.items():
        path = os.path.join(d, fname)
        if fname.startswith("_"):
            continue
        if fname.endswith(".safetensors"):
            from safetensors import safe_open
            from safetensors.torch import load_file
            loaded = load_file(path)
            with safe_open(path, framework="pt") as f:
                assert f.metadata().get("writer") == "tensorwire", f"{fname}: metadata {f.metadata()}"
        else:
            zipfile.ZipFile(path).testzip()  # every CRC-32 must be right
            loaded = torch.load(path, weights_only=True)
        for key, desc in entries.items():
            t = loaded if key == "" else loaded[key]
            want = from_raw(desc)
            assert same(t, want), f"{fname}[{key!r}]: {t.dtype} {tuple(t.shape)} differs from the expected {want.dtype} {tuple(want.shape)}"
            if torch.is_floating_point(t) and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) and not t.isnan().any():
                assert torch.equal(t, want), f"{fname}[{key!r}] not torch.equal"
            if "stride" in desc:
                assert list(t.stride()) == desc["stride"], f"{fname}[{key!r}]: stride {t.stride()} != {desc['stride']}"
            n += 1
        for a, b in manifest.get("_shared", {}).get(fname, []):
            sa, sb = loaded[a].untyped_storage(), loaded[b].untyped_storage()
            assert sa.data_ptr() == sb.data_ptr(), f"{fname}: {a} and {b} should share storage"
    print(f"checked {n} tensors")


class Evil:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def evil(d):
    os.makedirs(d, exist_ok=True)
    marker = os.path.join(d, "PWNED")
    # torch.save pickles arbitrary objects with __reduce__.
    torch.save({"x": Evil(f"touch {marker}")}, os.path.join(d, "reduce_os_system.pt"))
    # builtins.eval through a plain pickle placed inside a torch zip.
    buf = io.BytesIO()
    torch.save(torch.zeros(2), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(os.path.join(d, "eval.pt"), "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("data.pkl"):
                data = b"cbuiltins\neval\n(V__import__('os').system('touch " + marker.encode() + b"')\ntR."
            zout.writestr(item, data)
    print("wrote evil files")


if __name__ == "__main__":
    {"write": write, "check": check, "evil": evil}[sys.argv[1]](sys.argv[2])
