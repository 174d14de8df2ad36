"""Whole state dicts through `tensorwire send --file` / `fetch --out`,
checked with real PyTorch.

    write DIR               sd.pt (shared storages, views, many dtypes), sd_no_c128.pt
                            (the same without complex128) and sd.safetensors
    check ORIG BACK         BACK loads with torch.load(weights_only=True) (or safetensors)
                            equal to ORIG: same keys in the same order, dtypes,
                            shapes, values; for .pt also the same strides, storage
                            offsets and storage sharing
"""
import collections
import sys

import torch


def write(d):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(8, 6, generator=g)
    wb = torch.randn(4, 6, generator=g).to(torch.bfloat16)
    sd = collections.OrderedDict()
    sd["emb.weight"] = emb
    sd["w_bf16"] = wb
    sd["w_bf16.T"] = wb.t()  # a transposed view sharing w_bf16's storage
    sd["ids"] = torch.randint(-(2 ** 62), 2 ** 62, (5,), generator=g, dtype=torch.int64)
    sd["steps"] = torch.tensor(7)
    sd["mask"] = torch.randint(0, 2, (3, 4), generator=g).bool()
    sd["c64"] = torch.randn(2, 3, generator=g, dtype=torch.complex64)
    sd["c128"] = torch.randn(3, generator=g, dtype=torch.complex128)
    sd["head.weight"] = emb  # tied weights
    sd["emb.cols"] = emb[:, 1:3]  # a strided slice of the same storage
    sd["emb.row2"] = emb[2]  # a slice at an offset
    torch.save(sd, f"{d}/sd.pt")
    # safetensors has no complex128: the same state dict without it.
    torch.save(collections.OrderedDict((k, v) for k, v in sd.items() if k != "c128"), f"{d}/sd_no_c128.pt")
    from safetensors.torch import save_file

    st = collections.OrderedDict(
        (k, v.contiguous().clone()) for k, v in sd.items() if k in ("w_bf16", "ids", "mask", "c64", "emb.weight")
    )
    save_file(st, f"{d}/sd.safetensors")
    print("wrote")


def load(path):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)


def check(orig_path, back_path):
    orig, back = load(orig_path), load(back_path)
    assert list(orig.keys()) == list(back.keys()), (list(orig.keys()), list(back.keys()))
    strided = back_path.endswith(".pt")
    for k, a in orig.items():
        b = back[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), k
        if strided:
            assert a.stride() == b.stride(), (k, a.stride(), b.stride())
            assert a.storage_offset() == b.storage_offset(), (k, a.storage_offset(), b.storage_offset())
    if strided:
        # Tensors that shared a storage share one again, and no others.
        def groups(sd):
            by = collections.defaultdict(list)
            for k, t in sd.items():
                by[t.untyped_storage().data_ptr()].append(k)
            return sorted(sorted(g) for g in by.values())

        assert groups(orig) == groups(back), (groups(orig), groups(back))
    print(f"checked {len(orig)} tensors")


if __name__ == "__main__":
    {"write": lambda: write(sys.argv[2]), "check": lambda: check(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
