//! The few UCP calls this transport makes, declared by hand and resolved
//! with `dlopen` at first use (see the module docs of [`super`] for why).
//!
//! Layouts follow UCX 1.13's `ucp/api/ucp.h` and `ucp_def.h`; only fields
//! named in a `field_mask` are read by UCX, and every parameter struct is
//! zero-initialised, so the trailing fields this file does not name are
//! padding of at least the size UCX declares.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

/// `ucs_status_t`: a packed (one-byte) enum in UCX.
pub(crate) type Status = i8;
pub(crate) const UCS_OK: Status = 0;
pub(crate) const UCS_INPROGRESS: Status = 1;
pub(crate) const UCS_ERR_BUSY: Status = -15;
/// `UCS_ERR_LAST`: status pointers at or above `(uintptr_t)-100` are errors.
const UCS_ERR_LAST: isize = -100;

pub(crate) type Context = *mut c_void;
pub(crate) type Worker = *mut c_void;
pub(crate) type Ep = *mut c_void;
pub(crate) type Address = c_void;
/// `ucp_mem_h`.
pub(crate) type MemH = *mut c_void;
/// `ucp_rkey_h`.
pub(crate) type Rkey = *mut c_void;

pub(crate) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_FLAGS: u64 = 1 << 2;
pub(crate) const UCP_MEM_MAP_ALLOCATE: c_uint = 1 << 1;
pub(crate) const UCP_MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;

/// `ucp_mem_map_params_t`.
#[repr(C)]
pub(crate) struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub _rest: [u8; 64],
}

/// `ucp_mem_attr_t`.
#[repr(C)]
pub(crate) struct MemAttr {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub _rest: [u8; 32],
}

pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub(crate) const UCP_FEATURE_TAG: u64 = 1 << 0;
pub(crate) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub(crate) const UCP_FEATURE_STREAM: u64 = 1 << 5;

pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub(crate) const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub(crate) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

pub(crate) const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub(crate) const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub(crate) const UCP_OP_ATTR_FIELD_RECV_INFO: u32 = 1 << 7;

/// `ucp_params_t`.
#[repr(C)]
pub(crate) struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *mut c_void,
    pub request_cleanup: *mut c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub _rest: [u8; 64],
}

/// `ucp_worker_params_t` (all defaults: field_mask 0).
#[repr(C)]
pub(crate) struct WorkerParams {
    pub field_mask: u64,
    pub _rest: [u8; 512],
}

/// `ucp_err_handler_cb_t`.
pub(crate) type ErrHandlerCb = unsafe extern "C" fn(arg: *mut c_void, ep: Ep, status: Status);

/// `ucp_ep_params_t`.
#[repr(C)]
pub(crate) struct EpParams {
    pub field_mask: u64,
    pub address: *const Address,
    pub err_mode: c_int,
    pub err_cb: Option<ErrHandlerCb>,
    pub err_arg: *mut c_void,
    pub _rest: [u8; 128],
}

/// `ucp_tag_recv_info_t`.
#[repr(C)]
pub(crate) struct TagRecvInfo {
    pub sender_tag: u64,
    pub length: usize,
}

/// `ucp_send_nbx_callback_t`.
pub(crate) type SendCb = unsafe extern "C" fn(request: *mut c_void, status: Status, user_data: *mut c_void);
/// `ucp_tag_recv_nbx_callback_t`.
pub(crate) type RecvCb =
    unsafe extern "C" fn(request: *mut c_void, status: Status, info: *const TagRecvInfo, user_data: *mut c_void);

/// `ucp_request_param_t`; `cb` is a union of callback pointers.
#[repr(C)]
pub(crate) struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *const c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: u32,
    pub recv_info: *mut c_void,
    pub memh: *mut c_void,
    pub _rest: [u8; 32],
}

impl RequestParam {
    pub(crate) fn zeroed() -> Self {
        // SAFETY: every field is an integer, a raw pointer or a byte array,
        // for all of which zero is a valid value (null pointers, "not set").
        unsafe { std::mem::zeroed() }
    }
}

