//! The notification codec (SPEC §9): every message between agents, as bytes.
//!
//! Layout: magic `b"KL"`, a version byte, a type byte, then the body. Integers are LEB128 varints;
//! lease-id lists are sorted, deduplicated and delta-encoded, so a heartbeat for ids granted in a
//! row costs about one byte per lease. Request ids never appear on the wire, so nothing needs
//! escaping. [`Message::decode`] is total: any byte string yields a message or a [`WireError`],
//! never a panic, and never an allocation larger than the input justifies.

use crate::digest::PromptDigest;
use crate::LeaseId;
use thiserror::Error;

pub const MAGIC: [u8; 2] = *b"KL";
/// 2: `ReadDone` carries the reader's prompt digest (SPEC S4).
pub const VERSION: u8 = 2;
/// SPEC D2: the default largest notification we send.
pub const DEFAULT_MAX_NOTIF_BYTES: usize = 64 * 1024;
/// The smallest `max_notif_bytes` we accept: room for a header and a few ids (UCCL caps at 256).
pub const MIN_MAX_NOTIF_BYTES: usize = 64;
/// The largest message any decoder accepts; larger ones are `Oversized` (SPEC P7).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
const MAX_STRING: usize = 4096;
const MAX_BLOB: usize = 1 << 20;
/// Header (4) + seq varint (≤ 10) + count varint (≤ 10).
const HEARTBEAT_OVERHEAD: usize = 24;

/// Every message two agents exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// D → P: renew these leases (SPEC P2, D2). P answers with a `HeartbeatAck` of the same seq.
    Heartbeat { seq: u64, lease_ids: Vec<LeaseId> },
    /// P → D: heartbeat `seq` was applied; `lost_ids` were not live (SPEC P6, D6).
    HeartbeatAck { seq: u64, lost_ids: Vec<LeaseId> },
    /// D → P: D will not read these leases; free them now (SPEC D4).
    Release { lease_ids: Vec<LeaseId> },
    /// D → P: consumer rank `consumer_rank`, one of `n` expected, finished reading (SPEC P8),
    /// for a prompt whose digest is `digest` (SPEC S4: P confirms only a read for its own prompt).
    ReadDone { lease_id: LeaseId, consumer_rank: u32, n: u32, digest: PromptDigest },
    /// P → D: answer to `ReadDone`: whether the lease was live when the completion arrived, i.e.
    /// whether the bytes read are valid (SPEC D6, for transports where P cannot refuse a read).
    ReadDoneAck { lease_id: LeaseId, live: bool },
    /// P → D: these leases are gone; never use their data (SPEC P6).
    LeaseLost { lease_ids: Vec<LeaseId> },
    /// Clock probe for the offset estimator (SPEC B2): `t0` on the sender's clock.
    ClockPing { seq: u64, t0: u64 },
    /// Answer to a probe: `t1` receive and `t2` send time on the responder's clock.
    ClockPong { seq: u64, t0: u64, t1: u64, t2: u64 },
    /// Handshake, both directions: who the engine is and how to reach each rank's agent.
    Hello(Hello),
    /// Side channel, P → D: P will not take D's Hello, and why, in words both logs print (a
    /// geometry field and both values, say). `what` labels the kind of refusal (`geometry`,
    /// ...) for metrics. P closes the connection after it.
    Refused { what: String, reason: String },
    /// Side channel, D → P (SPEC O4): D will not read these leases and has no transfer link to
    /// P to say so; P applies it as the `Release` from that holder over the agents would.
    SideRelease(SideRelease),
    /// Side channel, P → D: the answer to a `SideRelease`: P's incarnation, and the ids it did
    /// not release (not live, held by another engine, or granted by another incarnation).
    SideReleaseAck { incarnation: u64, lost_ids: Vec<LeaseId> },
}

/// D's release over P's side channel (SPEC O4): the holder, the leases, the incarnation of P
/// that granted them, and why D will not read them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideRelease {
    /// The holder (SPEC S5): D's engine id and incarnation, as its agents are named.
    pub engine_id: String,
    pub incarnation: u64,
    /// The incarnation of P that granted the leases; another incarnation releases none (where
    /// the same ids name other leases). 0: unknown (P did not say one in its params).
    pub granted_by: u64,
    pub lease_ids: Vec<LeaseId>,
    /// Why D will not read them: a label (`duplicate_engine_id`, `no_handshake`) for P's
    /// metrics and a sentence for P's log.
    pub what: String,
    pub why: String,
    /// A MAC over the rest for this connection, under the cluster's secret (SPEC S2).
    pub auth: Vec<u8>,
}

