"""Python `tensorwire.Server`s: functions with tensors and plain values,
batching, tasks, streaming handlers, errors reaching the caller, Ctrl-C
during a long transfer, and Python servers called by the Rust CLI and by a
Rust client program."""

from __future__ import annotations

import _thread
import asyncio
import itertools
import json
import queue
import subprocess
import threading
import time
from typing import Iterator, List

import pytest
import torch

import tensorwire
from conftest import binary


@pytest.fixture
def server() -> Iterator[tensorwire.Server]:
    s = tensorwire.Server(listen=["tcp://127.0.0.1:0"])

    @s.function("add_numbers")
    def add(a, b):
        """Adds two numbers."""
        return a + b

    @s.function("scale")
    def scale(x, factor=2.0):
        return x * factor

    @s.function("echo_values")
    def echo_values(*args, **kwargs):
        return {"args": list(args), "kwargs": kwargs}

    @s.function("split")
    def split(x):
        return x[: len(x) // 2], x[len(x) // 2:], len(x)

    @s.function("named")
    def named(x):
        return {"double": x * 2, "neg": -x}

    @s.function("boom")
    def boom(x):
        raise RuntimeError(f"exploded on {x.shape[0]} rows")

    @s.function("missing")
    def missing():
        raise tensorwire.RemoteError("no such thing", code="NOT_FOUND")

    @s.function("slow")
    def slow(seconds):
        time.sleep(seconds)
        return seconds

    yield s
    s.stop(now=True)


def test_function_with_plain_values(server):
    server.start()
    with tensorwire.Client(server.url) as c:
        assert c.call("add_numbers", 10, 20) == 30
        assert c.call("add_numbers", 1.5, b=2.25) == 3.75
        assert c.call("add_numbers", "ab", "cd") == "abcd"
        assert c.call("add_numbers", [1], [2, 3]) == [1, 2, 3]
        fns = {f["name"]: f for f in c.functions()}
        assert fns["add_numbers"]["doc"] == "Adds two numbers."


def test_values_are_carried_not_pickled(server):
    server.start()
    args = (None, True, -(2**63), 2.5, "naïve", b"\x00\xff", [1, [2, "x"]], {"k": {"n": None}})
    with tensorwire.Client(server.url) as c:
        got = c.call("echo_values", *args, flag=False, blob=b"abc")
        # tuples arrive as lists: values are the RPC layer's, not Python objects.
        assert got == {"args": [None, True, -(2**63), 2.5, "naïve", b"\x00\xff", [1, [2, "x"]], {"k": {"n": None}}],
                       "kwargs": {"flag": False, "blob": b"abc"}}
        with pytest.raises(TypeError, match="cannot send a object as a value|cannot send"):
            c.call("echo_values", object())
        with pytest.raises(TypeError, match="64 bits"):
            c.call("echo_values", 2**70)


def test_function_with_tensors(server):
    server.start()
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with tensorwire.Client(server.url) as c:
        assert torch.equal(c.call("scale", x), x * 2)
        assert torch.equal(c.call("scale", x, factor=0.5), x * 0.5)
        a, b, n = c.call("split", torch.arange(10))
        assert torch.equal(a, torch.arange(5)) and torch.equal(b, torch.arange(5, 10)) and n == 10
        d = c.call("named", torch.ones(3))
        assert set(d) == {"double", "neg"} and torch.equal(d["neg"], -torch.ones(3))


def test_raising_handler_reaches_caller_as_remote_error(server):
    server.start()
    with tensorwire.Client(server.url) as c:
        with pytest.raises(tensorwire.RemoteError) as e:
            c.call("boom", torch.zeros(7, 2))
        assert e.value.code == "INTERNAL"
        assert "RuntimeError: exploded on 7 rows" in str(e.value)
        with pytest.raises(tensorwire.RemoteError) as e:
            c.call("missing")
        assert e.value.code == "NOT_FOUND" and "no such thing" in str(e.value)
        with pytest.raises(tensorwire.RemoteError) as e:
            c.call("no_such_function")
        assert e.value.code == "NOT_FOUND"
        # The connection survives errors.
        assert c.call("add_numbers", 1, 2) == 3


def test_timeout_is_tensorwire_and_builtin_timeout_error(server):
    server.start()
    with tensorwire.Client(server.url, retries=0) as c:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            c.call("slow", 5.0, timeout=0.3)
        assert isinstance(e.value, tensorwire.TimeoutError) and isinstance(e.value, tensorwire.Error)
        assert e.value.code == "DEADLINE_EXCEEDED"
        assert time.monotonic() - t0 < 4.0
    with tensorwire.Client(server.url, timeout=0.3, retries=0) as c:
        with pytest.raises(tensorwire.TimeoutError):
            c.call("slow", 5.0)


def test_connect_error():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(tensorwire.ConnectError) as e:
        tensorwire.Client(f"tcp://127.0.0.1:{port}", retries=0)
    assert isinstance(e.value, ConnectionError) and str(e.value)


def test_batched_function_stacks_concurrent_calls():
    s = tensorwire.Server(listen=["tcp://127.0.0.1:0"])
    sizes: List[int] = []

    @s.function("forward", batch=8, max_wait_ms=20)
    def forward(x):
        sizes.append(x.shape[0])
        return x.sum(dim=1, keepdim=True)

    s.start()
    try:
        with tensorwire.Client(s.url) as c:
            xs = [torch.full((4,), float(i)) for i in range(32)]
            results: List[torch.Tensor] = [torch.empty(0)] * 32

            def run(i: int) -> None:
                results[i] = c.call("forward", xs[i])

            threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for i, r in enumerate(results):
            assert torch.equal(r, torch.tensor([4.0 * i])), i
        assert sum(sizes) == 32 and max(sizes) <= 8
    finally:
        s.stop()


def test_a_batched_function_refuses_to_return_values():
    """Per-caller values cannot be split out of a batch: the caller gets a
    clear error, not a tuple where it returned a dict."""
    s = tensorwire.Server("tcp://127.0.0.1:0")

    @s.function("named", batch=4, max_wait_ms=5)
    def named(x):
        return {"y": x}

    with s, tensorwire.Client(s.url) as c:
        with pytest.raises(tensorwire.RemoteError, match="batched function named returned a value"):
            c.call("named", torch.ones(2))


def test_a_server_restarts_with_its_functions_and_answers_while_starting():
    """Functions stay registered across stop/start; `serving` (which takes
    the GIL) never waits for a start in progress on another thread."""
    s = tensorwire.Server("tcp://127.0.0.1:0")

    @s.function("twice", batch=4, max_wait_ms=5)
    def twice(x):
        return x * 2

    for _ in range(2):
        t = threading.Thread(target=s.start)
        t.start()
        deadline = time.monotonic() + 30
        while not s.serving:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.001)
        t.join()
        with tensorwire.Client(s.url) as c:
            assert torch.equal(c.call("twice", torch.ones(3)), torch.full((3,), 2.0))
        s.stop()


