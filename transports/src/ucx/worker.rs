//! One UCP worker and its endpoint to the peer, owned by a dedicated
//! progress thread. A UCP worker is not thread-safe; giving it a thread of
//! its own keeps every UCP call for it on that thread, while tokio tasks
//! talk to it through a command queue and get results through oneshots.
//!
//! The thread never busy-spins while idle: after a short spin (for latency)
//! it arms the worker (`ucp_worker_arm`) and sleeps in `poll(2)` on the
//! worker's event fd (`ucp_worker_get_efd`) and an eventfd that commands ring.
//!
//! Buffer lifetime: a payload handed to UCX (a send's `Bytes`, a receive's
//! `Vec`) lives in the operation's box, which the thread frees only after
//! UCX reported the operation complete (done, failed or cancelled). When a
//! worker is torn down, unmatched receives are cancelled and the endpoint
//! is force-closed, which completes the other operations with an error;
//! operations UCX has not completed within two seconds fail, and their
//! buffers are freed only once the worker is destroyed and only where no
//! transfer can bypass its progress (otherwise leaked, counted in
//! [`UcxStats::operations_abandoned`]), never freed under UCX.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::ffi::{self, Api, Ep, Worker};
use super::grant;
use crate::sync::lock;

/// Polls of `ucp_worker_progress` without progress before sleeping, at
/// least (see [`TransportConfig::spin`](crate::TransportConfig::spin)).
const SPIN: u32 = 64;
/// How long teardown waits for cancelled operations to complete.
const TEARDOWN: Duration = Duration::from_secs(2);
/// Frame-stream bytes pulled from UCX and not yet read by the connection's
/// reader, beyond which the thread leaves further bytes with UCX until the
/// reader catches up.
const INBOX_MAX: usize = 4 << 20;
/// How long the frame stream may take to deliver the bytes the peer said
/// it sent before closing (a peer that lies about the count fails then).
const END_GRACE: Duration = Duration::from_secs(10);
/// No end of the frame stream announced yet.
const NO_END: u64 = u64::MAX;

static OUTSTANDING: AtomicU64 = AtomicU64::new(0);
static BYTES_SENT: AtomicU64 = AtomicU64::new(0);
static BYTES_RECEIVED: AtomicU64 = AtomicU64::new(0);
static WORKERS: AtomicU64 = AtomicU64::new(0);
static ABANDONED: AtomicU64 = AtomicU64::new(0);
static FRAME_BYTES_SENT: AtomicU64 = AtomicU64::new(0);
static FRAME_BYTES_RECEIVED: AtomicU64 = AtomicU64::new(0);
static BYTES_PUT: AtomicU64 = AtomicU64::new(0);
pub(crate) static PAYLOADS_DISCARDED: AtomicU64 = AtomicU64::new(0);
/// Set when the process exits: every progress thread tears down.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Runs at process exit (registered once, after libucx was loaded, so
/// before its library destructors): stops the progress threads and waits
/// (bounded) until they have destroyed their workers. Handles no longer
/// join their thread, so without this a thread still tearing down when
/// `main` returns ran into UCX's destructors (a SIGSEGV in
/// `ucs_async_context_cleanup`, seen about once in 50 test runs).
extern "C" fn stop_at_exit() {
    EXITING.store(true, Ordering::Release);
    // A sleeping thread notices within its poll timeout (1 s).
    let deadline = Instant::now() + TEARDOWN + Duration::from_millis(1500);
    while WORKERS.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn stop_threads_at_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain `extern "C" fn()` that touches only atomics
    // and sleeps.
    ONCE.call_once(|| unsafe {
        libc::atexit(stop_at_exit);
    });
}

/// Remote keys one worker keeps unpacked (one per region the peer granted
/// lately; an unpacked key of a shared-memory region maps its segment).
const RKEYS_MAX: usize = 8;

/// Process-wide counters of the UCX transport.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UcxStats {
    /// Operations handed to UCX and not completed yet: each holds a
    /// payload buffer (and UCX's registration of it).
    pub operations_outstanding: u64,
    /// Payload bytes UCX delivered to peers.
    pub bytes_sent: u64,
    /// Payload bytes received through UCX (by tag, or put into memory
    /// this process granted).
    pub bytes_received: u64,
    /// UCP workers alive (one per connection).
    pub workers: u64,
    /// Operations UCX had not completed when their connection was torn
    /// down: failed, their buffers deliberately leaked.
    pub operations_abandoned: u64,
    /// Frame-stream bytes (headers and small payloads) UCX completed.
    pub frame_bytes_sent: u64,
    /// Frame-stream bytes received through UCX.
    pub frame_bytes_received: u64,
    /// Payload bytes this process put into memory its peers granted (part
    /// of `bytes_sent`).
    pub bytes_put: u64,
    /// Grants this process answered with memory for a peer's puts.
    pub grants: u64,
    /// Regions of UCX-allocated memory (tensor buffers that can be
    /// granted) alive now, in use or idle in the receive pool.
    pub regions: u64,
    /// Regions allocated since the start (a steady stream of tensors
    /// reuses them through the receive pool).
    pub regions_allocated: u64,
    /// Chunk payloads nobody read (their stream's receiver was gone)
    /// received into scratch memory and dropped, so that their senders'
    /// sends complete.
    pub payloads_discarded: u64,
}

/// Counts payload bytes a peer put into granted memory (the receiver sees
/// them when their frame arrives).
pub(crate) fn count_put_received(n: u64) {
    BYTES_RECEIVED.fetch_add(n, Ordering::Relaxed);
}

