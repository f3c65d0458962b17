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
use kvlease_core::auth::{ClusterKey, Tag};
use kvlease_core::auth::{Nonce, NONCE_LEN};
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
