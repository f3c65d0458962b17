//! The tcp backend's bytes: agent metadata and the frames on a connection.
//!
//! Pure functions of bytes, so decoding is total: any input decodes or yields `None` /
//! `BadMetadata`, never a panic. Integers are little-endian.
//!
//! Metadata: `KVLT` · version u8 · name (u16 length + UTF-8) · address (u16 length + UTF-8 `ip:port`).
//!
//! Frame: body length u32 · kind u8 · body.
//!
//! | kind | body |
//! |---|---|
//! | Hello | `KVLT` · version 4 · from (u16 + UTF-8) · to (u16 + UTF-8) · nonce (32): the dialer's first frame |
//! | HelloChallenge | the acceptor's nonce (32), nothing computed from the secret |
//! | HelloProof | the dialer's proof (32): the first proof of the connection |
//! | HelloAck | the acceptor's proof (32): the connection is adopted |
//! | HelloNack | the acceptor's proof (32): it keeps the connection it dialed itself (simultaneous dials) |
//! | HelloRefused | empty: the dialer's proof is wrong (another secret), or (SPEC S6, in place of the challenge) its certificate is not its agent name's engine; the acceptor closes |
//! | Notif | the payload |
//! | ReadReq | req_id u64 · lease_id u64 · count u32 · count × (block u32, offset u32, len u32) · tag (u16 + bytes, for the gate) |
//! | ReadData | req_id u64 · the next bytes of the segments, in order; at least one frame per read |
//! | ReadErr | req_id u64 · code u8 (1 refused, 2 out of range) · UTF-8 message |
//! | WriteReq | req_id u64 · count u32 · count × (block u32, offset u32, len u32) · key (u16 + bytes) · tag (u16 + bytes) · notif flag u8 (0 none, 1 some) · the notification (the rest) |
//! | WriteData | req_id u64 · the next bytes of the segments, in order; none for a write of 0 bytes |
//! | WriteAck | req_id u64: every byte landed, and the notification was delivered |
//! | WriteErr | req_id u64 · code u8 (1 refused, 2 out of range, 3 malformed) · UTF-8 message: nothing more lands |
//! | WriteCancel | req_id u64: the writer gave up; no more data follows, and the receiver drops the write |
//!
//! A write (push mode, SPEC §13) is sent without waiting for an answer: the request, then its
//! data. The receiver asks its write gate when the request arrives and answers `WriteErr` at
//! once on a refusal, skipping the data that follows: a refused write costs its bytes on the
//! wire, not a round trip for every write that is not refused. The segments name the
//! receiver's blocks, as its registration `key` does, never addresses.

use crate::{Segment, TransportError};
use kvlease_core::auth::{Nonce, Tag, NONCE_LEN, TAG_LEN};
use std::net::SocketAddr;

pub(super) const MAGIC: [u8; 4] = *b"KVLT";
/// Of the metadata.
pub(super) const VERSION: u8 = 1;
/// Of the handshake: 2 added the nonces and proofs (SPEC S2), so a version-1 dialer is refused;
/// 3 added the read request's tag, so an agent that would misread requests is refused at the
/// handshake rather than at its first read; 4 has the dialer prove first (issue 22: an acceptor
/// that proved first handed anyone a MAC to test guesses of the secret against).
pub(super) const HELLO_VERSION: u8 = 4;
/// Longest tag a read request may carry.
pub(super) const MAX_TAG: usize = 256;
/// Longest agent name, in bytes.
pub(super) const MAX_NAME: usize = 1024;
/// Length prefix and kind.
pub(super) const HEADER_LEN: usize = 5;
/// The largest handshake frame body (a `Hello` with the longest names): checked before the
/// body is read, so a stranger costs at most this much memory.
pub(super) const MAX_HELLO: usize = 4 + 1 + 2 + MAX_NAME + 2 + MAX_NAME + NONCE_LEN;
/// Bytes of a `ReadReq` body before the segments, and per segment (the tag's length prefix
/// counted in the fixed part).
pub(super) const READ_REQ_FIXED: usize = 8 + 8 + 4 + 2;
pub(super) const READ_REQ_PER_SEGMENT: usize = 12;
/// Bytes of a `WriteReq` body besides the segments (12 each), the key, the tag and the
/// notification: req_id, count, the two length prefixes and the notification flag.
pub(super) const WRITE_REQ_FIXED: usize = 8 + 4 + 2 + 2 + 1;