/// The counters now.
pub fn stats() -> UcxStats {
    UcxStats {
        operations_outstanding: OUTSTANDING.load(Ordering::Relaxed),
        bytes_sent: BYTES_SENT.load(Ordering::Relaxed),
        bytes_received: BYTES_RECEIVED.load(Ordering::Relaxed),
        workers: WORKERS.load(Ordering::Relaxed),
        operations_abandoned: ABANDONED.load(Ordering::Relaxed),
        frame_bytes_sent: FRAME_BYTES_SENT.load(Ordering::Relaxed),
        frame_bytes_received: FRAME_BYTES_RECEIVED.load(Ordering::Relaxed),
        bytes_put: BYTES_PUT.load(Ordering::Relaxed),
        grants: grant::GRANTS.load(Ordering::Relaxed),
        regions: grant::REGIONS.load(Ordering::Relaxed),
        regions_allocated: grant::REGIONS_ALLOCATED.load(Ordering::Relaxed),
        payloads_discarded: PAYLOADS_DISCARDED.load(Ordering::Relaxed),
    }
}

/// Result of a receive: where its bytes landed, and how many arrived.
pub(crate) type RecvResult = Result<Landed, String>;

/// Where a UCX receive lands.
pub(crate) enum RecvTarget {
    /// A buffer of its own, handed back when the receive completes.
    Owned(Vec<u8>),
    /// `len` bytes at `offset` of a stream's placement buffer, kept locked
    /// (and so alive and unmoved) until every receive posted into it is
    /// done with it.
    Placed { region: Arc<LockedRegion>, offset: usize, len: usize },
}

/// A placement buffer locked for the UCX receives posted into it (several
/// at once, into disjoint ranges: the receiver posts the next chunks of a
/// tensor while the first is still arriving). The lock is released when
/// the last receive holding it completes.
pub(crate) struct LockedRegion {
    base: *mut u8,
    len: usize,
    _guard: tokio::sync::OwnedMutexGuard<crate::RecvBuf>,
}

// SAFETY: `base` points into the buffer `_guard` keeps locked (no one else
// reaches it), alive and unmoved for as long as this value lives; the
// value itself only hands out that address for UCX to write through.
unsafe impl Send for LockedRegion {}
// SAFETY: as above; shared references read `base` and `len` only.
unsafe impl Sync for LockedRegion {}

impl LockedRegion {
    /// Locks for UCX the buffer behind `guard`.
    pub(crate) fn new(mut guard: tokio::sync::OwnedMutexGuard<crate::RecvBuf>) -> Self {
        let buf: &mut [u8] = &mut guard;
        let (base, len) = (buf.as_mut_ptr(), buf.len());
        Self { base, len, _guard: guard }
    }
}

impl RecvTarget {
    /// The region UCX writes into; None when a placed range lies outside
    /// its buffer (callers check first; this keeps the pointer sound).
    fn region(&mut self) -> Option<(*mut c_void, usize)> {
        match self {
            RecvTarget::Owned(b) => Some((b.as_mut_ptr() as *mut c_void, b.len())),
            RecvTarget::Placed { region, offset, len } => {
                if offset.checked_add(*len)? > region.len {
                    return None;
                }
                // SAFETY: `offset + len` lies within the locked buffer.
                Some((unsafe { region.base.add(*offset) } as *mut c_void, *len))
            }
        }
    }

    /// What the receiver gets back once `n` bytes arrived.
    fn landed(&mut self, n: usize) -> Landed {
        match self {
            RecvTarget::Owned(b) => {
                let mut b = std::mem::take(b);
                b.truncate(n);
                Landed::Owned(b)
            }
            RecvTarget::Placed { .. } => Landed::Placed(n),
        }
    }
}

/// A completed receive: its own buffer, or the bytes written in place.
pub(crate) enum Landed {
    /// The received bytes.
    Owned(Vec<u8>),
    /// This many bytes were written into the placement buffer.
    Placed(usize),
}

enum Cmd {
    Send {
        tag: u64,
        data: Bytes,
        done: oneshot::Sender<Result<(), String>>,
    },
    Recv {
        tag: u64,
        target: RecvTarget,
        done: oneshot::Sender<RecvResult>,
    },
    /// Frame-stream bytes (`ucp_stream_send_nbx`).
    Stream {
        data: Bytes,
    },
    /// Resolves once everything sent before it reached the peer
    /// (`ucp_ep_flush_nbx`).
    Flush {
        done: oneshot::Sender<Result<(), String>>,
    },
    /// Cancels the receives of `tag` UCX has not matched yet (their
    /// callers gave up: see [`WorkerHandle::cancel_recv`]).
    CancelRecv {
        tag: u64,
    },
    /// `data` put at `addr` of the region the peer granted (`ucp_put_nbx`).
    Put {
        put: Put,
        done: oneshot::Sender<Result<(), String>>,
    },
}

/// One put into memory the peer granted.
pub(crate) struct Put {
    /// The region (names the key in the worker's cache).
    pub region: u64,
    /// Its packed remote key (unpacked once per region).
    pub rkey: Arc<[u8]>,
    /// Where the bytes go, in the peer's address space (inside the grant).
    pub addr: u64,
    /// The bytes.
    pub data: Bytes,
}

/// Frame-stream bytes pulled from UCX, waiting for the connection's reader.
#[derive(Default)]
struct Inbox {
    chunks: VecDeque<Bytes>,
    /// Bytes in `chunks`.
    queued: usize,
    /// Bytes pulled from UCX since the start.
    pulled: u64,
    /// The reader waiting for bytes.
    waker: Option<Waker>,
    /// The stream is over: `Ok` at the end the peer announced, `Err` when
    /// the worker stopped first.
    end: Option<Result<(), String>>,
}

/// Frame-stream bytes handed to UCX and not yet completed.
#[derive(Default)]
struct Outbox {
    pending: usize,
    waker: Option<Waker>,
}

/// The handle tokio tasks hold.
pub(crate) struct WorkerHandle {
    shared: Arc<Shared>,
    /// A task aborted when the worker goes (the control socket's watch).
    attached: Mutex<Option<tokio::task::AbortHandle>>,
    /// This worker's address, for the peer's `ucp_ep_create`.
    pub(crate) address: Vec<u8>,
    /// The context the worker belongs to (its regions come from it).
    pub(crate) ctx: ffi::Ctx,
}

