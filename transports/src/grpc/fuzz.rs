//! Fuzz entry for the gRPC message decoder (feature `fuzzing`): the same
//! [`Decoder`](super::wire::Decoder) the calls' bodies run, fed arbitrary
//! bytes split into DATA frames where the input says; every message it
//! yields is re-encoded and must decode to the same frame.

use bytes::Bytes;
use tensorwire_proto::v1;

use super::wire::{Decoder, Limits, encode};

/// Largest message the fuzzed decoder accepts.
const LIMIT: usize = 64 << 10;
/// Its header limit.
const LIMITS: Limits = Limits { message: LIMIT, header: 4 << 10 };

/// The first byte sets the DATA frame size (1–256 bytes); the rest is the
/// call's body.
pub fn messages(data: &[u8]) {
    let Some((&step, body)) = data.split_first() else { return };
    let step = usize::from(step) + 1;
    let mut dec = Decoder::new(LIMITS);
    for piece in body.chunks(step) {
        dec.push(Bytes::copy_from_slice(piece));
        loop {
            let m = match dec.next() {
                Ok(Some(m)) => m,
                // As a server's call does between frames.
                Ok(None) => {
                    dec.detach();
                    break;
                }
                Err(_) => return,
            };
            let len = m.payload.len();
            assert!(len <= LIMIT);
            let mut placed = vec![0u8; len];
            m.payload.copy_to(&mut placed);
            let payload = m.payload.into_bytes();
            assert_eq!(payload[..], placed[..]);
            // What we send, we read back the same.
            let frame = v1::Frame { header: m.header, payload };
            let Ok((head, payload)) = encode(&frame, LIMIT) else { continue };
            // A re-encoded header can be longer than the bytes it came from
            // (an enum sent as a 5-byte varint, an unpacked repeated field).
            let mut again = Decoder::new(Limits { message: LIMIT, header: LIMIT });
            again.push(head);
            assert!(payload.is_empty() || again.next().expect("re-encoded head").is_none());
            again.push(payload);
            let b = again.next().expect("re-encoded message").expect("one message back");
            assert!(again.next().expect("nothing more").is_none());
            // Compared by encoded length: a header may hold a NaN (not
            // equal to itself) or a map (encoded in any order).
            let len = |h: &Option<v1::FrameHeader>| h.as_ref().map(prost::Message::encoded_len);
            assert_eq!(len(&b.header), len(&frame.header));
            assert_eq!(b.payload.into_bytes(), frame.payload);
        }
    }
    let _ = dec.finish();
}
