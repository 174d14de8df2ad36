#!/usr/bin/env python3
"""The seed's approach, measured: Python grpcio + torch.save() in 1 MiB chunks.

A skytorch-protocol server (grpc.aio, like shared/seeds/000_*.txt) runs in
its own process; a client in this process moves one tensor of --size bytes
client->server (ReceiveTensors) and server->client (SendTensors), --reps
times each, and prints GiB/s. The server serves a cached tensor, so neither
direction pays for generating data.

With --tensorwire BIN it then runs `BIN bench --transports grpc --json` on
the same sizes and prints tensorwire's figures and the ratio to the seed.

    python benches/seed_grpc.py --size 256M --tensorwire target/release/tensorwire

Needs torch and grpcio-tools (tests/run.sh installs them into
~/.cache/tensorwire/venv).
"""

import argparse
import asyncio
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import uuid

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = 1 << 20


def generate():
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="tw-seed-pb-")
    args = ["protoc", f"-I{os.path.join(ROOT, 'proto')}", f"--python_out={out}", f"--grpc_python_out={out}",
            "skytorch/torch/service.proto"]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for d in ["skytorch", "skytorch/torch"]:
        open(os.path.join(out, d, "__init__.py"), "a").close()
    sys.path.insert(0, out)


def chunks_of(tensor, pb):
    """The seed's serialize_tensor_to_chunks."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor, buf)
    data = buf.getvalue()
    tid = str(uuid.uuid4())
    n = max(1, (len(data) + CHUNK - 1) // CHUNK)
    for i in range(n):
        meta = {}
        if i == 0:
            meta = {"shape": str(list(tensor.shape)), "dtype": str(tensor.dtype), "device": str(tensor.device),
                    "size_bytes": str(len(data))}
        yield pb.TensorChunk(tensor_id=tid, chunk_number=i, data=data[i * CHUNK:(i + 1) * CHUNK], total_chunks=n,
                             is_last=i == n - 1, metadata=meta)


class Assembler:
    """The seed's TensorAssembler."""

    def __init__(self):
        self.parts = {}

    def add(self, c):
        import torch

        d = self.parts.setdefault(c.tensor_id, {})
        d[c.chunk_number] = c.data
        if len(d) == c.total_chunks:
            data = b"".join(d[i] for i in range(c.total_chunks))
            del self.parts[c.tensor_id]
            return torch.load(io.BytesIO(data), weights_only=True)
        return None


def serve(port_q):
    generate()
    import torch
    from skytorch.torch import service_pb2 as pb, service_pb2_grpc as pbg

    cache = {}

    class Servicer(pbg.ServiceServicer):
        async def ReceiveTensors(self, it, context):
            asm, n = Assembler(), 0
            async for c in it:
                if asm.add(c) is not None:
                    n += 1
            return pb.TensorResponse(success=True, message=f"Received {n} tensors", received_count=n)

        async def SendTensors(self, request, context):
            shape = tuple(int(s) for s in request.parameters["shape"].split(","))
            t = cache.setdefault(shape, torch.zeros(shape, dtype=torch.uint8))
            for _ in range(request.count):
                for c in chunks_of(t, pb):
                    yield c

        async def StreamTensors(self, it, context):
            asm = Assembler()
            async for c in it:
                t = asm.add(c)
                if t is not None:
                    for out in chunks_of(t, pb):
                        yield out

    async def main():
        server = grpc.aio.server()
        pbg.add_ServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def parse_size(s):
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mul > 1 else s) * mul


def human(n):
    for unit, m in [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]:
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return f"{n}B"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256M", help="tensor sizes, comma-separated (K, M, G suffixes)")
    ap.add_argument("--reps", type=int, default=3, help="transfers per direction and size")
    ap.add_argument("--tensorwire", help="path of the tensorwire binary to compare with (same sizes)")
    a = ap.parse_args()

    generate()
    import torch
    from skytorch.torch import service_pb2 as pb, service_pb2_grpc as pbg

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=serve, args=(q,), daemon=True)
    proc.start()
    port = q.get(timeout=120)
    sizes = [parse_size(s) for s in a.size.split(",")]
    seed = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.ServiceStub(ch)
            for size in sizes:
                t = torch.zeros(size, dtype=torch.uint8)
                stub.ReceiveTensors(chunks_of(torch.zeros(1 << 20, dtype=torch.uint8), pb))  # warm up
                start = time.perf_counter()
                for _ in range(a.reps):
                    r = stub.ReceiveTensors(chunks_of(t, pb))
                    assert r.received_count == 1
                send = size * a.reps / (time.perf_counter() - start) / (1 << 30)
                start = time.perf_counter()
                for _ in range(a.reps):
                    asm, got = Assembler(), None
                    for c in stub.SendTensors(pb.TensorRequest(count=1, parameters={"shape": str(size)})):
                        got = asm.add(c) if got is None else got
                    assert got is not None and got.numel() == size
                fetch = size * a.reps / (time.perf_counter() - start) / (1 << 30)
                seed[size] = {"send": send, "fetch": fetch}
                print(f"seed (python grpcio + torch.save, 1 MiB chunks)  {human(size):>7}  send {send:6.3f} GiB/s"
                      f"  fetch {fetch:6.3f} GiB/s", flush=True)
    finally:
        proc.terminate()
    if not a.tensorwire:
        return
    out = subprocess.run([a.tensorwire, "bench", "--transports", "grpc", "--sizes", a.size, "--json",
                          "--batch-examples", "0", "--stripes", "1", "--log-level", "warn"],
                         check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        row = json.loads(line)
        if "direction" not in row or row["size"] not in seed:
            continue
        s = seed[row["size"]][row["direction"]]
        print(f"tensorwire grpc {row['direction']:<5} {human(row['size']):>7}  {row['gib_per_s']:6.3f} GiB/s"
              f"  = {row['gib_per_s'] / s:5.1f}x the seed  ({row['ratio']:.2f}x raw TCP)", flush=True)


if __name__ == "__main__":
    main()
