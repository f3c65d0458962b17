//! P's side of the lease as one machine (SPEC §4, S4, S5, B1): the [`LeaseTable`], the
//! [`Quarantine`] and the decoder's cached turns behind the few calls a serving engine makes —
//! grant, a message from D, a read begun and ended, a release, a turn evicted, the reaper's poll
//! — so that every decision between them is made here, where the simulator sees it:
//!
//! * **Reads** (S4, P5): a read names exactly the lease's blocks in the order its params name
//!   them (a cached turn: an in-order prefix of them, B4), shows the digest the lease was granted
//!   with, and is of a live lease its reader may hold (S5).
//! * **Blocks of an ended lease** (P5): back at once when every expected reader reported
//!   completion or reads are fenced; through the quarantine otherwise; after the last reader
//!   when one still holds them.
//! * **The reaper** (P4): [`LeaseHolder::poll`] ticks the table a budget at a time and lets the
//!   quarantine go; [`LeaseHolder::poll_timeout`] says when the driver must call it next.
//! * **Params' times** (§10, B1): the expiry a grant's params carry.
//!
//! Like the table, this is sans-io: time is an argument, and what a call ended or freed comes
//! back in a [`Settled`] for the driver to carry out (free blocks, count, log). The vLLM
//! connector's P side is [`crate::issued::IssuedLeases`] instead: its ids are issued by another
//! process, and its reads are fenced by neither gate nor quarantine of ours.

use crate::config::LeaseConfig;
use crate::digest::{reads_lease_blocks, Bound, PromptDigest};
use crate::lease_table::{Answer, Evicted, Holder, LeasePayload, LeaseTable, ReadTicket, ReleaseReason, Released, REAP_BUDGET};
use crate::params::RemoteKv;
use crate::quarantine::Quarantine;
use crate::wire::Message;
use crate::{LeaseId, Nanos};
use std::time::Duration;

/// The engine's guard over pool blocks: gives them back when dropped. The holder only needs to
/// know which blocks it guards.
pub trait BlockGuard {
    /// The blocks, in the order they were allocated.
    fn ids(&self) -> &[u32];
}

/// What P keeps under a lease.
#[derive(Debug)]
struct Lease<B> {
    blocks: B,
    /// `remote_block_ids` as the params name them, in order (a read must name exactly those, S4).
    named: Vec<u32>,
    /// A cached turn (B1): read as far as the next turn's prompt shares it, so an in-order
    /// prefix of `named` is a read of it too (B4).
    prefix_reads: bool,
    /// The request the lease was granted for, for the log.
    request: String,
    /// SPEC S4: the digest of the prompt, bound to the params' fields.
    prompt_digest: PromptDigest,
}

impl<B> LeasePayload for Lease<B> {
    fn prompt_digest(&self) -> Option<&PromptDigest> {
        Some(&self.prompt_digest)
    }
}

/// A lease that ended, for the driver's count and log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    pub lease_id: LeaseId,
    pub reason: ReleaseReason,
    /// Grant to release (`kvlease_lease_hold_seconds`).
    pub held: Duration,
    /// The request it was granted for.
    pub request: String,
}

/// What a call of [`LeaseHolder`] leaves the driver to carry out.
#[derive(Debug)]
pub struct Settled<B> {
    /// Leases that ended, in the order they ended (each exactly once, P3).
    pub ended: Vec<Ended>,
    /// Blocks to give back to the pool now.
    pub freed: Vec<B>,
    /// Whether [`LeaseHolder::poll_timeout`] may have moved earlier (a grant, blocks
    /// quarantined): a sleeping reaper must look again.
    pub rearm: bool,
    /// Whether the live leases or their blocks changed (the `leases_active` and `leased_blocks`
    /// gauges).
    pub changed: bool,
}

impl<B> Default for Settled<B> {
    fn default() -> Self {
        Settled { ended: Vec::new(), freed: Vec::new(), rearm: false, changed: false }
    }
}

/// A lease just granted, and what its params say of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    pub lease_id: LeaseId,
    /// The params' digest (S4), binding the prompt to this engine, incarnation, lease and blocks.
    pub prompt_digest: PromptDigest,
    /// `remote_block_ids`, in order.
    pub block_ids: Vec<u32>,
    /// The first deadline: L, or a cached turn's TTL, from the grant.
    pub lifetime: Duration,
    /// `remote_blocks_expiry_time` (§10, B1): when the lease lapses without a heartbeat, on this
    /// engine's clock. Informational: D keeps the lease by heartbeats and learns of its loss from
    /// `LeaseLost`, never from this time.
    pub expiry: Nanos,
}

