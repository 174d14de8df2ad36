#!/usr/bin/env python3
"""tensorwire from Python vs the seed's approach, in one run, same host.

The seed (shared/seeds/000_*): grpcio + torch.save() in 1 MiB chunks, its
asyncio server in its own process (benches/seed_grpc.py). tensorwire: the
`tensorwire` Python package, a `tensorwire.Server` (store handlers, all
Rust) in its own process, over tcp, unix and shm. For each: --size bytes
(default 256 MiB) client->server (send) and server->client (fetch), --reps
times, GiB/s; then a 4 KiB call round trip, p50 latency and calls/s, against
the seed's way to call a function over gRPC (a unary grpcio call carrying a
torch.save'd tensor, answered by a Python handler that loads, runs and
saves it) — tensorwire's call runs a Python handler too.

    python benches/python_vs_seed.py [--size 256M] [--reps 3] [--calls 2000]

Needs the package built with --release (`maturin develop --release -m
python/Cargo.toml`), torch and grpcio (tests/run.sh installs them).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seed_grpc  # noqa: E402  (the seed's chunking, assembler and server)

GiB = 1 << 30
THREADS = 8


def tw_serve(urls: List[str], q) -> None:
    """A tensorwire server with Python handlers, in its own process."""
    import tensorwire

    s = tensorwire.Server(listen=urls, workers=2)

    @s.function("echo")
    def echo(x):
        return x

    q.put(s.start())
    s.serve_forever()


def seed_call_serve(q) -> None:
    """The seed's function call over gRPC: a unary method whose request and
    reply are torch.save'd tensors, handled in Python."""
    from concurrent import futures

    import grpc
    import torch

    def call(req: bytes, ctx) -> bytes:
        x = torch.load(io.BytesIO(req), weights_only=True)
        buf = io.BytesIO()
        torch.save(x, buf)
        return buf.getvalue()

    handler = grpc.method_handlers_generic_handler(
        "seed.Functions", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    q.put(port)
    server.wait_for_termination()


def gibs(size: int, reps: int, fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return size * reps / (time.perf_counter() - start) / GiB


WARMUP = 2


def measure(size: int, reps: int, fn: Callable[[], None]) -> Dict[str, float]:
    """GiB/s of the very first transfer ("cold": a receiver's first buffers
    fault in at ~1 GiB/s on these VMs, a figure about page faults, printed
    as an extra column) and of `reps` transfers after WARMUP more, when the
    receiver's recycled buffers are warm (the steady state of a server or a
    training loop, and the figure the ratios use)."""
    cold = gibs(size, 1, fn)
    for _ in range(WARMUP):
        fn()
    return {"cold": cold, "warm": gibs(size, reps, fn)}


def latencies(n: int, fn: Callable[[], None]) -> List[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def concurrent_rate(n: int, fn: Callable[[], None]) -> float:
    per = n // THREADS

    def work() -> None:
        for _ in range(per):
            fn()

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return per * THREADS / (time.perf_counter() - t0)


def variants(urls: List[str]) -> List[tuple]:
    """(label, url) per row: a same-host tcp client moves bulk data through
    shared memory (the server offers the upgrade), so tcp is measured both
    ways — `?shm=0` keeps it on the socket."""
    out = []
    for url in urls:
        scheme = url.split(":", 1)[0]
        if scheme == "tcp":
            out.append(("tcp", url + ("&" if "?" in url else "?") + "shm=0"))
            out.append(("tcp+shm", url))
        else:
            out.append((scheme, url))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256M", help="tensor size (K, M, G suffixes)")
    ap.add_argument("--reps", type=int, default=3, help="transfers per direction")
    ap.add_argument("--calls", type=int, default=2000, help="calls for the latency figures")
    a = ap.parse_args()
    size = seed_grpc.parse_size(a.size)

    seed_grpc.generate()
    import grpc
    import torch
    from skytorch.torch import service_pb2 as pb, service_pb2_grpc as pbg

    import tensorwire

    ctx = mp.get_context("spawn")
    procs = []
    rows: Dict[str, Dict[str, float]] = {}
    try:
        # --- the seed: bulk ---------------------------------------------------
        q = ctx.Queue()
        procs.append(ctx.Process(target=seed_grpc.serve, args=(q,), daemon=True))
        procs[-1].start()
        port = q.get(timeout=120)
        t = torch.zeros(size, dtype=torch.uint8)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.ServiceStub(ch)
            stub.ReceiveTensors(seed_grpc.chunks_of(torch.zeros(1 << 20, dtype=torch.uint8), pb))

            def seed_send() -> None:
                assert stub.ReceiveTensors(seed_grpc.chunks_of(t, pb)).received_count == 1

            def seed_fetch() -> None:
                asm, got = seed_grpc.Assembler(), None
                for c in stub.SendTensors(pb.TensorRequest(count=1, parameters={"shape": str(size)})):
                    got = asm.add(c) if got is None else got
                assert got is not None and got.numel() == size

            ms, mf = measure(size, a.reps, seed_send), measure(size, a.reps, seed_fetch)
            rows["seed grpc+torch.save"] = {"send": ms["warm"], "fetch": mf["warm"],
                                            "send_cold": ms["cold"], "fetch_cold": mf["cold"]}
        print(f"seed   grpcio + torch.save   send {rows['seed grpc+torch.save']['send']:7.3f} GiB/s"
              f"  fetch {rows['seed grpc+torch.save']['fetch']:7.3f} GiB/s", flush=True)

        # --- tensorwire from Python: bulk ------------------------------------
        sock_dir = tempfile.mkdtemp(prefix="tw-bench-")
        listen = ["tcp://127.0.0.1:0", f"unix://{sock_dir}/tw.sock", f"shm://twbench-{uuid.uuid4().hex[:10]}"]
        q = ctx.Queue()
        procs.append(ctx.Process(target=tw_serve, args=(listen, q), daemon=True))
        procs[-1].start()
        urls = variants(q.get(timeout=120))
        x = torch.randn(size // 4)
        for scheme, url in urls:
            with tensorwire.Client(url) as c:

                def send_once() -> None:
                    assert c.send({"x": x}).received == 1

                def fetch_once() -> None:
                    assert c.fetch("x").numel() == x.numel()

                ms, mf = measure(size, a.reps, send_once), measure(size, a.reps, fetch_once)
                send, fetch = ms["warm"], mf["warm"]
            rows[f"tensorwire {scheme}"] = {"send": send, "fetch": fetch, "send_cold": ms["cold"], "fetch_cold": mf["cold"]}
            print(f"tensorwire {scheme:<8}          send {send:7.3f} GiB/s  fetch {fetch:7.3f} GiB/s", flush=True)

        # --- calls: 4 KiB round trip -----------------------------------------
        q = ctx.Queue()
        procs.append(ctx.Process(target=seed_call_serve, args=(q,), daemon=True))
        procs[-1].start()
        call_port = q.get(timeout=120)
        small = torch.randn(1024)  # 4 KiB
        calls: Dict[str, Dict[str, float]] = {}
        with grpc.insecure_channel(f"127.0.0.1:{call_port}") as ch:
            rpc = ch.unary_unary("/seed.Functions/Call")

            def seed_call() -> None:
                buf = io.BytesIO()
                torch.save(small, buf)
                y = torch.load(io.BytesIO(rpc(buf.getvalue())), weights_only=True)
                assert y.numel() == 1024

            latencies(100, seed_call)
            lat = latencies(a.calls, seed_call)
            calls["seed grpc unary"] = {"p50_us": statistics.median(lat) * 1e6, "seq": len(lat) / sum(lat),
                                        "conc": concurrent_rate(a.calls, seed_call)}
        for scheme, url in urls:
            with tensorwire.Client(url) as c:

                def tw_call() -> None:
                    assert c.call("echo", small).numel() == 1024

                latencies(100, tw_call)
                lat = latencies(a.calls, tw_call)
                calls[f"tensorwire {scheme}"] = {"p50_us": statistics.median(lat) * 1e6, "seq": len(lat) / sum(lat),
                                                 "conc": concurrent_rate(a.calls, tw_call)}
    finally:
        for p in procs:
            p.terminate()

    base = rows["seed grpc+torch.save"]
    print(f"\n== {seed_grpc.human(size)} tensors, {a.reps} reps per direction after {WARMUP + 1} warm-up, same host, same run")
    print(f"{'':26} {'send GiB/s':>11} {'x seed':>7} {'fetch GiB/s':>12} {'x seed':>7}"
          f" | {'extra: 1st send':>15} {'1st fetch':>10} (cold receive buffers)")
    for name, r in rows.items():
        print(f"{name:26} {r['send']:11.3f} {r['send'] / base['send']:7.1f} {r['fetch']:12.3f} {r['fetch'] / base['fetch']:7.1f}"
              f" | {r['send_cold']:15.3f} {r['fetch_cold']:10.3f}")
    cb = calls["seed grpc unary"]
    print(f"\n== 4 KiB call round trip ({a.calls} sequential calls; concurrent: {THREADS} threads)")
    print(f"{'':26} {'p50 us':>9} {'calls/s':>9} {'x seed':>7} {'conc calls/s':>13} {'x seed':>7}")
    for name, r in calls.items():
        print(f"{name:26} {r['p50_us']:9.1f} {r['seq']:9.0f} {r['seq'] / cb['seq']:7.1f} {r['conc']:13.0f}"
              f" {r['conc'] / cb['conc']:7.1f}")
    print("\ntargets: >= 10x the seed over shm/unix, >= 4x over tcp (both directions)")
    for name, need in [("tensorwire shm", 10), ("tensorwire unix", 10), ("tensorwire tcp", 4), ("tensorwire tcp+shm", 4)]:
        r = rows[name]
        worst = min(r["send"] / base["send"], r["fetch"] / base["fetch"])
        print(f"  {name:18} worst direction {worst:5.1f}x  {'met' if worst >= need else 'NOT met'} (>= {need}x)")


if __name__ == "__main__":
    main()