/// True when `p` (a `ucs_status_ptr_t`) is an error code.
pub(crate) fn ptr_is_err(p: *mut c_void) -> bool {
    (p as usize) >= (UCS_ERR_LAST as usize)
}

/// The status an error pointer carries.
pub(crate) fn ptr_status(p: *mut c_void) -> Status {
    p as isize as Status
}

/// Function pointers into libucp/libucs, resolved once.
pub(crate) struct Api {
    pub init_version: unsafe extern "C" fn(c_uint, c_uint, *const Params, *const c_void, *mut Context) -> Status,
    pub worker_create: unsafe extern "C" fn(Context, *const WorkerParams, *mut Worker) -> Status,
    pub worker_destroy: unsafe extern "C" fn(Worker),
    pub worker_get_address: unsafe extern "C" fn(Worker, *mut *mut Address, *mut usize) -> Status,
    pub worker_release_address: unsafe extern "C" fn(Worker, *mut Address),
    pub worker_progress: unsafe extern "C" fn(Worker) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(Worker, *mut c_int) -> Status,
    pub worker_arm: unsafe extern "C" fn(Worker) -> Status,
    pub ep_create: unsafe extern "C" fn(Worker, *const EpParams, *mut Ep) -> Status,
    pub ep_close_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> *mut c_void,
    pub tag_send_nbx: unsafe extern "C" fn(Ep, *const c_void, usize, u64, *const RequestParam) -> *mut c_void,
    pub tag_recv_nbx: unsafe extern "C" fn(Worker, *mut c_void, usize, u64, u64, *const RequestParam) -> *mut c_void,
    pub stream_send_nbx: unsafe extern "C" fn(Ep, *const c_void, usize, *const RequestParam) -> *mut c_void,
    pub stream_recv_data_nb: unsafe extern "C" fn(Ep, *mut usize) -> *mut c_void,
    pub stream_data_release: unsafe extern "C" fn(Ep, *mut c_void),
    pub ep_flush_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> *mut c_void,
    pub mem_map: unsafe extern "C" fn(Context, *const MemMapParams, *mut MemH) -> Status,
    pub mem_unmap: unsafe extern "C" fn(Context, MemH) -> Status,
    pub mem_query: unsafe extern "C" fn(MemH, *mut MemAttr) -> Status,
    pub rkey_pack: unsafe extern "C" fn(Context, MemH, *mut *mut c_void, *mut usize) -> Status,
    pub rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ep_rkey_unpack: unsafe extern "C" fn(Ep, *const c_void, *mut Rkey) -> Status,
    pub rkey_destroy: unsafe extern "C" fn(Rkey),
    pub put_nbx: unsafe extern "C" fn(Ep, *const c_void, usize, u64, Rkey, *const RequestParam) -> *mut c_void,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    pub request_cancel: unsafe extern "C" fn(Worker, *mut c_void),
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub get_version_string: unsafe extern "C" fn() -> *const c_char,
    pub cleanup: unsafe extern "C" fn(Context),
    pub config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut c_void) -> Status,
    pub config_modify: unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> Status,
    pub config_release: unsafe extern "C" fn(*mut c_void),
    pub context_query: unsafe extern "C" fn(Context, *mut ContextAttr) -> Status,
    /// `&ucs_global_opts.log_component.log_level` (the first field of
    /// `ucs_global_opts_t`, `ucs/config/global_opts.h`): UCX's own log
    /// level, lowered around the peer-failure probe; None if not exported.
    pub log_level: Option<LogLevel>,
}

/// The address of UCX's global log level.
pub(crate) struct LogLevel(*mut c_int);

/// `UCS_LOG_LEVEL_FATAL`.
const UCS_LOG_LEVEL_FATAL: c_int = 0;

/// While alive, UCX logs only fatal errors (restored on drop).
struct QuietUcxLog<'a> {
    level: &'a LogLevel,
    old: c_int,
}

