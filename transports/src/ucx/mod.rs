//! `ucx://host:port`: every frame (headers, small payloads, errors) travels
//! through [UCX](https://openucx.org) as a UCP stream on the connection's
//! endpoint, and chunk payloads of at least
//! [`UcxConfig::min_chunk_bytes`](crate::config::UcxConfig) as tagged
//! messages, which UCX moves by rendezvous (the receiver posts its buffer,
//! the bytes go by zero-copy get/put: RDMA on InfiniBand/RoCE NICs, a single
//! `process_vm_readv` copy with `cma` on one host). A TCP connection to
//! `host:port` exchanges the two workers' addresses and then stays open as
//! the control channel: each side's closing byte count, and a dead peer's
//! end. UCX picks the transport from its environment (`UCX_TLS`,
//! `UCX_NET_DEVICES`); with `UCX_TLS` unset, a peer on this host (same boot
//! and namespaces, told by a token in the preamble) gets a worker limited to
//! UCX's shared-memory transports.
//!
//! On such a worker (UCX's shared memory only), a tensor of at least
//! [`UcxConfig::min_put_bytes`](crate::config::UcxConfig) goes by **puts**
//! after its first chunk: that chunk asks for memory, the receiver answers
//! with a grant of the tensor's receive buffer (UCX-allocated, recycled by
//! the receive pool), and the sender puts the rest straight into it
//! (`ucp_put_nbx`: one copy; the tagged rendezvous over UCX's shared memory
//! copies twice, through its bounce buffers). Over `tcp` UCX would emulate
//! puts in software, and over RDMA NICs they are unmeasured here, so those
//! keep the tagged rendezvous (zero-copy get by the NIC).
//!
//! Files, by concern (imports go one way, down this list):
//! * `ffi`: the hand-written UCP declarations, loaded with `dlopen`.
//! * `answer`: the grant message for puts (sans-IO; built for fuzzing too).
//! * `grant`: UCX-allocated receive buffers, granted for puts.
//! * `worker`: a UCP worker and its endpoint on their own progress thread.
//! * `stream`: the mux's byte stream over the UCP stream, and its close.
//! * `rendezvous`: the streams, diverting large payloads to UCX.
//! * `conn`: connect/listen, the address exchange, the [`Connection`](crate::Connection).
//!
//! This file only declares and re-exports.
//!
//! ## Why hand-written bindings loaded at run time
//! The transport uses 21 UCP functions. `async-ucx`/`ucx1-sys` build UCX
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
//! for it on that thread). The thread keeps polling for
//! [`TransportConfig::spin`](crate::TransportConfig::spin) (50 µs) after the last
//! activity, yielding the core every few polls, so that a reply within it
//! costs no wake-up; then it arms the worker and sleeps in `poll(2)` on the
//! worker's event fd: an idle connection costs no CPU. Tasks hand it
//! commands through a queue and ring its eventfd only while it sleeps.
//!
//! Each frame crosses two threads per side (the task and the progress
//! thread), where a socket's crosses one: measured on a 2-core VM,
//! 4 KiB calls through the UCP stream took 27–34 µs at the median against
//! 31–76 µs when the frames went over the TCP socket (before this design),
//! because the spinning thread answers without a wake-up.
//!
//! ## Registrations
//! UCX registers the buffers of rendezvous messages itself and caches the
//! registrations in its registration cache, bounded by UCX
//! (`UCX_RCACHE_MAX_SIZE`, `UCX_RCACHE_MAX_REGIONS`); a buffer is only
//! freed after UCX reported its operation complete, so no registration
//! outlives its memory. Granted regions are `RecvBuf`s the receive pool
//! recycles (so a steady stream of tensors reuses warm ones, and the pool's
//! memory budget bounds them); a region is unmapped when its buffer is
//! freed, and one whose grant ended before the tensor's last chunk (the
//! reader gave up; the sender may still put) is never recycled. A sender keeps the keys of
//! the last 8 regions it was granted unpacked (an unpacked key of a
//! shared-memory region maps its segment), destroyed with the worker.
//!
//! ## Trust
//! Every frame from the peer is checked as on any transport, but UCX itself
//! trusts its peer: over shared memory the peer writes UCX's own queues, and
//! a hostile one brought a test server down (overwritten System V segments:
//! UCX aborts on an assertion; shrunk POSIX segments: SIGBUS). `ucx://` is
//! for peers that trust each other (a cluster's processes); `shm://`
//! checks everything it reads from shared memory, `tcp://`/`tcps://`
//! everything from the socket.
//!
//! ## Not done
//! GPU memory: with feature `cuda`, tensors on the device go through
//! pinned host memory (no `UCS_MEMORY_TYPE_CUDA` registration yet).
//! [`ucx_memory_types`] tells whether this process's UCX could move device
//! memory itself (Debian's UCX: `host` only); the client logs which case it
//! is at the first GPU transfer over `ucx://`.

mod answer;
#[cfg(feature = "ucx")]
mod conn;
#[cfg(feature = "ucx")]
mod ffi;
#[cfg(feature = "ucx")]
mod grant;
#[cfg(feature = "ucx")]
mod rendezvous;
#[cfg(feature = "ucx")]
mod stream;
#[cfg(feature = "ucx")]
mod worker;

/// The grant message's fuzz entry point (see `tensorwire::fuzzing`).
#[cfg(feature = "fuzzing")]
pub use answer::fuzz as fuzz_grant;
#[cfg(feature = "ucx")]
pub use conn::{connect, listen};
#[cfg(feature = "ucx")]
pub use ffi::{ucx_memory_types, ucx_peer_failure_detection, ucx_puts, ucx_transports, ucx_version};
#[cfg(feature = "ucx")]
pub use worker::{UcxStats, stats};
