//! `kv_transfer_params`: what a request says about where its KV comes from or goes (SPEC §10),
//! with vLLM's field names, and their signature (SPEC S1).
//!
//! P signs the fields D acts on — among them the digest of the prompt they belong to — with
//! HMAC-SHA256 under the cluster's secret, so a client cannot make D read another request's KV
//! cache by crafting params (SPEC S1: a 400). With or without a secret, the params carry the
//! digest of the prompt P prefilled bound to the fields D reads by — engine, incarnation, lease
//! id, number of tokens, the ordered block list (`kvlease_prompt_digest`, SPEC S4) — which D
//! computes again from its own prompt and the fields it received before reading: genuine params
//! handed to the wrong prompt, or mangled by a router, are a mix-up, not a forgery, and D
//! computes that prompt itself (and releases the lease at once, O4). Parsing is strict about what D acts on and tolerant of anything else (vLLM's router
//! adds fields of its own).

use std::fmt;

use crate::config::LoadFailurePolicy;
use crate::digest::{Bound, PromptDigest};
use crate::renewer::Remote;
use hmac::{Hmac, Mac};
use serde_json::{json, Map, Value};
use sha2::Sha256;
use thiserror::Error;

/// What a request asks of this engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvRole {
    /// No disaggregation: prefill and decode here.
    Local,
    /// `do_remote_decode`: prefill here, keep the KV under a lease for a remote decoder. With
    /// a decoder's `remote_*` fields (its cached turn, SPEC B1), the prefill may read the
    /// conversation so far back from that decoder (B4).
    PrefillForRemote(Option<Box<TurnKv>>),
    /// `do_remote_prefill`: the prompt's KV is on a remote engine; pull it, then decode here.
    DecodeRemote(RemoteKv),
    /// `do_remote_prefill` in push mode (SPEC §13): P will write the prompt's KV into blocks
    /// this engine allocates and registers with it; then decode here.
    DecodePush(PushRemote),
}

/// Push mode, D's side (SPEC §13, U1): the P engine that writes the prompt's KV and the key
/// both legs name the transfer by. Parsed from vLLM's push router's params (P's coordinates, a
/// `remote_request_id`, no blocks) and from P's own push answer forwarded by a sequential router
/// (`transfer_mode: "push"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushRemote {
    pub engine_id: String,
    pub host: String,
    pub port: u16,
    pub tp_size: u32,
    /// P's pipeline stages: one write per destination rank and stage (SPEC U5, U7).
    pub pp_size: u32,
    pub key: crate::wire::PushKey,
    /// `remote_incarnation` when P answered already (a sequential router); 0 when the router
    /// sent both legs at once (SPEC U11: then any incarnation of P may pair).
    pub incarnation: u64,
}

impl PushRemote {
    /// Where P is, for D's renewer (its handshake, D5).
    pub fn remote(&self) -> Remote {
        Remote { engine_id: self.engine_id.clone(), host: self.host.clone(), port: self.port, incarnation: self.incarnation }
    }
}

/// Push-mode `do_remote_prefill` params for D (SPEC §13): P's coordinates and the transfer's
/// key, as vLLM's push connector names them, and no blocks — D registers its own. P answers a
/// prefill with them (its token count and incarnation known); a router sending both legs at
/// once builds them from what it learned of P (neither known yet: any incarnation pairs, U11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushAnswer<'a> {
    pub engine_id: &'a str,
    pub host: &'a str,
    pub port: u16,
    pub tp_size: u32,
    pub num_tokens: Option<u32>,
    pub incarnation: Option<u64>,
    pub key: &'a crate::wire::PushKey,
}

impl PushAnswer<'_> {
    pub fn to_json(&self) -> Value {
        use crate::wire::PushKey;
        let mut v = json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "transfer_mode": "push",
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "pp_size": 1,
        });
        if let Value::Object(o) = &mut v {
            if let Some(n) = self.num_tokens {
                o.insert("remote_num_tokens".into(), json!(n));
            }
            if let Some(i) = self.incarnation {
                o.insert("remote_incarnation".into(), json!(i.to_string()));
            }
            match self.key {
                PushKey::Transfer(t) => o.insert("transfer_id".into(), json!(t)),
                PushKey::Request(r) => o.insert("remote_request_id".into(), json!(r)),
                PushKey::Lease(id) => o.insert("remote_lease_id".into(), json!(id)),
            };
        }
        v
    }
}

/// Where a prompt's KV waits, as P described it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteKv {
    pub engine_id: String,
    pub request_id: String,
    pub block_ids: Vec<u32>,
    pub host: String,
    pub port: u16,
    pub tp_size: u32,
    pub num_tokens: u32,
    pub lease_id: u64,
    pub incarnation: u64,
    /// SPEC S4: the digest of the token ids P prefilled, bound to the fields of [`RemoteKv::bound`].
    pub prompt_digest: PromptDigest,
    pub signature: Option<String>,
}

/// A decoder's cached turn, as its params describe it (SPEC B1).
#[derive(Debug, Clone, PartialEq)]
pub struct TurnKv {
    pub kv: RemoteKv,
    /// `remote_blocks_expiry_time`: when the blocks expire, on the decoder's monotonic clock (s).
    pub expiry_time: Option<f64>,
    /// `remote_blocks_ttl_remaining`: seconds they had left when the decoder answered.
    pub ttl_remaining: Option<f64>,
}

