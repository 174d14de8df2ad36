"""``tensorwire.Client`` and ``tensorwire.AsyncClient``."""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, NamedTuple, Optional

from . import _convert as cv
from ._errors import Error
from ._native import NativeAsyncClient, NativeClient, async_in_flight

if TYPE_CHECKING:
    import torch

__all__ = ["Client", "AsyncClient", "SendResult"]


class SendResult(NamedTuple):
    """What the server said about a ``send``."""

    received: int
    """Tensors it received."""
    bytes: int
    """Payload bytes it received."""
    message: str
    """Its message (the store lists the names it stored)."""


def _answers(ex: Any, failed: List[BaseException]) -> Iterator["torch.Tensor"]:
    """The answers of an exchange; the inputs' own exception wins over the
    cancellation it caused (it is recorded before the cancel, so it is
    seen once the answers end)."""
    done = False
    try:
        for r in ex:
            yield cv.to_torch(r)
        done = True
    except Error:
        if failed:
            raise failed[0] from None
        raise
    finally:
        if not done:
            ex.cancel()
    if failed:
        raise failed[0]


_drain_registered = False


def _drain_async_at_exit() -> None:
    """Registers (once) an exit hook that lets async calls finish handing
    their results over: that hand-off takes the GIL from a runtime thread,
    which aborts the process if it happens while the interpreter finalizes.
    The hook runs before finalization, waits (at most 2 s) for the calls
    still running, then yields the GIL briefly so that their hand-offs
    return."""
    global _drain_registered
    if _drain_registered:
        return
    _drain_registered = True

    def drain() -> None:
        deadline = time.monotonic() + 2.0
        while async_in_flight() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.02)

    atexit.register(drain)


def _one(name: str, got: List["torch.Tensor"]) -> "torch.Tensor":
    if len(got) != 1:
        raise Error(f"asked for one tensor named {name!r}, got {len(got)}", "PROTOCOL")
    return got[0]


def _fetch_params(name: Optional[str], names: Optional[Iterable[str]], params: Dict[str, Any]) -> Dict[str, str]:
    p = {k: str(v) for k, v in params.items()}
    if name is not None:
        p["name"] = name
    if names is not None:
        p["names"] = ",".join(names)
    return p


def _copy_into(name: str, got: "torch.Tensor", out: "torch.Tensor") -> "torch.Tensor":
    if tuple(got.shape) != tuple(out.shape) or got.dtype != out.dtype:
        raise Error(
            f"fetch_into({name!r}): the server sent {got.dtype}{list(got.shape)}, out is {out.dtype}{list(out.shape)}",
            "INVALID_ARGUMENT",
        )
    out.copy_(got)
    return out


