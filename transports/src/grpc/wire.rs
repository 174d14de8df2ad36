//! gRPC messages of `tensorwire.v1.Frame` on the wire, encoded and decoded
//! here instead of by tonic's codec (sans-IO: bytes in, messages out).
//!
//! Why: tonic encodes every message into one buffer (copying a chunk's
//! payload into it) and decodes by appending each HTTP/2 DATA frame to a
//! buffer (copying it again) before prost slices the payload out. Here the
//! sender hands the payload to HTTP/2 as its own [`Bytes`] after a small
//! head (the 5-byte gRPC prefix, the header field, the payload field's key
//! and length), and the receiver keeps a message as the DATA frames' own
//! bytes ([`Pieces`]), which the stream copies once, straight into the
//! tensor's buffer when it has one. Same messages on the wire: tonic,
//! grpcio and every other gRPC peer read and write them as before.
//!
//! ```text
//!   0x00 | len: u32 BE | 0x0A varint(h) FrameHeader(h bytes) | 0x12 varint(p) payload(p bytes)
//!   ^ uncompressed       ^ field 1 (header)                   ^ field 2 (payload): its own Bytes
//! ```

use std::collections::VecDeque;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use tensorwire_proto::v1;

/// The gRPC message prefix: a compression flag and a big-endian length.
const PREFIX: usize = 5;
/// Protobuf keys of `Frame`'s fields: 1 (`header`) and 2 (`payload`),
/// both length-delimited.
const KEY_HEADER: u8 = 0x0A;
const KEY_PAYLOAD: u8 = 0x12;

/// Why a message could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WireError {
    /// The message is longer than the limit.
    TooLarge { size: u64, limit: usize },
    /// The message's frame header is longer than the limit.
    HeaderTooLarge { size: u64, limit: usize },
    /// A compressed message (or an unknown prefix flag): tensorwire's gRPC
    /// service does not negotiate gRPC compression (codecs compress chunks).
    Compressed(u8),
    /// The message is not a valid `Frame`.
    Malformed(String),
    /// The stream ended inside a message.
    Truncated { have: usize, need: usize },
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::TooLarge { size, limit } => {
                write!(f, "gRPC message of {size} bytes exceeds the limit of {limit} bytes")
            }
            WireError::HeaderTooLarge { size, limit } => {
                write!(f, "frame header of {size} bytes exceeds the limit of {limit} bytes")
            }
            WireError::Compressed(flag) => write!(
                f,
                "gRPC message with compression flag {flag}: this service takes uncompressed messages (tensorwire compresses chunks itself)"
            ),
            WireError::Malformed(why) => write!(f, "malformed tensorwire.v1.Frame message: {why}"),
            WireError::Truncated { have, need } => {
                write!(f, "the gRPC stream ended inside a message ({have} of {need} bytes)")
            }
        }
    }
}

/// One frame as a gRPC message: a small head (prefix, header, the payload
/// field's key and length) and the payload itself, untouched.
pub(crate) fn encode(frame: &v1::Frame, limit: usize) -> Result<(Bytes, Bytes), WireError> {
    let header = frame.header.as_ref().map(|h| (h, tensorwire_proto::header::encoded_len(h)));
    let p = frame.payload.len();
    let header_field = header.map_or(0, |(_, n)| 1 + prost::length_delimiter_len(n) + n);
    let payload_field = if p == 0 { 0 } else { 1 + prost::length_delimiter_len(p) + p };
    let total = header_field + payload_field;
    if total > limit || total > u32::MAX as usize {
        return Err(WireError::TooLarge { size: total as u64, limit });
    }
    let mut head = BytesMut::with_capacity(PREFIX + header_field + 11);
    head.put_u8(0);
    head.put_u32(total as u32);
    if let Some((h, n)) = header {
        head.put_u8(KEY_HEADER);
        prost::encode_length_delimiter(n, &mut head).map_err(|e| WireError::Malformed(e.to_string()))?;
        tensorwire_proto::header::encode(h, &mut head);
    }
    if p > 0 {
        head.put_u8(KEY_PAYLOAD);
        prost::encode_length_delimiter(p, &mut head).map_err(|e| WireError::Malformed(e.to_string()))?;
    }
    Ok((head.freeze(), frame.payload.clone()))
}

