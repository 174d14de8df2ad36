//! Shared-memory segments (sealed memfds) and the side channel that passes
//! their descriptors between the two processes (`SCM_RIGHTS` on a
//! `SOCK_SEQPACKET` socket pair).
//!
//! Safety rules, each enforced here:
//! - A segment is an anonymous memfd: it has no name in `/dev/shm`, so a
//!   crashed peer leaves nothing behind; the kernel frees it with its last
//!   descriptor or mapping.
//! - The writer seals its size (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`)
//!   before passing it on, and the reader refuses a segment without those
//!   seals: a segment cannot be truncated under the reader's mapping, which
//!   would make reads fault with SIGBUS.
//! - The reader maps the segment's real size (`fstat`), checked against its
//!   limit; a frame can name only a segment passed on its own connection,
//!   and only bytes inside it.
//! - Segments are reused: the writer fills a segment again only after the
//!   reader reported that every view of it was dropped. (A hostile writer
//!   on the same host could still change bytes the reader is looking at;
//!   it cannot make the reader fault or read outside a segment.)

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[cfg(doc)]
use crate::copy::STREAMED_DESTINATIONS_FROM;
use crate::copy::copy_streaming;
use crate::sync::lock;
use bytes::Bytes;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

/// Magic that opens a Unix socket whose client offers shared memory (sent
/// with one end of the side channel as `SCM_RIGHTS`).
pub(crate) const MAGIC: &[u8; 8] = b"TWSHM\x01\0\0";

/// Segments the peer may have passed on one connection at once, at most.
/// Writers keep their live segments below this.
pub(crate) const MAX_SEGMENTS: usize = 256;

/// Peer segments mapped in this process, across all connections, at most:
/// a few hostile local clients must not exhaust the address space or
/// `vm.max_map_count` (65,530 by default) of a server.
const MAX_MAPPED_SEGMENTS: u64 = 16_384;
/// Bytes of peer segments mapped in this process, at most (address space
/// only; pages are faulted in as frames' bytes are read).
const MAX_MAPPED_BYTES: u64 = 4 << 40;

static MAPPED_SEGMENTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static MAPPED_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Releases queued for the side channel's task while its socket is full,
/// at most (a peer has at most [`MAX_SEGMENTS`] segments lent at once).
const RELEASES_QUEUED: usize = 4 * MAX_SEGMENTS;

/// Messages to the peer wait at most this long for room in the socket: a
/// peer that stops reading its side channel is cut off, not waited for.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Side-channel operations (16-byte messages: segment id, operation).
pub(crate) mod op {
    /// Writer → reader, with the descriptor attached: a new segment.
    pub const NEW: u64 = 1;
    /// Reader → writer: a frame naming the segment arrived and was viewed
    /// (frees its share of the writer's in-flight budget).
    pub const TAKEN: u64 = 2;
    /// Reader → writer: every view of the segment was dropped; the writer
    /// may fill it again.
    pub const RELEASED: u64 = 3;
    /// Writer → reader: the segment will not be used again.
    pub const FORGET: u64 = 4;
}

/// One side-channel message: 16 bytes (segment id, operation, both
/// little-endian u64); `New` comes with the segment's descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SideMsg {
    /// [`op::NEW`]: a new segment of the writer (descriptor attached).
    New(u64),
    /// [`op::TAKEN`]: the reader viewed one of our segments.
    Taken(u64),
    /// [`op::RELEASED`]: the reader dropped every view of one of our segments.
    Released(u64),
    /// [`op::FORGET`]: the writer will not use the segment again.
    Forget(u64),
}

impl SideMsg {
    /// The 16 bytes on the wire.
    pub(crate) fn encode(self) -> [u8; 16] {
        let (id, operation) = match self {
            SideMsg::New(id) => (id, op::NEW),
            SideMsg::Taken(id) => (id, op::TAKEN),
            SideMsg::Released(id) => (id, op::RELEASED),
            SideMsg::Forget(id) => (id, op::FORGET),
        };
        let mut msg = [0u8; 16];
        msg[..8].copy_from_slice(&id.to_le_bytes());
        msg[8..].copy_from_slice(&operation.to_le_bytes());
        msg
    }