pub(super) const HELLO: u8 = 1;
pub(super) const HELLO_ACK: u8 = 2;
pub(super) const HELLO_NACK: u8 = 3;
pub(super) const NOTIF: u8 = 4;
pub(super) const READ_REQ: u8 = 5;
pub(super) const READ_DATA: u8 = 6;
pub(super) const READ_ERR: u8 = 7;
pub(super) const HELLO_CHALLENGE: u8 = 8;
pub(super) const HELLO_PROOF: u8 = 9;
pub(super) const HELLO_REFUSED: u8 = 10;
pub(super) const WRITE_REQ: u8 = 11;
pub(super) const WRITE_DATA: u8 = 12;
pub(super) const WRITE_ACK: u8 = 13;
pub(super) const WRITE_ERR: u8 = 14;
pub(super) const WRITE_CANCEL: u8 = 15;

pub(super) const ERR_REFUSED: u8 = 1;
pub(super) const ERR_OUT_OF_RANGE: u8 = 2;
pub(super) const ERR_MALFORMED: u8 = 3;

/// A cursor over untrusted bytes; every accessor is bounds-checked.
struct Bytes<'a>(&'a [u8]);

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).and_then(|b| b.try_into().ok())
    }

    fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// A u16-length-prefixed UTF-8 string.
    fn str16(&mut self) -> Option<&'a str> {
        let n = self.u16()? as usize;
        std::str::from_utf8(self.take(n)?).ok()
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn put_str16(out: &mut Vec<u8>, s: &str) {
    // Names are checked against MAX_NAME and addresses are short, so the length fits.
    let n = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..n as usize]);
}

/// Whether `name` can name an agent on the wire.
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME
}

pub(super) fn encode_metadata(name: &str, addr: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 1 + 2 + name.len() + 2 + 48);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    put_str16(&mut out, name);
    put_str16(&mut out, &addr.to_string());
    out
}

pub(super) fn decode_metadata(md: &[u8]) -> Result<(String, SocketAddr), TransportError> {
    let bad = |why: &str| TransportError::BadMetadata(format!("{why} (tcp agent metadata, {} bytes)", md.len()));
    let mut b = Bytes(md);
    if b.array::<4>() != Some(MAGIC) {
        return Err(bad("no KVLT magic: not the metadata of a tcp agent"));
    }
    match b.u8() {
        Some(VERSION) => {}
        Some(v) => return Err(bad(&format!("version {v}, this agent speaks {VERSION}"))),
        None => return Err(bad("truncated")),
    }
    let name = b.str16().ok_or_else(|| bad("truncated or non-UTF-8 name"))?;
    if !valid_name(name) {
        return Err(bad(&format!("agent names are 1 to {MAX_NAME} bytes")));
    }
    let addr = b.str16().ok_or_else(|| bad("truncated or non-UTF-8 address"))?;
    let addr: SocketAddr = addr.parse().map_err(|_| bad(&format!("{addr:?} is not an ip:port address")))?;
    if !b.is_empty() {
        return Err(bad("trailing bytes"));
    }
    Ok((name.to_owned(), addr))
}

/// The first frame of a connection: who dials, whom it means to reach, and the challenge the
/// acceptor's proof must answer.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Hello {
    pub from: String,
    pub to: String,
    pub nonce: Nonce,
}