impl Eq for TurnKv {}

/// A bad `kv_transfer_params`: a 400 naming the field.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("kv_transfer_params: {0}")]
pub struct ParamError(pub String);

impl KvRole {
    /// Reads `kv_transfer_params` (absent or null: a local request).
    pub fn parse(params: Option<&Value>) -> Result<KvRole, ParamError> {
        let obj = match params {
            None | Some(Value::Null) => return Ok(KvRole::Local),
            Some(Value::Object(o)) => o,
            Some(_) => return Err(ParamError("must be an object".into())),
        };
        let decode = flag(obj, "do_remote_decode")?;
        let prefill = flag(obj, "do_remote_prefill")?;
        match (decode, prefill) {
            (true, true) => Err(ParamError("do_remote_decode and do_remote_prefill cannot both be true".into())),
            (false, false) => Ok(KvRole::Local),
            // A fresh request (vLLM's router sends the remote fields as null), or the next turn
            // of a conversation, naming the decoder that keeps the last one.
            (true, false) => match obj.get("remote_engine_id") {
                None | Some(Value::Null) => Ok(KvRole::PrefillForRemote(None)),
                Some(_) => Ok(KvRole::PrefillForRemote(Some(Box::new(TurnKv {
                    kv: remote(obj, "do_remote_decode")?,
                    expiry_time: seconds(obj, "remote_blocks_expiry_time")?,
                    ttl_remaining: seconds(obj, "remote_blocks_ttl_remaining")?,
                })))),
            },
            (false, true) if is_push(obj)? => Ok(KvRole::DecodePush(push_remote(obj)?)),
            (false, true) => Ok(KvRole::DecodeRemote(remote(obj, "do_remote_prefill")?)),
        }
    }

    /// `transfer_id` of a `do_remote_decode` request (SPEC U1): the key P pairs its push lease
    /// by, when the router names one.
    pub fn transfer_id(params: Option<&Value>) -> Result<Option<String>, ParamError> {
        match params.and_then(|p| p.get("transfer_id")) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_TRANSFER_ID => Ok(Some(s.clone())),
            Some(v) => Err(ParamError(format!("transfer_id must be a string of 1 to {MAX_TRANSFER_ID} bytes, not {v}"))),
        }
    }
}

/// The longest `transfer_id` (or `remote_request_id` a push transfer is keyed by) accepted.
pub const MAX_TRANSFER_ID: usize = 256;

/// SPEC §13: whether `do_remote_prefill` params are push mode's: `transfer_mode: "push"`, or
/// P's coordinates with no blocks and no lease (vLLM's push router sends neither). Pull params
/// whose block list a router emptied still name their lease: they stay pull params (and are
/// refused as such, S4), so their lease is not stranded.
fn is_push(obj: &Map<String, Value>) -> Result<bool, ParamError> {
    match obj.get("transfer_mode") {
        Some(Value::String(m)) if m == "push" => Ok(true),
        Some(Value::String(m)) if m == "pull" => Ok(false),
        None | Some(Value::Null) => Ok(obj.get("remote_lease_id").is_none_or(Value::is_null)
            && match obj.get("remote_block_ids") {
                None | Some(Value::Null) => true,
                Some(Value::Array(a)) => a.is_empty(),
                Some(_) => false,
            }),
        Some(v) => Err(ParamError(format!("transfer_mode must be \"pull\" or \"push\", not {v}"))),
    }
}

/// Push-mode `do_remote_prefill` params (SPEC §13, U1).
fn push_remote(obj: &Map<String, Value>) -> Result<PushRemote, ParamError> {
    let with = "do_remote_prefill in push mode";
    let port = uint(obj, "remote_port", with)?;
    let small = |key: &str| -> Result<u32, ParamError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(1),
            Some(_) => {
                u32::try_from(uint(obj, key, with)?).ok().filter(|t| *t >= 1).ok_or_else(|| ParamError(format!("{key} must be ≥ 1")))
            }
        }
    };
    let text = |key: &str| -> Result<Option<String>, ParamError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.len() <= MAX_TRANSFER_ID => Ok(Some(s.clone())),
            Some(v) => Err(ParamError(format!("{key} must be a string of at most {MAX_TRANSFER_ID} bytes, not {v}"))),
        }
    };
    let lease_id = match obj.get("remote_lease_id") {
        None | Some(Value::Null) => None,
        Some(_) => Some(uint(obj, "remote_lease_id", with)?),
    };
    let key = crate::wire::PushKey::choose(text("transfer_id")?.as_deref(), text("remote_request_id")?.as_deref(), lease_id)
        .ok_or_else(|| ParamError("push mode needs transfer_id or remote_request_id to pair the two legs by (SPEC U1)".into()))?;
    let pp_size = small("pp_size")?;
    if pp_size > 64 {
        return Err(ParamError(format!("pp_size {pp_size} is more than 64 pipeline stages")));
    }
    Ok(PushRemote {
        engine_id: string(obj, "remote_engine_id", with)?,
        host: string(obj, "remote_host", with)?,
        port: u16::try_from(port).ok().filter(|p| *p != 0).ok_or_else(|| ParamError(format!("remote_port {port} is not a port")))?,
        tp_size: small("tp_size")?,
        pp_size,
        key,
        incarnation: match obj.get("remote_incarnation") {
            None | Some(Value::Null) => 0,
            Some(Value::String(s)) => s.parse().map_err(|_| ParamError("remote_incarnation must be a number".into()))?,
            Some(_) => uint(obj, "remote_incarnation", with)?,
        },
    })
}