    /// Parses a message; `has_fd` says whether a descriptor came with it
    /// (only `New` may carry one, and it must).
    pub(crate) fn decode(msg: &[u8], has_fd: bool) -> Result<SideMsg, String> {
        let Ok(msg) = <&[u8; 16]>::try_from(msg) else {
            return Err(format!("malformed side-channel message of {} bytes (expected 16)", msg.len()));
        };
        let (id, operation) = msg.split_at(8);
        let id = u64::from_le_bytes(id.try_into().unwrap_or_default());
        let operation = u64::from_le_bytes(operation.try_into().unwrap_or_default());
        match (operation, has_fd) {
            (op::NEW, true) => Ok(SideMsg::New(id)),
            (op::TAKEN, false) => Ok(SideMsg::Taken(id)),
            (op::RELEASED, false) => Ok(SideMsg::Released(id)),
            (op::FORGET, false) => Ok(SideMsg::Forget(id)),
            (op::NEW, false) => Err(format!("segment {id} announced without its descriptor")),
            (_, true) => Err(format!("a descriptor came with side-channel operation {operation}")),
            _ => Err(format!("unexpected side-channel operation {operation}")),
        }
    }
}

/// The peer's segments mapped on one connection (sans-IO: what the side
/// channel's reader applies messages to and frames are checked against).
pub(crate) struct PeerSegments {
    map: HashMap<u64, Arc<PeerSegment>>,
    max_segment: u64,
}

impl PeerSegments {
    /// No segments yet; none larger than `max_segment` bytes will be mapped.
    pub(crate) fn new(max_segment: u64) -> Self {
        Self { map: HashMap::new(), max_segment }
    }

    /// Applies one message (`fd`: the descriptor that came with it).
    /// Reports our own segments' fate to `owner`; returns true when a peer
    /// segment arrived. An error ends the side channel.
    pub(crate) fn apply(&mut self, owner: &dyn Owner, msg: &[u8], fd: Option<OwnedFd>) -> Result<bool, String> {
        match SideMsg::decode(msg, fd.is_some())? {
            SideMsg::New(id) => {
                let Some(fd) = fd else { return Err(format!("segment {id} announced without its descriptor")) };
                let seg = PeerSegment::map(&fd, self.max_segment).map_err(|e| format!("segment {id} refused: {e}"))?;
                if self.map.len() >= MAX_SEGMENTS && !self.map.contains_key(&id) {
                    return Err(format!("more than {MAX_SEGMENTS} segments passed at once"));
                }
                self.map.insert(id, Arc::new(seg));
                return Ok(true);
            }
            SideMsg::Taken(id) => owner.taken(id),
            SideMsg::Released(id) => owner.released(id),
            SideMsg::Forget(id) => {
                self.map.remove(&id);
            }
        }
        Ok(false)
    }

    /// The segment a frame names for `len` bytes: None while it has not
    /// arrived; an error when the frame claims more than the segment holds.
    pub(crate) fn lookup(&self, id: u64, len: u64) -> Result<Option<Arc<PeerSegment>>, String> {
        match self.map.get(&id) {
            Some(seg) if len > seg.len() as u64 => {
                Err(format!("frame claims {len} bytes of the {}-byte segment {id}", seg.len()))
            }
            Some(seg) => Ok(Some(seg.clone())),
            None => Ok(None),
        }
    }

    /// Unmaps every segment.
    #[cfg_attr(not(feature = "fuzzing"), allow(dead_code))]
    pub(crate) fn clear(&mut self) {
        self.map.clear();
    }

    /// Segments mapped now.
    #[cfg_attr(not(feature = "fuzzing"), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

/// A libc return value as a result (negative: the OS error).
pub(crate) fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r) }
}

fn cvt_size(r: isize) -> io::Result<usize> {
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r as usize) }
}

/// A `SOCK_SEQPACKET` socket pair (close-on-exec, non-blocking).
pub(crate) fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    unix_pair(libc::SOCK_SEQPACKET)
}