struct Shared {
    /// Commands for the thread; None once it tore down (commands then
    /// fail at once instead of waiting in a queue no one reads).
    queue: Mutex<Option<Vec<Cmd>>>,
    wake: OwnedFd,
    /// The thread sleeps (or is about to) in `poll(2)`: commands must ring.
    sleeping: AtomicBool,
    stop: AtomicBool,
    /// Set by the endpoint's error handler or at teardown: why ops fail.
    failed: Mutex<Option<String>>,
    inbox: Mutex<Inbox>,
    outbox: Mutex<Outbox>,
    /// Total frame-stream bytes the peer sent before finishing
    /// ([`NO_END`] until it says).
    end_after: AtomicU64,
}

impl Shared {
    fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), &one as *const u64 as *const c_void, 8) };
    }

    /// Rings only when the thread sleeps (or is about to): a spinning
    /// thread sees the queue on its own. Pairs with the fence in
    /// [`Progress::sleep`].
    fn nudge(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.ring();
        }
    }

    /// Ends the frame stream (the first reason given wins) and wakes both
    /// of its sides.
    fn end_stream(&self, end: Result<(), String>) {
        let w = {
            let mut inbox = lock(&self.inbox);
            inbox.end.get_or_insert(end);
            inbox.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
        if let Some(w) = lock(&self.outbox).waker.take() {
            w.wake();
        }
    }
}

/// Raw UCP handles moved onto the progress thread.
struct Raw {
    api: &'static Api,
    worker: Worker,
    /// Use peer failure mode (see [`ffi::context`]).
    peer_failure: bool,
}
// SAFETY: the worker is created on the caller's thread and from then on used
// only by the progress thread it is moved to (thread mode SINGLE allows one
// thread at a time; the hand-over happens-before through thread spawn).
unsafe impl Send for Raw {}

/// The endpoint on its way to the progress thread.
struct EpPtr(Ep);
// SAFETY: created on the caller's thread for a worker that has not started
// progressing; from the hand-over on, only the progress thread uses it.
unsafe impl Send for EpPtr {}

impl EpPtr {
    fn get(self) -> Ep {
        self.0
    }
}

