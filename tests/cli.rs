//! The `tensorwire` command line, as scripts use it: a real server process,
//! send/fetch with --json, call, info, health, and graceful shutdown on SIGTERM.

mod common;

use std::process::{Command, Stdio};

use common::cli::*;

#[test]
fn send_fetch_call_info_health_and_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("unix://{}", dir.path().join("cli.sock").display());
    let mut server = serve(&url);
    let sent =
        last_json(&run_ok(&["send", "--to", &url, "--random", "64,1024", "--dtype", "bf16", "--name", "w", "--json"]));
    assert_eq!(sent["bytes"], 64 * 1024 * 2);
    assert!(sent["seconds"].as_f64().unwrap() > 0.0 && sent["gib_per_s"].as_f64().unwrap() > 0.0);
    let out = dir.path().join("w.pt");
    let fetched =
        last_json(&run_ok(&["fetch", "--from", &url, "--name", "w", "--out", out.to_str().unwrap(), "--json"]));
    assert_eq!(fetched["crc32c"], sent["crc32c"], "sender and fetcher agree on the data");
    assert_eq!(fetched["dtype"], "bfloat16");
    assert!(out.exists());
    // The written file goes back in with --file (and keeps its data).
    let resent = last_json(&run_ok(&[
        "send",
        "--to",
        &url,
        "--file",
        out.to_str().unwrap(),
        "--name",
        "w2",
        "--count",
        "3",
        "--json",
    ]));
    assert_eq!(resent["crc32c"], sent["crc32c"]);
    assert_eq!(resent["bytes"], 3 * 64 * 1024 * 2);
    let called = last_json(&run_ok(&[
        "call",
        "--to",
        &url,
        "scale",
        "--input",
        "random:4,4:f32",
        "--arg",
        "factor=2",
        "--json",
    ]));
    assert_eq!(called["tensors"][0]["shape"], serde_json::json!([4, 4]));
    let info = last_json(&run_ok(&["info", "--to", &url, "--json"]));
    assert_eq!(info["service_name"], "tensorwire");
    assert!(info["functions"].as_array().unwrap().iter().any(|f| f["name"] == "identity"));
    // Graceful shutdown on SIGTERM: exit 0, then health fails.
    let pid = server.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = server.0.wait().unwrap();
    assert!(status.success(), "serve exited with {status}");
    let health = bin().args(["health", "--to", &url]).stdout(Stdio::null()).stderr(Stdio::null()).status().unwrap();
    assert!(!health.success(), "health must fail once the server is gone");
    assert!(!dir.path().join("cli.sock").exists(), "the socket file is cleaned up");
}

#[test]
fn bad_arguments_fail_with_a_clear_message() {
    let out = bin().args(["send", "--to", "tcp://127.0.0.1:1", "--random", "2,x"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad shape"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = bin().args(["fetch", "--from", "bogus://x", "--name", "w"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown scheme"));
    let out = bin()
        .args(["send", "--to", "unix:///nonexistent/tw.sock", "--random", "2", "--dtype", "float33"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown dtype"));
}

#[test]
fn a_failed_fetch_leaves_the_old_file_and_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("unix://{}", dir.path().join("atomic.sock").display());
    let _server = serve(&url);
    run_ok(&["send", "--to", &url, "--random", "16,16", "--name", "good"]);
    let out = dir.path().join("model.pt");
    run_ok(&["fetch", "--from", &url, "--name", "good", "--out", out.to_str().unwrap()]);
    let before = std::fs::read(&out).unwrap();
    let failed =
        bin().args(["fetch", "--from", &url, "--name", "missing", "--out", out.to_str().unwrap()]).output().unwrap();
    assert!(!failed.status.success());
    let err = String::from_utf8_lossy(&failed.stderr);
    assert!(err.contains("no tensor named \"missing\""), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), before, "the old file is untouched");
    let names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.contains(".tmp-")), "no temporary left: {names:?}");
}

