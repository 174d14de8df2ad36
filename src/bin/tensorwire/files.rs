//! Reading and writing tensor files for the CLI: torch.save (.pt, .pth,
//! .bin) and safetensors.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use tensorwire::codecs::torch::{self, Object, SaveOptions};
use tensorwire::codecs::{DecodeLimits, safetensors};
use tensorwire::parse_shape;
use tensorwire::{DType, Tensor};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub fn is_safetensors(p: &Path) -> bool {
    p.extension().is_some_and(|e| e == "safetensors")
}

/// Every tensor in a file by its key, in file order, and whether the file
/// holds one bare tensor (`torch.save(t)`) rather than a state dict.
pub fn load_file(path: &Path) -> Result<(Vec<(String, Tensor)>, bool), BoxError> {
    let data = Bytes::from(std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?);
    let limits = DecodeLimits::default();
    if is_safetensors(path) {
        return Ok((safetensors::load(data, &limits)?.tensors, false));
    }
    let v = torch::load(data, &limits).map_err(|e| format!("{}: {e}", path.display()))?;
    let bare = matches!(v, Object::Tensor(_));
    Ok((v.tensors().into_iter().map(|(k, t)| (k, t.clone())).collect(), bare))
}

/// Every tensor in a file, named by its key (or `name`, or the file stem).
pub fn read_tensors(path: &Path, name: Option<&str>) -> Result<Vec<Tensor>, BoxError> {
    let (named, _) = load_file(path)?;
    name_tensors(path, named, name)
}

/// A file's tensors named by key (or `name` for a single one, `name.key`
/// for several, or the file stem for a bare tensor).
pub fn name_tensors(path: &Path, named: Vec<(String, Tensor)>, name: Option<&str>) -> Result<Vec<Tensor>, BoxError> {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("tensor").to_string();
    if named.is_empty() {
        return Err(format!("{} holds no tensors", path.display()).into());
    }
    let single = named.len() == 1;
    Ok(named
        .into_iter()
        .map(|(k, t)| {
            let n = match (name, single, k.is_empty()) {
                (Some(n), true, _) => n.to_string(),
                (Some(n), false, _) => format!("{n}.{k}"),
                (None, _, true) => stem.clone(),
                (None, _, false) => k,
            };
            t.with_name(n)
        })
        .collect())
}

/// A call input: a file, or `random:SHAPE[:DTYPE]`.
pub fn input_tensor(spec: &str) -> Result<Vec<Tensor>, BoxError> {
    if let Some(rest) = spec.strip_prefix("random:") {
        let (shape, dtype) = rest.split_once(':').unwrap_or((rest, "float32"));
        let dtype: DType = dtype.parse()?;
        return Ok(vec![tensorwire::builtins::random_tensor(dtype, &parse_shape(shape)?, 0)?]);
    }
    read_tensors(Path::new(spec), None)
}

/// Writes tensors: one tensor as a bare torch.save tensor, several as a
/// dict; `.safetensors` files as safetensors.
pub fn write_tensors(path: &Path, named: &[(String, Tensor)]) -> Result<(), BoxError> {
    let segments = if is_safetensors(path) {
        safetensors::save(named, None)?
    } else {
        let value = match named {
            [(_, t)] => Object::Tensor(t.clone()),
            many => Object::state_dict(many.iter().map(|(k, t)| (k.clone(), t.clone()))),
        };
        let archive = path.file_stem().and_then(|s| s.to_str()).unwrap_or("archive").to_string();
        torch::save(&value, &SaveOptions { archive_name: archive, ..SaveOptions::default() })?
    };
    write_atomic(path, |f| {
        for s in &segments {
            std::io::Write::write_all(f, s)?;
        }
        Ok(())
    })
}

/// A temporary file beside its destination, removed unless it was renamed
/// over it.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Writes `path` atomically: into a temporary file in the same directory,
/// renamed over `path` once complete. A failed write leaves the old file
/// as it was and no temporary behind; so does a process killed before the
/// rename (but for the temporary, `.NAME.tmp-PID`, which the next write of
/// the same process id replaces).
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> std::io::Result<()>,
) -> Result<(), BoxError> {
    let name =
        path.file_name().and_then(|n| n.to_str()).ok_or_else(|| format!("{} is not a file name", path.display()))?;
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let file = std::fs::File::create(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let mut guard = TempFile(Some(tmp.clone()));
    let mut f = std::io::BufWriter::new(file);
    write(&mut f)
        .and_then(|()| std::io::Write::flush(&mut f))
        .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| format!("cannot rename {} to {}: {e}", tmp.display(), path.display()))?;
    guard.0 = None;
    Ok(())
}

/// The first few values, for printing.
pub fn preview(t: &Tensor) -> String {
    let vals: Option<Vec<String>> = match t.dtype() {
        DType::Float32 => t.to_vec::<f32>().ok().map(|v| v.iter().take(6).map(|x| format!("{x}")).collect()),
        DType::Float64 => t.to_vec::<f64>().ok().map(|v| v.iter().take(6).map(|x| format!("{x}")).collect()),
        DType::Int64 => t.to_vec::<i64>().ok().map(|v| v.iter().take(6).map(|x| format!("{x}")).collect()),
        DType::Int32 => t.to_vec::<i32>().ok().map(|v| v.iter().take(6).map(|x| format!("{x}")).collect()),
        _ => None,
    };
    match vals {
        Some(v) if !v.is_empty() => format!(" [{}{}]", v.join(", "), if t.numel() > 6 { ", ..." } else { "" }),
        _ => String::new(),
    }
}
