"""Tensors through `tensorwire.Client` against `tensorwire serve`: every
dtype, state dicts, non-contiguous views, names/metadata, numpy, the three
local transports, and zero-copy on both sides."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tensorwire
from tensorwire import _convert

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
]


def sample(dtype: torch.dtype, shape=(3, 5, 7)) -> torch.Tensor:
    """Random data of every bit pattern the dtype allows (raw bytes)."""
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs included), plus dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_every_dtype_round_trips(cli_server, dtype):
    s = cli_server("tcp")
    t = sample(dtype)
    with tensorwire.Client(s.url) as c:
        r = c.send({"t": t})
        assert (r.received, r.bytes) == (1, t.numel() * t.element_size())
        back = c.fetch("t")
    assert same_bits(back, t)
    assert tensorwire.name_of(back) == "t"


@pytest.mark.parametrize("shape", [(), (0,), (4, 0, 3), (1,), (2, 1, 1, 3)])
def test_scalar_and_empty_shapes(cli_server, shape):
    s = cli_server("tcp")
    t = torch.randn(shape)
    with tensorwire.Client(s.url) as c:
        c.send({"t": t})
        back = c.fetch("t")
    assert back.shape == t.shape and torch.equal(back, t)


def test_state_dict_send_fetch_by_name(cli_server):
    s = cli_server("tcp")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 10))
    model = model.to(torch.bfloat16)
    sd = model.state_dict()
    with tensorwire.Client(s.url) as c:
        r = c.send(sd)
        assert r.received == len(sd)
        for name, t in sd.items():
            assert same_bits(c.fetch(name), t), name
        many = c.fetch_many(list(sd))
        assert list(many) == list(sd)
        restored = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 10))
        restored.to(torch.bfloat16).load_state_dict(many)
        out = torch.empty_like(sd["0.weight"])
        assert c.fetch_into("0.weight", out) is out and same_bits(out, sd["0.weight"])
        with pytest.raises(tensorwire.Error, match="INVALID_ARGUMENT|sent"):
            c.fetch_into("0.weight", torch.empty(3))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(16, 24).t(),
        lambda: torch.randn(10, 12)[::3, 1::2],
        lambda: torch.randn(5).expand(4, 5),
        lambda: torch.randn(2, 3, 4).permute(2, 0, 1),
        lambda: torch.randn(6, 6, dtype=torch.complex64).conj(),
        lambda: -torch.randn(6, dtype=torch.complex128).conj().imag,
        lambda: torch.randn(8, 8, dtype=torch.bfloat16)[2:, 3],
    ],
    ids=["transpose", "step-slices", "expand", "permute", "conj", "neg-view", "bf16-column"],
)
def test_non_contiguous_views_sent_correctly(cli_server, make):
    s = cli_server("tcp")
    t = make()
    with tensorwire.Client(s.url) as c:
        c.send({"v": t})
        back = c.fetch("v")
    assert back.is_contiguous()
    assert torch.equal(back, t.resolve_conj().resolve_neg())


def test_names_and_metadata_kept(cli_server):
    s = cli_server("tcp")
    t = tensorwire.with_metadata(torch.arange(10), "counts", step="42", owner="trainer-0")
    with tensorwire.Client(s.url) as c:
        c.send([t])
        back = c.fetch("counts")
    assert tensorwire.name_of(back) == "counts"
    assert tensorwire.metadata_of(back) == {"step": "42", "owner": "trainer-0"}


def test_numpy_arrays_go_in(cli_server):
    s = cli_server("tcp")
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    with tensorwire.Client(s.url) as c:
        c.send({"a": a, "ro": np.frombuffer(b"\x01\x02\x03\x04", dtype=np.uint8)})
        assert np.array_equal(c.fetch("a").numpy(), a)
        assert c.fetch("ro").tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("scheme", ["tcp", "unix", "shm"])
def test_64mib_bfloat16_over_each_local_transport(cli_server, scheme):
    """The acceptance check: 64 MiB of bfloat16 to `tensorwire serve` and back."""
    s = cli_server(scheme)
    t = torch.randn(32, 1024, 1024, dtype=torch.bfloat16)
    with tensorwire.Client(s.url) as c:
        c.send({"big": t})
        back = c.fetch("big")
    assert torch.equal(back, t)


def test_exchange_streams_answers(cli_server):
    s = cli_server("tcp")
    inputs = [torch.full((i + 1,), float(i)) for i in range(5)]
    with tensorwire.Client(s.url) as c:
        outs = list(c.exchange(inputs))
    assert len(outs) == 5 and all(torch.equal(a, b) for a, b in zip(outs, inputs))


def test_received_tensor_storage_is_the_receive_buffer(cli_server):
    """Zero copy on receive: the torch tensor's data lies inside the buffer
    the native side received into, and writing through torch shows in it."""
    s = cli_server("tcp")
    t = torch.randn(256, 1024)
    with tensorwire.Client(s.url) as c:
        c.send({"t": t})
        (r,) = c.native.fetch({"name": "t"})
        back = _convert.to_torch(r)
        assert r.address <= back.data_ptr() < r.address + r.storage_nbytes
        assert back.data_ptr() + back.numel() * back.element_size() <= r.address + r.storage_nbytes
        assert torch.equal(back, t)
        # The public fetch goes through the same conversion.
        again = c.fetch("t")
        assert torch.equal(again, t)


@pytest.mark.parametrize("scheme", ["shm", "unix", "tcp"])
def test_received_tensors_can_be_changed_in_place(cli_server, scheme):
    """On one host a received tensor may be the sender's shared-memory
    segment itself (zero copy): torch's in-place ops write to it. (A
    read-only mapping of it made them a SIGSEGV.) The writes stay on the
    receiving side: the server's stored tensor is unchanged."""
    s = cli_server(scheme)
    t = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: segment-sized
    in_segment = 0
    with tensorwire.Client(s.url) as c:
        c.send({"w": t})
        # The first fetches of a size go through the rings while a segment
        # of that size is made; later ones arrive in it.
        for _ in range(6):
            got = c.fetch("w")
            assert torch.equal(got, t)
            in_segment += _in_peer_segment(got.data_ptr())
            got.add_(1)
            assert torch.equal(got, t + 1)
            got.numpy()[:4] = -1.0
            assert got[:4].tolist() == [-1.0] * 4
    assert in_segment > 0, "no fetch arrived in a shared-memory segment"