pub(super) fn decode_hello(body: &[u8]) -> Option<Hello> {
    let mut b = Bytes(body);
    if b.array::<4>()? != MAGIC || b.u8()? != HELLO_VERSION {
        return None;
    }
    let from = b.str16()?;
    let to = b.str16()?;
    let nonce = b.array()?;
    (valid_name(from) && valid_name(to) && b.is_empty()).then(|| Hello { from: from.to_owned(), to: to.to_owned(), nonce })
}

/// The acceptor's nonce.
pub(super) fn decode_challenge(body: &[u8]) -> Option<Nonce> {
    body.try_into().ok()
}

/// A proof (the dialer's `HelloProof`, the acceptor's `HelloAck` and `HelloNack`).
pub(super) fn decode_proof(body: &[u8]) -> Option<Tag> {
    (body.len() == TAG_LEN).then(|| body.try_into().ok()).flatten()
}

/// A remote piece of a read, as the serving side sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RemoteSegment {
    pub block: u32,
    pub offset: u32,
    pub len: u32,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) struct ReadReq {
    pub req_id: u64,
    pub lease_id: u64,
    pub segments: Vec<RemoteSegment>,
    pub tag: Vec<u8>,
}

pub(super) fn decode_read_req(body: &[u8]) -> Option<ReadReq> {
    let mut b = Bytes(body);
    let req_id = b.u64()?;
    let lease_id = b.u64()?;
    let count = b.u32()? as usize;
    // Checked before allocating, so a lying count cannot make us reserve memory.
    let seg_bytes = count.checked_mul(READ_REQ_PER_SEGMENT)?;
    if b.0.len() < seg_bytes + 2 {
        return None;
    }
    let mut segments = Vec::with_capacity(count);
    for _ in 0..count {
        segments.push(RemoteSegment { block: b.u32()?, offset: b.u32()?, len: b.u32()? });
    }
    let tag_len = b.u16()? as usize;
    if tag_len > MAX_TAG || b.0.len() != tag_len {
        return None;
    }
    Some(ReadReq { req_id, lease_id, segments, tag: b.0.to_vec() })
}

/// A peer asks to write into our blocks (push mode).
#[derive(Debug, PartialEq, Eq)]
pub(super) struct WriteReq {
    pub req_id: u64,
    /// Our blocks, as our registration named them.
    pub segments: Vec<RemoteSegment>,
    pub key: Vec<u8>,
    pub tag: Vec<u8>,
    pub notif: Option<Vec<u8>>,
}

pub(super) fn decode_write_req(body: &[u8]) -> Option<WriteReq> {
    let mut b = Bytes(body);
    let req_id = b.u64()?;
    let count = b.u32()? as usize;
    // Checked before allocating, so a lying count cannot make us reserve memory.
    let seg_bytes = count.checked_mul(READ_REQ_PER_SEGMENT)?;
    if b.0.len() < seg_bytes.checked_add(WRITE_REQ_FIXED - 12)? {
        return None;
    }
    let mut segments = Vec::with_capacity(count);
    for _ in 0..count {
        segments.push(RemoteSegment { block: b.u32()?, offset: b.u32()?, len: b.u32()? });
    }
    let key_len = b.u16()? as usize;
    if key_len > crate::MAX_WRITE_KEY {
        return None;
    }
    let key = b.take(key_len)?.to_vec();
    let tag_len = b.u16()? as usize;
    if tag_len > MAX_TAG {
        return None;
    }
    let tag = b.take(tag_len)?.to_vec();
    let notif = match b.u8()? {
        0 if b.is_empty() => None,
        1 => Some(b.rest().to_vec()),
        _ => return None,
    };
    Some(WriteReq { req_id, segments, key, tag, notif })
}

/// The request id of a `WriteAck` or `WriteCancel`.
pub(super) fn decode_req_id(body: &[u8]) -> Option<u64> {
    body.try_into().ok().map(u64::from_le_bytes)
}

/// `(req_id, code, message)` of a `ReadErr` or a `WriteErr`.
pub(super) fn decode_read_err(body: &[u8]) -> Option<(u64, u8, String)> {
    let mut b = Bytes(body);
    let req_id = b.u64()?;
    let code = b.u8()?;
    Some((req_id, code, String::from_utf8_lossy(b.rest()).into_owned()))
}