#[test]
fn sizes_the_process_cannot_allocate_are_clear_errors_not_aborts() {
    // 64 GiB of float32 under a 4 GiB address-space limit: an error, exit 1.
    if Command::new("prlimit").arg("--version").output().is_err() {
        eprintln!("skipping: prlimit (util-linux) is not installed");
        return;
    }
    let out = Command::new("prlimit")
        .args(["--as=4294967296", "--"])
        .arg(env!("CARGO_BIN_EXE_tensorwire"))
        .args(["send", "--to", "tcp://127.0.0.1:9", "--random", "16384,1048576"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot allocate"), "{err}");
}

#[test]
fn send_delta_stores_the_new_version_and_names_a_wrong_base() {
    use tensorwire::codecs::delta::ContentHash;
    use tensorwire::codecs::safetensors;
    use tensorwire::{DType, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let url = format!("unix://{}", dir.path().join("delta.sock").display());
    let _server = serve(&url);
    let v1: Vec<f32> = (0..100_000).map(|i| (i as f32 * 0.37).sin() * 0.05).collect();
    let mut v2 = v1.clone();
    for x in v2.iter_mut().step_by(40) {
        *x += 1e-3;
    }
    let write = |name: &str, v: Vec<f32>| {
        let t = Tensor::from_vec([v.len()], v).unwrap();
        let path = dir.path().join(name);
        let segs = safetensors::save(&[("w".into(), t.clone())], None).unwrap();
        std::fs::write(&path, segs.iter().flat_map(|s| s.iter().copied()).collect::<Vec<u8>>()).unwrap();
        (path.to_str().unwrap().to_string(), t)
    };
    let (p1, t1) = write("v1.safetensors", v1);
    let (p2, t2) = write("v2.safetensors", v2);
    // A safetensors file's tensors go by their keys (here "w").
    run_ok(&["send", "--to", &url, "--file", &p1]);
    let sent = last_json(&run_ok(&[
        "send",
        "--to",
        &url,
        "--file",
        &p2,
        "--delta",
        &p1,
        "--compress",
        "zstd",
        "--shuffle",
        "--json",
    ]));
    assert_eq!(sent["crc32c"], format!("{:08x}", t2.crc32c().unwrap()));
    let fetched = last_json(&run_ok(&["fetch", "--from", &url, "--name", "w", "--json"]));
    assert_eq!(fetched["crc32c"], sent["crc32c"], "the store holds the new version, bit-exact");
    assert_eq!(fetched["dtype"], DType::Float32.name());
    // The server now holds v2: a delta against v1 names v1's hash and changes nothing.
    let out = bin().args(["send", "--to", &url, "--file", &p2, "--delta", &p1]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&ContentHash::of(&t1).unwrap().to_string()), "{err}");
    let again = last_json(&run_ok(&["fetch", "--from", &url, "--name", "w", "--json"]));
    assert_eq!(again["crc32c"], sent["crc32c"]);
}

#[test]
fn bench_without_calls_measures_every_transport_it_is_given() {
    // `--calls 0` skips the calls-per-second figure (it used to fail after
    // the first transport's rows with "no exchanges to time").
    let out = run_ok(&[
        "bench",
        "--transports",
        "unix,tcp",
        "--sizes",
        "64K",
        "--seconds",
        "0.01",
        "--rounds",
        "1",
        "--round-trips",
        "20",
        "--calls",
        "0",
        "--batch-examples",
        "0",
        "--json",
    ]);
    let rows: Vec<serde_json::Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    for t in ["unix", "tcp"] {
        for dir in ["send", "fetch"] {
            assert!(
                rows.iter()
                    .any(|r| r["transport"] == t && r["direction"] == dir && r["gib_per_s"].as_f64() > Some(0.0)),
                "{t} {dir} missing: {out}"
            );
        }
        let lat = rows.iter().find(|r| r["transport"] == t && r.get("rtt_4k_p50_ms").is_some()).expect(t);
        assert!(lat["rtt_4k_p50_ms"].as_f64() > Some(0.0));
        assert!(lat["calls_per_s_64_in_flight"].is_null(), "no calls figure with --calls 0: {lat}");
    }
}