/// A payload as the received DATA frames' own bytes (slices, no copy).
#[derive(Debug, Default, Clone)]
pub(crate) struct Pieces(Vec<Bytes>);

impl Pieces {
    /// Total length.
    pub(crate) fn len(&self) -> usize {
        self.0.iter().map(Bytes::len).sum()
    }

    /// One contiguous `Bytes`: free when the payload arrived in one DATA
    /// frame, else one copy.
    pub(crate) fn into_bytes(self) -> Bytes {
        match self.0.len() {
            0 => Bytes::new(),
            1 => self.0.into_iter().next().unwrap_or_default(),
            _ => {
                let mut b = BytesMut::with_capacity(self.len());
                for p in &self.0 {
                    b.extend_from_slice(p);
                }
                b.freeze()
            }
        }
    }

    /// Copies the payload into `dst`, which must be exactly as long.
    pub(crate) fn copy_to(&self, dst: &mut [u8]) {
        let mut at = 0;
        for p in &self.0 {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
    }
}

/// A decoded message: the frame's header and its payload.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub(crate) header: Option<v1::FrameHeader>,
    pub(crate) payload: Pieces,
}

/// DATA frames a message is kept in before they are copied into one
/// buffer: a peer splitting messages into tiny frames cannot make the
/// receiver hold a `Bytes` handle (32 bytes, and the frame's buffer) per
/// byte. Messages sent in 1 MiB frames stay well below it.
const MAX_PIECES: usize = 64;

/// The sizes a [`Decoder`] accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Largest message (after its 5-byte prefix).
    pub(crate) message: usize,
    /// Largest `header` field (summed over its occurrences: protobuf
    /// merges repeated fields, so a peer could otherwise send many).
    pub(crate) header: usize,
}

/// Splits a stream of DATA frames into messages, one at a time: the
/// caller [`push`](Self::push)es a frame, then takes messages with
/// [`next`](Self::next) until it returns `None`, then pushes the next
/// frame. No message is decoded before the caller asks for it: the decoder
/// holds the unread bytes of the frames pushed and the message being
/// collected, so a frame packed with empty 5-byte messages costs no more
/// memory than the frame itself.
#[derive(Debug)]
pub(crate) struct Decoder {
    limits: Limits,
    prefix: [u8; PREFIX],
    have_prefix: usize,
    /// Length of the message being collected (after its prefix).
    need: Option<usize>,
    pieces: Vec<Bytes>,
    /// The message so far, copied, once it came in more than
    /// [`MAX_PIECES`] frames.
    merged: Option<BytesMut>,
    got: usize,
    /// What [`next`](Self::next) has not read yet of the pushed frames.
    unread: Bytes,
    /// The last of `pieces` is a view of a pushed frame (not yet detached).
    viewed: bool,
}

impl Decoder {
    /// A decoder refusing messages over `limits`.
    pub(crate) fn new(limits: Limits) -> Self {
        Self {
            limits,
            prefix: [0; PREFIX],
            have_prefix: 0,
            need: None,
            pieces: Vec::new(),
            merged: None,
            got: 0,
            unread: Bytes::new(),
            viewed: false,
        }
    }

    /// Copies what the decoder keeps of the frame pushed last into memory
    /// of its own. A frame's bytes are a view of the connection's read
    /// buffer, so a piece of a few bytes kept for an unfinished message can
    /// keep a buffer of a megabyte alive; call this when
    /// [`next`](Self::next) returned `None` (the frames are then held until
    /// more come), so what the decoder holds is what [`held`](Self::held)
    /// counts. Pieces of earlier frames were detached already.
    pub(crate) fn detach(&mut self) {
        if self.viewed
            && let Some(last) = self.pieces.last_mut()
        {
            *last = Bytes::copy_from_slice(last);
        }
        self.viewed = false;
    }