/// The `remote_*` fields of params: where a prompt's KV waits. `with` names the flag they came
/// with, for errors.
fn remote(obj: &Map<String, Value>, with: &str) -> Result<RemoteKv, ParamError> {
    let string = |key: &str| string(obj, key, with);
    let uint = |key: &str| uint(obj, key, with);
    // Flat, or nested per KV group as current vLLM sends them (the synthetic model has one
    // group, so one inner list).
    let flat = match obj.get("remote_block_ids") {
        Some(Value::Array(groups)) if groups.iter().all(Value::is_array) && !groups.is_empty() => match groups.as_slice() {
            [Value::Array(one)] => Some(one),
            _ => return Err(ParamError(format!("remote_block_ids has {} KV groups; this model has one", groups.len()))),
        },
        Some(Value::Array(a)) => Some(a),
        _ => None,
    };
    let block_ids = match flat {
        Some(a) if !a.is_empty() => a
            .iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| ParamError("remote_block_ids must be a list of block numbers".into()))?,
        _ => return Err(ParamError("remote_block_ids must be a non-empty list".into())),
    };
    let port = uint("remote_port")?;
    Ok(RemoteKv {
        engine_id: string("remote_engine_id")?,
        request_id: string("remote_request_id")?,
        block_ids,
        host: string("remote_host")?,
        port: u16::try_from(port).ok().filter(|p| *p != 0).ok_or_else(|| ParamError(format!("remote_port {port} is not a port")))?,
        tp_size: match obj.get("tp_size") {
            None | Some(Value::Null) => 1,
            Some(_) => u32::try_from(uint("tp_size")?).ok().filter(|t| *t >= 1).ok_or_else(|| ParamError("tp_size must be ≥ 1".into()))?,
        },
        num_tokens: u32::try_from(uint("remote_num_tokens")?).map_err(|_| ParamError("remote_num_tokens is too large".into()))?,
        lease_id: uint("remote_lease_id")?,
        // Required: lease ids restart with each incarnation of P, so a lease id without one
        // could name another request's blocks after a restart.
        incarnation: match obj.get("remote_incarnation") {
            Some(Value::String(s)) => s.parse().ok().filter(|i| *i != 0),
            _ => Some(uint("remote_incarnation")?).filter(|i| *i != 0),
        }
        .ok_or_else(|| ParamError("remote_incarnation must be a non-zero number".into()))?,
        // Required: without it D could not tell another prompt's KV from its own.
        prompt_digest: match obj.get("kvlease_prompt_digest") {
            Some(Value::String(s)) => PromptDigest::from_hex(s),
            _ => None,
        }
        .ok_or_else(|| ParamError("kvlease_prompt_digest must be the 32 hex digits P sent".into()))?,
        signature: match obj.get("kvlease_signature") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(ParamError("kvlease_signature must be a string".into())),
        },
    })
}

/// An optional number of seconds, ≥ 0.
fn seconds(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ParamError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64().filter(|s| s.is_finite() && *s >= 0.0) {
            Some(s) => Ok(Some(s)),
            None => Err(ParamError(format!("{key} must be a number of seconds ≥ 0, not {v}"))),
        },
    }
}

