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
from ._native import tune_allocator as _tune_allocator
from .client import AsyncClient, Client, SendResult
from .server import Server



def tune_allocator() -> bool:
    """Make the C allocator recycle buffers of up to 4 MiB from the heap.

    glibc maps a fresh, zero-filled block for a large request once its
    dynamic threshold is low, so HTTP/2 (``grpc://``) can page-fault on
    every 1 MiB frame it receives: measured here, a 256 MiB gRPC fetch at
    1.7 GiB/s instead of 5.3. This fixes the thresholds (mmap 4 MiB, trim
    128 MiB) for the whole process, so it is never done for you: call it
    once, early. Returns False where it does nothing (not glibc).
    """
    return _tune_allocator()


__all__ = [
    "tune_allocator",
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
