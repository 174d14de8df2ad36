//! The torch.save and safetensors codecs against real PyTorch and the
//! `safetensors` Python package.

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::python::{python, run};
use serde_json::{Value as Json, json};
use tensorwire::builtins::random_tensor;
use tensorwire::codecs::torch::{self, Object, SaveOptions};
use tensorwire::codecs::{DecodeError, DecodeLimits, safetensors};
use tensorwire::{DType, Tensor};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn describe(t: &Tensor) -> Json {
    json!({
        "dtype": t.dtype().name(),
        "shape": t.shape(),
        "stride": t.strides(),
        "storage_offset": t.storage_offset(),
        "data": hex(&t.to_contiguous_bytes().unwrap()),
    })
}

fn check(t: &Tensor, want: &Json, what: &str) {
    assert_eq!(t.dtype().name(), want["dtype"], "{what}: dtype");
    let shape: Vec<usize> = serde_json::from_value(want["shape"].clone()).unwrap();
    assert_eq!(t.shape(), shape.as_slice(), "{what}: shape");
    if t.numel() > 1 {
        let stride: Vec<usize> = serde_json::from_value(want["stride"].clone()).unwrap();
        assert_eq!(t.strides(), stride.as_slice(), "{what}: stride");
        assert_eq!(t.storage_offset() as u64, want["storage_offset"].as_u64().unwrap(), "{what}: storage offset");
    }
    assert_eq!(hex(&t.to_contiguous_bytes().unwrap()), want["data"], "{what}: values");
}

#[test]
fn files_written_by_torch_decode_exactly() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    run(&py, "torch_interop.py", &["write", d]);
    let manifest: BTreeMap<String, BTreeMap<String, Json>> =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("manifest.json")).unwrap()).unwrap();
    let limits = DecodeLimits::default();
    let mut checked = 0;
    for (file, entries) in &manifest {
        let bytes = Bytes::from(std::fs::read(dir.path().join(file)).unwrap());
        let tensors: BTreeMap<String, Tensor> = if file.ends_with(".safetensors") {
            let l = safetensors::load(bytes, &limits).unwrap();
            assert_eq!(l.metadata.get("source").map(String::as_str), Some("python"));
            l.tensors.into_iter().collect()
        } else {
            let v = torch::load(bytes, &limits).unwrap_or_else(|e| panic!("{file}: {e}"));
            v.tensors().into_iter().map(|(k, t)| (k, t.clone())).collect()
        };
        for (key, want) in entries {
            let t = tensors.get(key).unwrap_or_else(|| panic!("{file}: no tensor {key:?} in {:?}", tensors.keys()));
            check(t, want, &format!("{file}[{key}]"));
            checked += 1;
        }
        if file == "state_dict.pt" {
            // Views of one storage still share memory after loading.
            let (w, wt, row) = (&tensors["w"], &tensors["w_t"], &tensors["row2"]);
            assert_eq!(w.host_storage().unwrap().as_ptr(), wt.host_storage().unwrap().as_ptr());
            assert_eq!(w.host_storage().unwrap().as_ptr(), row.host_storage().unwrap().as_ptr());
            assert_eq!(row.storage_offset(), 12);
        }
    }
    assert!(checked > 40, "checked {checked} tensors");
}

#[test]
fn files_written_by_tensorwire_load_in_torch() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut manifest = serde_json::Map::new();
    let write = |name: &str, segs: Vec<Bytes>| {
        let mut v = Vec::new();
        for s in segs {
            v.extend_from_slice(&s);
        }
        std::fs::write(dir.path().join(name), v).unwrap();
    };
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let t = random_tensor(dtype, &[3, 4], i as u64).unwrap();
        write(&format!("{dtype}.pt"), torch::save(&Object::Tensor(t.clone()), &SaveOptions::default()).unwrap());
        manifest.insert(format!("{dtype}.pt"), json!({ "": describe(&t) }));
    }
    // A state dict with shared storage, a transposed view and an offset slice.
    let w = random_tensor(DType::Float32, &[4, 6], 100).unwrap();
    let sd = [
        ("w".to_string(), w.clone()),
        ("w_t".to_string(), w.transpose(0, 1).unwrap()),
        ("row2".to_string(), w.narrow(0, 2, 1).unwrap().reshape([6]).unwrap()),
        ("cols".to_string(), w.narrow(1, 1, 2).unwrap()),
        ("bias".to_string(), random_tensor(DType::BFloat16, &[6], 101).unwrap()),
    ];
    let value = Object::state_dict(sd.iter().cloned());
    write(
        "state_dict.pt",
        torch::save(&value, &SaveOptions { archive_name: "state_dict".into(), ..Default::default() }).unwrap(),
    );
    manifest.insert(
        "state_dict.pt".into(),
        json!(sd.iter().map(|(k, t)| (k.clone(), describe(t))).collect::<serde_json::Map<_, _>>()),
    );
    manifest.insert("_shared".into(), json!({ "state_dict.pt": [["w", "w_t"], ["w", "row2"], ["w", "cols"]] }));
    // safetensors with a metadata map.
    let st: Vec<(String, Tensor)> = DType::ALL
        .into_iter()
        .filter(|d| *d != DType::Complex128)
        .enumerate()
        .map(|(i, d)| (d.name().to_string(), random_tensor(d, &[2, 5], 300 + i as u64).unwrap()))
        .collect();
    let meta = std::collections::HashMap::from([("writer".to_string(), "tensorwire".to_string())]);
    write("all.safetensors", safetensors::save(&st, Some(meta)).unwrap());
    manifest.insert(
        "all.safetensors".into(),
        json!(st.iter().map(|(k, t)| (k.clone(), describe(t))).collect::<serde_json::Map<_, _>>()),
    );
    std::fs::write(dir.path().join("manifest.json"), serde_json::to_string(&manifest).unwrap()).unwrap();
    let out = run(&py, "torch_interop.py", &["check", dir.path().to_str().unwrap()]);
    assert!(out.contains("checked"), "{out}");
}

#[test]
fn malicious_pickles_are_refused_and_nothing_runs() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    run(&py, "torch_interop.py", &["evil", dir.path().to_str().unwrap()]);
    let limits = DecodeLimits::default();
    let load = |f: &str| torch::load(Bytes::from(std::fs::read(dir.path().join(f)).unwrap()), &limits);
    match load("reduce_os_system.pt") {
        Err(DecodeError::ForbiddenGlobal { module, name }) => {
            assert_eq!((module.as_str(), name.as_str()), ("posix", "system"));
        }
        other => panic!("expected a forbidden global, got {other:?}"),
    }
    match load("eval.pt") {
        Err(e @ DecodeError::ForbiddenGlobal { .. }) => assert!(e.to_string().contains("builtins.eval"), "{e}"),
        other => panic!("expected a forbidden global, got {other:?}"),
    }
    assert!(!dir.path().join("PWNED").exists(), "a pickle ran code");
}
