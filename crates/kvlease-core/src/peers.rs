//! Remote engines: what a handshake must prove before its peer is trusted (SPEC D5, S2, S5, T1),
//! and the one registry of what is known of each remote engine — where it is, its incarnation,
//! its agents and the clock samples its handshakes gave (SPEC B2).
//!
//! The side channel authenticates the bytes (the cluster secret); this module decides whether
//! what they say is acceptable: the reply answers our request, comes from the engine we dialled,
//! serves the same model geometry, and names its agents for itself only. The registry is owned
//! by the [`Renewer`](crate::renewer::Renewer), which also keeps each engine's link state, so an
//! engine's incarnation is stored once.

use crate::clock::{ClockOffset, ClockSample};
use crate::wire::Hello;
use serde_json::json;
use std::collections::BTreeMap;
use std::fmt;

/// How long a handshake may take, connecting included, before the dialer gives up and the
/// renewer backs off (SPEC D5); the server gives a peer as long to prove itself.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The model geometry two engines must share to exchange KV (their TP may differ, SPEC T1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub tp_size: u32,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
    pub block_size: u32,
    /// SPEC §13: the engine runs push mode (P writes into D's blocks) rather than pull.
    pub push: bool,
}

/// Why a handshake's answer is not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The reply echoes another request's stamp (a replay, or a confused peer).
    NotOurRequest,
    /// We dialled one engine and another answered.
    WrongEngine { dialled: String, answered: String },
    /// The engine info is not the JSON object we send.
    BadInfo(String),
    /// A geometry key differs.
    Geometry { key: &'static str, ours: u32, theirs: Option<u64> },
    /// The tensor-parallel size does not fit the agents or the heads.
    TpSize { tp: u64, agents: usize, heads: u32 },
    /// An engine introduced an agent named for another engine (SPEC S5).
    AgentName { engine_id: String, rank: usize, name: String, want: String },
    /// SPEC §13: one engine runs push mode, the other pull.
    Mode { ours: &'static str, theirs: String },
    /// SPEC S6: with certificates, a Hello must hand its notification key ([`notif_key`]).
    NotifKey { len: usize },
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::NotOurRequest => write!(f, "the engine answered another handshake (a replay?)"),
            Refused::WrongEngine { dialled, answered } => write!(f, "the engine there is {answered:?}, not {dialled:?}"),
            Refused::BadInfo(e) => write!(f, "bad engine info: {e}"),
            Refused::Geometry { key, ours, theirs } => {
                let theirs = theirs.map_or_else(|| "none".to_string(), |v| v.to_string());
                write!(
                    f,
                    "{key} ({}) differs: {ours} here, {theirs} on the peer; P and D must serve the same model geometry",
                    geometry_flag(key)
                )
            }
            Refused::TpSize { tp, agents, heads } => write!(f, "peer tp_size {tp} does not fit {agents} agents and {heads} heads"),
            Refused::AgentName { engine_id, rank, name, want } => {
                write!(f, "{engine_id:?} introduced an agent named {name:?} as its rank {rank}; its agents must be named {want}/<rank>")
            }
            Refused::Mode { ours, theirs } => write!(f, "transfer mode {ours} here, {theirs} there"),
            Refused::NotifKey { len } => write!(
                f,
                "its Hello hands a notification key of {len} bytes, not {NOTIF_KEY_LEN}: with certificates \
                 (--kv-transfer-tls-cert) both engines must run a kvlease that binds notifications to them"
            ),
        }
    }
}

impl std::error::Error for Refused {}

impl Refused {
    /// The refusal in words that read the same in both engines' logs, naming both: `us`
    /// refused `peer`. A geometry refusal names the field, its flag and both values.
    pub fn between(&self, us: &str, peer: &str) -> String {
        match self {
            Refused::Geometry { key, ours, theirs } => {
                let theirs = theirs.map_or_else(|| "none".to_string(), |v| v.to_string());
                format!(
                    "{key} ({}) differs: {ours} on engine {us:?}, {theirs} on engine {peer:?}; P and D must serve the same model geometry",
                    geometry_flag(key)
                )
            }
            Refused::TpSize { tp, agents, heads } => format!(
                "engine {peer:?} says tp_size {tp} with {agents} agents, which does not fit the {heads} KV heads (--num-kv-heads) of engine {us:?}"
            ),
            Refused::Mode { ours, theirs } => format!(
                "engine {us:?} runs {ours} mode and engine {peer:?} runs {theirs} mode; P and D must use the same kv_connector \
                 (NixlPushConnector for push, NixlConnector for pull)"
            ),
            other => format!("engine {us:?} refused engine {peer:?}: {other}"),
        }
    }

