//! What the challenge-response of `kvlease_core::auth` needs from outside the core, and the
//! nixl backend's own proofs. The handshake itself (SPEC S2: the tcp backend's connection
//! handshake and the engine's side channel, the dialer proving first) is pure and lives in the
//! core; this module draws its nonces from the OS, and keeps the nixl backend's notification tags
//! (a MAC under a key derived from the cluster secret, and a counter, on every notification)
//! with their replay window.

use crate::TransportError;
#[cfg(any(feature = "nixl", test))]
use hmac::{Hmac, Mac};
#[cfg(any(feature = "nixl", test))]
use kvlease_core::auth::Tag;
use kvlease_core::auth::{ClusterKey, Nonce, NONCE_LEN};
#[cfg(any(feature = "nixl", test))]
use kvlease_core::peers::agent_engine;
use kvlease_core::peers::NOTIF_KEY_LEN;
#[cfg(any(feature = "nixl", test))]
use sha2::Sha256;

#[cfg(any(feature = "nixl", test))]
type HmacSha256 = Hmac<Sha256>;

/// Derives the key of the notifications one nixl agent sends another.
#[cfg(any(feature = "nixl", test))]
const NOTIF: &[u8] = b"kvlease-nixl-notif-v1";

/// How many counters behind the newest one a notification may arrive and still be taken once
/// (see [`ReplayWindow`]).
#[cfg(any(feature = "nixl", test))]
pub(crate) const REPLAY_WINDOW: u64 = 4096;
#[cfg(any(feature = "nixl", test))]
const WINDOW_WORDS: usize = (REPLAY_WINDOW / 64) as usize;

/// The key of one direction of one pair of nixl agents.
#[cfg(any(feature = "nixl", test))]
#[derive(Clone)]
pub(crate) struct NotifKey {
    mac: HmacSha256,
}

#[cfg(any(feature = "nixl", test))]
impl NotifKey {
    /// The key of the notifications `sender` sends `receiver`: one per ordered pair, so a tag
    /// is not valid for another pair, nor the other way round.
    pub fn new(key: &ClusterKey, sender: &str, receiver: &str) -> NotifKey {
        let derived = key.derive(NOTIF, sender, receiver);
        NotifKey { mac: <HmacSha256 as Mac>::new_from_slice(&derived).expect("HMAC takes keys of any length") }
    }

    fn mac(&self, counter: u64, payload: &[u8]) -> HmacSha256 {
        let mut mac = self.mac.clone();
        mac.update(&counter.to_le_bytes());
        mac.update(payload);
        mac
    }

    pub fn tag(&self, counter: u64, payload: &[u8]) -> Tag {
        self.mac(counter, payload).finalize().into_bytes().into()
    }

    pub fn verify(&self, counter: u64, payload: &[u8], tag: &[u8]) -> bool {
        self.mac(counter, payload).verify_slice(tag).is_ok()
    }
}

/// Derives the key an engine hands one peer for the notifications that peer sends it (S6).
const PAIR: &[u8] = b"kvlease-nixl-pair-v1";

/// SPEC S6 over NIXL: the notification keys of one engine when engines hold certificates.
///
/// Under the cluster secret alone every member derives every pair's key, so an insider can tag
/// a notification as any engine (S5 holds against outsiders only). With certificates the engine
/// draws a random seed at start, and hands each peer engine, in its Hello inside the side
/// channel's mutual TLS (so to the engine that certificate names and no other), the key that
/// peer must tag its notifications to us with: derived from the seed and the peer's engine id,
/// so no other engine can derive it, and the same in every handshake with that peer (two
/// handshakes at once agree). The peer's own key for us is learnt from its Hello. Per pair of
/// agents the tag key then derives from these as it does from the secret.
pub struct PeerKeys {
    engine_id: String,
    seed: ClusterKey,
    /// What each peer engine handed us, by engine id.
    theirs: std::sync::Mutex<std::collections::HashMap<String, [u8; NOTIF_KEY_LEN]>>,
}

