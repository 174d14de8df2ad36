//! Many small `identity` calls on one connection, server and client in one
//! process on separate threads: a steady load to profile per-call work with
//! (`perf record`, `valgrind --tool=callgrind`).
//!
//! ```text
//! cargo run --release --example calls -- unix 100000 64 50
//! #                                       scheme calls in-flight spin-µs
//! ```
//! The scheme is one of `tcp`, `unix`, `shm` (any may carry client URL
//! options: `unix?shm=0`). With spin 0 both sides sleep as soon as they have
//! nothing to do, so an instruction count (callgrind) measures the work per
//! call and not the polling.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tensorwire::{Client, ClientConfig, DType, Server, ServerConfig, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let label = args.first().map_or("unix", String::as_str).to_string();
    let calls: u64 = args.get(1).map_or(Ok(100_000), |s| s.parse())?;
    let in_flight: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let spin = Duration::from_micros(args.get(3).map_or(Ok(50), |s| s.parse())?);
    let (scheme, options) = label.split_once('?').map_or((label.as_str(), ""), |(s, o)| (s, o));
    let dir = std::env::temp_dir().join(format!("tensorwire-calls-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let listen = match scheme {
        "tcp" => "tcp://127.0.0.1:0".to_string(),
        "unix" => format!("unix://{}", dir.join("s.sock").display()),
        "shm" => format!("shm://tensorwire-calls-{}", std::process::id()),
        other => return Err(format!("unknown scheme {other:?}: tcp, unix or shm").into()),
    };

    // The server: its own thread and single-threaded runtime.
    let (url_tx, url_rx) = std::sync::mpsc::channel::<Result<String, String>>();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
        rt.block_on(async move {
            let mut cfg = ServerConfig::default();
            cfg.transport.spin = spin;
            let mut b = Server::builder().config(cfg);
            for f in tensorwire::builtins::builtin_functions() {
                b = b.function(f);
            }
            match b.build().start([listen.as_str()]).await {
                Ok(s) => {
                    let _ = url_tx.send(Ok(s.url()));
                    let _ = stop_rx.await;
                    s.shutdown().await;
                }
                Err(e) => drop(url_tx.send(Err(e.to_string()))),
            }
        })
    });
    let mut url = url_rx.recv()??;
    if !options.is_empty() {
        url.push(if url.contains('?') { '&' } else { '?' });
        url.push_str(options);
    }

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let rate = rt.block_on(async {
        let mut cfg = ClientConfig::default();
        cfg.transport.spin = spin;
        let client = Client::connect_with(&url, cfg).await?;
        let t = Tensor::zeros(DType::UInt8, [4096])?;
        for _ in 0..1000 {
            client.compute("identity", vec![t.clone()]).await?;
        }
        let left = Arc::new(AtomicU64::new(calls));
        let start = Instant::now();
        let tasks: Vec<_> = (0..in_flight)
            .map(|_| {
                let (c, t, left) = (client.clone(), t.clone(), left.clone());
                tokio::spawn(async move {
                    while left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1)).is_ok() {
                        c.compute("identity", vec![t.clone()]).await?;
                    }
                    Ok::<_, tensorwire::CallError>(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok::<_, Box<dyn std::error::Error>>(calls as f64 / start.elapsed().as_secs_f64())
    })?;
    println!("{url}: {calls} calls, {in_flight} in flight, spin {spin:?}: {rate:.0} calls/s");
    let _ = stop_tx.send(());
    let _ = server.join();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