/// The handshake payload (SPEC §3, D5): identity, incarnation, one transport metadata blob per
/// rank, an opaque engine description (layout, tp), and a clock stamp for the offset estimator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub engine_id: String,
    pub incarnation: u64,
    pub agents: Vec<Vec<u8>>,
    pub info: Vec<u8>,
    /// Sender's clock when sent; a reply echoes the request's stamp in `echo`.
    pub t_send: u64,
    /// On a reply: (request's t_send, reply's receive time of the request); zero on a request.
    pub echo: (u64, u64),
    /// A MAC over the rest, under the cluster's secret (SPEC S1, S2); empty without one.
    pub auth: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("message too short")]
    Truncated,
    #[error("not a kvlease message (bad magic)")]
    BadMagic,
    #[error("unsupported wire version {0}")]
    Version(u8),
    #[error("unknown message type {0}")]
    UnknownType(u8),
    #[error("malformed varint")]
    Varint,
    #[error("malformed body: {0}")]
    Body(&'static str),
    #[error("message of {0} bytes exceeds the limit")]
    Oversized(usize),
}

impl WireError {
    /// The `reason` label under which a rejected message is counted (SPEC §11).
    pub fn reason(&self) -> &'static str {
        match self {
            WireError::Oversized(_) => "oversized",
            _ => "malformed",
        }
    }
}

mod tag {
    pub const HEARTBEAT: u8 = 1;
    pub const HEARTBEAT_ACK: u8 = 2;
    pub const RELEASE: u8 = 3;
    pub const READ_DONE: u8 = 4;
    pub const LEASE_LOST: u8 = 5;
    pub const READ_DONE_ACK: u8 = 6;
    pub const CLOCK_PING: u8 = 7;
    pub const CLOCK_PONG: u8 = 8;
    pub const HELLO: u8 = 9;
    pub const REFUSED: u8 = 10;
    pub const SIDE_RELEASE: u8 = 11;
    pub const SIDE_RELEASE_ACK: u8 = 12;
}

