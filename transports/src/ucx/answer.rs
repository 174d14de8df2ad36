//! The grant message of `ucx://` puts (see the `grant` module): what a
//! receiver answers to a chunk that asked for memory. Sans-IO, and compiled
//! for the fuzz targets too (which build without libucx).

const VERSION: u8 = 1;
const HEADER: usize = 1 + 1 + 8 + 8 + 8 + 4;

/// What the receiver answers to a chunk that asked for a grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Put the rest of the tensor at `addr + offset` through `rkey`.
    Grant(Grant),
    /// Send the rest by tag, as usual.
    Refused,
}

/// Memory the receiver lends for the rest of one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Grant {
    /// Names the region for the sender's key cache (never reused in the
    /// receiving process).
    pub region: u64,
    /// The tensor's byte 0 in the receiver's address space.
    pub addr: u64,
    /// Bytes granted from `addr` (the tensor's payload length).
    pub len: u64,
    /// The region's packed remote key.
    pub rkey: Vec<u8>,
}

impl Answer {
    /// The message bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HEADER + 64);
        v.push(VERSION);
        match self {
            Answer::Refused => {
                v.push(0);
                v.resize(HEADER, 0);
            }
            Answer::Grant(g) => {
                v.push(1);
                v.extend_from_slice(&g.region.to_le_bytes());
                v.extend_from_slice(&g.addr.to_le_bytes());
                v.extend_from_slice(&g.len.to_le_bytes());
                v.extend_from_slice(&(g.rkey.len() as u32).to_le_bytes());
                v.extend_from_slice(&g.rkey);
            }
        }
        v
    }

    /// Parses an answer for a tensor of `tensor_len` payload bytes: a grant
    /// must cover exactly that many, carry a key, and not wrap the address
    /// space.
    pub(crate) fn decode(b: &[u8], tensor_len: u64) -> Result<Answer, String> {
        if b.len() < HEADER || b[0] != VERSION {
            return Err(format!("a UCX grant of {} bytes (version {:?}) is malformed", b.len(), b.first()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        match b[1] {
            0 => return Ok(Answer::Refused),
            1 => {}
            k => return Err(format!("a UCX grant of unknown kind {k}")),
        }
        let (region, addr, len) = (u64_at(2), u64_at(10), u64_at(18));
        let klen = u32::from_le_bytes(b[26..30].try_into().expect("4 bytes")) as usize;
        if b.len() != HEADER + klen || klen == 0 {
            return Err(format!("a UCX grant declares a {klen}-byte key in {} bytes", b.len()));
        }
        if len != tensor_len {
            return Err(format!("the peer granted {len} bytes for a tensor of {tensor_len}"));
        }
        if addr.checked_add(len).is_none() {
            return Err(format!("a UCX grant at {addr:#x} + {len} wraps the address space"));
        }
        Ok(Answer::Grant(Grant { region, addr, len, rkey: b[HEADER..].to_vec() }))
    }
}

/// Fuzz entry point: the first 8 bytes are the tensor's length, the rest
/// an answer from the peer. Whatever decodes re-encodes to the same answer
/// and a grant always fits the tensor and the address space.
#[cfg(feature = "fuzzing")]
pub fn fuzz(data: &[u8]) {
    let (len, msg) = match data.split_first_chunk::<8>() {
        Some((l, m)) => (u64::from_le_bytes(*l), m),
        None => (0, data),
    };
    if let Ok(a) = Answer::decode(msg, len) {
        assert_eq!(Answer::decode(&a.encode(), len).as_ref(), Ok(&a));
        if let Answer::Grant(g) = &a {
            assert!(g.len == len && g.addr.checked_add(g.len).is_some() && !g.rkey.is_empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip_and_lies_are_refused() {
        let g = Grant { region: 7, addr: 0x7f00_0000_0000, len: 1 << 20, rkey: vec![1, 2, 3] };
        let b = Answer::Grant(g.clone()).encode();
        assert_eq!(Answer::decode(&b, 1 << 20).unwrap(), Answer::Grant(g.clone()));
        assert_eq!(Answer::decode(&Answer::Refused.encode(), 5).unwrap(), Answer::Refused);
        // The wrong size for the tensor, a key longer than the message, no
        // key, an address range that wraps, a truncated or unknown message.
        assert!(Answer::decode(&b, 1 << 21).unwrap_err().contains("granted 1048576 bytes for a tensor of 2097152"));
        let mut long = b.clone();
        long[26] = 200;
        assert!(Answer::decode(&long, 1 << 20).is_err());
        let nokey = Answer::Grant(Grant { rkey: vec![], ..g.clone() }).encode();
        assert!(Answer::decode(&nokey, 1 << 20).is_err());
        let wrap = Answer::Grant(Grant { addr: u64::MAX - 10, ..g.clone() }).encode();
        assert!(Answer::decode(&wrap, 1 << 20).unwrap_err().contains("wraps"));
        assert!(Answer::decode(&b[..10], 1 << 20).is_err());
        let mut kind = b.clone();
        kind[1] = 9;
        assert!(Answer::decode(&kind, 1 << 20).is_err());
        let mut version = b;
        version[0] = 2;
        assert!(Answer::decode(&version, 1 << 20).is_err());
    }
}
