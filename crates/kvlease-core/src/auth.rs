//! Proof that a peer holds the cluster secret (SPEC S2): the one challenge-response of every
//! channel between engines — the tcp transfer agents' connection handshake and the engine's side
//! channel — and the MACs of the frames signed on them. Pure functions of keys and bytes: the
//! callers bring the nonces (fresh from the OS, `kvlease_transport::auth::nonce`), move the bytes
//! in their own framing, and decide what to do with a verdict.
//!
//! The handshake, on both channels (`K` the secret, `·` concatenation):
//!
//! ```text
//! dialer                                             acceptor
//!                                                 ←  nonce_a (fresh)             Challenge
//!   nonce_d, HMAC(K, dial · names · nonce_d · nonce_a) →                         Answer
//!                                                 ←  HMAC(K, accept · names · nonce_d · nonce_a)
//!                                                                                Challenge::check
//! ```
//!
//! (The tcp agent's dialer sends `nonce_d` in its opening Hello, before the challenge; the side
//! channel's with its proof. The bytes proven are the same.)
//!
//! **The dialer proves first.** An acceptor's port is reachable by anyone; a dialer dials only
//! addresses it has reason to trust (signed `kv_transfer_params`, or an agent its engine was
//! introduced to). So the acceptor sends nothing computed from the secret until the dialer has
//! proven it holds it: whoever merely reaches a port gets a nonce and nothing to test guesses of
//! a weak secret against offline. The types hold the acceptor to it: its proof exists only as
//! the result of [`Challenge::check`] passing. The acceptor's proof then tells the dialer it
//! reached a member of the cluster ([`Answer::check`]), before it sends anything worth having
//! (its agents' metadata).
//!
//! Agent names (`{engine_id}/{incarnation:x}/{rank}`) are public: any HTTP client can learn
//! them. What an outsider cannot learn is the secret, so every proof is an HMAC-SHA256 under it,
//! bound to both peers' names where the channel knows them (the tcp agents' names, which include
//! their incarnations) so a proof for one pair is worth nothing for another. Each MAC input starts
//! with its own label (`kvlease-agent-…`, `kvlease-side-channel-…`, `kvlease-nixl-…`), which no
//! other MAC under the secret starts with (the params' begin with a length), and variable fields
//! are length-prefixed, so no input of one kind can be read as another. Tags are compared in
//! constant time (`hmac`'s `verify_slice`).
//!
//! Without a secret the same exchange runs under the empty key: it proves nothing (anyone can
//! compute it), and the engines must then be reachable from the local host only (SPEC S3).

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

pub const NONCE_LEN: usize = 32;
pub const TAG_LEN: usize = 32;
pub type Nonce = [u8; NONCE_LEN];
pub type Tag = [u8; TAG_LEN];

/// Which channel a handshake runs on: each has its own labels, so a proof made for one is worth
/// nothing on the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// A tcp transfer agent's connection (names: both agents').
    Agent,
    /// The engine's handshake side channel (no names: they travel in the signed Hellos).
    SideChannel,
}

impl Channel {
    /// (the dialer's label, the acceptor's label, the label of a signed frame). Version 2 of the
    /// agent's: the dialer proves first.
    fn labels(self) -> (&'static [u8], &'static [u8], &'static [u8]) {
        match self {
            Channel::Agent => (b"kvlease-agent-dial-v2", b"kvlease-agent-accept-v2", b"kvlease-agent-frame-v2"),
            Channel::SideChannel => (b"kvlease-side-channel-dial-v3", b"kvlease-side-channel-accept-v3", b"kvlease-side-channel-frame-v3"),
        }
    }
}

/// Which side of a connection made a proof or signed a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Dialer,
    Acceptor,
}

/// Who proves to whom on one connection: the channel, and both ends' names where the channel
/// proves them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parties<'a> {
    pub channel: Channel,
    pub dialer: &'a str,
    pub acceptor: &'a str,
}

impl Parties<'_> {
    /// The side channel's: no names (they travel in the signed Hellos).
    pub const SIDE_CHANNEL: Parties<'static> = Parties { channel: Channel::SideChannel, dialer: "", acceptor: "" };

    /// The tcp agent `dialer`'s connection to the agent `acceptor`.
    pub fn agents<'a>(dialer: &'a str, acceptor: &'a str) -> Parties<'a> {
        Parties { channel: Channel::Agent, dialer, acceptor }
    }
}