impl Message {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16);
        self.encode_into(&mut out);
        out
    }

    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        match self {
            Message::Heartbeat { seq, lease_ids } => {
                out.push(tag::HEARTBEAT);
                put_varint(out, *seq);
                put_ids(out, lease_ids);
            }
            Message::HeartbeatAck { seq, lost_ids } => {
                out.push(tag::HEARTBEAT_ACK);
                put_varint(out, *seq);
                put_ids(out, lost_ids);
            }
            Message::Release { lease_ids } => {
                out.push(tag::RELEASE);
                put_ids(out, lease_ids);
            }
            Message::ReadDone { lease_id, consumer_rank, n, digest } => {
                out.push(tag::READ_DONE);
                put_varint(out, *lease_id);
                put_varint(out, u64::from(*consumer_rank));
                put_varint(out, u64::from(*n));
                out.extend_from_slice(&digest.0);
            }
            Message::ReadDoneAck { lease_id, live } => {
                out.push(tag::READ_DONE_ACK);
                put_varint(out, *lease_id);
                out.push(u8::from(*live));
            }
            Message::LeaseLost { lease_ids } => {
                out.push(tag::LEASE_LOST);
                put_ids(out, lease_ids);
            }
            Message::ClockPing { seq, t0 } => {
                out.push(tag::CLOCK_PING);
                put_varint(out, *seq);
                put_varint(out, *t0);
            }
            Message::ClockPong { seq, t0, t1, t2 } => {
                out.push(tag::CLOCK_PONG);
                for v in [seq, t0, t1, t2] {
                    put_varint(out, *v);
                }
            }
            Message::Hello(h) => {
                out.push(tag::HELLO);
                put_bytes(out, h.engine_id.as_bytes());
                put_varint(out, h.incarnation);
                put_varint(out, h.agents.len() as u64);
                for a in &h.agents {
                    put_bytes(out, a);
                }
                put_bytes(out, &h.info);
                put_varint(out, h.t_send);
                put_varint(out, h.echo.0);
                put_varint(out, h.echo.1);
                put_bytes(out, &h.auth);
            }
            Message::Refused { what, reason } => {
                out.push(tag::REFUSED);
                put_bytes(out, what.as_bytes());
                put_bytes(out, reason.as_bytes());
            }
            Message::SideRelease(r) => {
                out.push(tag::SIDE_RELEASE);
                put_bytes(out, r.engine_id.as_bytes());
                put_varint(out, r.incarnation);
                put_varint(out, r.granted_by);
                put_ids(out, &r.lease_ids);
                put_bytes(out, r.what.as_bytes());
                put_bytes(out, r.why.as_bytes());
                put_bytes(out, &r.auth);
            }
            Message::SideReleaseAck { incarnation, lost_ids } => {
                out.push(tag::SIDE_RELEASE_ACK);
                put_varint(out, *incarnation);
                put_ids(out, lost_ids);
            }
        }
    }

    /// Decodes one message. Total: never panics, rejects trailing bytes and unknown types.
    pub fn decode(buf: &[u8]) -> Result<Message, WireError> {
        if buf.len() > MAX_MESSAGE_BYTES {
            return Err(WireError::Oversized(buf.len()));
        }
        if buf.len() < 4 {
            return Err(WireError::Truncated);
        }
        if buf[..2] != MAGIC {
            return Err(WireError::BadMagic);
        }
        if buf[2] != VERSION {
            return Err(WireError::Version(buf[2]));
        }
        let mut r = Reader { buf: &buf[4..] };
        let msg = match buf[3] {
            tag::HEARTBEAT => Message::Heartbeat { seq: r.varint()?, lease_ids: r.ids()? },
            tag::HEARTBEAT_ACK => Message::HeartbeatAck { seq: r.varint()?, lost_ids: r.ids()? },
            tag::RELEASE => Message::Release { lease_ids: r.ids()? },
            tag::READ_DONE => Message::ReadDone { lease_id: r.varint()?, consumer_rank: r.u32()?, n: r.u32()?, digest: r.digest()? },
            tag::READ_DONE_ACK => Message::ReadDoneAck {
                lease_id: r.varint()?,
                live: match r.byte()? {
                    0 => false,
                    1 => true,
                    _ => return Err(WireError::Body("bool")),
                },
            },
            tag::LEASE_LOST => Message::LeaseLost { lease_ids: r.ids()? },
            tag::CLOCK_PING => Message::ClockPing { seq: r.varint()?, t0: r.varint()? },
            tag::CLOCK_PONG => Message::ClockPong { seq: r.varint()?, t0: r.varint()?, t1: r.varint()?, t2: r.varint()? },
            tag::HELLO => {
                let engine_id = String::from_utf8(r.bytes(MAX_STRING)?.to_vec()).map_err(|_| WireError::Body("engine_id is not UTF-8"))?;
                let incarnation = r.varint()?;
                let n = r.count(1)?;
                let mut agents = Vec::with_capacity(n);
                for _ in 0..n {
                    agents.push(r.bytes(MAX_BLOB)?.to_vec());
                }
                let info = r.bytes(MAX_BLOB)?.to_vec();
                let (t_send, echo) = (r.varint()?, (r.varint()?, r.varint()?));
                Message::Hello(Hello { engine_id, incarnation, agents, info, t_send, echo, auth: r.bytes(MAX_STRING)?.to_vec() })
            }
            tag::REFUSED => {
                Message::Refused { what: r.string("refusal label is not UTF-8")?, reason: r.string("refusal reason is not UTF-8")? }
            }
            tag::SIDE_RELEASE => Message::SideRelease(SideRelease {
                engine_id: r.string("engine_id is not UTF-8")?,
                incarnation: r.varint()?,
                granted_by: r.varint()?,
                lease_ids: r.ids()?,
                what: r.string("release label is not UTF-8")?,
                why: r.string("release reason is not UTF-8")?,
                auth: r.bytes(MAX_STRING)?.to_vec(),
            }),
            tag::SIDE_RELEASE_ACK => Message::SideReleaseAck { incarnation: r.varint()?, lost_ids: r.ids()? },
            t => return Err(WireError::UnknownType(t)),
        };
        if !r.buf.is_empty() {
            return Err(WireError::Body("trailing bytes"));
        }
        Ok(msg)
    }
}