class Client:
    """A connection to a tensorwire server (blocking calls).

    ``url`` picks the transport: ``tcp://host:port``, ``unix:///path.sock``,
    ``shm://name``, ``quic://host:port``, ``grpc://host:port``. Every call
    releases the GIL while bytes move, so other Python threads keep running,
    and Ctrl-C (``KeyboardInterrupt``) cancels a call in progress cleanly.

    Options:
      timeout: default per-call timeout in seconds (None: no timeout).
      retries: retries of failed connections and idempotent calls
        (default 3, exponential backoff; 0 disables retrying).
      retry_backoff: first retry delay in seconds (default 0.05).
      auth_token: shared-secret token the server may require.
      chunk_size: bytes per chunk on the wire (default 1 MiB).
      compression: ``"auto"`` (default), ``"none"``, ``"lz4"``, ``"zstd"``.
      codec: ``"raw"`` (default), ``"torch"``, ``"safetensors"``.
      coalesce: stack concurrent calls of a batched function (default True).

    Tensors received share memory with the receive buffer (no copy); a
    contiguous CPU tensor is sent from its own memory: do not modify it
    while the call runs. Use it as a context manager or call ``close()``::

        with tensorwire.Client("tcp://127.0.0.1:50051") as c:
            c.send(model.state_dict())
            w = c.fetch("fc.weight")
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: Optional[float] = None,
        retries: Optional[int] = None,
        retry_backoff: Optional[float] = None,
        auth_token: Optional[str] = None,
        chunk_size: Optional[int] = None,
        compression: Optional[str] = None,
        codec: Optional[str] = None,
        coalesce: bool = True,
    ) -> None:
        self._native: Optional[NativeClient] = None
        self._native = NativeClient(
            url, timeout, retries, retry_backoff, auth_token, chunk_size, compression, codec, coalesce
        )
        self.url = url

    @property
    def native(self) -> NativeClient:
        """The native client (raises if closed)."""
        if self._native is None:
            raise Error(f"client for {self.url} is closed", "FAILED_PRECONDITION")
        return self._native

    def close(self) -> None:
        """Closes the connection. Idempotent."""
        if self._native is not None:
            self._native.close()
            self._native = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"tensorwire.Client({self.url!r}{'' if self._native else ', closed'})"

    # --- tensors -------------------------------------------------------------

    def send(self, tensors: Any) -> SendResult:
        """Streams tensors to the server: one tensor, a ``{name: tensor}``
        mapping (a state dict), or an iterable of tensors or
        ``(name, tensor)`` pairs. Names, dtypes, shapes and metadata
        (:func:`tensorwire.with_metadata`) are kept."""
        return SendResult(*self.native.send(cv.describe_all(tensors)))

    def fetch(self, name: str, **params: Any) -> "torch.Tensor":
        """Fetches the tensor named ``name``; extra keyword parameters are
        passed to the server's fetch handler as strings."""
        return _one(name, cv.to_torch_all(self.native.fetch(_fetch_params(name, None, params))))

    def fetch_many(self, names: Optional[Iterable[str]] = None, **params: Any) -> Dict[str, "torch.Tensor"]:
        """Fetches several tensors by name (all the store holds when
        ``names`` is None and no parameters are given): ``{name: tensor}``."""
        if names is None and not params:
            params = {"all": "1"}
        got = cv.to_torch_all(self.native.fetch(_fetch_params(None, names, params)))
        return {cv.name_of(t) or str(i): t for i, t in enumerate(got)}

    def fetch_into(self, name: str, out: "torch.Tensor") -> "torch.Tensor":
        """Fetches ``name`` into the existing tensor ``out`` (same dtype and
        shape; one copy from the receive buffer); returns ``out``."""
        return _copy_into(name, self.fetch(name), out)

    def exchange(self, tensors: Iterable[Any]) -> Iterator["torch.Tensor"]:
        """Bidirectional stream: sends the tensors of ``tensors`` while the
        server's exchange handler answers; yields the answers as they come.

        ``tensors`` (tensors or ``(name, tensor)`` pairs; a generator is
        fine) is read on a thread of its own as the call goes — at most two
        inputs ahead of the sender — so a generator may wait for an earlier
        answer (a training loop feeding its next batch). An exception from
        ``tensors`` cancels the call (the server sees it cancelled, not a
        clean end) and is raised here; closing the returned iterator early
        cancels the call too."""
        ex = self.native.exchange()
        failed: List[BaseException] = []

        def feed() -> None:
            try:
                for d in cv.describe_each(tensors):
                    if not ex.push(d):
                        return  # the call ended: its answers say why
            except BaseException as e:  # noqa: BLE001 - re-raised by the reader
                failed.append(e)
                ex.cancel()
                return
            ex.finish()

        threading.Thread(target=feed, name="tensorwire-exchange-inputs", daemon=True).start()
        return _answers(ex, failed)

    # --- functions -----------------------------------------------------------

    def call(self, function: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """Calls a server function. Tensor arguments travel as tensors, plain
        values (int, float, bool, str, bytes, None, lists/tuples/dicts of
        them) as the RPC layer's values — never pickled. Returns a tensor, a
        tuple of tensors, a ``{name: tensor}`` dict, or the plain value::

            client.call("add_numbers", 10, 20)   # 30
            client.call("forward", x, scale=0.5) # a tensor
        """
        inputs, values = cv.split_args(args, kwargs)
        received, value = self.native.call(function, inputs, values, timeout)
        return cv.decode_result(received, value)

    def submit(self, function: str, *args: Any, **kwargs: Any) -> str:
        """Starts ``function`` as a background task; returns its id."""
        inputs, values = cv.split_args(args, kwargs)
        return self.native.submit(function, inputs, values)

    def status(self, task_id: str) -> str:
        """A task's state: ``pending``, ``running``, ``done``,
        ``cancelled`` or ``failed: <why>``."""
        return self.native.status(task_id)

    def result(self, task_id: str, wait: float = 0.0) -> Any:
        """A finished task's result (as :meth:`call` returns it), waiting up
        to ``wait`` seconds for it."""
        received, value = self.native.result(task_id, wait)
        return cv.decode_result(received, value)

    def cancel(self, task_id: str) -> str:
        """Cancels a task; returns its state afterwards."""
        return self.native.cancel(task_id)

    # --- control -------------------------------------------------------------

    def health(self) -> bool:
        """True while the server is serving."""
        return self.native.health()

    def info(self) -> Dict[str, Any]:
        """The server's name, version, transports, codecs, devices, uptime and totals."""
        return self.native.info()

    def functions(self) -> List[Dict[str, Any]]:
        """The server's functions (name, doc, max_batch, is_async)."""
        return self.native.functions()

    def statistics(self) -> Dict[str, Any]:
        """This client's counters and latencies."""
        return self.native.statistics()


class AsyncClient:
    """The asyncio twin of :class:`Client`: every call is an awaitable of
    the running event loop (no thread per call); cancelling it cancels the
    call. Same options as :class:`Client`::

        async with tensorwire.AsyncClient("tcp://127.0.0.1:50051") as c:
            await c.send({"x": x})
            y = await c.call("forward", x)
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: Optional[float] = None,
        retries: Optional[int] = None,
        retry_backoff: Optional[float] = None,
        auth_token: Optional[str] = None,
        chunk_size: Optional[int] = None,
        compression: Optional[str] = None,
        codec: Optional[str] = None,
        coalesce: bool = True,
    ) -> None:
        self.url = url
        self._options = (timeout, retries, retry_backoff, auth_token, chunk_size, compression, codec, coalesce)
        self._native: Optional[NativeAsyncClient] = None
        self._closed = False
        # Concurrent first calls share one connection.
        self._connecting = asyncio.Lock()

    @classmethod
    async def connect(cls, url: str, **options: Any) -> "AsyncClient":
        """Connects and returns the client (options as for the constructor)."""
        c = cls(url, **options)
        await c._connect()
        return c

    async def _connect(self) -> NativeAsyncClient:
        if self._closed:
            raise Error(f"client for {self.url} is closed", "FAILED_PRECONDITION")
        if self._native is None:
            async with self._connecting:
                if self._native is None and not self._closed:
                    _drain_async_at_exit()
                    self._native = await NativeAsyncClient.connect(self.url, *self._options)
        if self._native is None:
            raise Error(f"client for {self.url} is closed", "FAILED_PRECONDITION")
        return self._native

    async def __aenter__(self) -> "AsyncClient":
        await self._connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the connection; later calls raise. Idempotent."""
        self._closed = True
        if self._native is not None:
            self._native.close()
            self._native = None

    async def send(self, tensors: Any) -> SendResult:
        """See :meth:`Client.send`."""
        n = await self._connect()
        return SendResult(*(await n.send(cv.describe_all(tensors))))

    async def fetch(self, name: str, **params: Any) -> "torch.Tensor":
        """See :meth:`Client.fetch`."""
        n = await self._connect()
        return _one(name, cv.to_torch_all(await n.fetch(_fetch_params(name, None, params))))

    async def fetch_many(self, names: Optional[Iterable[str]] = None, **params: Any) -> Dict[str, "torch.Tensor"]:
        """See :meth:`Client.fetch_many`."""
        if names is None and not params:
            params = {"all": "1"}
        n = await self._connect()
        got = cv.to_torch_all(await n.fetch(_fetch_params(None, names, params)))
        return {cv.name_of(t) or str(i): t for i, t in enumerate(got)}

    async def fetch_into(self, name: str, out: "torch.Tensor") -> "torch.Tensor":
        """See :meth:`Client.fetch_into`."""
        return _copy_into(name, await self.fetch(name), out)

    async def exchange(self, tensors: Iterable[Any]) -> List["torch.Tensor"]:
        """Sends every tensor and returns all the answers (see :meth:`Client.exchange`)."""
        n = await self._connect()
        return cv.to_torch_all(await n.exchange(cv.describe_all(tensors)))

    async def call(self, function: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """See :meth:`Client.call`."""
        n = await self._connect()
        inputs, values = cv.split_args(args, kwargs)
        received, value = await n.call(function, inputs, values, timeout)
        return cv.decode_result(received, value)

    async def submit(self, function: str, *args: Any, **kwargs: Any) -> str:
        """See :meth:`Client.submit`."""
        n = await self._connect()
        inputs, values = cv.split_args(args, kwargs)
        return await n.submit(function, inputs, values)

    async def status(self, task_id: str) -> str:
        """See :meth:`Client.status`."""
        return await (await self._connect()).status(task_id)

    async def result(self, task_id: str, wait: float = 0.0) -> Any:
        """See :meth:`Client.result`."""
        received, value = await (await self._connect()).result(task_id, wait)
        return cv.decode_result(received, value)

    async def cancel(self, task_id: str) -> str:
        """See :meth:`Client.cancel`."""
        return await (await self._connect()).cancel(task_id)

    async def health(self) -> bool:
        """See :meth:`Client.health`."""
        return await (await self._connect()).health()

    async def info(self) -> Dict[str, Any]:
        """See :meth:`Client.info`."""
        return await (await self._connect()).info()

    async def functions(self) -> List[Dict[str, Any]]:
        """See :meth:`Client.functions`."""
        return await (await self._connect()).functions()

    def statistics(self) -> Dict[str, Any]:
        """See :meth:`Client.statistics` (empty before the first call connects)."""
        return self._native.statistics() if self._native is not None else {}
