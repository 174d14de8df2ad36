//! An emulated WAN link between two network namespaces, made without
//! `tc netem` (absent from these kernels).
//!
//! ```text
//!  netns tw<id>-a              this process (root netns)               netns tw<id>-b
//!  10.<o>.0.1 ── tun a ──tbf──► read ─ drop p ─ delay rtt/2 ─ write ──► tun b ── 10.<o>.0.2
//!             ◄─ tun a ◄─ write ─ delay rtt/2 ─ drop p ─ read ◄──tbf── tun b
//! ```
//!
//! Each namespace gets a TUN device (created here, then moved into it; the
//! file descriptor keeps working across the move). A **`tbf` qdisc** on each
//! TUN device's egress limits the rate (the kernel's token bucket, with a
//! queue of one bandwidth-delay product, so the bottleneck drops like a real
//! router's). A **userspace relay** (two threads per direction) reads each
//! IP packet from one device, drops it with probability `loss`, and writes
//! it into the other device one-way delay (rtt/2) later.
//!
//! What it models: a fixed-rate bottleneck with a BDP-sized drop-tail queue,
//! a constant propagation delay, and independent (Bernoulli) random loss
//! in both directions (data and ACKs), for TCP and UDP alike, since the
//! relay moves IP packets. What it does **not** model: jitter and
//! reordering (delay is constant and the relay keeps packet order), bursty
//! (Gilbert–Elliott) loss, asymmetric links, MTU changes, corruption.
//! Relay scheduling adds tens of microseconds to the delay.
//!
//! Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `setns`), `ip` and `tc`
//! and `/dev/net/tun`; [`Link::up`] says why not when one is missing, and
//! callers skip with that reason. Teardown (drop) stops the relay and
//! deletes both namespaces, which deletes their devices.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::process::Command;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Rate, round-trip time and loss of an emulated link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkSpec {
    /// Bottleneck rate in bits per second.
    pub rate_bps: f64,
    /// Round-trip propagation delay (each direction gets half).
    pub rtt: Duration,
    /// Probability that a packet is dropped, each direction (0..1).
    pub loss: f64,
}

impl LinkSpec {
    /// The rate in bytes per second.
    pub fn bytes_per_sec(&self) -> f64 {
        self.rate_bps / 8.0
    }

    /// Bandwidth-delay product in bytes.
    pub fn bdp(&self) -> f64 {
        self.bytes_per_sec() * self.rtt.as_secs_f64()
    }
}

impl fmt::Display for LinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}mbit,{}ms,{}%", self.rate_bps / 1e6, self.rtt.as_secs_f64() * 1e3, self.loss * 100.0)
    }
}

impl FromStr for LinkSpec {
    type Err = String;
    /// `RATE,RTT[,LOSS]`: `100mbit,40ms,0.1%` (rate in kbit/mbit/gbit,
    /// RTT in ms or s, loss in % or as a fraction).
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let bad = |what: &str| format!("link {s:?}: {what} (expected RATE,RTT[,LOSS], e.g. 100mbit,40ms,0.1%)");
        if !(2..=3).contains(&parts.len()) {
            return Err(bad("two or three fields"));
        }
        let lower = parts[0].to_ascii_lowercase();
        let (num, mul) = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)]
            .iter()
            .find_map(|(suf, m)| lower.strip_suffix(suf).map(|n| (n, *m)))
            .ok_or_else(|| bad("rate needs a unit: kbit, mbit or gbit"))?;
        let rate_bps = num.parse::<f64>().map_err(|_| bad("rate is not a number"))? * mul;
        let rtt_s = parts[1].to_ascii_lowercase();
        let rtt = if let Some(ms) = rtt_s.strip_suffix("ms") {
            ms.parse::<f64>().map_err(|_| bad("rtt is not a number"))? / 1e3
        } else if let Some(sec) = rtt_s.strip_suffix('s') {
            sec.parse::<f64>().map_err(|_| bad("rtt is not a number"))?
        } else {
            return Err(bad("rtt needs a unit: ms or s"));
        };
        let loss = match parts.get(2) {
            None => 0.0,
            Some(l) => match l.strip_suffix('%') {
                Some(p) => p.parse::<f64>().map_err(|_| bad("loss is not a number"))? / 100.0,
                None => l.parse::<f64>().map_err(|_| bad("loss is not a number"))?,
            },
        };
        if !(rate_bps.is_finite() && rate_bps >= 1e5) {
            return Err(bad("rate below 100kbit"));
        }
        if !(rtt.is_finite() && (0.0..=10.0).contains(&rtt)) {
            return Err(bad("rtt outside 0..10 s"));
        }
        if !(0.0..0.5).contains(&loss) {
            return Err(bad("loss outside 0..50%"));
        }
        Ok(Self { rate_bps, rtt: Duration::from_secs_f64(rtt), loss })
    }
}

