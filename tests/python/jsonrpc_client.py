"""A JSON-RPC 2.0 client using only the standard library, against
`tensorwire serve --listen http://...` (the function-sharing seed's protocol).

    python jsonrpc_client.py URL TOKEN

Checks scalar functions, a tensor function (base64 raw bytes in and out), a
task, a batch with a notification, every error code, the HTTP refusals
(missing token, wrong content type, a 1 GiB body) and that the server keeps
serving after each. Prints "ok" at the end; any failure raises.
"""
import base64
import http.client
import json
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

URL, TOKEN = sys.argv[1].rstrip("/") + "/rpc", sys.argv[2]
HOST = urllib.parse.urlsplit(URL)
_next_id = [0]


def post(body, token=TOKEN, content_type="application/json"):
    """POSTs raw bytes; returns (HTTP status, parsed JSON or None)."""
    req = urllib.request.Request(URL, data=body, method="POST")
    if content_type:
        req.add_header("Content-Type", content_type)
    if token:
        req.add_header("Authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
            return r.status, (json.loads(data) if data else None)
    except urllib.error.HTTPError as e:
        data = e.read()
        return e.code, (json.loads(data) if data else None)


def rpc(method, params=None):
    """One call; returns the whole response object."""
    _next_id[0] += 1
    msg = {"jsonrpc": "2.0", "method": method, "id": _next_id[0]}
    if params is not None:
        msg["params"] = params
    status, resp = post(json.dumps(msg).encode())
    assert status == 200, (status, resp)
    assert resp["jsonrpc"] == "2.0" and resp["id"] == _next_id[0], resp
    return resp


def call(method, params=None):
    resp = rpc(method, params)
    assert "error" not in resp, resp
    return resp["result"]


def error_code(method, params=None):
    resp = rpc(method, params)
    assert "result" not in resp, resp
    return resp["error"]["code"], resp["error"]


def tensor(fmt, shape, values, dtype):
    return {"dtype": dtype, "shape": shape, "data": base64.b64encode(struct.pack("<" + fmt * len(values), *values)).decode()}


def values(t, fmt):
    raw = base64.b64decode(t["data"])
    return list(struct.unpack("<" + fmt * (len(raw) // struct.calcsize(fmt)), raw))


def still_serving():
    assert call("add", [1, 2]) == 3


# Scalar functions: positional (the seed's call_function("add_numbers", [10, 20])) and named.
assert call("add", [10, 20]) == 30
assert call("add", {"a": 1.5, "b": 2}) == 3.5

# A tensor function: base64 raw bytes in, out.
x = tensor("f", [2, 3], [1, 2, 3, 4, 5, 6], "float32")
y = call("scale", [x, 2.5])  # positional scalars fill the declared arguments (factor)
assert y["dtype"] == "float32" and y["shape"] == [2, 3] and values(y, "f") == [2.5, 5, 7.5, 10, 12.5, 15], y
y = call("scale", {"x": x, "factor": 0.5})
assert values(y, "f") == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0], y
s = call("sum", [tensor("q", [3], [1, 2, 3], "int64")])
assert values(s, "q") == [6] and s["shape"] == [], s

# A task: submit, poll its status, fetch its result; cancel an unknown one.
task = call("tensorwire.submit", ["add", [100, 23]])
assert task["state"] == "pending" and task["task_id"].startswith("task-"), task
deadline = time.time() + 10
while call("tensorwire.status", [task["task_id"]])["state"] != "done":
    assert time.time() < deadline, "task did not finish"
    time.sleep(0.01)
assert call("tensorwire.result", {"task_id": task["task_id"], "wait_ms": 1000}) == 123
task2 = call("tensorwire.submit", {"function": "scale", "params": {"x": x, "factor": 2}})
assert values(call("tensorwire.result", [task2["task_id"], 5000]), "f") == [2, 4, 6, 8, 10, 12]

# Discovery.
fns = {f["name"]: f for f in call("tensorwire.list_functions")}
assert {"identity", "scale", "sum", "add"} <= set(fns), fns
assert fns["add"]["args"] == ["a", "b"], fns["add"]
assert call("tensorwire.health") == {"serving": True, "status": "SERVING"}
info = call("tensorwire.info")
assert "http" in info["transports"] and info["calls"] > 0, info

# A batch: answers for requests (any order, matched by id), none for the
# notification, an error for the invalid entry.
batch = [
    {"jsonrpc": "2.0", "method": "add", "params": [1, 1], "id": "a"},
    {"jsonrpc": "2.0", "method": "add", "params": [2, 2]},  # notification
    {"jsonrpc": "2.0", "method": "scale", "params": {"x": x, "factor": 3}, "id": "b"},
    {"jsonrpc": "2.0", "method": "nope", "id": "c"},
    {"foo": "boo"},
]
status, answers = post(json.dumps(batch).encode())
assert status == 200 and isinstance(answers, list) and len(answers) == 4, answers
by_id = {a["id"]: a for a in answers}
assert by_id["a"]["result"] == 2
assert values(by_id["b"]["result"], "f") == [3, 6, 9, 12, 15, 18]
assert by_id["c"]["error"]["code"] == -32601
assert by_id[None]["error"]["code"] == -32600
# Notifications only: no content at all.
status, body = post(json.dumps([{"jsonrpc": "2.0", "method": "add", "params": [1, 2]}]).encode())
assert (status, body) == (204, None), (status, body)
status, body = post(json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2]}).encode())
assert (status, body) == (204, None), (status, body)

