//! Mux framing, sans-IO: the preface, the 16-byte frame head and the
//! incremental [`Decoder`] that the socket driver, the tests and the fuzz
//! target all run (the driver reads large payloads past the buffer, which
//! the decoder's two-step API allows).
//!
//! ```text
//! preface (each side, once):  "TWMX" | u16 version | u16 flags=0 | u32 stream_window | u32 max_frame_payload
//! frame:  u32 stream | u8 type | u8 flags | u16 reserved=0 | u32 meta_len | u32 value | meta | payload
//!   DATA   meta = protobuf FrameHeader (may be empty with FIN), value = payload length
//!   WINDOW value = credit increment            RESET/STOP/GOAWAY meta = UTF-8 reason, value = code
//!   PING/PONG value = opaque
//! ```
//! All integers little-endian. Client streams have odd ids, server streams even.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// First bytes of every mux connection.
pub const MAGIC: [u8; 4] = *b"TWMX";
/// The mux version this crate speaks.
pub const MUX_VERSION: u16 = 1;
/// Length of the preface.
pub const PREFACE_LEN: usize = 16;
/// The smallest stream window and largest-frame size a preface may
/// announce: below it a peer would make the other side cut tensors into
/// byte-sized frames (a denial of service on itself, paid by us).
pub const MIN_PREFACE_VALUE: u32 = 4096;
/// Length of a frame head.
pub const HEAD_LEN: usize = 16;
/// DATA flag: last frame of this direction.
pub const FLAG_FIN: u8 = 0x1;

/// Frame types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Header and payload of a logical stream.
    Data = 0,
    /// Flow-control credit for a stream.
    Window = 1,
    /// The sender abandons its direction of a stream.
    Reset = 2,
    /// The receiver asks the sender to stop.
    Stop = 3,
    /// The connection is closing.
    GoAway = 4,
    /// Liveness probe.
    Ping = 5,
    /// Answer to a probe.
    Pong = 6,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            0 => Kind::Data,
            1 => Kind::Window,
            2 => Kind::Reset,
            3 => Kind::Stop,
            4 => Kind::GoAway,
            5 => Kind::Ping,
            6 => Kind::Pong,
            _ => return None,
        })
    }
}

/// Error codes carried by RESET, STOP and GOAWAY.
pub mod code {
    /// No error (graceful close).
    pub const NO_ERROR: u32 = 0;
    /// The handle was dropped before the stream ended.
    pub const CANCELLED: u32 = 1;
    /// Too many streams are open.
    pub const REFUSED: u32 = 2;
    /// The peer broke the protocol.
    pub const PROTOCOL: u32 = 3;
    /// The peer sent more than its credit.
    pub const FLOW_CONTROL: u32 = 4;
    /// A frame above the size limits.
    pub const FRAME_SIZE: u32 = 5;
    /// The peer's preface asked for an unknown version.
    pub const VERSION: u32 = 6;
}

/// What a side announces in its preface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preface {
    /// Mux version.
    pub version: u16,
    /// Initial credit per stream the sender of this preface grants.
    pub stream_window: u32,
    /// Largest frame payload it accepts.
    pub max_frame_payload: u32,
}

/// Framing errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first bytes are not a tensorwire mux preface.
    #[error("not a tensorwire connection: bad magic {0:02x?} (expected \"TWMX\")")]
    BadMagic([u8; 4]),
    /// The peer speaks another mux version.
    #[error("unsupported mux version {0} (this side speaks {MUX_VERSION})")]
    Version(u16),
    /// The preface announces a window or frame size below [`MIN_PREFACE_VALUE`].
    #[error("the peer announces a {what} of {value} bytes, below the minimum of {MIN_PREFACE_VALUE}")]
    PrefaceTooSmall {
        /// `"stream window"` or `"largest frame payload"`.
        what: &'static str,
        /// The announced value.
        value: u32,
    },
    /// Unknown frame type.
    #[error("unknown frame type {0}")]
    UnknownKind(u8),
    /// Reserved bits set.
    #[error("reserved bits set in frame head")]
    Reserved,
    /// A frame's meta section is above the limit.
    #[error("frame header of {size} bytes exceeds the limit of {limit}")]
    MetaTooLarge {
        /// Declared size.
        size: u32,
        /// The limit.
        limit: u32,
    },
    /// A frame's payload is above the limit.
    #[error("frame payload of {size} bytes exceeds the limit of {limit}")]
    PayloadTooLarge {
        /// Declared size.
        size: u32,
        /// The limit.
        limit: u32,
    },
    /// Control frames carry no payload.
    #[error("{0:?} frame with a payload")]
    UnexpectedPayload(Kind),
}

