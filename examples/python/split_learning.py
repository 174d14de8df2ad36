#!/usr/bin/env python3
"""Split learning (the split-learning seed) with ``import tensorwire``: a
3-layer MLP cut in two places. The client holds the data and the first and
last layers; the server holds the middle layer. Each step the client sends
its activations (``forward``), gets the middle layer's output, finishes the
forward pass and the loss, sends the gradient back (``backward``) and gets
the gradient for its first layer; both sides update their own weights.

    # server and client in one process (default)
    python examples/python/split_learning.py
    # or apart
    python examples/python/split_learning.py serve tcp://0.0.0.0:50052
    python examples/python/split_learning.py train tcp://127.0.0.1:50052 [tcp://127.0.0.1:50051]

The optional last URL is a ``tensorwire serve`` store: the trained client
layers are checkpointed there with ``send`` and read back with ``fetch``.
"""

from __future__ import annotations

import sys
import threading
from typing import Dict, Optional, Tuple

import torch

import tensorwire

IN, H1, H2, OUT, BATCH, LR, STEPS = 4, 16, 16, 1, 32, 0.05, 200


def serve_middle(url: str) -> tensorwire.Server:
    """The server half: the middle layer, one activation cache per client step."""
    torch.manual_seed(1)
    middle = torch.nn.Linear(H1, H2)
    opt = torch.optim.SGD(middle.parameters(), lr=LR)
    cache: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    lock = threading.Lock()
    server = tensorwire.Server(listen=[url])

    @server.function("forward")
    def forward(h1: torch.Tensor, step: str) -> torch.Tensor:
        x = h1.clone().requires_grad_(True)
        y = torch.relu(middle(x))
        with lock:
            cache[step] = (x, y)
        return y.detach()

    @server.function("backward")
    def backward(grad_h2: torch.Tensor, step: str) -> torch.Tensor:
        with lock:
            x, y = cache.pop(step)
            opt.zero_grad()
            torch.autograd.backward(y, grad_h2)
            opt.step()
        assert x.grad is not None
        return x.grad

    server.start()
    return server


def train(url: str, store: Optional[str] = None) -> float:
    """The client half; returns the final loss."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(IN, H1), torch.nn.Linear(H2, OUT)
    opt = torch.optim.SGD(list(first.parameters()) + list(last.parameters()), lr=LR)
    w_true = torch.randn(IN, OUT)
    loss_value = float("nan")
    with tensorwire.Client(url, timeout=30) as client:
        for step in range(STEPS):
            x = torch.randn(BATCH, IN)
            target = x @ w_true
            h1 = torch.relu(first(x))
            h2 = client.call("forward", h1.detach(), step=str(step)).requires_grad_(True)
            loss = torch.nn.functional.mse_loss(last(h2), target)
            opt.zero_grad()
            torch.autograd.backward(loss)
            assert h2.grad is not None
            grad_h1 = client.call("backward", h2.grad, step=str(step))
            torch.autograd.backward(h1, grad_h1)
            opt.step()
            loss_value = loss.item()
            if step % 50 == 0 or step == STEPS - 1:
                print(f"step {step:4d} loss {loss_value:.4f}")
    if store is not None:
        with tensorwire.Client(store) as s:
            s.send({f"first.{k}": v.detach() for k, v in first.state_dict().items()})
            w = s.fetch("first.weight")
            print("checkpointed the client layers; round trip equal:", torch.equal(w, first.weight.detach()))
    return loss_value


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "serve":
        server = serve_middle(args[1] if len(args) > 1 else "tcp://0.0.0.0:50052")
        print("serving the middle layer on", ", ".join(server.urls))
        server.serve_forever()
    elif args and args[0] == "train":
        train(args[1], args[2] if len(args) > 2 else None)
    else:
        server = serve_middle("tcp://127.0.0.1:0")
        try:
            first_loss_hint = train(server.url)
            print("final loss", round(first_loss_hint, 4))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