    /// The label of this refusal for `kvlease_handshakes_refused_total{reason}`.
    pub fn label(&self) -> &'static str {
        match self {
            Refused::Geometry { .. } | Refused::TpSize { .. } => "geometry",
            Refused::Mode { .. } => "mode",
            Refused::NotifKey { .. } => "certificate",
            _ => "other",
        }
    }
}

/// The `kvlease serve` flag that sets a geometry key, for messages that tell an operator what
/// to change.
pub fn geometry_flag(key: &str) -> &'static str {
    match key {
        "num_layers" => "--num-layers",
        "num_kv_heads" => "--num-kv-heads",
        "head_dim" => "--head-dim",
        "dtype_bytes" => "--dtype-bytes",
        "block_size" => "--block-size",
        "tp_size" => "--tp-size",
        _ => "the engine's model",
    }
}

impl Geometry {
    fn mode(&self) -> &'static str {
        if self.push {
            "push"
        } else {
            "pull"
        }
    }

    /// The `info` of our Hello.
    pub fn to_info(&self) -> Vec<u8> {
        json!({
            "tp_size": self.tp_size, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "dtype_bytes": self.dtype_bytes, "block_size": self.block_size,
            "transfer_mode": self.mode(),
        })
        .to_string()
        .into_bytes()
    }

    /// Checks that a peer's Hello serves our geometry; returns its TP size.
    pub fn check_peer(&self, hello: &Hello) -> Result<u32, Refused> {
        let info: serde_json::Value = serde_json::from_slice(&hello.info).map_err(|e| Refused::BadInfo(e.to_string()))?;
        for (key, ours) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
            ("block_size", self.block_size),
        ] {
            let theirs = info.get(key).and_then(|v| v.as_u64());
            if theirs != Some(u64::from(ours)) {
                return Err(Refused::Geometry { key, ours, theirs });
            }
        }
        // An engine that says no mode is a pull engine (every kvlease before push mode).
        let theirs = info.get("transfer_mode").and_then(|v| v.as_str()).unwrap_or("pull");
        if theirs != self.mode() {
            return Err(Refused::Mode { ours: self.mode(), theirs: theirs.chars().take(16).collect() });
        }
        let tp = info.get("tp_size").and_then(|v| v.as_u64()).unwrap_or(0);
        let fits = tp != 0 && tp as usize == hello.agents.len() && u64::from(self.num_kv_heads) % tp == 0;
        if !fits {
            return Err(Refused::TpSize { tp, agents: hello.agents.len(), heads: self.num_kv_heads });
        }
        Ok(tp as u32)
    }
}

/// A reply to our handshake answers our request (its echo is our stamp) and comes from the
/// engine the params named (SPEC D5).
pub fn check_reply(dialled: &str, our_t_send: u64, theirs: &Hello) -> Result<(), Refused> {
    if theirs.echo.0 != our_t_send {
        return Err(Refused::NotOurRequest);
    }
    if theirs.engine_id != dialled {
        return Err(Refused::WrongEngine { dialled: dialled.to_string(), answered: theirs.engine_id.clone() });
    }
    Ok(())
}

/// The name under which an engine holds leases (SPEC S5): its engine id and incarnation. Each
/// rank's transfer agent is named `{holder}/{rank}`, and the transport authenticates that name.
pub fn holder_name(engine_id: &str, incarnation: u64) -> String {
    format!("{engine_id}/{incarnation:x}")
}

/// The name of rank `rank`'s agent of an engine.
pub fn agent_name(engine_id: &str, incarnation: u64, rank: usize) -> String {
    holder_agent(&holder_name(engine_id, incarnation), rank)
}

/// The agent of rank `rank` of the engine whose holder name ([`agent_holder`]) is `holder`.
pub fn holder_agent(holder: &str, rank: usize) -> String {
    format!("{holder}/{rank}")
}

/// The holder an agent, named as in [`agent_name`], acts for: all ranks of one engine are one.
pub fn agent_holder(agent: &str) -> &str {
    agent.rsplit_once('/').map_or(agent, |(holder, _rank)| holder)
}

/// The engine an agent, named as in [`agent_name`], belongs to.
pub fn agent_engine(agent: &str) -> &str {
    let holder = agent_holder(agent);
    holder.rsplit_once('/').map_or(holder, |(engine, _incarnation)| engine)
}

/// The length of the notification key a Hello hands its peer (SPEC S6).
pub const NOTIF_KEY_LEN: usize = 32;

/// SPEC S6: the key under which we must tag the notifications we send `hello`'s engine, when
/// engines hold certificates (`certificates`): NIXL's notifications carry no certificate, and
/// under the cluster secret alone any member could tag them as any other. Each engine hands each
/// peer, inside the mutual TLS of the side channel, a key only that peer learns; without
/// certificates there is none (`None`).
pub fn notif_key(hello: &Hello, certificates: bool) -> Result<Option<[u8; NOTIF_KEY_LEN]>, Refused> {
    if !certificates {
        return Ok(None);
    }
    let key = hello.notif_key.as_slice().try_into().map_err(|_| Refused::NotifKey { len: hello.notif_key.len() })?;
    Ok(Some(key))
}