impl Preface {
    /// Appends the preface.
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_slice(&MAGIC);
        out.put_u16_le(self.version);
        out.put_u16_le(0);
        out.put_u32_le(self.stream_window);
        out.put_u32_le(self.max_frame_payload);
    }

    /// Parses a preface; fails on bad magic or version, or a window or frame
    /// size below [`MIN_PREFACE_VALUE`].
    pub fn decode(b: &[u8; PREFACE_LEN]) -> Result<Preface, FrameError> {
        let mut s = &b[..];
        let mut magic = [0u8; 4];
        s.copy_to_slice(&mut magic);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = s.get_u16_le();
        let _flags = s.get_u16_le();
        let p = Preface { version, stream_window: s.get_u32_le(), max_frame_payload: s.get_u32_le() };
        if version != MUX_VERSION {
            return Err(FrameError::Version(version));
        }
        if p.stream_window < MIN_PREFACE_VALUE {
            return Err(FrameError::PrefaceTooSmall { what: "stream window", value: p.stream_window });
        }
        if p.max_frame_payload < MIN_PREFACE_VALUE {
            return Err(FrameError::PrefaceTooSmall { what: "largest frame payload", value: p.max_frame_payload });
        }
        Ok(p)
    }
}

/// A frame head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    /// Stream id (0: the connection).
    pub stream: u32,
    /// Type.
    pub kind: Kind,
    /// Flags ([`FLAG_FIN`]).
    pub flags: u8,
    /// Bytes of meta after the head.
    pub meta_len: u32,
    /// Payload length (DATA) or the type's value.
    pub value: u32,
}

impl Head {
    /// Appends the head.
    pub fn encode(&self, out: &mut impl BufMut) {
        // One slice, not six small writes (each a `memcpy` call into a `BytesMut`).
        let mut b = [0u8; HEAD_LEN];
        b[..4].copy_from_slice(&self.stream.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.flags;
        b[8..12].copy_from_slice(&self.meta_len.to_le_bytes());
        b[12..].copy_from_slice(&self.value.to_le_bytes());
        out.put_slice(&b);
    }

    /// Parses and checks a head against the limits (before anything is
    /// allocated for its meta or payload).
    pub fn decode(b: &[u8; HEAD_LEN], limits: &FrameLimits) -> Result<Head, FrameError> {
        let mut s = &b[..];
        let stream = s.get_u32_le();
        let kind_byte = s.get_u8();
        let kind = Kind::from_u8(kind_byte).ok_or(FrameError::UnknownKind(kind_byte))?;
        let flags = s.get_u8();
        if s.get_u16_le() != 0 || flags & !FLAG_FIN != 0 {
            return Err(FrameError::Reserved);
        }
        let meta_len = s.get_u32_le();
        let value = s.get_u32_le();
        if meta_len > limits.max_meta {
            return Err(FrameError::MetaTooLarge { size: meta_len, limit: limits.max_meta });
        }
        if kind == Kind::Data && value > limits.max_payload {
            return Err(FrameError::PayloadTooLarge { size: value, limit: limits.max_payload });
        }
        Ok(Head { stream, kind, flags, meta_len, value })
    }

    /// Payload bytes that follow the meta.
    pub fn payload_len(&self) -> u32 {
        if self.kind == Kind::Data { self.value } else { 0 }
    }

    /// True when the FIN flag is set.
    pub fn fin(&self) -> bool {
        self.flags & FLAG_FIN != 0
    }
}

/// Size limits applied to incoming frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest meta section.
    pub max_meta: u32,
    /// Largest DATA payload.
    pub max_payload: u32,
}

