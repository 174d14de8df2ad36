//! The stream multiplexer used by byte-stream transports (TCP, Unix, shm).
//!
//! Each logical stream gets a window of credit; a stream blocked on credit
//! blocks nobody else, so a slow consumer of one call never stalls the other
//! calls on the connection.
//!
//! Sans-IO (no tokio, no sockets; tested on their own, the way quinn-proto
//! sits under quinn):
//! * [`frame`]: the wire format (preface, 16-byte frame heads) and the
//!   incremental [`Decoder`](frame::Decoder) the reader and the fuzz target run.
//! * [`flow`]: per-stream credit windows.
//! * [`state`]: the stream state machine: ids, half-closes,
//!   RESET/STOP/GOAWAY, credit.
//!
//! Thin tokio drivers over them:
//! * `shared`: what the tasks and handles of a connection share.
//! * `reader`: the reader task (socket -> decoder -> state -> streams).
//! * `writer`: the writer task and direct writes ([`MuxWrite`]).
//! * `spinning`: the socket halves counted so the reader spins after
//!   activity instead of sleeping at once.
//! * `handles`: the [`SendStream`](crate::SendStream) and
//!   [`RecvStream`](crate::RecvStream) of a stream.
//! * [`conn`]: the handshake and [`MuxConnection`].
//!
//! Imports go one way: sans-IO files import only each other (and
//! `crate::` error types), drivers import sans-IO files and the drivers
//! listed before them (`writer` < `spinning` < `shared` < `handles` < `reader` < `conn`).
//! This file only declares and re-exports.

pub mod conn;
pub mod flow;
pub mod frame;
mod handles;
mod reader;
mod shared;
mod spinning;
pub mod state;
mod writer;

#[cfg(any(feature = "ucx", feature = "shm"))]
pub(crate) use conn::establish_with;
pub use conn::{EstablishError, MuxConnection, SocketInfo, establish};
#[cfg(feature = "shm")]
pub(crate) use handles::{MuxRecv, MuxSend};
#[cfg(any(feature = "ucx", feature = "shm"))]
pub(crate) use shared::DiscardHook;
pub use state::Role;
pub use writer::{MuxWrite, QueuedWrite};
