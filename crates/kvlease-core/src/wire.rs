//! The notification codec (SPEC §9): every message between agents, as bytes.
//!
//! Layout: magic `b"KL"`, a version byte, a type byte, then the body. Integers are LEB128 varints;
//! lease-id lists are sorted, deduplicated and delta-encoded, so a heartbeat for ids granted in a
//! row costs about one byte per lease. Pull messages never carry a request id; push messages
//! (SPEC §13) name their transfer by a [`PushKey`], whose strings are length-prefixed, so nothing
//! needs escaping either. [`Message::decode`] is total: any byte string yields a message or a [`WireError`],
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
    /// Push mode, D → P (SPEC U1, U2, U8, U11): D's destination blocks for the transfer `key`
    /// names, and what P must check before writing into them.
    PushRegister(PushRegistration),
    /// Push mode, P → D: registration `attempt` of `key` is kept, paired with a live lease
    /// (`granted`) or held for the grant (SPEC U1, U2). A duplicate is acknowledged the same way.
    PushRegisterAck { key: PushKey, attempt: u32, granted: bool },
    /// Push mode, D → P: renew the leases these keys name, granted or not yet (SPEC U2, P2), and
    /// say how long D still waits for each one's writes (SPEC U8, U10). Only lost keys are
    /// answered (`PushLost`).
    PushHeartbeat { seq: u64, renewals: Vec<PushRenewal> },
    /// Push mode, D → P: D gave these transfers up (SPEC U9): free the source blocks, post no
    /// write. Answered `PushLost` once no write to them is in flight.
    PushRelease { keys: Vec<PushKey> },
    /// Push mode, P → D: P holds nothing for these keys (ended, released, or never its own): no
    /// write into their blocks is in flight and none will be posted (SPEC U3, U8, P6).
    PushLost { keys: Vec<PushKey> },
    /// Push mode, P → D: the write of destination rank `dst_rank` and pipeline stage `stage` of
    /// registration `attempt` landed (SPEC U5, U7).
    PushWriteDone { key: PushKey, attempt: u32, dst_rank: u32, stage: u32 },
    /// Push mode, P → D (SPEC U6): writes of registration `attempt` failed or will not be posted.
    /// `done` and `failed` are P's running totals for that registration, so D's tally closes
    /// however many of these arrive, in any order: once `done + failed` covers every expected
    /// write, none is in flight any more.
    PushWriteFailed { key: PushKey, attempt: u32, done: u32, failed: u32, why: PushFailure },
}

/// How a push transfer is named on both sides (SPEC U1): the router's `transfer_id` when
/// present, else the `remote_request_id` both legs carry, else the lease id P returned. The kind
/// is part of the key, so a transfer id never matches a request id that happens to be spelled
/// the same.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PushKey {
    Transfer(String),
    Request(String),
    Lease(LeaseId),
}

impl PushKey {
    /// SPEC U1: the key of a transfer from what its params carry, by precedence; empty strings
    /// count as absent. `None`: nothing to pair by (P pairs by the lease id it grants).
    pub fn choose(transfer_id: Option<&str>, remote_request_id: Option<&str>, lease_id: Option<LeaseId>) -> Option<PushKey> {
        let given = |s: Option<&str>| s.filter(|s| !s.is_empty()).map(str::to_owned);
        given(transfer_id)
            .map(PushKey::Transfer)
            .or_else(|| given(remote_request_id).map(PushKey::Request))
            .or(lease_id.map(PushKey::Lease))
    }

    /// The name a one-sided write of registration `attempt` carries to D's write gate
    /// (`WriteOp::key` of the transports): the key as messages encode it, then the attempt.
    pub fn write_key(&self, attempt: u32) -> Vec<u8> {
        let mut out = Vec::new();
        put_key(&mut out, self);
        put_varint(&mut out, u64::from(attempt));
        out
    }