impl<'a> QuietUcxLog<'a> {
    fn new(api: &'a Api) -> Option<Self> {
        let level = api.log_level.as_ref()?;
        // SAFETY: the address of a live C int in libucs (never unloaded);
        // volatile because UCX threads read it.
        let old = unsafe { std::ptr::read_volatile(level.0) };
        // SAFETY: as above; any ucs_log_level_t value is valid there.
        unsafe { std::ptr::write_volatile(level.0, UCS_LOG_LEVEL_FATAL.min(old)) };
        Some(Self { level, old })
    }
}

impl Drop for QuietUcxLog<'_> {
    fn drop(&mut self) {
        // SAFETY: as in new.
        unsafe { std::ptr::write_volatile(self.level.0, self.old) };
    }
}

/// `ucp_context_attr_t` (UCX 1.13), with room to spare.
#[repr(C)]
pub(crate) struct ContextAttr {
    pub field_mask: u64,
    pub request_size: usize,
    pub thread_mode: c_int,
    pub memory_types: u64,
    pub _rest: [u8; 256],
}

/// `UCP_ATTR_FIELD_MEMORY_TYPES`.
const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
/// `ucs_memory_type_t`, in order from `UCS_MEMORY_TYPE_HOST`.
const MEMORY_TYPES: [&str; 5] = ["host", "cuda", "cuda-managed", "rocm", "rocm-managed"];

// SAFETY: the table holds plain function pointers into a library that is
// never unloaded; calling them from any thread is UCX's business (the
// callers keep each worker on one thread).
unsafe impl Send for Api {}
// SAFETY: as above; the table is immutable after loading.
unsafe impl Sync for Api {}

/// The UCP API version this file follows (`UCP_API_MAJOR`/`MINOR` of 1.13).
pub(crate) const API_MAJOR: c_uint = 1;
pub(crate) const API_MINOR: c_uint = 13;

fn open(names: &[String]) -> Result<*mut c_void, String> {
    let mut tried = Vec::new();
    for name in names {
        let Ok(c) = std::ffi::CString::new(name.as_str()) else { continue };
        // SAFETY: dlopen with a NUL-terminated name; the handle is kept for
        // the life of the process (never dlclosed), so the resolved function
        // pointers stay valid.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !h.is_null() {
            return Ok(h);
        }
        tried.push(name.clone());
    }
    Err(format!(
        "cannot load {} (tried {}): install UCX with `apt-get install libucx0` (Debian/Ubuntu) or put libucp on LD_LIBRARY_PATH",
        names.last().map(String::as_str).unwrap_or("libucp"),
        tried.join(", ")
    ))
}

/// Where to look for `lib`: the directory in `TENSORWIRE_UCX_LIBDIR` at run
/// time (alone, when set), else the one pkg-config named at build time,
/// then the loader's search path.
fn candidates(lib: &str) -> Vec<String> {
    if let Ok(dir) = std::env::var("TENSORWIRE_UCX_LIBDIR") {
        return vec![format!("{dir}/{lib}")];
    }
    let dir = env!("TENSORWIRE_UCX_LIBDIR");
    let mut v = Vec::new();
    if !dir.is_empty() {
        v.push(format!("{dir}/{lib}"));
    }
    v.push(lib.to_string());
    v
}