impl RemoteKv {
    /// The params P returns to the router, signed when a secret is configured. The incarnation
    /// travels as a string too: JSON numbers above 2^53 lose precision in many clients.
    pub fn to_json(&self, secret: Option<&[u8]>) -> Value {
        let mut v = json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": self.block_ids,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "remote_num_tokens": self.num_tokens,
            "remote_lease_id": self.lease_id,
            "remote_incarnation": self.incarnation.to_string(),
            "kvlease_prompt_digest": self.prompt_digest.to_hex(),
        });
        if let (Some(secret), Value::Object(o)) = (secret, &mut v) {
            o.insert("kvlease_signature".into(), Value::String(self.sign(secret)));
        }
        v
    }

    /// SPEC B1: the params a decoder returns for the turn it keeps: P's params turned around
    /// (`do_remote_decode`, so the router hands them to the next turn's prefill), with when the
    /// blocks expire on the decoder's clock and how long they had left (clock-free), in seconds.
    pub fn to_turn_json(&self, secret: Option<&[u8]>, expiry_time: f64, ttl_remaining: f64) -> Value {
        let mut v = self.to_json(secret);
        if let Value::Object(o) = &mut v {
            o.insert("do_remote_prefill".into(), Value::Bool(false));
            o.insert("do_remote_decode".into(), Value::Bool(true));
            o.insert("remote_blocks_expiry_time".into(), json!(expiry_time));
            o.insert("remote_blocks_ttl_remaining".into(), json!(ttl_remaining));
        }
        v
    }

    /// SPEC S4: whether these params describe `prompt`: it is the prompt P prefilled (the same
    /// length and tokens), with the fields P granted its lease under (the same engine,
    /// incarnation, lease id and blocks in the same order).
    pub fn describes(&self, prompt: &[u32]) -> bool {
        self.prompt_digest.describes(self.num_tokens, prompt, &self.bound())
    }

    /// Where the lease is, for D's renewer.
    pub fn remote(&self) -> Remote {
        Remote { engine_id: self.engine_id.clone(), host: self.host.clone(), port: self.port, incarnation: self.incarnation }
    }

    /// SPEC S4: the fields the digest binds.
    pub fn bound(&self) -> Bound<'_> {
        Bound { engine_id: &self.engine_id, incarnation: self.incarnation, lease_id: self.lease_id, block_ids: &self.block_ids }
    }

    /// SPEC S1: D checks P's signature over the fields it acts on, the prompt digest among them.
    pub fn verify(&self, secret: &[u8]) -> Result<(), ParamError> {
        let Some(sig) = &self.signature else {
            return Err(ParamError("unsigned; this engine requires params signed by the prefill engine (kvlease_signature)".into()));
        };
        let Ok(bytes) = hex::decode(sig) else { return Err(ParamError("kvlease_signature is not hex".into())) };
        self.mac(secret)
            .verify_slice(&bytes)
            .map_err(|_| ParamError("kvlease_signature does not match these params: altered, or signed with another secret".into()))
    }

    fn sign(&self, secret: &[u8]) -> String {
        hex::encode(self.mac(secret).finalize().into_bytes())
    }

    /// Every field with its length before it, so no field's bytes can pass for another's.
    fn mac(&self, secret: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
        let mut field = |bytes: &[u8]| {
            mac.update(&(bytes.len() as u64).to_le_bytes());
            mac.update(bytes);
        };
        field(b"kvlease-params-v2");
        for s in [&self.engine_id, &self.request_id, &self.host] {
            field(s.as_bytes());
        }
        for n in [u64::from(self.port), u64::from(self.tp_size), u64::from(self.num_tokens), self.lease_id, self.incarnation] {
            field(&n.to_le_bytes());
        }
        field(&self.prompt_digest.0);
        let blocks: Vec<u8> = self.block_ids.iter().flat_map(|b| b.to_le_bytes()).collect();
        field(&blocks);
        mac
    }
}

/// What a decode engine knows of itself to decide what to do with a request's params (SPEC S1,
/// S4, O3, O4): the one place those decisions are made, for the engine and the vLLM connector.
#[derive(Debug, Clone, Copy)]
pub struct Admission<'a> {
    /// The cluster's secret (S1): params must carry P's signature.
    pub secret: Option<&'a [u8]>,
    /// This engine's id and incarnation: params naming them are its own lease (O4).
    pub engine_id: &'a str,
    pub incarnation: u64,
    /// The model's block size and KV heads: the shape the params must fit.
    pub block_size: u32,
    pub num_kv_heads: u32,
    /// `kv_load_failure_policy`: params not read are recomputed, or the request refused.
    pub policy: LoadFailurePolicy,
}

/// What a decode request does with P's params.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Read the KV from P: claim the lease for this request (renewed from now on, D1); if another
    /// request here already holds it, ask [`Admission::not_read`] with [`NotRead::Replay`].
    Pull,
    /// Params of this engine's own live incarnation (a `kv_both` engine paired with itself, O4):
    /// take the blocks from its own lease; if that lease ended, ask [`Admission::not_read`] with
    /// [`NotRead::OwnLeaseEnded`].
    Own,
    /// Not read. `release` names whose lease to release at once (O4); then the request computes
    /// the prompt itself, or (`refuse`, `kv_load_failure_policy=fail`) is refused with a 400 that
    /// releases nothing more ([`Refusal::keeps_lease`]).
    NotRead { why: NotRead, release: Option<Whose>, refuse: bool },
    /// A 400 naming `kv_transfer_params`: forged (S1) or not of this model's shape.
    Invalid(ParamError),
}

/// Why params are not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotRead {
    /// S4: another prompt's params, or altered on the way (a router that mixed or mangled them).
    OtherPrompt,
    /// This engine's own lease, which has ended (or was a previous run's).
    OwnLeaseEnded,
    /// Another request here is already reading with these params.
    Replay,
}

/// Whose lease a decode engine releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whose {
    /// This engine's own lease (its own live incarnation).
    Ours,
    /// The prefill engine's, through the renewer.
    Theirs,
}

impl NotRead {
    /// The reason, as the log line and a refusal's message give it.
    pub fn message(self) -> &'static str {
        match self {
            NotRead::OtherPrompt => "kv_transfer_params belong to another prompt or were altered on the way (kvlease_prompt_digest does not match this prompt with the blocks, lease and engine they name)",
            NotRead::OwnLeaseEnded => "kv_transfer_params name a lease of this engine that has ended (or a previous run of it)",
            NotRead::Replay => "another request on this engine is already reading with these kv_transfer_params",
        }
    }
}