    /// The key and attempt a write names ([`PushKey::write_key`]); `None` for anything else.
    pub fn from_write_key(bytes: &[u8]) -> Option<(PushKey, u32)> {
        let mut r = Reader { buf: bytes };
        let key = r.key().ok()?;
        let attempt = u32::try_from(r.varint().ok()?).ok()?;
        r.buf.is_empty().then_some((key, attempt))
    }
}

impl std::fmt::Display for PushKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PushKey::Transfer(t) => write!(f, "transfer {t:?}"),
            PushKey::Request(r) => write!(f, "request {r:?}"),
            PushKey::Lease(id) => write!(f, "lease {id}"),
        }
    }
}

/// D's registration of its destination blocks for one push transfer (SPEC U1, U8, U11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRegistration {
    pub key: PushKey,
    /// D's registrations of one key count up; a higher one supersedes the lower (SPEC U11):
    /// P writes for the newest only, and D ignores completions of the older.
    pub attempt: u32,
    /// D's incarnation (SPEC §3, U11): a registration of another life of D is not the same.
    pub incarnation: u64,
    /// The incarnation of P that D expects to write (from P's params); 0: not known yet (the
    /// router sent both legs at once). Another incarnation writes nothing (a restarted P reuses
    /// lease ids).
    pub granted_by: u64,
    /// SPEC S4, U11: the digest of D's prompt ([`PromptDigest::of`]); P writes only when it is
    /// the digest of the tokens it prefilled.
    pub digest: PromptDigest,
    /// Expected writes: one per destination rank and pipeline stage (SPEC U5, P8).
    pub dst_ranks: u32,
    pub stages: u32,
    /// D's destination blocks, in order (the same ids on every destination rank).
    pub block_ids: Vec<u32>,
    /// SPEC U8: how long from sending this D still waits for the writes; P posts none after it.
    pub window_ns: u64,
    /// SPEC D5, §3: how long before sending this D admitted the request (its decode leg, sent
    /// with the prefill leg). A P that has lived less than that, by more than a prefill leg may
    /// trail its decode leg, never had its prefill: it answers a key it does not know lost at
    /// once (a restarted P), rather than keeping it for a prefill that will not come. On the
    /// wire after `window_ns`, left off by a D that does not send it (then 0: not known).
    pub age_ns: u64,
}

/// One key of a [`Message::PushHeartbeat`]: renew it, and D still waits `window_ns` for its
/// writes (0: not registered yet, nothing to write).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRenewal {
    pub key: PushKey,
    pub window_ns: u64,
}

/// Why writes of a push transfer failed or will not be posted (SPEC U6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PushFailure {
    /// A posted write ended in error.
    WriteError = 1,
    /// The write could not be posted: no handshake toward D, or the transport refused it.
    NotPosted = 2,
    /// D's write deadline passed before the write could be posted (SPEC U8).
    Deadline = 3,
    /// P's lease ended (expired) before the writes were done.
    LeaseLost = 4,
    /// The registration's prompt digest is not P's prefill's (SPEC S4, U11).
    Digest = 5,
    /// The registration names another incarnation of P (SPEC §3, U11).
    Incarnation = 6,
    /// P's request was aborted.
    Aborted = 7,
    /// P is shutting down.
    Shutdown = 8,
    /// D registered again (a higher attempt): this registration's writes stop (SPEC U11).
    Superseded = 9,
    /// A posted write outlived P's write timeout and was given up on, over a transport that
    /// cannot cancel it (NIXL): counted failed, but it may still land (SPEC U4, U8). D must not
    /// reuse the registration's blocks until P's `PushLost` says every write of it stopped, or
    /// its own bound passes.
    TimedOut = 10,
}

impl PushFailure {
    pub const ALL: [PushFailure; 10] = [
        PushFailure::WriteError,
        PushFailure::NotPosted,
        PushFailure::Deadline,
        PushFailure::LeaseLost,
        PushFailure::Digest,
        PushFailure::Incarnation,
        PushFailure::Aborted,
        PushFailure::Shutdown,
        PushFailure::Superseded,
        PushFailure::TimedOut,
    ];

