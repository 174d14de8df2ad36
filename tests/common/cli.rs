//! The `tensorwire` binary as scripts use it: run a command, read its JSON
//! line, keep a `serve` process for the length of a test.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value as Json;

/// The `tensorwire` binary.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tensorwire"))
}

/// Runs it; panics with its output unless it succeeds; returns stdout.
pub fn run_ok(args: &[&str]) -> String {
    let out = bin().args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "tensorwire {args:?} failed:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// The JSON object on the last line of `out`.
pub fn last_json(out: &str) -> Json {
    serde_json::from_str(out.trim().lines().last().unwrap()).unwrap()
}

/// A `tensorwire serve` process, killed when dropped.
pub struct Served(pub Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tensorwire serve --listen url` and waits until it is healthy.
pub fn serve(url: &str) -> Served {
    let child = bin().args(["serve", "--listen", url, "--log-level", "warn"]).stdout(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    while !bin().args(["health", "--to", url]).stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap().success() {
        assert!(start.elapsed() < Duration::from_secs(20), "server did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Served(child)
}
