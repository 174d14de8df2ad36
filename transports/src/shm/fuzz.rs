//! Fuzz entry for the shared-memory side channel (feature `fuzzing`): the
//! same sans-IO code the side channel's reader and the stream's receive
//! side run ([`SideMsg::decode`], [`PeerSegments`], [`segment_claim`]),
//! driven by arbitrary bytes, with real memfds (sealed, unsealed, empty,
//! oversized) and descriptors that are not memfds at all attached to
//! messages, as a hostile peer on the same host could send them.

use std::os::fd::{FromRawFd, OwnedFd};

use prost::Message;
use tensorwire_proto::v1;

use super::segment::{Owner, PeerSegments, SegmentWriter};
use super::segment_claim;

/// Largest segment the fuzzed receiver accepts (as `ShmConfig::max_segment`).
const LIMIT: u64 = 1 << 20;
/// Records per input, at most.
const MAX_RECORDS: usize = 64;

/// Counts what the peer reports about our segments.
#[derive(Default)]
struct Counting {
    reports: std::sync::atomic::AtomicU64,
}

impl Owner for Counting {
    fn taken(&self, _id: u64) {
        self.reports.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    fn released(&self, _id: u64) {
        self.reports.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A descriptor as the fuzzer asks: 0 none, 1 a sealed segment, 2 an
/// unsealed memfd, 3 a pipe (not a memfd); sizes up to 4 MiB (some above
/// [`LIMIT`]).
fn descriptor(kind: u8, size: usize) -> Option<OwnedFd> {
    match kind % 4 {
        1 => SegmentWriter::new(size).ok().map(|w| w.fd().try_clone().ok())?,
        2 => {
            // SAFETY: valid name and flags; the new descriptor is ours.
            let fd = unsafe { libc::memfd_create(c"tensorwire-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                return None;
            }
            // SAFETY: memfd_create returned a new descriptor that we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: ftruncate on our own descriptor.
            unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), size as libc::off_t) };
            Some(fd)
        }
        3 => {
            let mut fds = [0; 2];
            // SAFETY: pipe2 writes two descriptors into the array.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
                return None;
            }
            // SAFETY: pipe2 returned two new descriptors that we own.
            let (r, _w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            Some(r)
        }
        _ => None,
    }
}

/// Runs one input: a sequence of records, each a tag byte and its fields.
/// - tag % 3 == 0: a side-channel message (16 bytes, or `tag >> 3` bytes
///   when tag bit 2 is set), then a descriptor kind byte and a 2-byte size;
/// - tag % 3 == 1: a frame naming segment `id` (1 byte) for `len` (4 bytes);
/// - tag % 3 == 2: a chunk header (prost, `n` bytes) with a payload length
///   byte, checked as the receive side checks shared-memory frames.
pub fn side_channel(data: &[u8]) {
    let owner = Counting::default();
    let mut peers = PeerSegments::new(LIMIT);
    let mut d = data;
    for _ in 0..MAX_RECORDS {
        let Some((&tag, rest)) = d.split_first() else { break };
        d = rest;
        match tag % 3 {
            0 => {
                let n = if tag & 4 != 0 { usize::from(tag >> 3) } else { 16 }.min(d.len());
                let (msg, rest) = d.split_at(n);
                d = rest;
                let [kind, a, b, rest @ ..] = d else { return };
                d = rest;
                let size = usize::from(u16::from_le_bytes([*a, *b])) * 64;
                let fd = descriptor(*kind, size);
                if peers.apply(&owner, msg, fd).is_err() {
                    // The side channel ends on an error; so does this run.
                    peers.clear();
                    return;
                }
            }
            1 => {
                let [id, l0, l1, l2, l3, rest @ ..] = d else { return };
                d = rest;
                let len = u64::from(u32::from_le_bytes([*l0, *l1, *l2, *l3]));
                if let Ok(Some(seg)) = peers.lookup(u64::from(*id), len) {
                    assert!(len <= seg.len() as u64, "a frame may only name bytes inside its segment");
                }
            }
            _ => {
                let [n, payload_len, rest @ ..] = d else { return };
                let n = usize::from(*n).min(rest.len());
                let (head, rest) = rest.split_at(n);
                d = rest;
                if let Ok(c) = v1::Chunk::decode(head)
                    && let Ok(Some((id, len))) = segment_claim(&c, usize::from(*payload_len))
                {
                    let _ = peers.lookup(id, len);
                }
            }
        }
        assert!(peers.len() <= super::segment::MAX_SEGMENTS);
    }
}

/// Runs one input against a shared-memory ring (the sans-IO core the
/// async halves call, [`super::ring::Producer`] and
/// [`super::ring::Consumer`], on a real memfd region of the smallest size):
/// a sequence of records, each a tag byte and its fields.
/// - tag % 6 == 0: write `n` bytes (2-byte `n`), split in two slices;
/// - 1: read up to `n` bytes (2-byte `n`);
/// - 2: the peer scribbles a control word: ring (1 bit of the next byte),
///   which word, and an 8-byte value;
/// - 3 / 4: the consumer / producer arms for sleep;
/// - 5: both check whether the other side must be woken, and the consumer
///   whether the producer announced it is busy.
///
/// Until the first scribble, every byte read must be the next byte
/// written; after one, calls may fail (as `Corrupt`) but never panic or
/// touch memory outside the region.
pub fn ring(data: &[u8]) {
    use super::ring::{MIN_RING, Region};
    use std::collections::VecDeque;
    use std::io::IoSlice;
    use std::mem::MaybeUninit;

    let Ok((region, _fd)) = Region::create(MIN_RING) else { return };
    let (p, c) = (region.producer(0), region.consumer(0));
    let mut model: VecDeque<u8> = VecDeque::new();
    let mut honest = true;
    let mut next = 0u8;
    let mut out = vec![MaybeUninit::new(0u8); 3 * MIN_RING];
    let mut d = data;
    for _ in 0..4 * MAX_RECORDS {
        let Some((&tag, rest)) = d.split_first() else { break };
        d = rest;
        match tag % 6 {
            0 | 1 => {
                let [a, b, rest @ ..] = d else { return };
                d = rest;
                let n = usize::from(u16::from_le_bytes([*a, *b])) % (3 * MIN_RING);
                if tag % 6 == 0 {
                    let bytes: Vec<u8> = (0..n).map(|i| next.wrapping_add(i as u8)).collect();
                    let (x, y) = bytes.split_at(n / 3);
                    match p.write(&[IoSlice::new(x), IoSlice::new(y)]) {
                        Ok(k) => {
                            assert!(k <= n && (!honest || model.len() + k <= MIN_RING));
                            model.extend(&bytes[..k]);
                            next = next.wrapping_add(k as u8);
                        }
                        Err(_) => assert!(!honest, "an honest ring never fails"),
                    }
                } else {
                    match c.read(&mut out[..n]) {
                        Ok(k) if honest => {
                            assert!(k <= n);
                            for b in &out[..k] {
                                // SAFETY: read() initialized the first k bytes.
                                assert_eq!(Some(unsafe { b.assume_init() }), model.pop_front(), "bytes in order");
                            }
                        }
                        Ok(k) => assert!(k <= n),
                        Err(_) => assert!(!honest, "an honest ring never fails"),
                    }
                }
            }
            2 => {
                let [sel, v @ ..] = d else { return };
                let Some(v) = v.get(..8) else { return };
                let value = u64::from_le_bytes(v.try_into().expect("8 bytes"));
                region.scribble(usize::from(sel & 1), sel >> 1, value);
                d = &d[9..];
                honest = false;
            }
            3 => drop(c.arm()),
            4 => drop(p.arm()),
            _ => {
                let _ = (p.consumer_asleep(), c.producer_asleep(), c.peer_busy());
            }
        }
    }
}