impl std::fmt::Debug for PeerKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerKeys").field("engine_id", &self.engine_id).finish_non_exhaustive()
    }
}

impl PeerKeys {
    /// The keys of engine `engine_id`, from a fresh seed from the OS.
    pub fn new(engine_id: &str) -> Result<PeerKeys, TransportError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| TransportError::Io(format!("no randomness from the OS for notification keys: {e}")))?;
        Ok(PeerKeys { engine_id: engine_id.to_owned(), seed: ClusterKey::new(Some(&seed)), theirs: Default::default() })
    }

    /// The key `peer` must tag its notifications to us with: for our Hello to `peer` only.
    pub fn ours_for(&self, peer: &str) -> [u8; NOTIF_KEY_LEN] {
        self.seed.derive(PAIR, peer, &self.engine_id)
    }

    /// Takes the key `peer`'s Hello handed us, for the notifications we send it.
    pub fn learn(&self, peer: &str, key: [u8; NOTIF_KEY_LEN]) {
        self.theirs.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(peer.to_owned(), key);
    }

    /// The base key of the notifications agent `sender` (of another engine) sends us.
    #[cfg(any(feature = "nixl", test))]
    pub(crate) fn inbound(&self, sender: &str) -> ClusterKey {
        ClusterKey::new(Some(&self.ours_for(agent_engine(sender))))
    }

    /// The base key of the notifications we send agent `receiver`, once its engine's Hello
    /// handed us one.
    #[cfg(any(feature = "nixl", test))]
    pub(crate) fn outbound(&self, receiver: &str) -> Option<ClusterKey> {
        let theirs = self.theirs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        theirs.get(agent_engine(receiver)).map(|k| ClusterKey::new(Some(k)))
    }
}

/// A fresh random nonce from the OS.
pub fn nonce() -> Result<Nonce, TransportError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| TransportError::Io(format!("no randomness from the OS for a handshake nonce: {e}")))?;
    Ok(n)
}

/// Which of a sender's counters were taken: the newest, and a bitmap of the
/// [`REPLAY_WINDOW`] before it (IPsec's anti-replay window, RFC 4303 §3.4.3). A counter is
/// taken once; one older than the window is refused, since it can no longer be told apart
/// from a replay. Only counters of authentic messages may be offered: a forged huge counter
/// would otherwise push the window past every real one.
#[cfg(any(feature = "nixl", test))]
#[derive(Debug, Clone)]
pub(crate) struct ReplayWindow {
    newest: u64,
    /// Bit `c % REPLAY_WINDOW` is set when counter `c` (within the window) was taken.
    seen: [u64; WINDOW_WORDS],
}

#[cfg(any(feature = "nixl", test))]
impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow { newest: 0, seen: [0; WINDOW_WORDS] }
    }
}

#[cfg(any(feature = "nixl", test))]
impl ReplayWindow {
    fn slot(c: u64) -> (usize, u64) {
        let i = c % REPLAY_WINDOW;
        ((i / 64) as usize, 1 << (i % 64))
    }

