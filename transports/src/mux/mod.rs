//! The stream multiplexer used by byte-stream transports (TCP, Unix, shm).
//!
//! * [`frame`]: the wire format (preface, 16-byte frame heads), sans-IO.
//! * [`flow`]: per-stream credit windows, sans-IO.
//! * [`conn`]: the tokio driver (reader and writer tasks, stream handles).
//!
//! Each logical stream gets a window of credit; a stream blocked on credit
//! blocks nobody else, so a slow consumer of one call never stalls the other
//! calls on the connection.

pub mod conn;
pub mod flow;
pub mod frame;
mod reader;
mod writer;

pub use conn::{EstablishError, MuxConnection, Role, SocketInfo, establish};
pub use writer::MuxWrite;