def _in_peer_segment(address: int) -> bool:
    """Whether `address` lies in a mapping of a tensorwire shared-memory
    segment (a memfd named "tensorwire"; the rings are "tensorwire-ring")."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == "/memfd:tensorwire":
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= address < hi:
                    return True
    return False


RSS_PROBE = textwrap.dedent(
    """
    import resource, sys, torch, tensorwire
    url, mode = sys.argv[1], sys.argv[2]
    MiB = 1 << 20
    size = 256 * MiB
    def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with tensorwire.Client(url) as c:
        c.send({"warm": torch.ones(1024)}); c.fetch("warm")
        if mode == "send":
            t = torch.ones(size // 4)
            before = peak()
            c.send({"big": t})
        else:
            c.send({"big": torch.ones(size // 4)})
            import gc; gc.collect()
            before = peak()
            t = c.fetch("big")
            assert t.sum().item() == size // 4
        print((peak() - before) / MiB)
    """
)


@pytest.mark.parametrize("mode", ["send", "fetch"])
def test_no_extra_copy_in_memory(cli_server, mode):
    """Zero copy shown by memory: sending a 256 MiB tensor raises the peak
    RSS far less than a copy would (256 MiB), and fetching one raises it by
    about the tensor itself, not twice that."""
    s = cli_server("tcp")
    # TCP proper: a same-host client would otherwise upgrade to shared
    # memory, whose segments (a copy by design) count in its RSS.
    url = s.url if "?" in s.url else s.url + "?shm=0"
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, url, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grew_mib = float(out.stdout.strip().splitlines()[-1])
    if mode == "send":
        assert grew_mib < 64, f"sending 256 MiB grew the peak RSS by {grew_mib:.0f} MiB"
    else:
        assert grew_mib < 256 + 64, f"fetching 256 MiB grew the peak RSS by {grew_mib:.0f} MiB"


def test_cuda_tensor_is_a_clear_error_without_cuda(cli_server):
    s = cli_server("tcp")
    meta = torch.empty(4, device="meta")
    with tensorwire.Client(s.url) as c:
        with pytest.raises(tensorwire.Error, match="device meta"):
            c.send({"m": meta})
        if torch.cuda.is_available():
            with pytest.raises(tensorwire.Error, match="CUDA"):
                c.send({"g": torch.ones(4, device="cuda")})


def test_unknown_dtype_is_refused(cli_server):
    s = cli_server("tcp")
    if not hasattr(torch, "float8_e4m3fnuz"):
        pytest.skip("this torch has no float8_e4m3fnuz")
    with tensorwire.Client(s.url) as c:
        with pytest.raises(tensorwire.Error, match="cannot carry"):
            c.send({"x": torch.zeros(2, dtype=torch.float8_e4m3fnuz)})


def test_help_is_useful():
    doc = tensorwire.Client.__doc__ or ""
    assert "tcp://" in doc and "timeout" in doc
    assert (tensorwire.Client.call.__doc__ or "").count("add_numbers") == 1
    assert os.path.exists(os.path.join(os.path.dirname(tensorwire.__file__), "py.typed"))


def test_tune_allocator_then_round_trip(cli_server):
    """`tune_allocator()` (process-wide, so in a process of its own) takes on
    glibc, and transfers work after it."""
    import platform

    s = cli_server("tcp")
    code = textwrap.dedent(
        f"""
        import torch, tensorwire
        print(tensorwire.tune_allocator())
        t = torch.arange(1 << 20, dtype=torch.float32)
        with tensorwire.Client({s.url!r}) as c:
            c.send({{"big": t}})
            assert torch.equal(c.fetch("big"), t)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    assert out.stdout.strip() == str(glibc)
