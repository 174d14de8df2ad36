#!/usr/bin/env python3
"""The first seed's workflow (a grpcio server streaming ``torch.save`` chunks)
done with ``import tensorwire``: send a state dict, fetch tensors by name,
and a bidirectional stream — against ``tensorwire serve``::

    tensorwire serve --listen tcp://127.0.0.1:50051 &
    python examples/python/seed000_workflow.py tcp://127.0.0.1:50051

The same code runs over ``unix:///tmp/tw.sock`` or ``shm://name`` on one
host. The asyncio half shows the seed's ``async with TensorClient(...)``
style with :class:`tensorwire.AsyncClient`.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Dict

import torch

import tensorwire


def model_state() -> Dict[str, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return {k: v.detach() for k, v in model.state_dict().items()}


def blocking(url: str) -> None:
    state = model_state()
    with tensorwire.Client(url, timeout=60) as client:
        # Client -> server (the seed's ReceiveTensors): names are kept.
        summary = client.send(state)
        print(f"sent {summary.received} tensors, {summary.bytes} bytes: {summary.message}")

        # Server -> client by name (the seed's SendTensors with parameters).
        w = client.fetch("0.weight")
        assert torch.equal(w, state["0.weight"])
        everything = client.fetch_many(list(state))
        print(f"fetched {len(everything)} tensors back, all equal:",
              all(torch.equal(everything[k], v) for k, v in state.items()))

        # Into existing memory (e.g. a model's parameters).
        out = torch.empty_like(state["2.bias"])
        client.fetch_into("2.bias", out)

        # Bidirectional (the seed's StreamTensors): `tensorwire serve` echoes.
        batches = [torch.randn(32, 256) for _ in range(4)]
        for i, answer in enumerate(client.exchange(batches)):
            print(f"stream answer {i}: {tuple(answer.shape)} equal={torch.equal(answer, batches[i])}")

        print("server:", client.info()["service_name"], "healthy:", client.health())


async def asynchronous(url: str) -> None:
    async with tensorwire.AsyncClient(url) as client:
        t = torch.randn(1024, 1024, dtype=torch.bfloat16)
        await client.send({"activations": t})
        back = await client.fetch("activations")
        print("async round trip equal:", torch.equal(back, t))
        answers = await client.exchange([torch.ones(3), torch.zeros(2)])
        print("async stream answers:", [a.tolist() for a in answers])


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:50051"
    blocking(url)
    asyncio.run(asynchronous(url))


if __name__ == "__main__":
    main()
