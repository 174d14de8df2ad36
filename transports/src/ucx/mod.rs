//! `ucx://host:port`: the mux over a TCP control socket carries frame
//! headers and small payloads; chunk payloads of at least
//! [`UcxConfig::min_chunk_bytes`](crate::config::UcxConfig) travel through
//! [UCX](https://openucx.org) as tagged messages, which UCX moves by
//! rendezvous (the receiver posts its buffer, the bytes go by zero-copy
//! get/put: RDMA on InfiniBand/RoCE NICs, a single `process_vm_readv` copy
//! with `cma` on one host). UCX picks the transport from its environment
//! (`UCX_TLS`, `UCX_NET_DEVICES`); with `UCX_TLS` unset, a peer on this host
//! (same boot and namespaces, told by a token in the preamble) gets a
//! worker limited to UCX's shared-memory transports.
//!
//! Files, by concern (imports go one way, down this list):
//! * `ffi`: the hand-written UCP declarations, loaded with `dlopen`.
//! * `worker`: a UCP worker and its endpoint on their own progress thread.
//! * `rendezvous`: the streams, diverting large payloads to UCX.
//! * `conn`: connect/listen, the address exchange, the [`Connection`](crate::Connection).
//!
//! This file only declares and re-exports.
//!
//! ## Why hand-written bindings loaded at run time
//! The transport uses 17 UCP functions. `async-ucx`/`ucx1-sys` build UCX
//! from source (minutes of build, an old UCX, not the system's one that
//! knows the cluster's NICs); `ucx-sys` and `bindgen` pull libclang into the
//! build for declarations that fit on a page. The declarations here are
//! checked against UCX 1.13's headers (the version the tests run); UCP's
//! ABI is stable across 1.x. Loading `libucp.so.0` at first use (instead of
//! linking it) means a binary built with `--features ucx` still starts on a
//! machine without UCX and reports "cannot load libucp.so.0: install UCX
//! ..." when a `ucx://` URL is used; `build.rs` still requires UCX at build
//! time and names the package to install.
//!
//! ## Threads and progress
//! Each connection has its own UCP worker, driven by a dedicated thread (a
//! UCP worker is not thread-safe; one thread per worker keeps every call
//! for it on that thread). The thread spins briefly after activity, then
//! arms the worker and sleeps in `poll(2)` on the worker's event fd: an
//! idle connection costs no CPU.
//!
//! ## Registrations
//! UCX registers the buffers of rendezvous messages itself and caches the
//! registrations in its registration cache, bounded by UCX
//! (`UCX_RCACHE_MAX_SIZE`, `UCX_RCACHE_MAX_REGIONS`); a buffer is only
//! freed after UCX reported its operation complete, so no registration
//! outlives its memory.
//!
//! ## Not done
//! GPU memory: with feature `cuda`, tensors on the device go through
//! pinned host memory (no `UCS_MEMORY_TYPE_CUDA` registration yet).
//! [`ucx_memory_types`] tells whether this process's UCX could move device
//! memory itself (Debian's UCX: `host` only); the client logs which case it
//! is at the first GPU transfer over `ucx://`.

mod conn;
mod ffi;
mod rendezvous;
mod worker;

pub use conn::{connect, listen};
pub use ffi::{ucx_memory_types, ucx_peer_failure_detection, ucx_transports, ucx_version};
pub use worker::{UcxStats, stats};
