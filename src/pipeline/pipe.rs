//! An in-process stream pair: frames written on one end are received on
//! the other without a socket. Adapters (the skytorch compat service) use
//! it to run a call through the same dispatcher as network calls.

use async_trait::async_trait;
use tensorwire_transports::{Frame, Payload, Received, RecvStream, SendStream, StreamError};
use tokio::sync::mpsc;

/// Frames buffered per direction before the writer waits.
const DEPTH: usize = 8;

type Item = Result<Received, StreamError>;

pub(crate) struct PipeSend {
    tx: Option<mpsc::Sender<Item>>,
    id: u64,
    peer: String,
}

pub(crate) struct PipeRecv {
    rx: mpsc::Receiver<Item>,
    id: u64,
}

/// One direction of a pipe.
pub(crate) fn pipe(id: u64, peer: &str) -> (PipeSend, PipeRecv) {
    let (tx, rx) = mpsc::channel(DEPTH);
    (PipeSend { tx: Some(tx), id, peer: peer.to_string() }, PipeRecv { rx, id })
}

#[async_trait]
impl SendStream for PipeSend {
    async fn send(&mut self, frame: Frame) -> Result<(), StreamError> {
        let Some(tx) = &self.tx else {
            return Err(StreamError::Finished { peer: self.peer.clone(), stream: self.id });
        };
        let item = Received { header: frame.header, payload: Payload::Bytes(frame.payload) };
        tx.send(Ok(item)).await.map_err(|_| StreamError::Stopped { peer: self.peer.clone(), stream: self.id, code: 0 })
    }

    async fn finish(&mut self) -> Result<(), StreamError> {
        self.tx = None;
        Ok(())
    }

    fn reset(&mut self, code: u32) {
        if let Some(tx) = self.tx.take() {
            let e = StreamError::Reset { peer: self.peer.clone(), stream: self.id, code };
            if let Err(mpsc::error::TrySendError::Full(item)) = tx.try_send(Err(e)) {
                tokio::spawn(async move {
                    let _ = tx.send(item).await;
                });
            }
        }
    }

    fn id(&self) -> u64 {
        self.id
    }
}

#[async_trait]
impl RecvStream for PipeRecv {
    async fn recv(&mut self) -> Result<Option<Received>, StreamError> {
        self.rx.recv().await.transpose()
    }

    fn id(&self) -> u64 {
        self.id
    }
}