/// Which end of the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Namespace `a`, address `.1` (the bench's client).
    A,
    /// Namespace `b`, address `.2` (the bench's server).
    B,
}

/// Counters of the relay, per direction (index 0: a → b, 1: b → a).
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Packets relayed.
    pub packets: [AtomicU64; 2],
    /// Packets dropped by the loss model.
    pub dropped: [AtomicU64; 2],
    /// IP bytes relayed (headers included).
    pub bytes: [AtomicU64; 2],
}

impl RelayStats {
    /// IP bytes relayed from a to b so far.
    pub fn bytes_a_to_b(&self) -> u64 {
        self.bytes[0].load(Ordering::Relaxed)
    }
}

/// A running emulated link; dropping it tears everything down.
pub struct Link {
    spec: LinkSpec,
    ns: [String; 2],
    addr: [String; 2],
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    stats: Arc<RelayStats>,
}

impl fmt::Debug for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Link").field("spec", &self.spec).field("ns", &self.ns).finish_non_exhaustive()
    }
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args[0]))?;
    if !out.status.success() {
        return Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(())
}

/// Names of the network namespaces that exist now (`ip netns list`).
pub fn namespaces() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default()
}

/// Why this machine cannot run an emulated link, or None when it can.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("link emulation needs root (network namespaces, TUN devices, tc)".into());
    }
    for tool in ["ip", "tc"] {
        if Command::new(tool).arg("-V").output().is_err() {
            return Some(format!("link emulation needs the `{tool}` command (iproute2)"));
        }
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Some("link emulation needs /dev/net/tun".into());
    }
    None
}