// Each transmute's target is the type of the Api field it initialises,
// spelled once in the struct above.
#[allow(clippy::missing_transmute_annotations)]
fn load() -> Result<Api, String> {
    let ucs = open(&candidates("libucs.so.0"))?;
    let ucp = open(&candidates("libucp.so.0"))?;
    macro_rules! sym {
        ($h:expr, $name:literal) => {{
            // SAFETY: dlsym on a live handle with a NUL-terminated name.
            let p = unsafe { libc::dlsym($h, concat!($name, "\0").as_ptr() as *const c_char) };
            if p.is_null() {
                return Err(format!("libucx lacks {} (UCX >= 1.13 is needed)", $name));
            }
            // SAFETY: the symbol is the UCP function of that name, whose C
            // signature the field's type transcribes from ucp.h.
            unsafe { std::mem::transmute::<*mut c_void, _>(p) }
        }};
    }
    Ok(Api {
        init_version: sym!(ucp, "ucp_init_version"),
        worker_create: sym!(ucp, "ucp_worker_create"),
        worker_destroy: sym!(ucp, "ucp_worker_destroy"),
        worker_get_address: sym!(ucp, "ucp_worker_get_address"),
        worker_release_address: sym!(ucp, "ucp_worker_release_address"),
        worker_progress: sym!(ucp, "ucp_worker_progress"),
        worker_get_efd: sym!(ucp, "ucp_worker_get_efd"),
        worker_arm: sym!(ucp, "ucp_worker_arm"),
        ep_create: sym!(ucp, "ucp_ep_create"),
        ep_close_nbx: sym!(ucp, "ucp_ep_close_nbx"),
        tag_send_nbx: sym!(ucp, "ucp_tag_send_nbx"),
        tag_recv_nbx: sym!(ucp, "ucp_tag_recv_nbx"),
        stream_send_nbx: sym!(ucp, "ucp_stream_send_nbx"),
        stream_recv_data_nb: sym!(ucp, "ucp_stream_recv_data_nb"),
        stream_data_release: sym!(ucp, "ucp_stream_data_release"),
        ep_flush_nbx: sym!(ucp, "ucp_ep_flush_nbx"),
        mem_map: sym!(ucp, "ucp_mem_map"),
        mem_unmap: sym!(ucp, "ucp_mem_unmap"),
        mem_query: sym!(ucp, "ucp_mem_query"),
        rkey_pack: sym!(ucp, "ucp_rkey_pack"),
        rkey_buffer_release: sym!(ucp, "ucp_rkey_buffer_release"),
        ep_rkey_unpack: sym!(ucp, "ucp_ep_rkey_unpack"),
        rkey_destroy: sym!(ucp, "ucp_rkey_destroy"),
        put_nbx: sym!(ucp, "ucp_put_nbx"),
        request_check_status: sym!(ucp, "ucp_request_check_status"),
        request_cancel: sym!(ucp, "ucp_request_cancel"),
        request_free: sym!(ucp, "ucp_request_free"),
        status_string: sym!(ucs, "ucs_status_string"),
        get_version_string: sym!(ucp, "ucp_get_version_string"),
        cleanup: sym!(ucp, "ucp_cleanup"),
        config_read: sym!(ucp, "ucp_config_read"),
        config_modify: sym!(ucp, "ucp_config_modify"),
        config_release: sym!(ucp, "ucp_config_release"),
        context_query: sym!(ucp, "ucp_context_query"),
        log_level: {
            // SAFETY: dlsym on a live handle with a NUL-terminated name; the
            // symbol, when present, is the global whose first field is the level.
            let p = unsafe { libc::dlsym(ucs, c"ucs_global_opts".as_ptr()) };
            (!p.is_null()).then_some(LogLevel(p as *mut c_int))
        },
    })
}

/// The loaded API, or why UCX cannot be used in this process.
pub(crate) fn api() -> Result<&'static Api, String> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// UCX's name for a status.
pub(crate) fn status_str(api: &Api, s: Status) -> String {
    // SAFETY: ucs_status_string returns a static NUL-terminated string for
    // any value (an "unknown" one for codes it does not know).
    let p = unsafe { (api.status_string)(s) };
    if p.is_null() {
        return format!("UCX status {s}");
    }
    // SAFETY: non-null, static, NUL-terminated (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The process's UCP context and what it can do.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub api: &'static Api,
    pub ctx: Context,
    /// Endpoints can use peer failure mode (a dead peer fails operations).
    pub peer_failure: bool,
    /// The `UCX_TLS` the context was created with (after leaving out the
    /// single-copy transports where peer failure mode is refused).
    pub tls: String,
    /// Large payloads may be put into receiver-granted memory (see
    /// `rendezvous`): the context has only shared-memory transports, where
    /// a put is a copy into a mapped segment (`UCP_FEATURE_RMA` is on).
    pub puts: bool,
}
// SAFETY: a UCP context created with mt_workers_shared may be used by
// workers on different threads; the pointer itself is just an address.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