def test_values_that_are_not_plain():
    """A tensor passed as a keyword value is refused (tensors travel
    positionally); numpy's bool scalar travels as a bool."""
    import numpy as np

    s = tensorwire.Server("tcp://127.0.0.1:0")

    @s.function("kind")
    def kind(flag):
        return type(flag).__name__

    with s, tensorwire.Client(s.url) as c:
        assert c.call("kind", flag=np.array([1, 0]).any()) == "bool"
        with pytest.raises(TypeError, match="keyword argument 'flag' is a tensor"):
            c.call("kind", flag=torch.ones(1))


def test_numpy_arrays_torch_cannot_share_are_sent_as_copies(server, tmp_path):
    """Arrays `torch.from_numpy` refuses (reversed, big-endian) and array
    subclasses (np.memmap) are sent as tensors."""
    import numpy as np

    a = np.arange(8, dtype=np.float32)
    with server, tensorwire.Client(server.url) as c:
        for x in (a[::-1], a.astype(">f4")):
            assert torch.equal(c.call("scale", x, factor=1.0), torch.from_numpy(np.ascontiguousarray(x, "=f4")))
        a.tofile(tmp_path / "a.f32")
        m = np.memmap(tmp_path / "a.f32", dtype=np.float32, mode="r", shape=(8,))
        assert torch.equal(c.call("scale", m, factor=1.0), torch.from_numpy(a))


def test_tasks_submit_status_result_cancel(server):
    server.start()
    with tensorwire.Client(server.url) as c:
        tid = c.submit("add_numbers", 2, 3)
        assert c.result(tid, wait=5.0) == 5
        assert c.status(tid) == "done"
        slow = c.submit("slow", 3.0)
        assert c.status(slow) in ("pending", "running")
        assert c.cancel(slow) == "cancelled"
        failing = c.submit("boom", torch.zeros(1))
        deadline = time.monotonic() + 5
        while not c.status(failing).startswith("failed") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "exploded on 1 rows" in c.status(failing)


