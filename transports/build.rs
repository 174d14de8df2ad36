//! With the `ucx` feature on, checks that UCX's development files are
//! installed and tells the crate where libucp lives; without it, does nothing
//! (the crate then needs no UCX at all).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    if std::env::var_os("CARGO_FEATURE_UCX").is_none() {
        return;
    }
    // pkg-config is the usual way; the header check covers machines with
    // UCX installed but no pkg-config binary.
    let libdir = Command::new("pkg-config")
        .args(["--variable=libdir", "ucx"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let header = ["/usr/include/ucp/api/ucp.h", "/usr/local/include/ucp/api/ucp.h", "/opt/ucx/include/ucp/api/ucp.h"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if libdir.is_none() && !header {
        panic!(
            "the `ucx` feature needs UCX (libucp, >= 1.13): install it with `apt-get install libucx-dev` \
             (Debian/Ubuntu; `dnf install ucx-devel` on Fedora/RHEL), or make `pkg-config ucx` find your UCX build \
             through PKG_CONFIG_PATH"
        );
    }
    // The library is opened at run time (see src/ucx/ffi.rs), so a binary
    // built here reports a clear error instead of failing to start on a
    // machine without UCX; the directory found here is tried first.
    println!("cargo:rustc-env=TENSORWIRE_UCX_LIBDIR={}", libdir.unwrap_or_default());
}