/// A frame's head and meta, from [`Decoder::decode_head`]; its payload
/// ([`Head::payload_len`] bytes) follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameStart {
    /// The head.
    pub head: Head,
    /// The meta bytes.
    pub meta: Bytes,
}

/// A whole frame from [`Decoder::decode`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFrame {
    /// The head.
    pub head: Head,
    /// The meta bytes.
    pub meta: Bytes,
    /// The payload bytes.
    pub payload: Bytes,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Waiting for a head.
    Head,
    /// Head decoded, waiting for its meta.
    Meta(Head),
    /// Head and meta handed out; this many payload bytes still follow.
    Payload(usize),
}

/// Incremental decoder, sans-IO (the tokio-util `Decoder` pattern): the
/// caller appends bytes from its source to a buffer and asks for frames.
///
/// The socket driver (`mux::reader`) and the tests and fuzz target run
/// this same code. It works in two steps so large payloads need not pass
/// through the buffer:
///
/// 1. [`decode_head`](Self::decode_head) checks the head against the
///    [`FrameLimits`] (before anything is allocated) and returns it with its
///    meta;
/// 2. the payload ([`payload_remaining`](Self::payload_remaining) bytes)
///    is then taken from the buffer with
///    [`take_payload`](Self::take_payload), or read by the caller straight
///    into its destination and accounted with
///    [`payload_read`](Self::payload_read). Payload bytes not taken are
///    skipped by the next `decode_head`.
///
/// [`decode`](Self::decode) does both steps for callers that want whole
/// frames.
#[derive(Debug)]
pub struct Decoder {
    limits: FrameLimits,
    state: State,
    /// The frame [`decode`](Self::decode) is collecting the payload of.
    pending: Option<FrameStart>,
}