/// The header of a `ReadData` frame carrying `payload` bytes.
pub(super) fn read_data_header(req_id: u64, payload: usize) -> [u8; HEADER_LEN + 8] {
    data_header(READ_DATA, req_id, payload)
}

/// The header of a `WriteData` frame carrying `payload` bytes.
pub(super) fn write_data_header(req_id: u64, payload: usize) -> [u8; HEADER_LEN + 8] {
    data_header(WRITE_DATA, req_id, payload)
}

fn data_header(kind: u8, req_id: u64, payload: usize) -> [u8; HEADER_LEN + 8] {
    let mut h = [0u8; HEADER_LEN + 8];
    // A data frame carries at most one chunk, far below 4 GiB.
    h[..4].copy_from_slice(&((payload + 8) as u32).to_le_bytes());
    h[4] = kind;
    h[5..].copy_from_slice(&req_id.to_le_bytes());
    h
}

/// A frame queued for a connection's writer: a small header and an owned body, written together
/// with one vectored write so a notification's payload is never copied again.
#[derive(Debug)]
pub(super) struct Outgoing {
    head: [u8; HEADER_LEN],
    body: Vec<u8>,
}

impl Outgoing {
    fn new(kind: u8, body: Vec<u8>) -> Outgoing {
        let mut head = [0u8; HEADER_LEN];
        // Bodies are bounded by the frame limit (checked by the callers), far below 4 GiB.
        head[..4].copy_from_slice(&(body.len() as u32).to_le_bytes());
        head[4] = kind;
        Outgoing { head, body }
    }

    pub fn head(&self) -> &[u8] {
        &self.head
    }

    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The frame's length on the wire.
    pub fn len(&self) -> usize {
        HEADER_LEN + self.body.len()
    }

    /// The whole frame in one buffer (handshake frames, tests).
    pub fn to_bytes(&self) -> Vec<u8> {
        [&self.head[..], &self.body].concat()
    }

    pub fn hello(from: &str, to: &str, nonce: &Nonce) -> Outgoing {
        let mut body = Vec::with_capacity(4 + 1 + 4 + from.len() + to.len() + NONCE_LEN);
        body.extend_from_slice(&MAGIC);
        body.push(HELLO_VERSION);
        put_str16(&mut body, from);
        put_str16(&mut body, to);
        body.extend_from_slice(nonce);
        Outgoing::new(HELLO, body)
    }

    pub fn hello_challenge(nonce: &Nonce) -> Outgoing {
        Outgoing::new(HELLO_CHALLENGE, nonce.to_vec())
    }

    pub fn hello_proof(proof: &Tag) -> Outgoing {
        Outgoing::new(HELLO_PROOF, proof.to_vec())
    }

    pub fn hello_ack(proof: &Tag) -> Outgoing {
        Outgoing::new(HELLO_ACK, proof.to_vec())
    }

    pub fn hello_nack(proof: &Tag) -> Outgoing {
        Outgoing::new(HELLO_NACK, proof.to_vec())
    }

    pub fn hello_refused() -> Outgoing {
        Outgoing::new(HELLO_REFUSED, Vec::new())
    }

    pub fn notif(bytes: Vec<u8>) -> Outgoing {
        Outgoing::new(NOTIF, bytes)
    }

    /// A read request; a tag longer than [`MAX_TAG`] is cut there (the engine's is 16 bytes).
    pub fn read_req(req_id: u64, lease_id: u64, segments: &[Segment], tag: &[u8]) -> Outgoing {
        let tag = &tag[..tag.len().min(MAX_TAG)];
        let mut body = Vec::with_capacity(READ_REQ_FIXED + READ_REQ_PER_SEGMENT * segments.len() + tag.len());
        body.extend_from_slice(&req_id.to_le_bytes());
        body.extend_from_slice(&lease_id.to_le_bytes());
        body.extend_from_slice(&(segments.len() as u32).to_le_bytes());
        for s in segments {
            body.extend_from_slice(&s.remote_block.to_le_bytes());
            body.extend_from_slice(&s.remote_offset.to_le_bytes());
            body.extend_from_slice(&s.len.to_le_bytes());
        }
        body.extend_from_slice(&(tag.len() as u16).to_le_bytes());
        body.extend_from_slice(tag);
        Outgoing::new(READ_REQ, body)
    }

