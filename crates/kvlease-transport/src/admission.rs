//! Who may hold an inbound connection that has proven nothing yet (SPEC S2, issue 22): one
//! policy for every port an engine accepts handshakes on — the tcp agent's and the engine's side
//! channel — so that strangers cannot keep a member of the cluster out.
//!
//! A connection that has not proven it holds the cluster secret costs a socket and a few bytes,
//! and it must prove itself within a short deadline (the channel's). Many may wait at once
//! ([`Admission::new`]'s `cap`), but never so many that a newcomer is turned away: when the cap is
//! reached, the **oldest** unproven connection is evicted to make room. A newcomer from a source
//! that already holds `per_source` unproven connections evicts that source's oldest instead, so
//! one flooding address cannot evict everyone else's. On loopback every peer is 127.0.0.1 and the
//! per-source cap is simply the cap of that one source: a real dialer still gets in, because it
//! is the newest and answers within milliseconds, long before the flood has pushed `per_source`
//! newer connections in behind it.
//!
//! Connections that *have* proven themselves are not counted here: each channel keeps its own
//! small cap for them (they may then allocate for a Hello), and a flood of strangers never waits
//! in front of them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio::sync::oneshot;

/// The unproven connections of one listener.
#[derive(Clone)]
pub struct Admission {
    state: Arc<Mutex<State>>,
    cap: usize,
    per_source: usize,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").field("cap", &self.cap).field("per_source", &self.per_source).field("held", &self.len()).finish()
    }
}

#[derive(Default)]
struct State {
    next: u64,
    /// By admission order (ids increase): the oldest first.
    held: BTreeMap<u64, (IpAddr, oneshot::Sender<()>)>,
    by_source: HashMap<IpAddr, BTreeSet<u64>>,
}

impl State {
    fn remove(&mut self, id: u64) -> bool {
        let Some((source, _evict)) = self.held.remove(&id) else { return false };
        if let Some(ids) = self.by_source.get_mut(&source) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_source.remove(&source);
            }
        }
        // Dropping the sender wakes the evicted connection's `evicted()`.
        true
    }
}

/// One unproven connection's place. Drop it (or call [`Unproven::proven`]) once the connection
/// has proven itself or closed; [`Unproven::evicted`] resolves when a newcomer took the place.
pub struct Unproven {
    id: u64,
    state: Arc<Mutex<State>>,
    evicted: oneshot::Receiver<()>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Admission {
    /// At most `cap` unproven connections in all, `per_source` of them from one address (both at
    /// least 1).
    pub fn new(cap: usize, per_source: usize) -> Admission {
        let cap = cap.max(1);
        Admission { state: Arc::default(), cap, per_source: per_source.clamp(1, cap) }
    }

    /// Admits a connection from `source`, always: when its source, or everyone, is at the cap,
    /// the oldest unproven connection (of that source, or of all) is evicted first. Returns its
    /// place and how many were evicted to make room (0 or 1).
    pub fn admit(&self, source: IpAddr) -> (Unproven, usize) {
        let source = source.to_canonical();
        let mut st = lock(&self.state);
        let mut evicted = 0;
        let own_oldest = st.by_source.get(&source).filter(|ids| ids.len() >= self.per_source).and_then(|ids| ids.first().copied());
        if let Some(id) = own_oldest {
            evicted += usize::from(st.remove(id));
        } else if st.held.len() >= self.cap {
            if let Some(id) = st.held.keys().next().copied() {
                evicted += usize::from(st.remove(id));
            }
        }
        let id = st.next;
        st.next += 1;
        let (tx, rx) = oneshot::channel();
        st.held.insert(id, (source, tx));
        st.by_source.entry(source).or_default().insert(id);
        drop(st);
        (Unproven { id, state: Arc::clone(&self.state), evicted: rx }, evicted)
    }

    /// Unproven connections held now.
    pub fn len(&self) -> usize {
        lock(&self.state).held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Unproven {
    /// Resolves once a newcomer evicted this connection: close it.
    pub async fn evicted(&mut self) {
        let _ = (&mut self.evicted).await;
    }

    /// The connection proved itself: it gives its place back and can no longer be evicted.
    pub fn proven(self) {}
}

impl Drop for Unproven {
    fn drop(&mut self) {
        lock(&self.state).remove(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    fn is_evicted(u: &mut Unproven) -> bool {
        !matches!(u.evicted.try_recv(), Err(oneshot::error::TryRecvError::Empty))
    }

    /// Issue 22: a newcomer always gets in; the oldest stranger makes room, first of its own
    /// source, so one flooding address evicts only its own connections.
    #[test]
    fn a_newcomer_always_gets_in_evicting_the_oldest_of_its_source_first_s2() {
        let a = Admission::new(4, 2);
        let (mut x1, e) = a.admit(ip(1));
        assert_eq!(e, 0);
        let (mut x2, _) = a.admit(ip(1));
        let (mut y1, _) = a.admit(ip(2));
        // A third from 10.0.0.1: its own oldest goes, not 10.0.0.2's.
        let (mut x3, e) = a.admit(ip(1));
        assert_eq!(e, 1);
        assert!(is_evicted(&mut x1) && !is_evicted(&mut x2) && !is_evicted(&mut y1) && !is_evicted(&mut x3));
        assert_eq!(a.len(), 3);
        // Full (4): a newcomer from elsewhere evicts the oldest of all.
        let (mut z1, e) = a.admit(ip(3));
        assert_eq!((e, a.len()), (0, 4));
        let (_z2, e) = a.admit(ip(3));
        assert_eq!(e, 1);
        assert!(is_evicted(&mut x2), "the oldest of all");
        assert!(!is_evicted(&mut y1) && !is_evicted(&mut z1));
        // A proven or closed connection gives its place back.
        y1.proven();
        drop(x3);
        assert_eq!(a.len(), 2);
        assert!(!is_evicted(&mut z1));
    }

    /// Issue 22, on loopback: every peer has one address, and a real dialer among a flood still
    /// gets its place, which lasts until `per_source` newer strangers have come in behind it.
    #[test]
    fn on_loopback_the_newest_connection_holds_until_per_source_newer_ones_arrive() {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let a = Admission::new(1024, 256);
        let flood: Vec<_> = (0..300).map(|_| a.admit(lo).0).collect();
        assert_eq!(a.len(), 256);
        let (mut real, e) = a.admit(lo);
        assert_eq!(e, 1);
        let mut more: Vec<_> = (0..255).map(|_| a.admit(lo).0).collect();
        assert!(!is_evicted(&mut real), "255 newer strangers do not push it out");
        more.push(a.admit(lo).0);
        assert!(is_evicted(&mut real), "the 256th does");
        drop(flood);
        assert_eq!(a.len(), 256);
    }

    /// `evicted()` resolves on eviction, in async code too.
    #[tokio::test]
    async fn evicted_resolves_when_the_place_is_taken() {
        let a = Admission::new(1, 1);
        let (mut first, _) = a.admit(ip(1));
        let waiter = tokio::spawn(async move { first.evicted().await });
        let (_second, e) = a.admit(ip(2));
        assert_eq!(e, 1);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter).await.expect("evicted in time").expect("task");
    }
}
