//! The mem backend: agents in one process on a [`MemNetwork`], for unit tests (the simulator
//! drives the protocol core directly, without agents).
//!
//! Same contract and errors as the tcp backend, without sockets: metadata is the agent's name,
//! a read asks the serving agent's [`ReadGate`] and copies arena to arena directly, a
//! notification goes straight onto the peer's event channel. A link works while both agents are
//! alive, each has added the other, and the network does not cut it
//! ([`MemNetwork::partition`]). Each network is its own world: there are no global statics.

use crate::{Agent, AgentEvent, BlockArena, BoxFuture, ReadGate, ReadOp, TransportError};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// How long `add_peer` waits for the peer to add us too (the tcp backend's hold).
const ADD_PEER_WAIT: Duration = Duration::from_secs(5);

/// A cloneable handle on one in-process network of agents.
#[derive(Clone, Default)]
pub struct MemNetwork {
    net: Arc<Net>,
}

impl std::fmt::Debug for MemNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = lock(&self.net.state);
        f.debug_struct("MemNetwork").field("agents", &st.agents.keys().collect::<Vec<_>>()).field("cut", &st.cut).finish()
    }
}

#[derive(Default)]
struct Net {
    state: Mutex<NetState>,
    /// Signalled when an agent appears, leaves, or adds or removes a peer.
    changed: Notify,
}

#[derive(Default)]
struct NetState {
    agents: HashMap<String, Weak<MemAgent>>,
    /// Cut links, as (smaller name, larger name).
    cut: HashSet<(String, String)>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn link_key(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.to_owned(), b.to_owned())
    } else {
        (b.to_owned(), a.to_owned())
    }
}

impl MemNetwork {
    pub fn new() -> MemNetwork {
        MemNetwork::default()
    }

    /// Creates an agent on this network. A live agent of the same name is replaced (as a
    /// restarted process taking over an address would be); names carry an incarnation, so
    /// this only happens on purpose.
    pub fn agent(
        &self,
        name: impl Into<String>,
        arena: Arc<BlockArena>,
        gate: Arc<dyn ReadGate>,
        events: mpsc::UnboundedSender<AgentEvent>,
    ) -> Arc<MemAgent> {
        let agent = Arc::new(MemAgent { name: name.into(), arena, gate, events, net: Arc::clone(&self.net), peers: Mutex::default() });
        lock(&self.net.state).agents.insert(agent.name.clone(), Arc::downgrade(&agent));
        self.net.changed.notify_waiters();
        agent
    }

    /// Cuts (`true`) or heals (`false`) the link between agents `a` and `b`. While cut, reads
    /// fail with `Disconnected` and notifications are silently lost; cutting reports
    /// `Disconnected` to each side that had added the other.
    pub fn partition(&self, a: &str, b: &str, cut: bool) {
        let newly_cut = {
            let mut st = lock(&self.net.state);
            if cut {
                st.cut.insert(link_key(a, b))
            } else {
                st.cut.remove(&link_key(a, b));
                false
            }
        };
        if newly_cut {
            for (x, y) in [(a, b), (b, a)] {
                if let Some(agent) = self.net.lookup(x) {
                    if agent.knows(y) {
                        let _ = agent.events.send(AgentEvent::Disconnected { peer: y.to_owned() });
                    }
                }
            }
        }
        self.net.changed.notify_waiters();
    }
}

impl Net {
    fn lookup(&self, name: &str) -> Option<Arc<MemAgent>> {
        lock(&self.state).agents.get(name).and_then(Weak::upgrade)
    }

    fn is_cut(&self, a: &str, b: &str) -> bool {
        lock(&self.state).cut.contains(&link_key(a, b))
    }
}

/// An in-process transfer agent.
pub struct MemAgent {
    name: String,
    arena: Arc<BlockArena>,
    gate: Arc<dyn ReadGate>,
    events: mpsc::UnboundedSender<AgentEvent>,
    net: Arc<Net>,
    peers: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for MemAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemAgent").field("name", &self.name).field("peers", &*lock(&self.peers)).finish()
    }
}

/// Why a link to a peer is not usable.
enum LinkDown {
    /// We never added the peer (or removed it).
    Unknown,
    /// The peer is gone or does not know us (any more).
    Gone,
    /// The network cut the link.
    Cut,
}

impl MemAgent {
    fn knows(&self, peer: &str) -> bool {
        lock(&self.peers).contains(peer)
    }

    fn link(&self, peer: &str) -> Result<Arc<MemAgent>, LinkDown> {
        if !self.knows(peer) {
            return Err(LinkDown::Unknown);
        }
        let other = self.net.lookup(peer).ok_or(LinkDown::Gone)?;
        if !other.knows(&self.name) {
            return Err(LinkDown::Gone);
        }
        if self.net.is_cut(&self.name, peer) {
            return Err(LinkDown::Cut);
        }
        Ok(other)
    }

