//! What each fuzz target checks, on any bytes. Shared by the cargo-fuzz targets
//! (`fuzz_targets/`) and the stable corpus replay (`crates/kvlease-engine/tests/fuzz_corpus.rs`),
//! so the corpus replayed by `cargo test` goes through exactly what the fuzzer ran.
//!
//! Each function must never panic on any input; a panic is a bug (the input is a regression
//! test to keep in `corpus/`). Besides "no panic", each checks a round trip where the code
//! promises one.

use kvlease_core::params::PushAnswer;
use kvlease_core::peers::{agent_name, check_agent_names, check_reply, Geometry};
use kvlease_core::wire::{Hello, Message, PushKey, SideRelease};
use kvlease_engine::KvRole;
use serde_json::Value;

/// The side channel's largest frame (`side_channel::MAX_FRAME`, private to the engine).
pub const MAX_FRAME: usize = 1 << 20;

/// SPEC §9, P7: the notification decoder accepts any byte string without panicking; what it
/// accepts re-encodes to bytes that decode to the same message. Push mode's write key (what D's
/// write gate reads off a peer's write, SPEC U4, U11) the same.
pub fn wire(data: &[u8]) {
    if let Ok(msg) = Message::decode(data) {
        let again = Message::decode(&msg.encode());
        assert_eq!(again.as_ref(), Ok(&msg), "a decoded message must survive a round trip");
    }
    if let Some((key, attempt)) = PushKey::from_write_key(data) {
        assert_eq!(key.write_key(attempt), data, "a write key names one key and attempt, in one spelling");
    }
}

/// SPEC §3, D5, P7, O4: the side channel's request, as the engine takes it from a proven peer
/// (the side channel's module is private, so this follows its steps through public functions):
/// a frame of a 4-byte big-endian length and a message (`read_frame`: refused over
/// [`MAX_FRAME`]), which must be a Hello or a release (`SideRelease`); its MAC input is the
/// message re-encoded without its `auth`; a Hello's `info` is the geometry JSON the connector
/// reads with `serde_json::from_slice` (`check_geometry`), and a geometry refusal is put in words.
pub fn hello(data: &[u8]) {
    let Some((len, body)) = data.split_first_chunk::<4>() else { return };
    let len = u32::from_be_bytes(*len) as usize;
    if len > MAX_FRAME || len > body.len() {
        return; // refused as oversized, or the connection waits for more (and times out)
    }
    match Message::decode(&body[..len]) {
        Ok(Message::Hello(hello)) => {
            let unsigned = Hello { auth: Vec::new(), ..hello.clone() };
            let encoded = Message::Hello(unsigned.clone()).encode();
            assert_eq!(Message::decode(&encoded), Ok(Message::Hello(unsigned)), "the signed form of a Hello must round-trip");
            geometry(&hello);
        }
        Ok(Message::SideRelease(release)) => {
            let unsigned = SideRelease { auth: Vec::new(), ..release };
            let encoded = Message::SideRelease(unsigned.clone()).encode();
            assert_eq!(Message::decode(&encoded), Ok(Message::SideRelease(unsigned)), "the signed form of a release must round-trip");
        }
        _ => {}
    }
}

/// The engine's handshake checks of a peer's Hello, which live in core: its geometry (`info`)
/// and its agents' names, and that a reply answers our request.
fn geometry(hello: &Hello) {
    let ours = Geometry { tp_size: 1, num_layers: 2, num_kv_heads: 8, head_dim: 16, dtype_bytes: 2, block_size: 16, push: false };
    if let Err(refused) = ours.check_peer(hello) {
        let _ = refused.between("us", &hello.engine_id);
    }
    let _ = check_reply(&hello.engine_id, hello.echo.0, hello);
    let names: Vec<String> = (0..hello.agents.len()).map(|r| agent_name(&hello.engine_id, hello.incarnation, r)).collect();
    assert_eq!(check_agent_names(hello, &names), Ok(()), "agents named for their engine are accepted");
}

/// SPEC §10, S1, S4: `kv_transfer_params` as a request body brings them (any JSON) through
/// `KvRole::parse`: never a panic; D's params re-issued by `to_json` parse back to the same
/// params, and the signature `to_json` adds verifies.
pub fn kv_params(data: &[u8]) {
    let Ok(params) = serde_json::from_slice::<Value>(data) else { return };
    let _ = KvRole::transfer_id(Some(&params));
    let rk = match KvRole::parse(Some(&params)) {
        Ok(KvRole::DecodeRemote(rk)) => rk,
        // SPEC §13, U1: push params name P and the transfer's key; P's answer for them parses
        // back to the same P and key.
        Ok(KvRole::DecodePush(pr)) => {
            let answer = PushAnswer {
                engine_id: &pr.engine_id,
                host: &pr.host,
                port: pr.port,
                tp_size: pr.tp_size,
                num_tokens: Some(1),
                incarnation: Some(pr.incarnation),
                key: &pr.key,
            };
            match KvRole::parse(Some(&answer.to_json())) {
                Ok(KvRole::DecodePush(again)) => {
                    assert_eq!((again.engine_id, again.port, again.key, again.incarnation), (pr.engine_id, pr.port, pr.key, pr.incarnation))
                }
                other => panic!("P's push answer must parse as push params, got {other:?}"),
            }
            return;
        }
        _ => return,
    };
    let _ = rk.verify(b"cluster secret");
    let _ = rk.describes(&[1, 2, 3]);
    let signed = rk.to_json(Some(b"cluster secret"));
    match KvRole::parse(Some(&signed)) {
        Ok(KvRole::DecodeRemote(mut again)) => {
            assert!(again.verify(b"cluster secret").is_ok(), "params signed by to_json must verify");
            again.signature.clone_from(&rk.signature);
            assert_eq!(again, rk, "params must survive to_json and parse");
        }
        other => panic!("to_json's params must parse as D's params, got {other:?}"),
    }
}
