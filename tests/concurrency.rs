//! 500 clients at once on each of tcp, tcps, unix, quic and grpc, each with
//! its own connection, each moving a 1–4 MiB tensor to the server and back
//! (the built-in `identity` function): every result bit-exact, and the
//! process's open descriptors back to where they were once the clients are
//! gone. Ignored by default (each moves ~2.5 GB through loopback and holds
//! ~1,000 sockets); `tests/run.sh` runs them:
//! `cargo nextest run --test concurrency --run-ignored only`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{Client, DType, ServerConfig};

const CLIENTS: usize = 500;

/// Descriptors open in this process now.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Raises the soft open-file limit to the hard one (500 clients and their
/// server in one process hold more than the usual soft limit of 1,024).
fn raise_nofile() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit only read and write the struct given.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    r.rlim_cur
}

async fn five_hundred_clients(scheme: &str) {
    let limit = raise_nofile();
    assert!(limit >= 2 * CLIENTS as u64 + 100, "open-file limit {limit} is too low for {CLIENTS} clients");
    let config =
        ServerConfig { max_connections: 4 * CLIENTS, max_connections_per_peer: 4 * CLIENTS, ..Default::default() };
    let (server, _dir) = start(store_server(config), scheme).await;
    let url = server.url();
    let before = open_fds();
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..CLIENTS {
        let url = url.clone();
        tasks.spawn(async move {
            // 1 MiB to 4 MiB, a different size and content per client.
            let n = (1 << 18) + (i * 7919) % (3 << 18);
            let x = random_tensor(DType::Float32, &[n], i as u64 + 1).unwrap();
            let c = Client::connect(&url).await.map_err(|e| format!("client {i}: connect: {e}"))?;
            let y = c.compute("identity", vec![x.clone()]).await.map_err(|e| format!("client {i}: {e}"))?;
            if y.len() != 1 || y[0].crc32c().ok() != x.crc32c().ok() || y[0].shape() != x.shape() {
                return Err(format!("client {i}: the result differs from what it sent"));
            }
            c.disconnect();
            Ok::<usize, String>(x.nbytes())
        });
    }
    let (mut ok, mut bytes, mut errors) = (0, 0, Vec::new());
    while let Some(r) = tasks.join_next().await {
        match r.expect("client task panicked") {
            Ok(n) => {
                ok += 1;
                bytes += n;
            }
            Err(e) => errors.push(e),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!("{scheme}: {ok}/{CLIENTS} clients, {:.2} GiB each way in {secs:.1} s", bytes as f64 / (1u64 << 30) as f64);
    assert!(errors.is_empty(), "{} of {CLIENTS} clients failed on {scheme}, first: {}", errors.len(), errors[0]);
    // The server lets go of each connection as its client closes; give it
    // the time that takes (a deadline, not a timing assertion).
    let deadline = Instant::now() + Duration::from_secs(30);
    while open_fds() > before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = open_fds();
    assert!(after <= before, "{scheme}: {after} descriptors open after the clients left, {before} before");
    server.shutdown().await;
}

macro_rules! at_scale {
    ($($name:ident => $scheme:literal),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "slow: 500 clients moving ~2.5 GB; tests/run.sh runs it"]
        async fn $name() {
            five_hundred_clients($scheme).await
        }
    )*};
}

at_scale!(
    five_hundred_clients_tcp => "tcp",
    five_hundred_clients_tcps => "tcps",
    five_hundred_clients_unix => "unix",
    five_hundred_clients_quic => "quic",
    five_hundred_clients_grpc => "grpc",
);