def test_streaming_handlers():
    s = tensorwire.Server(listen=["tcp://127.0.0.1:0"])
    got = {}

    @s.on_send
    def on_send(name, t):
        got[name] = t.clone()

    @s.on_fetch
    def on_fetch(name, params):
        if name not in got:
            raise KeyError(name)
        return {name: got[name] * int(params.get("times", "1"))}

    @s.on_exchange
    def on_exchange(t):
        return None if t.numel() == 0 else [t + 1, t + 2]

    s.start()
    try:
        with tensorwire.Client(s.url) as c:
            assert c.send({"a": torch.ones(3), "b": torch.zeros(2)}).received == 2
            assert set(got) == {"a", "b"}
            assert torch.equal(c.fetch("a", times=3), torch.full((3,), 3.0))
            with pytest.raises(tensorwire.RemoteError) as e:
                c.fetch("zzz")
            assert e.value.code == "NOT_FOUND" and "zzz" in str(e.value)
            outs = list(c.exchange([torch.zeros(2), torch.empty(0), torch.ones(1)]))
            assert [o.tolist() for o in outs] == [[1.0, 1.0], [2.0, 2.0], [2.0], [3.0]]
    finally:
        s.stop()


def _exchange_server(seen: List[float]) -> tensorwire.Server:
    s = tensorwire.Server(listen=["tcp://127.0.0.1:0?shm=0"])

    @s.on_exchange
    def on_exchange(t):
        seen.append(float(t[0]))
        return t + 1

    s.start()
    return s


def test_exchange_inputs_stream_and_may_wait_for_answers():
    """A generator whose next input depends on the last answer (a training
    loop): the inputs are read as the call goes, not gathered first."""
    seen: List[float] = []
    s = _exchange_server(seen)
    try:
        answers: "queue.Queue[torch.Tensor]" = queue.Queue()

        def inputs():
            x = torch.zeros(4)
            for _ in range(5):
                yield x
                x = answers.get(timeout=10)  # the answer to the last input

        with tensorwire.Client(s.url) as c:
            for a in c.exchange(inputs()):
                answers.put(a)
            assert a.tolist() == [5.0] * 4
        assert seen == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        s.stop()


def test_exchange_input_error_cancels_the_call_and_is_raised():
    """An exception from the inputs is raised to the caller and cancels the
    call: the server never sees a clean end of inputs; an answer loop the
    caller leaves early cancels too; the client keeps working."""
    seen: List[float] = []
    s = _exchange_server(seen)
    try:

        def failing():
            yield torch.zeros(2)
            yield torch.ones(2)
            raise ValueError("the data loader broke")

        with tensorwire.Client(s.url) as c:
            with pytest.raises(ValueError, match="data loader broke"):
                list(c.exchange(failing()))
            # Leaving early: an endless input stream is cancelled.
            endless = (torch.full((2,), float(i)) for i in itertools.count())
            it = c.exchange(endless)
            assert next(it).tolist() == [1.0, 1.0]
            it.close()  # type: ignore[attr-defined]
            # Neither exchange may end as a success. A call counts once the
            # server has read its request, and every info() call below
            # succeeds (its own count included), so successes == info calls.
            # (A reset discards what is still queued, so an exchange cancelled
            # before the server read its request is not a call at all.)
            deadline = time.monotonic() + 10
            infos = 1
            info = c.info()
            while info["active_calls"] > 1 or info["calls"] - info["failures"] != infos:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
                infos += 1
                info = c.info()
            assert info["active_calls"] == 1, repr(info)  # this info call only
            assert info["calls"] - info["failures"] == infos, repr(info)  # no exchange succeeded
            assert info["failures"] >= 1, repr(info)  # the second one reached the server: it answered
            assert [o.tolist() for o in c.exchange([torch.full((1,), 7.0)])] == [[8.0]]
    finally:
        s.stop()


def test_keyboard_interrupt_cancels_a_long_transfer_cleanly():
    """Ctrl-C while a send is stalled by a slow server: the call ends with
    KeyboardInterrupt within a fraction of a second, the server sees the
    call cancelled (its handler stops being fed), and the same client keeps
    working. Over TCP proper (?shm=0): a same-host client would upgrade to
    shared memory, whose sender can run up to 1 GiB ahead of a slow server
    (a known leftover)."""
    s = tensorwire.Server(listen=["tcp://127.0.0.1:0?shm=0"])
    seen: List[str] = []

    @s.on_send
    def slow_sink(name, t):
        seen.append(name)
        time.sleep(0.2)

    @s.function("ping")
    def ping():
        return "pong"

    s.start()
    try:
        with tensorwire.Client(s.url, retries=0) as c:
            tensors = {f"t{i}": torch.ones(4 << 20, dtype=torch.uint8) for i in range(100)}  # 400 MiB, ~20 s
            # Early: the send must still be running (a fast machine moves 400 MiB into
            # the server's receive buffers in well under a second).
            timer = threading.Timer(0.1, _thread.interrupt_main)
            timer.start()
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                c.send(tensors)
            took = time.monotonic() - t0
            assert took < 3.0, took
            time.sleep(0.5)
            n = len(seen)
            time.sleep(0.6)
            assert len(seen) <= n + 1, "the server kept receiving after the cancel"
            assert len(seen) < 100
            assert c.call("ping") == "pong"
            assert c.health()
    finally:
        s.stop(now=True)


