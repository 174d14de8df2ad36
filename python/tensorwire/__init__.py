"""tensorwire for PyTorch users: move torch tensors between processes and
machines over TCP, Unix sockets, shared memory, QUIC or gRPC, zero-copy
where memory allows.

* :class:`Client` / :class:`AsyncClient`: ``send`` a tensor or state dict,
  ``fetch`` by name, ``exchange`` a stream both ways, ``call`` server
  functions with tensors and plain values, background tasks.
* :class:`Server`: serve Python functions (``@server.function``, batched
  with ``batch=N``) and tensor handlers (``on_send``, ``on_fetch``,
  ``on_exchange``).
* Errors: :class:`Error` and its subclasses :class:`ConnectError`,
  :class:`RemoteError` (``.code``), :class:`TimeoutError` (also the builtin)
  and :class:`DecodeError`.

Quick start (against ``tensorwire serve --listen tcp://127.0.0.1:50051``)::

    import torch, tensorwire
    with tensorwire.Client("tcp://127.0.0.1:50051") as c:
        c.send({"w": torch.randn(1024, 1024, dtype=torch.bfloat16)})
        w = c.fetch("w")
"""

from ._convert import metadata_of, name_of, with_metadata
from ._errors import ConnectError, DecodeError, Error, RemoteError, TimeoutError
from ._native import __version__
from .client import AsyncClient, Client, SendResult
from .server import Server

__all__ = [
    "Client",
    "AsyncClient",
    "Server",
    "SendResult",
    "Error",
    "ConnectError",
    "RemoteError",
    "TimeoutError",
    "DecodeError",
    "name_of",
    "metadata_of",
    "with_metadata",
    "__version__",
]