impl Granted {
    /// [`Granted::expiry`] in the params' unit, seconds.
    pub fn expiry_secs(&self) -> f64 {
        self.expiry.0 as f64 / 1e9
    }
}

/// Why no lease was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// SPEC P1: a lease holds at least one block; the request's blocks (none) go back at once.
    #[error("a lease needs at least one block; the request holds none")]
    NoBlocks,
}

/// Why a read of a lease is refused before a byte is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadRefused {
    /// SPEC S4: every kvlease reader shows its params' digest; this read showed none (or not 16
    /// bytes of it).
    #[error("the read shows no params digest; a kvlease reader must present the one its params carry")]
    NoDigest,
    /// SPEC S4: the read does not name exactly the lease's blocks in its params' order.
    #[error("the read names other blocks than the lease's, or in another order")]
    NotTheLeasesBlocks,
    /// SPEC P5, S4, S5: the lease is not live (or another incarnation of this engine granted
    /// it), another engine holds it, or the digest is not the one it was granted with.
    #[error("the lease is not live, is another engine's, or was granted for another prompt")]
    NotLive,
}

/// What [`LeaseHolder::evict_turns`] did (SPEC B1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnEviction {
    /// The cached turns evicted, in order.
    pub evicted: Vec<Evicted>,
    /// Turns that ended on the way: those evicted, and those found expired.
    pub ended: usize,
}

/// P's leases, the quarantine and the cached turns of one engine (see the module's
/// documentation).
#[derive(Debug)]
pub struct LeaseHolder<B> {
    table: LeaseTable<Lease<B>>,
    quarantine: Quarantine<B>,
    cfg: LeaseConfig,
    engine_id: String,
    incarnation: u64,
    /// The holder name of this engine itself ([`crate::peers::holder_name`]).
    own: String,
    block_size: u32,
    /// Simulator only: vLLM's head-only sweep, and when it can next free anything.
    head_only: bool,
    head_next: Option<Nanos>,
}

impl<B: BlockGuard> LeaseHolder<B> {
    /// The leases of engine `engine_id`, incarnation `incarnation`, whose pool's blocks hold
    /// `block_size` tokens each. Reads count as unfenced (quarantined) until
    /// [`LeaseHolder::set_fenced_reads`] says otherwise.
    pub fn new(cfg: &LeaseConfig, engine_id: &str, incarnation: u64, block_size: u32) -> Self {
        LeaseHolder {
            table: LeaseTable::new(cfg),
            quarantine: Quarantine::new(cfg, true),
            cfg: cfg.clone(),
            engine_id: engine_id.to_owned(),
            incarnation,
            own: crate::peers::holder_name(engine_id, incarnation),
            block_size: block_size.max(1),
            head_only: false,
            head_next: None,
        }
    }

    /// Whether the transport refuses reads of dead leases (tcp, mem; not NIXL): then nothing is
    /// quarantined (P5) and a `ReadDone` of a live lease is not acknowledged. Set once the
    /// transfer agents are known, before any lease is granted or block quarantined.
    pub fn set_fenced_reads(&mut self, fenced: bool) {
        self.quarantine = Quarantine::new(&self.cfg, fenced);
        self.table.set_fenced_reads(fenced);
    }

    /// **Simulator only** (`kvlease sim`'s vLLM lease, `PlantedBug::VllmLease`): the reaper
    /// sweeps as vLLM does, head-only in grant order (vLLM #58222).
    #[doc(hidden)]
    pub fn sweep_head_only(&mut self) {
        self.head_only = true;
    }

    /// The name this engine holds its own leases under (SPEC S5).
    pub fn own_name(&self) -> &str {
        &self.own
    }

    /// SPEC P1: a `do_remote_decode` prefill of `tokens` for `request` finished normally: a lease
    /// of L on all of `blocks`. Without blocks there is no lease: they go back at once.
    pub fn grant(&mut self, now: Nanos, request: &str, blocks: B, tokens: &[u32], out: &mut Settled<B>) -> Result<Granted, GrantError> {
        if blocks.ids().is_empty() {
            out.freed.push(blocks);
            return Err(GrantError::NoBlocks);
        }
        let n = blocks.ids().len();
        Ok(self.grant_lease(now, None, request, blocks, n, tokens, out))
    }