/// The two fresh nonces of one connection: the acceptor's challenge and the dialer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nonces {
    pub dialer: Nonce,
    pub acceptor: Nonce,
}

/// Why a handshake's proof was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("the dialer's proof does not verify: it does not hold this cluster's secret")]
    DialerUnproven,
    #[error("the acceptor's proof does not verify: it does not hold this cluster's secret")]
    AcceptorUnproven,
}

/// The cluster secret, as the key of every proof: HMAC-SHA256 keyed once, cloned per use.
#[derive(Clone)]
pub struct ClusterKey {
    mac: HmacSha256,
}

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

fn keyed(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes keys of any length")
}

/// Names are at most a few KiB (both backends cap them), so the length fits a u32.
fn put_name(mac: &mut HmacSha256, name: &str) {
    mac.update(&(name.len() as u32).to_le_bytes());
    mac.update(name.as_bytes());
}

impl ClusterKey {
    /// The key of the cluster secret; without one, the empty key (no security, see the module doc).
    pub fn new(secret: Option<&[u8]>) -> ClusterKey {
        ClusterKey { mac: keyed(secret.unwrap_or_default()) }
    }

    fn handshake(&self, side: Side, parties: Parties<'_>, n: &Nonces) -> HmacSha256 {
        let (dial, accept, _) = parties.channel.labels();
        let mut mac = self.mac.clone();
        mac.update(match side {
            Side::Dialer => dial,
            Side::Acceptor => accept,
        });
        put_name(&mut mac, parties.dialer);
        put_name(&mut mac, parties.acceptor);
        mac.update(&n.dialer);
        mac.update(&n.acceptor);
        mac
    }

    fn frame(&self, channel: Channel, side: Side, n: &Nonces, frame: &[u8]) -> HmacSha256 {
        let mut mac = self.mac.clone();
        mac.update(channel.labels().2);
        mac.update(&n.dialer);
        mac.update(&n.acceptor);
        mac.update(match side {
            Side::Dialer => b"dialer",
            Side::Acceptor => b"accept",
        });
        mac.update(frame);
        mac
    }

    /// A MAC over `frame`, sent by `side` on the connection these nonces opened: a frame recorded
    /// on one connection does not verify on another, nor as the other side's (reflected).
    pub fn frame_tag(&self, channel: Channel, side: Side, n: &Nonces, frame: &[u8]) -> Tag {
        self.frame(channel, side, n, frame).finalize().into_bytes().into()
    }

    pub fn verify_frame(&self, channel: Channel, side: Side, n: &Nonces, frame: &[u8], tag: &[u8]) -> bool {
        self.frame(channel, side, n, frame).verify_slice(tag).is_ok()
    }

    /// A key derived from the secret for one use (`label`, one of this crate's `kvlease-…`
    /// labels) between the ordered pair `from`, `to`: the nixl notification keys.
    pub fn derive(&self, label: &[u8], from: &str, to: &str) -> [u8; 32] {
        let mut mac = self.mac.clone();
        mac.update(label);
        put_name(&mut mac, from);
        put_name(&mut mac, to);
        mac.finalize().into_bytes().into()
    }
}

/// The acceptor's half of one connection's handshake: its challenge (a fresh nonce, and nothing
/// computed from the secret), then the check of the dialer's answer, which alone yields the
/// acceptor's own proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    nonce: Nonce,
}

/// A dialer that proved it holds the secret: the connection's nonces, and the acceptor's proof
/// to send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proven {
    pub nonces: Nonces,
    pub proof: Tag,
}

impl Challenge {
    /// A challenge of the acceptor's fresh `nonce` (from the OS).
    pub fn new(nonce: Nonce) -> Challenge {
        Challenge { nonce }
    }

    /// What the acceptor sends: its nonce.
    pub fn nonce(&self) -> &Nonce {
        &self.nonce
    }

    /// Checks the dialer's answer (its nonce and its proof); only if it verifies, the
    /// acceptor's proof.
    pub fn check(&self, key: &ClusterKey, parties: Parties<'_>, dialer: Nonce, proof: &[u8]) -> Result<Proven, AuthError> {
        let nonces = Nonces { dialer, acceptor: self.nonce };
        key.handshake(Side::Dialer, parties, &nonces).verify_slice(proof).map_err(|_| AuthError::DialerUnproven)?;
        Ok(Proven { nonces, proof: key.handshake(Side::Acceptor, parties, &nonces).finalize().into_bytes().into() })
    }
}