    fn read_now(&self, peer: &str, op: ReadOp) -> Result<(), TransportError> {
        let other = self.link(peer).map_err(|down| match down {
            LinkDown::Unknown => TransportError::UnknownPeer(peer.to_owned()),
            LinkDown::Gone | LinkDown::Cut => TransportError::Disconnected(peer.to_owned()),
        })?;
        for s in &op.segments {
            other.arena.check(s.remote_block, s.remote_offset, s.len, peer).map_err(TransportError::OutOfRange)?;
            self.arena.check(s.local_block, s.local_offset, s.len, "our").map_err(TransportError::OutOfRange)?;
        }
        let mut blocks: Vec<u32> = op.segments.iter().map(|s| s.remote_block).collect();
        blocks.sort_unstable();
        blocks.dedup();
        let permit = other.gate.begin_read(&self.name, op.lease_id, &blocks).ok_or(TransportError::Refused { lease_id: op.lease_id })?;
        let same_arena = Arc::ptr_eq(&self.arena, &other.arena);
        for s in &op.segments {
            // SAFETY: both ranges passed `contains`; the permit keeps the remote blocks from
            // being reused (SPEC P5) and the caller owns its local blocks during the read.
            unsafe {
                if same_arena {
                    // Source and destination may overlap: go through a buffer.
                    let mut tmp = vec![0; s.len as usize];
                    other.arena.copy_out(s.remote_block, s.remote_offset as usize, &mut tmp);
                    self.arena.copy_in(s.local_block, s.local_offset as usize, &tmp);
                } else {
                    let start = s.remote_block as usize * other.arena.block_bytes() + s.remote_offset as usize;
                    let src = std::slice::from_raw_parts(other.arena.as_ptr().add(start), s.len as usize);
                    self.arena.copy_in(s.local_block, s.local_offset as usize, src);
                }
            }
        }
        drop(permit);
        if let Some(bytes) = op.notif {
            let _ = other.events.send(AgentEvent::Notification { from: self.name.clone(), bytes });
        }
        Ok(())
    }
}

impl Drop for MemAgent {
    fn drop(&mut self) {
        let others: Vec<Arc<MemAgent>> = {
            let mut st = lock(&self.net.state);
            let me: *const MemAgent = self;
            if st.agents.get(&self.name).is_some_and(|w| std::ptr::eq(w.as_ptr(), me)) {
                st.agents.remove(&self.name);
            }
            st.agents.values().filter_map(Weak::upgrade).collect()
        };
        let peers = std::mem::take(&mut *lock(&self.peers));
        for other in others {
            if peers.contains(&other.name) && other.knows(&self.name) {
                let _ = other.events.send(AgentEvent::Disconnected { peer: self.name.clone() });
            }
        }
        self.net.changed.notify_waiters();
    }
}

impl Agent for MemAgent {
    fn name(&self) -> &str {
        &self.name
    }

    fn metadata(&self) -> Vec<u8> {
        self.name.as_bytes().to_vec()
    }

    /// Registers the peer, then waits (up to 5 s, like the tcp backend's hold) until the peer
    /// has added us too, so that both directions work when it returns.
    fn add_peer<'a>(&'a self, metadata: &'a [u8]) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            let name = match std::str::from_utf8(metadata) {
                Ok("") => return Err(TransportError::BadMetadata("empty agent name".into())),
                Ok(n) if n == self.name => return Err(TransportError::BadMetadata(format!("{n:?} is this agent's own metadata"))),
                Ok(n) => n.to_owned(),
                Err(_) => return Err(TransportError::BadMetadata("mem agent metadata is a UTF-8 name".into())),
            };
            lock(&self.peers).insert(name.clone());
            self.net.changed.notify_waiters();
            let deadline = tokio::time::Instant::now() + ADD_PEER_WAIT;
            loop {
                let notified = self.net.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if !self.knows(&name) {
                    return Err(TransportError::UnknownPeer(name));
                }
                match self.net.lookup(&name) {
                    None => return Err(TransportError::Io(format!("no agent {name:?} on this network"))),
                    Some(other) if other.knows(&self.name) => return Ok(name),
                    Some(_) => {}
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    return Err(TransportError::Io(format!("{name} has not added us within {ADD_PEER_WAIT:?}")));
                }
            }
        })
    }

    fn remove_peer(&self, peer: &str) {
        if lock(&self.peers).remove(peer) {
            if let Some(other) = self.net.lookup(peer) {
                if other.knows(&self.name) {
                    let _ = other.events.send(AgentEvent::Disconnected { peer: self.name.clone() });
                }
            }
        }
        self.net.changed.notify_waiters();
    }

    fn read<'a>(&'a self, peer: &'a str, op: ReadOp) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move { self.read_now(peer, op) })
    }

    fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), TransportError> {
        match self.link(peer) {
            Ok(other) => {
                let _ = other.events.send(AgentEvent::Notification { from: self.name.clone(), bytes });
                Ok(())
            }
            // Lost on the cut link, as a datagram would be; the sender cannot tell.
            Err(LinkDown::Cut) => Ok(()),
            Err(LinkDown::Unknown) => Err(TransportError::UnknownPeer(peer.to_owned())),
            Err(LinkDown::Gone) => Err(TransportError::Disconnected(peer.to_owned())),
        }
    }

    fn can_refuse_reads(&self) -> bool {
        true
    }

    fn arena(&self) -> &BlockArena {
        &self.arena
    }
}

#[cfg(test)]
mod tests;
