"""examples/python/ run against real servers: the seed-000 workflow against
`tensorwire serve`, split learning with its Python middle-layer server and a
`tensorwire serve` checkpoint store."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT

EXAMPLES = os.path.join(ROOT, "examples", "python")


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_seed000_workflow_against_tensorwire_serve(cli_server):
    s = cli_server("unix")
    out = run(os.path.join(EXAMPLES, "seed000_workflow.py"), s.url)
    assert "fetched 4 tensors back, all equal: True" in out
    assert out.count("equal=True") == 4
    assert "async round trip equal: True" in out


def test_split_learning_loss_falls_and_checkpoints(cli_server):
    store = cli_server("tcp")
    out = run(os.path.join(EXAMPLES, "split_learning.py"))
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) >= 3 and losses[-1] < losses[0] / 10, losses
    # Apart: the middle layer in its own process, the client checkpointing to the store.
    server = subprocess.Popen([sys.executable, os.path.join(EXAMPLES, "split_learning.py"), "serve",
                               "tcp://127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert "serving the middle layer on " in line, line
        url = line.split(" on ", 1)[1].split(",")[0].strip()
        out = run(os.path.join(EXAMPLES, "split_learning.py"), "train", url, store.url)
        assert "round trip equal: True" in out
    finally:
        server.terminate()
        server.wait(10)
