"""The ``tensorwire`` exception hierarchy.

Every error a call raises is a :class:`Error` carrying the Rust side's
message and a status ``code`` (gRPC-style names such as ``"NOT_FOUND"``).
The native module raises these classes; they live in Python so that
:class:`TimeoutError` can be both a :class:`Error` and the builtin
``TimeoutError``.
"""

from __future__ import annotations

import builtins
from typing import Optional

__all__ = ["Error", "ConnectError", "RemoteError", "TimeoutError", "DecodeError"]


class Error(Exception):
    """Base of every tensorwire error. ``code`` names the status
    (``"UNAVAILABLE"``, ``"INTERNAL"``, ...)."""

    code: str

    def __init__(self, message: str = "", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code or "UNKNOWN"

    @property
    def message(self) -> str:
        """The message from the Rust side (or the remote handler)."""
        return str(self.args[0]) if self.args else ""


class ConnectError(Error, builtins.ConnectionError):
    """Could not connect (or reconnect) to the server, or the connection broke."""


class RemoteError(Error):
    """The server answered with an error: its handler raised, or it refused
    the call. ``code`` is the status code; the message is the server's.

    A Python handler may raise ``RemoteError(message, code="NOT_FOUND")`` to
    choose the code its caller sees."""


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001 - deliberately shadows the builtin
    """The call took longer than its timeout (``code == "DEADLINE_EXCEEDED"``)."""

    def __init__(self, message: str = "", code: Optional[str] = None) -> None:
        super().__init__(message, code or "DEADLINE_EXCEEDED")


class DecodeError(Error):
    """A received payload could not be decoded (corrupt or over a limit)."""