impl fmt::Display for NotRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl Admission<'_> {
    /// SPEC S1, S4, O4 and the params' shape: what a `do_remote_prefill` request of `prompt` does
    /// with `rk`. S1 first (forged params are refused and never release anything), then S4 (a
    /// mix-up is not read, and its lease released at once), then the shape (block count, tensor
    /// parallel size), then whose lease it is.
    pub fn admit(&self, rk: &RemoteKv, prompt: &[u32]) -> Admit {
        if let Err(e) = self.verify(rk) {
            return Admit::Invalid(e);
        }
        if !rk.describes(prompt) {
            return Admit::NotRead { why: NotRead::OtherPrompt, release: self.whose(rk), refuse: self.refuses() };
        }
        // `describes` held: the prompt has `remote_num_tokens` tokens.
        let want_blocks = prompt.len().div_ceil(self.block_size.max(1) as usize);
        if rk.block_ids.len() != want_blocks {
            return Admit::Invalid(ParamError(format!(
                "kv_transfer_params name {} blocks; this prompt of {} tokens fills {} blocks of {}",
                rk.block_ids.len(),
                prompt.len(),
                want_blocks,
                self.block_size
            )));
        }
        if let Err(e) = self.fits(rk) {
            return Admit::Invalid(e);
        }
        match self.whose(rk) {
            Some(Whose::Ours) => Admit::Own,
            Some(Whose::Theirs) => Admit::Pull,
            None => self.not_read(NotRead::OwnLeaseEnded),
        }
    }

    /// Params the request could not use after all (its own lease ended, or another request here
    /// reads with them): computed locally, or refused under `kv_load_failure_policy=fail`. Nothing
    /// is released: the lease is not this request's.
    pub fn not_read(&self, why: NotRead) -> Admit {
        Admit::NotRead { why, release: None, refuse: self.refuses() }
    }

    /// SPEC S1: params must carry P's signature when the cluster has a secret.
    pub fn verify(&self, rk: &RemoteKv) -> Result<(), ParamError> {
        match self.secret {
            Some(secret) => rk.verify(secret),
            None => Ok(()),
        }
    }

    /// The tensor parallel size the params name must divide this model's KV heads (SPEC T1).
    pub fn fits(&self, rk: &RemoteKv) -> Result<(), ParamError> {
        if rk.tp_size == 0 || !self.num_kv_heads.is_multiple_of(rk.tp_size) {
            return Err(ParamError(format!("tp_size {} does not divide {} KV heads", rk.tp_size, self.num_kv_heads)));
        }
        Ok(())
    }

    /// SPEC O3: a request carrying params that is refused before admission releases the lease
    /// they name at once — P's through the renewer, or this engine's own (a `kv_both` engine
    /// handed its own params) — but only params that verify (S1: a forgery releases nothing),
    /// of a live incarnation, and whose refusal does not say they are another request's
    /// ([`Refusal::keeps_lease`]). For P's lease the caller also leaves it alone when another
    /// request here is reading with it (a refused replay). Returns whose lease to release.
    pub fn releases_on_refusal(&self, rk: &RemoteKv, refusal: Refusal) -> Option<Whose> {
        (refusal == Refusal::Request && self.verify(rk).is_ok()).then(|| self.whose(rk)).flatten()
    }

    /// P: params to end one of this engine's leases (the proxy's O3 release) must be this
    /// engine's, this run's, and signed when the cluster has a secret.
    pub fn names_our_lease(&self, rk: &RemoteKv) -> Result<(), ParamError> {
        self.verify(rk)?;
        if rk.engine_id != self.engine_id || rk.incarnation != self.incarnation {
            return Err(ParamError(format!(
                "the lease belongs to engine {} (incarnation {}), not to this one ({}, {})",
                rk.engine_id, rk.incarnation, self.engine_id, self.incarnation
            )));
        }
        Ok(())
    }

    /// Whose lease the params name; `None` for this engine's name with another incarnation (a
    /// previous run's lease: nobody here can read or renew it).
    fn whose(&self, rk: &RemoteKv) -> Option<Whose> {
        match rk.engine_id == self.engine_id {
            true if rk.incarnation == self.incarnation => Some(Whose::Ours),
            true => None,
            false => Some(Whose::Theirs),
        }
    }

    fn refuses(&self) -> bool {
        self.policy == LoadFailurePolicy::Fail
    }
}

/// How a request carrying P's params was refused, for SPEC O3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The request's own fault (a bad field, the wrong model, too long, bad params): the lease
    /// its params name is its own, released at once (O3).
    Request,
    /// The params are not the request's own ([`Admit::NotRead`] refused): the lease belongs to
    /// another request, so refusing this one keeps it.
    NotItsParams,
}

impl Refusal {
    /// Whether the lease the params name stays (the refusal says they are another request's).
    pub fn keeps_lease(self) -> bool {
        self == Refusal::NotItsParams
    }
}

fn flag(obj: &Map<String, Value>, key: &str) -> Result<bool, ParamError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ParamError(format!("{key} must be true or false, not {v}"))),
    }
}

fn string(obj: &Map<String, Value>, key: &str, with: &str) -> Result<String, ParamError> {
    match obj.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::Number(n)) if key == "remote_host" => Ok(n.to_string()),
        None | Some(Value::Null) => Err(ParamError(format!("{key} is required with {with}"))),
        Some(v) => Err(ParamError(format!("{key} must be a non-empty string, not {v}"))),
    }
}

