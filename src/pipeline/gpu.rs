//! Tensors received straight into GPU memory (feature `cuda`): chunks are
//! handed, as they arrive, to a thread that stages them through pinned
//! buffers to the device ([`Gpu::begin_upload`]), so the upload runs while
//! the rest of the tensor is still on the wire. Used by a server handler
//! ([`TensorStream::next_to_gpu`]) and by [`Client::fetch_to_gpu`](crate::Client::fetch_to_gpu).

use std::sync::Arc;

use tensorwire_codecs::checksum;
use tensorwire_codecs::{DecodeError, Tensor};

use super::chunk::Piece;
use super::reader::{FrameReader, IntoItem, Pieces};
use super::tensors::TensorStream;
use crate::cuda::{DeviceTensor, Gpu, GpuError};
use crate::error::CallError;

/// Pieces queued for the upload thread: bounds what the network may run
/// ahead of the copies (chunks are 1 MiB by default).
const QUEUED_PIECES: usize = 8;

fn gpu_error(e: GpuError) -> CallError {
    CallError::InvalidArgument(format!("GPU copy failed: {e}"))
}

/// Uploads a tensor that was read whole.
async fn upload_whole(gpu: &Arc<Gpu>, t: Tensor) -> Result<DeviceTensor, CallError> {
    let g = gpu.clone();
    tokio::task::spawn_blocking(move || g.upload(&t))
        .await
        .map_err(|e| CallError::InvalidArgument(format!("GPU copy task failed: {e}")))?
        .map_err(gpu_error)
}

/// The CRC-32C of a tensor in GPU memory (read back through the pinned pool).
async fn crc_on_gpu(gpu: &Arc<Gpu>, d: DeviceTensor) -> Result<(DeviceTensor, u32), CallError> {
    let g = gpu.clone();
    tokio::task::spawn_blocking(move || {
        let mut h = checksum::Crc32c::new();
        g.download_chunks(&d, |c| {
            h.update(&c);
            Ok(())
        })
        .map(|()| (d, h.finish()))
    })
    .await
    .map_err(|e| CallError::InvalidArgument(format!("GPU copy task failed: {e}")))?
    .map_err(gpu_error)
}

