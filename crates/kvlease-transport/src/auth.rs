//! Proof that a peer holds the cluster secret (SPEC S2), for every channel between engines: the
//! tcp backend's connection handshake and the engine's side channel (one challenge-response, the
//! same order for both), and the nixl backend's notification tags (a MAC and a counter on every
//! notification). Pure functions of keys and bytes, plus the OS's random nonces; the channels
//! decide what to do with a verdict.
//!
//! The handshake, on both channels (`K` the secret, `·` concatenation):
//!
//! ```text
//! dialer                                             acceptor
//!                                                 ←  nonce_a (fresh)
//!   nonce_d, HMAC(K, dial · names · nonce_d · nonce_a) →
//!                                                 ←  HMAC(K, accept · names · nonce_d · nonce_a)
//! ```
//!
//! **The dialer proves first.** An acceptor's port is reachable by anyone; a dialer dials only
//! addresses it has reason to trust (signed `kv_transfer_params`, or an agent its engine was
//! introduced to). So the acceptor sends nothing computed from the secret until the dialer has
//! proven it holds it: whoever merely reaches a port gets a nonce and nothing to test guesses of
//! a weak secret against offline. The acceptor's proof then tells the dialer it reached a member
//! of the cluster, before it sends anything worth having (its agents' metadata).
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

use crate::TransportError;
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

/// The two fresh nonces of one connection: the acceptor's challenge and the dialer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nonces {
    pub dialer: Nonce,
    pub acceptor: Nonce,
}
/// Derives the key of the notifications one nixl agent sends another.
#[cfg(any(feature = "nixl", test))]
const NOTIF: &[u8] = b"kvlease-nixl-notif-v1";

/// How many counters behind the newest one a notification may arrive and still be taken once
/// (see [`ReplayWindow`]).
#[cfg(any(feature = "nixl", test))]
pub(crate) const REPLAY_WINDOW: u64 = 4096;
#[cfg(any(feature = "nixl", test))]
const WINDOW_WORDS: usize = (REPLAY_WINDOW / 64) as usize;

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

    fn handshake(&self, channel: Channel, side: Side, dialer: &str, acceptor: &str, n: &Nonces) -> HmacSha256 {
        let (dial, accept, _) = channel.labels();
        let mut mac = self.mac.clone();
        mac.update(match side {
            Side::Dialer => dial,
            Side::Acceptor => accept,
        });
        put_name(&mut mac, dialer);
        put_name(&mut mac, acceptor);
        mac.update(&n.dialer);
        mac.update(&n.acceptor);
        mac
    }

    /// The dialer's proof, answering the acceptor's challenge: sent first (see the module doc).
    pub fn dial_tag(&self, channel: Channel, dialer: &str, acceptor: &str, n: &Nonces) -> Tag {
        self.handshake(channel, Side::Dialer, dialer, acceptor, n).finalize().into_bytes().into()
    }

    pub fn verify_dial(&self, channel: Channel, dialer: &str, acceptor: &str, n: &Nonces, tag: &[u8]) -> bool {
        self.handshake(channel, Side::Dialer, dialer, acceptor, n).verify_slice(tag).is_ok()
    }

    /// The acceptor's proof: sent only once the dialer's has been checked.
    pub fn accept_tag(&self, channel: Channel, dialer: &str, acceptor: &str, n: &Nonces) -> Tag {
        self.handshake(channel, Side::Acceptor, dialer, acceptor, n).finalize().into_bytes().into()
    }

    pub fn verify_accept(&self, channel: Channel, dialer: &str, acceptor: &str, n: &Nonces, tag: &[u8]) -> bool {
        self.handshake(channel, Side::Acceptor, dialer, acceptor, n).verify_slice(tag).is_ok()
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

    /// The key of the notifications `sender` sends `receiver`: one per ordered pair, so a tag
    /// is not valid for another pair, nor the other way round.
    #[cfg(any(feature = "nixl", test))]
    pub(crate) fn notif_key(&self, sender: &str, receiver: &str) -> NotifKey {
        let mut mac = self.mac.clone();
        mac.update(NOTIF);
        put_name(&mut mac, sender);
        put_name(&mut mac, receiver);
        NotifKey { mac: keyed(&mac.finalize().into_bytes()) }
    }
}