/// SPEC S5: leases are held under the agents' names, so an engine may only introduce agents
/// named for itself, rank by rank, never another engine's.
pub fn check_agent_names(hello: &Hello, names: &[String]) -> Result<(), Refused> {
    for (rank, name) in names.iter().enumerate() {
        let want = agent_name(&hello.engine_id, hello.incarnation, rank);
        if *name != want {
            return Err(Refused::AgentName {
                engine_id: hello.engine_id.clone(),
                rank,
                name: name.clone(),
                want: holder_name(&hello.engine_id, hello.incarnation),
            });
        }
    }
    Ok(())
}

/// What is known of one remote engine from its last accepted handshake.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The incarnation these agents belong to: a lease of another is never read from them.
    pub incarnation: u64,
    /// Agent names, one per rank, in rank order.
    pub agents: Vec<String>,
    /// Clock offset toward it, from the handshakes' stamps (SPEC B2).
    pub clock: ClockOffset,
}

/// Every remote engine we have handshaken with, either way. Ordered maps: iteration order never
/// depends on a random seed.
#[derive(Debug, Default)]
pub struct Peers {
    peers: BTreeMap<String, Peer>,
    agents: BTreeMap<String, String>,
}

impl Peers {
    /// An accepted handshake with `engine_id`. Returns the agents of its previous incarnation,
    /// which are of no more use: the driver drops their connections. The same incarnation's
    /// agents stay (dropping a live connection only to dial it again would make the other side
    /// wait for the old one to close).
    pub fn learned(&mut self, engine_id: &str, incarnation: u64, agents: Vec<String>) -> Vec<String> {
        let old = match self.peers.get(engine_id) {
            Some(p) if p.incarnation != incarnation => self.forget(engine_id),
            _ => Vec::new(),
        };
        for a in &agents {
            self.agents.insert(a.clone(), engine_id.to_string());
        }
        let peer = self.peers.entry(engine_id.to_string()).or_insert_with(|| Peer {
            incarnation,
            agents: Vec::new(),
            clock: ClockOffset::default(),
        });
        peer.incarnation = incarnation;
        peer.agents = agents;
        old
    }

    /// A clock sample from a handshake with `engine_id` (SPEC B2).
    pub fn clock_sample(&mut self, engine_id: &str, sample: ClockSample) {
        if let Some(p) = self.peers.get_mut(engine_id) {
            p.clock.add(sample);
        }
    }

    /// Forgets an engine; returns its agents, whose connections the driver drops.
    pub fn forget(&mut self, engine_id: &str) -> Vec<String> {
        let Some(peer) = self.peers.remove(engine_id) else { return Vec::new() };
        for a in &peer.agents {
            self.agents.remove(a);
        }
        peer.agents
    }

    /// Forgets one agent that is not (or no longer) part of a known engine.
    pub fn forget_agent(&mut self, agent: &str) {
        self.agents.remove(agent);
    }

    pub fn get(&self, engine_id: &str) -> Option<&Peer> {
        self.peers.get(engine_id)
    }

    /// The engine an agent belongs to.
    pub fn engine_of(&self, agent: &str) -> Option<&str> {
        self.agents.get(agent).map(String::as_str)
    }