/// Reads the next item of `r`; a tensor goes to `gpu`, chunk by chunk as
/// its chunks arrive when it arrives as plain bytes (raw codec, contiguous;
/// compressed chunks are decompressed on the way), else read whole first.
/// The payload's checksum, when the sender sent one, is checked before the
/// tensor is returned.
pub(crate) async fn next_to_gpu(r: &mut FrameReader, gpu: &Arc<Gpu>) -> Result<IntoItem<DeviceTensor>, CallError> {
    let (info, dtype, nbytes, first) = match r.start_pieces().await? {
        Pieces::Stream { info, dtype, nbytes, first } => (info, dtype, nbytes, first),
        Pieces::Whole(t) => return upload_whole(gpu, t).await.map(IntoItem::Tensor),
        Pieces::Control(h) => return Ok(IntoItem::Control(h)),
        Pieces::End => return Ok(IntoItem::End),
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Piece>(QUEUED_PIECES);
    let g = gpu.clone();
    let shape = info.shape.clone();
    // The upload thread verifies each piece that came with a checksum
    // (off the thread that reads the network) and, while every piece has
    // one, builds the whole payload's from theirs: no pass of its own. It
    // takes whatever pieces have queued up at once, so that one that fell
    // behind copies them on several threads.
    let worker = tokio::task::spawn_blocking(move || {
        let mut up = g.begin_upload(dtype, shape).map_err(gpu_error)?;
        let mut crc = Some(0u32);
        let mut batch: Vec<Piece> = Vec::with_capacity(QUEUED_PIECES);
        while let Some(p) = rx.blocking_recv() {
            batch.push(p);
            while batch.len() < QUEUED_PIECES {
                match rx.try_recv() {
                    Ok(p) => batch.push(p),
                    Err(_) => break,
                }
            }
            let mut next = up.received();
            for p in &batch {
                if p.offset != next {
                    return Err(CallError::InvalidArgument(format!(
                        "GPU copy failed: a piece at {}, expected at {next}",
                        p.offset
                    )));
                }
                next += p.bytes.len();
                let Some(expected) = p.check else {
                    crc = None;
                    continue;
                };
                let actual = checksum::crc32c(&p.bytes);
                if actual != expected {
                    return Err(CallError::Decode(DecodeError::Checksum { what: "chunk payload", expected, actual }));
                }
                crc = crc.map(|c| checksum::crc32c_combine(c, actual, p.bytes.len()));
            }
            let parts: Vec<&[u8]> = batch.iter().map(|p| &p.bytes[..]).collect();
            up.push_parts(&parts).map_err(gpu_error)?;
            batch.clear();
        }
        Ok((up.finish().map_err(gpu_error)?, crc))
    });
    // Reads the pieces and queues them; the upload thread's error, if it
    // stopped early, is the one reported.
    let read = async {
        let mut piece = first;
        loop {
            let last = piece.last;
            if tx.send(piece).await.is_err() {
                return Ok(None);
            }
            if last {
                return r.finish_pieces(nbytes).map(Some);
            }
            piece = r.next_piece().await?;
        }
    }
    .await;
    drop(tx);
    let uploaded = worker.await.map_err(|e| CallError::InvalidArgument(format!("GPU copy task failed: {e}")));
    let expected = match read {
        Ok(Some(crc)) => crc,
        // The upload thread stopped: its error says why.
        Ok(None) => {
            return Err(match uploaded {
                Ok(Err(e)) | Err(e) => e,
                Ok(Ok(_)) => r.protocol("the GPU upload stopped early"),
            });
        }
        Err(e) => return Err(e),
    };
    let (mut d, crc) = uploaded??;
    if let Some(expected) = expected {
        let actual = match crc {
            Some(c) => c,
            // Pieces without checksums of their own (a transport that sends
            // none, compressed chunks): the whole payload's, which the
            // sender asked for, takes a pass of its own, read back from the
            // device.
            None => {
                let (back, c) = crc_on_gpu(gpu, d).await?;
                d = back;
                c
            }
        };
        if actual != expected {
            return Err(CallError::Decode(DecodeError::Checksum { what: "tensor payload", expected, actual }));
        }
    }
    Ok(IntoItem::Tensor(match info.name {
        Some(n) => d.with_name(n),
        None => d,
    }))
}

impl TensorStream {
    /// The next tensor, in `gpu`'s memory: a tensor that arrives as plain
    /// bytes (raw codec, contiguous; compressed or not) goes to the device
    /// chunk by chunk as it arrives, through `gpu`'s pinned staging buffers
    /// on a blocking thread, so the upload overlaps the receive; any other
    /// (another codec, a strided view) is received whole, then uploaded.
    /// None at the end of the stream. A GPU error ends the stream (the
    /// rest of that tensor is not read: end the call).
    pub async fn next_to_gpu(&mut self, gpu: &Arc<Gpu>) -> Option<Result<DeviceTensor, CallError>> {
        self.next_via(async |pending, reader| match pending {
            Some(t) => upload_whole(gpu, t).await.map(IntoItem::Tensor),
            None => next_to_gpu(reader, gpu).await,
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Limits;
    use crate::pipeline::pipe::pipe;
    use bytes::Bytes;
    use tensorwire_proto::v1::{self, frame_header::Kind};
    use tensorwire_transports::{Frame, FrameHeader, SendStream};

    /// A uint8 tensor of `data` in two uncompressed chunks, with the
    /// checksums given (per chunk, and of the whole payload).
    async fn read_two_chunks(data: &[u8], chunk_crcs: [Option<u32>; 2], whole: Option<u32>) -> Result<(), CallError> {
        let Ok(g) = Gpu::open(0).map(Arc::new) else { return Ok(()) };
        let (mut tx, rx) = pipe(1, "test");
        let half = data.len() / 2;
        for (i, (range, crc)) in [(0..half, chunk_crcs[0]), (half..data.len(), chunk_crcs[1])].into_iter().enumerate() {
            let last = i == 1;
            let c = v1::Chunk {
                tensor_id: 1,
                index: i as u32,
                offset: range.start as u64,
                total_bytes: data.len() as u64,
                last,
                compression: v1::Compression::None as i32,
                raw_len: range.len() as u64,
                chunk_crc32c: crc,
                crc32c: if last { whole } else { None },
                info: (i == 0).then(|| {
                    Box::new(v1::TensorInfo {
                        dtype: v1::Dtype::Uint8 as i32,
                        shape: vec![data.len() as u64],
                        ..Default::default()
                    })
                }),
                ..Default::default()
            };
            let payload = Bytes::copy_from_slice(&data[range]);
            tx.send(Frame { header: FrameHeader::new(Kind::Chunk(c)), payload }).await.unwrap();
        }
        tx.finish().await.unwrap();
        let mut r = FrameReader::new(Box::new(rx), "test".into(), Limits::default(), false);
        match next_to_gpu(&mut r, &g).await? {
            IntoItem::Tensor(d) => {
                assert_eq!(g.download(&d).unwrap().as_bytes().unwrap(), data);
                Ok(())
            }
            _ => panic!("expected a tensor"),
        }
    }

    /// The checksums an uncompressed chunk leaves to the upload thread are
    /// checked there, and so is the whole payload's: a tampered byte in
    /// either chunk fails the receive with a checksum error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn checksums_are_checked_on_the_way_to_the_gpu() {
        if Gpu::open(0).is_err() {
            eprintln!("skipping GPU test: no device");
            return;
        }
        let data: Vec<u8> = (0..(3 << 20) + 5).map(|i: usize| (i * 7 + i / 1000) as u8).collect();
        let half = data.len() / 2;
        let (a, b) = (checksum::crc32c(&data[..half]), checksum::crc32c(&data[half..]));
        let whole = checksum::crc32c(&data);
        read_two_chunks(&data, [Some(a), Some(b)], Some(whole)).await.unwrap();
        read_two_chunks(&data, [None, None], Some(whole)).await.unwrap();
        for (chunks, w) in
            [([Some(a), Some(b ^ 1)], None), ([Some(a ^ 1), Some(b)], None), ([None, None], Some(whole ^ 1))]
        {
            let e = read_two_chunks(&data, chunks, w).await.unwrap_err();
            assert!(matches!(e, CallError::Decode(DecodeError::Checksum { .. })), "{e}");
        }
    }
}