    /// SPEC B1: a request this engine decoded finished in bidirectional mode: keep the blocks
    /// that hold the KV of `tokens` (the conversation up to its last generated token; the
    /// params name only those, the lease keeps all of `blocks`) under a cached-turn lease of
    /// `decoder_kv_blocks_ttl`, which [`LeaseHolder::evict_turns`] may end early.
    pub fn grant_turn(&mut self, now: Nanos, request: &str, blocks: B, tokens: &[u32], out: &mut Settled<B>) -> Granted {
        let used = tokens.len().div_ceil(self.block_size as usize).min(blocks.ids().len());
        let ttl = self.cfg.decoder_kv_blocks_ttl;
        self.grant_lease(now, Some(ttl), request, blocks, used, tokens, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn grant_lease(
        &mut self,
        now: Nanos,
        turn: Option<Duration>,
        request: &str,
        blocks: B,
        n: usize,
        tokens: &[u32],
        out: &mut Settled<B>,
    ) -> Granted {
        let named = blocks.ids()[..n.min(blocks.ids().len())].to_vec();
        let count = named.len() as u32;
        let lease =
            Lease { blocks, named, prefix_reads: turn.is_some(), request: request.to_owned(), prompt_digest: PromptDigest::default() };
        let lifetime = turn.unwrap_or(self.cfg.lease_duration);
        let lease_id = match turn {
            Some(ttl) => self.table.grant_turn(now, ttl, count, lease),
            None => self.table.grant(now, count, lease),
        };
        // The digest binds the lease id, which the table has only now given out.
        let (mut prompt_digest, mut block_ids) = (PromptDigest::default(), Vec::new());
        if let Some(lease) = self.table.get_mut(lease_id) {
            let fields = Bound { engine_id: &self.engine_id, incarnation: self.incarnation, lease_id, block_ids: &lease.named };
            prompt_digest = PromptDigest::bound(tokens, &fields);
            lease.prompt_digest = prompt_digest;
            block_ids = lease.named.clone();
        }
        // The new deadline may come before whatever the reaper sleeps until.
        out.rearm = true;
        out.changed = true;
        Granted { lease_id, prompt_digest, block_ids, lifetime, expiry: now + lifetime }
    }

    /// Everything P does with a message from engine `holder` (as the transport authenticated it;
    /// an agent's name through [`crate::peers::agent_holder`]): see [`LeaseTable::on_message`]
    /// (SPEC P2, P3, P6, P8, S5).
    pub fn on_message(&mut self, holder: &str, msg: &Message, now: Nanos, out: &mut Settled<B>) -> Answer {
        let holder = self.table.holder(holder);
        let mut released = Vec::new();
        let answer = self.table.on_message(holder, msg, now, &mut released);
        self.settle(now, released, out);
        answer
    }

    /// SPEC D4, O3, S5: `holder` will not read leases `ids`; those it may release end as
    /// `released`. Returns the ids answered lost (not live, or another engine's).
    pub fn release(&mut self, holder: &str, ids: &[LeaseId], now: Nanos, out: &mut Settled<B>) -> Vec<LeaseId> {
        let holder = self.table.holder(holder);
        self.release_as(holder, ids, now, out)
    }

    fn release_as(&mut self, holder: Holder, ids: &[LeaseId], now: Nanos, out: &mut Settled<B>) -> Vec<LeaseId> {
        let (mut lost, mut released) = (Vec::new(), Vec::new());
        self.table.release(holder, ids, now, &mut lost, &mut released);
        self.settle(now, released, out);
        lost
    }

    /// P releases a lease of its own that nobody will read (its client left, a router handed
    /// its params back): as a release from this engine, so one a decoder holds is not touched
    /// (S5). Returns whether it was live and is now released.
    pub fn release_own(&mut self, lease_id: LeaseId, now: Nanos, out: &mut Settled<B>) -> bool {
        let from = out.ended.len();
        let us = self.table.holder(&self.own);
        let lost = self.release_as(us, &[lease_id], now, out);
        lost.is_empty() && out.ended.len() > from
    }

    /// SPEC P5, S2, S4, S5: engine `holder` begins a read of `blocks` of lease `lease_id`,
    /// showing `tag`, its params' digest. Served only for a live lease `holder` may hold, of
    /// exactly the lease's blocks in its params' order, for the digest it was granted with; the
    /// blocks stay out of the pool until the ticket is handed to [`LeaseHolder::end_read`].
    pub fn begin_read(
        &mut self,
        holder: &str,
        lease_id: LeaseId,
        blocks: &[u32],
        tag: &[u8],
        now: Nanos,
        out: &mut Settled<B>,
    ) -> Result<ReadTicket, ReadRefused> {
        // Over a fenced transport this check is the only one before D uses the bytes, so a read
        // without a digest is refused.
        let digest = <[u8; 16]>::try_from(tag).map(PromptDigest).map_err(|_| ReadRefused::NoDigest)?;
        let holder = self.table.holder(holder);
        self.begin_read_as(holder, lease_id, blocks, digest, false, now, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn begin_read_as(
        &mut self,
        holder: Holder,
        lease_id: LeaseId,
        blocks: &[u32],
        digest: PromptDigest,
        whole: bool,
        now: Nanos,
        out: &mut Settled<B>,
    ) -> Result<ReadTicket, ReadRefused> {
        // SPEC S4: exactly the lease's blocks, in the order its params name them.
        let owned = self.table.get(lease_id).is_some_and(|l| reads_lease_blocks(&l.named, blocks, l.prefix_reads && !whole));
        if !owned {
            return Err(if self.table.get(lease_id).is_some() { ReadRefused::NotTheLeasesBlocks } else { ReadRefused::NotLive });
        }
        let mut released = Vec::new();
        let ticket = self.table.begin_read(holder, lease_id, Some(digest), now, &mut released);
        self.settle(now, released, out);
        ticket.ok_or(ReadRefused::NotLive)
    }

    /// SPEC P5: a read ended. Returns the blocks of a lease released while it was being read,
    /// if this was its last reader: only now may they be reused.
    pub fn end_read(&mut self, ticket: ReadTicket) -> Option<B> {
        self.table.end_read(ticket).map(|l| l.blocks)
    }

    /// SPEC O4: this engine was handed its own params `rk` (a `kv_both` engine a router paired
    /// with itself): the request takes the lease's blocks instead of reading them, as a read by
    /// this engine (of this incarnation; live, the digest it was granted with, exactly its blocks
    /// in order, the whole of a cached turn: S4, S5) that completes at once, ending the lease as
    /// `transferred`. Returns the lease's blocks, which the request copies its prompt's KV from.
    pub fn take_own(&mut self, rk: &RemoteKv, now: Nanos, out: &mut Settled<B>) -> Result<B, ReadRefused> {
        if rk.incarnation != self.incarnation {
            return Err(ReadRefused::NotLive);
        }
        let us = self.table.holder(&self.own);
        let ticket = self.begin_read_as(us, rk.lease_id, &rk.block_ids, rk.prompt_digest, true, now, out)?;
        let mut released = Vec::new();
        self.table.complete(us, rk.lease_id, 0, 1, rk.prompt_digest, now, &mut released);
        self.settle(now, released, out);
        // The read "ends" now: the lease's payload comes back to us, not to the pool.
        self.end_read(ticket).ok_or(ReadRefused::NotLive)
    }

    /// SPEC B1: the pool has `free` blocks and a request needs `need`: end cached turns, in the
    /// table's order ([`LeaseTable::evict_turn`]: the oldest nobody claimed, then the oldest a
    /// prefill engine renews but is not reading; never one under a read, P5), until `need`
    /// blocks are free or coming back, or none is left to end. A cached turn is a cache: its
    /// blocks go to new requests rather than leaving them waiting out the TTL.
    pub fn evict_turns(&mut self, free: usize, need: usize, now: Nanos, out: &mut Settled<B>) -> TurnEviction {
        // Blocks come back at once where reads are fenced, after the quarantine otherwise: count
        // what the quarantine and the evictions will give back, not only what the pool has now,
        // or each pass during a quarantine would evict more turns.
        let mut coming = free + self.quarantine.iter().map(|b| b.ids().len()).sum::<usize>();
        let mut eviction = TurnEviction::default();
        while coming < need {
            let mut released = Vec::new();
            let evicted = self.table.evict_turn(now, &mut released);
            coming += released.iter().filter_map(|r| r.payload.as_ref()).map(|l| l.blocks.ids().len()).sum::<usize>();
            eviction.ended += released.len();
            self.settle(now, released, out);
            match evicted {
                Some(e) => eviction.evicted.push(e),
                None => break,
            }
        }
        eviction
    }

    /// SPEC P5, D6: blocks a READ that failed or timed out may still land in, where the
    /// transport cannot fence it: held by the quarantine (`None`), or back at once (`Some`) where
    /// reads are fenced.
    pub fn quarantine(&mut self, now: Nanos, blocks: B, out: &mut Settled<B>) -> Option<B> {
        let held = self.quarantine.hold(now, blocks);
        if held.is_none() {
            out.rearm = true;
        }
        held
    }

    /// SPEC P4: the reaper's turn. Ends leases past their deadline as `expired`, at most
    /// [`REAP_BUDGET`] expiry-index entries at a time, and lets out quarantined blocks whose hold
    /// has ended. Returns whether work is left: then poll again at once (after letting renewals
    /// and reads in); else sleep until [`LeaseHolder::poll_timeout`].
    pub fn poll(&mut self, now: Nanos, out: &mut Settled<B>) -> bool {
        let mut released = Vec::new();
        let more = if self.head_only {
            // vLLM's head-only sweep, run at least every granularity (the head may be released
            // before its deadline).
            let granularity = self.cfg.reap_granularity();
            self.head_next = self.table.tick_head_only(now, &mut released).map(|d| d.min(now + granularity));
            false
        } else {
            self.table.tick_budget(now, REAP_BUDGET, &mut released)
        };
        self.settle(now, released, out);
        self.quarantine.poll(now, &mut out.freed);
        more
    }

    /// SPEC P4: when the driver must call [`LeaseHolder::poll`] next, asked at `now` after a
    /// poll: the table's next expiry (a lower bound, never later than the truth) or the
    /// quarantine's next release, whichever is first, but never sooner than a quarter of the
    /// granularity P4 allows (no spinning on a lower bound that is due but expires nothing, a
    /// renewed lease) and never later than P4 does. `None`: nothing to do until a call of this
    /// holder says [`Settled::rearm`].
    pub fn poll_timeout(&self, now: Nanos) -> Option<Nanos> {
        let next_expiry = if self.head_only { self.head_next } else { self.table.next_expiry() };
        let next = match (next_expiry, self.quarantine.next_release()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        next.map(|t| t.max(now + self.cfg.reap_granularity() / 4))
    }

    /// Engine shutdown: every lease ends as `shutdown`, and every block comes back, quarantined
    /// ones too (the process's memory goes with it).
    pub fn shutdown(&mut self, now: Nanos, out: &mut Settled<B>) {
        let mut released = Vec::new();
        self.table.shutdown(now, &mut released);
        self.settle(now, released, out);
        out.freed.extend(self.quarantine.drain());
    }

    /// Whether lease `lease_id` is live.
    pub fn is_live(&self, lease_id: LeaseId) -> bool {
        self.table.get(lease_id).is_some()
    }

    /// Live leases (`kvlease_leases_active`).
    pub fn live(&self) -> usize {
        self.table.live()
    }

    /// Blocks pinned by live leases (`kvlease_leased_blocks`).
    pub fn leased_blocks(&self) -> u64 {
        self.table.leased_blocks()
    }

    /// Blocks held by the quarantine.
    pub fn quarantined(&self) -> usize {
        self.quarantine.len()
    }

    /// Live cached turns.
    pub fn turns(&self) -> usize {
        self.table.turns()
    }

    /// SPEC P3, P5: where the blocks of leases that just ended go: nowhere yet while a reader
    /// holds them (they come back from [`LeaseHolder::end_read`]); through the quarantine when a
    /// READ the transport cannot fence may be on its way (expired, released, shut down); at once
    /// when every expected reader reported completion.
    fn settle(&mut self, now: Nanos, released: Vec<Released<Lease<B>>>, out: &mut Settled<B>) {
        if released.is_empty() {
            return;
        }
        out.changed = true;
        for r in released {
            let request = match r.payload {
                Some(lease) => {
                    if !r.reason.may_have_readers() {
                        out.freed.push(lease.blocks);
                    } else if let Some(blocks) = self.quarantine(now, lease.blocks, out) {
                        out.freed.push(blocks);
                    }
                    lease.request
                }
                // The table's parked copy: its request's name, for the log.
                None => self.table.parked_payload(r.lease_id).map(|l| l.request.clone()).unwrap_or_default(),
            };
            out.ended.push(Ended { lease_id: r.lease_id, reason: r.reason, held: r.held, request });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const SEC: u64 = 1_000 * MS;
    const T0: Nanos = Nanos(3_600 * SEC);

    /// Blocks that say when they come back: the test's pool is what `Settled::freed` holds.
    #[derive(Debug, PartialEq, Eq)]
    struct Ids(Vec<u32>);

    impl BlockGuard for Ids {
        fn ids(&self) -> &[u32] {
            &self.0
        }
    }

    fn holder(fenced: bool) -> LeaseHolder<Ids> {
        let mut h = LeaseHolder::new(&LeaseConfig::default(), "p", 3, 16);
        h.set_fenced_reads(fenced);
        h
    }

    /// Params of this holder's lease `g` naming `blocks`, from incarnation `incarnation`.
    fn own(g: &Granted, blocks: &[u32], incarnation: u64) -> RemoteKv {
        RemoteKv {
            engine_id: "p".into(),
            request_id: "r".into(),
            block_ids: blocks.to_vec(),
            host: "h".into(),
            port: 1,
            tp_size: 1,
            num_tokens: 1,
            lease_id: g.lease_id,
            incarnation,
            prompt_digest: g.prompt_digest,
            signature: None,
        }
    }

    fn freed(out: &Settled<Ids>) -> Vec<&[u32]> {
        out.freed.iter().map(|b| b.ids()).collect()
    }

    fn reasons(out: &Settled<Ids>) -> Vec<(LeaseId, ReleaseReason)> {
        out.ended.iter().map(|e| (e.lease_id, e.reason)).collect()
    }

    /// SPEC P1, §10: a grant names every block in order, binds the digest to them and the lease,
    /// and its params' expiry is L away; a prefill without blocks gets no lease.
    #[test]
    fn p1_a_grant_binds_its_blocks_and_says_when_it_lapses() {
        let mut h = holder(true);
        let mut out = Settled::default();
        let g = h.grant(T0, "r", Ids(vec![7, 3, 5]), &[1, 2, 3], &mut out).unwrap();
        assert_eq!(g.block_ids, vec![7, 3, 5]);
        assert_eq!(g.expiry, T0 + LeaseConfig::default().lease_duration);
        let fields = Bound { engine_id: "p", incarnation: 3, lease_id: g.lease_id, block_ids: &[7, 3, 5] };
        assert!(g.prompt_digest.describes(3, &[1, 2, 3], &fields));
        assert!(out.rearm, "a new deadline may be the earliest");
        assert_eq!(h.grant(T0, "r", Ids(vec![]), &[1], &mut out), Err(GrantError::NoBlocks));
        assert_eq!(freed(&out), vec![&[] as &[u32]], "its (no) blocks go back at once");
        assert_eq!(h.live(), 1);
    }

    /// SPEC S4: a read names exactly the lease's blocks in the order its params name them, and
    /// shows the digest the lease was granted with; a cached turn may be read as an in-order
    /// prefix (B4), but taken whole only (O4).
    #[test]
    fn s4_a_read_names_exactly_the_leases_blocks_in_order() {
        let mut h = holder(true);
        let mut out = Settled::default();
        let g = h.grant(T0, "r", Ids(vec![7, 3, 5]), &[1, 2, 3], &mut out).unwrap();
        let tag = g.prompt_digest.0;
        for bad in [vec![3, 5, 7], vec![5, 3, 7], vec![7, 7, 7], vec![7, 3], vec![3, 5], vec![7, 3, 5, 1]] {
            assert_eq!(h.begin_read("d/1", g.lease_id, &bad, &tag, T0, &mut out), Err(ReadRefused::NotTheLeasesBlocks), "{bad:?}");
        }
        assert_eq!(h.begin_read("d/1", g.lease_id, &[7, 3, 5], &tag[..15], T0, &mut out), Err(ReadRefused::NoDigest));
        let bare = PromptDigest::of(&[1, 2, 3]).0;
        assert_eq!(h.begin_read("d/1", g.lease_id, &[7, 3, 5], &bare, T0, &mut out), Err(ReadRefused::NotLive));
        assert_eq!(h.begin_read("d/1", g.lease_id + 1, &[7, 3, 5], &tag, T0, &mut out), Err(ReadRefused::NotLive));
        let ticket = h.begin_read("d/1", g.lease_id, &[7, 3, 5], &tag, T0, &mut out).unwrap();
        assert_eq!(h.end_read(ticket), None, "the lease is still live");

        let t = h.grant_turn(T0, "turn", Ids(vec![9, 8, 6]), &[1; 20], &mut out);
        assert_eq!(t.block_ids, vec![9, 8], "20 tokens fill two blocks of 16");
        assert_eq!(t.expiry, T0 + LeaseConfig::default().decoder_kv_blocks_ttl);
        let ticket = h.begin_read("p2/1", t.lease_id, &[9], &t.prompt_digest.0, T0, &mut out).unwrap();
        assert_eq!(h.end_read(ticket), None);
        assert_eq!(h.take_own(&own(&t, &[9], 3), T0, &mut out).err(), Some(ReadRefused::NotTheLeasesBlocks));
        // A cached turn another engine claimed is not ours to take; a lease nobody claimed is,
        // by this incarnation only.
        assert_eq!(h.take_own(&own(&t, &[9, 8], 3), T0, &mut out).err(), Some(ReadRefused::NotLive));
        let g2 = h.grant(T0, "own", Ids(vec![4]), &[1], &mut out).unwrap();
        assert_eq!(h.take_own(&own(&g2, &[4], 5), T0, &mut out).err(), Some(ReadRefused::NotLive));
        assert_eq!(h.take_own(&own(&g2, &[4], 3), T0, &mut out), Ok(Ids(vec![4])));
        assert_eq!(out.ended.last().map(|e| (e.reason, e.request.as_str())), Some((ReleaseReason::Transferred, "own")));
    }

    /// SPEC P5: unfenced, the blocks of a lease that ended with a READ possibly on its way sit out
    /// the quarantine, and the reaper is told to wake for them; a lease every reader completed
    /// gives its blocks back at once; fenced, everything comes back at once; blocks under a
    /// reader come back only when it ends.
    #[test]
    fn p5_unfenced_blocks_of_an_ended_lease_sit_out_the_quarantine() {
        let cfg = LeaseConfig::default();
        let mut h = holder(false);
        let mut out = Settled::default();
        let a = h.grant(T0, "a", Ids(vec![1]), &[1], &mut out).unwrap();
        let b = h.grant(T0, "b", Ids(vec![2]), &[2], &mut out).unwrap();
        let mut out = Settled::default();
        assert!(h.release_own(a.lease_id, T0, &mut out));
        assert!(out.freed.is_empty() && out.rearm, "released: a READ may be on its way");
        assert_eq!(h.quarantined(), 1);
        let done = Message::ReadDone { lease_id: b.lease_id, consumer_rank: 0, n: 1, digest: b.prompt_digest };
        let mut out = Settled::default();
        h.on_message("d", &done, T0, &mut out);
        assert_eq!(freed(&out), vec![&[2u32] as &[u32]], "transferred: nothing in flight");
        assert_eq!(h.poll_timeout(T0), Some(T0 + cfg.quarantine()));
        let mut out = Settled::default();
        h.poll(T0 + cfg.quarantine() - Duration::from_nanos(1), &mut out);
        assert!(out.freed.is_empty());
        h.poll(T0 + cfg.quarantine(), &mut out);
        assert_eq!(freed(&out), vec![&[1u32] as &[u32]]);
        assert_eq!(h.poll_timeout(T0 + cfg.quarantine()), None, "nothing left: the reaper sleeps");

        let mut fenced = holder(true);
        let mut out = Settled::default();
        let c = fenced.grant(T0, "c", Ids(vec![3]), &[3], &mut out).unwrap();
        let ticket = fenced.begin_read("d", c.lease_id, &[3], &c.prompt_digest.0, T0, &mut out).unwrap();
        let mut out = Settled::default();
        assert!(fenced.release("d", &[c.lease_id], T0, &mut out).is_empty());
        assert!(out.freed.is_empty(), "a reader still holds the blocks");
        assert_eq!(out.ended[0].request, "c", "named from the parked lease");
        assert_eq!(fenced.end_read(ticket), Some(Ids(vec![3])));
        assert_eq!(fenced.quarantine(T0, Ids(vec![4]), &mut out), Some(Ids(vec![4])), "fenced: nothing is held");
    }

    /// SPEC P4 (vLLM #58222): one poll ends every lease past its deadline in deadline order,
    /// not grant order, also behind an older lease that was renewed.
    #[test]
    fn p4_poll_reaps_in_deadline_order_not_grant_order() {
        let mut h = holder(true);
        let mut out = Settled::default();
        let ids: Vec<LeaseId> = (0..3u32)
            .map(|i| h.grant(T0 + Duration::from_secs(u64::from(i)), "r", Ids(vec![i]), &[i], &mut out).unwrap().lease_id)
            .collect();
        // The oldest is renewed past the others.
        h.on_message("d", &Message::Heartbeat { seq: 1, lease_ids: vec![ids[0]] }, T0 + Duration::from_secs(15), &mut out);
        let mut out = Settled::default();
        while h.poll(T0 + Duration::from_secs(40), &mut out) {}
        let expired = |id| (id, ReleaseReason::Expired);
        assert_eq!(reasons(&out), vec![expired(ids[1]), expired(ids[2]), expired(ids[0])]);
        assert_eq!(out.freed.len(), 3, "fenced: every block back at once");
        assert_eq!(h.live(), 0);
    }

    /// SPEC P4: driven by `poll_timeout` alone, the reaper ends each lease at most one
    /// granularity after its deadline, sleeps at least a quarter of a granularity between polls
    /// (no spinning on a bound that expires nothing: a renewed lease), and not at all while
    /// nothing is live or quarantined.
    #[test]
    fn p4_poll_timeout_wakes_the_reaper_within_the_granularity() {
        let cfg = LeaseConfig::default();
        let (l, e, g) = (cfg.lease_duration, cfg.extension, cfg.reap_granularity());
        let mut h = holder(true);
        let mut out = Settled::default();
        assert_eq!(h.poll_timeout(T0), None, "idle: no timer at all");
        let a = h.grant(T0, "a", Ids(vec![1]), &[1], &mut out).unwrap().lease_id;
        let b = h.grant(T0 + Duration::from_millis(1_234), "b", Ids(vec![2]), &[2], &mut out).unwrap().lease_id;
        let renewed = T0 + Duration::from_secs(15);
        h.on_message("d", &Message::Heartbeat { seq: 1, lease_ids: vec![a] }, renewed, &mut out);
        let deadline = |id| if id == a { renewed + e } else { T0 + Duration::from_millis(1_234) + l };
        let mut now = T0;
        let mut polls = 0;
        while let Some(next) = h.poll_timeout(now) {
            assert!(next >= now + g / 4, "no spinning: {next:?} after {now:?}");
            now = next;
            let mut out = Settled::default();
            while h.poll(now, &mut out) {}
            for ended in &out.ended {
                assert_eq!(ended.reason, ReleaseReason::Expired);
                let late = now.0 - deadline(ended.lease_id).0;
                assert!(late <= g.as_nanos() as u64, "lease {} ended {late} ns after its deadline", ended.lease_id);
            }
            polls += 1;
            assert!(polls < 1_000, "the reaper must not poll this often for two leases");
        }
        assert_eq!(h.live(), 0, "both ended, and then the reaper sleeps: {b}");
    }

    /// SPEC B1: cached turns are evicted, oldest unclaimed first, then claimed ones not under a
    /// read, never one under a read, until the blocks a request needs are free or coming —
    /// counting what the quarantine will give back, so a quarantine does not evict more.
    #[test]
    fn b1_turns_are_evicted_in_order_until_enough_blocks_are_coming() {
        let mut h = holder(false);
        let mut out = Settled::default();
        let turn = |h: &mut LeaseHolder<Ids>, ids: Vec<u32>, out: &mut Settled<Ids>| h.grant_turn(T0, "t", Ids(ids), &[1; 32], out);
        let (t1, t2, t3, t4) = (
            turn(&mut h, vec![1, 2], &mut out),
            turn(&mut h, vec![3, 4], &mut out),
            turn(&mut h, vec![5, 6], &mut out),
            turn(&mut h, vec![7, 8], &mut out),
        );
        // t1 is claimed (renewed) by a prefill engine, t2 is being read by one.
        h.on_message("p2", &Message::Heartbeat { seq: 1, lease_ids: vec![t1.lease_id] }, T0, &mut out);
        let reading = h.begin_read("p2/0", t2.lease_id, &[3], &t2.prompt_digest.0, T0, &mut out).unwrap();
        let mut out = Settled::default();
        let ev = h.evict_turns(1, 4, T0, &mut out);
        assert_eq!(ev.evicted, vec![Evicted::Unclaimed(t3.lease_id), Evicted::Unclaimed(t4.lease_id)], "1 free + 2 + 2 ≥ 4");
        assert_eq!(ev.ended, 2);
        assert_eq!(h.quarantined(), 2, "unfenced: their blocks come back after the quarantine");
        assert_eq!(h.evict_turns(0, 4, T0, &mut out), TurnEviction::default(), "the quarantined blocks count as coming");
        let ev = h.evict_turns(0, 8, T0, &mut out);
        assert_eq!(ev.evicted, vec![Evicted::Claimed(t1.lease_id)], "never the one under a read");
        assert!(h.is_live(t2.lease_id));
        assert_eq!(h.end_read(reading), None);
        assert_eq!(h.turns(), 1);
    }
}