impl WorkerHandle {
    /// Creates a worker (its progress thread starts once the peer's address
    /// is known, in [`connect`](Self::connect)).
    /// `same_host`: the peer shares this host and its namespaces (the
    /// worker then comes from [`ffi::context_for`]'s same-host context).
    pub(crate) fn new(peer: &str, same_host: bool) -> Result<(Self, PendingWorker), String> {
        let context = ffi::context_for(same_host)?;
        let ffi::Ctx { api, ctx, peer_failure, .. } = context.clone();
        let params = ffi::WorkerParams { field_mask: 0, _rest: [0; 512] };
        let mut worker: Worker = std::ptr::null_mut();
        // SAFETY: live context, valid params and out-pointer.
        let s = unsafe { (api.worker_create)(ctx, &params, &mut worker) };
        if s != ffi::UCS_OK {
            return Err(format!("ucp_worker_create: {}", ffi::status_str(api, s)));
        }
        let raw = Raw { api, worker, peer_failure };
        let address = match raw.address() {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: the worker was created above and nothing uses it.
                unsafe { (api.worker_destroy)(worker) };
                return Err(e);
            }
        };
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            // SAFETY: as above.
            unsafe { (api.worker_destroy)(worker) };
            return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
        }
        let shared = Arc::new(Shared {
            queue: Mutex::new(Some(Vec::new())),
            // SAFETY: fd is a fresh descriptor we own.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
            inbox: Mutex::new(Inbox::default()),
            outbox: Mutex::new(Outbox::default()),
            end_after: AtomicU64::new(NO_END),
        });
        let handle = WorkerHandle { shared: shared.clone(), attached: Mutex::new(None), address, ctx: context };
        Ok((handle, PendingWorker { raw: Some(raw), shared, peer: peer.to_string() }))
    }

    /// Connects to the peer worker at `peer_address` and starts progress.
    /// `spin`: how long the thread keeps polling after activity before it
    /// sleeps.
    pub(crate) fn connect(
        &self,
        mut pending: PendingWorker,
        peer_address: &[u8],
        spin: Duration,
    ) -> Result<(), String> {
        let Some(raw) = pending.raw.take() else { return Err("worker already started".into()) };
        let ep = match raw.ep_create(peer_address, Arc::as_ptr(&pending.shared) as *mut c_void) {
            Ok(ep) => ep,
            Err(e) => {
                // SAFETY: no endpoint or operation uses the worker yet.
                unsafe { (raw.api.worker_destroy)(raw.worker) };
                return Err(e);
            }
        };
        let shared = pending.shared.clone();
        let ep = EpPtr(ep);
        let name = format!("tw-ucx {}", pending.peer);
        stop_threads_at_exit();
        // Counted from here (not from the thread's start), so that an exit
        // right after this waits for it too.
        WORKERS.fetch_add(1, Ordering::AcqRel);
        std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || {
                Progress { raw, ep: ep.get(), spin, shared, ops: HashMap::new(), next: 1, rkeys: Vec::new() }.run()
            })
            .map_err(|e| {
                WORKERS.fetch_sub(1, Ordering::AcqRel);
                format!("cannot start the UCX progress thread: {e}")
            })?;
        Ok(())
    }

    /// Sends `data` as a tagged message; resolves once UCX has delivered it
    /// (for large messages: once the peer has pulled it by rendezvous).
    pub(crate) fn send(&self, tag: u64, data: Bytes) -> oneshot::Receiver<Result<(), String>> {
        let (done, rx) = oneshot::channel();
        self.submit(Cmd::Send { tag, data, done });
        rx
    }

    /// Receives the message tagged `tag` into `target`.
    pub(crate) fn recv(&self, tag: u64, target: RecvTarget) -> oneshot::Receiver<RecvResult> {
        let (done, rx) = oneshot::channel();
        self.submit(Cmd::Recv { tag, target, done });
        rx
    }

    /// Gives up the receives of `tag` that UCX has not matched with a
    /// message yet (a peer that announced a payload and never sent it):
    /// they fail as cancelled and their buffers are freed. A receive whose
    /// message is arriving completes as usual.
    pub(crate) fn cancel_recv(&self, tag: u64) {
        self.submit(Cmd::CancelRecv { tag });
    }

    fn submit(&self, cmd: Cmd) {
        // A stopped worker drops the command, whose oneshot then reports
        // the connection gone.
        if self.shared.stop.load(Ordering::Acquire) {
            return;
        }
        match lock(&self.shared.queue).as_mut() {
            Some(q) => q.push(cmd),
            // Torn down: dropping the command fails its caller.
            None => return,
        }
        self.shared.nudge();
    }

    /// Hands frame-stream bytes to UCX (in order with earlier ones);
    /// returns at once. Fails once the worker stopped.
    pub(crate) fn stream_send(&self, data: Bytes) -> Result<(), String> {
        if let Some(why) = self.failure() {
            return Err(why);
        }
        lock(&self.shared.outbox).pending += data.len();
        self.submit(Cmd::Stream { data });
        Ok(())
    }

    /// Ready when fewer than `limit` frame-stream bytes wait for UCX;
    /// fails once the worker stopped.
    pub(crate) fn poll_stream_room(&self, cx: &mut Context<'_>, limit: usize) -> Poll<Result<(), String>> {
        if let Some(why) = self.failure() {
            return Poll::Ready(Err(why));
        }
        let mut out = lock(&self.shared.outbox);
        if out.pending < limit {
            return Poll::Ready(Ok(()));
        }
        out.waker = Some(cx.waker().clone());
        drop(out);
        // The thread may have failed (and woken no one) in between.
        match self.failure() {
            Some(why) => Poll::Ready(Err(why)),
            None => Poll::Pending,
        }
    }

    /// Frame-stream bytes handed to UCX and not completed yet.
    pub(crate) fn stream_pending(&self) -> usize {
        lock(&self.shared.outbox).pending
    }

    /// Puts bytes into memory the peer granted; resolves once UCX is done
    /// with `put.data` (a [`flush`](Self::flush) after it tells when the
    /// bytes are at the peer).
    pub(crate) fn put(&self, put: Put) -> oneshot::Receiver<Result<(), String>> {
        let (done, rx) = oneshot::channel();
        self.submit(Cmd::Put { put, done });
        rx
    }

    /// Resolves once every operation started before it reached the peer.
    pub(crate) fn flush(&self) -> oneshot::Receiver<Result<(), String>> {
        let (done, rx) = oneshot::channel();
        self.submit(Cmd::Flush { done });
        rx
    }

    /// Copies received frame-stream bytes into `buf`; `Ok` with nothing
    /// written at the end the peer announced, an error when the worker
    /// stopped before it.
    pub(crate) fn poll_stream_read(
        &self,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let mut inbox = lock(&self.shared.inbox);
        if inbox.chunks.is_empty() {
            return match &inbox.end {
                Some(Ok(())) => Poll::Ready(Ok(())),
                Some(Err(why)) => {
                    Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, why.clone())))
                }
                None => {
                    inbox.waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            };
        }
        let was_full = inbox.queued >= INBOX_MAX;
        while buf.remaining() > 0 {
            let Some(front) = inbox.chunks.front_mut() else { break };
            let n = front.len().min(buf.remaining());
            buf.put_slice(&front[..n]);
            if n == front.len() {
                inbox.chunks.pop_front();
            } else {
                bytes::Buf::advance(front, n);
            }
            inbox.queued -= n;
        }
        let refill = was_full && inbox.queued < INBOX_MAX;
        drop(inbox);
        if refill {
            // The thread left bytes with UCX while the inbox was full.
            self.shared.ring();
        }
        Poll::Ready(Ok(()))
    }

    /// The peer finished its frame stream after `total` bytes: the stream
    /// ends once that many arrived.
    pub(crate) fn peer_finished(&self, total: u64) {
        self.shared.end_after.store(total, Ordering::Release);
        self.shared.ring();
    }

    /// Aborts `task` when this handle is dropped.
    pub(crate) fn attach(&self, task: tokio::task::AbortHandle) {
        *lock(&self.attached) = Some(task);
    }

    /// Why operations fail, once they do.
    pub(crate) fn failure(&self) -> Option<String> {
        lock(&self.shared.failed).clone()
    }

    /// Stops the thread: outstanding operations fail, the endpoint and the
    /// worker are released. Idempotent; does not wait.
    pub(crate) fn stop(&self, why: &str) {
        lock(&self.shared.failed).get_or_insert_with(|| why.to_string());
        self.shared.stop.store(true, Ordering::Release);
        self.shared.ring();
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.stop("connection dropped");
        if let Some(task) = lock(&self.attached).take() {
            task.abort();
        }
        // The thread tears down on its own (waiting on UCX for at most
        // TEARDOWN): not joined, since the last handle is often dropped on
        // a runtime thread that other connections need meanwhile.
    }
}

/// A worker created but not connected yet; destroys it when dropped.
pub(crate) struct PendingWorker {
    raw: Option<Raw>,
    shared: Arc<Shared>,
    peer: String,
}

impl Drop for PendingWorker {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            // SAFETY: never connected: no endpoint, no operation.
            unsafe { (raw.api.worker_destroy)(raw.worker) };
        }
    }
}

impl Raw {
    fn address(&self) -> Result<Vec<u8>, String> {
        let mut addr: *mut ffi::Address = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker, valid out-pointers.
        let s = unsafe { (self.api.worker_get_address)(self.worker, &mut addr, &mut len) };
        if s != ffi::UCS_OK {
            return Err(format!("ucp_worker_get_address: {}", ffi::status_str(self.api, s)));
        }
        // SAFETY: UCX returned `len` readable bytes at `addr`, released below.
        let v = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: the address came from this worker.
        unsafe { (self.api.worker_release_address)(self.worker, addr) };
        Ok(v)
    }

    /// Creates the endpoint to the peer's worker, in peer failure mode when
    /// the process's transports support it (a dead peer then fails our
    /// operations instead of hanging them). Without it (UCX 1.13's sysv and
    /// posix), the TCP control socket detects a dead peer and the worker is
    /// torn down.
    fn ep_create(&self, peer: &[u8], arg: *mut c_void) -> Result<Ep, String> {
        self.ep_create_mode(peer, arg, self.peer_failure)
    }