impl Decoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: FrameLimits) -> Self {
        Self { limits, state: State::Head, pending: None }
    }

    /// Takes the next frame's head and meta from the front of `buf`, first
    /// skipping what is left of the previous frame's payload. None: more
    /// bytes are needed (room for the meta is reserved in `buf`). Errors
    /// are final.
    pub fn decode_head(&mut self, buf: &mut BytesMut) -> Result<Option<FrameStart>, FrameError> {
        loop {
            match self.state {
                State::Payload(left) => {
                    let k = left.min(buf.len());
                    buf.advance(k);
                    self.state = if k == left { State::Head } else { State::Payload(left - k) };
                    if k < left {
                        return Ok(None);
                    }
                }
                State::Head => {
                    let Some(b) = buf.first_chunk::<HEAD_LEN>() else { return Ok(None) };
                    let head = Head::decode(b, &self.limits)?;
                    buf.advance(HEAD_LEN);
                    self.state = State::Meta(head);
                }
                State::Meta(head) => {
                    let meta_len = head.meta_len as usize;
                    if buf.len() < meta_len {
                        buf.reserve(meta_len - buf.len());
                        return Ok(None);
                    }
                    let meta = buf.split_to(meta_len).freeze();
                    let payload = head.payload_len() as usize;
                    self.state = if payload > 0 { State::Payload(payload) } else { State::Head };
                    return Ok(Some(FrameStart { head, meta }));
                }
            }
        }
    }

    /// Payload bytes of the current frame not yet taken or read.
    pub fn payload_remaining(&self) -> usize {
        match self.state {
            State::Payload(left) => left,
            _ => 0,
        }
    }

    /// True between frames: no head, meta or payload is partly decoded (a
    /// clean place for the source to end).
    pub fn at_frame_boundary(&self) -> bool {
        self.state == State::Head && self.pending.is_none()
    }

    /// Takes as much of the current payload as `buf` holds (without
    /// copying: it is split off `buf`).
    pub fn take_payload(&mut self, buf: &mut BytesMut) -> Bytes {
        let k = self.payload_remaining().min(buf.len());
        self.payload_read(k);
        buf.split_to(k).freeze()
    }

    /// Accounts for `n` payload bytes the caller read from its source
    /// itself, past the buffer.
    ///
    /// # Panics
    /// If `n` is more than [`payload_remaining`](Self::payload_remaining).
    pub fn payload_read(&mut self, n: usize) {
        let left = self.payload_remaining();
        assert!(n <= left, "{n} payload bytes read with {left} left in the frame");
        if n > 0 {
            self.state = if n == left { State::Head } else { State::Payload(left - n) };
        }
    }

    /// Takes the next complete frame from the front of `buf`, or returns
    /// None when more bytes are needed: [`decode_head`](Self::decode_head)
    /// then [`take_payload`](Self::take_payload) once the whole payload is
    /// buffered. Errors are final. Do not mix with the two-step calls
    /// within a frame.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<RawFrame>, FrameError> {
        if self.pending.is_none() {
            match self.decode_head(buf)? {
                Some(start) => self.pending = Some(start),
                None => return Ok(None),
            }
        }
        let need = self.payload_remaining();
        if buf.len() < need {
            buf.reserve(need - buf.len());
            return Ok(None);
        }
        let FrameStart { head, meta } = self.pending.take().expect("set above");
        let payload = self.take_payload(buf);
        Ok(Some(RawFrame { head, meta, payload }))
    }
}

