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

use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::ffi::{self, Api, Ep, Worker};
use crate::sync::lock;

/// Spins of `ucp_worker_progress` without progress before sleeping.
const SPIN: u32 = 64;
/// How long teardown waits for cancelled operations to complete.
const TEARDOWN: Duration = Duration::from_secs(2);

static OUTSTANDING: AtomicU64 = AtomicU64::new(0);
static BYTES_SENT: AtomicU64 = AtomicU64::new(0);
static BYTES_RECEIVED: AtomicU64 = AtomicU64::new(0);
static WORKERS: AtomicU64 = AtomicU64::new(0);
static ABANDONED: AtomicU64 = AtomicU64::new(0);

/// Process-wide counters of the UCX transport.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UcxStats {
    /// Operations handed to UCX and not completed yet: each holds a
    /// payload buffer (and UCX's registration of it).
    pub operations_outstanding: u64,
    /// Payload bytes UCX delivered to peers.
    pub bytes_sent: u64,
    /// Payload bytes received through UCX.
    pub bytes_received: u64,
    /// UCP workers alive (one per connection).
    pub workers: u64,
    /// Operations UCX had not completed when their connection was torn
    /// down: failed, their buffers deliberately leaked.
    pub operations_abandoned: u64,
}

/// The counters now.
pub fn stats() -> UcxStats {
    UcxStats {
        operations_outstanding: OUTSTANDING.load(Ordering::Relaxed),
        bytes_sent: BYTES_SENT.load(Ordering::Relaxed),
        bytes_received: BYTES_RECEIVED.load(Ordering::Relaxed),
        workers: WORKERS.load(Ordering::Relaxed),
        operations_abandoned: ABANDONED.load(Ordering::Relaxed),
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
    Send { tag: u64, data: Bytes, done: oneshot::Sender<Result<(), String>> },
    Recv { tag: u64, target: RecvTarget, done: oneshot::Sender<RecvResult> },
}

/// The handle tokio tasks hold.
pub(crate) struct WorkerHandle {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// This worker's address, for the peer's `ucp_ep_create`.
    pub(crate) address: Vec<u8>,
}

struct Shared {
    queue: Mutex<Vec<Cmd>>,
    wake: OwnedFd,
    stop: AtomicBool,
    /// Set by the endpoint's error handler or at teardown: why ops fail.
    failed: Mutex<Option<String>>,
}

impl Shared {
    fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), &one as *const u64 as *const c_void, 8) };
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
        let ffi::Ctx { api, ctx, peer_failure, .. } = ffi::context_for(same_host)?;
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
            queue: Mutex::new(Vec::new()),
            // SAFETY: fd is a fresh descriptor we own.
            wake: unsafe { OwnedFd::from_raw_fd(fd) },
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        });
        let handle = WorkerHandle { shared: shared.clone(), thread: Mutex::new(None), address };
        Ok((handle, PendingWorker { raw: Some(raw), shared, peer: peer.to_string() }))
    }

    /// Connects to the peer worker at `peer_address` and starts progress.
    pub(crate) fn connect(&self, mut pending: PendingWorker, peer_address: &[u8]) -> Result<(), String> {
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
        let t = std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || Progress { raw, ep: ep.get(), shared, ops: HashMap::new(), next: 1 }.run())
            .map_err(|e| format!("cannot start the UCX progress thread: {e}"))?;
        *lock(&self.thread) = Some(t);
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

    fn submit(&self, cmd: Cmd) {
        // A stopped worker drops the command, whose oneshot then reports
        // the connection gone.
        if self.shared.stop.load(Ordering::Acquire) {
            return;
        }
        lock(&self.shared.queue).push(cmd);
        self.shared.ring();
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
        if let Some(t) = lock(&self.thread).take() {
            // The thread only waits on UCX for at most TEARDOWN.
            let _ = t.join();
        }
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
    Recv { target: RecvTarget, done: Option<oneshot::Sender<RecvResult>> },
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
    shared: Arc<Shared>,
    ops: HashMap<u64, Box<Op>>,
    next: u64,
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
        WORKERS.fetch_add(1, Ordering::Relaxed);
        let api = self.raw.api;
        let mut efd: libc::c_int = -1;
        // SAFETY: live worker (created with UCP_FEATURE_WAKEUP).
        let s = unsafe { (api.worker_get_efd)(self.raw.worker, &mut efd) };
        if s != ffi::UCS_OK {
            lock(&self.shared.failed).get_or_insert_with(|| format!("ucp_worker_get_efd: {}", ffi::status_str(api, s)));
            self.shared.stop.store(true, Ordering::Release);
        }
        let mut idle = 0u32;
        while !self.shared.stop.load(Ordering::Acquire) {
            let cmds = std::mem::take(&mut *lock(&self.shared.queue));
            let had_cmds = !cmds.is_empty();
            for c in cmds {
                self.start(c);
            }
            // SAFETY: live worker, on its own thread.
            let n = unsafe { (api.worker_progress)(self.raw.worker) };
            self.reap();
            if lock(&self.shared.failed).is_some() {
                break;
            }
            if n > 0 || had_cmds {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < SPIN {
                std::hint::spin_loop();
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

    fn start(&mut self, cmd: Cmd) {
        let api = self.raw.api;
        let id = self.next;
        self.next += 1;
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
                (OpKind::Recv { target, done: Some(done) }, p, l, false, tag)
            }
        };
        let mut op = Box::new(Op {
            kind,
            request: std::ptr::null_mut(),
            result: None,
            info: ffi::TagRecvInfo { sender_tag: 0, length: 0 },
        });
        let mut param = ffi::RequestParam::zeroed();
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_CALLBACK | ffi::UCP_OP_ATTR_FIELD_USER_DATA;
        param.user_data = &mut *op as *mut Op as *mut c_void;
        let r = if is_send {
            param.cb = on_send as ffi::SendCb as *const c_void;
            // SAFETY: live endpoint; the buffer (the Bytes in op) stays
            // alive and unmoved (boxed) until the operation completes.
            unsafe { (api.tag_send_nbx)(self.ep, ptr, len, tag, &param) }
        } else {
            param.cb = on_recv as ffi::RecvCb as *const c_void;
            param.op_attr_mask |= ffi::UCP_OP_ATTR_FIELD_RECV_INFO;
            param.recv_info = &mut op.info as *mut ffi::TagRecvInfo as *mut c_void;
            // SAFETY: live worker; the buffer (the Vec in op, heap memory
            // that does not move with the box) stays alive until completion;
            // a full mask matches exactly this tag.
            unsafe { (api.tag_recv_nbx)(self.raw.worker, ptr, len, tag, u64::MAX, &param) }
        };
        if r.is_null() {
            // Completed at once; the callback is not called. A receive's
            // length is in the recv_info UCX filled.
            op.result = Some((ffi::UCS_OK, if is_send { len } else { op.info.length }));
        } else if ffi::ptr_is_err(r) {
            op.result = Some((ffi::ptr_status(r), 0));
        } else {
            op.request = r;
        }
        OUTSTANDING.fetch_add(1, Ordering::Relaxed);
        self.ops.insert(id, op);
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
                OpKind::Recv { ref mut target, ref mut done } => {
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
        lock(&self.shared.failed).get_or_insert_with(|| "connection closed".into());
        // Commands that arrived after the stop: fail them.
        drop(std::mem::take(&mut *lock(&self.shared.queue)));
        // Receives not matched yet can be cancelled; sends and matched
        // receives are completed with an error by the forced close.
        for op in self.ops.values() {
            if !op.request.is_null() && op.result.is_none() && matches!(op.kind, OpKind::Recv { .. }) {
                // SAFETY: a live request of this worker.
                unsafe { (api.request_cancel)(self.raw.worker, op.request) };
            }
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
                OpKind::Send { done, .. } => drop(done.take().map(|d| d.send(Err(why)))),
                OpKind::Recv { done, .. } => drop(done.take().map(|d| d.send(Err(why)))),
            }
            OUTSTANDING.fetch_sub(1, Ordering::Relaxed);
        }
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
        WORKERS.fetch_sub(1, Ordering::Relaxed);
    }
}