    /// Whether nothing is known of anyone.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty() && self.agents.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry { tp_size: 2, num_layers: 2, num_kv_heads: 8, head_dim: 16, dtype_bytes: 2, block_size: 16, push: false }
    }

    fn hello(engine_id: &str, incarnation: u64, info: Vec<u8>, agents: usize) -> Hello {
        Hello {
            engine_id: engine_id.into(),
            incarnation,
            agents: vec![vec![1]; agents],
            info,
            t_send: 5,
            echo: (9, 10),
            auth: vec![],
            notif_key: vec![],
        }
    }

    /// SPEC D5: a reply must answer our request and come from the engine the params named.
    #[test]
    fn d5_a_reply_must_answer_our_request_from_the_named_engine() {
        let h = hello("p", 1, geometry().to_info(), 2);
        assert_eq!(check_reply("p", 9, &h), Ok(()));
        assert_eq!(check_reply("p", 8, &h), Err(Refused::NotOurRequest));
        assert!(matches!(check_reply("q", 9, &h), Err(Refused::WrongEngine { .. })));
    }

    /// SPEC §13: a push engine and a pull engine refuse each other, naming both modes; an
    /// engine that says no mode is a pull engine.
    #[test]
    fn push_and_pull_engines_refuse_each_other_naming_both_modes() {
        let pull = geometry();
        let push = Geometry { push: true, ..pull };
        let err = push.check_peer(&hello("d", 1, pull.to_info(), 2)).unwrap_err();
        assert_eq!(err, Refused::Mode { ours: "push", theirs: "pull".into() });
        let said = err.between("p0", "d0");
        assert!(said.contains("push mode") && said.contains("pull mode") && said.contains("NixlPushConnector"), "{said}");
        assert_eq!(err.label(), "mode");
        assert!(pull.check_peer(&hello("p", 1, push.to_info(), 2)).is_err());
        assert_eq!(push.check_peer(&hello("d", 1, push.to_info(), 2)), Ok(2));
        let old = br#"{"tp_size":2,"num_layers":2,"num_kv_heads":8,"head_dim":16,"dtype_bytes":2,"block_size":16}"#.to_vec();
        assert_eq!(pull.check_peer(&hello("p", 1, old, 2)), Ok(2));
    }

    /// SPEC T1: the geometry must match; TP may differ but must fit the heads and the agents.
    #[test]
    fn t1_geometry_must_match_and_tp_must_fit() {
        let g = geometry();
        assert_eq!(g.check_peer(&hello("p", 1, g.to_info(), 2)), Ok(2));
        let other = Geometry { tp_size: 4, ..g };
        assert_eq!(g.check_peer(&hello("p", 1, other.to_info(), 4)), Ok(4));
        let wrong = Geometry { head_dim: 32, ..g };
        let refused = g.check_peer(&hello("p", 1, wrong.to_info(), 2)).unwrap_err();
        assert!(matches!(refused, Refused::Geometry { key: "head_dim", .. }));
        // Both logs name the field, its flag and both values, and who has which.
        let said = refused.between("p", "d");
        assert!(said.contains("head_dim (--head-dim) differs: 16 on engine \"p\", 32 on engine \"d\""), "{said}");
        assert_eq!(refused.label(), "geometry");
        assert!(matches!(g.check_peer(&hello("p", 1, g.to_info(), 3)), Err(Refused::TpSize { .. })));
        assert!(matches!(g.check_peer(&hello("p", 1, b"{".to_vec(), 2)), Err(Refused::BadInfo(_))));
    }

    /// SPEC S5: an engine's agents must be named for it.
    #[test]
    fn s5_agents_must_be_named_for_their_engine() {
        let h = hello("p", 0x1f, vec![], 2);
        assert_eq!(check_agent_names(&h, &["p/1f/0".into(), "p/1f/1".into()]), Ok(()));
        assert!(matches!(check_agent_names(&h, &["p/1f/0".into(), "victim/1/0".into()]), Err(Refused::AgentName { rank: 1, .. })));
        assert_eq!(agent_holder("p/1f/1"), "p/1f");
        assert_eq!(agent_engine("p/1f/1"), "p");
        assert_eq!(agent_engine("ns/p/1f/1"), "ns/p", "an engine id may hold a slash");
    }

    /// SPEC S6: with certificates a Hello must hand a notification key of the right length;
    /// without them none is asked for.
    #[test]
    fn s6_with_certificates_a_hello_hands_its_notification_key() {
        let mut h = hello("p", 1, vec![], 1);
        assert_eq!(notif_key(&h, false), Ok(None));
        let refused = notif_key(&h, true).unwrap_err();
        assert_eq!(refused, Refused::NotifKey { len: 0 });
        assert_eq!(refused.label(), "certificate");
        assert!(refused.between("p", "d").contains("notification key of 0 bytes, not 32"), "{}", refused.between("p", "d"));
        h.notif_key = vec![7; NOTIF_KEY_LEN];
        assert_eq!(notif_key(&h, true), Ok(Some([7; NOTIF_KEY_LEN])));
        h.notif_key = vec![7; 31];
        assert!(notif_key(&h, true).is_err());
    }

    /// SPEC §3, D5: a new incarnation of an engine replaces the old one's agents.
    #[test]
    fn d5_a_new_incarnation_forgets_the_old_agents() {
        let mut peers = Peers::default();
        assert!(peers.learned("p", 1, vec!["p/1/0".into()]).is_empty());
        assert!(peers.learned("p", 1, vec!["p/1/0".into()]).is_empty(), "the same incarnation keeps its agents");
        assert_eq!(peers.learned("p", 2, vec!["p/2/0".into()]), vec!["p/1/0".to_string()]);
        assert_eq!(peers.engine_of("p/2/0"), Some("p"));
        assert_eq!(peers.engine_of("p/1/0"), None);
        assert_eq!(peers.forget("p"), vec!["p/2/0".to_string()]);
        assert!(peers.is_empty());
    }
}