/// The dialer's half of one connection's handshake: its proof answering the acceptor's challenge
/// (sent first), then the check of the acceptor's proof.
#[derive(Clone)]
pub struct Answer {
    pub nonces: Nonces,
    pub proof: Tag,
    /// The acceptor's proof, to be compared in constant time.
    theirs: HmacSha256,
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answer").field("nonces", &self.nonces).field("proof", &self.proof).finish_non_exhaustive()
    }
}

impl Answer {
    /// The dialer's answer on the connection of these nonces (its own fresh one, and the
    /// acceptor's challenge).
    pub fn new(key: &ClusterKey, parties: Parties<'_>, nonces: Nonces) -> Answer {
        let proof = key.handshake(Side::Dialer, parties, &nonces).finalize().into_bytes().into();
        Answer { nonces, proof, theirs: key.handshake(Side::Acceptor, parties, &nonces) }
    }

    /// Checks the acceptor's proof; the connection's nonces if it verifies.
    pub fn check(self, proof: &[u8]) -> Result<Nonces, AuthError> {
        self.theirs.verify_slice(proof).map_err(|_| AuthError::AcceptorUnproven)?;
        Ok(self.nonces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonces() -> Nonces {
        Nonces { dialer: [1u8; NONCE_LEN], acceptor: [2u8; NONCE_LEN] }
    }

    /// The acceptor's check of a dialer's proof.
    fn dialer_proven(k: &ClusterKey, parties: Parties<'_>, n: &Nonces, proof: &[u8]) -> bool {
        Challenge::new(n.acceptor).check(k, parties, n.dialer, proof).is_ok()
    }

    /// SPEC S2: a proof verifies only for the same secret, channel, names, nonces and direction.
    #[test]
    fn proofs_verify_only_for_the_same_secret_names_nonces_and_direction_s2() {
        let k = ClusterKey::new(Some(b"cluster secret"));
        let n = nonces();
        let ag = Parties::agents("d/1/0", "p/2/0");
        let d = Answer::new(&k, ag, n);
        let a = Challenge::new(n.acceptor).check(&k, ag, n.dialer, &d.proof).expect("the dialer's proof verifies");
        assert_eq!(a.nonces, n);
        assert_eq!(d.clone().check(&a.proof), Ok(n));
        // A reflected proof (the acceptor's, replayed as the dialer's) is not a proof.
        assert_eq!(Challenge::new(n.acceptor).check(&k, ag, n.dialer, &a.proof), Err(AuthError::DialerUnproven));
        assert_eq!(d.clone().check(&d.proof), Err(AuthError::AcceptorUnproven));
        let swapped = Nonces { dialer: n.acceptor, acceptor: n.dialer };
        let other = Nonces { acceptor: [3u8; NONCE_LEN], ..n };
        let d = d.proof;
        for wrong in [
            dialer_proven(&k, Parties::agents("d/1/0", "p/3/0"), &n, &d), // another incarnation
            dialer_proven(&k, Parties::agents("p/2/0", "d/1/0"), &n, &d), // names swapped
            dialer_proven(&k, Parties::agents("d/1/0p", "/2/0"), &n, &d), // the same bytes, cut elsewhere
            dialer_proven(&k, ag, &swapped, &d),                          // nonces swapped
            dialer_proven(&k, ag, &other, &d),                            // another challenge
            dialer_proven(&k, Parties { channel: Channel::SideChannel, ..ag }, &n, &d), // another channel
            dialer_proven(&ClusterKey::new(Some(b"another secret")), ag, &n, &d), // another secret
            dialer_proven(&ClusterKey::new(None), ag, &n, &d),            // no secret
            dialer_proven(&k, ag, &n, &d[..31]),                          // truncated
        ] {
            assert!(!wrong);
        }
        // Without a secret the exchange still works (and proves nothing).
        let none = ClusterKey::new(None);
        let ab = Parties::agents("a", "b");
        let answer = Answer::new(&none, ab, n);
        let proven = Challenge::new(n.acceptor).check(&none, ab, n.dialer, &answer.proof).expect("no secret on either side");
        assert_eq!(answer.check(&proven.proof), Ok(n));
        assert_eq!(Answer::new(&none, ab, n).proof, Answer::new(&ClusterKey::new(Some(b"")), ab, n).proof);
    }

    /// SPEC S2: the side channel's proofs are its own: no names, its own labels.
    #[test]
    fn side_channel_proofs_are_not_the_agents_s2() {
        let k = ClusterKey::new(Some(b"k"));
        let n = nonces();
        let sc = Answer::new(&k, Parties::SIDE_CHANNEL, n);
        assert!(dialer_proven(&k, Parties::SIDE_CHANNEL, &n, &sc.proof));
        assert!(!dialer_proven(&k, Parties::agents("", ""), &n, &sc.proof));
    }

    /// SPEC S2: a signed frame verifies only on its own connection, from its own side.
    #[test]
    fn frames_do_not_replay_or_reflect_s2() {
        let k = ClusterKey::new(Some(b"k"));
        let sc = Channel::SideChannel;
        let (a, b) =
            (Nonces { dialer: [1; NONCE_LEN], acceptor: [2; NONCE_LEN] }, Nonces { dialer: [1; NONCE_LEN], acceptor: [3; NONCE_LEN] });
        let t = k.frame_tag(sc, Side::Dialer, &a, b"hello");
        assert!(k.verify_frame(sc, Side::Dialer, &a, b"hello", &t));
        assert!(!k.verify_frame(sc, Side::Dialer, &b, b"hello", &t), "replayed on another connection");
        assert!(!k.verify_frame(sc, Side::Acceptor, &a, b"hello", &t), "reflected");
        assert!(!k.verify_frame(sc, Side::Dialer, &a, b"hellO", &t), "altered");
        assert!(!k.verify_frame(Channel::Agent, Side::Dialer, &a, b"hello", &t), "another channel");
        assert!(!ClusterKey::new(Some(b"other")).verify_frame(sc, Side::Dialer, &a, b"hello", &t), "another secret");
    }

    /// The bytes on the wire, pinned against an independent HMAC-SHA256 (Python's `hmac`) of the
    /// inputs the module doc describes: engines of this version and the last one still agree.
    #[test]
    fn proofs_frames_and_derived_keys_are_the_documented_macs() {
        let k = ClusterKey::new(Some(b"cluster secret"));
        let n = nonces();
        let hex = |t: &[u8]| hex::encode(t);
        let agents = Answer::new(&k, Parties::agents("d/1/0", "p/2/0"), n);
        assert_eq!(hex(&agents.proof), "442e6b2a1ff239410abd6fe339148d4eb6fc735d850f391b274a8e8a90c71000");
        let proven = Challenge::new(n.acceptor).check(&k, Parties::agents("d/1/0", "p/2/0"), n.dialer, &agents.proof).expect("proven");
        assert_eq!(hex(&proven.proof), "a910844da9d73dc421dce7e174917ff9280ccd7abb3734f7d726e6c3897e0d72");
        let sc = Answer::new(&k, Parties::SIDE_CHANNEL, n);
        assert_eq!(hex(&sc.proof), "8642f1f862ebd9fdcf812b3ed3dd7220effc1177f9bb49b84fde303e2178a13b");
        let proven = Challenge::new(n.acceptor).check(&k, Parties::SIDE_CHANNEL, n.dialer, &sc.proof).expect("proven");
        assert_eq!(hex(&proven.proof), "3280b2154f0884f80b5f38c07256bef9d1c6a44f482bac886be6696eba7c50b6");
        let frame = k.frame_tag(Channel::SideChannel, Side::Dialer, &n, b"hello");
        assert_eq!(hex(&frame), "d0a854ca60911a3a405954a876ee32d77d0471def7dcb93a257c9fe6732ac0fe");
        let notif = k.derive(b"kvlease-nixl-notif-v1", "d", "p");
        assert_eq!(hex(&notif), "d8c6455a5f89c570503a59420c32794dfd75d109d1326d40415de9338b6b1e1d");
    }

    #[test]
    fn derived_keys_are_per_label_ordered_pair_and_secret() {
        let k = ClusterKey::new(Some(b"s"));
        let d = k.derive(b"kvlease-nixl-notif-v1", "d", "p");
        assert_eq!(d, k.derive(b"kvlease-nixl-notif-v1", "d", "p"));
        assert_ne!(d, k.derive(b"kvlease-nixl-notif-v1", "p", "d"));
        assert_ne!(d, k.derive(b"kvlease-nixl-notif-v1", "d", "q"));
        assert_ne!(d, k.derive(b"kvlease-nixl-notif-v2", "d", "p"));
        assert_ne!(d, ClusterKey::new(Some(b"t")).derive(b"kvlease-nixl-notif-v1", "d", "p"));
    }
}
