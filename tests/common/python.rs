//! Real Python peers (PyTorch, grpcio, safetensors) for interop tests.
//!
//! `tests/run.sh` installs them into a cached virtualenv and sets
//! `TENSORWIRE_PYTHON`; without it these tests print why they skip, unless
//! `TENSORWIRE_REQUIRE_PYTHON=1` (set by the test command) makes that a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The interpreter with the peers installed, or None (after printing why).
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("TENSORWIRE_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var_os("TENSORWIRE_REQUIRE_PYTHON").is_some() => {
            panic!("TENSORWIRE_REQUIRE_PYTHON is set but TENSORWIRE_PYTHON is not: run tests/run.sh")
        }
        None => {
            eprintln!("skipping: Python peers not set up (run tests/run.sh, which installs them)");
            None
        }
    }
}

/// The path of a helper script in tests/python.
pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(name)
}

/// Runs `python script args...`, panicking with its output on failure.
pub fn run(py: &Path, script_name: &str, args: &[&str]) -> String {
    let out = Command::new(py).arg(script(script_name)).args(args).output().expect("python runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{script_name} {args:?} failed:\n{text}");
    text
}