fn uint(obj: &Map<String, Value>, key: &str, with: &str) -> Result<u64, ParamError> {
    match obj.get(key) {
        Some(Value::Number(n)) => n.as_u64().ok_or_else(|| ParamError(format!("{key} must be a non-negative integer, not {n}"))),
        None | Some(Value::Null) => Err(ParamError(format!("{key} is required with {with}"))),
        Some(v) => Err(ParamError(format!("{key} must be a non-negative integer, not {v}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote() -> RemoteKv {
        RemoteKv {
            engine_id: "p0".into(),
            request_id: "r1".into(),
            block_ids: vec![3, 4],
            host: "127.0.0.1".into(),
            port: 5600,
            tp_size: 1,
            num_tokens: 20,
            lease_id: 9,
            incarnation: u64::MAX - 1,
            prompt_digest: PromptDigest::of(&[1, 2, 3]),
            signature: None,
        }
    }

    #[test]
    fn round_trip_through_json_like_a_router() {
        let v = remote().to_json(Some(b"s3cret"));
        let KvRole::DecodeRemote(r) = KvRole::parse(Some(&v)).unwrap() else { panic!() };
        assert_eq!(r.incarnation, u64::MAX - 1);
        r.verify(b"s3cret").unwrap();
    }

    /// SPEC §10: `remote_block_ids` nested per KV group (current vLLM) reads as the flat list,
    /// still verifies, and `remote_blocks_expiry_time` is accepted; several groups are refused.
    #[test]
    fn block_ids_flat_or_nested_per_kv_group() {
        let mut v = remote().to_json(Some(b"s3cret"));
        v["remote_block_ids"] = json!([[3, 4]]);
        v["remote_blocks_expiry_time"] = json!(1_700_000_000.5);
        let KvRole::DecodeRemote(r) = KvRole::parse(Some(&v)).unwrap() else { panic!() };
        assert_eq!(r.block_ids, vec![3, 4]);
        r.verify(b"s3cret").unwrap();
        v["remote_block_ids"] = json!([[3, 4], [5, 6]]);
        assert!(KvRole::parse(Some(&v)).unwrap_err().0.contains("KV groups"));
        v["remote_block_ids"] = json!([[]]);
        assert!(KvRole::parse(Some(&v)).is_err());
    }

    /// SPEC S1: altered fields (the prompt digest among them), another secret, or no signature
    /// are refused.
    #[test]
    fn s1_altered_or_unsigned_params_are_refused() {
        let v = remote().to_json(Some(b"s3cret"));
        for (key, val) in [
            ("remote_block_ids", json!([3, 5])),
            ("remote_lease_id", json!(10)),
            ("remote_request_id", json!("r2")),
            ("remote_port", json!(5601)),
            ("kvlease_prompt_digest", json!(PromptDigest::of(&[9]).to_hex())),
        ] {
            let mut w = v.clone();
            w[key] = val;
            let KvRole::DecodeRemote(r) = KvRole::parse(Some(&w)).unwrap() else { panic!() };
            assert!(r.verify(b"s3cret").is_err(), "{key}");
        }
        let KvRole::DecodeRemote(r) = KvRole::parse(Some(&v)).unwrap() else { panic!() };
        assert!(r.verify(b"other").is_err(), "another secret");
        let unsigned = remote().to_json(None);
        let KvRole::DecodeRemote(r) = KvRole::parse(Some(&unsigned)).unwrap() else { panic!() };
        assert!(r.verify(b"s3cret").unwrap_err().0.contains("unsigned"));
    }

    /// SPEC S4: params describe only the prompt P prefilled — not another of the same length,
    /// not a prefix of it, not a longer prompt that starts with it.
    #[test]
    fn s4_params_describe_only_their_prompt() {
        let mut r = remote();
        r.num_tokens = 3;
        r.prompt_digest = PromptDigest::bound(&[1, 2, 3], &r.bound());
        assert!(r.describes(&[1, 2, 3]));
        assert!(!r.describes(&[1, 2, 4]), "same length, another prompt");
        assert!(!r.describes(&[1, 2]), "shorter");
        assert!(!r.describes(&[1, 2, 3, 4]), "longer, starting with it");
        r.num_tokens = 2;
        assert!(!r.describes(&[1, 2, 3]), "a prefix of another length");
        r.num_tokens = 3;
        for blocks in [vec![4, 3], vec![3, 3], vec![3], vec![3, 4, 5]] {
            let mangled = RemoteKv { block_ids: blocks.clone(), ..r.clone() };
            assert!(!mangled.describes(&[1, 2, 3]), "blocks {blocks:?}");
        }
        assert!(!RemoteKv { lease_id: 10, ..r.clone() }.describes(&[1, 2, 3]), "another lease");
    }

    /// A decode engine "d0" (incarnation 7) with blocks of 16 tokens and 4 KV heads.
    fn admission(secret: Option<&[u8]>, policy: LoadFailurePolicy) -> Admission<'_> {
        Admission { secret, engine_id: "d0", incarnation: 7, block_size: 16, num_kv_heads: 4, policy }
    }

    /// Params P "p0" would give for `prompt` (2 blocks of 16 for 20 tokens), signed with `secret`.
    fn params_for(prompt: &[u32], secret: Option<&[u8]>) -> RemoteKv {
        let mut r = RemoteKv { num_tokens: prompt.len() as u32, ..remote() };
        r.prompt_digest = PromptDigest::bound(prompt, &r.bound());
        r.signature = secret.map(|s| r.sign(s));
        r
    }

    const PROMPT: [u32; 20] = [5; 20];

    /// SPEC S1: forged params are refused (a 400) and never release anything (O3).
    #[test]
    fn s1_forged_params_are_invalid_and_release_nothing() {
        let a = admission(Some(b"s3cret"), LoadFailurePolicy::Recompute);
        let mut forged = params_for(&PROMPT, Some(b"other"));
        assert!(matches!(a.admit(&forged, &PROMPT), Admit::Invalid(e) if e.0.contains("kvlease_signature")));
        assert_eq!(a.releases_on_refusal(&forged, Refusal::Request), None);
        forged.signature = None;
        assert!(matches!(a.admit(&forged, &PROMPT), Admit::Invalid(e) if e.0.contains("unsigned")));
        let genuine = params_for(&PROMPT, Some(b"s3cret"));
        assert_eq!(a.admit(&genuine, &PROMPT), Admit::Pull);
    }

    /// SPEC S4, O4: params of another prompt, or mangled on the way, are not read; the lease
    /// they name is released at once — P's through the renewer, this engine's own directly, a
    /// previous run's of this engine not at all — then the prompt is computed, or the request
    /// refused under `kv_load_failure_policy=fail`.
    #[test]
    fn s4_o4_params_of_another_prompt_are_not_read_and_their_lease_is_released() {
        let a = admission(None, LoadFailurePolicy::Recompute);
        let other = [6; 20];
        let theirs = params_for(&PROMPT, None);
        assert_eq!(a.admit(&theirs, &other), Admit::NotRead { why: NotRead::OtherPrompt, release: Some(Whose::Theirs), refuse: false });
        let mut mangled = theirs.clone();
        mangled.block_ids.reverse();
        assert!(matches!(a.admit(&mangled, &PROMPT), Admit::NotRead { why: NotRead::OtherPrompt, .. }));
        let ours = params_for(&PROMPT, None);
        let ours = RemoteKv { engine_id: "d0".into(), incarnation: 7, ..ours };
        assert_eq!(a.admit(&ours, &other), Admit::NotRead { why: NotRead::OtherPrompt, release: Some(Whose::Ours), refuse: false });
        let previous_run = RemoteKv { incarnation: 5, ..ours };
        assert_eq!(a.admit(&previous_run, &other), Admit::NotRead { why: NotRead::OtherPrompt, release: None, refuse: false });
        let strict = admission(None, LoadFailurePolicy::Fail);
        assert_eq!(strict.admit(&theirs, &other), Admit::NotRead { why: NotRead::OtherPrompt, release: Some(Whose::Theirs), refuse: true });
    }

    /// SPEC O4: an engine handed its own live params takes its own lease; a previous run's is
    /// not read (and never pulled from itself); a replay here is not read twice.
    #[test]
    fn o4_own_params_and_replays() {
        let a = admission(None, LoadFailurePolicy::Recompute);
        let mut ours = params_for(&PROMPT, None);
        ours.engine_id = "d0".into();
        ours.incarnation = 7;
        ours.prompt_digest = PromptDigest::bound(&PROMPT, &ours.bound());
        assert_eq!(a.admit(&ours, &PROMPT), Admit::Own);
        ours.incarnation = 5;
        ours.prompt_digest = PromptDigest::bound(&PROMPT, &ours.bound());
        assert_eq!(a.admit(&ours, &PROMPT), Admit::NotRead { why: NotRead::OwnLeaseEnded, release: None, refuse: false });
        assert_eq!(a.not_read(NotRead::Replay), Admit::NotRead { why: NotRead::Replay, release: None, refuse: false });
        let strict = admission(None, LoadFailurePolicy::Fail);
        assert_eq!(strict.not_read(NotRead::Replay), Admit::NotRead { why: NotRead::Replay, release: None, refuse: true });
    }

    /// Params must fit this engine: one block per `block_size` tokens of the prompt (P with
    /// another block size is refused, not misread) and a tensor parallel size that divides the
    /// KV heads (SPEC T1).
    #[test]
    fn params_of_another_shape_are_invalid() {
        let a = admission(None, LoadFailurePolicy::Recompute);
        let mut three = params_for(&PROMPT, None);
        three.block_ids = vec![3, 4, 5];
        three.prompt_digest = PromptDigest::bound(&PROMPT, &three.bound());
        assert!(matches!(a.admit(&three, &PROMPT), Admit::Invalid(e) if e.0.contains("name 3 blocks")));
        let mut tp3 = params_for(&PROMPT, None);
        tp3.tp_size = 3;
        assert!(matches!(a.admit(&tp3, &PROMPT), Admit::Invalid(e) if e.0.contains("tp_size 3")));
    }

    /// SPEC O3: a refused request releases the lease its params name only when they verify,
    /// name a live incarnation (P's, or this engine's own), and are its own (not another
    /// request's).
    #[test]
    fn o3_a_refusal_releases_only_the_requests_own_verified_lease() {
        let a = admission(Some(b"s3cret"), LoadFailurePolicy::Recompute);
        let theirs = params_for(&PROMPT, Some(b"s3cret"));
        assert_eq!(a.releases_on_refusal(&theirs, Refusal::Request), Some(Whose::Theirs));
        assert_eq!(a.releases_on_refusal(&theirs, Refusal::NotItsParams), None);
        let mut ours = RemoteKv { engine_id: "d0".into(), incarnation: 7, ..theirs.clone() };
        ours.signature = Some(ours.sign(b"s3cret"));
        assert_eq!(a.releases_on_refusal(&ours, Refusal::Request), Some(Whose::Ours), "a kv_both engine's own lease");
        let previous_run = RemoteKv { incarnation: 5, ..ours.clone() };
        assert_eq!(a.releases_on_refusal(&previous_run, Refusal::Request), None);
        let unsigned = RemoteKv { signature: None, ..theirs };
        assert_eq!(a.releases_on_refusal(&unsigned, Refusal::Request), None);
    }

    /// SPEC O3 on P: a router may end only this engine's lease of this run.
    #[test]
    fn o3_p_releases_only_its_own_leases_of_this_run() {
        let p = Admission { engine_id: "p0", incarnation: u64::MAX - 1, ..admission(Some(b"s3cret"), LoadFailurePolicy::Recompute) };
        let ours = params_for(&PROMPT, Some(b"s3cret"));
        p.names_our_lease(&ours).unwrap();
        let err = Admission { incarnation: 3, ..p }.names_our_lease(&ours).unwrap_err();
        assert!(err.0.contains("not to this one"), "{err}");
        assert!(p.names_our_lease(&RemoteKv { signature: None, ..ours }).is_err());
    }

    /// SPEC §13, U1: vLLM's push router's params (P's coordinates, a request id, no blocks) and
    /// P's own push answer both read as push; the key is the transfer id, else the request id.
    #[test]
    fn push_params_from_vllms_router_and_from_p() {
        use crate::wire::PushKey;
        let router = json!({"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": "p0",
            "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2, "pp_size": 1, "remote_request_id": "abc"});
        let KvRole::DecodePush(r) = KvRole::parse(Some(&router)).unwrap() else { panic!() };
        assert_eq!((r.engine_id.as_str(), r.port, r.tp_size, r.pp_size, r.incarnation), ("p0", 5600, 2, 1, 0));
        assert_eq!(r.key, PushKey::Request("abc".into()));
        let key = PushKey::Transfer("t-1".into());
        let answer =
            PushAnswer { engine_id: "p0", host: "h", port: 7, tp_size: 1, num_tokens: Some(3), incarnation: Some(u64::MAX), key: &key };
        let KvRole::DecodePush(r) = KvRole::parse(Some(&answer.to_json())).unwrap() else { panic!() };
        assert_eq!((r.key, r.incarnation), (key.clone(), u64::MAX));
        let mut no_key = router.clone();
        no_key.as_object_mut().unwrap().remove("remote_request_id");
        assert!(KvRole::parse(Some(&no_key)).unwrap_err().0.contains("U1"));
        let mut mode = router.clone();
        mode["transfer_mode"] = json!("sideways");
        assert!(KvRole::parse(Some(&mode)).unwrap_err().0.contains("transfer_mode"));
        // Pull params whose blocks a router emptied are still pull params, refused as such.
        let mut emptied = remote().to_json(None);
        emptied["remote_block_ids"] = json!([]);
        assert!(KvRole::parse(Some(&emptied)).unwrap_err().0.contains("remote_block_ids"));
        assert_eq!(KvRole::transfer_id(Some(&json!({"transfer_id": "t"}))), Ok(Some("t".into())));
        assert!(KvRole::transfer_id(Some(&json!({"transfer_id": 5}))).is_err());
    }

    #[test]
    fn bad_params_name_the_field() {
        let v = remote().to_json(None);
        for (key, val, want) in [
            ("do_remote_prefill", json!("yes"), "do_remote_prefill"),
            ("remote_block_ids", json!([]), "remote_block_ids"),
            ("remote_block_ids", json!([-1]), "remote_block_ids"),
            ("remote_port", json!(70000), "remote_port"),
            ("remote_lease_id", Value::Null, "remote_lease_id"),
            ("remote_incarnation", Value::Null, "remote_incarnation"),
            ("remote_incarnation", json!("0"), "remote_incarnation"),
            ("kvlease_prompt_digest", Value::Null, "kvlease_prompt_digest"),
            ("kvlease_prompt_digest", json!("abc"), "kvlease_prompt_digest"),
            ("remote_engine_id", json!(""), "remote_engine_id"),
            ("tp_size", json!(0), "tp_size"),
            ("do_remote_decode", json!(true), "both"),
        ] {
            let mut w = v.clone();
            w[key] = val;
            let err = KvRole::parse(Some(&w)).unwrap_err();
            assert!(err.0.contains(want), "{key}: {err}");
        }
        assert!(KvRole::parse(Some(&json!([1]))).is_err());
        assert_eq!(KvRole::parse(None), Ok(KvRole::Local));
        assert_eq!(KvRole::parse(Some(&json!({"do_remote_decode": true, "remote_engine_id": null}))), Ok(KvRole::PrefillForRemote(None)));
    }
}
