//! What the CLI does with the server's store beyond single tensors: whole
//! state dicts (`send --file F --name M`, `fetch --name M --out F`, the file
//! written while the tensors arrive) and `ls` / `rm`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args as ClapArgs;
use tensorwire::codecs::torch::{SaveOptions, StateDictWriter};
use tensorwire::codecs::{checksum, safetensors};
use tensorwire::{Client, DType, StateDictEntry, StoredTensor, Tensor};

use super::{BoxError, ConnArgs, FetchArgs, Progress, SendArgs, client, report};

#[derive(ClapArgs, Debug)]
pub(crate) struct LsArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// Only names starting with this.
    prefix: Option<String>,
}

#[derive(ClapArgs, Debug)]
pub(crate) struct RmArgs {
    #[command(flatten)]
    conn: ConnArgs,
    /// A tensor, or a whole state dict, to delete.
    #[arg(required_unless_present = "prefix", conflicts_with = "prefix")]
    name: Option<String>,
    /// Delete every tensor whose name starts with this instead.
    #[arg(long)]
    prefix: Option<String>,
}

/// CRC-32C of the tensors' elements one after another, in logical order:
/// what `send` and `fetch` of a state dict both print, so they can be compared.
fn combined_crc<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<u32, BoxError> {
    let mut crc = 0;
    for t in tensors {
        crc = checksum::crc32c_combine(crc, t.crc32c()?, t.nbytes());
    }
    Ok(crc)
}

/// `send --file F --name M` for a file holding a state dict: stored as one.
pub(crate) async fn send_state_dict(a: &SendArgs, name: &str, items: Vec<(String, Tensor)>) -> Result<(), BoxError> {
    let per_round: u64 = items.iter().map(|(_, t)| t.nbytes() as u64).sum();
    let total = per_round * a.count;
    let bar = Progress::start(Some(total));
    let c = client(&a.conn, Some(&a.enc), Progress::counter(&bar)).await?;
    let crc = combined_crc(items.iter().map(|(_, t)| t))?;
    let start = Instant::now();
    let mut message = String::new();
    for _ in 0..a.count {
        message = c.put_state_dict(name, &items).await?.message;
    }
    let secs = start.elapsed().as_secs_f64();
    Progress::finish(bar).await;
    report(
        a.conn.json,
        &format!("sent state dict {name} ({} tensors)", items.len()),
        total,
        secs,
        crc,
        serde_json::json!({ "tensors": items.len() as u64 * a.count, "state_dict": name, "server": message }),
    );
    Ok(())
}

/// Where a fetched state dict goes, tensor by tensor.
enum Sink {
    Discard,
    Torch(StateDictWriter<BufWriter<File>>),
    Safetensors { file: BufWriter<File>, layout: Vec<(String, DType, Vec<usize>)>, next: usize },
}

