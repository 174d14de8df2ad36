//! The RPC layer: named functions with signatures, dynamic batching, tasks,
//! deadlines, retries, statistics, metrics and health.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use tensorwire::{
    Args, BatchConfig, CallError, CallOptions, Client, ClientConfig, Code, DType, Function, Output, RetryPolicy,
    Server, ServerConfig, Status, TaskConfig, TaskState, Tensor, TensorSpec, Value,
};

fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_vec::<f32>().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signatures_are_checked_before_the_function_runs() {
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let add = Function::new("add", move |c| {
        r.fetch_add(1, Ordering::SeqCst);
        let (x, y) = (f32s(&c.inputs[0]), f32s(&c.inputs[1]));
        Ok(Tensor::from_vec(c.inputs[0].shape(), x.iter().zip(&y).map(|(a, b)| a + b).collect::<Vec<_>>())?.into())
    })
    .inputs([
        TensorSpec::new("x").dtype(DType::Float32).shape([-1, 3]),
        TensorSpec::new("y").dtype(DType::Float32).shape([-1, 3]),
    ])
    .doc("elementwise sum of two [N, 3] float32 tensors");
    let (server, _d) = start(Server::builder().function(add), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let x = Tensor::from_vec([2, 3], vec![1.0f32; 6]).unwrap();
    let out = c.compute("add", vec![x.clone(), x.clone()]).await.unwrap();
    assert_eq!(f32s(&out[0]), vec![2.0; 6]);
    let bad = Tensor::from_vec([2, 4], vec![1.0f32; 8]).unwrap();
    let e = c.compute("add", vec![x.clone(), bad]).await.unwrap_err();
    let s = e.status().unwrap();
    assert_eq!(s.code, Code::InvalidArgument);
    assert!(s.message.contains("\"y\"") && s.message.contains("[*, 3]"), "{s}");
    let e = c.compute("add", vec![x.clone(), Tensor::zeros(DType::Int64, [2, 3]).unwrap()]).await.unwrap_err();
    assert!(e.status().unwrap().message.contains("must be float32, got int64"));
    let e = c.compute("add", vec![x]).await.unwrap_err();
    assert!(e.status().unwrap().message.contains("takes 2 tensor(s) (x, y), got 1"));
    assert_eq!(ran.load(Ordering::SeqCst), 1, "mismatched calls never reach the function");
    let fs = c.list_functions().await.unwrap();
    assert_eq!(fs.len(), 1);
    assert_eq!(fs[0].inputs.as_ref().unwrap()[1], TensorSpec::new("y").dtype(DType::Float32).shape([-1, 3]));
    assert!(fs[0].doc.contains("[N, 3]"));
}

fn batched(name: &str, config: BatchConfig, runs: Arc<Mutex<Vec<usize>>>) -> Function {
    Function::batched(name, config, move |inputs, _args| {
        let x = &inputs[0];
        runs.lock().unwrap().push(x.shape()[0]);
        let y: Vec<f32> = f32s(x).iter().map(|v| v * 2.0 + 1.0).collect();
        Ok(vec![Tensor::from_vec(x.shape(), y)?])
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_callers_share_at_most_five_batches() {
    let runs = Arc::new(Mutex::new(Vec::new()));
    let cfg = BatchConfig { max_batch: 8, max_wait: Duration::from_millis(500), ..BatchConfig::default() };
    let (server, _d) = start(Server::builder().function(batched("model", cfg, runs.clone())), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..32 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let x = Tensor::from_vec([4], vec![i as f32; 4]).unwrap();
            let y = c.compute("model", vec![x]).await.unwrap();
            assert_eq!(y[0].shape(), [4], "each caller gets its own example back");
            assert_eq!(f32s(&y[0]), vec![i as f32 * 2.0 + 1.0; 4], "caller {i}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.iter().sum::<usize>(), 32);
    assert!(runs.len() <= 5, "the function ran {} times: {runs:?}", runs.len());
    assert!(runs.iter().all(|&n| n <= 8));
    let info = c.service_info().await.unwrap();
    let f = info.functions.iter().find(|f| f.name == "model").unwrap();
    assert_eq!((f.calls, f.batches), (32, runs.len() as u64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_wait_flushes_a_partial_batch() {
    let runs = Arc::new(Mutex::new(Vec::new()));
    let cfg = BatchConfig { max_batch: 8, max_wait: Duration::from_millis(30), ..BatchConfig::default() };
    let (server, _d) = start(Server::builder().function(batched("model", cfg, runs.clone())), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let calls = (0..3).map(|i| {
        let c = c.clone();
        async move { c.compute("model", vec![Tensor::from_vec([2], vec![i as f32; 2]).unwrap()]).await.unwrap() }
    });
    let outs = futures_util::future::join_all(calls).await;
    for (i, y) in outs.iter().enumerate() {
        assert_eq!(f32s(&y[0]), vec![i as f32 * 2.0 + 1.0; 2]);
    }
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.iter().sum::<usize>(), 3);
    assert!(runs.iter().all(|&n| n < 8), "partial batches ran without waiting for 8: {runs:?}");
    // A failing batch fails every caller in it.
    let fail = Function::batched("fail", cfg_fast(), |_, _| Err(Status::internal("model exploded")));
    let (server, _d) = start(Server::builder().function(fail), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let calls = (0..4).map(|_| {
        let c = c.clone();
        async move { c.compute("fail", vec![Tensor::zeros(DType::Float32, [1]).unwrap()]).await }
    });
    for r in futures_util::future::join_all(calls).await {
        assert!(r.unwrap_err().status().unwrap().message.contains("model exploded"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_with_different_arguments_never_share_a_batch() {
    let runs = Arc::new(Mutex::new(Vec::new()));
    let r = runs.clone();
    let cfg = BatchConfig { max_batch: 16, max_wait: Duration::from_millis(200), ..BatchConfig::default() };
    let scale = Function::batched("scale", cfg, move |inputs, args| {
        let factor = match args.get("factor") {
            Some(Value::Int(f)) => *f as f32,
            other => return Err(Status::invalid_argument(format!("factor: {other:?}"))),
        };
        r.lock().unwrap().push((inputs[0].shape()[0], factor));
        let y: Vec<f32> = f32s(&inputs[0]).iter().map(|v| v * factor).collect();
        Ok(vec![Tensor::from_vec(inputs[0].shape(), y)?])
    });
    let (server, _d) = start(Server::builder().function(scale), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let calls = (0..12).map(|i| {
        let c = c.clone();
        async move {
            let factor = 2 + i % 3;
            let args = Args::new().with("factor", factor);
            let out = c.call("scale", vec![Tensor::from_vec([2], vec![1.0f32; 2]).unwrap()], args).await.unwrap();
            assert_eq!(f32s(&out.tensors[0]), vec![factor as f32; 2], "caller {i} got another caller's factor");
        }
    });
    futures_util::future::join_all(calls).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.iter().map(|(n, _)| n).sum::<usize>(), 12);
    assert!(runs.len() < 12, "callers with the same arguments still share batches: {runs:?}");
    // A NaN equals nothing, itself included: its caller still gets its own
    // batch (here an error: the function takes integers), and the
    // function keeps serving.
    let x = || vec![Tensor::from_vec([2], vec![1.0f32; 2]).unwrap()];
    let e = c.call("scale", x(), Args::new().with("factor", f64::NAN)).await.unwrap_err();
    assert!(e.status().unwrap().message.contains("factor"), "{e}");
    let out = c.call("scale", x(), Args::new().with("factor", 5)).await.unwrap();
    assert_eq!(f32s(&out.tensors[0]), vec![5.0; 2]);
}

fn cfg_fast() -> BatchConfig {
    BatchConfig { max_batch: 4, max_wait: Duration::from_millis(20), ..BatchConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_run_report_cancel_and_expire() {
    let slow = Function::new_async("slow", |c| async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let factor = c.args.f64_or("factor", 1.0)?;
        Ok(Output { tensors: vec![Tensor::from_vec([1], vec![factor as f32])?], values: Value::from("done") })
    });
    let spins = Arc::new(AtomicUsize::new(0));
    let s2 = spins.clone();
    let forever = Function::new_async("forever", move |c| {
        let s = s2.clone();
        async move {
            while !c.ctx.is_cancelled() {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(Status::cancelled("stopped"))
        }
    });
    // The ttl outlasts the steps between the first task's end and the
    // refused submit below on a loaded machine (it was 300 ms: the first
    // task could expire first and free its slot).
    let tasks = TaskConfig { ttl: Duration::from_secs(2), max_tasks: 3 };
    let (server, _d) = start(Server::builder().function(slow).function(forever).tasks(tasks), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let id = c.submit("slow", vec![], Args::new().with("factor", 3)).await.unwrap();
    assert!(matches!(c.task_status(&id).await.unwrap(), TaskState::Pending | TaskState::Running));
    let e = c.task_result(&id, Duration::ZERO).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "not finished yet");
    let out = c.task_result(&id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(f32s(&out.tensors[0]), vec![3.0]);
    assert_eq!(out.values, Value::from("done"));
    assert_eq!(c.task_status(&id).await.unwrap(), TaskState::Done);
    // Cancel stops the work.
    let id2 = c.submit("forever", vec![], Args::new()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(c.cancel_task(&id2).await.unwrap(), TaskState::Cancelled);
    let before = spins.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(spins.load(Ordering::SeqCst), before, "a cancelled task keeps running");
    assert_eq!(c.task_result(&id2, Duration::ZERO).await.unwrap_err().code(), Code::Cancelled);
    // At most 3 tasks are held; finished ones expire after the ttl.
    let id3 = c.submit("slow", vec![], Args::new()).await.unwrap();
    let e = c.submit("slow", vec![], Args::new()).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    c.task_result(&id3, Duration::from_secs(5)).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for id in [&id, &id2, &id3] {
        loop {
            match c.task_status(id).await {
                Err(e) if e.code() == Code::NotFound => break,
                r => assert!(std::time::Instant::now() < deadline, "{id} did not expire: {r:?}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    c.submit("slow", vec![], Args::new()).await.unwrap();
    assert_eq!(c.task_status("task-nope").await.unwrap_err().code(), Code::NotFound);
}

/// `spin_async` (ticks until dropped) and `spin_sync` (ticks until its
/// context is cancelled, then counts that in `saw_cancel`), both counting
/// into `ticks`. Sync code cannot be interrupted: it checks its context.
fn spinning_functions(ticks: &Arc<AtomicUsize>, saw_cancel: &Arc<AtomicUsize>) -> tensorwire::ServerBuilder {
    let (t1, t2, seen) = (ticks.clone(), ticks.clone(), saw_cancel.clone());
    let spin_async = Function::new_async("spin_async", move |_c| {
        let t = t1.clone();
        async move {
            loop {
                t.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let spin_sync = Function::new("spin_sync", move |c| {
        while !c.ctx.is_cancelled() {
            t2.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(5));
        }
        seen.fetch_add(1, Ordering::SeqCst);
        Err(Status::cancelled("cancelled"))
    });
    Server::builder().function(spin_async).function(spin_sync)
}

/// Waits (at most 10 s) until `ticks` stops moving for 200 ms; true when it did.
async fn settles(ticks: &AtomicUsize) -> bool {
    let give_up = Instant::now() + Duration::from_secs(10);
    let mut last = ticks.load(Ordering::SeqCst);
    while Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = ticks.load(Ordering::SeqCst);
        if now == last {
            return true;
        }
        last = now;
    }
    false
}

/// A client that drops a call (no deadline sent: the caller's own timeout,
/// as a `select!` or Ctrl-C would) stops the work on the server: async
/// handlers are dropped, sync ones see `is_cancelled()`; the connection
/// serves the next call. Over gRPC the client's reset of the call tells the
/// server (the response body is dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_client_goes_away_stops_on_the_server() {
    let ticks = Arc::new(AtomicUsize::new(0));
    let saw_cancel = Arc::new(AtomicUsize::new(0));
    let functions = || spinning_functions(&ticks, &saw_cancel);
    for scheme in ["unix", "tcp", "shm", "quic", "grpc"] {
        let (server, _d) = start(functions(), scheme).await;
        let c = Client::connect(&server.url()).await.unwrap();
        for f in ["spin_async", "spin_sync"] {
            // The call runs until the handler has ticked, then is dropped.
            let before = ticks.load(Ordering::SeqCst);
            let ran = async {
                while ticks.load(Ordering::SeqCst) == before {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::select! {
                r = c.call(f, vec![], Args::new()) => panic!("{scheme} {f} returned: {r:?}"),
                _ = tokio::time::timeout(Duration::from_secs(20), ran) => {}
            }
            assert!(ticks.load(Ordering::SeqCst) > before, "{scheme} {f} never ran");
            assert!(settles(&ticks).await, "{scheme}: {f} kept running after its client went away");
            // The connection goes on serving.
            assert!(c.health().await.unwrap(), "{scheme}");
        }
        server.shutdown().await;
    }
    assert_eq!(saw_cancel.load(Ordering::SeqCst), 5, "each sync handler saw its cancellation");
}

/// Sync handlers that never look at `is_cancelled` run on after their
/// clients went away, but keep their place on the connection: once as
/// many of them run as it may open streams, a new call there is refused
/// with RESOURCE_EXHAUSTED (not queued on the blocking pool without bound)
/// until they finish; health is still answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_sync_calls_keep_their_place_on_the_connection() {
    let (started, finished) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, f, r) = (started.clone(), finished.clone(), release.clone());
    let stubborn = Function::new("stubborn", move |_c| {
        s.fetch_add(1, Ordering::SeqCst);
        let t0 = Instant::now();
        while !r.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(5));
        }
        f.fetch_add(1, Ordering::SeqCst);
        Ok(Output::default())
    });
    let quick_runs = Arc::new(AtomicUsize::new(0));
    let q = quick_runs.clone();
    let quick = Function::new("quick", move |_c| {
        q.fetch_add(1, Ordering::SeqCst);
        Ok(Output::default())
    });
    let mut cfg = ServerConfig::default();
    cfg.transport.max_concurrent_streams = 4;
    let (server, _d) = start(Server::builder().config(cfg).function(stubborn).function(quick), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    for i in 0..4 {
        let ran = async {
            while started.load(Ordering::SeqCst) <= i {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::select! {
            r = c.call("stubborn", vec![], Args::new()) => panic!("returned: {r:?}"),
            _ = tokio::time::timeout(Duration::from_secs(20), ran) => {}
        }
    }
    assert_eq!(started.load(Ordering::SeqCst), 4);
    // Once the four calls' streams have ended on the server, new calls
    // are refused (until then they may still run).
    let refused = async {
        loop {
            match c.call("quick", vec![], Args::new()).await {
                Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                Err(e) => return e,
            }
        }
    };
    let e = tokio::time::timeout(Duration::from_secs(20), refused).await.expect("a call is refused");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(e.to_string().contains("still running"), "{e}");
    let runs = quick_runs.load(Ordering::SeqCst);
    assert_eq!(c.call("quick", vec![], Args::new()).await.unwrap_err().code(), Code::ResourceExhausted);
    assert_eq!(quick_runs.load(Ordering::SeqCst), runs, "a refused call does not run");
    assert!(c.health().await.unwrap(), "health is answered");
    assert_eq!(finished.load(Ordering::SeqCst), 0);
    // When they finish, the connection serves again.
    release.store(true, Ordering::SeqCst);
    let served = async {
        loop {
            match c.call("quick", vec![], Args::new()).await {
                Ok(_) => return,
                Err(e) => assert_eq!(e.code(), Code::ResourceExhausted, "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), served).await.expect("served again");
    assert_eq!(finished.load(Ordering::SeqCst), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_stop_server_work() {
    let ticks = Arc::new(AtomicUsize::new(0));
    let (server, _d) = start(spinning_functions(&ticks, &Arc::new(AtomicUsize::new(0))), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    for f in ["spin_async", "spin_sync"] {
        let start = Instant::now();
        let e =
            c.call_with(f, vec![], Args::new(), &CallOptions::timeout(Duration::from_millis(150))).await.unwrap_err();
        assert!(matches!(e, CallError::Timeout(_)) || e.code() == Code::DeadlineExceeded, "{f}: {e}");
        assert!(start.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(150)).await;
        let a = ticks.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let b = ticks.load(Ordering::SeqCst);
        assert!(a > 0);
        assert_eq!(a, b, "{f} kept running after its deadline");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_idempotent_calls_are_not_retried_once_sent() {
    let runs = Arc::new(AtomicUsize::new(0));
    let dir = tempfile::tempdir().unwrap();
    let url = format!("unix://{}", dir.path().join("s.sock").display());
    let mk = |runs: Arc<AtomicUsize>| {
        Server::builder().function(Function::new_async("bump", move |_c| {
            let r = runs.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(Output::value(1))
            }
        }))
    };
    let cfg = ClientConfig {
        retry: RetryPolicy::Fixed { delay: Duration::from_millis(100), max_retries: 5 },
        ..ClientConfig::default()
    };
    for idempotent in [false, true] {
        runs.store(0, Ordering::SeqCst);
        let first = mk(runs.clone()).build().start([url.as_str()]).await.unwrap();
        let c = Client::connect_with(&url, cfg.clone()).await.unwrap();
        let opts = CallOptions { idempotent, ..CallOptions::default() };
        let call = tokio::spawn({
            let c = c.clone();
            async move { c.call_with("bump", vec![], Args::new(), &opts).await }
        });
        // The server dies with the call in flight (running), and comes back.
        wait_until(Duration::from_secs(10), || runs.load(Ordering::SeqCst) > 0).await;
        first.abort().await;
        let second = mk(runs.clone()).build().start([url.as_str()]).await.unwrap();
        let r = call.await.unwrap();
        if idempotent {
            assert_eq!(r.unwrap().values, Value::Int(1));
            assert_eq!(runs.load(Ordering::SeqCst), 2, "retried once on the new server");
            assert!(c.statistics().retries >= 1);
        } else {
            let e = r.unwrap_err();
            assert!(matches!(e, CallError::Stream(_)), "{e}");
            assert_eq!(runs.load(Ordering::SeqCst), 1, "a non-idempotent call ran twice");
            assert_eq!(c.statistics().retries, 0);
            // The next call reconnects by itself.
            assert_eq!(c.call("bump", vec![], Args::new()).await.unwrap().values, Value::Int(1));
        }
        second.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statistics_and_service_info_match_what_happened() {
    let (server, _d) =
        start(store_server(ServerConfig { service_name: "stats-test".into(), ..ServerConfig::default() }), "tcp").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let x = Tensor::zeros(DType::Float32, [256]).unwrap(); // 1 KiB
    for _ in 0..5 {
        c.compute("identity", vec![x.clone()]).await.unwrap();
    }
    for _ in 0..2 {
        c.compute("missing", vec![x.clone()]).await.unwrap_err();
    }
    let s = c.statistics();
    assert_eq!((s.requests, s.successes, s.failures, s.retries), (7, 5, 2, 0));
    assert_eq!(s.bytes_sent, 7 * 1024);
    assert_eq!(s.bytes_received, 5 * 1024);
    assert!(s.latency_p50_ms > 0.0 && s.latency_p99_ms >= s.latency_p50_ms);
    assert!(s.avg_network_time_ms >= 0.0);
    // The server lets go of a call just after its reply is out.
    wait_until(Duration::from_secs(10), || server.info().active_calls == 0).await;
    let info = c.service_info().await.unwrap();
    assert_eq!(info.service_name, "stats-test");
    assert_eq!(info.version, tensorwire::VERSION);
    assert_eq!(info.transports, vec!["tcp"]);
    assert!(info.codecs.contains(&"torch".to_string()) && info.devices.contains(&"cpu".to_string()));
    // 7 calls, plus this info call in progress.
    assert_eq!((info.calls, info.failures, info.active_calls), (8, 2, 1));
    assert_eq!(info.bytes_received, 7 * 1024);
    let f = info.functions.iter().find(|f| f.name == "identity").unwrap();
    assert_eq!((f.calls, f.failures), (5, 0));
    assert_eq!(server.info().calls, 8);
}

#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_endpoint_reports_the_counters() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (server, _d) = start(store_server(ServerConfig::default()), "unix").await;
    let m = server.serve_metrics("127.0.0.1:0").await.unwrap();
    let c = Client::connect(&server.url()).await.unwrap();
    for _ in 0..3 {
        c.compute("identity", vec![Tensor::zeros(DType::UInt8, [10]).unwrap()]).await.unwrap();
    }
    c.compute("nope", vec![]).await.unwrap_err();
    let mut s = tokio::net::TcpStream::connect(m.local_addr()).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    for line in [
        "tensorwire_calls_total 4",
        "tensorwire_call_failures_total 1",
        "tensorwire_received_bytes_total 30",
        "tensorwire_function_calls_total{function=\"identity\"} 3",
        "tensorwire_serving 1",
    ] {
        assert!(body.contains(line), "missing {line:?} in\n{body}");
    }
    let mut s = tokio::net::TcpStream::connect(m.local_addr()).await.unwrap();
    s.write_all(b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 404"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_not_serving_during_graceful_shutdown() {
    let slow = Function::new_async("slow", |_c| async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        Ok(Output::value("finished"))
    });
    let (server, _d) = start(Server::builder().function(slow), "unix").await;
    let c = Client::connect(&server.url()).await.unwrap();
    // Refused calls are normally retried; this client shows the refusal itself.
    let no_retry = ClientConfig { retry: RetryPolicy::None, ..ClientConfig::default() };
    let c2 = Client::connect_with(&server.url(), no_retry).await.unwrap();
    assert!(c.health().await.unwrap());
    let in_flight = tokio::spawn({
        let c = c.clone();
        async move { c.call("slow", vec![], Args::new()).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let shutdown = tokio::spawn(server.shutdown());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!c.health().await.unwrap(), "NOT_SERVING while draining");
    let e = c2.call("slow", vec![], Args::new()).await.unwrap_err();
    assert_eq!(e.code(), Code::Refused, "new calls are refused while draining: {e}");
    // The call that was in flight finishes.
    assert_eq!(in_flight.await.unwrap().unwrap().values, Value::from("finished"));
    shutdown.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_of_a_batched_function_are_coalesced_on_the_client() {
    let runs = Arc::new(Mutex::new(Vec::new()));
    let cfg = BatchConfig { max_batch: 16, max_wait: Duration::from_millis(20), ..BatchConfig::default() };
    let (server, _d) = start(Server::builder().function(batched("model", cfg, runs.clone())), "tcp").await;
    let c = Client::connect(&server.url()).await.unwrap();
    let calls = (0..100).map(|i| {
        let c = c.clone();
        async move {
            let x = Tensor::from_vec([3], vec![i as f32, 0.5, -1.0]).unwrap();
            let y = c.compute("model", vec![x]).await.unwrap();
            assert_eq!(y[0].shape(), [3]);
            assert_eq!(f32s(&y[0]), vec![i as f32 * 2.0 + 1.0, 2.0, -1.0]);
        }
    });
    futures_util::future::join_all(calls).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.iter().sum::<usize>(), 100);
    assert!(runs.iter().all(|&n| n <= 16), "{runs:?}");
    // Each caller is counted, though far fewer calls crossed the wire.
    let s = c.statistics();
    assert_eq!((s.requests, s.successes), (100, 100));
    let info = c.service_info().await.unwrap();
    assert!(info.calls < 60, "{} wire calls for 100 examples", info.calls);
    // Coalescing can be turned off.
    let plain =
        Client::connect_with(&server.url(), ClientConfig { coalesce: false, ..ClientConfig::default() }).await.unwrap();
    let y = plain.compute("model", vec![Tensor::from_vec([3], vec![1.0f32; 3]).unwrap()]).await.unwrap();
    assert_eq!(f32s(&y[0]), vec![3.0; 3]);
}

/// A call's future is what a caller's task holds and moves: it stays small
/// (the rare connect path is boxed away; it once made every call's future
/// ~10 KB, copied on each call). A bound with room for compiler changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_futures_stay_small() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "tcp").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let t = Tensor::zeros(DType::UInt8, [16]).unwrap();
    let sizes = [
        ("compute", std::mem::size_of_val(&client.compute("identity", vec![t.clone()]))),
        ("call", std::mem::size_of_val(&client.call("identity", vec![t.clone()], Args::new()))),
        ("send", std::mem::size_of_val(&client.send(vec![t.clone()]))),
        ("fetch", std::mem::size_of_val(&client.fetch(Default::default()))),
    ];
    for (what, size) in sizes {
        assert!(size <= 4096, "a {what} future is {size} bytes");
    }
    // The futures were never polled: the client still works.
    assert_eq!(client.compute("identity", vec![t.clone()]).await.unwrap().len(), 1);
}
