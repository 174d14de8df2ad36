"""``tensorwire.Server``: serve Python functions and tensor handlers."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, TypeVar, Union

from . import _convert as cv
from ._native import NativeServer, Received

if TYPE_CHECKING:
    import torch

__all__ = ["Server"]

F = TypeVar("F", bound=Callable[..., Any])


def _tensors_out(result: Any) -> List[cv.Description]:
    """A streaming handler's answer: None, a tensor, a ``{name: tensor}``
    mapping or an iterable of tensors / ``(name, tensor)`` pairs."""
    if result is None:
        return []
    return cv.describe_all(result)


class Server:
    """A tensorwire server whose handlers are Python functions.

    Bytes move on the server's own threads without the GIL; a handler takes
    the GIL only while it runs. Without handlers it behaves like
    ``tensorwire serve``: ``send`` stores tensors by name, ``fetch`` returns
    them, ``exchange`` echoes::

        server = tensorwire.Server(listen=["tcp://0.0.0.0:50051", "unix:///tmp/tw.sock"])

        @server.function("add_numbers")
        def add(a: int, b: int) -> int:
            return a + b

        @server.function("forward", batch=8)
        def forward(x: torch.Tensor) -> torch.Tensor:   # x stacked: [<=8, ...]
            return model(x)

        server.serve_forever()

    Handlers:
      ``@server.function(name, batch=None, max_wait_ms=None, doc=None)``:
        called with the call's tensors and values in their positional order
        and its keyword values; returns a tensor, a tuple of tensors
        (optionally ending with one plain value), a ``{name: tensor}`` dict
        or a plain value. With ``batch=N``, concurrent calls are stacked
        along a new leading dimension (at most N) and the outputs split back.
      ``@server.on_send``: ``handler(name, tensor)`` per tensor sent.
      ``@server.on_fetch``: ``handler(name, params) -> tensor(s)``.
      ``@server.on_exchange``: ``handler(tensor) -> tensor(s) or None`` per tensor.

    An exception in a handler reaches the caller as
    :class:`tensorwire.RemoteError` with its type and message.
    """

    def __init__(
        self,
        listen: Union[str, Sequence[str]] = ("tcp://127.0.0.1:0",),
        *,
        service_name: Optional[str] = None,
        auth_token: Optional[str] = None,
        max_store_bytes: Optional[int] = None,
        workers: int = 2,
    ) -> None:
        # One URL may be given as a plain string.
        self.listen = [listen] if isinstance(listen, str) else list(listen)
        self._opts: Dict[str, Any] = dict(
            service_name=service_name, auth_token=auth_token, max_store_bytes=max_store_bytes, workers=workers
        )
        self._native = NativeServer()
        self._handlers: Dict[str, Optional[Callable[..., Any]]] = {"on_send": None, "on_fetch": None, "on_exchange": None}
        self._stopped = threading.Event()

    # --- registration --------------------------------------------------------

    def function(
        self, name: Optional[str] = None, *, batch: Optional[int] = None, max_wait_ms: Optional[float] = None,
        doc: Optional[str] = None,
    ) -> Callable[[F], F]:
        """Decorator: serves the function under ``name`` (default: its ``__name__``)."""

        def register(fn: F) -> F:
            def dispatch(received: List[Received], values: Dict[str, Any]) -> Any:
                args, kwargs = cv.join_args(cv.to_torch_all(received), values)
                return cv.encode_result(fn(*args, **kwargs))

            text = doc if doc is not None else (fn.__doc__ or "").strip().split("\n")[0]
            self._native.add_function(name or fn.__name__, dispatch, batch, max_wait_ms, text)
            return fn

        return register

    def on_send(self, fn: Callable[[Optional[str], "torch.Tensor"], Any]) -> Callable[[Optional[str], "torch.Tensor"], Any]:
        """Decorator: ``fn(name, tensor)`` runs for each tensor a client sends."""

        def handler(r: Received) -> None:
            t = cv.to_torch(r)
            fn(cv.name_of(t), t)

        self._handlers["on_send"] = handler
        return fn

    def on_fetch(self, fn: Callable[[Optional[str], Dict[str, str]], Any]) -> Callable[[Optional[str], Dict[str, str]], Any]:
        """Decorator: ``fn(name, params)`` answers a fetch with tensor(s)."""

        def handler(params: Dict[str, str]) -> List[cv.Description]:
            return _tensors_out(fn(params.get("name"), params))

        self._handlers["on_fetch"] = handler
        return fn

    def on_exchange(self, fn: Callable[["torch.Tensor"], Any]) -> Callable[["torch.Tensor"], Any]:
        """Decorator: ``fn(tensor)`` answers each exchanged tensor with tensor(s) or None."""

        def handler(r: Received) -> List[cv.Description]:
            return _tensors_out(fn(cv.to_torch(r)))

        self._handlers["on_exchange"] = handler
        return fn

    # --- running -------------------------------------------------------------

    def start(self) -> List[str]:
        """Starts serving in the background; returns the bound URLs (port 0
        becomes the real port). Functions and handlers must be registered first."""
        self._native.set_handlers(**self._handlers)
        self._stopped.clear()
        return self._native.start(self.listen, **self._opts)

    @property
    def urls(self) -> List[str]:
        """The URLs the server listens on (after ``start``)."""
        return self._native.urls

    @property
    def url(self) -> str:
        """The first URL (after ``start``)."""
        return self._native.urls[0]

    @property
    def serving(self) -> bool:
        """True between ``start`` and ``stop``."""
        return self._native.serving

    def info(self) -> Dict[str, Any]:
        """Name, version, transports, uptime and totals of the running server."""
        return self._native.info()

    def stop(self, now: bool = False) -> None:
        """Stops: waits for calls in flight (up to the grace period) unless ``now``."""
        self._native.stop(now)
        self._stopped.set()

    def serve_forever(self) -> None:
        """Starts (if needed) and serves until ``stop()`` or Ctrl-C."""
        if not self.serving:
            self.start()
        try:
            # Short waits keep the main thread responsive to Ctrl-C.
            while not self._stopped.wait(0.2):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def __enter__(self) -> "Server":
        if not self.serving:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