impl Sink {
    fn open(path: &Path, tmp: &Path, entries: &[StoredTensor]) -> Result<Sink, BoxError> {
        let file = BufWriter::with_capacity(
            1 << 20,
            File::create(tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?,
        );
        if super::files::is_safetensors(path) {
            let layout: Vec<(String, DType, Vec<usize>)> =
                entries.iter().map(|e| (e.key().to_string(), e.dtype, e.shape.clone())).collect();
            let mut file = file;
            file.write_all(&safetensors::header(&layout, None)?)?;
            return Ok(Sink::Safetensors { file, layout, next: 0 });
        }
        let archive = path.file_stem().and_then(|s| s.to_str()).unwrap_or("archive").to_string();
        Ok(Sink::Torch(StateDictWriter::new(file, &SaveOptions { archive_name: archive, ..SaveOptions::default() })))
    }

    fn write(&mut self, e: &StateDictEntry) -> Result<(), BoxError> {
        match self {
            Sink::Discard => {}
            Sink::Torch(w) => w.write(&e.key, &e.tensor, e.storage)?,
            Sink::Safetensors { file, layout, next } => {
                let expected = layout.get(*next).map(|(k, d, s)| (k.as_str(), *d, s.as_slice()));
                if expected != Some((e.key.as_str(), e.tensor.dtype(), e.tensor.shape())) {
                    return Err(format!(
                        "the state dict changed while it was fetched ({:?} arrived where {:?} was listed); fetch it again",
                        e.key,
                        expected.map(|x| x.0)
                    )
                    .into());
                }
                *next += 1;
                file.write_all(&e.tensor.to_contiguous_bytes()?)?;
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<(), BoxError> {
        match self {
            Sink::Discard => {}
            Sink::Torch(w) => {
                w.finish()?.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            }
            Sink::Safetensors { file, layout, next } => {
                if next != layout.len() {
                    return Err(format!(
                        "the state dict changed while it was fetched ({next} of {} tensors arrived); fetch it again",
                        layout.len()
                    )
                    .into());
                }
                file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            }
        }
        Ok(())
    }
}

/// A temporary file beside `path`, renamed over it once complete.
fn temp_beside(path: &Path) -> PathBuf {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// `fetch --name M` of a state dict: written to `--out` while it arrives
/// (a torch.save zip, or safetensors), never held in memory as a whole.
pub(crate) async fn fetch_state_dict(a: &FetchArgs, c: &Client, entries: Vec<StoredTensor>) -> Result<(), BoxError> {
    let tmp = a.out.as_deref().map(temp_beside);
    let result = async {
        let mut sink = match (&a.out, &tmp) {
            (Some(out), Some(tmp)) => Sink::open(out, tmp, &entries)?,
            _ => Sink::Discard,
        };
        let start = Instant::now();
        let mut stream = c.state_dict_stream(&a.name).await?;
        let (mut crc, mut bytes, mut n) = (0u32, 0u64, 0u64);
        while let Some(e) = stream.next().await {
            let e = e?;
            crc = checksum::crc32c_combine(crc, e.tensor.crc32c()?, e.tensor.nbytes());
            bytes += e.tensor.nbytes() as u64;
            n += 1;
            // File writes block: keep them off the runtime's other tasks.
            tokio::task::block_in_place(|| sink.write(&e))?;
        }
        tokio::task::block_in_place(|| sink.finish())?;
        Ok::<_, BoxError>((start.elapsed().as_secs_f64(), crc, bytes, n))
    }
    .await;
    let (secs, crc, bytes, n) = match result {
        Ok(r) => r,
        Err(e) => {
            if let Some(tmp) = &tmp {
                let _ = std::fs::remove_file(tmp);
            }
            return Err(e);
        }
    };
    if let (Some(out), Some(tmp)) = (&a.out, &tmp) {
        std::fs::rename(tmp, out).map_err(|e| format!("cannot move {} to {}: {e}", tmp.display(), out.display()))?;
    }
    report(
        a.conn.json,
        &format!("fetched state dict {} ({n} tensors)", a.name),
        bytes,
        secs,
        crc,
        serde_json::json!({ "name": a.name, "state_dict": a.name, "tensors": n }),
    );
    Ok(())
}

fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.1} {}", units[u]) }
}

fn human_age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

fn to_json(t: &StoredTensor) -> serde_json::Value {
    serde_json::json!({
        "name": t.name, "dtype": t.dtype.name(), "shape": t.shape, "bytes": t.bytes,
        "state_dict": t.state_dict, "age_s": t.age.as_secs_f64(),
    })
}

/// `tensorwire ls`: what the server holds.
pub(crate) async fn ls(a: LsArgs) -> Result<(), BoxError> {
    let c = client(&a.conn, None, None).await?;
    let prefix = a.prefix.unwrap_or_default();
    let tensors = c.list(&prefix).await?;
    let total: u64 = tensors.iter().map(|t| t.bytes).sum();
    if a.conn.json {
        let list: Vec<_> = tensors.iter().map(to_json).collect();
        println!("{}", serde_json::json!({ "prefix": prefix, "tensors": list, "bytes": total }));
        return Ok(());
    }
    let rows: Vec<[String; 6]> = tensors
        .iter()
        .map(|t| {
            [
                printable(&t.name),
                t.dtype.name().to_string(),
                format!("{:?}", t.shape),
                human_bytes(t.bytes),
                t.state_dict.as_deref().map_or_else(|| "-".into(), printable),
                human_age(t.age),
            ]
        })
        .collect();
    let head = ["NAME", "DTYPE", "SHAPE", "BYTES", "STATE_DICT", "AGE"].map(String::from);
    let mut width = head.clone().map(|h| h.len());
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    for r in std::iter::once(&head).chain(&rows) {
        let line: Vec<String> = r.iter().zip(width).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", line.join("  ").trim_end());
    }
    println!("{} tensors, {}", tensors.len(), human_bytes(total));
    Ok(())
}

/// `tensorwire rm`: deletes a tensor, a state dict, or everything under a prefix.
pub(crate) async fn rm(a: RmArgs) -> Result<(), BoxError> {
    let c = client(&a.conn, None, None).await?;
    let removed = match (&a.name, &a.prefix) {
        (_, Some(p)) if p.is_empty() => return Err("--prefix needs at least one character".into()),
        (_, Some(p)) => c.remove_prefix(p).await?,
        (Some(n), None) => c.remove(n).await?,
        (None, None) => return Err("give a NAME or --prefix PREFIX".into()),
    };
    let bytes: u64 = removed.iter().map(|t| t.bytes).sum();
    if a.conn.json {
        let names: Vec<&str> = removed.iter().map(|t| t.name.as_str()).collect();
        println!("{}", serde_json::json!({ "removed": names, "tensors": removed.len(), "bytes": bytes }));
    } else {
        for t in &removed {
            println!("removed {}", printable(&t.name));
        }
        println!("{} tensors, {} removed", removed.len(), human_bytes(bytes));
    }
    Ok(())
}

/// A name chosen by whoever stored it, safe to print on a terminal:
/// control characters (escape sequences) are shown escaped.
fn printable(name: &str) -> String {
    if name.chars().any(char::is_control) { name.escape_debug().to_string() } else { name.to_string() }
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_with_control_characters_print_escaped() {
        assert_eq!(super::printable("model.w"), "model.w");
        assert_eq!(super::printable("evil\u{1b}[2Jname"), "evil\\u{1b}[2Jname");
    }
}
