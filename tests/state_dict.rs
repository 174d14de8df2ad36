//! Whole state dicts as one object: `Client::put_state_dict` /
//! `get_state_dict` over real sockets, and the CLI's `send --file` /
//! `fetch --out` / `ls` / `rm` against real PyTorch.

mod common;

use std::process::Command;

use common::cli::*;
use common::python::{python, run};
use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{Client, Code, DType, ServerConfig, StoreService, Tensor};

/// A state dict whose tensors share storages the ways checkpoints do.
fn sample_state_dict() -> Vec<(String, Tensor)> {
    let emb = random_tensor(DType::Float32, &[64, 32], 1).unwrap();
    let w = random_tensor(DType::BFloat16, &[16, 24], 2).unwrap();
    vec![
        ("emb.weight".into(), emb.clone()),
        ("w".into(), w.clone()),
        ("w.T".into(), w.transpose(0, 1).unwrap()),
        ("ids".into(), random_tensor(DType::Int64, &[5], 3).unwrap()),
        ("mask".into(), random_tensor(DType::Bool, &[3, 4], 4).unwrap()),
        ("c64".into(), random_tensor(DType::Complex64, &[2, 3], 5).unwrap()),
        ("head.weight".into(), emb.clone()),
        ("emb.cols".into(), emb.narrow(1, 4, 8).unwrap()),
        ("emb.row2".into(), emb.narrow(0, 2, 1).unwrap().reshape([32]).unwrap()),
        ("big".into(), random_tensor(DType::Float32, &[3 << 20], 6).unwrap()),
    ]
}

fn ptr(t: &Tensor) -> *const u8 {
    t.host_storage().unwrap().as_ptr()
}

async fn round_trip(scheme: &str) {
    let (server, _dir) = start(store_server(ServerConfig::default()), scheme).await;
    let client = Client::connect(&server.url()).await.unwrap();
    let sd = sample_state_dict();
    let logical: u64 = sd.iter().map(|(_, t)| t.nbytes() as u64).sum();
    let s = client.put_state_dict("m", &sd).await.unwrap();
    assert_eq!(s.received, sd.len() as u64);
    assert!(s.message.contains("state dict m"), "{}", s.message);
    // Shared storages crossed once: fewer bytes on the wire than the tensors hold.
    let wire = server.info().bytes_received;
    assert!(wire < logical, "{wire} wire bytes for {logical} logical");

    let back = client.get_state_dict("m").await.unwrap();
    assert_eq!(
        back.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        sd.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>()
    );
    for ((k, a), (_, b)) in sd.iter().zip(&back) {
        assert_same(a, b);
        assert_eq!(a.strides(), b.strides(), "{k}: strides");
        assert_eq!(a.storage_offset(), b.storage_offset(), "{k}: storage offset");
    }
    let got = |k: &str| &back.iter().find(|(x, _)| x == k).unwrap().1;
    assert_eq!(ptr(got("emb.weight")), ptr(got("head.weight")), "tied weights share again");
    assert_eq!(ptr(got("emb.weight")), ptr(got("emb.cols")));
    assert_eq!(ptr(got("w")), ptr(got("w.T")));
    assert_ne!(ptr(got("w")), ptr(got("emb.weight")));

    // Single tensors of it keep working by their full names.
    let one = client.fetch_one("m.w.T").await.unwrap();
    assert_same(&sd[2].1, &one);
    // ls / stat / rm.
    let listed = client.list("m.").await.unwrap();
    assert_eq!(listed.len(), sd.len());
    assert!(listed.iter().all(|t| t.state_dict.as_deref() == Some("m")));
    let stat = client.stat("m").await.unwrap();
    assert_eq!(
        stat.iter().map(|t| t.key()).collect::<Vec<_>>(),
        sd.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>()
    );
    assert_eq!(stat[9].bytes, 12 << 20);
    let info = client.service_info().await.unwrap();
    assert_eq!(info.store.tensors, sd.len() as u64);
    assert_eq!(info.store.bytes, logical);

    // A new version replaces the whole state dict.
    let v2 = vec![("only".to_string(), random_tensor(DType::UInt8, &[10], 9).unwrap())];
    client.put_state_dict("m", &v2).await.unwrap();
    assert_eq!(client.get_state_dict("m").await.unwrap().len(), 1);
    assert!(client.fetch_one("m.w").await.is_err(), "old keys are gone");
    let removed = client.remove("m").await.unwrap();
    assert_eq!(removed.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), vec!["m.only"]);
    let e = client.get_state_dict("m").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert_eq!(client.remove("m").await.unwrap_err().code(), Code::NotFound);
    assert!(client.remove_prefix("nothing.").await.unwrap().is_empty());
    assert_eq!(client.service_info().await.unwrap().store.bytes, 0);
    server.shutdown().await;
}

#[tokio::test]
async fn put_get_state_dict_over_unix() {
    round_trip("unix").await;
}

#[tokio::test]
async fn put_get_state_dict_over_tcp() {
    round_trip("tcp").await;
}

