//! UCX's own benchmark, `ucx_perftest` (package `ucx-utils`), as the
//! baseline of `ucx://`: a server and a client process on loopback with the
//! same `UCX_*` environment as the bench, so both use the same UCX
//! transports. Imports nothing from the rest of the harness.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The `Final:` row of one `ucx_perftest` run.
#[derive(Clone, Copy, Debug)]
pub struct Perftest {
    /// Median latency (`*_lat` tests: one way) or overhead, in microseconds.
    pub p50_us: f64,
    /// Overall bandwidth in GiB/s (ucx_perftest's "MB" is MiB).
    pub gib_per_s: f64,
}

/// Runs `ucx_perftest -t test -s size -n iters` between two processes.
pub fn ucx_perftest(test: &str, size: usize, iters: usize) -> Result<Perftest, BoxError> {
    ucx_perftest_on(test, size, iters, None)
}

/// [`ucx_perftest`] with `UCX_TLS=tls` for both processes (the bench's own
/// `UCX_*` environment otherwise).
pub fn ucx_perftest_on(test: &str, size: usize, iters: usize, tls: Option<&str>) -> Result<Perftest, BoxError> {
    let env: Vec<(&str, &str)> = tls.map(|t| ("UCX_TLS", t)).into_iter().collect();
    let mut last = String::new();
    // The client fails when it comes before the server listens: a few
    // tries with a longer head start each.
    for attempt in 1..=5u64 {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
        let mut server = Command::new("ucx_perftest")
            .envs(env.iter().copied())
            .args(["-p", &port])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot run ucx_perftest (apt-get install ucx-utils): {e}"))?;
        std::thread::sleep(Duration::from_millis(150 * attempt));
        let warm = (iters / 10).max(1).to_string();
        let out = Command::new("ucx_perftest")
            .envs(env.iter().copied())
            .args(["127.0.0.1", "-p", &port, "-t", test, "-s", &size.to_string(), "-n", &iters.to_string()])
            .args(["-w", &warm])
            .output();
        let _ = server.kill();
        let _ = server.wait();
        let out = out?;
        let text = String::from_utf8_lossy(&out.stdout);
        let Some(row) = text.lines().find(|l| l.starts_with("Final:")) else {
            last = String::from_utf8_lossy(&out.stderr).trim().to_string();
            continue;
        };
        // Final: iterations p50 average overall bw_average bw_overall rate_average rate_overall
        let v: Vec<f64> = row.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        if v.len() < 6 {
            return Err(format!("unexpected ucx_perftest row: {row}").into());
        }
        return Ok(Perftest { p50_us: v[1], gib_per_s: v[5] / 1024.0 });
    }
    Err(format!("ucx_perftest -t {test} printed no result: {last}").into())
}