    fn ep_create_mode(&self, peer: &[u8], arg: *mut c_void, peer_mode: bool) -> Result<Ep, String> {
        let mut field_mask = ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        if peer_mode {
            field_mask |= ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER;
        }
        let params = ffi::EpParams {
            field_mask,
            address: peer.as_ptr() as *const ffi::Address,
            err_mode: ffi::UCP_ERR_HANDLING_MODE_PEER,
            err_cb: Some(on_ep_error),
            err_arg: arg,
            _rest: [0; 128],
        };
        let mut ep: Ep = std::ptr::null_mut();
        // SAFETY: live worker; `peer` holds a worker address the peer sent
        // (UCX validates it and fails with a status on garbage); `arg`
        // points at the Shared the progress thread keeps alive for as long
        // as the endpoint exists.
        let s = unsafe { (self.api.ep_create)(self.worker, &params, &mut ep) };
        if s != ffi::UCS_OK {
            return Err(format!("ucp_ep_create: {}", ffi::status_str(self.api, s)));
        }
        Ok(ep)
    }
}

/// Endpoint error handler: records the failure; the progress thread fails
/// outstanding operations (UCX completes them with an error status too).
unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: Ep, status: ffi::Status) {
    // SAFETY: `arg` is the Shared the progress thread holds an Arc of until
    // after the endpoint is closed, and this runs on that thread.
    let shared = unsafe { &*(arg as *const Shared) };
    let why = match ffi::api() {
        Ok(api) => ffi::status_str(api, status),
        Err(e) => e,
    };
    lock(&shared.failed).get_or_insert_with(|| format!("UCX endpoint failed: {why}"));
}

enum OpKind {
    Send { data: Bytes, done: Option<oneshot::Sender<Result<(), String>>> },
    Put { data: Bytes, done: Option<oneshot::Sender<Result<(), String>>> },
    Recv { tag: u64, target: RecvTarget, done: Option<oneshot::Sender<RecvResult>> },
    Stream { data: Bytes },
    Flush { done: Option<oneshot::Sender<Result<(), String>>> },
}

/// One operation UCX may still be working on.
struct Op {
    kind: OpKind,
    /// The UCP request (null once freed or when completed at once).
    request: *mut c_void,
    /// Set by the completion callback: status and received length.
    result: Option<(ffi::Status, usize)>,
    /// Filled by UCX when a receive completes at once.
    info: ffi::TagRecvInfo,
}

struct Progress {
    raw: Raw,
    ep: Ep,
    /// How long to keep polling after the last activity before sleeping.
    spin: Duration,
    shared: Arc<Shared>,
    ops: HashMap<u64, Box<Op>>,
    next: u64,
    /// Unpacked remote keys of regions the peer granted, most recent last.
    rkeys: Vec<(u64, ffi::Rkey)>,
}

unsafe extern "C" fn on_send(_req: *mut c_void, status: ffi::Status, user_data: *mut c_void) {
    // SAFETY: user_data is the Op box, alive until its result is taken,
    // which happens after this callback ran (same thread).
    let op = unsafe { &mut *(user_data as *mut Op) };
    op.result = Some((status, 0));
}

unsafe extern "C" fn on_recv(
    _req: *mut c_void,
    status: ffi::Status,
    info: *const ffi::TagRecvInfo,
    user_data: *mut c_void,
) {
    // SAFETY: as in on_send; `info` is valid during the callback when non-null.
    let op = unsafe { &mut *(user_data as *mut Op) };
    let len = if info.is_null() { 0 } else { unsafe { (*info).length } };
    op.result = Some((status, len));
}

impl Progress {
    fn run(mut self) {
        let api = self.raw.api;
        let mut efd: libc::c_int = -1;
        // SAFETY: live worker (created with UCP_FEATURE_WAKEUP).
        let s = unsafe { (api.worker_get_efd)(self.raw.worker, &mut efd) };
        if s != ffi::UCS_OK {
            lock(&self.shared.failed).get_or_insert_with(|| format!("ucp_worker_get_efd: {}", ffi::status_str(api, s)));
            self.shared.stop.store(true, Ordering::Release);
        }
        let mut idle = 0u32;
        let mut end_deadline = None;
        // When the thread last went idle (None while busy).
        let mut idle_since: Option<Instant> = None;
        while !self.shared.stop.load(Ordering::Acquire) && !EXITING.load(Ordering::Acquire) {
            let cmds = lock(&self.shared.queue).as_mut().map(std::mem::take).unwrap_or_default();
            let had_cmds = !cmds.is_empty();
            for c in cmds {
                self.start(c);
            }
            // SAFETY: live worker, on its own thread.
            let n = unsafe { (api.worker_progress)(self.raw.worker) };
            self.reap();
            let pulled = self.pull();
            self.check_end(&mut end_deadline);
            if lock(&self.shared.failed).is_some() {
                break;
            }
            if n > 0 || had_cmds || pulled {
                idle = 0;
                idle_since = None;
                continue;
            }
            idle += 1;
            // Spin (for latency) for `spin` after the last activity, at
            // least SPIN polls, reading the clock and yielding the core every
            // 16 polls (on a busy machine the tasks this thread serves need
            // it more than the spin does).
            if !idle.is_multiple_of(16) {
                std::hint::spin_loop();
                continue;
            }
            if idle < SPIN || idle_since.get_or_insert_with(Instant::now).elapsed() < self.spin {
                std::thread::yield_now();
                continue;
            }
            idle = 0;
            // SAFETY: live worker.
            match unsafe { (api.worker_arm)(self.raw.worker) } {
                ffi::UCS_ERR_BUSY => continue,
                ffi::UCS_OK => self.sleep(efd),
                other => {
                    lock(&self.shared.failed)
                        .get_or_insert_with(|| format!("ucp_worker_arm: {}", ffi::status_str(api, other)));
                    break;
                }
            }
        }
        self.teardown();
    }