#[tokio::test]
async fn a_failed_put_changes_nothing_and_the_budget_holds() {
    let (server, _dir) = start(tensorwire::Server::builder().service(StoreService::new(1 << 20)), "unix").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let small = vec![("a".to_string(), random_tensor(DType::UInt8, &[1000], 1).unwrap())];
    client.put_state_dict("m", &small).await.unwrap();
    let big = vec![
        ("a".to_string(), random_tensor(DType::UInt8, &[600 << 10], 2).unwrap()),
        ("b".to_string(), random_tensor(DType::UInt8, &[600 << 10], 3).unwrap()),
    ];
    let e = client.put_state_dict("m", &big).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    let still = client.get_state_dict("m").await.unwrap();
    assert_eq!(still.len(), 1);
    assert_same(&small[0].1, &still[0].1);
    // Keys must be unique.
    let dup = vec![("a".to_string(), small[0].1.clone()), ("a".to_string(), small[0].1.clone())];
    assert_eq!(client.put_state_dict("m", &dup).await.unwrap_err().code(), Code::InvalidArgument);
    server.shutdown().await;
}

// ---------------------------------------------------------------------------
// The CLI against real PyTorch.

#[test]
fn cli_moves_whole_state_dicts_that_torch_loads_back() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let url = format!("unix://{}", dir.path().join("sd.sock").display());
    let _server = serve(&url);
    run(&py, "state_dict_interop.py", &["write", d]);
    let p = |f: &str| dir.path().join(f).to_str().unwrap().to_string();

    // .pt in, .pt and .safetensors out.
    let sent = last_json(&run_ok(&["send", "--to", &url, "--file", &p("sd.pt"), "--name", "m", "--json"]));
    assert_eq!(sent["tensors"], 11);
    assert_eq!(sent["state_dict"], "m");
    let ls = last_json(&run_ok(&["ls", "--from", &url, "m.", "--json"]));
    let names: Vec<&str> = ls["tensors"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"m.w_bf16.T") && names.contains(&"m.head.weight"), "{names:?}");
    let t = ls["tensors"].as_array().unwrap().iter().find(|t| t["name"] == "m.w_bf16").unwrap();
    assert_eq!(
        (t["dtype"].as_str(), t["shape"].clone(), t["bytes"].as_u64()),
        (Some("bfloat16"), serde_json::json!([4, 6]), Some(48))
    );
    assert_eq!(t["state_dict"], "m");
    let table = run_ok(&["ls", "--from", &url]);
    assert!(table.starts_with("NAME") && table.contains("m.c128") && table.contains("11 tensors"), "{table}");

    let fetched = last_json(&run_ok(&["fetch", "--from", &url, "--name", "m", "--out", &p("back.pt"), "--json"]));
    assert_eq!(fetched["crc32c"], sent["crc32c"], "sender and fetcher agree on the data");
    assert_eq!((fetched["tensors"].as_u64(), fetched["bytes"].clone()), (Some(11), sent["bytes"].clone()));
    run(&py, "state_dict_interop.py", &["check", &p("sd.pt"), &p("back.pt")]);
    // safetensors has no complex128: refused before a file is written.
    let out = bin().args(["fetch", "--from", &url, "--name", "m", "--out", &p("back.safetensors")]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("complex128"));
    assert!(
        std::fs::read_dir(dir.path()).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("back.safetensors"))
    );
    run_ok(&["send", "--to", &url, "--file", &p("sd_no_c128.pt"), "--name", "m2"]);
    run_ok(&["fetch", "--from", &url, "--name", "m2", "--out", &p("back.safetensors")]);
    run(&py, "state_dict_interop.py", &["check", &p("sd_no_c128.pt"), &p("back.safetensors")]);
    run_ok(&["rm", "--from", &url, "m2"]);
    // A single tensor of it, as before: a bare tensor file.
    run_ok(&["fetch", "--from", &url, "--name", "m.ids", "--out", &p("ids.pt")]);
    let check = format!(
        "import torch; t = torch.load('{}', weights_only=True); assert t.dtype == torch.int64 and t.shape == (5,)",
        p("ids.pt")
    );
    let out = Command::new(&py).args(["-c", &check]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // .safetensors in, .pt out.
    run_ok(&["send", "--to", &url, "--file", &p("sd.safetensors"), "--name", "s"]);
    run_ok(&["fetch", "--from", &url, "--name", "s", "--out", &p("s.pt")]);
    run(&py, "state_dict_interop.py", &["check", &p("sd.safetensors"), &p("s.pt")]);
    run_ok(&["fetch", "--from", &url, "--name", "s", "--out", &p("s.safetensors")]);
    run(&py, "state_dict_interop.py", &["check", &p("sd.safetensors"), &p("s.safetensors")]);

    // rm: a whole state dict, then a prefix; what is gone cannot be fetched.
    let rm = last_json(&run_ok(&["rm", "--from", &url, "m", "--json"]));
    assert_eq!(rm["tensors"], 11);
    let left = last_json(&run_ok(&["ls", "--from", &url, "--json"]));
    assert!(left["tensors"].as_array().unwrap().iter().all(|t| t["state_dict"] == "s"), "{left}");
    let rm = last_json(&run_ok(&["rm", "--from", &url, "--prefix", "s.", "--json"]));
    assert_eq!(rm["tensors"], 5);
    assert_eq!(last_json(&run_ok(&["ls", "--from", &url, "--json"]))["tensors"], serde_json::json!([]));
    let out = bin().args(["fetch", "--from", &url, "--name", "m", "--out", &p("gone.pt")]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("NOT_FOUND"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!dir.path().join("gone.pt").exists(), "no file for a failed fetch");
    let out = bin().args(["rm", "--from", &url, "m"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("NOT_FOUND"));
}