    pub fn read_err(req_id: u64, code: u8, message: &str) -> Outgoing {
        let mut body = Vec::with_capacity(9 + message.len());
        body.extend_from_slice(&req_id.to_le_bytes());
        body.push(code);
        body.extend_from_slice(message.as_bytes());
        Outgoing::new(READ_ERR, body)
    }

    /// A write request; the caller keeps the key within [`crate::MAX_WRITE_KEY`] (checked by
    /// the agent); a longer tag is cut at [`MAX_TAG`], as a read's is.
    pub fn write_req(req_id: u64, segments: &[Segment], key: &[u8], tag: &[u8], notif: Option<&[u8]>) -> Outgoing {
        let key = &key[..key.len().min(crate::MAX_WRITE_KEY)];
        let tag = &tag[..tag.len().min(MAX_TAG)];
        let extra = key.len() + tag.len() + notif.map_or(0, <[u8]>::len);
        let mut body = Vec::with_capacity(WRITE_REQ_FIXED + READ_REQ_PER_SEGMENT * segments.len() + extra);
        body.extend_from_slice(&req_id.to_le_bytes());
        body.extend_from_slice(&(segments.len() as u32).to_le_bytes());
        for s in segments {
            body.extend_from_slice(&s.remote_block.to_le_bytes());
            body.extend_from_slice(&s.remote_offset.to_le_bytes());
            body.extend_from_slice(&s.len.to_le_bytes());
        }
        body.extend_from_slice(&(key.len() as u16).to_le_bytes());
        body.extend_from_slice(key);
        body.extend_from_slice(&(tag.len() as u16).to_le_bytes());
        body.extend_from_slice(tag);
        match notif {
            None => body.push(0),
            Some(n) => {
                body.push(1);
                body.extend_from_slice(n);
            }
        }
        Outgoing::new(WRITE_REQ, body)
    }

    pub fn write_ack(req_id: u64) -> Outgoing {
        Outgoing::new(WRITE_ACK, req_id.to_le_bytes().to_vec())
    }

    pub fn write_err(req_id: u64, code: u8, message: &str) -> Outgoing {
        let mut f = Outgoing::read_err(req_id, code, message);
        f.head[4] = WRITE_ERR;
        f
    }

    pub fn write_cancel(req_id: u64) -> Outgoing {
        Outgoing::new(WRITE_CANCEL, req_id.to_le_bytes().to_vec())
    }