def test_python_server_called_by_the_rust_cli(tmp_path):
    s = tensorwire.Server(listen=["tcp://127.0.0.1:0", f"unix://{tmp_path}/py.sock"])

    @s.function("add_numbers")
    def add(a, b):
        return a + b

    @s.function("rowsum")
    def rowsum(x):
        return x.sum(dim=1)

    urls = s.start()
    cli = binary("tensorwire")
    try:
        for url in urls:
            out = subprocess.run([cli, "call", "--to", url, "add_numbers", "--arg", "0=10", "--arg", "1=20", "--json"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert str(json.loads(out.stdout.strip().splitlines()[-1])["values"]) == "30"
        pt = tmp_path / "out.pt"
        out = subprocess.run([cli, "call", "--to", urls[0], "rowsum", "--input", "random:8,16:f32", "--out", str(pt)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        y = torch.load(pt)
        y = y[0] if isinstance(y, list) else y
        assert y.shape == (8,) and y.dtype == torch.float32
        # The default handlers are the store: the CLI sends, Python fetches.
        out = subprocess.run([cli, "send", "--to", urls[1], "--random", "64,32", "--dtype", "bf16", "--name", "w"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        with tensorwire.Client(urls[1]) as c:
            w = c.fetch("w")
        assert w.shape == (64, 32) and w.dtype == torch.bfloat16
        out = subprocess.run([cli, "health", "--to", urls[0]], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "SERVING" in out.stdout
    finally:
        s.stop()


def test_python_server_called_by_a_rust_client_program():
    """examples/client.rs (the Rust library's Client) against a Python server
    that serves its `normalize` function and the store."""
    s = tensorwire.Server(listen=["tcp://127.0.0.1:0"])

    @s.function("normalize")
    def normalize(x):
        return x / x.norm()

    s.start()
    try:
        out = subprocess.run([binary("client"), s.url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "stored x" in out.stdout
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("normalized:"))
        values = [float(v) for v in line.split("[", 1)[1].rstrip("]").split(",")]
        expected = torch.arange(1.0, 7.0) / torch.arange(1.0, 7.0).norm()
        assert torch.allclose(torch.tensor(values), expected)
    finally:
        s.stop()


def test_async_client_on_the_running_loop(server):
    server.start()

    async def main() -> None:
        async with tensorwire.AsyncClient(server.url) as c:
            assert await c.health()
            sums = await asyncio.gather(*(c.call("add_numbers", i, i) for i in range(50)))
            assert sums == [2 * i for i in range(50)]
            x = torch.randn(1000, dtype=torch.bfloat16)
            assert (await c.send({"x": x})).received == 1
            assert torch.equal(await c.fetch("x"), x)
            outs = await c.exchange([torch.ones(2), torch.zeros(1)])
            assert [o.tolist() for o in outs] == [[1.0, 1.0], [0.0]]
            with pytest.raises(tensorwire.RemoteError, match="exploded"):
                await c.call("boom", torch.zeros(1))
            # Cancelling the awaitable cancels the call; the loop stays live.
            slow = asyncio.ensure_future(c.call("slow", 5.0))
            await asyncio.sleep(0.2)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            tid = await c.submit("add_numbers", 4, 5)
            assert await c.result(tid, wait=5.0) == 9
            assert (await c.info())["service_name"] == "tensorwire"
            # The rest of Client's calls.
            await c.send({"y": torch.ones(3)})
            many = await c.fetch_many(["x", "y"])
            assert sorted(many) == ["x", "y"] and torch.equal(many["y"], torch.ones(3))
            assert "add_numbers" in [f["name"] for f in await c.functions()]
            assert c.statistics()["requests"] > 50

    asyncio.run(main())


def test_async_client_options_connection_and_close(server):
    """Options are checked like Client's; concurrent first calls share one
    connection; a closed client raises instead of reconnecting."""
    server.start()
    with pytest.raises(TypeError):
        tensorwire.AsyncClient(server.url, timout=5)  # type: ignore[call-arg]

    async def main() -> None:
        c = tensorwire.AsyncClient(server.url, timeout=10.0)
        assert await asyncio.gather(*(c.call("add_numbers", i, 1) for i in range(8))) == [i + 1 for i in range(8)]
        assert c.statistics()["requests"] == 8, "one connection served every first call"
        c.close()
        with pytest.raises(tensorwire.Error, match="closed"):
            await c.health()

    asyncio.run(main())
