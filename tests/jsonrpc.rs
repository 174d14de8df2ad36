//! JSON-RPC 2.0 over HTTP (the function-sharing seed's protocol), on
//! loopback: a Python client using only the standard library against
//! `tensorwire serve`, and raw HTTP from here for what must be refused
//! before a body is read, deadlines, batching, statistics and shutdown.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::python::{python, run};
use serde_json::{Value as Json, json};
use tensorwire::{BatchConfig, DType, Function, Output, Server, ServerConfig, Status, Tensor, TensorSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tensorwire serve --listen http://127.0.0.1:0 ARGS`, and its URL.
fn serve_http(args: &[&str]) -> (Served, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["serve", "--listen", "http://127.0.0.1:0", "--log-level", "warn"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{line:?}")).to_string();
    (Served(child), url)
}

#[test]
fn python_stdlib_client_against_serve() {
    let Some(py) = python() else { return };
    let (mut server, url) = serve_http(&["--auth-token", "s3cret"]);
    let out = run(&py, "jsonrpc_client.py", &[&url, "s3cret"]);
    assert!(out.trim_end().ends_with("ok"), "{out}");
    assert!(server.0.try_wait().unwrap().is_none(), "the server kept running");
}

#[test]
fn the_example_script_calls_a_function_and_runs_a_task() {
    let Some(py) = python() else { return };
    let (_server, url) = serve_http(&[]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/jsonrpc_client.py");
    let out = Command::new(py).arg(script).arg(&url).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("add(10, 20) = 30"), "{text}");
    assert!(text.contains("task") && text.contains("done"), "{text}");
}

// ---------------------------------------------------------------------------
// Raw HTTP from here.

struct HttpReply {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl HttpReply {
    fn json(&self) -> Json {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Sends `head` (request line and headers, without the blank line) and
/// `body` on a fresh connection, and reads the reply to the end.
async fn raw(addr: &str, head: &str, body: &[u8]) -> HttpReply {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("{head}\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
    if !body.is_empty() {
        s.write_all(body).await.unwrap();
    }
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf)).await.expect("reply in time").unwrap();
    let split = buf.windows(4).position(|w| w == b"\r\n\r\n").expect("a whole head");
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    HttpReply { status, head, body: buf[split + 4..].to_vec() }
}

async fn post(addr: &str, headers: &str, body: &Json) -> HttpReply {
    let b = body.to_string();
    let head = format!(
        "POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}{headers}",
        b.len()
    );
    raw(addr, &head, b.as_bytes()).await
}

fn req(method: &str, params: Json, id: u64) -> Json {
    json!({ "jsonrpc": "2.0", "method": method, "params": params, "id": id })
}

fn f32_tensor(values: &[f32], shape: &[usize]) -> Json {
    use base64::Engine;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    json!({ "dtype": "float32", "shape": shape, "data": base64::engine::general_purpose::STANDARD.encode(bytes) })
}

fn f32_values(t: &Json) -> Vec<f32> {
    use base64::Engine;
    let b = base64::engine::general_purpose::STANDARD.decode(t["data"].as_str().unwrap()).unwrap();
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn test_server(config: ServerConfig) -> tensorwire::ServerBuilder {
    Server::builder()
        .config(config)
        .function(
            Function::inline("add_numbers", |c| {
                let (a, b) = (c.args.f64_or("a", 0.0)?, c.args.f64_or("b", 0.0)?);
                Ok(if a.fract() == 0.0 && b.fract() == 0.0 {
                    Output::value((a + b) as i64)
                } else {
                    Output::value(a + b)
                })
            })
            .arg_names(["a", "b"]),
        )
        .function(
            Function::new("double", |c| {
                let x = c.inputs[0].to_vec::<f32>()?;
                Ok(Tensor::from_vec(c.inputs[0].shape(), x.iter().map(|v| v * 2.0).collect::<Vec<f32>>())?.into())
            })
            .inputs([TensorSpec::new("x").dtype(DType::Float32)]),
        )
        .function(Function::new_async("sleep", |c| async move {
            let ms = c.args.get("0").and_then(|v| v.as_i64()).unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms as u64)).await;
            Ok(Output::value("slept"))
        }))
        .function(Function::new_async("busy", |_c| async move {
            // Always ready, but for tokio's coop budget, which it spends on
            // every poll: its deadline must stop it all the same.
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(3) {
                tokio::task::coop::consume_budget().await;
            }
            Ok(Output::value("finished"))
        }))
        .function(Function::batched(
            "negate",
            BatchConfig { max_batch: 8, max_wait: Duration::from_millis(20), ..Default::default() },
            |inputs, _| {
                let x = inputs[0].to_vec::<f32>()?;
                Ok(vec![Tensor::from_vec(inputs[0].shape(), x.iter().map(|v| -v).collect::<Vec<f32>>())?])
            },
        ))
        .function(Function::inline("fail", |_| Err(Status::resource_exhausted("no room"))))
}

async fn start(config: ServerConfig) -> (tensorwire::RunningServer, String) {
    let server = test_server(config).build().start(["http://127.0.0.1:0"]).await.unwrap();
    let addr = server.url().strip_prefix("http://").unwrap().to_string();
    (server, addr)
}

#[tokio::test]
async fn refusals_come_before_the_body_is_read_and_the_server_keeps_serving() {
    let config =
        ServerConfig { auth_token: Some("tok".into()), max_http_body_bytes: 1 << 20, ..ServerConfig::default() };
    let (server, addr) = start(config).await;
    let auth = "\r\nAuthorization: Bearer tok";
    let ok = || async { post(&addr, auth, &req("add_numbers", json!([10, 20]), 1)).await };
    assert_eq!(ok().await.json()["result"], 30);

    // A 1 GiB body declared: 413 at once, with none of it sent.
    let started = Instant::now();
    let r = raw(
        &addr,
        "POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer tok\r\nContent-Length: 1073741824",
        b"",
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.head);
    assert!(started.elapsed() < Duration::from_secs(5));
    let e = r.json();
    assert_eq!(e["error"]["code"], -32600);
    assert!(e["error"]["message"].as_str().unwrap().contains("limit of 1048576"), "{e}");
    // A chunked body that passes the limit: 413 once it does.
    let mut chunked = Vec::new();
    for _ in 0..3 {
        chunked.extend_from_slice(format!("{:x}\r\n", 512 << 10).as_bytes());
        chunked.extend(std::iter::repeat_n(b' ', 512 << 10));
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let r = raw(
        &addr,
        "POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer tok\r\nTransfer-Encoding: chunked",
        &chunked,
    )
    .await;
    assert_eq!(r.status, 413, "{}", r.head);
    assert_eq!(ok().await.json()["result"], 30);

    // No token, a wrong one, a wrong type, method or path.
    let r = post(&addr, "", &req("add_numbers", json!([1, 2]), 1)).await;
    assert_eq!(r.status, 401);
    assert!(r.head.to_ascii_lowercase().contains("www-authenticate: bearer"), "{}", r.head);
    assert_eq!(r.json()["error"]["code"], -32018);
    assert_eq!(post(&addr, "\r\nAuthorization: Bearer nope", &req("add_numbers", json!([1, 2]), 1)).await.status, 401);
    let r = raw(
        &addr,
        "POST /rpc HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\nContent-Type: text/plain\r\nContent-Length: 2",
        b"{}",
    )
    .await;
    assert_eq!(r.status, 415);
    let r = raw(&addr, "GET /rpc HTTP/1.1\r\nHost: x", b"").await;
    assert_eq!(r.status, 405);
    assert!(r.head.to_ascii_lowercase().contains("allow: post"), "{}", r.head);
    assert_eq!(raw(&addr, "POST /elsewhere HTTP/1.1\r\nHost: x\r\nContent-Length: 0", b"").await.status, 404);

    // Malformed JSON, garbage bytes, a lying tensor, an unknown method.
    for body in [&b"{\"jsonrpc\": \"2.0\", \"method\""[..], b"\xff\xfe\x00garbage", b"nul"] {
        let head = format!(
            "POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer tok\r\nContent-Length: {}",
            body.len()
        );
        let r = raw(&addr, &head, body).await;
        assert_eq!((r.status, r.json()["error"]["code"].clone()), (200, json!(-32700)));
    }
    let liar = json!({ "dtype": "float32", "shape": [4], "data": "AAAA" });
    let e = post(&addr, auth, &req("double", json!([liar]), 2)).await.json();
    assert_eq!(e["error"]["code"], -32602, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("needs 16 bytes, but data holds 3"), "{e}");
    let e = post(&addr, auth, &req("no_such", json!([]), 3)).await.json();
    assert_eq!(e["error"]["code"], -32601);
    assert!(e["error"]["message"].as_str().unwrap().contains("add_numbers"), "lists what exists: {e}");
    assert_eq!(ok().await.json()["result"], 30, "still serving");
    server.shutdown().await;
}

#[tokio::test]
async fn functions_tasks_batches_deadlines_and_statistics() {
    let (server, addr) = start(ServerConfig::default()).await;
    // A declared tensor signature: by name or by position; the wrong dtype is invalid params.
    let x = f32_tensor(&[1.0, 2.0, 3.0], &[3]);
    let r = post(&addr, "", &req("double", json!({ "x": x }), 1)).await.json();
    assert_eq!(f32_values(&r["result"]), vec![2.0, 4.0, 6.0], "{r}");
    let r = post(&addr, "", &req("double", json!([x]), 2)).await.json();
    assert_eq!(r["result"]["shape"], json!([3]));
    let ints = json!({ "dtype": "int32", "shape": [1], "data": "AQAAAA==" });
    let e = post(&addr, "", &req("double", json!([ints]), 3)).await.json();
    assert_eq!(e["error"]["code"], -32602, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("must be float32"), "{e}");
    // Server errors carry the status.
    let e = post(&addr, "", &req("fail", json!([]), 4)).await.json();
    assert_eq!(e["error"]["code"], -32005);
    assert_eq!(e["error"]["data"]["status"], "RESOURCE_EXHAUSTED");
    // A deadline from X-Timeout-Ms.
    let started = Instant::now();
    let e = post(&addr, "\r\nX-Timeout-Ms: 50", &req("sleep", json!([2000]), 5)).await.json();
    assert_eq!(e["error"]["code"], -32008, "{e}");
    assert!(started.elapsed() < Duration::from_secs(1));
    // Also for work that never waits (HTTP calls are not told their client
    // went: only the deadline stops it).
    let e = post(&addr, "\r\nX-Timeout-Ms: 50", &req("busy", json!([]), 10)).await.json();
    assert_eq!(e["error"]["code"], -32008, "{e}");
    // A batch of 8 calls of a batched function runs through the server's
    // batcher (fewer runs than calls) and answers each in its place.
    let batch: Vec<Json> = (0..8).map(|i| req("negate", json!([f32_tensor(&[i as f32], &[1])]), i)).collect();
    let answers = post(&addr, "", &json!(batch)).await.json();
    let answers = answers.as_array().unwrap();
    assert_eq!(answers.len(), 8);
    for a in answers {
        let i = a["id"].as_u64().unwrap();
        assert_eq!(f32_values(&a["result"]), vec![-(i as f32)], "{a}");
    }
    let info = server.info();
    let negate = info.functions.iter().find(|f| f.name == "negate").unwrap();
    assert_eq!(negate.calls, 8);
    assert!(negate.batches < 8, "{negate:?}");
    assert!(info.transports.contains(&"http".to_string()));
    assert!(info.calls >= 14 && info.failures >= 4, "{info:?}");
    // A task over JSON-RPC, cancelled before it finishes.
    let t = post(&addr, "", &req("tensorwire.submit", json!(["sleep", [5000]]), 6)).await.json();
    let id = t["result"]["task_id"].as_str().unwrap().to_string();
    let c = post(&addr, "", &req("tensorwire.cancel", json!([id]), 7)).await.json();
    assert_eq!(c["result"]["state"], "cancelled", "{c}");
    let e = post(&addr, "", &req("tensorwire.result", json!([id]), 8)).await.json();
    assert_eq!(e["error"]["data"]["status"], "CANCELLED", "{e}");

    // Graceful shutdown: a call in flight finishes; then nothing is served.
    let a2 = addr.clone();
    let slow = tokio::spawn(async move { post(&a2, "", &req("sleep", json!([300]), 9)).await.json() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.shutdown().await;
    assert_eq!(slow.await.unwrap()["result"], "slept");
    assert!(tokio::net::TcpStream::connect(&addr).await.is_err(), "the listener is closed");
}

#[tokio::test]
async fn connections_memory_and_responses_are_bounded() {
    let config = ServerConfig {
        max_connections_per_peer: 2,
        max_memory_bytes: 8 << 20,
        max_http_response_bytes: 256 << 10,
        ..ServerConfig::default()
    };
    let (server, addr) = start(config).await;

    // A body of many tiny values parses into many times its size: it is
    // reserved against the memory budget first (here 8 MiB), 503 if short.
    let zeros = format!("[{}0]", "0,".repeat(300_000));
    let head =
        format!("POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}", zeros.len());
    let r = raw(&addr, &head, zeros.as_bytes()).await;
    assert_eq!(r.status, 503, "{}", r.head);
    let e = r.json();
    assert!(e["error"]["message"].as_str().unwrap().contains("short of memory"), "{e}");
    assert_eq!(post(&addr, "", &req("add_numbers", json!([1, 2]), 1)).await.json()["result"], 3);

    // A result whose base64 would not fit the response (256 KiB): an error,
    // checked before it is encoded.
    let big = f32_tensor(&vec![1.0; 64 << 10], &[64 << 10]); // 256 KiB: ~341 KiB as base64
    let e = post(&addr, "", &req("double", json!([big]), 2)).await.json();
    assert_eq!(e["error"]["code"], -32017, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("max-http-response-bytes"), "{e}");
    // A batch: answers are charged in turn (the limit plus 64 KiB of slack:
    // 320 KiB); those past it are errors.
    let mid = f32_tensor(&vec![1.0; 16 << 10], &[16 << 10]); // 64 KiB: ~87 KiB as base64
    let batch = Json::Array((0..5).map(|i| req("double", json!([mid]), 10 + i)).collect());
    let answers = post(&addr, "", &batch).await.json();
    let answers = answers.as_array().unwrap();
    assert_eq!(answers.len(), 5);
    let ok = answers.iter().filter(|a| a.get("result").is_some()).count();
    assert_eq!(ok, 3, "three of ~88 KiB fit in 320 KiB: {answers:?}");
    assert!(answers.iter().filter(|a| a.get("error").is_some()).all(|a| a["error"]["code"] == -32017));

    // Two idle connections from this address are the cap: a third gets 503.
    let idle: Vec<_> = futures_util::future::join_all((0..2).map(|_| tokio::net::TcpStream::connect(&addr))).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r = post(&addr, "", &req("add_numbers", json!([1, 2]), 4)).await;
    assert_eq!(r.status, 503, "{}", r.head);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("too many HTTP connections from"), "{}", r.head);
    drop(idle);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(post(&addr, "", &req("add_numbers", json!([1, 2]), 5)).await.json()["result"], 3);
    server.shutdown().await;

    // A limit of 0: small answers still fit (64 KiB of slack); a larger
    // result does not.
    let (server, addr) = start(ServerConfig { max_http_response_bytes: 0, ..ServerConfig::default() }).await;
    assert_eq!(post(&addr, "", &req("add_numbers", json!([1, 2]), 1)).await.json()["result"], 3);
    let small = f32_tensor(&vec![1.0; 1 << 10], &[1 << 10]); // ~5.5 KiB as base64
    assert_eq!(f32_values(&post(&addr, "", &req("double", json!([small]), 2)).await.json()["result"]).len(), 1 << 10);
    let e = post(&addr, "", &req("double", json!([mid]), 3)).await.json();
    assert_eq!(e["error"]["code"], -32017, "{e}");
    // Notifications give back all the room they held: after thirty of them
    // (each ~5.6 KiB of result, ten times the slack in all), a request in
    // the same batch still gets its answer.
    let mut batch: Vec<Json> =
        (0..30).map(|_| json!({ "jsonrpc": "2.0", "method": "double", "params": [small.clone()] })).collect();
    batch.push(req("add_numbers", json!([2, 3]), 4));
    let answers = post(&addr, "", &Json::Array(batch)).await.json();
    assert_eq!(answers.as_array().map(Vec::len), Some(1), "{answers}");
    assert_eq!(answers[0]["result"], 5, "{answers}");
    server.shutdown().await;
}