# Every error code.
status, resp = post(b'{"jsonrpc": "2.0", "method": "add", "params": [1, 2')  # malformed JSON
assert status == 200 and resp["error"]["code"] == -32700 and resp["id"] is None, resp
still_serving()
status, resp = post(b"[]")
assert resp["error"]["code"] == -32600, resp
status, resp = post(json.dumps({"jsonrpc": "1.0", "method": "add", "id": 9}).encode())
assert resp["error"]["code"] == -32600 and resp["id"] == 9, resp
code, err = error_code("no_such_function", [1])
assert code == -32601 and "add" in err["message"], err
code, _ = error_code("tensorwire.nope")
assert code == -32601
# A lying shape x dtype vs data length.
liar = {"dtype": "float32", "shape": [2, 3], "data": base64.b64encode(b"\0" * 20).decode()}
code, err = error_code("scale", [liar])
assert code == -32602 and "needs 24 bytes" in err["message"], err
# A shape far above the server's limits: refused before anything is decoded.
code, err = error_code("scale", [{"dtype": "float32", "shape": [1 << 40], "data": ""}])
assert code == -32602 and "limit" in err["message"], err
code, err = error_code("add", ["x", 1])
assert code == -32602 and err["data"]["status"] == "INVALID_ARGUMENT", err
code, err = error_code("add", [1, 2, 3])
assert code == -32602, err
# Server errors carry the status code and message.
code, err = error_code("tensorwire.status", ["task-0000"])
assert code == -32002 and err["data"]["status"] == "NOT_FOUND" and err["message"].startswith("NOT_FOUND:"), err
still_serving()

# HTTP-level refusals.
status, resp = post(json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode(), token=None)
assert status == 401 and resp["error"]["code"] == -32018, (status, resp)
status, resp = post(json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode(), token="wrong")
assert status == 401, status
status, resp = post(b"{}", content_type="text/plain")
assert status == 415, status
still_serving()

# A 1 GiB body: refused by its declared length, before any of it is read.
conn = http.client.HTTPConnection(HOST.hostname, HOST.port, timeout=30)
conn.putrequest("POST", "/rpc")
conn.putheader("Content-Type", "application/json")
conn.putheader("Authorization", "Bearer " + TOKEN)
conn.putheader("Content-Length", str(1 << 30))
conn.endheaders()
r = conn.getresponse()  # answered with none of the body sent
assert r.status == 413, r.status
body = json.loads(r.read())
assert body["error"]["code"] == -32600 and "limit" in body["error"]["message"], body
conn.close()
still_serving()

print("ok")