/// True when `tls` names shared-memory transports only (and `self`): a put
/// is then a copy into a segment this process maps, done when the call
/// returns. Over `tcp` UCX emulates puts in software (~30 MB/s here); over
/// RDMA NICs they would be native, but that is unmeasured, so they keep the
/// tagged rendezvous.
fn shared_memory_only(tls: &str) -> bool {
    let mut names = tls.split(',').map(str::trim).filter(|t| !t.is_empty()).peekable();
    names.peek().is_some() && names.all(|t| matches!(t, "sysv" | "posix" | "self"))
}

fn init(api: &'static Api, tls: Option<&str>) -> Result<Context, String> {
    let mut params: Params = {
        // SAFETY: integers, null pointers and bytes: all-zero is valid.
        unsafe { std::mem::zeroed() }
    };
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP;
    if tls.is_some_and(shared_memory_only) {
        params.features |= UCP_FEATURE_RMA;
    }
    params.mt_workers_shared = 1;
    let mut config: *mut c_void = std::ptr::null_mut();
    // SAFETY: null prefix and file: UCX reads UCX_* from the environment.
    let s = unsafe { (api.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
    if s != UCS_OK {
        return Err(format!("ucp_config_read: {}", status_str(api, s)));
    }
    if let Some(tls) = tls {
        let v = std::ffi::CString::new(tls).map_err(|e| e.to_string())?;
        // SAFETY: a live config and NUL-terminated strings.
        let s = unsafe { (api.config_modify)(config, c"TLS".as_ptr(), v.as_ptr()) };
        if s != UCS_OK {
            // SAFETY: releasing the config read above.
            unsafe { (api.config_release)(config) };
            return Err(format!("UCX_TLS={tls}: {}", status_str(api, s)));
        }
    }
    if params.features & UCP_FEATURE_RMA != 0 {
        // Put regions (`grant::Region`) come from shared-memory segments or
        // fresh mappings, all zero pages: never from the heap, whose memory
        // would not be initialised.
        // SAFETY: a live config and NUL-terminated strings.
        let s =
            unsafe { (api.config_modify)(config, c"ALLOC_PRIO".as_ptr(), c"md:sysv,md:posix,huge,thp,mmap".as_ptr()) };
        if s != UCS_OK {
            // SAFETY: releasing the config read above.
            unsafe { (api.config_release)(config) };
            return Err(format!("UCX_ALLOC_PRIO: {}", status_str(api, s)));
        }
    }
    let mut ctx: Context = std::ptr::null_mut();
    // SAFETY: valid params, config and out-pointer.
    let s = unsafe { (api.init_version)(API_MAJOR, API_MINOR, &params, config, &mut ctx) };
    // SAFETY: UCX copied what it needs from the config.
    unsafe { (api.config_release)(config) };
    if s != UCS_OK {
        return Err(format!("ucp_init failed: {}", status_str(api, s)));
    }
    Ok(ctx)
}

/// True when an endpoint between two workers of `ctx` can use peer failure
/// mode: UCX 1.13's shared-memory transports (sysv, posix) cannot, so with
/// `UCX_TLS=sm,self` it is refused.
fn probe_peer_failure(api: &'static Api, ctx: Context) -> bool {
    let params = WorkerParams { field_mask: 0, _rest: [0; 512] };
    let (mut a, mut b): (Worker, Worker) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: live context, valid params and out-pointers.
    if unsafe { (api.worker_create)(ctx, &params, &mut a) } != UCS_OK {
        return false;
    }
    // SAFETY: as above.
    if unsafe { (api.worker_create)(ctx, &params, &mut b) } != UCS_OK {
        // SAFETY: a was created above and is unused.
        unsafe { (api.worker_destroy)(a) };
        return false;
    }
    let mut ok = false;
    let mut addr: *mut Address = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: live worker, valid out-pointers.
    if unsafe { (api.worker_get_address)(b, &mut addr, &mut len) } == UCS_OK {
        let ep_params = EpParams {
            field_mask: UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            address: addr,
            err_mode: UCP_ERR_HANDLING_MODE_PEER,
            err_cb: None,
            err_arg: std::ptr::null_mut(),
            _rest: [0; 128],
        };
        let mut ep: Ep = std::ptr::null_mut();
        // A refusal is the answer here, not an error: UCX would print it as
        // one ("no active messages transport ... no peer failure handler")
        // in the middle of the caller's output.
        let quiet = QuietUcxLog::new(api);
        // SAFETY: live worker and an address of a live worker.
        let created = unsafe { (api.ep_create)(a, &ep_params, &mut ep) } == UCS_OK;
        drop(quiet);
        if created {
            ok = true;
            let mut p = RequestParam::zeroed();
            p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_EP_CLOSE_FLAG_FORCE;
            // SAFETY: the endpoint just created, closed once.
            let r = unsafe { (api.ep_close_nbx)(ep, &p) };
            if !r.is_null() && !ptr_is_err(r) {
                // SAFETY (loop): live workers and request.
                while unsafe { (api.request_check_status)(r) } == UCS_INPROGRESS {
                    unsafe { (api.worker_progress)(a) };
                    unsafe { (api.worker_progress)(b) };
                }
                // SAFETY: completed request, freed once.
                unsafe { (api.request_free)(r) };
            }
        }
        // SAFETY: the address came from worker b.
        unsafe { (api.worker_release_address)(b, addr) };
    }
    // SAFETY: no endpoints or operations remain on either worker.
    unsafe {
        (api.worker_destroy)(a);
        (api.worker_destroy)(b);
    }
    ok
}

/// `UCX_TLS` without the single-copy transports (cma, knem, xpmem), `sm`
/// spelled out as the transports that stay.
fn without_single_copy(tls: &str) -> String {
    let single_copy = ["cma", "knem", "xpmem"];
    if let Some(neg) = tls.strip_prefix('^') {
        return format!("^{},cma,knem,xpmem", neg);
    }
    let mut out: Vec<&str> = Vec::new();
    for t in tls.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        match t {
            "sm" | "shm" => out.extend(["sysv", "posix"]),
            "all" => return "^cma,knem,xpmem".into(),
            t if single_copy.contains(&t) => {}
            t => out.push(t),
        }
    }
    out.join(",")
}

/// The UCP context of this process for peers on other hosts (and for every
/// peer when `UCX_TLS` names transports), created at first use with UCX's
/// configuration from the environment (`UCX_TLS`, `UCX_NET_DEVICES`, ...).
/// Shared by every such connection's worker (`mt_workers_shared`); never
/// freed.
///
/// Where the configured transports cannot detect a dead peer (UCX 1.13's
/// sysv/posix), the single-copy transports are left out: UCX aborts the
/// process when a `cma` copy from a dead process fails on an endpoint
/// without peer failure mode, while copies through shared-memory segments
/// cannot fail that way. The TCP control socket detects the dead peer.
pub(crate) fn context() -> Result<Ctx, String> {
    static CTX: OnceLock<Result<Ctx, String>> = OnceLock::new();
    let api = api()?;
    CTX.get_or_init(|| make_context(api, &configured_tls())).clone()
}

/// `UCX_TLS` from the environment; `all` (UCX's default) when unset.
fn configured_tls() -> String {
    std::env::var("UCX_TLS").unwrap_or_else(|_| "all".into())
}

/// The context for a peer on this host (same boot, PID, IPC and mount
/// namespaces: see [`same_host_token`]). With `UCX_TLS` unset (or `all`) it
/// is limited to `sm,self`: with every transport, UCX 1.13 puts a same-host
/// rendezvous on its `tcp` lanes once `cma` is left out (3.4–4.0 GiB/s
/// against 10–16 through shared memory, measured here). A `UCX_TLS` that
/// names transports is used as it is, for every peer.
pub(crate) fn context_for(same_host: bool) -> Result<Ctx, String> {
    if !same_host || configured_tls().trim() != "all" {
        return context();
    }
    static LOCAL: OnceLock<Result<Ctx, String>> = OnceLock::new();
    let api = api()?;
    LOCAL.get_or_init(|| make_context(api, "sm,self")).clone()
}

/// A context on transports `tls`, reduced as [`context`] describes.
fn make_context(api: &'static Api, tls: &str) -> Result<Ctx, String> {
    let ctx = init(api, Some(tls))?;
    if probe_peer_failure(api, ctx) {
        return Ok(Ctx { api, ctx, peer_failure: true, tls: tls.to_string(), puts: false });
    }
    let reduced = without_single_copy(tls);
    // SAFETY: nothing else uses this context yet.
    unsafe { (api.cleanup)(ctx) };
    tracing::info!(
        ucx_tls = %tls,
        using = %reduced,
        "UCX transports without peer failure detection: single-copy transports (cma) left out"
    );
    let ctx = init(api, Some(&reduced))?;
    let puts = shared_memory_only(&reduced);
    Ok(Ctx { api, ctx, peer_failure: false, tls: reduced, puts })
}

/// Identifies this host *and* the namespaces UCX's shared-memory
/// transports need to share with a peer (boot id; PID, IPC and mount
/// namespaces): two processes with the same token can use `sm`.
pub(crate) fn same_host_token() -> Vec<u8> {
    let mut text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default().trim().to_string();
    for ns in ["pid", "ipc", "mnt"] {
        let link = std::fs::read_link(format!("/proc/self/ns/{ns}")).map(|p| p.display().to_string());
        text.push(' ');
        text.push_str(&link.unwrap_or_default());
    }
    text.into_bytes()
}

/// Whether this process's UCX endpoints detect dead peers (peer failure
/// mode), once UCX is loaded.
pub fn ucx_peer_failure_detection() -> Result<bool, String> {
    context().map(|c| c.peer_failure)
}

/// The UCX transports (`UCX_TLS` syntax) this process's connections use:
/// to peers on this host when `same_host`, else to other hosts. What to
/// give `ucx_perftest` so that it measures what `ucx://` can reach.
pub fn ucx_transports(same_host: bool) -> Result<String, String> {
    context_for(same_host).map(|c| c.tls)
}

/// Whether large tensors to a peer on this host (`same_host`) or elsewhere
/// go by puts into receiver-granted memory (contexts with shared-memory
/// transports only) rather than by tagged rendezvous.
pub fn ucx_puts(same_host: bool) -> Result<bool, String> {
    context_for(same_host).map(|c| c.puts)
}

/// The memory types this process's UCX can move (`host`, and `cuda`,
/// `cuda-managed`, `rocm`, `rocm-managed` where UCX was built with them;
/// Debian's UCX has `host` only).
pub fn ucx_memory_types() -> Result<Vec<&'static str>, String> {
    let c = context()?;
    let mut attr = ContextAttr {
        field_mask: UCP_ATTR_FIELD_MEMORY_TYPES,
        request_size: 0,
        thread_mode: 0,
        memory_types: 0,
        _rest: [0; 256],
    };
    // SAFETY: a live context and an attribute struct laid out as ucp.h's
    // (with spare room), asking only for the memory types.
    let s = unsafe { (c.api.context_query)(c.ctx, &mut attr) };
    if s != UCS_OK {
        return Err(format!("ucp_context_query: {}", status_str(c.api, s)));
    }
    Ok(MEMORY_TYPES.iter().enumerate().filter(|(i, _)| attr.memory_types & (1 << i) != 0).map(|(_, n)| *n).collect())
}

/// The version of the UCX library this process loaded (e.g. "1.13.1"), or
/// why it could not load one.
pub fn ucx_version() -> Result<String, String> {
    let api = api()?;
    // SAFETY: returns a static NUL-terminated string.
    let p = unsafe { (api.get_version_string)() };
    if p.is_null() {
        return Ok(String::new());
    }
    // SAFETY: non-null static string.
    Ok(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