    /// Sleeps until UCX or a command needs the thread.
    fn sleep(&self, efd: libc::c_int) {
        self.shared.sleeping.store(true, Ordering::SeqCst);
        // Pairs with the fence in `Shared::nudge`: either a submitter sees
        // `sleeping` and rings, or this check sees its command.
        fence(Ordering::SeqCst);
        if lock(&self.shared.queue).as_ref().is_some_and(|q| !q.is_empty()) || self.shared.stop.load(Ordering::Acquire)
        {
            self.shared.sleeping.store(false, Ordering::SeqCst);
            return;
        }
        self.poll_fds(efd);
        self.shared.sleeping.store(false, Ordering::SeqCst);
    }

    fn poll_fds(&self, efd: libc::c_int) {
        let mut fds = [
            libc::pollfd { fd: efd, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.shared.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // A timeout bounds the sleep should a wake-up be missed.
        // SAFETY: two valid pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if fds[1].revents != 0 {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes from our non-blocking eventfd.
            unsafe { libc::read(self.shared.wake.as_raw_fd(), &mut v as *mut u64 as *mut c_void, 8) };
        }
    }

    /// Pulls the frame-stream bytes UCX received into the inbox (while it
    /// has room) and wakes the reader; true when any arrived.
    fn pull(&mut self) -> bool {
        let api = self.raw.api;
        let mut got = Vec::new();
        let mut room = INBOX_MAX.saturating_sub(lock(&self.shared.inbox).queued);
        while room > 0 {
            let mut len = 0usize;
            // SAFETY: live endpoint, on the worker's thread.
            let p = unsafe { (api.stream_recv_data_nb)(self.ep, &mut len) };
            if p.is_null() {
                break;
            }
            if ffi::ptr_is_err(p) {
                let why = format!("UCX stream receive failed: {}", ffi::status_str(api, ffi::ptr_status(p)));
                lock(&self.shared.failed).get_or_insert(why);
                break;
            }
            // SAFETY: UCX returned `len` readable bytes at `p`, ours until
            // released just below.
            got.push(Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(p as *const u8, len) }));
            // SAFETY: data UCX handed out for this endpoint, released once.
            unsafe { (api.stream_data_release)(self.ep, p) };
            room = room.saturating_sub(len);
        }
        if got.is_empty() {
            return false;
        }
        let w = {
            let mut inbox = lock(&self.shared.inbox);
            for b in got {
                FRAME_BYTES_RECEIVED.fetch_add(b.len() as u64, Ordering::Relaxed);
                inbox.pulled += b.len() as u64;
                inbox.queued += b.len();
                inbox.chunks.push_back(b);
            }
            inbox.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
        true
    }

    /// Ends the frame stream once the bytes the peer announced arrived;
    /// fails the connection if more arrive, or if they do not within
    /// [`END_GRACE`].
    fn check_end(&self, deadline: &mut Option<Instant>) {
        let total = self.shared.end_after.load(Ordering::Acquire);
        if total == NO_END {
            return;
        }
        let pulled = lock(&self.shared.inbox).pulled;
        if pulled == total {
            self.shared.end_stream(Ok(()));
        } else if pulled > total {
            lock(&self.shared.failed)
                .get_or_insert_with(|| format!("the peer sent {pulled} frame bytes after announcing {total}"));
        } else if Instant::now() >= *deadline.get_or_insert_with(|| Instant::now() + END_GRACE) {
            lock(&self.shared.failed).get_or_insert_with(|| {
                format!("the peer announced {total} frame bytes but only {pulled} arrived within {END_GRACE:?}")
            });
        }
    }

    /// A boxed operation of `kind` and the request parameters that name it
    /// (as `user_data`) with `cb` as its completion callback.
    fn new_op(kind: OpKind, cb: *const c_void) -> (Box<Op>, ffi::RequestParam) {
        let mut op = Box::new(Op {
            kind,
            request: std::ptr::null_mut(),
            result: None,
            info: ffi::TagRecvInfo { sender_tag: 0, length: 0 },
        });
        let mut param = ffi::RequestParam::zeroed();
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_CALLBACK | ffi::UCP_OP_ATTR_FIELD_USER_DATA;
        // The box's heap address: stable however the box moves.
        param.user_data = &mut *op as *mut Op as *mut c_void;
        param.cb = cb;
        (op, param)
    }

    /// Starts a frame-stream send or a flush.
    fn start_stream(&mut self, cmd: Cmd) {
        let api = self.raw.api;
        let (kind, ptr, len) = match cmd {
            Cmd::Stream { data } => {
                let (p, l) = (data.as_ptr() as *const c_void, data.len());
                (OpKind::Stream { data }, p, l)
            }
            Cmd::Flush { done } => (OpKind::Flush { done: Some(done) }, std::ptr::null(), 0),
            Cmd::Put { put, done } => return self.start_put(put, done),
            other => return self.start(other),
        };
        let is_flush = matches!(kind, OpKind::Flush { .. });
        let (op, param) = Self::new_op(kind, on_send as ffi::SendCb as *const c_void);
        let r = if is_flush {
            // SAFETY: live endpoint.
            unsafe { (api.ep_flush_nbx)(self.ep, &param) }
        } else {
            // SAFETY: live endpoint; the bytes (the Bytes in op) stay alive
            // and unmoved until the operation completes.
            unsafe { (api.stream_send_nbx)(self.ep, ptr, len, &param) }
        };
        self.track(op, r, len);
    }