/// The key of one direction of one pair of nixl agents.
#[cfg(any(feature = "nixl", test))]
#[derive(Clone)]
pub(crate) struct NotifKey {
    mac: HmacSha256,
}

#[cfg(any(feature = "nixl", test))]
impl NotifKey {
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

    /// SPEC S2: a proof verifies only for the same secret, channel, names, nonces and direction.
    #[test]
    fn proofs_verify_only_for_the_same_secret_names_nonces_and_direction_s2() {
        let k = ClusterKey::new(Some(b"cluster secret"));
        let n = Nonces { dialer: [1u8; NONCE_LEN], acceptor: [2u8; NONCE_LEN] };
        let ag = Channel::Agent;
        let a = k.accept_tag(ag, "d/1/0", "p/2/0", &n);
        let d = k.dial_tag(ag, "d/1/0", "p/2/0", &n);
        assert!(k.verify_accept(ag, "d/1/0", "p/2/0", &n, &a));
        assert!(k.verify_dial(ag, "d/1/0", "p/2/0", &n, &d));
        // A reflected proof (the acceptor's, replayed as the dialer's) is not a proof.
        assert!(!k.verify_dial(ag, "d/1/0", "p/2/0", &n, &a));
        assert!(!k.verify_accept(ag, "d/1/0", "p/2/0", &n, &d));
        let swapped = Nonces { dialer: n.acceptor, acceptor: n.dialer };
        let other = Nonces { acceptor: [3u8; NONCE_LEN], ..n };
        for wrong in [
            k.verify_dial(ag, "d/1/0", "p/3/0", &n, &d),                   // another incarnation
            k.verify_dial(ag, "p/2/0", "d/1/0", &n, &d),                   // names swapped
            k.verify_dial(ag, "d/1/0p", "/2/0", &n, &d),                   // the same bytes, cut elsewhere
            k.verify_dial(ag, "d/1/0", "p/2/0", &swapped, &d),             // nonces swapped
            k.verify_dial(ag, "d/1/0", "p/2/0", &other, &d),               // another challenge
            k.verify_dial(Channel::SideChannel, "d/1/0", "p/2/0", &n, &d), // another channel
            ClusterKey::new(Some(b"another secret")).verify_dial(ag, "d/1/0", "p/2/0", &n, &d), // another secret
            ClusterKey::new(None).verify_dial(ag, "d/1/0", "p/2/0", &n, &d), // no secret
            k.verify_dial(ag, "d/1/0", "p/2/0", &n, &d[..31]),             // truncated
        ] {
            assert!(!wrong);
        }
        // Without a secret the exchange still works (and proves nothing).
        let none = ClusterKey::new(None);
        assert!(none.verify_accept(ag, "a", "b", &n, &none.accept_tag(ag, "a", "b", &n)));
        assert_eq!(none.accept_tag(ag, "a", "b", &n), ClusterKey::new(Some(b"")).accept_tag(ag, "a", "b", &n));
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

    #[test]
    fn notification_keys_are_per_ordered_pair_and_per_secret_s2() {
        let k = ClusterKey::new(Some(b"s"));
        let t = k.notif_key("d", "p").tag(7, b"heartbeat");
        assert!(k.notif_key("d", "p").verify(7, b"heartbeat", &t));
        assert!(!k.notif_key("p", "d").verify(7, b"heartbeat", &t), "not valid the other way round");
        assert!(!k.notif_key("d", "q").verify(7, b"heartbeat", &t), "not valid for another receiver");
        assert!(!k.notif_key("d", "p").verify(8, b"heartbeat", &t), "bound to its counter");
        assert!(!k.notif_key("d", "p").verify(7, b"heartbeaT", &t), "bound to its payload");
        assert!(!ClusterKey::new(Some(b"t")).notif_key("d", "p").verify(7, b"heartbeat", &t), "bound to the secret");
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
