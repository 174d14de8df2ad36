//! A 1 GiB state dict of ~500 tensors moved as one object
//! (`put_state_dict` / `get_state_dict`) vs the same tensors sent and
//! fetched one call each, over Unix sockets (with and without the
//! shared-memory upgrade) and TCP on loopback. The server runs on its own
//! thread and runtime, as a second process would; medians of 5 rounds, the
//! state dict and its baseline alternating in each.
//!
//! ```sh
//! cargo run --release --example state_dict_bench [-- unix,tcp]
//! ```

use std::time::{Duration, Instant};

use tensorwire::builtins::random_tensor;
use tensorwire::{Client, DType, Server, StoreService, Tensor};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ROUNDS: usize = 5;

/// ~1 GiB: 240 weights of 4 MiB (f32), 240 biases of 16 KiB, 15 bf16 weights of 4 MiB.
fn state_dict() -> Vec<(String, Tensor)> {
    let mut sd = Vec::new();
    for i in 0..240u64 {
        sd.push((format!("layers.{i}.weight"), random_tensor(DType::Float32, &[1024, 1024], i).unwrap()));
        sd.push((format!("layers.{i}.bias"), random_tensor(DType::Float32, &[4096], 1000 + i).unwrap()));
    }
    for i in 0..15u64 {
        sd.push((format!("heads.{i}.weight"), random_tensor(DType::BFloat16, &[2048, 1024], 2000 + i).unwrap()));
    }
    sd
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn timed<T>(f: impl std::future::Future<Output = T>) -> (T, f64) {
    let t = Instant::now();
    let r = f.await;
    (r, t.elapsed().as_secs_f64())
}

fn main() -> Result<(), BoxError> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "unix,unix-noshm,tcp".into());
    let sd = state_dict();
    let bytes: u64 = sd.iter().map(|(_, t)| t.nbytes() as u64).sum();
    let gib = bytes as f64 / (1u64 << 30) as f64;
    println!("state dict: {} tensors, {bytes} bytes ({gib:.3} GiB)", sd.len());
    let dir = tempfile::tempdir()?;
    for transport in which.split(',') {
        let url = match transport {
            "unix" => format!("unix://{}", dir.path().join("sd.sock").display()),
            "unix-noshm" => format!("unix://{}?shm=0", dir.path().join("sd-noshm.sock").display()),
            "tcp" => "tcp://127.0.0.1:0?shm=0".to_string(),
            other => return Err(format!("unknown transport {other}").into()),
        };
        // The server: its own thread and runtime.
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server_thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async move {
                let server =
                    Server::builder().service(StoreService::new(4 << 30)).build().start([url.as_str()]).await.unwrap();
                tx.send(server.url()).unwrap();
                let _ = stop_rx.await;
                server.shutdown().await;
            });
        });
        let url = rx.recv()?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let (put, get, sends, fetches, replace) = rt.block_on(async {
            let client = Client::connect(&url).await?;
            let (mut put, mut get, mut sends, mut fetches, mut replace) = (vec![], vec![], vec![], vec![], vec![]);
            let single = |k: &str| format!("single.{k}");
            for round in 0..ROUNDS {
                // The state dict and its baseline (one send call per tensor)
                // each into an empty store, in alternating order.
                for state in [round % 2 == 0, round % 2 == 1] {
                    client.remove_prefix("").await?;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let t = Instant::now();
                    if state {
                        client.put_state_dict("m", &sd).await?;
                        put.push(t.elapsed().as_secs_f64());
                    } else {
                        for (k, v) in &sd {
                            client.send(vec![v.clone().with_name(single(k))]).await?;
                        }
                        sends.push(t.elapsed().as_secs_f64());
                    }
                }
                client.put_state_dict("m", &sd).await?;
                for (k, v) in &sd {
                    client.send(vec![v.clone().with_name(single(k))]).await?;
                }
                // Fetching: both keep what arrives until the end (1 GiB of
                // fresh memory either way), in alternating order.
                for state in [round % 2 == 0, round % 2 == 1] {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let t = Instant::now();
                    if state {
                        let got = client.get_state_dict("m").await?;
                        get.push(t.elapsed().as_secs_f64());
                        assert_eq!(got.len(), sd.len());
                    } else {
                        let mut got = Vec::with_capacity(sd.len());
                        for (k, _) in &sd {
                            got.push(client.fetch_one(&single(k)).await?);
                        }
                        fetches.push(t.elapsed().as_secs_f64());
                    }
                }
                // A new version over the old one: the server holds both until it is complete.
                client.remove_prefix("single.").await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let (r, s) = timed(client.put_state_dict("m", &sd)).await;
                r?;
                replace.push(s);
            }
            client.remove_prefix("").await?;
            Ok::<_, BoxError>((median(put), median(get), median(sends), median(fetches), median(replace)))
        })?;
        drop(rt);
        let _ = stop_tx.send(());
        server_thread.join().map_err(|_| "server thread panicked")?;
        println!(
            "{transport:<11} put_state_dict {:.3} s ({:.2} GiB/s) vs {} single sends {:.3} s ({:.2} GiB/s): {:.2}x | \
             get_state_dict {:.3} s ({:.2} GiB/s) vs single fetches {:.3} s ({:.2} GiB/s): {:.2}x | \
             replacing put {:.3} s ({:.2} GiB/s)",
            put,
            gib / put,
            sd.len(),
            sends,
            gib / sends,
            sends / put,
            get,
            gib / get,
            fetches,
            gib / fetches,
            fetches / get,
            replace,
            gib / replace,
        );
    }
    Ok(())
}