/// Splits the heartbeat for sorted, deduplicated `ids` into messages of at most `max_bytes`
/// each (SPEC D2). Returns the id ranges, one per message, in order; encode each with
/// [`encode_heartbeat`]. Every range holds at least one id whatever `max_bytes` is.
pub fn heartbeat_chunks(ids: &[LeaseId], max_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let budget = max_bytes.saturating_sub(HEARTBEAT_OVERHEAD).max(10);
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut used = 0;
    for i in 0..ids.len() {
        let cost = if i == start { varint_len(ids[i]) } else { varint_len(ids[i] - ids[i - 1] - 1) };
        if i > start && used + cost > budget {
            chunks.push(start..i);
            start = i;
            used = varint_len(ids[i]);
        } else {
            used += cost;
        }
    }
    if start < ids.len() {
        chunks.push(start..ids.len());
    }
    chunks
}

/// Encodes `Heartbeat{seq, ids}` for ids already sorted and deduplicated, without copying them.
pub fn encode_heartbeat(seq: u64, ids: &[LeaseId], out: &mut Vec<u8>) {
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(tag::HEARTBEAT);
    put_varint(out, seq);
    put_sorted_ids(out, ids);
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn put_ids(out: &mut Vec<u8>, ids: &[LeaseId]) {
    if ids.windows(2).all(|w| w[0] < w[1]) {
        put_sorted_ids(out, ids);
    } else {
        let mut sorted = ids.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        put_sorted_ids(out, &sorted);
    }
}

/// Count, first id, then each gap minus one (ids strictly increase, so gaps are ≥ 1).
fn put_sorted_ids(out: &mut Vec<u8>, ids: &[LeaseId]) {
    put_varint(out, ids.len() as u64);
    let mut prev = None;
    for &id in ids {
        match prev {
            None => put_varint(out, id),
            Some(p) => put_varint(out, id - p - 1),
        }
        prev = Some(id);
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl Reader<'_> {
    fn byte(&mut self) -> Result<u8, WireError> {
        let (&b, rest) = self.buf.split_first().ok_or(WireError::Truncated)?;
        self.buf = rest;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.byte()?;
            if i == 9 && b > 1 {
                return Err(WireError::Varint);
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(WireError::Varint)
    }

    fn digest(&mut self) -> Result<PromptDigest, WireError> {
        let (head, rest) = self.buf.split_first_chunk::<16>().ok_or(WireError::Truncated)?;
        self.buf = rest;
        Ok(PromptDigest(*head))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        u32::try_from(self.varint()?).map_err(|_| WireError::Body("u32 out of range"))
    }

    /// A count of items each at least `min_item_bytes` long: bounded by what is left.
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, WireError> {
        let n = self.varint()?;
        if n > (self.buf.len() / min_item_bytes) as u64 {
            return Err(WireError::Body("count exceeds message"));
        }
        Ok(n as usize)
    }

    /// A UTF-8 string of at most `MAX_STRING` bytes.
    fn string(&mut self, not_utf8: &'static str) -> Result<String, WireError> {
        String::from_utf8(self.bytes(MAX_STRING)?.to_vec()).map_err(|_| WireError::Body(not_utf8))
    }

    fn bytes(&mut self, max: usize) -> Result<&[u8], WireError> {
        let n = self.varint()?;
        if n > max as u64 || n > self.buf.len() as u64 {
            return Err(WireError::Body("length exceeds message"));
        }
        let (b, rest) = self.buf.split_at(n as usize);
        self.buf = rest;
        Ok(b)
    }

    fn ids(&mut self) -> Result<Vec<LeaseId>, WireError> {
        let n = self.count(1)?;
        let mut ids = Vec::with_capacity(n);
        let mut prev: Option<u64> = None;
        for _ in 0..n {
            let v = self.varint()?;
            let id = match prev {
                None => v,
                Some(p) => p.checked_add(v).and_then(|x| x.checked_add(1)).ok_or(WireError::Body("lease id overflow"))?,
            };
            ids.push(id);
            prev = Some(id);
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> Hello {
        Hello {
            engine_id: "p,0:HB".into(),
            incarnation: u64::MAX,
            agents: vec![vec![1, 2, 3], vec![]],
            info: b"{}".to_vec(),
            t_send: 7,
            echo: (1, 2),
            auth: vec![9; 32],
        }
    }

    #[test]
    fn every_type_round_trips() {
        for m in [
            Message::Heartbeat { seq: 1, lease_ids: vec![1, 2, 3, 1000, u64::MAX] },
            Message::HeartbeatAck { seq: u64::MAX, lost_ids: vec![] },
            Message::Release { lease_ids: vec![0] },
            Message::ReadDone { lease_id: 5, consumer_rank: 3, n: 4, digest: crate::digest::PromptDigest::of(&[7, 8]) },
            Message::ReadDoneAck { lease_id: 5, live: true },
            Message::LeaseLost { lease_ids: vec![9, 10] },
            Message::ClockPing { seq: 3, t0: 4 },
            Message::ClockPong { seq: 3, t0: 4, t1: 5, t2: 6 },
            Message::Hello(hello()),
            Message::Refused { what: "geometry".into(), reason: "num_layers differs: 2 on \"p\", 4 on \"d\"".into() },
            Message::SideRelease(SideRelease {
                engine_id: "d,0:HB".into(),
                incarnation: u64::MAX,
                granted_by: 7,
                lease_ids: vec![1, 5, 1 << 40],
                what: "duplicate_engine_id".into(),
                why: "two live engines claim \"p\"".into(),
                auth: vec![3; 32],
            }),
            Message::SideReleaseAck { incarnation: 7, lost_ids: vec![5] },
        ] {
            assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn unsorted_ids_are_sorted_and_deduplicated() {
        let m = Message::Release { lease_ids: vec![5, 1, 5, 3] };
        assert_eq!(Message::decode(&m.encode()), Ok(Message::Release { lease_ids: vec![1, 3, 5] }));
    }

    #[test]
    fn consecutive_ids_cost_about_one_byte_each() {
        let ids: Vec<u64> = (1_000_000..1_001_000).collect();
        let bytes = Message::Heartbeat { seq: 42, lease_ids: ids }.encode();
        assert!(bytes.len() <= 1_010, "{} bytes for 1000 ids", bytes.len());
    }

    #[test]
    fn rejects_what_it_does_not_understand() {
        assert_eq!(Message::decode(b""), Err(WireError::Truncated));
        assert_eq!(Message::decode(b"HB:1,2"), Err(WireError::BadMagic));
        assert_eq!(Message::decode(b"KL\x01\x01"), Err(WireError::Version(1)), "version 1 had no digest in ReadDone");
        assert_eq!(Message::decode(b"KL\x02\xff"), Err(WireError::UnknownType(255)));
        let mut m = Message::Release { lease_ids: vec![1] }.encode();
        m.push(0);
        assert_eq!(Message::decode(&m), Err(WireError::Body("trailing bytes")));
        // A count claiming more ids than bytes left must not allocate them.
        assert!(Message::decode(&[b'K', b'L', VERSION, tag::RELEASE, 0xff, 0xff, 0xff, 0xff, 0x0f]).is_err());
        assert_eq!(Message::decode(&vec![0u8; MAX_MESSAGE_BYTES + 1]).map_err(|e| e.reason()), Err("oversized"));
    }

    /// SPEC D2: chunks respect the byte limit (down to 64 B) and cover every id once, in order.
    #[test]
    fn d2_heartbeat_chunks_fit_and_cover() {
        let ids: Vec<u64> =
            (0..5000u64).map(|i| i * i % 100_003 + i * 1000).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        for max in [64, 256, 1024, DEFAULT_MAX_NOTIF_BYTES] {
            let chunks = heartbeat_chunks(&ids, max);
            let mut seen = Vec::new();
            for (seq, r) in chunks.iter().enumerate() {
                let mut out = Vec::new();
                encode_heartbeat(seq as u64, &ids[r.clone()], &mut out);
                assert!(out.len() <= max, "{} > {max}", out.len());
                let Ok(Message::Heartbeat { lease_ids, .. }) = Message::decode(&out) else { panic!("decode") };
                seen.extend(lease_ids);
            }
            assert_eq!(seen, ids, "max {max}");
        }
        assert!(heartbeat_chunks(&[], 256).is_empty());
    }

    proptest! {
        /// SPEC §9: the decoder is total on arbitrary bytes.
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Message::decode(&bytes);
        }

        /// SPEC §9: valid headers followed by arbitrary bodies never panic either.
        #[test]
        fn decode_never_panics_behind_a_valid_header(t in 0u8..16, body in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut b = vec![b'K', b'L', VERSION, t];
            b.extend(body);
            if let Ok(m) = Message::decode(&b) {
                prop_assert_eq!(Message::decode(&m.encode()), Ok(m));
            }
        }

        #[test]
        fn id_lists_round_trip(mut ids in proptest::collection::vec(any::<u64>(), 0..200), seq in any::<u64>()) {
            ids.sort_unstable();
            ids.dedup();
            let m = Message::Heartbeat { seq, lease_ids: ids };
            prop_assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
    }
}