/// Encodes a whole frame (tests and tools; the driver writes vectored).
pub fn encode_frame(head: &Head, meta: &[u8], payload: &[u8], out: &mut BytesMut) {
    head.encode(out);
    out.put_slice(meta);
    out.put_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: FrameLimits = FrameLimits { max_meta: 1 << 16, max_payload: 1 << 20 };

    fn frames() -> Vec<(Head, Vec<u8>, Vec<u8>)> {
        vec![
            (Head { stream: 1, kind: Kind::Data, flags: 0, meta_len: 3, value: 5 }, vec![1, 2, 3], vec![9; 5]),
            (Head { stream: 1, kind: Kind::Data, flags: FLAG_FIN, meta_len: 0, value: 0 }, vec![], vec![]),
            (Head { stream: 2, kind: Kind::Window, flags: 0, meta_len: 0, value: 1 << 20 }, vec![], vec![]),
            (Head { stream: 3, kind: Kind::Reset, flags: 0, meta_len: 4, value: 7 }, b"oops".to_vec(), vec![]),
            (
                Head { stream: 5, kind: Kind::Data, flags: FLAG_FIN, meta_len: 2, value: 70_000 },
                vec![0; 2],
                vec![3; 70_000],
            ),
        ]
    }

    #[test]
    fn split_at_every_byte_boundary() {
        let mut wire = BytesMut::new();
        for (h, m, p) in frames() {
            encode_frame(&h, &m, &p, &mut wire);
        }
        let wire = wire.freeze();
        // Feed one split point at a time: the decoder must reassemble the same frames.
        for split in 0..wire.len() {
            let mut dec = Decoder::new(LIMITS);
            let mut buf = BytesMut::new();
            let mut got = vec![];
            for part in [&wire[..split], &wire[split..]] {
                buf.extend_from_slice(part);
                while let Some(f) = dec.decode(&mut buf).unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(got.len(), frames().len(), "split at {split}");
            for (f, (h, m, p)) in got.iter().zip(frames()) {
                assert_eq!((f.head, f.meta.as_ref(), f.payload.as_ref()), (h, &m[..], &p[..]));
            }
        }
        // And byte by byte.
        let mut dec = Decoder::new(LIMITS);
        let mut buf = BytesMut::new();
        let mut n = 0;
        for b in wire.iter() {
            buf.put_u8(*b);
            while dec.decode(&mut buf).unwrap().is_some() {
                n += 1;
            }
        }
        assert_eq!(n, frames().len());
    }

    /// What the socket driver does: heads from the buffer, payloads partly
    /// from the buffer and the rest read "from the socket" past it, or
    /// skipped. `how` picks, per frame, take (0), read past the buffer (1)
    /// or skip (2).
    fn drive(wire: &[u8], chunk: usize, how: &[u8]) -> Vec<(Head, Vec<u8>, Option<Vec<u8>>)> {
        let mut dec = Decoder::new(LIMITS);
        let mut buf = BytesMut::new();
        let mut src = wire;
        let mut got = vec![];
        let feed = |buf: &mut BytesMut, src: &mut &[u8]| {
            let k = chunk.min(src.len());
            buf.extend_from_slice(&src[..k]);
            *src = &src[k..];
            k > 0
        };
        loop {
            let start = loop {
                match dec.decode_head(&mut buf).unwrap() {
                    Some(s) => break Some(s),
                    None if !feed(&mut buf, &mut src) => break None,
                    None => {}
                }
            };
            let Some(FrameStart { head, meta }) = start else { break };
            let payload = match how.get(got.len()).copied().unwrap_or(0) % 3 {
                0 => {
                    let mut p = vec![];
                    while dec.payload_remaining() > 0 {
                        if buf.is_empty() {
                            assert!(feed(&mut buf, &mut src));
                        }
                        p.extend_from_slice(&dec.take_payload(&mut buf));
                    }
                    Some(p)
                }
                1 => {
                    let mut p = dec.take_payload(&mut buf).to_vec();
                    let rest = dec.payload_remaining();
                    p.extend_from_slice(&src[..rest]);
                    src = &src[rest..];
                    dec.payload_read(rest);
                    Some(p)
                }
                _ => None,
            };
            got.push((head, meta.to_vec(), payload));
        }
        assert!(dec.at_frame_boundary() && buf.is_empty() && src.is_empty());
        got
    }

    #[test]
    fn payloads_taken_read_past_the_buffer_or_skipped() {
        let mut wire = BytesMut::new();
        for (h, m, p) in frames() {
            encode_frame(&h, &m, &p, &mut wire);
        }
        for chunk in [1, 7, 16, 17, 1000, 1 << 20] {
            for how in [[0u8; 5], [1; 5], [2; 5], [0, 1, 2, 0, 1], [2, 2, 1, 0, 2]] {
                let got = drive(&wire, chunk, &how);
                assert_eq!(got.len(), frames().len());
                for (i, ((h, m, p), (eh, em, ep))) in got.into_iter().zip(frames()).enumerate() {
                    assert_eq!((h, m), (eh, em), "chunk {chunk} how {how:?}");
                    if how[i] % 3 != 2 {
                        assert_eq!(p.unwrap(), ep, "chunk {chunk} how {how:?}");
                    }
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "payload bytes read")]
    fn reading_past_the_payload_is_a_caller_bug() {
        let mut dec = Decoder::new(LIMITS);
        let mut buf = BytesMut::new();
        encode_frame(&Head { stream: 1, kind: Kind::Data, flags: 0, meta_len: 1, value: 4 }, &[1], &[0; 4], &mut buf);
        buf.truncate(HEAD_LEN + 1);
        dec.decode_head(&mut buf).unwrap().unwrap();
        dec.payload_read(5);
    }

    #[test]
    fn limits_are_checked_before_allocation() {
        let mut buf = BytesMut::new();
        Head { stream: 1, kind: Kind::Data, flags: 0, meta_len: 0, value: u32::MAX }.encode(&mut buf);
        assert_eq!(
            Decoder::new(LIMITS).decode(&mut buf).unwrap_err(),
            FrameError::PayloadTooLarge { size: u32::MAX, limit: 1 << 20 }
        );
        let mut buf = BytesMut::new();
        Head { stream: 1, kind: Kind::Data, flags: 0, meta_len: u32::MAX, value: 0 }.encode(&mut buf);
        assert!(matches!(Decoder::new(LIMITS).decode(&mut buf), Err(FrameError::MetaTooLarge { .. })));
        let mut buf = BytesMut::from(&[0u8, 0, 0, 0, 99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]);
        assert_eq!(Decoder::new(LIMITS).decode(&mut buf).unwrap_err(), FrameError::UnknownKind(99));
        let mut buf = BytesMut::from(&[0u8, 0, 0, 0, 0, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]);
        assert_eq!(Decoder::new(LIMITS).decode(&mut buf).unwrap_err(), FrameError::Reserved);
    }

    #[test]
    fn preface() {
        let mut b = BytesMut::new();
        Preface { version: MUX_VERSION, stream_window: 12345, max_frame_payload: 4567 }.encode(&mut b);
        let arr: [u8; PREFACE_LEN] = b[..].try_into().unwrap();
        assert_eq!(Preface::decode(&arr).unwrap().stream_window, 12345);
        let mut bad = arr;
        bad[4] = 9;
        assert_eq!(Preface::decode(&bad).unwrap_err(), FrameError::Version(9));
        assert!(matches!(Preface::decode(b"GET / HTTP/1.1\r\n"), Err(FrameError::BadMagic(_))));
        // A peer asking for byte-sized frames or windows is refused.
        for (w, p, what) in [(1, 1 << 20, "stream window"), (1 << 20, 63, "largest frame payload")] {
            let mut b = BytesMut::new();
            Preface { version: MUX_VERSION, stream_window: w, max_frame_payload: p }.encode(&mut b);
            let e = Preface::decode(&b[..].try_into().unwrap()).unwrap_err();
            assert!(matches!(e, FrameError::PrefaceTooSmall { what: got, .. } if got == what), "{e}");
        }
    }

    proptest! {
        #[test]
        fn heads_round_trip(stream: u32, kind in 0u8..7, fin: bool, meta_len in 0u32..=(1 << 16), value: u32) {
            let kind = Kind::from_u8(kind).unwrap();
            let value = if kind == Kind::Data { value % (1 << 20) } else { value };
            let h = Head { stream, kind, flags: if fin { FLAG_FIN } else { 0 }, meta_len, value };
            let mut b = BytesMut::new();
            h.encode(&mut b);
            let arr: [u8; HEAD_LEN] = b[..].try_into().unwrap();
            prop_assert_eq!(Head::decode(&arr, &LIMITS).unwrap(), h);
        }

        #[test]
        fn every_way_of_reading_gives_the_same_frames(chunk in 1usize..300, how in proptest::collection::vec(0u8..3, 5)) {
            let mut wire = BytesMut::new();
            for (h, m, p) in frames() {
                encode_frame(&h, &m, &p, &mut wire);
            }
            let got = drive(&wire, chunk, &how);
            prop_assert_eq!(got.len(), frames().len());
            for (i, ((h, m, p), (eh, em, ep))) in got.into_iter().zip(frames()).enumerate() {
                prop_assert_eq!((h, m), (eh, em));
                if how[i] != 2 {
                    prop_assert_eq!(p.unwrap(), ep);
                }
            }
        }

        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut dec = Decoder::new(LIMITS);
            let mut buf = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = dec.decode(&mut buf) {}
            // And the two-step calls the socket driver makes, taking half of each payload.
            let mut dec = Decoder::new(LIMITS);
            let mut buf = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = dec.decode_head(&mut buf) {
                let half = dec.payload_remaining().min(buf.len()) / 2;
                buf.advance(half);
                dec.payload_read(half);
                dec.take_payload(&mut buf);
            }
        }
    }
}