    /// Adds a DATA frame after what is unread (normally nothing: callers
    /// push once [`next`](Self::next) returned `None`).
    pub(crate) fn push(&mut self, data: Bytes) {
        if self.unread.is_empty() {
            self.unread = data;
        } else if !data.is_empty() {
            let mut b = BytesMut::with_capacity(self.unread.len() + data.len());
            b.extend_from_slice(&self.unread);
            b.extend_from_slice(&data);
            self.unread = b.freeze();
        }
    }

    /// The next complete message, or `None` when the pushed frames hold
    /// no further complete message (all of it has then been read).
    pub(crate) fn next(&mut self) -> Result<Option<Decoded>, WireError> {
        loop {
            let Some(need) = self.need else {
                if self.unread.is_empty() {
                    return Ok(None);
                }
                let n = (PREFIX - self.have_prefix).min(self.unread.len());
                self.prefix[self.have_prefix..self.have_prefix + n].copy_from_slice(&self.unread[..n]);
                self.have_prefix += n;
                let _ = self.unread.split_to(n);
                if self.have_prefix == PREFIX {
                    if self.prefix[0] != 0 {
                        return Err(WireError::Compressed(self.prefix[0]));
                    }
                    let len = u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]);
                    if len as u64 > self.limits.message as u64 {
                        return Err(WireError::TooLarge { size: len as u64, limit: self.limits.message });
                    }
                    self.need = Some(len as usize);
                    self.have_prefix = 0;
                }
                continue;
            };
            if self.got == need {
                let pieces = match self.merged.take() {
                    Some(m) => vec![m.freeze()],
                    None => std::mem::take(&mut self.pieces),
                };
                self.viewed = false;
                self.need = None;
                self.got = 0;
                return parse(pieces, need, self.limits.header).map(Some);
            }
            if self.unread.is_empty() {
                return Ok(None);
            }
            let n = (need - self.got).min(self.unread.len());
            let piece = self.unread.split_to(n);
            if let Some(m) = &mut self.merged {
                if m.capacity() - m.len() < piece.len() {
                    // Doubling, but never past the message's length.
                    let mut grown = BytesMut::with_capacity((m.len() * 2).max(m.len() + piece.len()).min(need));
                    grown.extend_from_slice(m);
                    *m = grown;
                }
                m.extend_from_slice(&piece);
            } else if self.pieces.len() < MAX_PIECES {
                self.pieces.push(piece);
                self.viewed = true;
            } else {
                // Sized by what came, not by what the peer declared (grown
                // as more comes, never past `need`, checked against the limit).
                let mut m = BytesMut::with_capacity(((self.got + piece.len()) * 2).min(need));
                for p in self.pieces.drain(..) {
                    m.extend_from_slice(&p);
                }
                self.viewed = false;
                m.extend_from_slice(&piece);
                self.merged = Some(m);
            }
            self.got += n;
        }
    }

    /// Bytes of the pushed frames not yet returned in a message: the
    /// message being collected and what is unread.
    pub(crate) fn held(&self) -> usize {
        self.have_prefix + self.got + self.unread.len()
    }

    /// The stream ended (and [`next`](Self::next) returned `None`): an
    /// error when it ended inside a message.
    pub(crate) fn finish(&self) -> Result<(), WireError> {
        match self.need {
            Some(need) => Err(WireError::Truncated { have: PREFIX + self.got, need: PREFIX + need }),
            None if self.have_prefix > 0 => Err(WireError::Truncated { have: self.have_prefix, need: PREFIX }),
            None => Ok(()),
        }
    }
}

/// Reads a message's fields across its pieces.
struct Cursor {
    pieces: VecDeque<Bytes>,
    left: usize,
}

