//! Shared memory: `shm://` and `unix://` upgraded to it, bit-exact from
//! 1 byte to 1 GiB in every direction, cleanup after a peer is killed,
//! frames that lie about segments, and a peer that overwrites the shared
//! memory itself.

mod common;

use std::time::Duration;

use common::*;
use tensorwire::builtins::random_tensor;
use tensorwire::{Client, DType, ServerConfig, Tensor};
use tensorwire_proto::v1::{self, frame_header::Kind};
use tensorwire_transports::{self as transports, Frame, FrameHeader, StreamKind};

/// Environment variable that makes `child_process_client` act (it is run
/// by `a_killed_peer_leaves_nothing_behind` as a separate process).
const CHILD_URL: &str = "TENSORWIRE_TEST_SHM_CHILD_URL";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_fetch_exchange_from_one_byte_to_one_gib_bit_exact() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let sizes = [1usize, 255 << 10, 256 << 10, (1 << 20) + 1, 64 << 20, 1 << 30];
    for (i, &n) in sizes.iter().enumerate() {
        let t = random_tensor(DType::UInt8, &[n], i as u64).unwrap().with_name(format!("t{i}"));
        let s = client.send(vec![t.clone()]).await.unwrap();
        assert_eq!(s.bytes, n as u64);
        let back = client.fetch_one(&format!("t{i}")).await.unwrap();
        assert_same(&t, &back);
        drop(back); // its segment goes back to the server's pool
        // Two tensors per exchange, one at 1 GiB (memory on a small machine).
        let copies = if n <= 64 << 20 { 2 } else { 1 };
        let ex = client.exchange_all(vec![t.clone(); copies]).await.unwrap();
        assert_eq!(ex.len(), copies);
        for e in &ex {
            assert_same(&t, e);
        }
    }
    // Typed views of a received tensor work (the mapping is page-aligned).
    let x = random_tensor(DType::Float64, &[512, 1024], 9).unwrap().with_name("f64");
    client.send(vec![x.clone()]).await.unwrap();
    let y = client.fetch_one("f64").await.unwrap();
    assert_eq!(y.as_slice::<f64>().unwrap(), x.as_slice::<f64>().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_connections_upgrade_and_plain_clients_still_work() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "unix").await;
    let url = server.url();
    let cfg = transports::TransportConfig::default();
    let upgraded = transports::connect(&transports::Endpoint::parse(&url).unwrap(), &cfg).await.unwrap();
    assert_eq!(upgraded.info().transport, "unix+shm");
    let plain_url = format!("{url}?shm=0");
    let plain = transports::connect(&transports::Endpoint::parse(&plain_url).unwrap(), &cfg).await.unwrap();
    assert_eq!(plain.info().transport, "unix");
    let mut off = cfg.clone();
    off.shm.unix_upgrade = false;
    let plain2 = transports::connect(&transports::Endpoint::parse(&url).unwrap(), &off).await.unwrap();
    assert_eq!(plain2.info().transport, "unix");
    // Both kinds of client move the same tensors through the same server.
    let t = random_tensor(DType::Float32, &[1 << 20], 4).unwrap().with_name("both");
    let a = Client::connect(&url).await.unwrap();
    let b = Client::connect(&plain_url).await.unwrap();
    a.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &b.fetch_one("both").await.unwrap());
    b.send(vec![t.clone().with_name("both2")]).await.unwrap();
    assert_same(&t, &a.fetch_one("both2").await.unwrap());
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn dev_shm() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Run as a child process by the test below: sends big tensors forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_client() {
    let Ok(url) = std::env::var(CHILD_URL) else { return };
    let client = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[64 << 20], 1).unwrap();
    println!("child connected");
    loop {
        client.send(vec![t.clone()]).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_leaves_nothing_behind() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let url = server.url();
    // A first client warms up everything the server keeps for its lifetime.
    let warm = Client::connect(&url).await.unwrap();
    warm.send(vec![random_tensor(DType::UInt8, &[1 << 20], 1).unwrap()]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (fds_before, shm_before) = (open_fds(), dev_shm());

    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_process_client", "--nocapture", "--test-threads=1"])
        .env(CHILD_URL, &url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Let it send for a while (segments in flight in both directions).
    let stats = || server.info().bytes_received;
    let start = stats();
    for _ in 0..200 {
        if stats() > start + (256 << 20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(stats() > start, "the child sent nothing");
    assert!(open_fds() > fds_before, "the child's connection holds descriptors here");
    child.kill().unwrap();
    child.wait().unwrap();

    // Everything the dead peer had is released: descriptors closed, no
    // file in /dev/shm (segments are anonymous memfds), server serving.
    let mut fds = open_fds();
    for _ in 0..100 {
        if fds <= fds_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        fds = open_fds();
    }
    assert!(fds <= fds_before, "descriptors left after the peer died: {fds} > {fds_before}");
    assert_eq!(dev_shm(), shm_before, "files appeared in /dev/shm");
    let c = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[8 << 20], 3).unwrap().with_name("after");
    c.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &c.fetch_one("after").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_that_lie_about_segments_are_refused() {
    let mut cfg = ServerConfig::default();
    cfg.transport.shm.segment_timeout = Duration::from_millis(300);
    let (server, _dir) = start(store_server(cfg), "shm").await;
    let url = server.url();
    let ep = transports::Endpoint::parse(&url).unwrap();
    let conn = transports::connect(&ep, &Default::default()).await.unwrap();
    let hello = v1::Hello { version: tensorwire::PROTOCOL_VERSION, ..Default::default() };
    let (mut tx, mut rx) = conn.open(StreamKind::Handshake).await.unwrap();
    tx.send_last(Frame::header_only(FrameHeader::new(Kind::Hello(Box::new(hello))))).await.unwrap();
    assert!(matches!(rx.recv().await.unwrap().unwrap().header.kind, Some(Kind::Welcome(_))));

    let info = v1::TensorInfo { dtype: v1::Dtype::Uint8 as i32, shape: vec![100], ..Default::default() };
    let lying = |segment: u64, raw_len: u64, total: u64| {
        let c = v1::Chunk {
            tensor_id: 1,
            total_bytes: total,
            raw_len,
            last: true,
            info: Some(Box::new(info.clone())),
            shm_segment: segment,
            ucx_tag: 0,
            compression: v1::Compression::None as i32,
            ..Default::default()
        };
        Frame::header_only(FrameHeader::new(Kind::Chunk(c)))
    };
    let request = || {
        let r = v1::Request { method: v1::Method::Send as i32, ..Default::default() };
        Frame::header_only(FrameHeader::new(Kind::Request(Box::new(r))))
    };
    // A segment never passed, and a frame whose sizes disagree.
    for (frame, want) in [(lying(999, 100, 100), "segment 999"), (lying(5, 50, 100), "declares 50 bytes")] {
        let (mut tx, mut rx) = conn.open(StreamKind::Send).await.unwrap();
        let _ = tx.send_batch(vec![request(), frame], true).await;
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await.expect("an answer, not a hang");
        let text = match got {
            Ok(Some(r)) => format!("{:?}", r.header.kind),
            Ok(None) => "closed".to_string(),
            Err(e) => e.to_string(),
        };
        assert!(text.contains(want) || text.contains("closed") || text.contains("connection"), "{want}: {text}");
    }
    // The server keeps serving everyone else.
    let c = Client::connect(&url).await.unwrap();
    let t = Tensor::from_vec([3], vec![1u8, 2, 3]).unwrap();
    assert_same(&t, &c.compute("identity", vec![t.clone()]).await.unwrap()[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_larger_than_the_segment_pool_go_through_the_rings_bit_exact() {
    // With a 2 MiB segment pool, a 5 MiB tensor never gets a segment (it
    // would be fresh memory each time, held beside the tensor): it goes
    // through the rings, again and again, in both directions, while a
    // 1 MiB tensor on the same connection still may use segments.
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let mut cfg = tensorwire::ClientConfig::default();
    cfg.transport.shm.max_in_flight = 2 << 20;
    let client = Client::connect_with(&server.url(), cfg).await.unwrap();
    for i in 0..4u64 {
        let big = random_tensor(DType::UInt8, &[(5 << 20) + 3], i).unwrap().with_name("big");
        let small = random_tensor(DType::UInt8, &[1 << 20], 100 + i).unwrap().with_name("small");
        let s = client.send(vec![big.clone(), small.clone()]).await.unwrap();
        assert_eq!(s.received, 2);
        assert_same(&big, &client.fetch_one("big").await.unwrap());
        assert_same(&small, &client.fetch_one("small").await.unwrap());
        let ex = client.exchange_all(vec![big.clone()]).await.unwrap();
        assert_same(&big, &ex[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_held_tensors_than_the_peer_takes_segments_still_arrive() {
    // Each tensor a receiver keeps holds its segment; past the peer's limit
    // (256 per connection) the sender uses the socket instead of failing.
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let client = Client::connect(&server.url()).await.unwrap();
    let tensors: Vec<Tensor> =
        (0..300u64).map(|i| random_tensor(DType::UInt8, &[300 << 10], i).unwrap().with_name(format!("h{i}"))).collect();
    let s = client.send(tensors.clone()).await.unwrap();
    assert_eq!(s.received, 300);
    let names: Vec<String> = (0..300).map(|i| format!("h{i}")).collect();
    let back = client.fetch(tensorwire::FetchRequest::default().param("names", names.join(","))).await.unwrap();
    assert_eq!(back.len(), 300);
    for (a, b) in tensors.iter().zip(&back) {
        assert_same(a, b);
    }
    // Still healthy afterwards, both ways.
    let t = random_tensor(DType::UInt8, &[1 << 20], 7).unwrap().with_name("after");
    client.send(vec![t.clone()]).await.unwrap();
    assert_same(&t, &client.fetch_one("after").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_on_the_same_host_upgrades_to_shared_memory_unless_refused() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "tcp+shm").await;
    let url = server.url();
    // The server lists only what it was asked to listen on.
    assert_eq!(server.info().transports, vec!["tcp".to_string()]);
    let upgraded = Client::connect(&url).await.unwrap();
    assert_eq!(upgraded.transport(), Some("unix+shm"), "a same-host tcp:// client upgrades");
    let plain = Client::connect(&format!("{url}?shm=0")).await.unwrap();
    assert_eq!(plain.transport(), Some("tcp"), "?shm=0 refuses the upgrade");
    let mut cfg = tensorwire::ClientConfig::default();
    cfg.transport.shm.unix_upgrade = false;
    let off = Client::connect_with(&url, cfg).await.unwrap();
    assert_eq!(off.transport(), Some("tcp"), "unix_upgrade = false refuses it too");
    // Both move the same tensors through the same server, bit-exact.
    for (i, c) in [&upgraded, &plain, &off].into_iter().enumerate() {
        let t = random_tensor(DType::UInt8, &[(8 << 20) + i], i as u64).unwrap().with_name(format!("t{i}"));
        c.send(vec![t.clone()]).await.unwrap();
        for d in [&upgraded, &plain] {
            assert_same(&t, &d.fetch_one(&format!("t{i}")).await.unwrap());
        }
    }
    // A reconnect upgrades again.
    upgraded.disconnect();
    assert!(upgraded.health().await.unwrap());
    assert_eq!(upgraded.transport(), Some("unix+shm"));
}

/// Raw descriptors for a hand-made shared-memory offer.
mod offer {
    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    /// Bytes of one ring's data area, and of its control words before it.
    pub const CAP: usize = 4096;
    const CONTROL: usize = 256;

    fn owned(fd: RawFd) -> OwnedFd {
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: a new descriptor this test owns.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    pub fn eventfd() -> OwnedFd {
        // SAFETY: eventfd returns a new descriptor or -1.
        owned(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })
    }

    /// A doorbell as the client makes it: (sleeping end, ringing end).
    pub fn doorbell() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: fds holds two ints for socketpair to fill.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        (owned(fds[0]), owned(fds[1]))
    }

    pub fn pipe() -> OwnedFd {
        let mut fds = [0; 2];
        // SAFETY: fds holds two ints for pipe to fill.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        drop(owned(fds[1]));
        owned(fds[0])
    }

    /// A ring region as the client makes it (sealed unless `seal` is false).
    pub fn region(seal: bool) -> OwnedFd {
        // SAFETY: valid name and flags.
        let fd = owned(unsafe { libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) });
        // SAFETY: on our own descriptor.
        unsafe {
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), (2 * (CONTROL + CAP)) as libc::off_t), 0);
            if seal {
                assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW), 0);
            }
        }
        fd
    }

    /// Writes ring 0's head (the client's producer position) as a hostile client.
    pub fn write_head(region: &OwnedFd, head: u64) {
        // SAFETY: pwrite of 8 bytes at offset 0 of our memfd.
        let n = unsafe { libc::pwrite(region.as_raw_fd(), &head as *const u64 as *const libc::c_void, 8, 0) };
        assert_eq!(n, 8);
    }

    /// Rings a doorbell through its ringing end.
    pub fn signal(fd: &OwnedFd) {
        let one = 1u8;
        // SAFETY: sending 1 byte on our socket.
        assert_eq!(unsafe { libc::send(fd.as_raw_fd(), &one as *const u8 as *const libc::c_void, 1, 0) }, 1);
    }

    /// Connects to `path` and sends `magic` with `fds` attached, as the offer does.
    pub fn send(path: &std::path::Path, magic: [u8; 8], fds: &[RawFd]) -> UnixStream {
        let s = UnixStream::connect(path).unwrap();
        let mut iov = libc::iovec { iov_base: magic.as_ptr() as *mut libc::c_void, iov_len: 8 };
        let bytes = std::mem::size_of_val(fds);
        // SAFETY: CMSG_SPACE is a size computation; the message header points
        // at live buffers for the duration of sendmsg.
        unsafe {
            let space = libc::CMSG_SPACE(bytes as u32) as usize;
            let mut cbuf = vec![0u64; space.div_ceil(8)];
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(cmsg), bytes);
            assert_eq!(libc::sendmsg(s.as_raw_fd(), &msg, 0), 8);
        }
        s
    }

    /// True when the server closes `s` within 10 s (it gives up on this client).
    pub fn closed_by_server(mut s: UnixStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 4096];
        loop {
            match s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// The hostile offers of the test below: what case `i` sends (None: no more cases).
fn lying_offer(i: usize, path: &std::path::Path) -> Option<(&'static str, std::os::unix::net::UnixStream)> {
    use std::os::fd::AsRawFd;
    let magic = |flag: u8| {
        let mut m = *b"TWSHM\x01\0\0";
        m[6] = flag;
        m
    };
    let side = std::os::unix::net::UnixStream::pair().unwrap().0;
    // The server's ends of the four doorbells (it sleeps on client → server
    // data and server → client room), and the client's.
    let (c2s_data, c2s_room, s2c_data, s2c_room) =
        (offer::doorbell(), offer::doorbell(), offer::doorbell(), offer::doorbell());
    let events = [c2s_data.0, c2s_room.1, s2c_data.1, s2c_room.0];
    let data_bell = c2s_data.1;
    let all = |region: &std::os::fd::OwnedFd, e: &[std::os::fd::OwnedFd; 4]| {
        [side.as_raw_fd(), region.as_raw_fd(), e[0].as_raw_fd(), e[1].as_raw_fd(), e[2].as_raw_fd(), e[3].as_raw_fd()]
    };
    Some(match i {
        0 => ("rings announced without their descriptors", offer::send(path, magic(1), &[side.as_raw_fd()])),
        1 => ("an unsealed region", offer::send(path, magic(1), &all(&offer::region(false), &events))),
        2 => {
            let pipes = [offer::pipe(), offer::pipe(), offer::pipe(), offer::pipe()];
            ("pipes for doorbells", offer::send(path, magic(1), &all(&offer::region(true), &pipes)))
        }
        3 => ("an unknown offer flag", offer::send(path, magic(2), &[side.as_raw_fd()])),
        4 => {
            let region = offer::region(true);
            let sock = offer::send(path, magic(1), &all(&region, &events));
            // The server now reads ring 0: claim more bytes than it holds, and wake it.
            offer::write_head(&region, (offer::CAP as u64) * 3);
            offer::signal(&data_bell);
            ("a producer position beyond the ring", sock)
        }
        5 => {
            // What an earlier version offered: eventfds.
            let efds = [offer::eventfd(), offer::eventfd(), offer::eventfd(), offer::eventfd()];
            ("eventfds for doorbells", offer::send(path, magic(1), &all(&offer::region(true), &efds)))
        }
        _ => return None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_offers_that_lie_are_refused_and_the_server_keeps_serving() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "unix").await;
    let url = server.url();
    let path = std::path::PathBuf::from(url.strip_prefix("unix://").unwrap());
    for i in 0.. {
        let p = path.clone();
        let Some((what, closed)) =
            tokio::task::spawn_blocking(move || lying_offer(i, &p).map(|(w, s)| (w, offer::closed_by_server(s))))
                .await
                .unwrap()
        else {
            break;
        };
        assert!(closed, "{what}: the server must drop this client");
        // The server keeps serving everyone else, over rings.
        let c = Client::connect(&url).await.unwrap();
        let t = random_tensor(DType::Float32, &[1000], 3).unwrap();
        assert_same(&t, &c.compute("identity", vec![t.clone()]).await.unwrap()[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_go_through_the_socket_when_rings_are_refused() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let mut rings_off = tensorwire::ClientConfig::default();
    rings_off.transport.shm.ring_bytes = 0;
    let by_url = Client::connect(&format!("{}?ring=0", server.url())).await.unwrap();
    let by_config = Client::connect_with(&server.url(), rings_off).await.unwrap();
    let with_rings = Client::connect(&server.url()).await.unwrap();
    for (i, c) in [by_url, by_config, with_rings].iter().enumerate() {
        // Small tensors (frames) and a large one (a segment, or the socket until one is warm).
        for n in [3usize, 100 << 10, 8 << 20] {
            let t = random_tensor(DType::UInt8, &[n], i as u64).unwrap().with_name(format!("r{i}-{n}"));
            c.send(vec![t.clone()]).await.unwrap();
            assert_same(&t, &c.fetch_one(&format!("r{i}-{n}")).await.unwrap());
        }
    }
}

/// Makes `child_process_scribbler` act.
const CHILD_SCRIBBLE: &str = "TENSORWIRE_TEST_SHM_CHILD_SCRIBBLE";

/// Overwrites every shared memfd mapping of this process (the segments it
/// shares with its peer, and the rings when `rings`) with `byte`, and tries to shrink
/// every sealed memfd it holds; returns (mappings written, files shrunk).
fn scribble_shared_memory(byte: u8, rings: bool) -> (usize, usize) {
    use std::os::unix::fs::FileExt;
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    // Through /proc/self/mem: a mapping this process's transport unmaps in
    // the meantime is an error here, not a crash of the attacker.
    let mem = std::fs::OpenOptions::new().write(true).open("/proc/self/mem").unwrap();
    let mut written = 0;
    for l in maps.lines().filter(|l| l.contains("/memfd:") && (rings || !l.contains("/memfd:tensorwire-ring"))) {
        let mut f = l.split_whitespace();
        let (range, perms) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
        if !perms.starts_with("rw") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        let junk = vec![byte; (b - a) as usize];
        written += usize::from(mem.write_all_at(&junk, a).is_ok());
    }
    let mut shrunk = 0;
    for e in std::fs::read_dir("/proc/self/fd").into_iter().flatten().flatten() {
        let is_memfd = std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"));
        let fd = e.file_name().to_string_lossy().parse::<i32>();
        // A memfd without seals is one the transport is still making (it
        // seals a new one right after sizing it, checks the size, and only
        // then maps or shares it; a peer refuses unsealed ones): shrinking
        // it only makes this process's own next segment fail to be made.
        // SAFETY: fcntl on a descriptor of this process.
        let sealed = |fd| unsafe { libc::fcntl(fd, libc::F_GET_SEALS) } > 0;
        if let (true, Ok(fd)) = (is_memfd, fd)
            && sealed(fd)
        {
            // SAFETY: truncating a descriptor of this process (sealed ones refuse).
            shrunk += usize::from(unsafe { libc::ftruncate(fd, 0) } == 0);
        }
    }
    (written, shrunk)
}

/// Run as a child process: a hostile peer on the same host that, after a
/// first send and fetch, keeps overwriting all the shared memory it maps
/// (rings, segments) and tries to shrink it, while it sends and fetches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_process_scribbler() {
    let Ok(url) = std::env::var(CHILD_SCRIBBLE) else { return };
    let client = Client::connect(&url).await.unwrap();
    let t = random_tensor(DType::UInt8, &[64 << 20], 1).unwrap().with_name("mine");
    client.send(vec![t.clone()]).await.unwrap();
    let held = client.fetch_one("mine").await.unwrap();
    // First segments only (so that the connection lives on and lends more),
    // then the rings too: everything shared, again and again, while this
    // process sends (into segments the server lends) and fetches.
    let start = std::time::Instant::now();
    let scribbler = std::thread::spawn(move || {
        let (mut segments, mut all, mut shrunk_any, mut byte) = (0, 0, 0, 0xffu8);
        while start.elapsed() < Duration::from_secs(2) {
            let rings = start.elapsed() > Duration::from_secs(1);
            let (written, shrunk) = scribble_shared_memory(byte, rings);
            let most = if rings { &mut all } else { &mut segments };
            *most = written.max(*most);
            shrunk_any = shrunk_any.max(shrunk);
            byte = byte.wrapping_add(37);
        }
        (segments, all, shrunk_any)
    });
    while start.elapsed() < Duration::from_secs(2) {
        let _ = tokio::time::timeout(Duration::from_millis(300), client.send(vec![t.clone()])).await;
        let _ = tokio::time::timeout(Duration::from_millis(300), client.fetch_one("mine")).await;
    }
    let (segments, all, shrunk) = scribbler.join().unwrap();
    println!("\nSCRIBBLED {segments} segments, {all} mappings with the rings, shrunk {shrunk} files");
    drop(held);
    std::process::exit(0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_scribbling_over_shared_memory_cannot_bring_the_server_down() {
    let (server, _dir) = start(store_server(ServerConfig::default()), "shm").await;
    let url = server.url();
    // Another client's connection and acknowledged tensor, before the attack.
    let other = Client::connect(&url).await.unwrap();
    let kept = random_tensor(DType::Float32, &[1 << 20], 5).unwrap().with_name("kept");
    other.send(vec![kept.clone()]).await.unwrap();

    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_process_scribbler", "--nocapture", "--test-threads=1"])
            .env(CHILD_SCRIBBLE, &url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("SCRIBBLED"))
        .unwrap_or_else(|| panic!("child: {:?}\n{text}\n{}", out.status, String::from_utf8_lossy(&out.stderr)));
    println!("{line}");
    let n = |i: usize| line.split_whitespace().nth(i).and_then(|w| w.parse::<usize>().ok()).unwrap();
    assert!(n(1) >= 1 && n(3) >= 1, "the child wrote over no segment or no ring: {line}");
    assert!(line.ends_with("shrunk 0 files"), "a shared segment could be shrunk: {line}");

    // The other connection still works, its acknowledged tensor is intact,
    // and a new client is served.
    assert_same(&kept, &other.fetch_one("kept").await.unwrap());
    let t = random_tensor(DType::UInt8, &[8 << 20], 3).unwrap().with_name("after");
    other.send(vec![t.clone()]).await.unwrap();
    let c = Client::connect(&server.url()).await.unwrap();
    assert_same(&t, &c.fetch_one("after").await.unwrap());
}

/// Whether `t`'s bytes are a sender's shared-memory segment, mapped here
/// (`/proc/self/maps` names segments `memfd:tensorwire`, rings
/// `memfd:tensorwire-ring`).
fn in_a_segment(t: &Tensor) -> bool {
    let at = t.as_bytes().unwrap().as_ptr() as usize;
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().any(|l| {
        let mut parts = l.split_whitespace();
        let range = parts.next().unwrap_or("");
        let Some((lo, hi)) = range.split_once('-') else { return false };
        let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap_or(0), usize::from_str_radix(hi, 16).unwrap_or(0));
        lo <= at && at < hi && l.contains("/memfd:tensorwire ")
    })
}

/// A `send` handler that takes its time over each tensor once `pause_ms`
/// is set (a slow consumer: writing to a slow disk, say), and keeps what
/// it received.
#[derive(Default)]
struct Slow {
    pause_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Refuse the call without reading a tensor.
    refuse: std::sync::Arc<std::sync::atomic::AtomicBool>,
    got: std::sync::Arc<std::sync::Mutex<Vec<Tensor>>>,
}

#[async_trait::async_trait]
impl tensorwire::TensorService for Slow {
    async fn send(
        &self,
        _: &tensorwire::CallContext,
        tensors: &mut tensorwire::TensorStream,
    ) -> Result<tensorwire::SendSummary, tensorwire::Status> {
        if self.refuse.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(tensorwire::Status::invalid_argument("refused unread"));
        }
        let mut s = tensorwire::SendSummary::default();
        loop {
            let pause = self.pause_ms.load(std::sync::atomic::Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let Some(t) = tensors.next().await else { break };
            let t = t.map_err(tensorwire::Status::from)?;
            s.received += 1;
            s.bytes += t.nbytes() as u64;
            self.got.lock().unwrap().push(t);
        }
        Ok(s)
    }
}

/// Segments lent to a receiver that reads them late are not taken back:
/// the sender, short of budget, waits longer than `segment_timeout` while
/// the receiver is slow, and every tensor still arrives bit-exact (they
/// used to expire after the timeout, and the receiver then failed on a
/// segment that "never arrived"). A segment whose frame the receiver
/// drops unread (the call refused) comes back to the sender at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_loses_no_segment_and_an_unread_one_comes_back() {
    let service = Slow::default();
    let (pause, refuse, got) = (service.pause_ms.clone(), service.refuse.clone(), service.got.clone());
    let mut scfg = ServerConfig::default();
    scfg.transport.shm.segment_timeout = Duration::from_secs(2);
    let (server, _dir) = start(tensorwire::Server::builder().config(scfg).service(service), "shm").await;
    let mut cfg = tensorwire::ClientConfig::default();
    cfg.transport.shm.segment_timeout = Duration::from_millis(100);
    cfg.transport.shm.max_in_flight = 1 << 20;
    let client = Client::connect_with(&server.url(), cfg).await.unwrap();
    let tensor = |i| random_tensor(DType::UInt8, &[1 << 20], i).unwrap();
    // A few quick sends of the size put a segment in the sender's pool
    // (one is made after a repeated miss).
    for i in 0..6 {
        client.send(vec![tensor(i)]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Now slow: the first tensor takes the pooled segment (the whole
    // budget), the second waits for budget past the segment timeout.
    pause.store(300, std::sync::atomic::Ordering::Relaxed);
    let sent: Vec<Tensor> = (10..14).map(tensor).collect();
    let s = client.send(sent.clone()).await.unwrap();
    assert_eq!(s.received, 4);
    {
        let got = got.lock().unwrap();
        for (a, b) in sent.iter().zip(got[6..].iter()) {
            assert_same(a, b);
        }
        // What this tests: the tensors arrived in the sender's segment.
        assert!(got[6..].iter().any(in_a_segment), "no tensor came through a segment");
    }
    // Refused unread, twice: the segment (the whole budget) each refused
    // tensor went in is reported released, so the next send gets budget
    // (it would wait forever otherwise: a frame that left never expires).
    pause.store(0, std::sync::atomic::Ordering::Relaxed);
    for i in 20..22 {
        refuse.store(true, std::sync::atomic::Ordering::Relaxed);
        let e = client.send(vec![tensor(i)]).await.unwrap_err();
        assert!(e.to_string().contains("refused unread"), "{e}");
        refuse.store(false, std::sync::atomic::Ordering::Relaxed);
        let next = tokio::time::timeout(Duration::from_secs(20), client.send(vec![tensor(i + 10)])).await;
        assert_eq!(next.expect("budget came back").unwrap().received, 1);
    }
}

/// Two tensors that each need most of the segment budget, sent in one
/// batch (the first one's small last chunk waits to leave with the
/// second's first): the first leaves before the second waits for budget,
/// so the receiver can take it and give the budget back (the second used
/// to wait for budget the first, still unsent, held, until it expired
/// after `segment_timeout`, 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_segment_tensors_never_waits_on_itself() {
    let service = Slow::default();
    let got = service.got.clone();
    let (server, _dir) = start(tensorwire::Server::builder().service(service), "shm").await;
    let mut cfg = tensorwire::ClientConfig::default();
    cfg.transport.shm.max_in_flight = 4 << 20;
    let client = Client::connect_with(&server.url(), cfg).await.unwrap();
    let n = (2 << 20) + 1024;
    let tensor = |i| random_tensor(DType::UInt8, &[n], i).unwrap();
    // Quick sends of the size put a segment in the pool (the receiver
    // drops each tensor, so its segment comes back).
    for i in 0..6 {
        client.send(vec![tensor(i)]).await.unwrap();
        got.lock().unwrap().clear();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for round in 0..3u64 {
        let sent = vec![tensor(10 + 2 * round), tensor(11 + 2 * round)];
        let s = tokio::time::timeout(Duration::from_secs(20), client.send(sent.clone())).await;
        assert_eq!(s.expect("no wait on itself").unwrap().received, 2);
        let got = std::mem::take(&mut *got.lock().unwrap());
        assert_same(&sent[0], &got[0]);
        assert_same(&sent[1], &got[1]);
        if round == 2 {
            assert!(got.iter().any(in_a_segment), "no tensor came through a segment");
        }
    }
}

/// Tensors a peer sent in segments just before it closed its connection
/// arrive whole: the peer's side channel ends first, but its segments stay
/// mapped here, and a TAKEN that can no longer be reported does not fail
/// the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_sent_in_segments_just_before_a_close_arrive() {
    let (url, _dir) = listen_url("shm");
    let ep = transports::Endpoint::parse(&url).unwrap();
    let cfg = transports::TransportConfig::default();
    let mut listener = transports::listen(&ep, &cfg).await.unwrap();
    let ep = listener.local_endpoint();
    let (client, server) = tokio::join!(transports::connect(&ep, &cfg), listener.accept());
    let (client, server) = (client.unwrap(), server.unwrap());
    let (mut ctx, mut crx) = client.open(StreamKind::Fetch).await.unwrap();
    ctx.send(Frame::header_only(FrameHeader::new(Kind::Request(Box::default())))).await.unwrap();
    let inc = server.accept().await.unwrap();
    let (mut stx, mut srx) = (inc.send, inc.recv);
    assert!(srx.recv().await.unwrap().is_some());
    let n = 1usize << 20;
    let info = v1::TensorInfo { dtype: v1::Dtype::Uint8 as i32, shape: vec![n as u64], ..Default::default() };
    let payloads: Vec<bytes::Bytes> = (0..6u8).map(|i| bytes::Bytes::from(vec![i; n])).collect();
    for (i, p) in payloads.iter().enumerate() {
        let c = v1::Chunk {
            tensor_id: i as u64 + 1,
            total_bytes: n as u64,
            raw_len: n as u64,
            last: true,
            info: Some(Box::new(info.clone())),
            compression: v1::Compression::None as i32,
            ..Default::default()
        };
        stx.send(Frame { header: FrameHeader::new(Kind::Chunk(c)), payload: p.clone() }).await.unwrap();
        // (The sender makes a segment for a size after a repeated miss,
        // in the background: time for it. 6 MiB stays within the stream's
        // window whichever way the tensors go.)
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    stx.finish().await.unwrap();
    drop((stx, srx));
    server.close("done");
    drop(server);
    drop(listener);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut in_segments = 0;
    for p in &payloads {
        let r = tokio::time::timeout(Duration::from_secs(10), crx.recv()).await.expect("no hang");
        let r = r.expect("the frame arrives").expect("not the end yet");
        let Some(Kind::Chunk(c)) = &r.header.kind else { panic!("a chunk") };
        in_segments += usize::from(c.shm_segment != 0);
        let transports::Payload::Bytes(b) = r.payload else { panic!("bytes") };
        assert!(b == *p, "tensor {} changed", c.tensor_id);
    }
    assert!(in_segments > 0, "no tensor came through a segment");
}
