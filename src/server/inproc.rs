//! Calls that reach the dispatcher from a front end in this process — the
//! gRPC skytorch compat service, JSON-RPC over HTTP — rather than from a
//! transport stream. Each runs through [`dispatch::handle_stream`] over an
//! in-process pipe, so it gets the same method routing, function registry,
//! limits, deadlines, statistics and shutdown rules as a native call; the
//! front end only translates its protocol to frames and back.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tensorwire_codecs::{CodecKind, CompressionMode};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{ConnectionInfo, Incoming, StreamKind};

use super::dispatch;
use super::state::{ServerInner, Session, StreamSlot};
use crate::config::Encoding;
use crate::error::CallError;
use crate::pipeline::link::{LinkEstimator, SharedCaps};
use crate::pipeline::pipe::pipe;
use crate::pipeline::reader::FrameReader;
use crate::pipeline::tensors::TensorStream;
use crate::pipeline::writer::FrameWriter;

/// Both ends of one dispatched call: where its input tensors go (end it
/// with `writer.finish()`), and its output tensors and reply.
pub(crate) struct LocalCall {
    pub(crate) writer: FrameWriter,
    pub(crate) output: TensorStream,
}

static NEXT: AtomicU64 = AtomicU64::new(1);

/// Starts `request` in the dispatcher as a call of `kind` from `peer` over
/// `transport` (a name for statistics and handlers), already authenticated
/// by the front end: the server's own token is attached.
pub(crate) async fn start(
    inner: &Arc<ServerInner>,
    transport: &'static str,
    peer: String,
    kind: StreamKind,
    mut request: v1::Request,
) -> Result<LocalCall, CallError> {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let (to_server, server_in) = pipe(id, &peer);
    let (server_out, from_server) = pipe(id, &peer);
    let info = ConnectionInfo {
        transport,
        peer: peer.clone(),
        max_frame_payload: inner.config.transport.max_frame_payload.into(),
        local: false,
        stateless: true,
    };
    let session = Arc::new(Session {
        peer: Arc::from(peer.as_str()),
        info,
        handshaken: AtomicBool::new(true),
        caps: Mutex::new(SharedCaps::default()),
        link: Arc::new(LinkEstimator::default()),
        active: std::sync::atomic::AtomicU32::new(0),
        orphaned: std::sync::atomic::AtomicU32::new(0),
        since: std::time::Instant::now(),
    });
    let inc = Incoming { kind: Some(kind), send: Box::new(server_out), recv: Box::new(server_in), peer: None };
    let slot = StreamSlot::new(inner, &session);
    tokio::spawn(Box::pin(dispatch::handle_stream(inner.clone(), session, inc, slot)));
    // Raw codec in the pipe: tensors pass as slices of their bytes.
    let enc = Encoding { codec: CodecKind::Raw, compression: CompressionMode::Auto, ..Default::default() };
    let mut writer = FrameWriter::new(Box::new(to_server), enc, SharedCaps::default(), u64::MAX, None);
    request.auth_token = inner.config.auth_token.clone().unwrap_or_default();
    writer.control(Kind::Request(Box::new(request)));
    writer.flush(false).await?;
    let limits = inner.config.limits.clone();
    let output = TensorStream::new(FrameReader::new(Box::new(from_server), Arc::from(peer), limits, false), true);
    Ok(LocalCall { writer, output })
}