impl Cursor {
    fn byte(&mut self) -> Result<u8, WireError> {
        while let Some(p) = self.pieces.front_mut() {
            if let Some(&b) = p.first() {
                let _ = p.split_to(1);
                self.left -= 1;
                return Ok(b);
            }
            self.pieces.pop_front();
        }
        Err(WireError::Malformed("a field runs past the end of the message".into()))
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireError::Malformed("a varint longer than 10 bytes".into()))
    }

    /// The next `n` bytes, as slices of the pieces.
    fn take(&mut self, n: u64) -> Result<Vec<Bytes>, WireError> {
        if n > self.left as u64 {
            return Err(WireError::Malformed(format!(
                "a field of {n} bytes with only {} left in the message",
                self.left
            )));
        }
        let mut n = n as usize;
        self.left -= n;
        let mut out = Vec::new();
        while n > 0 {
            let Some(p) = self.pieces.front_mut() else { break };
            let k = n.min(p.len());
            out.push(p.split_to(k));
            if p.is_empty() {
                self.pieces.pop_front();
            }
            n -= k;
        }
        Ok(out)
    }
}

/// Decodes a complete message of `len` bytes held in `pieces`, whose
/// header fields hold at most `max_header` bytes in all.
fn parse(pieces: Vec<Bytes>, len: usize, max_header: usize) -> Result<Decoded, WireError> {
    let mut c = Cursor { pieces: pieces.into(), left: len };
    let mut header: Option<v1::FrameHeader> = None;
    let mut header_bytes = 0u64;
    let mut payload = Pieces::default();
    while c.left > 0 {
        let key = c.varint()?;
        let (field, wire_type) = (key >> 3, key & 7);
        match (field, wire_type) {
            (1, 2) => {
                let n = c.varint()?;
                header_bytes = header_bytes.saturating_add(n);
                if header_bytes > max_header as u64 {
                    return Err(WireError::HeaderTooLarge { size: header_bytes, limit: max_header });
                }
                let bytes = Pieces(c.take(n)?).into_bytes();
                let h = header.get_or_insert_with(Default::default);
                h.merge(bytes).map_err(|e| WireError::Malformed(format!("header: {e}")))?;
            }
            (2, 2) => {
                let n = c.varint()?;
                payload = Pieces(c.take(n)?);
            }
            (0, _) => return Err(WireError::Malformed("field number 0".into())),
            // Unknown fields (a newer peer): skipped.
            (_, 0) => {
                c.varint()?;
            }
            (_, 1) => {
                c.take(8)?;
            }
            (_, 2) => {
                let n = c.varint()?;
                c.take(n)?;
            }
            (_, 5) => {
                c.take(4)?;
            }
            (f, w) => return Err(WireError::Malformed(format!("field {f} has wire type {w}"))),
        }
    }
    Ok(Decoded { header, payload })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire_proto::v1::frame_header::Kind;

    fn frame(payload: &[u8]) -> v1::Frame {
        let chunk = v1::Chunk { tensor_id: 7, offset: 64, raw_len: payload.len() as u64, ..Default::default() };
        v1::Frame {
            header: Some(v1::FrameHeader { kind: Some(Kind::Chunk(chunk)) }),
            payload: Bytes::copy_from_slice(payload),
        }
    }

    fn lim(message: usize) -> Limits {
        Limits { message, header: 1 << 10 }
    }

    /// Pushes `data` and takes every message it completes.
    fn feed(d: &mut Decoder, data: Bytes, out: &mut VecDeque<Decoded>) -> Result<(), WireError> {
        d.push(data);
        while let Some(m) = d.next()? {
            out.push_back(m);
        }
        Ok(())
    }

    fn wire(f: &v1::Frame) -> Vec<u8> {
        let (head, payload) = encode(f, 1 << 20).unwrap();
        [head.as_ref(), payload.as_ref()].concat()
    }

    #[test]
    fn encoding_is_what_prost_and_tonic_write() {
        for p in [&b""[..], b"x", &[7u8; 300][..]] {
            let f = frame(p);
            let body = f.encode_to_vec();
            let mut expect = vec![0u8];
            expect.extend_from_slice(&(body.len() as u32).to_be_bytes());
            expect.extend_from_slice(&body);
            assert_eq!(wire(&f), expect);
        }
    }

    #[test]
    fn decodes_across_any_split() {
        let frames = [frame(b"hello"), frame(&[1u8; 1000]), frame(b"")];
        let bytes: Vec<u8> = frames.iter().flat_map(wire).collect();
        for step in [1, 2, 5, 7, 64, 999, bytes.len()] {
            let mut d = Decoder::new(lim(1 << 20));
            let mut out = VecDeque::new();
            for piece in bytes.chunks(step) {
                feed(&mut d, Bytes::copy_from_slice(piece), &mut out).unwrap();
            }
            d.finish().unwrap();
            assert_eq!(out.len(), 3, "step {step}");
            for (got, want) in out.into_iter().zip(&frames) {
                assert_eq!(got.header.as_ref(), want.header.as_ref());
                assert_eq!(got.payload.into_bytes(), want.payload);
            }
        }
    }

    #[test]
    fn a_detached_piece_keeps_no_read_buffer_alive() {
        // The start of an unfinished message, as a view of a large read
        // buffer: once detached, the buffer is free to go.
        let msg = Bytes::from(wire(&frame(&[7; 100])));
        let mut buffer = BytesMut::zeroed(1 << 20);
        buffer[..20].copy_from_slice(&msg[..20]);
        let mut buffer = buffer.freeze();
        let mut d = Decoder::new(lim(1 << 20));
        d.push(buffer.slice(..20));
        assert!(d.next().unwrap().is_none());
        assert!(!buffer.is_unique(), "the piece is a view");
        d.detach();
        assert!(buffer.is_unique(), "the piece is a copy");
        assert_eq!(d.held(), 20 - PREFIX, "the message so far (its prefix is parsed)");
        // The rest completes the message as before.
        d.push(msg.slice(20..));
        let m = d.next().unwrap().expect("the message");
        assert_eq!(m.payload.into_bytes(), Bytes::from(vec![7u8; 100]));
        let _ = &mut buffer;
    }

    #[test]
    fn a_message_in_tiny_frames_is_held_in_a_bounded_number_of_pieces() {
        let f = frame(&[5u8; 10_000]);
        let bytes = wire(&f);
        let mut d = Decoder::new(lim(1 << 20));
        let mut out = VecDeque::new();
        for (i, b) in bytes.iter().enumerate() {
            feed(&mut d, Bytes::copy_from_slice(&[*b]), &mut out).unwrap();
            assert!(d.pieces.len() <= MAX_PIECES, "after {i} bytes");
        }
        let m = out.pop_front().unwrap();
        assert!(m.payload.0.len() <= MAX_PIECES);
        assert_eq!(m.payload.into_bytes(), f.payload);
    }

    #[test]
    fn a_payload_in_one_data_frame_is_a_slice_of_it() {
        let f = frame(&[9u8; 4096]);
        let data = Bytes::from(wire(&f));
        let mut d = Decoder::new(lim(1 << 20));
        let mut out = VecDeque::new();
        feed(&mut d, data.clone(), &mut out).unwrap();
        let got = out.pop_front().unwrap().payload.into_bytes();
        let start = data.as_ptr() as usize;
        assert!((got.as_ptr() as usize) > start && (got.as_ptr() as usize) < start + data.len());
    }

    #[test]
    fn bad_messages_are_refused() {
        let mut out = VecDeque::new();
        let mut d = Decoder::new(lim(100));
        assert_eq!(
            feed(&mut d, Bytes::from_static(&[0, 0, 0, 1, 0]), &mut out),
            Err(WireError::TooLarge { size: 256, limit: 100 })
        );
        let mut d = Decoder::new(lim(100));
        assert_eq!(feed(&mut d, Bytes::from_static(&[1, 0, 0, 0, 1, 0]), &mut out), Err(WireError::Compressed(1)));
        // A payload field longer than its message.
        let mut d = Decoder::new(lim(100));
        assert!(matches!(
            feed(&mut d, Bytes::from_static(&[0, 0, 0, 0, 2, 0x12, 9]), &mut out),
            Err(WireError::Malformed(_))
        ));
        // Field number 0, an end group wire type.
        let mut d = Decoder::new(lim(100));
        assert!(matches!(
            feed(&mut d, Bytes::from_static(&[0, 0, 0, 0, 1, 0x02]), &mut out),
            Err(WireError::Malformed(_))
        ));
        let mut d = Decoder::new(lim(100));
        assert!(matches!(
            feed(&mut d, Bytes::from_static(&[0, 0, 0, 0, 1, 0x0C]), &mut out),
            Err(WireError::Malformed(_))
        ));
        // Truncated: inside the prefix, inside the message.
        let mut d = Decoder::new(lim(100));
        feed(&mut d, Bytes::from_static(&[0, 0]), &mut out).unwrap();
        assert!(matches!(d.finish(), Err(WireError::Truncated { .. })));
        let mut d = Decoder::new(lim(100));
        feed(&mut d, Bytes::from_static(&[0, 0, 0, 0, 9, 0x12]), &mut out).unwrap();
        assert!(matches!(d.finish(), Err(WireError::Truncated { have: 6, need: 14 })));
        assert!(out.is_empty());
        let big = v1::Frame { header: None, payload: Bytes::from(vec![0u8; 200]) };
        assert!(matches!(encode(&big, 100), Err(WireError::TooLarge { .. })));
    }

    #[test]
    fn unknown_fields_are_skipped() {
        let mut msg = frame(b"abc").encode_to_vec();
        msg.extend_from_slice(&[0x18, 0x96, 0x01, 0x22, 2, b'z', b'z', 0x2D, 1, 2, 3, 4, 0x31, 1, 2, 3, 4, 5, 6, 7, 8]);
        let mut data = vec![0u8];
        data.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        data.extend_from_slice(&msg);
        let mut d = Decoder::new(lim(1 << 10));
        let mut out = VecDeque::new();
        feed(&mut d, Bytes::from(data), &mut out).unwrap();
        assert_eq!(out.pop_front().unwrap().payload.into_bytes(), Bytes::from_static(b"abc"));
    }

    #[test]
    fn messages_are_decoded_one_at_a_time() {
        // A DATA frame packed with empty messages: the decoder holds the
        // frame, never a queue of decoded messages.
        let data = Bytes::from([0u8; PREFIX].repeat(200_000));
        let mut d = Decoder::new(lim(1 << 20));
        d.push(data.clone());
        for i in 1..=200_000usize {
            let m = d.next().unwrap().expect("a message");
            assert!(m.header.is_none() && m.payload.len() == 0);
            assert_eq!(d.unread.len(), data.len() - i * PREFIX);
        }
        assert!(d.next().unwrap().is_none());
        d.finish().unwrap();
    }

    #[test]
    fn a_header_over_the_limit_is_refused() {
        let big =
            v1::FrameHeader { kind: Some(Kind::Error(v1::Error { message: "x".repeat(2000), ..Default::default() })) };
        let f = v1::Frame { header: Some(big), payload: Bytes::new() };
        let mut d = Decoder::new(lim(1 << 20));
        assert!(matches!(
            feed(&mut d, Bytes::from(wire(&f)), &mut VecDeque::new()),
            Err(WireError::HeaderTooLarge { .. })
        ));
        // Many small header fields add up (protobuf merges them).
        let one = frame(b"").header.unwrap().encode_to_vec();
        let mut msg = Vec::new();
        for _ in 0..200 {
            msg.push(KEY_HEADER);
            prost::encode_length_delimiter(one.len(), &mut msg).unwrap();
            msg.extend_from_slice(&one);
        }
        let mut data = vec![0u8];
        data.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        data.extend_from_slice(&msg);
        let mut d = Decoder::new(lim(1 << 20));
        assert!(matches!(feed(&mut d, Bytes::from(data), &mut VecDeque::new()), Err(WireError::HeaderTooLarge { .. })));
    }
}