    /// The unpacked key of `region` (unpacked from `packed` on first use;
    /// the least recently used key goes beyond [`RKEYS_MAX`]).
    fn rkey(&mut self, region: u64, packed: &[u8]) -> Result<ffi::Rkey, String> {
        let api = self.raw.api;
        if let Some(i) = self.rkeys.iter().position(|(r, _)| *r == region) {
            let k = self.rkeys.remove(i);
            self.rkeys.push(k);
            return Ok(k.1);
        }
        let mut rkey: ffi::Rkey = std::ptr::null_mut();
        // SAFETY: live endpoint; `packed` is a key the peer packed with
        // ucp_rkey_pack (peers are trusted: see the module docs of `ucx`).
        let s = unsafe { (api.ep_rkey_unpack)(self.ep, packed.as_ptr() as *const c_void, &mut rkey) };
        if s != ffi::UCS_OK {
            return Err(format!("ucp_ep_rkey_unpack: {}", ffi::status_str(api, s)));
        }
        self.rkeys.push((region, rkey));
        // The least recently used keys beyond the bound go (not the one just
        // unpacked), once no put is in flight.
        if !self.ops.values().any(|o| matches!(o.kind, OpKind::Put { .. })) {
            while self.rkeys.len() > RKEYS_MAX {
                let (_, old) = self.rkeys.remove(0);
                // SAFETY: a key unpacked here, no put in flight uses any key.
                unsafe { (api.rkey_destroy)(old) };
            }
        }
        Ok(rkey)
    }

    /// Starts a put into granted memory.
    fn start_put(&mut self, put: Put, done: oneshot::Sender<Result<(), String>>) {
        let api = self.raw.api;
        let rkey = match self.rkey(put.region, &put.rkey) {
            Ok(k) => k,
            Err(e) => {
                let _ = done.send(Err(e));
                return;
            }
        };
        let (p, l) = (put.data.as_ptr() as *const c_void, put.data.len());
        let (op, param) =
            Self::new_op(OpKind::Put { data: put.data, done: Some(done) }, on_send as ffi::SendCb as *const c_void);
        // SAFETY: live endpoint and key; the bytes (the Bytes in op) stay
        // alive and unmoved until the operation completes; the range lies
        // inside the grant (checked by the sender against its length).
        let r = unsafe { (api.put_nbx)(self.ep, p, l, put.addr, rkey, &param) };
        self.track(op, r, l);
    }

    /// Destroys the unpacked keys (at teardown, no put in flight).
    fn drop_rkeys(&mut self) {
        for (_, k) in self.rkeys.drain(..) {
            // SAFETY: keys unpacked by this worker, destroyed once.
            unsafe { (self.raw.api.rkey_destroy)(k) };
        }
    }

    /// Keeps an operation until UCX completes it (`r`: what the call
    /// returned; `len`: its length should it have completed at once).
    fn track(&mut self, mut op: Box<Op>, r: *mut c_void, len: usize) {
        if r.is_null() {
            op.result = Some((ffi::UCS_OK, len));
        } else if ffi::ptr_is_err(r) {
            op.result = Some((ffi::ptr_status(r), 0));
        } else {
            op.request = r;
        }
        let id = self.next;
        self.next += 1;
        OUTSTANDING.fetch_add(1, Ordering::Relaxed);
        self.ops.insert(id, op);
    }

    /// Cancels the unmatched receives of `tag`: UCX completes each with
    /// `UCS_ERR_CANCELED` (its buffer is freed when reaped). A receive UCX
    /// has matched already (its data on the way) is left to complete.
    fn cancel_recv(&mut self, tag: u64) {
        let api = self.raw.api;
        // The requests first: a cancel may run the completion callback at
        // once, which writes to its op.
        let requests: Vec<*mut c_void> = self
            .ops
            .values()
            .filter(|op| {
                matches!(op.kind, OpKind::Recv { tag: t, .. } if t == tag)
                    && !op.request.is_null()
                    && op.result.is_none()
            })
            .map(|op| op.request)
            .collect();
        for request in requests {
            // SAFETY: a live request of this worker (its op is freed only by
            // `reap`, on this thread, after completion); a request UCX has
            // matched ignores the cancel.
            unsafe { (api.request_cancel)(self.raw.worker, request) };
        }
    }

    fn start(&mut self, cmd: Cmd) {
        let api = self.raw.api;
        let (kind, ptr, len, is_send, tag) = match cmd {
            Cmd::Send { tag, data, done } => {
                let (p, l) = (data.as_ptr() as *mut c_void, data.len());
                (OpKind::Send { data, done: Some(done) }, p, l, true, tag)
            }
            Cmd::Recv { tag, mut target, done } => {
                let Some((p, l)) = target.region() else {
                    let _ = done.send(Err("the receive's range lies outside its buffer".into()));
                    return;
                };
                (OpKind::Recv { tag, target, done: Some(done) }, p, l, false, tag)
            }
            Cmd::CancelRecv { tag } => return self.cancel_recv(tag),
            other => return self.start_stream(other),
        };
        let cb =
            if is_send { on_send as ffi::SendCb as *const c_void } else { on_recv as ffi::RecvCb as *const c_void };
        let (mut op, mut param) = Self::new_op(kind, cb);
        let r = if is_send {
            // SAFETY: live endpoint; the buffer (the Bytes in op) stays
            // alive and unmoved (boxed) until the operation completes.
            unsafe { (api.tag_send_nbx)(self.ep, ptr, len, tag, &param) }
        } else {
            param.op_attr_mask |= ffi::UCP_OP_ATTR_FIELD_RECV_INFO;
            param.recv_info = &mut op.info as *mut ffi::TagRecvInfo as *mut c_void;
            // SAFETY: live worker; the buffer (the Vec in op, heap memory
            // that does not move with the box) stays alive until completion;
            // a full mask matches exactly this tag.
            unsafe { (api.tag_recv_nbx)(self.raw.worker, ptr, len, tag, u64::MAX, &param) }
        };
        // Completed at once, the callback is not called; a receive's length
        // is then in the recv_info UCX filled.
        let len = if is_send { len } else { op.info.length };
        self.track(op, r, len);
    }

