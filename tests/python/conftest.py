"""Fixtures for the `import tensorwire` tests: real servers on loopback —
the `tensorwire` CLI (`tensorwire serve`) and Python `tensorwire.Server`s —
and the Rust binaries that call Python servers.

tests/run.sh builds the package into the test virtualenv and exports
TENSORWIRE_BIN (the CLI) before running pytest here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from typing import Callable, Iterator, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRED = os.environ.get("TENSORWIRE_REQUIRE_PYTHON") == "1"


def binary(name: str) -> str:
    """Path of a built Rust binary (the CLI or an example); skipped (or,
    under tests/run.sh, failed) when it was not built."""
    cli = os.environ.get("TENSORWIRE_BIN") or os.path.join(ROOT, "target", "debug", "tensorwire")
    path = cli if name == "tensorwire" else os.path.join(os.path.dirname(cli), "examples", name)
    if not os.access(path, os.X_OK):
        msg = f"{path} not built (cargo build --bin tensorwire --example client)"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def tmp_sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="twpy-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def listen_url(scheme: str, sock_dir: str) -> str:
    """A listen URL of `scheme` on loopback that no other test uses."""
    if scheme == "tcp":
        return "tcp://127.0.0.1:0"
    if scheme == "unix":
        return f"unix://{sock_dir}/tw.sock"
    if scheme == "shm":
        return f"shm://twpy-{uuid.uuid4().hex[:12]}"
    raise ValueError(scheme)


class CliServer:
    """`tensorwire serve` in its own process."""

    def __init__(self, listen: List[str]) -> None:
        args = [binary("tensorwire"), "serve", "--log-level", "warn"]
        for u in listen:
            args += ["--listen", u]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.urls: List[str] = []
        assert self.proc.stdout is not None
        while len(self.urls) < len(listen):
            line = self.proc.stdout.readline()
            if not line:
                err = self.proc.stderr.read() if self.proc.stderr else ""
                raise RuntimeError(f"tensorwire serve exited: {err}")
            if line.startswith("listening on "):
                self.urls.append(line.split("listening on ", 1)[1].strip())

    @property
    def url(self) -> str:
        return self.urls[0]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def cli_server(tmp_sock_dir: str) -> Iterator[Callable[[str], CliServer]]:
    """Factory: `cli_server("tcp")` starts `tensorwire serve` on that transport."""
    started: List[CliServer] = []

    def start(scheme: str = "tcp") -> CliServer:
        s = CliServer([listen_url(scheme, tmp_sock_dir)])
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
