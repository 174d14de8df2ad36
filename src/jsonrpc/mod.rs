//! JSON-RPC 2.0 over HTTP (feature `http`): the protocol of the Python
//! function-sharing seed, so any language calls the server's functions
//! with an HTTP client. `tensorwire serve --listen http://0.0.0.0:8080`.
//!
//! ```sh
//! curl -s localhost:8080/rpc -H 'Content-Type: application/json' \
//!      -d '{"jsonrpc": "2.0", "method": "add", "params": [10, 20], "id": 1}'
//! # {"jsonrpc":"2.0","result":30,"id":1}
//! ```
//!
//! **HTTP.** `POST /rpc` with `Content-Type: application/json` (else 404,
//! 405, 415). With an auth token configured, `Authorization: Bearer
//! <token>` (else 401). The body is refused with 413 above
//! `ServerConfig::max_http_body_bytes` (64 MiB by default) — by its
//! `Content-Length` before any of it is read, or as soon as a chunked body
//! passes the limit. `X-Timeout-Ms: N` sets each call's deadline. JSON-RPC
//! answers (errors included) are `200 OK`; a notification, or a batch of
//! notifications only, gets `204 No Content`.
//!
//! **Bounds.** `max_connections` and `max_connections_per_peer` (by
//! address) apply to HTTP connections, counted apart from native ones; one
//! past them is answered 503 and closed. A body is reserved against the
//! server's memory budget before it is parsed (its bytes three times, plus
//! `JSON_VALUE_BYTES` per value: tiny values parse into many times their
//! text; estimates under 64 KiB are not), 503 when the budget is short (at
//! once, without making room, when it needs more than the whole budget). A
//! response may take `ServerConfig::max_http_response_bytes` plus 64 KiB
//! (so a small answer fits whatever the limit), a batch's answers
//! together, each charged as it is made (a result's tensors, as base64,
//! before they are encoded); an answer that does not fit is a
//! LIMIT_EXCEEDED error instead, and once less than 4 KiB is left the
//! batch's further requests are not run (so a call that ran has room to
//! say so). `tensorwire.result` waits at most `JSONRPC_MAX_WAIT_MS`.
//!
//! **Methods.**
//!
//! | method | params | result |
//! |---|---|---|
//! | any function's name | `[...]` or `{...}` (below) | its result (below) |
//! | `tensorwire.submit` | `[function, params]` or `{"function", "params"}` | `{"task_id", "state"}` |
//! | `tensorwire.status` | `[task_id]` or `{"task_id"}` | `{"task_id", "state", "message"?}` |
//! | `tensorwire.result` | `[task_id, wait_ms?]` or named | the function's result |
//! | `tensorwire.cancel` | `[task_id]` or named | `{"task_id", "state"}` |
//! | `tensorwire.list_functions` | none | `[{"name", "doc", "inputs", "args", "batch", "async"}]` |
//! | `tensorwire.health` | none | `{"serving", "status"}` |
//! | `tensorwire.info` | none | name, version, transports, totals, store usage, per-function statistics |
//! | `tensorwire.list` | `[prefix?]` | `{"tensors": [{"name", "dtype", "shape", "bytes", "state_dict", "age_s"}], ...}` |
//!
//! **Params of a function.** A tensor is `{"dtype": "float32", "shape":
//! [2, 3], "data": "<base64 of the raw little-endian bytes, row-major>"}`
//! (`name` optional) or `{"safetensors": "<base64 of a safetensors file>"}`;
//! anything else is a scalar (null, bool, 64-bit int, float, string, list,
//! object). Positional params: the tensors are the inputs in order, the
//! scalars the arguments named by the function's declared `arg_names`
//! (`"0"`, `"1"`, … when it declares none). Named params: tensor-valued
//! entries are the inputs (in the order of the declared input names), the
//! rest arguments by name.
//!
//! **Results.** The function's values when it returned no tensors (`30`),
//! its tensor when it returned one and no values, a list for several, and
//! `{"tensors": [...], "values": ...}` for both.
//!
//! **Errors.** -32700 parse error, -32600 invalid request (also an empty or
//! oversized batch), -32601 method not found (an unknown function called by
//! name; one named in `tensorwire.submit` is NOT_FOUND, -32002), -32602
//! invalid params (also a function's INVALID_ARGUMENT: a lying shape, a
//! wrong dtype), -32603 internal (a function that panicked); every other
//! server status as `-32000 - <wire ErrorCode>` (NOT_FOUND -32002,
//! RESOURCE_EXHAUSTED -32005, DEADLINE_EXCEEDED -32008, REFUSED -32016,
//! LIMIT_EXCEEDED -32017, UNAUTHENTICATED -32018), its message `"CODE:
//! message"` and `data: {"status", "message"}`.
//!
//! Every request runs through the server's dispatcher as an in-process call
//! (`server::inproc`): the same function registry, limits, deadlines,
//! statistics (transport `"http"`) and shutdown rules as a native call.
//!
//! | file | holds |
//! |---|---|
//! | `protocol.rs` | the envelope, sans-IO: bodies, batches, notifications, error codes, responses |
//! | `convert.rs` | JSON ⇄ tensors and values; params ⇄ inputs and `Args`, sans-IO |
//! | `methods.rs` | one request run through the dispatcher |
//! | `http.rs` | the hyper HTTP/1.1 server, its checks and limits, shutdown |
//!
//! May import: `server::state`, `server::dispatch` and `server::inproc`,
//! `pipeline`, `rpc`, `observe`, `config`, `error`. Imported only by
//! `server::accept` (and the fuzzing entry points).

pub(crate) mod convert;
mod http;
mod methods;
pub(crate) mod protocol;

pub(crate) use http::listen;
