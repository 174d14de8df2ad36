#!/usr/bin/env python3
"""Call tensorwire's functions over JSON-RPC 2.0 with nothing but the
Python standard library (urllib.request + json): the function-sharing
seed's protocol, spoken by `tensorwire serve`.

    tensorwire serve --listen http://127.0.0.1:8080 &
    python3 examples/jsonrpc_client.py http://127.0.0.1:8080 [TOKEN]

It calls a scalar function (`add`), a tensor function (`scale`, tensors as
base64 raw bytes), and runs a function as a background task.
"""
import base64
import json
import struct
import sys
import time
import urllib.error
import urllib.request


class RpcError(Exception):
    def __init__(self, error):
        super().__init__(f"{error['code']}: {error['message']}")
        self.code = error["code"]


class Client:
    def __init__(self, url, token=None):
        self.url = url.rstrip("/") + "/rpc"
        self.token = token
        self.next_id = 0

    def call_function(self, method, params=None):
        self.next_id += 1
        body = {"jsonrpc": "2.0", "method": method, "id": self.next_id}
        if params is not None:
            body["params"] = params
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", "Bearer " + self.token)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:  # 401, 413, ...: the body says why
            answer = json.loads(e.read())
        if "error" in answer:
            raise RpcError(answer["error"])
        return answer["result"]

    # The seed's async client: submit_task / get_task_status / get_task_result.
    def submit_task(self, method, params=None):
        return self.call_function("tensorwire.submit", [method, params or []])["task_id"]

    def get_task_status(self, task_id):
        return self.call_function("tensorwire.status", [task_id])["state"]

    def get_task_result(self, task_id, wait_ms=10_000):
        return self.call_function("tensorwire.result", [task_id, wait_ms])


def tensor(values, shape):
    """A float32 tensor as JSON-RPC carries it: dtype, shape, base64 raw bytes."""
    data = struct.pack(f"<{len(values)}f", *values)
    return {"dtype": "float32", "shape": shape, "data": base64.b64encode(data).decode()}


def floats(t):
    raw = base64.b64decode(t["data"])
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def main():
    client = Client(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080",
                    sys.argv[2] if len(sys.argv) > 2 else None)
    print("functions:", ", ".join(f["name"] for f in client.call_function("tensorwire.list_functions")))

    print("add(10, 20) =", client.call_function("add", [10, 20]))

    y = client.call_function("scale", [tensor([1, 2, 3, 4], [2, 2]), 1.5])
    print(f"scale: {y['dtype']} {y['shape']} {floats(y)}")

    task_id = client.submit_task("add", [100, 23])
    while (state := client.get_task_status(task_id)) not in ("done", "failed", "cancelled"):
        time.sleep(0.05)
    print(f"task {task_id}: {state}, result {client.get_task_result(task_id)}")

    try:
        client.call_function("no_such_function", [])
    except RpcError as e:
        print("unknown method ->", e.code)


if __name__ == "__main__":
    main()