/// A connected pair of Unix sockets of `kind` (close-on-exec, non-blocking).
pub(crate) fn unix_pair(kind: libc::c_int) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` is a valid array of two ints for socketpair to fill.
    cvt(unsafe {
        libc::socketpair(libc::AF_UNIX, kind | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0, fds.as_mut_ptr())
    })?;
    // SAFETY: socketpair succeeded, so both descriptors are open and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A message header over one buffer and a control buffer of `space` bytes.
///
/// # Safety
/// `iov` and `cbuf` must outlive every use of the returned header, and
/// `cbuf` must hold at least `space` bytes.
unsafe fn msghdr(iov: &mut libc::iovec, cbuf: &mut [u64], space: usize) -> libc::msghdr {
    // SAFETY: msghdr is plain data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    msg
}

/// Sends `data` with `fd` attached (`SCM_RIGHTS`) on the socket `sock`.
pub(crate) fn send_with_fd(sock: RawFd, data: &[u8], fd: RawFd) -> io::Result<usize> {
    send_with_fds(sock, data, &[fd])
}

/// Sends `data` with `fds` attached (`SCM_RIGHTS`, at most [`MAX_FDS`]) on
/// the socket `sock`.
pub(crate) fn send_with_fds(sock: RawFd, data: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    assert!(!fds.is_empty() && fds.len() <= MAX_FDS, "1..={MAX_FDS} descriptors per message");
    let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
    let bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    // u64 elements: aligned for cmsghdr.
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; every pointer set below outlives the
    // sendmsg call (iov, cbuf), and the control buffer is CMSG_SPACE bytes
    // for these descriptors, as CMSG_FIRSTHDR/CMSG_DATA expect.
    unsafe {
        let msg = msghdr(&mut iov, &mut cbuf, space);
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(cmsg), bytes);
        cvt_size(libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL))
    }
}

/// Most descriptors one message may carry.
pub(crate) const MAX_FDS: usize = 8;

/// Receives into `buf`, returning its length and at most one descriptor
/// (any others attached are closed). `flags` may hold `MSG_PEEK`.
pub(crate) fn recv_with_fd(sock: RawFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<(usize, Option<OwnedFd>)> {
    let (n, fds) = recv_with_fds(sock, buf, flags)?;
    Ok((n, fds.into_iter().next()))
}

/// Receives into `buf`, returning its length and the descriptors attached
/// (at most [`MAX_FDS`]; a message with more is an error, its descriptors
/// closed). `flags` may hold `MSG_PEEK`.
pub(crate) fn recv_with_fds(sock: RawFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: as in send_with_fds; the kernel fills at most msg_controllen
    // bytes of cbuf, and we read only the headers it reports.
    unsafe {
        let mut msg = msghdr(&mut iov, &mut cbuf, space);
        let n = cvt_size(libc::recvmsg(sock, &mut msg, flags | libc::MSG_CMSG_CLOEXEC))?;
        let mut fds = Vec::new();
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "too many descriptors attached"));
        }
        Ok((n, fds))
    }
}

/// A segment this side writes: a memfd mapped read-write, its size sealed.
pub(crate) struct SegmentWriter {
    fd: OwnedFd,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only written through &mut self.
unsafe impl Send for SegmentWriter {}

impl SegmentWriter {
    /// A new memfd of `len` bytes (size sealed), mapped for writing.
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        let fd = sealed_memfd(c"tensorwire", len)?;
        if len == 0 {
            return Ok(Self { fd, ptr: std::ptr::null_mut(), len });
        }
        // SAFETY: mapping `len` bytes of a file of exactly `len` bytes.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd, ptr: ptr as *mut u8, len })
    }

    /// Segment length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The descriptor, to pass to the peer.
    pub(crate) fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Copies `data` to `offset` (false when it does not fit); `stream`
    /// copies with non-temporal stores ([`copy_streaming`]: for a tensor
    /// of at least [`STREAMED_DESTINATIONS_FROM`] bytes, which leaves the
    /// caches anyway).
    pub(crate) fn write(&mut self, offset: usize, data: &[u8], stream: bool) -> bool {
        match offset.checked_add(data.len()) {
            Some(end) if end <= self.len => {
                if !data.is_empty() {
                    // SAFETY: offset..end lies inside our mapping of `len`
                    // bytes. Nothing else in this process reads or writes
                    // it meanwhile: a segment is written only while it is
                    // not lent (it comes back from the peer when RELEASED),
                    // `copy_out` makes copies, and the peer's mapping of a
                    // segment of ours (same process in tests) lies at
                    // another address, so `data` cannot point into it.
                    let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), data.len()) };
                    if stream {
                        copy_streaming(dst, data);
                    } else {
                        dst.copy_from_slice(data);
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// A copy of `offset..offset+len` (clamped to the segment).
    pub(crate) fn copy_out(&self, offset: usize, len: usize) -> Bytes {
        let start = offset.min(self.len);
        let end = offset.saturating_add(len).min(self.len);
        if start == end {
            return Bytes::new();
        }
        // SAFETY: start..end lies inside our live mapping.
        Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(self.ptr.add(start), end - start) })
    }
}

impl Drop for SegmentWriter {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: ptr/len is the mapping made in new(), unmapped once.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

/// A new memfd named `name`, `len` bytes long, its size sealed (it can
/// neither shrink nor grow, and the seals cannot be removed). The size is
/// checked once sealed: anything else in this process that resized the
/// file between `ftruncate` and the seal (a descriptor is visible in
/// `/proc/self/fd` from its creation) would otherwise make a later access
/// to the mapping a SIGBUS instead of an error here.
pub(crate) fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: the name is a valid C string; flags are valid memfd flags.
    let fd = cvt(unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) })?;
    // SAFETY: memfd_create returned a new descriptor that we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate and fcntl on our own descriptor.
    unsafe {
        cvt(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t))?;
        cvt(libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        ))?;
    }
    let size = sealed_size(&fd, "new shared memory").map_err(io::Error::other)?;
    if size != len as u64 {
        return Err(io::Error::other(format!(
            "shared memory of {len} bytes was resized to {size} before its size was sealed"
        )));
    }
    Ok(fd)
}

/// The size of a peer's memfd (`what` names it in errors), checked to be
/// sealed against shrinking and growing, so a mapping cannot fault, and to
/// live in ordinary shared memory (tmpfs): a huge-page memfd can have holes
/// punched in it that its seals do not forbid, and a fault in a hole with
/// the huge-page pool empty is a SIGBUS.
pub(crate) fn sealed_size(fd: &OwnedFd, what: &str) -> Result<u64, String> {
    // SAFETY: fstat/fstatfs/fcntl on a descriptor we own; st and fs are
    // plain data.
    let (size, seals, fs_type) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) < 0 {
            return Err(format!("fstat of the {what} failed: {}", io::Error::last_os_error()));
        }
        let mut fs: libc::statfs = std::mem::zeroed();
        if libc::fstatfs(fd.as_raw_fd(), &mut fs) < 0 {
            return Err(format!("fstatfs of the {what} failed: {}", io::Error::last_os_error()));
        }
        (st.st_size as u64, libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS), fs.f_type)
    };
    if fs_type != libc::TMPFS_MAGIC {
        return Err(format!("the {what} is not ordinary shared memory (file system type {fs_type:#x}, not tmpfs)"));
    }
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals < 0 || seals & need != need {
        return Err(format!("the {what}'s size is not sealed (it could shrink under the mapping)"));
    }
    Ok(size)
}

/// A segment of the peer's, mapped for as long as this lives.
///
/// Mapped writable (shared): this crate only reads it, but a receiver's
/// tensor *is* this memory, and a consumer outside Rust (a torch tensor
/// made from it through DLPack) may write to it in place. A read-only
/// mapping made that a SIGSEGV. Writes land in the sender's segment, which
/// the sender neither reads nor reuses until every view is released;
/// they give the receiver nothing it could not do with the descriptor it
/// holds anyway.
pub(crate) struct PeerSegment {
    ptr: *const u8,
    len: usize,
}

// SAFETY: this crate never writes through the mapping (it hands out
// shared, immutable views of it); sharing references to it across threads
// is sound.
unsafe impl Send for PeerSegment {}
// SAFETY: see Send.
unsafe impl Sync for PeerSegment {}

impl PeerSegment {
    /// Checks a received segment (seals, size within `limit`) and maps all of it.
    pub(crate) fn map(fd: &OwnedFd, limit: u64) -> Result<Self, String> {
        let size = sealed_size(fd, "segment")?;
        if size > limit {
            return Err(format!("segment of {size} bytes exceeds the limit of {limit} bytes"));
        }
        if size == 0 {
            return Ok(Self { ptr: std::ptr::null(), len: 0 });
        }
        use std::sync::atomic::Ordering::AcqRel;
        let count = MAPPED_SEGMENTS.fetch_add(1, AcqRel) + 1;
        let bytes = MAPPED_BYTES.fetch_add(size, AcqRel) + size;
        if count > MAX_MAPPED_SEGMENTS || bytes > MAX_MAPPED_BYTES {
            MAPPED_SEGMENTS.fetch_sub(1, AcqRel);
            MAPPED_BYTES.fetch_sub(size, AcqRel);
            return Err(format!(
                "this process already maps {} peer segments ({} bytes): limit reached",
                count - 1,
                bytes - size
            ));
        }
        // SAFETY: mapping exactly the sealed size of the file. No
        // MAP_POPULATE: faulting in a peer's sparse segment would allocate
        // memory here for bytes no frame may ever name; pages are faulted in
        // only as the bytes a frame names are read.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            MAPPED_SEGMENTS.fetch_sub(1, AcqRel);
            MAPPED_BYTES.fetch_sub(size, AcqRel);
            return Err(format!("mmap failed: {}", io::Error::last_os_error()));
        }
        Ok(Self { ptr: ptr as *const u8, len: size as usize })
    }

    /// Mapped length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PeerSegment {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: ptr/len is the mapping made in map(), unmapped once.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
            MAPPED_SEGMENTS.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            MAPPED_BYTES.fetch_sub(self.len as u64, std::sync::atomic::Ordering::AcqRel);
        }
    }
}

/// The first `len` bytes of a peer segment, as the owner of a [`Bytes`];
/// reports the release when the last reference goes.
struct View {
    seg: Arc<PeerSegment>,
    len: usize,
    id: u64,
    side: std::sync::Weak<SideChannel>,
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: len ≤ the live mapping's length (checked in SideChannel::view).
        unsafe { std::slice::from_raw_parts(self.seg.ptr, self.len) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        if let Some(side) = self.side.upgrade() {
            side.release(self.id);
        }
    }
}

/// Our end of the side channel: passes our segments' descriptors, keeps
/// the peer's segments mapped, and carries the acknowledgements that give
/// budget and segments back (see [`op`]).
pub(crate) struct SideChannel {
    sock: AsyncFd<OwnedFd>,
    peer_segments: Mutex<PeerSegments>,
    arrived: Notify,
    closed: std::sync::atomic::AtomicBool,
    released_tx: tokio::sync::mpsc::Sender<u64>,
    released_rx: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<u64>>,
}

/// What the reader loop reports about our own segments.
pub(crate) trait Owner: Send + Sync {
    /// The peer viewed segment `id`.
    fn taken(&self, id: u64);
    /// The peer dropped every view of segment `id`.
    fn released(&self, id: u64);
}

impl SideChannel {
    pub(crate) fn new(sock: OwnedFd, max_segment: u64) -> io::Result<Self> {
        // SAFETY: fcntl on our own descriptor.
        unsafe {
            let fl = libc::fcntl(sock.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(sock.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let (released_tx, released_rx) = tokio::sync::mpsc::channel(RELEASES_QUEUED);
        Ok(Self {
            // SAFETY: an OwnedFd's descriptor stays open and the same until
            // it is dropped, which only happens with the AsyncFd.
            sock: unsafe { AsyncFd::register(sock) }?,
            peer_segments: Mutex::new(PeerSegments::new(max_segment)),
            arrived: Notify::new(),
            closed: std::sync::atomic::AtomicBool::new(false),
            released_tx,
            released_rx: tokio::sync::Mutex::new(released_rx),
        })
    }

    /// Ends the side channel (as its reader does when it fails): no more
    /// segments either way, and the peer learns it at once (its reader
    /// sees the end, it stops lending and sends through the socket).
    /// Segments already mapped stay readable.
    pub(crate) fn end(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::Release);
        // SAFETY: shutdown on our own socket.
        unsafe { libc::shutdown(self.sock.get_ref().as_raw_fd(), libc::SHUT_RDWR) };
        self.arrived.notify_waiters();
    }

    /// True once the side channel has ended.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Reports the peer's segment `id` released (every view dropped, or
    /// its frame dropped unread, whether or not the segment has arrived
    /// yet: a frame may overtake it; the peer ignores ids it did not lend):
    /// at once when the socket has room (so the report is on its way before
    /// anything the caller sends next), else through the reader task.
    pub(crate) fn release(&self, id: u64) {
        if self.is_closed() {
            return;
        }
        let msg = SideMsg::Released(id).encode();
        // SAFETY: send on our own socket with a valid 16-byte buffer.
        let n = unsafe {
            libc::send(
                self.sock.get_ref().as_raw_fd(),
                msg.as_ptr() as *const libc::c_void,
                msg.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n != msg.len() as isize {
            // Queued for the reader task; past RELEASES_QUEUED the peer is
            // not reading its side channel, and only it loses (its budget).
            let _ = self.released_tx.try_send(id);
        }
    }

    /// Handles every message already waiting, without blocking (the writer
    /// calls it before making a new segment, in case a release is in).
    pub(crate) fn drain_now(&self, owner: &dyn Owner) -> Result<(), String> {
        let mut buf = [0u8; 16];
        loop {
            match recv_with_fd(self.sock.get_ref().as_raw_fd(), &mut buf, libc::MSG_DONTWAIT) {
                Ok((0, _)) => return Err("peer closed the side channel".into()),
                Ok((n, fd)) => self.handle(owner, &buf[..n], fd)?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    fn handle(&self, owner: &dyn Owner, msg: &[u8], fd: Option<OwnedFd>) -> Result<(), String> {
        let arrived = lock(&self.peer_segments).apply(owner, msg, fd)?;
        if arrived {
            self.arrived.notify_waiters();
        }
        Ok(())
    }

    /// Sends one message, with `fd` attached when given, waiting at most
    /// [`SEND_TIMEOUT`] for room in the socket.
    pub(crate) async fn send(&self, msg: SideMsg, fd: Option<&OwnedFd>) -> io::Result<()> {
        match tokio::time::timeout(SEND_TIMEOUT, self.send_now(msg, fd)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "the peer does not read its side channel")),
        }
    }

    async fn send_now(&self, msg: SideMsg, fd: Option<&OwnedFd>) -> io::Result<()> {
        let msg = msg.encode();
        loop {
            let mut guard = self.sock.writable().await?;
            let r = guard.try_io(|s| match fd {
                Some(fd) => send_with_fd(s.as_raw_fd(), &msg, fd.as_raw_fd()),
                // SAFETY: send on our own socket with a valid 16-byte buffer.
                None => cvt_size(unsafe {
                    libc::send(s.as_raw_fd(), msg.as_ptr() as *const libc::c_void, msg.len(), libc::MSG_NOSIGNAL)
                }),
            });
            match r {
                Ok(r) => return r.map(|_| ()),
                Err(_would_block) => continue,
            }
        }
    }

    /// Reads messages until the peer closes its end (or breaks the
    /// protocol), and sends our release reports; returns why it ended.
    pub(crate) async fn run(&self, owner: &dyn Owner) -> String {
        let mut released = self.released_rx.lock().await;
        let mut buf = [0u8; 16];
        let reason = loop {
            let readable = tokio::select! {
                r = self.sock.readable() => r,
                id = released.recv() => {
                    if let Some(id) = id
                        && let Err(e) = self.send(SideMsg::Released(id), None).await
                    {
                        break e.to_string();
                    }
                    continue;
                }
            };
            let mut guard = match readable {
                Ok(g) => g,
                Err(e) => break e.to_string(),
            };
            let (n, fd) = match guard.try_io(|s| recv_with_fd(s.as_raw_fd(), &mut buf, 0)) {
                Err(_would_block) => continue,
                Ok(Err(e)) => break e.to_string(),
                Ok(Ok((0, _))) => break "peer closed the side channel".to_string(),
                Ok(Ok(r)) => r,
            };
            if let Err(e) = self.handle(owner, &buf[..n], fd) {
                break e;
            }
        };
        // Tell the peer at once (it may still hold our end open otherwise).
        // The peer's segments stay mapped (until the connection goes):
        // frames naming them may still be queued unread here, the end of a
        // reply the peer sent just before it closed, say.
        self.end();
        reason
    }

    /// The first `len` bytes of the peer's segment `id` (waiting up to
    /// `timeout` for the segment to arrive), and reports it taken.
    pub(crate) async fn view(self: &Arc<Self>, id: u64, len: u64, timeout: Duration) -> Result<Bytes, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let seg = loop {
            let notified = self.arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(s) = lock(&self.peer_segments).lookup(id, len)? {
                break s;
            }
            if self.closed.load(std::sync::atomic::Ordering::Acquire) {
                return Err(format!("segment {id} never arrived: the side channel is closed"));
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(format!("segment {id} did not arrive within {timeout:?}"));
            }
        };
        if let Err(e) = self.send(SideMsg::Taken(id), None).await {
            // The segment is mapped and its bytes are here: the reader gets
            // them. Only the sender's budget waits for the TAKEN: a side
            // channel that cannot carry it is ended (the sender then stops
            // lending and sends through the socket).
            tracing::debug!(segment = id, error = %e, "could not report a segment taken");
            self.end();
        }
        Ok(Bytes::from_owner(View { seg, len: len as usize, id, side: Arc::downgrade(self) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(data: &[u8]) -> SegmentWriter {
        let mut w = SegmentWriter::new(data.len()).unwrap();
        assert!(w.write(0, data, false));
        assert!(!w.write(data.len(), b"x", false), "writes past the end are refused");
        w
    }

    #[test]
    fn a_peer_segment_maps_read_only_and_reads_back() {
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let w = segment(&data);
        let s = PeerSegment::map(w.fd(), u64::MAX).unwrap();
        assert_eq!(s.len(), data.len());
        // SAFETY: reading the live mapping within its length.
        assert_eq!(unsafe { std::slice::from_raw_parts(s.ptr, s.len) }, &data[..]);
        assert_eq!(&w.copy_out(10, 5)[..], &data[10..15]);
    }

    #[test]
    fn a_large_segment_filled_piece_by_piece_reads_back_exactly() {
        // Large enough to be filled with non-temporal stores; pieces of
        // odd lengths at odd offsets, as compressed-off chunks may be.
        let len = crate::copy::STREAMED_DESTINATIONS_FROM + 4099;
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ (i >> 16) as u8).collect();
        let mut w = SegmentWriter::new(len).unwrap();
        let mut at = 0;
        for piece in [(1 << 20) + 7, 300_001, 5, 1 << 20].iter().cycle() {
            let end = (at + piece).min(len);
            assert!(w.write(at, &data[at..end], true));
            at = end;
            if at == len {
                break;
            }
        }
        let s = PeerSegment::map(w.fd(), u64::MAX).unwrap();
        // SAFETY: reading the live mapping within its length.
        assert!(unsafe { std::slice::from_raw_parts(s.ptr, s.len) } == &data[..]);
    }

    #[test]
    fn oversized_and_unsealed_segments_are_refused() {
        let w = segment(&[7u8; 4096]);
        let e = PeerSegment::map(w.fd(), 1000).err().unwrap();
        assert!(e.contains("exceeds the limit"), "{e}");
        // An unsealed memfd could be truncated under the mapping: refused.
        // SAFETY: plain memfd_create on a new descriptor.
        let raw = unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: memfd_create returned a new descriptor that we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own descriptor.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 4096) }, 0);
        let e = PeerSegment::map(&fd, u64::MAX).err().unwrap();
        assert!(e.contains("not sealed"), "{e}");
    }

    #[derive(Default)]
    struct Log(Mutex<Vec<(u64, u64)>>);

    impl Owner for Log {
        fn taken(&self, id: u64) {
            self.0.lock().unwrap().push((id, op::TAKEN));
        }
        fn released(&self, id: u64) {
            self.0.lock().unwrap().push((id, op::RELEASED));
        }
    }

    #[tokio::test]
    async fn segments_cross_the_side_channel_and_views_report_take_and_release() {
        let (a, b) = seqpacket_pair().unwrap();
        let a = Arc::new(SideChannel::new(a, 1 << 30).unwrap());
        let b = Arc::new(SideChannel::new(b, 1 << 30).unwrap());
        let log = Arc::new(Log::default());
        let (ra, rb, la) = (a.clone(), b.clone(), log.clone());
        let ta = tokio::spawn(async move { ra.run(&*la).await });
        let tb = tokio::spawn(async move { rb.run(&Log::default()).await });
        let w = segment(b"hello world");
        a.send(SideMsg::New(1), Some(w.fd())).await.unwrap();
        let v = b.view(1, 5, Duration::from_secs(5)).await.unwrap();
        assert_eq!(&v[..], b"hello");
        let e = b.view(1, 100, Duration::from_secs(5)).await.unwrap_err();
        assert!(e.contains("claims 100 bytes of the 11-byte segment 1"), "{e}");
        drop(v);
        for _ in 0..200 {
            if log.0.lock().unwrap().len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(*log.0.lock().unwrap(), vec![(1, op::TAKEN), (1, op::RELEASED)]);
        // A segment that never comes is an error, not a hang.
        let e = b.view(2, 1, Duration::from_millis(50)).await.unwrap_err();
        assert!(e.contains("did not arrive"), "{e}");
        ta.abort();
        tb.abort();
    }
}
