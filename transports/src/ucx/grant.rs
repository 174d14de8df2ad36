//! Receiver-granted memory for puts: a region of UCX-allocated memory (the
//! tensor's receive buffer), and the grant message that hands its remote
//! key to the sender. Sans-IO apart from the two UCP calls that make and
//! free a region.
//!
//! ```text
//!   sender                                           receiver
//!   chunk 0 by tag, frame {ucx_tag, grant_wanted} ─►  first chunk lands; the
//!                                                     reader places the tensor:
//!                                                     its buffer becomes a UCX
//!   ◄──────── tag GRANT|tag: Grant {region, addr,     region (ucp_mem_map,
//!             len, rkey}  (or a refusal)              ALLOCATE), rkey packed
//!   ucp_put_nbx(chunk k → addr + offset) ...
//!   ucp_ep_flush_nbx
//!   frames {ucx_put} ─────────── mux ──────────────►  Payload::Placed: already there
//! ```
//!
//! On one host, UCX's shared-memory transports allocate the region in a
//! segment the sender maps when it unpacks the key: each put is one copy,
//! by the sender, into the receiver's tensor (the tagged rendezvous copies
//! twice, through UCX's bounce buffers). Grants are answered only for
//! tensors the reader places (so a `fetch_into` into caller memory keeps
//! the tagged path), and refused when no region can be had.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::answer::Grant;
use super::ffi;
use crate::RecvBuf;

/// Tags with this bit carry grants (answers to the chunk whose tag is the
/// rest); payload tags never have it (they count up from 1).
pub(crate) const GRANT_BIT: u64 = 1 << 63;
/// Longest grant message (the packed key of a shared-memory region is a
/// few dozen bytes; RDMA keys a few hundred).
pub(crate) const GRANT_MAX: usize = 4096;
/// Numbers regions (process-wide, never reused).
static NEXT_REGION: AtomicU64 = AtomicU64::new(1);
/// Regions alive, and allocated since the start ([`super::UcxStats`]).
pub(crate) static REGIONS: AtomicU64 = AtomicU64::new(0);
pub(crate) static REGIONS_ALLOCATED: AtomicU64 = AtomicU64::new(0);
/// Grants answered with memory.
pub(crate) static GRANTS: AtomicU64 = AtomicU64::new(0);

/// UCX-allocated memory (`ucp_mem_map` with `ALLOCATE`) of one context,
/// unmapped when dropped; it backs a [`RecvBuf`] (so the receive pool
/// recycles it like any buffer).
pub(crate) struct Region {
    ctx: ffi::Ctx,
    memh: ffi::MemH,
    base: NonNull<u8>,
    len: usize,
    id: u64,
    /// The packed remote key, made once.
    rkey: Vec<u8>,
    /// Set when a grant of it ended before its last put: the peer may still
    /// write into it, so it is never recycled (freed instead).
    poisoned: Arc<AtomicBool>,
}

// SAFETY: the memory handle belongs to a context created for several
// threads (mt_workers_shared); the region is only read through `RecvBuf`.
unsafe impl Send for Region {}
// SAFETY: as above; shared references read plain fields.
unsafe impl Sync for Region {}

impl Region {
    /// A new region of at least `len` bytes in `ctx`, as a [`RecvBuf`] of
    /// length `len`; None when UCX cannot allocate it.
    pub(crate) fn alloc(ctx: &ffi::Ctx, len: usize) -> Result<RecvBuf, String> {
        let api = ctx.api;
        let params = ffi::MemMapParams {
            field_mask: ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | ffi::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            address: std::ptr::null_mut(),
            length: len,
            flags: ffi::UCP_MEM_MAP_ALLOCATE,
            prot: 0,
            _rest: [0; 64],
        };
        let mut memh: ffi::MemH = std::ptr::null_mut();
        // SAFETY: live context, valid params and out-pointer.
        let s = unsafe { (api.mem_map)(ctx.ctx, &params, &mut memh) };
        if s != ffi::UCS_OK {
            return Err(format!("ucp_mem_map({len} bytes): {}", ffi::status_str(api, s)));
        }
        let unmap = |why: String| {
            // SAFETY: the handle mapped above, unmapped once.
            unsafe { (api.mem_unmap)(ctx.ctx, memh) };
            Err(why)
        };
        let mut attr = ffi::MemAttr {
            field_mask: ffi::UCP_MEM_ATTR_FIELD_ADDRESS | ffi::UCP_MEM_ATTR_FIELD_LENGTH,
            address: std::ptr::null_mut(),
            length: 0,
            _rest: [0; 32],
        };
        // SAFETY: a live handle and a valid out-struct.
        let s = unsafe { (api.mem_query)(memh, &mut attr) };
        let Some(base) = NonNull::new(attr.address.cast::<u8>()).filter(|_| s == ffi::UCS_OK && attr.length >= len)
        else {
            return unmap(format!("ucp_mem_query: {} ({} bytes)", ffi::status_str(api, s), attr.length));
        };
        let (mut packed, mut size): (*mut std::ffi::c_void, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: live context and handle, valid out-pointers.
        let s = unsafe { (api.rkey_pack)(ctx.ctx, memh, &mut packed, &mut size) };
        if s != ffi::UCS_OK || packed.is_null() {
            return unmap(format!("ucp_rkey_pack: {}", ffi::status_str(api, s)));
        }
        // SAFETY: UCX returned `size` bytes at `packed`, released just after.
        let rkey = unsafe { std::slice::from_raw_parts(packed as *const u8, size) }.to_vec();
        // SAFETY: the buffer ucp_rkey_pack returned, released once.
        unsafe { (api.rkey_buffer_release)(packed) };
        let cap = attr.length;
        let id = NEXT_REGION.fetch_add(1, Ordering::Relaxed);
        let region = Region { ctx: ctx.clone(), memh, base, len: cap, id, rkey, poisoned: Arc::default() };
        REGIONS.fetch_add(1, Ordering::Relaxed);
        REGIONS_ALLOCATED.fetch_add(1, Ordering::Relaxed);
        // SAFETY: UCX allocated `cap` bytes at `base` for this handle alone
        // (zero pages of a new segment or mapping: contexts with puts never
        // allocate from the heap, see `ffi::init`); they live until
        // `region`, the buffer's owner, unmaps them.
        Ok(unsafe { RecvBuf::from_foreign(base, cap, len, Box::new(region)) })
    }

    /// The grant of the first `len` bytes of `buf` if `buf` is a region of
    /// `ctx` (a recycled one, or one made by [`alloc`](Self::alloc)), and
    /// the flag that poisons the region should the grant end early.
    pub(crate) fn grant(buf: &RecvBuf, ctx: &ffi::Ctx) -> Option<(Grant, Arc<AtomicBool>)> {
        let r = buf.foreign::<Region>().filter(|r| r.ctx.ctx == ctx.ctx && !r.poisoned.load(Ordering::Acquire))?;
        debug_assert_eq!(r.base.as_ptr() as *const u8, buf.as_ptr());
        let g = Grant { region: r.id, addr: r.base.as_ptr() as u64, len: buf.len() as u64, rkey: r.rkey.clone() };
        (buf.len() <= r.len).then(|| (g, r.poisoned.clone()))
    }
}

impl crate::buf::Foreign for Region {
    fn reusable(&self) -> bool {
        !self.poisoned.load(Ordering::Acquire)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the handle mapped in `alloc`, unmapped once; the buffer
        // over it is being dropped (this is its owner).
        unsafe { (self.ctx.api.mem_unmap)(self.ctx.ctx, self.memh) };
        REGIONS.fetch_sub(1, Ordering::Relaxed);
    }
}