    /// Whether counter `c` is new (then it is taken); counters start at 1.
    pub fn accept(&mut self, c: u64) -> bool {
        if c == 0 {
            return false;
        }
        if c > self.newest {
            if c - self.newest >= REPLAY_WINDOW {
                self.seen = [0; WINDOW_WORDS];
            } else {
                // The slots of the counters passed over held counters a window older.
                for skipped in self.newest + 1..c {
                    let (w, bit) = Self::slot(skipped);
                    self.seen[w] &= !bit;
                }
            }
            self.newest = c;
            let (w, bit) = Self::slot(c);
            self.seen[w] |= bit;
            return true;
        }
        if self.newest - c >= REPLAY_WINDOW {
            return false;
        }
        let (w, bit) = Self::slot(c);
        if self.seen[w] & bit != 0 {
            return false;
        }
        self.seen[w] |= bit;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notification_keys_are_per_ordered_pair_and_per_secret_s2() {
        let k = ClusterKey::new(Some(b"s"));
        let t = NotifKey::new(&k, "d", "p").tag(7, b"heartbeat");
        assert!(NotifKey::new(&k, "d", "p").verify(7, b"heartbeat", &t));
        assert!(!NotifKey::new(&k, "p", "d").verify(7, b"heartbeat", &t), "not valid the other way round");
        assert!(!NotifKey::new(&k, "d", "q").verify(7, b"heartbeat", &t), "not valid for another receiver");
        assert!(!NotifKey::new(&k, "d", "p").verify(8, b"heartbeat", &t), "bound to its counter");
        assert!(!NotifKey::new(&k, "d", "p").verify(7, b"heartbeaT", &t), "bound to its payload");
        assert!(!NotifKey::new(&ClusterKey::new(Some(b"t")), "d", "p").verify(7, b"heartbeat", &t), "bound to the secret");
    }

    /// SPEC S6: the key an engine hands a peer is that peer's alone, the same in every
    /// handshake, and what the peer learns is what tags its notifications to us.
    #[test]
    fn s6_peer_keys_are_per_peer_engine_and_per_seed() {
        let (p, d) = (PeerKeys::new("p").unwrap(), PeerKeys::new("d").unwrap());
        assert_eq!(p.ours_for("d"), p.ours_for("d"), "stable across handshakes");
        assert_ne!(p.ours_for("d"), p.ours_for("x"), "another engine gets another key");
        assert_ne!(p.ours_for("d"), PeerKeys::new("p").unwrap().ours_for("d"), "a new seed, a new key");
        assert!(d.outbound("p/1/0").is_none(), "nothing to tag with before p's Hello");
        d.learn("p", p.ours_for("d"));
        let sent = NotifKey::new(&d.outbound("p/1/0").unwrap(), "d/2/0", "p/1/0").tag(1, b"release");
        assert!(NotifKey::new(&p.inbound("d/2/0"), "d/2/0", "p/1/0").verify(1, b"release", &sent));
        // An insider x, even one holding the secret, has only the key p handed x.
        let x = PeerKeys::new("x").unwrap();
        x.learn("p", p.ours_for("x"));
        let forged = NotifKey::new(&x.outbound("p/1/0").unwrap(), "d/2/0", "p/1/0").tag(1, b"release");
        assert!(!NotifKey::new(&p.inbound("d/2/0"), "d/2/0", "p/1/0").verify(1, b"release", &forged));
    }

    #[test]
    fn replay_window_takes_each_counter_once_in_any_order_within_the_window() {
        let mut w = ReplayWindow::default();
        assert!(!w.accept(0), "counters start at 1");
        assert!(w.accept(1));
        assert!(!w.accept(1), "a replay");
        assert!(w.accept(5));
        assert!(w.accept(3), "overtaken, still within the window");
        assert!(w.accept(2) && w.accept(4));
        for c in 1..=5 {
            assert!(!w.accept(c), "{c} replayed");
        }
        assert!(w.accept(5 + REPLAY_WINDOW - 1));
        assert!(w.accept(6), "the oldest counter still inside the window");
        assert!(!w.accept(5), "outside the window: refused, even though never seen there");
        // A jump past the whole window forgets everything older.
        let far = 10 * REPLAY_WINDOW;
        assert!(w.accept(far));
        assert!(!w.accept(far - REPLAY_WINDOW));
        assert!(w.accept(far - REPLAY_WINDOW + 1));
        assert!(!w.accept(far - REPLAY_WINDOW + 1));

        // Against a model: a set of everything taken, random order around a moving front.
        let (mut w, mut taken, mut newest) = (ReplayWindow::default(), std::collections::HashSet::new(), 0u64);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let c = (newest + 64).saturating_sub(x % (REPLAY_WINDOW + 600)).max(1);
            let want = !taken.contains(&c) && c + REPLAY_WINDOW > newest;
            assert_eq!(w.accept(c), want, "counter {c}, newest {newest}");
            if want {
                taken.insert(c);
                newest = newest.max(c);
            }
        }
    }
}