    /// Hands completed operations back and frees their requests.
    fn reap(&mut self) {
        let api = self.raw.api;
        let done: Vec<u64> = self.ops.iter().filter(|(_, o)| o.result.is_some()).map(|(id, _)| *id).collect();
        for id in done {
            let Some(mut op) = self.ops.remove(&id) else { continue };
            OUTSTANDING.fetch_sub(1, Ordering::Relaxed);
            if !op.request.is_null() {
                // SAFETY: the request completed (its callback ran) and is
                // freed exactly once, here.
                unsafe { (api.request_free)(op.request) };
                op.request = std::ptr::null_mut();
            }
            let (status, len) = op.result.unwrap_or((ffi::UCS_OK, 0));
            let err = (status != ffi::UCS_OK).then(|| self.describe(status));
            match op.kind {
                OpKind::Send { ref mut done, ref data } => {
                    if err.is_none() {
                        BYTES_SENT.fetch_add(data.len() as u64, Ordering::Relaxed);
                    }
                    if let Some(d) = done.take() {
                        let _ = d.send(err.map_or(Ok(()), Err));
                    }
                }
                OpKind::Recv { ref mut target, ref mut done, .. } => {
                    if let Some(d) = done.take() {
                        let r = match err {
                            Some(e) => Err(e),
                            None => {
                                BYTES_RECEIVED.fetch_add(len as u64, Ordering::Relaxed);
                                Ok(target.landed(len))
                            }
                        };
                        let _ = d.send(r);
                    }
                }
                OpKind::Stream { ref data } => {
                    match err {
                        // A lost frame breaks the connection.
                        Some(e) => drop(
                            lock(&self.shared.failed).get_or_insert_with(|| format!("UCX stream send failed: {e}")),
                        ),
                        None => drop(FRAME_BYTES_SENT.fetch_add(data.len() as u64, Ordering::Relaxed)),
                    }
                    let w = {
                        let mut out = lock(&self.shared.outbox);
                        out.pending -= data.len();
                        out.waker.take()
                    };
                    if let Some(w) = w {
                        w.wake();
                    }
                }
                OpKind::Flush { ref mut done } => {
                    if let Some(d) = done.take() {
                        let _ = d.send(err.map_or(Ok(()), Err));
                    }
                }
                OpKind::Put { ref mut done, ref data } => {
                    if err.is_none() {
                        BYTES_SENT.fetch_add(data.len() as u64, Ordering::Relaxed);
                        BYTES_PUT.fetch_add(data.len() as u64, Ordering::Relaxed);
                    }
                    if let Some(d) = done.take() {
                        let _ = d.send(err.map_or(Ok(()), Err));
                    }
                }
            }
        }
    }

    fn describe(&self, status: ffi::Status) -> String {
        match lock(&self.shared.failed).as_ref() {
            Some(why) => why.clone(),
            None => ffi::status_str(self.raw.api, status),
        }
    }

    /// Cancels what is outstanding, closes the endpoint, destroys the worker.
    fn teardown(mut self) {
        let api = self.raw.api;
        let why = lock(&self.shared.failed).get_or_insert_with(|| "connection closed".into()).clone();
        self.shared.end_stream(Err(why));
        // Commands that arrived after the stop: fail them.
        drop(lock(&self.shared.queue).take());
        // Receives not matched yet can be cancelled; sends and matched
        // receives are completed with an error by the forced close.
        for op in self.ops.values() {
            if !op.request.is_null() && op.result.is_none() && matches!(op.kind, OpKind::Recv { .. }) {
                // SAFETY: a live request of this worker.
                unsafe { (api.request_cancel)(self.raw.worker, op.request) };
            }
        }
        // Keys go before their endpoint (none is used by an operation: puts
        // into shared memory complete when issued; otherwise after the close).
        if !self.ops.values().any(|o| matches!(o.kind, OpKind::Put { .. })) {
            self.drop_rkeys();
        }
        // Close the endpoint without flushing (the peer may be gone).
        let mut param = ffi::RequestParam::zeroed();
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = ffi::UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: live endpoint, closed once.
        let mut close = unsafe { (api.ep_close_nbx)(self.ep, &param) };
        if close.is_null() || ffi::ptr_is_err(close) {
            close = std::ptr::null_mut();
        }
        let deadline = Instant::now() + TEARDOWN;
        loop {
            // SAFETY: live worker and (when non-null) close request.
            let closing = !close.is_null() && unsafe { (api.request_check_status)(close) } == ffi::UCS_INPROGRESS;
            if !closing && !close.is_null() {
                // SAFETY: the close request completed; freed once.
                unsafe { (api.request_free)(close) };
                close = std::ptr::null_mut();
            }
            self.reap();
            if (!closing && self.ops.is_empty()) || Instant::now() >= deadline {
                break;
            }
            // SAFETY: live worker, its own thread.
            unsafe { (api.worker_progress)(self.raw.worker) };
        }
        // Operations UCX did not complete within the deadline: fail their
        // callers now.
        let mut stuck: Vec<Box<Op>> = self.ops.drain().map(|(_, op)| op).collect();
        for op in &mut stuck {
            let why = "UCX operation abandoned: the connection closed".to_string();
            match &mut op.kind {
                OpKind::Send { done, .. } | OpKind::Put { done, .. } | OpKind::Flush { done } => {
                    drop(done.take().map(|d| d.send(Err(why))))
                }
                OpKind::Recv { done, .. } => drop(done.take().map(|d| d.send(Err(why)))),
                OpKind::Stream { .. } => {}
            }
            OUTSTANDING.fetch_sub(1, Ordering::Relaxed);
        }
        self.drop_rkeys();
        // SAFETY: the endpoint is closed (or abandoned with its requests,
        // which the worker's destruction releases); no callback and no
        // transfer driven by this worker runs after this.
        unsafe { (api.worker_destroy)(self.raw.worker) };
        if !stuck.is_empty() {
            if self.raw.peer_failure {
                // With peer failure mode UCX completes every operation of a
                // force-closed endpoint; one it did not may have a transfer
                // UCX does not drive from this worker (an RDMA NIC, a peer's
                // cma read): leak its buffer rather than free memory in use.
                tracing::warn!(ops = stuck.len(), "UCX operations did not complete at teardown; leaking their buffers");
                for op in stuck {
                    ABANDONED.fetch_add(1, Ordering::Relaxed);
                    Box::leak(op);
                }
            } else {
                // Without it the context has no single-copy transport (see
                // ffi::context): every byte into or out of these buffers
                // was copied by this worker's progress, which is over.
                drop(stuck);
            }
        }
        WORKERS.fetch_sub(1, Ordering::AcqRel);
    }
}