    /// A label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            PushFailure::WriteError => "write_error",
            PushFailure::NotPosted => "not_posted",
            PushFailure::Deadline => "deadline",
            PushFailure::LeaseLost => "lease_lost",
            PushFailure::Digest => "digest",
            PushFailure::Incarnation => "incarnation",
            PushFailure::Aborted => "aborted",
            PushFailure::Shutdown => "shutdown",
            PushFailure::Superseded => "superseded",
            PushFailure::TimedOut => "timed_out",
        }
    }

    fn from_code(code: u8) -> Option<PushFailure> {
        PushFailure::ALL.into_iter().find(|f| *f as u8 == code)
    }
}

/// The most writes one push registration may expect (destination ranks × pipeline stages).
pub const MAX_PUSH_WRITES: u64 = 1 << 16;

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
    /// SPEC S6, with certificates only: the key ([`crate::peers::NOTIF_KEY_LEN`] bytes) under
    /// which the Hello's recipient must tag the notifications it sends this engine's agents
    /// (over NIXL, whose notifications carry no certificate). Sent only inside mutual TLS, so
    /// only the engine the recipient's certificate names learns it. Empty otherwise, and then
    /// not on the wire (a Hello without it encodes as before it existed).
    pub notif_key: Vec<u8>,
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
    pub const PUSH_REGISTER: u8 = 13;
    pub const PUSH_REGISTER_ACK: u8 = 14;
    pub const PUSH_HEARTBEAT: u8 = 15;
    pub const PUSH_RELEASE: u8 = 16;
    pub const PUSH_LOST: u8 = 17;
    pub const PUSH_WRITE_DONE: u8 = 18;
    pub const PUSH_WRITE_FAILED: u8 = 19;
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
                if !h.notif_key.is_empty() {
                    put_bytes(out, &h.notif_key);
                }
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
            Message::PushRegister(r) => {
                out.push(tag::PUSH_REGISTER);
                put_key(out, &r.key);
                put_varint(out, u64::from(r.attempt));
                put_varint(out, r.incarnation);
                put_varint(out, r.granted_by);
                out.extend_from_slice(&r.digest.0);
                put_varint(out, u64::from(r.dst_ranks));
                put_varint(out, u64::from(r.stages));
                put_varint(out, r.block_ids.len() as u64);
                for b in &r.block_ids {
                    put_varint(out, u64::from(*b));
                }
                put_varint(out, r.window_ns);
                put_varint(out, r.age_ns);
            }
            Message::PushRegisterAck { key, attempt, granted } => {
                out.push(tag::PUSH_REGISTER_ACK);
                put_key(out, key);
                put_varint(out, u64::from(*attempt));
                out.push(u8::from(*granted));
            }
            Message::PushHeartbeat { seq, renewals } => {
                out.push(tag::PUSH_HEARTBEAT);
                put_varint(out, *seq);
                put_varint(out, renewals.len() as u64);
                for r in renewals {
                    put_key(out, &r.key);
                    put_varint(out, r.window_ns);
                }
            }
            Message::PushRelease { keys } => {
                out.push(tag::PUSH_RELEASE);
                put_keys(out, keys);
            }
            Message::PushLost { keys } => {
                out.push(tag::PUSH_LOST);
                put_keys(out, keys);
            }
            Message::PushWriteDone { key, attempt, dst_rank, stage } => {
                out.push(tag::PUSH_WRITE_DONE);
                put_key(out, key);
                for v in [attempt, dst_rank, stage] {
                    put_varint(out, u64::from(*v));
                }
            }
            Message::PushWriteFailed { key, attempt, done, failed, why } => {
                out.push(tag::PUSH_WRITE_FAILED);
                put_key(out, key);
                for v in [attempt, done, failed] {
                    put_varint(out, u64::from(*v));
                }
                out.push(*why as u8);
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
            tag::READ_DONE_ACK => Message::ReadDoneAck { lease_id: r.varint()?, live: r.bool()? },
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
                let auth = r.bytes(MAX_STRING)?.to_vec();
                // On the wire only when there is one: one encoding per Hello.
                let notif_key = match r.buf.is_empty() {
                    true => Vec::new(),
                    false => match r.bytes(MAX_STRING)? {
                        [] => return Err(WireError::Body("empty notification key")),
                        k => k.to_vec(),
                    },
                };
                Message::Hello(Hello { engine_id, incarnation, agents, info, t_send, echo, auth, notif_key })
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
            tag::PUSH_REGISTER => {
                let (key, attempt, incarnation, granted_by, digest) = (r.key()?, r.u32()?, r.varint()?, r.varint()?, r.digest()?);
                let (dst_ranks, stages) = (r.u32()?, r.u32()?);
                if u64::from(dst_ranks) * u64::from(stages) > MAX_PUSH_WRITES {
                    return Err(WireError::Body("too many expected writes"));
                }
                let n = r.count(1)?;
                let mut block_ids = Vec::with_capacity(n);
                for _ in 0..n {
                    block_ids.push(r.u32()?);
                }
                let window_ns = r.varint()?;
                let age_ns = if r.buf.is_empty() { 0 } else { r.varint()? };
                Message::PushRegister(PushRegistration {
                    key,
                    attempt,
                    incarnation,
                    granted_by,
                    digest,
                    dst_ranks,
                    stages,
                    block_ids,
                    window_ns,
                    age_ns,
                })
            }
            tag::PUSH_REGISTER_ACK => Message::PushRegisterAck { key: r.key()?, attempt: r.u32()?, granted: r.bool()? },
            tag::PUSH_HEARTBEAT => {
                let seq = r.varint()?;
                // A key and a window take at least three bytes.
                let n = r.count(3)?;
                let mut renewals = Vec::with_capacity(n);
                for _ in 0..n {
                    renewals.push(PushRenewal { key: r.key()?, window_ns: r.varint()? });
                }
                Message::PushHeartbeat { seq, renewals }
            }
            tag::PUSH_RELEASE => Message::PushRelease { keys: r.keys()? },
            tag::PUSH_LOST => Message::PushLost { keys: r.keys()? },
            tag::PUSH_WRITE_DONE => Message::PushWriteDone { key: r.key()?, attempt: r.u32()?, dst_rank: r.u32()?, stage: r.u32()? },
            tag::PUSH_WRITE_FAILED => Message::PushWriteFailed {
                key: r.key()?,
                attempt: r.u32()?,
                done: r.u32()?,
                failed: r.u32()?,
                why: PushFailure::from_code(r.byte()?).ok_or(WireError::Body("unknown push failure"))?,
            },
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

/// A kind byte (0 transfer id, 1 request id, 2 lease id), then the string or the id.
fn put_key(out: &mut Vec<u8>, key: &PushKey) {
    match key {
        PushKey::Transfer(t) => {
            out.push(0);
            put_bytes(out, t.as_bytes());
        }
        PushKey::Request(r) => {
            out.push(1);
            put_bytes(out, r.as_bytes());
        }
        PushKey::Lease(id) => {
            out.push(2);
            put_varint(out, *id);
        }
    }
}

fn put_keys(out: &mut Vec<u8>, keys: &[PushKey]) {
    put_varint(out, keys.len() as u64);
    for k in keys {
        put_key(out, k);
    }
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

    fn bool(&mut self) -> Result<bool, WireError> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(WireError::Body("bool")),
        }
    }

    fn key(&mut self) -> Result<PushKey, WireError> {
        match self.byte()? {
            0 => Ok(PushKey::Transfer(self.string("transfer id is not UTF-8")?)),
            1 => Ok(PushKey::Request(self.string("request id is not UTF-8")?)),
            2 => Ok(PushKey::Lease(self.varint()?)),
            _ => Err(WireError::Body("unknown push key kind")),
        }
    }

    fn keys(&mut self) -> Result<Vec<PushKey>, WireError> {
        // A key takes at least two bytes.
        let n = self.count(2)?;
        let mut keys = Vec::with_capacity(n);
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
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
            notif_key: Vec::new(),
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
            Message::Hello(Hello { notif_key: vec![5; 32], ..hello() }),
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
        ]
        .into_iter()
        .chain(push_messages())
        {
            assert_eq!(Message::decode(&m.encode()), Ok(m));
        }
    }

    fn registration() -> PushRegistration {
        PushRegistration {
            key: PushKey::Transfer("t,1:HB \"é\"".into()),
            attempt: 2,
            incarnation: u64::MAX,
            granted_by: 0,
            digest: crate::digest::PromptDigest::of(&[1, 2, 3]),
            dst_ranks: 4,
            stages: 2,
            block_ids: vec![9, 3, 7, u32::MAX],
            window_ns: 30_000_000_000,
            age_ns: 4_000_000_000,
        }
    }

    /// SPEC D5: a registration from a D that does not send its age (nothing after the window)
    /// decodes with age 0 (not known), and a present age round-trips.
    #[test]
    fn a_registration_without_its_age_decodes_as_age_unknown() {
        let with_age = Message::PushRegister(registration());
        let mut bytes = with_age.encode();
        assert_eq!(Message::decode(&bytes), Ok(with_age));
        let age_len = {
            let mut v = Vec::new();
            put_varint(&mut v, registration().age_ns);
            v.len()
        };
        bytes.truncate(bytes.len() - age_len);
        assert_eq!(Message::decode(&bytes), Ok(Message::PushRegister(PushRegistration { age_ns: 0, ..registration() })));
    }

    /// One of each push message (SPEC §13), every key kind among them.
    fn push_messages() -> Vec<Message> {
        let keys = vec![PushKey::Transfer(String::new()), PushKey::Request("r-1".into()), PushKey::Lease(u64::MAX)];
        let mut m = vec![
            Message::PushRegister(registration()),
            Message::PushRegister(PushRegistration { key: PushKey::Lease(5), block_ids: vec![], ..registration() }),
            Message::PushRegisterAck { key: PushKey::Request("r".into()), attempt: 0, granted: true },
            Message::PushHeartbeat { seq: 9, renewals: keys.iter().map(|k| PushRenewal { key: k.clone(), window_ns: 1 << 40 }).collect() },
            Message::PushHeartbeat { seq: 0, renewals: vec![] },
            Message::PushRelease { keys: keys.clone() },
            Message::PushLost { keys: keys.clone() },
            Message::PushWriteDone { key: PushKey::Lease(3), attempt: 1, dst_rank: 7, stage: 3 },
        ];
        m.extend(PushFailure::ALL.map(|why| Message::PushWriteFailed { key: keys[1].clone(), attempt: 1, done: 2, failed: 6, why }));
        m
    }

    /// SPEC U1: the key is the router's transfer id, else the request id both legs carry, else
    /// P's lease id; an empty id counts as absent, and the kinds never match each other.
    #[test]
    fn u1_push_keys_are_chosen_by_precedence() {
        assert_eq!(PushKey::choose(Some("t"), Some("r"), Some(5)), Some(PushKey::Transfer("t".into())));
        for k in [PushKey::Transfer("t/1".into()), PushKey::Request("r".into()), PushKey::Lease(u64::MAX)] {
            assert_eq!(PushKey::from_write_key(&k.write_key(7)), Some((k.clone(), 7)));
            let mut longer = k.write_key(7);
            longer.push(0);
            assert_eq!(PushKey::from_write_key(&longer), None, "trailing bytes name nothing");
        }
        assert_eq!(PushKey::from_write_key(&[9, 1]), None);
        assert_eq!(PushKey::choose(Some(""), Some("r"), Some(5)), Some(PushKey::Request("r".into())));
        assert_eq!(PushKey::choose(None, None, Some(5)), Some(PushKey::Lease(5)));
        assert_eq!(PushKey::choose(None, Some(""), None), None);
        assert_ne!(PushKey::Transfer("x".into()), PushKey::Request("x".into()));
        let on_wire = |k: PushKey| Message::PushLost { keys: vec![k] }.encode();
        assert_ne!(on_wire(PushKey::Transfer("x".into())), on_wire(PushKey::Request("x".into())));
    }

    /// SPEC §9, P7 for the push messages: what is malformed is refused, never a panic, never an
    /// allocation the input does not justify.
    #[test]
    fn malformed_push_messages_are_refused() {
        let header = |t: u8| vec![b'K', b'L', VERSION, t];
        let with = |t: u8, body: &[u8]| {
            let mut b = header(t);
            b.extend_from_slice(body);
            Message::decode(&b)
        };
        assert_eq!(with(tag::PUSH_LOST, &[1, 3, 0]), Err(WireError::Body("unknown push key kind")));
        assert_eq!(with(tag::PUSH_LOST, &[1, 0, 2, 0xff, 0xfe]), Err(WireError::Body("transfer id is not UTF-8")));
        assert_eq!(with(tag::PUSH_LOST, &[1, 1, 9, b'a']), Err(WireError::Body("length exceeds message")));
        assert_eq!(with(tag::PUSH_RELEASE, &[0xff, 0xff, 0xff, 0xff, 0x0f, 2, 0]), Err(WireError::Body("count exceeds message")));
        assert_eq!(with(tag::PUSH_HEARTBEAT, &[1, 0xff, 0xff, 0x03, 2, 0, 0]), Err(WireError::Body("count exceeds message")));
        assert_eq!(with(tag::PUSH_REGISTER_ACK, &[2, 1, 0, 2]), Err(WireError::Body("bool")));
        assert_eq!(with(tag::PUSH_WRITE_FAILED, &[2, 1, 0, 0, 0, 0]), Err(WireError::Body("unknown push failure")));
        assert_eq!(with(tag::PUSH_WRITE_FAILED, &[2, 1, 0, 0, 0, 11]), Err(WireError::Body("unknown push failure")));
        assert_eq!(with(tag::PUSH_WRITE_DONE, &[2, 1, 0, 0xff, 0xff, 0xff, 0xff, 0x1f, 0]), Err(WireError::Body("u32 out of range")));
        assert_eq!(with(tag::PUSH_WRITE_DONE, &[2, 1, 0]), Err(WireError::Truncated));
        let too_many = PushRegistration { dst_ranks: 1 << 9, stages: 1 << 8, ..registration() };
        assert_eq!(Message::decode(&Message::PushRegister(too_many).encode()), Err(WireError::Body("too many expected writes")));
        let mut m = Message::PushRegister(registration()).encode();
        m.push(0);
        assert_eq!(Message::decode(&m), Err(WireError::Body("trailing bytes")));
        for msg in push_messages() {
            let b = msg.encode();
            // A registration's age is optional on the wire: cut whole, it decodes as age 0
            // (`a_registration_without_its_age_decodes_as_age_unknown`).
            let optional = match &msg {
                Message::PushRegister(r) => {
                    let mut v = Vec::new();
                    put_varint(&mut v, r.age_ns);
                    v.len()
                }
                _ => 0,
            };
            for cut in (0..b.len()).filter(|&cut| optional == 0 || cut != b.len() - optional) {
                assert!(Message::decode(&b[..cut]).is_err(), "{msg:?} cut at {cut}");
            }
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
        fn decode_never_panics_behind_a_valid_header(t in 0u8..24, body in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut b = vec![b'K', b'L', VERSION, t];
            b.extend(body);
            if let Ok(m) = Message::decode(&b) {
                prop_assert_eq!(Message::decode(&m.encode()), Ok(m));
            }
        }

        /// SPEC §9, U1: push keys of any text round-trip.
        #[test]
        fn push_keys_round_trip(t in ".{0,40}", r in ".{0,40}", id in any::<u64>(), window in any::<u64>()) {
            let keys = vec![PushKey::Transfer(t), PushKey::Request(r), PushKey::Lease(id)];
            let m = Message::PushHeartbeat { seq: id, renewals: keys.iter().map(|k| PushRenewal { key: k.clone(), window_ns: window }).collect() };
            prop_assert_eq!(Message::decode(&m.encode()), Ok(m));
            let m = Message::PushRelease { keys };
            prop_assert_eq!(Message::decode(&m.encode()), Ok(m));
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