    /// Any kind and body, for tests that speak the protocol badly on purpose.
    #[cfg(test)]
    pub fn raw(kind: u8, body: Vec<u8>) -> Outgoing {
        Outgoing::new(kind, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips() {
        let addr: SocketAddr = "127.0.0.1:4242".parse().unwrap();
        let md = encode_metadata("engine/7/0", addr);
        assert_eq!(decode_metadata(&md).unwrap(), ("engine/7/0".to_owned(), addr));
        let v6: SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(decode_metadata(&encode_metadata("x", v6)).unwrap().1, v6);
    }

    #[test]
    fn metadata_decoding_is_total_every_truncation_and_flip_is_bad_metadata_not_a_panic() {
        let md = encode_metadata("engine/7/0", "127.0.0.1:4242".parse().unwrap());
        for n in 0..md.len() {
            assert!(matches!(decode_metadata(&md[..n]), Err(TransportError::BadMetadata(_))), "truncated to {n}");
        }
        let mut extended = md.clone();
        extended.push(0);
        assert!(matches!(decode_metadata(&extended), Err(TransportError::BadMetadata(_))));
        // Every single-byte change either still decodes or is refused; none panics.
        for i in 0..md.len() {
            for v in [0u8, 1, 0x7f, 0x80, 0xff] {
                let mut m = md.clone();
                m[i] = v;
                let _ = decode_metadata(&m);
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..512 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            assert!(decode_metadata(&junk).is_err());
        }
        assert!(decode_metadata(&encode_metadata("", "127.0.0.1:1".parse().unwrap())).is_err(), "empty name");
    }

    #[test]
    fn hello_and_read_req_round_trip_and_reject_lies() {
        let h = Outgoing::hello("a", "b", &[7; NONCE_LEN]);
        assert_eq!(decode_hello(h.body()), Some(Hello { from: "a".into(), to: "b".into(), nonce: [7; NONCE_LEN] }));
        assert_eq!(decode_hello(&h.body()[..h.body().len() - 1]), None);
        assert_eq!(decode_hello(&[h.body(), &[0]].concat()), None);
        let mut v1 = h.body()[..h.body().len() - NONCE_LEN].to_vec();
        v1[4] = 1;
        assert_eq!(decode_hello(&v1), None, "a version-1 hello (no nonce) is refused");
        let longest = Outgoing::hello(&"x".repeat(MAX_NAME), &"y".repeat(MAX_NAME), &[0; NONCE_LEN]);
        assert_eq!(longest.body().len(), MAX_HELLO);
        let c = Outgoing::hello_challenge(&[1; NONCE_LEN]);
        assert_eq!(decode_challenge(c.body()), Some([1; NONCE_LEN]), "a nonce, and no proof: the dialer proves first");
        assert_eq!(decode_challenge(&c.body()[1..]), None);
        assert_eq!(decode_proof(Outgoing::hello_proof(&[3; TAG_LEN]).body()), Some([3; TAG_LEN]));
        assert_eq!(decode_proof(Outgoing::hello_ack(&[4; TAG_LEN]).body()), Some([4; TAG_LEN]));
        assert_eq!(decode_proof(&[4; TAG_LEN - 1]), None);
        let segs = [Segment { remote_block: 3, remote_offset: 16, local_block: 9, local_offset: 0, len: 100 }];
        let r = Outgoing::read_req(5, 77, &segs, b"digest");
        assert_eq!(
            decode_read_req(r.body()),
            Some(ReadReq {
                req_id: 5,
                lease_id: 77,
                segments: vec![RemoteSegment { block: 3, offset: 16, len: 100 }],
                tag: b"digest".to_vec()
            })
        );
        let untagged = Outgoing::read_req(5, 77, &segs, &[]);
        assert_eq!(decode_read_req(untagged.body()).map(|r| r.tag), Some(Vec::new()));
        let mut long_tag = r.body().to_vec();
        long_tag.push(0);
        assert_eq!(decode_read_req(&long_tag), None, "bytes after the tag are refused");
        assert_eq!(decode_read_req(&r.body()[..r.body().len() - 1]), None, "a tag shorter than its length is refused");
        let mut lying = r.body().to_vec();
        lying[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_read_req(&lying), None, "a count that does not match the body is refused");
        assert_eq!(decode_read_req(&[1, 2, 3]), None);
        assert_eq!(decode_read_err(Outgoing::read_err(4, ERR_REFUSED, "no").body()), Some((4, ERR_REFUSED, "no".into())));
        assert_eq!(decode_read_err(&[0; 8]), None);
    }

    /// Push mode's frames (SPEC U4, U8): a write request round-trips with and without its tag
    /// and notification, and every truncation, extension, flip and lie decodes to a request or
    /// `None`, never a panic.
    #[test]
    fn u4_write_frames_round_trip_and_malformed_ones_are_refused_without_panics() {
        let segs = [
            Segment { remote_block: 3, remote_offset: 16, local_block: 9, local_offset: 0, len: 100 },
            Segment { remote_block: 4, remote_offset: 0, local_block: 1, local_offset: 8, len: 7 },
        ];
        let w = Outgoing::write_req(5, &segs, b"key-1", b"digest", Some(b"done"));
        assert_eq!(w.head()[4], WRITE_REQ);
        let expected = WriteReq {
            req_id: 5,
            segments: vec![RemoteSegment { block: 3, offset: 16, len: 100 }, RemoteSegment { block: 4, offset: 0, len: 7 }],
            key: b"key-1".to_vec(),
            tag: b"digest".to_vec(),
            notif: Some(b"done".to_vec()),
        };
        assert_eq!(decode_write_req(w.body()), Some(expected));
        let bare = Outgoing::write_req(6, &[], &[], &[], None);
        assert_eq!(decode_write_req(bare.body()), Some(WriteReq { req_id: 6, segments: vec![], key: vec![], tag: vec![], notif: None }));
        assert_eq!(bare.body().len(), WRITE_REQ_FIXED);
        let empty_notif = Outgoing::write_req(7, &segs[..1], b"k", b"", Some(b""));
        assert_eq!(decode_write_req(empty_notif.body()).and_then(|r| r.notif), Some(Vec::new()), "an empty notification is still one");
        // Cut anywhere before the notification, the request is refused.
        let fixed_end = w.body().len() - 4;
        for n in 0..fixed_end {
            assert_eq!(decode_write_req(&w.body()[..n]), None, "truncated to {n}");
        }
        assert_eq!(decode_write_req(&[bare.body(), &[0]].concat()), None, "bytes after 'no notification' are refused");
        let mut flag = bare.body().to_vec();
        *flag.last_mut().expect("flag") = 2;
        assert_eq!(decode_write_req(&flag), None, "an unknown notification flag is refused");
        let mut lying = w.body().to_vec();
        lying[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_write_req(&lying), None, "a count that does not match the body is refused");
        let mut long_key = bare.body().to_vec();
        long_key[12..14].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(decode_write_req(&long_key), None, "a key longer than MAX_WRITE_KEY is refused");
        let cut = Outgoing::write_req(1, &[], &vec![7; crate::MAX_WRITE_KEY + 5], &vec![8; MAX_TAG + 5], None);
        let cut = decode_write_req(cut.body()).expect("cut to the limits");
        assert_eq!((cut.key.len(), cut.tag.len()), (crate::MAX_WRITE_KEY, MAX_TAG));
        for i in 0..w.body().len() {
            for v in [0u8, 1, 0x7f, 0x80, 0xff] {
                let mut m = w.body().to_vec();
                m[i] = v;
                let _ = decode_write_req(&m);
            }
        }
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for len in 0..256 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = decode_write_req(&junk);
            let _ = decode_req_id(&junk);
            let _ = decode_read_err(&junk);
        }
        let ack = Outgoing::write_ack(9);
        assert_eq!((ack.head()[4], decode_req_id(ack.body())), (WRITE_ACK, Some(9)));
        let cancel = Outgoing::write_cancel(10);
        assert_eq!((cancel.head()[4], decode_req_id(cancel.body())), (WRITE_CANCEL, Some(10)));
        assert_eq!(decode_req_id(&[0; 7]), None);
        assert_eq!(decode_req_id(&[0; 9]), None);
        let err = Outgoing::write_err(11, ERR_REFUSED, "registration ended");
        assert_eq!(err.head()[4], WRITE_ERR);
        assert_eq!(decode_read_err(err.body()), Some((11, ERR_REFUSED, "registration ended".into())));
        let h = write_data_header(12, 100);
        assert_eq!(
            (u32::from_le_bytes([h[0], h[1], h[2], h[3]]), h[4], u64::from_le_bytes(h[5..].try_into().expect("8"))),
            (108, WRITE_DATA, 12)
        );
        assert_eq!(read_data_header(12, 100)[4], READ_DATA, "the read path's frames are unchanged");
    }
}
