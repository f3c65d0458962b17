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

use hmac::{Hmac, Mac};
use kvlease_core::digest::{Bound, PromptDigest};
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
            (false, true) => Ok(KvRole::DecodeRemote(remote(obj, "do_remote_prefill")?)),
        }
    }
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
