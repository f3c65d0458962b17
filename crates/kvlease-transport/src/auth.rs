//! Proof that a peer agent holds the cluster secret (SPEC S2), for both networked backends:
//! the tcp backend's connection handshake (a challenge-response in each direction) and the nixl
//! backend's notification tags (a MAC and a counter on every notification). Pure functions of
//! keys and bytes, plus the OS's random nonces; the backends decide what to do with a verdict.
//!
//! Agent names (`{engine_id}/{incarnation:x}/{rank}`) are public: any HTTP client can learn
//! them. What an outsider cannot learn is the secret, so every proof is an HMAC-SHA256 under it,
//! bound to both agents' names (which include their incarnations) so a proof for one pair is
//! worth nothing for another. Each MAC input starts with its own label (`kvlease-agent-…`,
//! `kvlease-nixl-…`), which no other MAC under the secret starts with (the engine's begin with
//! `kvlease-hello-v2`, `kvlease-side-channel-` or a length), and variable fields are length-prefixed, so no input of one
//! kind can be read as another. Tags are compared in constant time (`hmac`'s `verify_slice`).
//!
//! Without a secret the same exchange runs under the empty key: it proves nothing (anyone can
//! compute it), and the agents must then be reachable from the local host only (SPEC S3).

use crate::TransportError;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

pub(crate) const NONCE_LEN: usize = 32;
pub(crate) const TAG_LEN: usize = 32;
pub(crate) type Nonce = [u8; NONCE_LEN];
pub(crate) type Tag = [u8; TAG_LEN];

/// What the acceptor of a tcp connection proves (it holds the secret, now, for this dial).
const ACCEPT: &[u8] = b"kvlease-agent-accept-v1";
/// What the dialer of a tcp connection proves.
const DIAL: &[u8] = b"kvlease-agent-dial-v1";
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
pub(crate) struct ClusterKey {
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

    fn handshake(&self, label: &[u8], dialer: &str, acceptor: &str, dialer_nonce: &Nonce, acceptor_nonce: &Nonce) -> HmacSha256 {
        let mut mac = self.mac.clone();
        mac.update(label);
        put_name(&mut mac, dialer);
        put_name(&mut mac, acceptor);
        mac.update(dialer_nonce);
        mac.update(acceptor_nonce);
        mac
    }

    /// The acceptor's proof, answering the dialer's nonce.
    pub fn accept_tag(&self, dialer: &str, acceptor: &str, dialer_nonce: &Nonce, acceptor_nonce: &Nonce) -> Tag {
        self.handshake(ACCEPT, dialer, acceptor, dialer_nonce, acceptor_nonce).finalize().into_bytes().into()
    }

    pub fn verify_accept(&self, dialer: &str, acceptor: &str, dialer_nonce: &Nonce, acceptor_nonce: &Nonce, tag: &[u8]) -> bool {
        self.handshake(ACCEPT, dialer, acceptor, dialer_nonce, acceptor_nonce).verify_slice(tag).is_ok()
    }

    /// The dialer's proof, answering the acceptor's nonce.
    pub fn dial_tag(&self, dialer: &str, acceptor: &str, dialer_nonce: &Nonce, acceptor_nonce: &Nonce) -> Tag {
        self.handshake(DIAL, dialer, acceptor, dialer_nonce, acceptor_nonce).finalize().into_bytes().into()
    }

    pub fn verify_dial(&self, dialer: &str, acceptor: &str, dialer_nonce: &Nonce, acceptor_nonce: &Nonce, tag: &[u8]) -> bool {
        self.handshake(DIAL, dialer, acceptor, dialer_nonce, acceptor_nonce).verify_slice(tag).is_ok()
    }

    /// The key of the notifications `sender` sends `receiver`: one per ordered pair, so a tag
    /// is not valid for another pair, nor the other way round.
    #[cfg(any(feature = "nixl", test))]
    pub fn notif_key(&self, sender: &str, receiver: &str) -> NotifKey {
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
pub(crate) fn nonce() -> Result<Nonce, TransportError> {
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
    fn proofs_verify_only_for_the_same_secret_names_nonces_and_direction_s2() {
        let k = ClusterKey::new(Some(b"cluster secret"));
        let (na, nb) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let a = k.accept_tag("d/1/0", "p/2/0", &na, &nb);
        let d = k.dial_tag("d/1/0", "p/2/0", &na, &nb);
        assert!(k.verify_accept("d/1/0", "p/2/0", &na, &nb, &a));
        assert!(k.verify_dial("d/1/0", "p/2/0", &na, &nb, &d));
        // A reflected proof (the acceptor's, replayed as the dialer's) is not a proof.
        assert!(!k.verify_dial("d/1/0", "p/2/0", &na, &nb, &a));
        assert!(!k.verify_accept("d/1/0", "p/2/0", &na, &nb, &d));
        for wrong in [
            k.verify_dial("d/1/0", "p/3/0", &na, &nb, &d),               // another incarnation
            k.verify_dial("p/2/0", "d/1/0", &na, &nb, &d),               // names swapped
            k.verify_dial("d/1/0p", "/2/0", &na, &nb, &d),               // the same bytes, cut elsewhere
            k.verify_dial("d/1/0", "p/2/0", &nb, &na, &d),               // nonces swapped
            k.verify_dial("d/1/0", "p/2/0", &na, &[3u8; NONCE_LEN], &d), // another challenge
            ClusterKey::new(Some(b"another secret")).verify_dial("d/1/0", "p/2/0", &na, &nb, &d), // another secret
            ClusterKey::new(None).verify_dial("d/1/0", "p/2/0", &na, &nb, &d), // no secret
            k.verify_dial("d/1/0", "p/2/0", &na, &nb, &d[..31]),         // truncated
        ] {
            assert!(!wrong);
        }
        // Without a secret the exchange still works (and proves nothing).
        let none = ClusterKey::new(None);
        assert!(none.verify_accept("a", "b", &na, &nb, &none.accept_tag("a", "b", &na, &nb)));
        assert_eq!(none.accept_tag("a", "b", &na, &nb), ClusterKey::new(Some(b"")).accept_tag("a", "b", &na, &nb));
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