const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Creates the TUN device `name` and returns its file (non-blocking).
fn tun(name: &str) -> Result<File, String> {
    let f = OpenOptions::new().read(true).write(true).open("/dev/net/tun").map_err(|e| format!("/dev/net/tun: {e}"))?;
    let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: IFF_TUN | IFF_NO_PI, _pad: [0; 22] };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes an ifreq, which IfReq lays out (40 bytes).
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF, &mut req) };
    if rc < 0 {
        return Err(format!("TUNSETIFF {name}: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: plain fcntl on a file descriptor we own.
    unsafe {
        let fl = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(f.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    Ok(f)
}

/// Moves the calling thread into the network namespace `ns`.
pub fn enter(ns: &str) -> std::io::Result<()> {
    let f = File::open(format!("/run/netns/{ns}"))?;
    // SAFETY: setns on an open namespace file; affects this thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Link {
    /// Sets up the link. Names are unique per process and call (namespaces
    /// `tw<k>-a`/`-b`, devices `tw<k>a`/`b`, a /32 pair in 10.0.0.0/8).
    pub fn up(spec: LinkSpec) -> Result<Link, String> {
        if let Some(why) = unavailable() {
            return Err(why);
        }
        static N: AtomicU64 = AtomicU64::new(0);
        let k = (std::process::id() as u64 * 7 + N.fetch_add(1, Ordering::Relaxed)) % 10_000;
        let tag = format!("tw{k}");
        let octet = 10 + (k % 240);
        let ns = [format!("{tag}-a"), format!("{tag}-b")];
        let dev = [format!("{tag}a"), format!("{tag}b")];
        let addr = [format!("10.{octet}.{}.1", k / 240 % 250), format!("10.{octet}.{}.2", k / 240 % 250)];
        let mut link = Link {
            spec,
            ns: ns.clone(),
            addr: addr.clone(),
            stop: Arc::new(AtomicBool::new(false)),
            threads: vec![],
            stats: Arc::default(),
        };
        // From here on, a failure drops `link`, which deletes what exists.
        for n in &ns {
            run(&["ip", "netns", "add", n])?;
        }
        let files = [tun(&dev[0])?, tun(&dev[1])?];
        // tbf: rate, a burst of at least one rate/HZ slice, a BDP of queue.
        let rate = format!("{}bit", spec.rate_bps as u64);
        let burst = format!("{}", ((spec.bytes_per_sec() / 250.0) as u64).max(16 << 10));
        let limit = format!("{}", (spec.bdp() as u64).max(64 << 10));
        for i in 0..2 {
            let (me, peer) = (&addr[i], &addr[1 - i]);
            run(&["ip", "link", "set", &dev[i], "netns", &ns[i]])?;
            run(&["ip", "-n", &ns[i], "addr", "add", me, "peer", peer, "dev", &dev[i]])?;
            run(&["ip", "-n", &ns[i], "link", "set", &dev[i], "up"])?;
            run(&["ip", "-n", &ns[i], "link", "set", "lo", "up"])?;
            run(&[
                "tc", "-n", &ns[i], "qdisc", "add", "dev", &dev[i], "root", "tbf", "rate", &rate, "burst", &burst,
                "limit", &limit,
            ])?;
        }
        let [fa, fb] = files;
        let (fa2, fb2) = (dup(&fa)?, dup(&fb)?);
        link.spawn_direction(fa, fb2, 0);
        link.spawn_direction(fb, fa2, 1);
        Ok(link)
    }

    fn spawn_direction(&mut self, from: File, to: File, dir: usize) {
        let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
        let delay = self.spec.rtt / 2;
        let loss = self.spec.loss;
        let (stop, stats) = (self.stop.clone(), self.stats.clone());
        self.threads.push(std::thread::spawn(move || read_side(from, tx, delay, loss, dir, &stop, &stats)));
        let stop = self.stop.clone();
        self.threads.push(std::thread::spawn(move || write_side(to, rx, &stop)));
    }

    /// The link's parameters.
    pub fn spec(&self) -> LinkSpec {
        self.spec
    }

    /// The namespace of `side`.
    pub fn netns(&self, side: Side) -> &str {
        &self.ns[side as usize]
    }

    /// The IPv4 address of `side`.
    pub fn addr(&self, side: Side) -> &str {
        &self.addr[side as usize]
    }

    /// Relay counters.
    pub fn stats(&self) -> &RelayStats {
        &self.stats
    }

    /// Relay counters, shareable with other threads.
    pub fn stats_arc(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Runs `f` on a new thread inside `side`'s namespace (sockets it
    /// opens live there; threads it starts inherit the namespace).
    pub fn spawn_in<T: Send + 'static>(
        &self,
        side: Side,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<std::io::Result<T>> {
        let ns = self.netns(side).to_string();
        std::thread::spawn(move || {
            enter(&ns)?;
            Ok(f())
        })
    }
}

fn dup(f: &File) -> Result<File, String> {
    // SAFETY: dup of a descriptor we own; the new one is owned by the File.
    let fd = unsafe { libc::dup(f.as_raw_fd()) };
    if fd < 0 {
        return Err(format!("dup: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor nobody else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

fn wait_readable(f: &File, ms: i32) -> bool {
    let mut p = libc::pollfd { fd: f.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

fn read_side(
    mut from: File,
    tx: std::sync::mpsc::Sender<(Instant, Vec<u8>)>,
    delay: Duration,
    loss: f64,
    dir: usize,
    stop: &AtomicBool,
    stats: &RelayStats,
) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (dir as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let threshold = (loss * u64::MAX as f64) as u64;
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
        if !wait_readable(&from, 50) {
            continue;
        }
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(_) => break, // WouldBlock: drained
            };
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x < threshold {
                stats.dropped[dir].fetch_add(1, Ordering::Relaxed);
                continue;
            }
            stats.packets[dir].fetch_add(1, Ordering::Relaxed);
            stats.bytes[dir].fetch_add(n as u64, Ordering::Relaxed);
            if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    }
}

fn write_side(mut to: File, rx: std::sync::mpsc::Receiver<(Instant, Vec<u8>)>, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let Ok((due, pkt)) = rx.recv_timeout(Duration::from_millis(50)) else { continue };
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        // A full device queue drops the packet, as a router would.
        let _ = to.write(&pkt);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for n in &self.ns {
            if namespaces().contains(n)
                && let Err(e) = run(&["ip", "netns", "del", n])
            {
                eprintln!("warning: removing network namespace {n}: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_link_specs() {
        let s: LinkSpec = "100mbit,40ms,0.1%".parse().unwrap();
        assert_eq!(s.rate_bps, 100e6);
        assert_eq!(s.rtt, Duration::from_millis(40));
        assert!((s.loss - 0.001).abs() < 1e-12);
        let s: LinkSpec = "1gbit,0.5s".parse().unwrap();
        assert_eq!((s.rate_bps, s.rtt, s.loss), (1e9, Duration::from_millis(500), 0.0));
        for bad in ["100,40ms", "100mbit", "100mbit,40", "100mbit,40ms,60%", "x,40ms"] {
            assert!(bad.parse::<LinkSpec>().is_err(), "{bad}");
        }
    }

    /// Set up, carry a TCP transfer and a UDP datagram across, tear down:
    /// no namespace is left behind. Root only (skips with the reason otherwise).
    #[test]
    fn link_carries_tcp_and_udp_and_leaves_no_namespaces() {
        if let Some(why) = unavailable() {
            eprintln!("skipping: {why}");
            return;
        }
        let before = namespaces();
        let spec: LinkSpec = "200mbit,10ms,0%".parse().unwrap();
        let link = Link::up(spec).expect("link up");
        let ns = [link.netns(Side::A).to_string(), link.netns(Side::B).to_string()];
        assert!(namespaces().contains(&ns[0]) && namespaces().contains(&ns[1]));
        let b = link.addr(Side::B).to_string();
        let server = link.spawn_in(Side::B, {
            let b = b.clone();
            move || -> std::io::Result<(Vec<u8>, Vec<u8>)> {
                let l = std::net::TcpListener::bind(format!("{b}:7900"))?;
                let u = std::net::UdpSocket::bind(format!("{b}:7901"))?;
                let (mut s, _) = l.accept()?;
                let mut got = Vec::new();
                s.read_to_end(&mut got)?;
                let mut d = [0u8; 64];
                u.set_read_timeout(Some(Duration::from_secs(5)))?;
                let n = u.recv(&mut d)?;
                Ok((got, d[..n].to_vec()))
            }
        });
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let sent = data.clone();
        let client = link.spawn_in(Side::A, move || -> std::io::Result<()> {
            let mut s = None;
            for _ in 0..50 {
                match std::net::TcpStream::connect(format!("{b}:7900")) {
                    Ok(c) => {
                        s = Some(c);
                        break;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
            let mut s = s.ok_or_else(|| std::io::Error::other("no connection"))?;
            s.write_all(&sent)?;
            drop(s);
            let u = std::net::UdpSocket::bind("0.0.0.0:0")?;
            for _ in 0..20 {
                u.send_to(b"hello", format!("{b}:7901"))?;
            }
            Ok(())
        });
        client.join().unwrap().unwrap().unwrap();
        let (got, dgram) = server.join().unwrap().unwrap().unwrap();
        assert_eq!(got, data);
        assert_eq!(dgram, b"hello");
        assert!(link.stats().packets[0].load(Ordering::Relaxed) > 600);
        assert!(link.stats().bytes_a_to_b() > 1_000_000);
        drop(link);
        let after = namespaces();
        assert!(!after.contains(&ns[0]) && !after.contains(&ns[1]), "left behind: {after:?}");
        // Other processes may add namespaces meanwhile; none of ours remains.
        assert!(
            after
                .iter()
                .filter(|n| n.starts_with("tw") && !before.contains(n))
                .all(|n| !n.starts_with(&ns[0][..ns[0].len() - 2]))
        );
    }
}
