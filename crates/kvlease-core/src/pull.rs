//! D's pull of one request's KV (SPEC D6, T1, T2), as a state machine fed `now`.
//!
//! A pull goes through three waits, each with a deadline this module sets:
//! 1. **waiting for a live acknowledgement**: the renewer must know the lease acknowledged live
//!    for longer than the read budget ([`crate::renewer::ReadCheck`]); at most `ack_wait`;
//! 2. **reading**: the incarnation of P as the handshake knows it must still be the one that
//!    granted the lease (a restarted P reuses lease ids), then the reads run, at most
//!    `read_timeout`;
//! 3. **waiting for `ReadDoneAck`s**: the bytes are used only if P confirms, for every read, that
//!    the lease was live when it completed; at most `read_done_ack_wait` (the read timeout,
//!    capped at 2 s). P answers a `ReadDone` at once, so a longer wait only holds a slot of D
//!    for a lost message: under 20 % loss, waiting E (20 s) per lost acknowledgement cut D's
//!    throughput tenfold in the simulator, and a wait of E/4 made longer leases serve fewer
//!    requests under 1 % loss; giving up costs one prefill.
//!
//! Over a **fenced** transport (the `tcp` agent: P's gate admits each read only for a live lease
//! whose prompt digest the read shows, and keeps the blocks from reuse until the last byte has
//! left, SPEC P5, S4) the read itself is the proof waits 1 and 3 stand in for on NIXL, whose
//! one-sided READ P never sees: a fenced pull reads at once (no renewal first: a lease that has
//! ended is refused, one that ends mid-read keeps its blocks until the read is out) and uses the
//! bytes as soon as they have landed; P still gets the `ReadDone` and frees the blocks at once.
//! That saves two round trips per request (issue 15) and keeps every guarantee.
//!
//! The driver carries out the waits and the reads; every decision — what to wait for, until
//! when, whether the bytes may be used, and what the request does when they may not
//! ([`Verdict`]) — is made here.

use crate::config::{LeaseConfig, LoadFailurePolicy};
use crate::renewer::ReadCheck;
use crate::tp::{read_plan, ReadPair};
use crate::Nanos;
use std::fmt;
use std::time::Duration;

/// The least wait before a renewal for a read is sent again ([`Pull::measured_round_trip`]).
pub const MIN_RESEND: Duration = Duration::from_millis(10);

/// Why a pull's bytes must not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullLost {
    /// P reported the lease lost (or it was never tracked).
    LeaseLost,
    /// The last handshake with P failed: nothing can renew or read the lease (SPEC D5).
    Unreachable { engine_id: String },
    /// No heartbeat acknowledgement covered the read in time.
    NoLiveAck { engine_id: String, waited: Duration },
    /// No handshake with P has completed (it was forgotten or disconnected meanwhile).
    NoPeer,
    /// P restarted after granting: the same lease id may name another request's blocks (§3).
    Restarted { granted_by: u64, now: u64 },
    /// P's ranks cannot serve our heads (SPEC T1).
    Topology { p_ranks: u32, heads: u32 },
    /// The reads did not finish within the read timeout.
    ReadTimedOut { after: Duration },
    /// The transport failed a read.
    ReadFailed(ReadFailure),
    /// P did not confirm every read completion in time.
    NoReadDoneAck,
    /// P said the lease had ended when a read completed: the bytes may be anything (SPEC P5).
    EndedUnderRead,
}

impl PullLost {
    /// A short name for logs and failure labels (`kvlease_<kind>`).
    pub fn kind(&self) -> &'static str {
        match self {
            PullLost::LeaseLost => "lease_lost",
            PullLost::Unreachable { .. } => "unreachable",
            PullLost::NoLiveAck { .. } => "lease_unconfirmed",
            PullLost::NoPeer => "no_peer",
            PullLost::Restarted { .. } => "restarted",
            PullLost::Topology { .. } => "topology",
            PullLost::ReadTimedOut { .. } => "read_timed_out",
            PullLost::ReadFailed(_) => "read_failed",
            PullLost::NoReadDoneAck => "read_unconfirmed",
            PullLost::EndedUnderRead => "read_lost",
        }
    }
}

impl fmt::Display for PullLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PullLost::LeaseLost => write!(f, "the prefill engine reported the lease lost"),
            PullLost::Unreachable { engine_id } => write!(f, "no handshake with the prefill engine {engine_id}"),
            PullLost::NoLiveAck { engine_id, waited } => {
                write!(f, "no heartbeat acknowledgement from {engine_id} within {waited:?}")
            }
            PullLost::NoPeer => write!(f, "no connection to the prefill engine"),
            PullLost::Restarted { .. } => write!(f, "the prefill engine restarted since it granted the lease"),
            PullLost::Topology { p_ranks, heads } => write!(f, "a prefill engine of {p_ranks} ranks cannot serve {heads} heads"),
            PullLost::ReadTimedOut { after } => write!(f, "the read timed out after {after:?}"),
            PullLost::ReadFailed(e) => write!(f, "the read failed: {e}"),
            PullLost::NoReadDoneAck => write!(f, "no read-completion acknowledgement from the prefill engine"),
            PullLost::EndedUnderRead => write!(f, "the lease ended before the read completed"),
        }
    }
}

/// Why a read failed, as the driver saw it: the core only decides that its bytes are not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadFailure {
    /// The transport returned an error for one of the reads (its message).
    #[error("{0}")]
    Transport(String),
    /// The task that ran the pull panicked.
    #[error("the pull panicked")]
    Panicked,
}

/// What the request does after its pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every byte is in our blocks and P confirmed the lease live at each completion: decode.
    Use,
    /// The bytes must not be used; compute the prompt locally (`kv_load_failure_policy:
    /// recompute`, SPEC D7 keeps the output the same).
    Recompute(PullLost),
    /// The bytes must not be used; fail the request (`kv_load_failure_policy: fail`).
    Fail(PullLost),
}

/// What the driver does next.
/// What a pull does once its reads returned ([`Pull::reads_done`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterReads {
    /// Wait for P's `ReadDoneAck`s until `until` ([`Pull::on_read_done_ack`], [`Pull::on_deadline`]).
    AwaitAcks { until: Nanos },
    /// Decided: no confirmation to wait for (a fenced transport), or the reads failed.
    Decided(Verdict),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Wait for news from P (an acknowledgement, a lost lease) or until `until`, then
    /// [`Pull::check`] again. `renew`: the renewer queued a renewal; wake it first.
    Wait { until: Nanos, renew: bool },
    /// Safe to read now: call [`Pull::begin_read`].
    Read,
    /// The pull is over; the bytes must not be used.
    Lost(PullLost),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitLive { until: Nanos },
    Reading { until: Nanos },
    AwaitAcks { until: Nanos, want: u32, live: u32 },
    Done,
}

/// One pull.
#[derive(Debug, Clone)]
pub struct Pull {
    engine_id: String,
    incarnation: u64,
    read_budget: Duration,
    read_timeout: Duration,
    /// How long P's `ReadDoneAck`s are waited for once the reads landed.
    ack_after_read: Duration,
    ack_wait: Duration,
    policy: LoadFailurePolicy,
    /// The transport fences reads (see the module doc).
    fenced: bool,
    /// How long to wait for the acknowledgement of a renewal for this read before asking for
    /// another: a lost renewal is sent again, from 50 ms doubling up to I/2, rather than left to
    /// the next interval's heartbeat (or to `ack_wait`).
    renew_retry: Duration,
    max_renew_retry: Duration,
    /// When the renewal asked for last may be asked for again: a wake-up for anything else
    /// before then (another pull's news) neither resends it nor advances the back-off.
    retry_at: Option<Nanos>,
    /// When the pull began, and how long after it a read may wait for P's link as well as for an
    /// acknowledgement ([`Pull::waiting_for_link`]).
    start: Nanos,
    link_wait: Duration,
    state: State,
    #[doc(hidden)]
    pub planted: Option<PlantedBug>,
}

/// Bugs the deterministic simulator must be able to find: each skips one of the core's checks
/// (the pull's, the router's: [`crate::route`], or a vLLM P's: [`crate::issued`]). Never set outside the
/// simulators' own tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedBug {
    /// Read without checking that P's incarnation is still the one that granted the lease.
    SkipIncarnationCheck,
    /// Use the bytes as soon as the reads return, without P's `ReadDoneAck`s.
    SkipReadDoneAck,
    /// Use the bytes whatever the pull found: the fencing verdict ignored.
    IgnoreVerdict,
    /// vLLM before leases: no renewal, no liveness check, no confirmation; D reads when it gets
    /// to the request and uses whatever it read (the `fixed` policy of `kvlease sim`).
    FixedTimeout,
    /// vLLM's lease as vLLM implements it (the `vllm-lease` policy of `kvlease sim`): D renews
    /// by heartbeats as kvlease's does, but there is no lease-lost answer D acts on and no
    /// confirmation — D reads when it gets to the request and uses whatever it read, like
    /// [`PlantedBug::FixedTimeout`] — and P's expiry sweep is head-only in grant order (vLLM
    /// #58222; `LeaseTable::tick_head_only`).
    VllmLease,
    /// The router retries a decode leg on another decoder also after the first byte of its
    /// answer reached the client (SPEC O2 allows it only before): the client gets the first
    /// decoder's tokens and then the second's whole answer.
    RetryAfterFirstByte,
    /// vLLM's P before 6ee67ac ([`crate::issued::IssuedLeases`]): a renewal of a lease not
    /// granted yet is answered "not lost" but dropped, not applied at the grant, so the
    /// acknowledgement D reads on does not hold (vLLM's grant may come with less than E left).
    EarlyRenewalDropped,
    /// [`crate::issued::IssuedLeases`] answers a `ReadDone` of a lease that expired as if the
    /// lease had ended by its read: confirmed, though its blocks may have been reused (P5).
    ConfirmExpiredRead,
    /// Push mode, D's engine (vLLM #53095): D's heartbeats name a key P never matches (D's own
    /// request id), so nothing D waits for is renewed.
    PushHeartbeatWrongKey,
    /// Push mode, D's engine (vLLM #46283): a request D gives up never tells P (its
    /// `PushRelease` is not sent); P holds the blocks to expiry.
    PushAbortNotSent,
    /// Push mode, P's engine (vLLM #48633): a write that failed, or could not be posted, is only
    /// logged: neither the core nor D hears of it.
    PushFailureOnlyLogged,
}

impl PlantedBug {
    /// Reads without a liveness check and uses the bytes without P's confirmation (vLLM's
    /// unfenced reads, with or without its lease).
    fn unconfirmed(self) -> bool {
        matches!(self, PlantedBug::FixedTimeout | PlantedBug::VllmLease)
    }
}

impl Pull {
    /// A pull of the lease P engine `engine_id` (incarnation `incarnation`) granted, starting at
    /// `now`.
    /// A pull of a lease granted by `engine_id` in its incarnation `incarnation`, over a
    /// transport whose reads are `fenced` or not.
    pub fn new(cfg: &LeaseConfig, engine_id: &str, incarnation: u64, fenced: bool, now: Nanos) -> Pull {
        let ack_wait = cfg.ack_wait();
        Pull {
            engine_id: engine_id.to_string(),
            incarnation,
            read_budget: cfg.read_budget(),
            read_timeout: cfg.read_timeout(),
            ack_after_read: cfg.read_done_ack_wait(),
            ack_wait,
            policy: cfg.load_failure_policy,
            fenced,
            renew_retry: Duration::from_millis(50).min(cfg.heartbeat_interval / 2),
            max_renew_retry: cfg.heartbeat_interval / 2,
            retry_at: None,
            start: now,
            link_wait: ack_wait,
            state: State::AwaitLive { until: now + ack_wait },
            planted: None,
        }
    }

    /// A driver whose links to P come late (vLLM's worker handshakes only on a heartbeat step or
    /// for a read): a read whose wait for an acknowledgement ran out while there was still no
    /// link to P waits once more, for `ack_wait`, if it began less than `wait` ago — a lease
    /// nobody could renew is gone after L anyway. Without it, that wait is `ack_wait`.
    pub fn waiting_for_link(mut self, wait: Duration) -> Pull {
        self.link_wait = wait.max(self.ack_wait);
        self
    }

    /// A driver whose confirmations come from a P that may be busy for longer than the default
    /// ([`LeaseConfig::read_done_ack_wait`]): P's `ReadDoneAck`s are waited for `wait` once the
    /// reads landed.
    pub fn confirming_within(mut self, wait: Duration) -> Pull {
        self.ack_after_read = wait;
        self
    }

    /// The round trip to P as the renewer measured it ([`crate::renewer::Renewer::round_trip`]):
    /// a renewal for this read whose acknowledgement has not come after two of them (at least
    /// [`MIN_RESEND`], at most I/2) is sent again, then after twice as long each time — not after
    /// a fixed 50 ms. Only before the first resend: the back-off is not undone. The floor keeps a
    /// round trip measured on an idle link from turning a slow P's acknowledgements into a burst
    /// of resends from every waiting read.
    pub fn measured_round_trip(&mut self, rtt: Duration) {
        if self.retry_at.is_none() {
            self.renew_retry = (rtt * 2).clamp(MIN_RESEND, self.max_renew_retry.max(MIN_RESEND));
        }
    }

    /// How long a read may take and still be safe (the renewer's `read_check` budget).
    pub fn read_budget(&self) -> Duration {
        self.read_budget
    }

    /// Whether this pull's reads are fenced (what `Renewer::read_check` must be told too).
    pub fn fenced(&self) -> bool {
        self.fenced
    }

    /// Step 1: the renewer's answer to "may I read now?" (SPEC D6).
    pub fn check(&mut self, answer: ReadCheck, now: Nanos) -> Step {
        let State::AwaitLive { until } = self.state else {
            return Step::Lost(PullLost::LeaseLost);
        };
        let lost = match answer {
            ReadCheck::Safe => return Step::Read,
            _ if self.planted.is_some_and(PlantedBug::unconfirmed) => return Step::Read,
            ReadCheck::Untracked => PullLost::LeaseLost,
            ReadCheck::Unreachable => PullLost::Unreachable { engine_id: self.engine_id.clone() },
            ReadCheck::NoLink if now >= until && now < self.start + self.link_wait => {
                // No link to P yet: the wait for its answer starts again, once.
                let until = now + self.ack_wait;
                self.state = State::AwaitLive { until };
                self.retry_at = None;
                return Step::Wait { until: (now + self.renew_retry).min(until), renew: true };
            }
            ReadCheck::RenewFirst | ReadCheck::NoLink if now < until => {
                if let Some(at) = self.retry_at.filter(|&at| now < at) {
                    return Step::Wait { until: at.min(until), renew: false };
                }
                let at = now + self.renew_retry;
                self.retry_at = Some(at);
                self.renew_retry = (self.renew_retry * 2).min(self.max_renew_retry);
                return Step::Wait { until: at.min(until), renew: true };
            }
            ReadCheck::RenewFirst | ReadCheck::NoLink => PullLost::NoLiveAck { engine_id: self.engine_id.clone(), waited: self.ack_wait },
        };
        self.state = State::Done;
        Step::Lost(lost)
    }

    /// Step 2: about to read. `peer`: P's incarnation and rank count as the last handshake
    /// found them; `heads`/`d_tp`: our geometry. Returns the reads to post (one per D rank and
    /// P rank whose heads overlap, SPEC T1/T2) and the deadline for all of them.
    pub fn begin_read(&mut self, peer: Option<(u64, u32)>, heads: u32, d_tp: u32, now: Nanos) -> Result<(Vec<ReadPair>, Nanos), PullLost> {
        let result = self.plan(peer, heads, d_tp);
        match &result {
            Ok(_) => {
                let until = now + self.read_timeout;
                self.state = State::Reading { until };
                result.map(|plan| (plan, until))
            }
            Err(_) => {
                self.state = State::Done;
                result.map(|plan| (plan, now))
            }
        }
    }

    fn plan(&self, peer: Option<(u64, u32)>, heads: u32, d_tp: u32) -> Result<Vec<ReadPair>, PullLost> {
        if !matches!(self.state, State::AwaitLive { .. }) {
            return Err(PullLost::LeaseLost);
        }
        let Some((incarnation, p_ranks)) = peer else { return Err(PullLost::NoPeer) };
        if incarnation != self.incarnation && self.planted != Some(PlantedBug::SkipIncarnationCheck) {
            return Err(PullLost::Restarted { granted_by: self.incarnation, now: incarnation });
        }
        read_plan(heads, p_ranks, d_tp).ok_or(PullLost::Topology { p_ranks, heads })
    }

    /// Step 2 for a driver whose transport plans and posts the reads itself (vLLM's worker): the
    /// lease was found safe to read ([`Step::Read`]) and the reads go now. Returns their
    /// deadline.
    pub fn reading(&mut self, now: Nanos) -> Result<Nanos, PullLost> {
        if !matches!(self.state, State::AwaitLive { .. }) {
            self.state = State::Done;
            return Err(PullLost::LeaseLost);
        }
        let until = now + self.read_timeout;
        self.state = State::Reading { until };
        Ok(until)
    }

    /// Step 3: the reads returned (`Err`: the first failure) or their deadline passed
    /// (`timed_out`). Over a fenced transport landed bytes are decided at once; otherwise P's
    /// `ReadDoneAck`s, one per read, are waited for until the deadline returned.
    pub fn reads_done(&mut self, result: Result<u32, ReadFailure>, timed_out: bool, now: Nanos) -> AfterReads {
        let State::Reading { .. } = self.state else { return AfterReads::Decided(self.finish(Err(PullLost::LeaseLost))) };
        let outcome = match result {
            _ if timed_out => Err(PullLost::ReadTimedOut { after: self.read_timeout }),
            Err(e) => Err(PullLost::ReadFailed(e)),
            Ok(_) if self.fenced => Ok(()),
            Ok(n) => {
                let until = now + self.ack_after_read;
                self.state = State::AwaitAcks { until, want: n, live: 0 };
                return AfterReads::AwaitAcks { until };
            }
        };
        AfterReads::Decided(self.finish(outcome))
    }

    /// One `ReadDoneAck` arrived. `Some` once the pull is decided: [`Verdict::Use`] when every
    /// read was confirmed live, else the lost verdict. A `live: false` decides at once.
    pub fn on_read_done_ack(&mut self, live: bool) -> Option<Verdict> {
        let State::AwaitAcks { until, want, live: got } = self.state else { return None };
        if !live {
            return Some(self.finish(Err(PullLost::EndedUnderRead)));
        }
        let got = got + 1;
        self.state = State::AwaitAcks { until, want, live: got };
        (got >= want).then(|| self.finish(Ok(())))
    }

    /// The renewer reported the lease lost (P answered a heartbeat or renewal naming it lost).
    /// `Some(verdict)` while no read was posted: the bytes will never be read, the request
    /// recomputes or fails now. `None` once the reads were posted (or the pull was decided):
    /// their `ReadDone`s decide. P also ends a lease *on* its read (vLLM's P frees the blocks
    /// when D's transfer notification arrives, which can reach P before D's own engine sees its
    /// read land), so a loss reported then may be the read's own completion: P answers that
    /// read's `ReadDone` live if the lease was still held when it completed, lost otherwise
    /// (SPEC D6, P5). Failing the load on the report as well decided the request twice (inside
    /// vLLM, its worker asserted and D's engine died).
    pub fn on_lease_lost(&mut self) -> Option<Verdict> {
        match self.state {
            State::AwaitLive { .. } => Some(self.finish(Err(PullLost::LeaseLost))),
            State::Reading { .. } | State::AwaitAcks { .. } | State::Done => None,
        }
    }

    /// Whether the pull still waits for `ReadDoneAck`s. With the planted bug
    /// [`PlantedBug::SkipReadDoneAck`] it never does.
    pub fn awaits_acks(&self) -> bool {
        matches!(self.state, State::AwaitAcks { .. })
            && !matches!(self.planted, Some(PlantedBug::SkipReadDoneAck | PlantedBug::FixedTimeout | PlantedBug::VllmLease))
    }

    /// The driver's wait reached the deadline this pull gave it (or, with the planted bug, it
    /// skipped the wait for `ReadDoneAck`s): the verdict.
    pub fn on_deadline(&mut self) -> Verdict {
        let lost = match self.state {
            State::AwaitAcks { .. }
                if matches!(self.planted, Some(PlantedBug::SkipReadDoneAck | PlantedBug::FixedTimeout | PlantedBug::VllmLease)) =>
            {
                return self.finish(Ok(()))
            }
            State::AwaitAcks { .. } => PullLost::NoReadDoneAck,
            State::Reading { .. } => PullLost::ReadTimedOut { after: self.read_timeout },
            State::AwaitLive { .. } => PullLost::NoLiveAck { engine_id: self.engine_id.clone(), waited: self.ack_wait },
            State::Done => PullLost::LeaseLost,
        };
        self.finish(Err(lost))
    }

    /// The verdict for a pull that ended with `lost` before reading (or `Ok`: confirmed).
    pub fn finish(&mut self, outcome: Result<(), PullLost>) -> Verdict {
        self.state = State::Done;
        let unread = matches!(
            outcome,
            Err(PullLost::NoPeer
                | PullLost::Unreachable { .. }
                | PullLost::Topology { .. }
                | PullLost::ReadFailed(_)
                | PullLost::ReadTimedOut { .. })
        );
        match self.planted {
            Some(PlantedBug::IgnoreVerdict) => return Verdict::Use,
            // vLLM before leases used whatever it read, but not what it could not read.
            Some(PlantedBug::FixedTimeout | PlantedBug::VllmLease) if !unread => return Verdict::Use,
            _ => {}
        }
        match outcome {
            Ok(()) => Verdict::Use,
            Err(lost) => match self.policy {
                LoadFailurePolicy::Recompute => Verdict::Recompute(lost),
                LoadFailurePolicy::Fail => Verdict::Fail(lost),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LeaseConfig {
        LeaseConfig::with_lease_secs(30.0).unwrap()
    }

    const T0: Nanos = Nanos(1_000_000_000);

    /// SPEC D6: D reads only once the renewer knows the lease acknowledged live; it waits at
    /// most `ack_wait` for that, then recomputes.
    #[test]
    fn d6_waits_for_a_live_ack_with_a_deadline() {
        let mut p = Pull::new(&cfg(), "p", 7, false, T0);
        let Step::Wait { renew: true, .. } = p.check(ReadCheck::RenewFirst, T0) else { panic!() };
        assert_eq!(p.check(ReadCheck::Safe, T0), Step::Read);
        let until = T0 + cfg().ack_wait();
        let mut late = Pull::new(&cfg(), "p", 7, false, T0);
        assert!(matches!(late.check(ReadCheck::RenewFirst, until), Step::Lost(PullLost::NoLiveAck { .. })));
        let mut lost = Pull::new(&cfg(), "p", 7, false, T0);
        assert_eq!(lost.check(ReadCheck::Untracked, T0), Step::Lost(PullLost::LeaseLost));
        let mut down = Pull::new(&cfg(), "p", 7, false, T0);
        assert!(matches!(down.check(ReadCheck::Unreachable, T0), Step::Lost(PullLost::Unreachable { .. })));
    }

    /// SPEC D6 under loss: a renewal for a read whose acknowledgement does not come is asked for
    /// again after 50 ms, then 100, 200… up to I/2, never past `ack_wait`; not left to the next
    /// interval's heartbeat.
    #[test]
    fn d6_a_lost_renewal_for_a_read_is_sent_again() {
        let c = cfg(); // L = 30 s: I = 5 s, E = 20 s
        let mut p = Pull::new(&c, "p", 7, false, T0);
        let mut now = T0;
        let mut waits = Vec::new();
        let last = loop {
            match p.check(ReadCheck::RenewFirst, now) {
                Step::Wait { until, renew: true } => {
                    waits.push(until.since(now).as_millis());
                    now = until;
                }
                other => break other,
            }
        };
        assert_eq!(&waits[..7], &[50, 100, 200, 400, 800, 1600, 2500], "doubling up to I/2");
        assert!(waits[7..].iter().all(|&w| w <= 2500));
        assert_eq!(now, T0 + c.ack_wait(), "the last wait ends at ack_wait");
        assert!(matches!(last, Step::Lost(PullLost::NoLiveAck { .. })), "{last:?}");
        // Woken early for something else: no resend, no faster back-off.
        let mut p = Pull::new(&c, "p", 7, false, T0);
        assert_eq!(p.check(ReadCheck::RenewFirst, T0), Step::Wait { until: T0 + Duration::from_millis(50), renew: true });
        let early = T0 + Duration::from_millis(10);
        assert_eq!(p.check(ReadCheck::RenewFirst, early), Step::Wait { until: T0 + Duration::from_millis(50), renew: false });
        let due = T0 + Duration::from_millis(50);
        assert_eq!(p.check(ReadCheck::RenewFirst, due), Step::Wait { until: due + Duration::from_millis(100), renew: true });
    }

    /// SPEC D6 for a driver whose links come late (vLLM): a read whose wait for an
    /// acknowledgement runs out while there is still no link to P waits once more, for
    /// `ack_wait`, within the link wait; with a link (or by default) it gives up at `ack_wait`.
    #[test]
    fn d6_a_read_waits_once_more_for_a_late_link_within_the_link_wait() {
        let c = cfg(); // L = 30 s, E = 20 s
        let e = c.ack_wait();
        let mut p = Pull::new(&c, "p", 0, false, T0);
        assert!(matches!(p.check(ReadCheck::NoLink, T0 + e), Step::Lost(PullLost::NoLiveAck { .. })), "by default: E");
        let mut p = Pull::new(&c, "p", 0, false, T0).waiting_for_link(c.lease_duration);
        assert!(matches!(p.check(ReadCheck::NoLink, T0), Step::Wait { renew: true, .. }));
        let Step::Wait { renew: true, .. } = p.check(ReadCheck::NoLink, T0 + e) else { panic!("waits once more") };
        assert!(matches!(p.check(ReadCheck::RenewFirst, T0 + e + e - Duration::from_millis(1)), Step::Wait { .. }));
        assert!(matches!(p.check(ReadCheck::NoLink, T0 + e + e), Step::Lost(PullLost::NoLiveAck { .. })), "past the link wait");
        let mut linked = Pull::new(&c, "p", 0, false, T0).waiting_for_link(c.lease_duration);
        assert!(matches!(linked.check(ReadCheck::RenewFirst, T0 + e), Step::Lost(PullLost::NoLiveAck { .. })), "a link: no more waiting");
        let mut p = Pull::new(&c, "p", 0, false, T0).waiting_for_link(c.lease_duration);
        assert!(matches!(p.check(ReadCheck::NoLink, T0 + e), Step::Wait { .. }));
        assert_eq!(p.check(ReadCheck::Safe, T0 + e), Step::Read);
    }

    /// A driver that posts its own reads (vLLM): `reading` starts them, and P's confirmations are
    /// waited for as long as the driver says.
    #[test]
    fn d6_reads_posted_by_the_driver_are_confirmed_within_its_wait() {
        let c = cfg();
        let wait = Duration::from_secs(30);
        let mut p = Pull::new(&c, "p", 0, false, T0).confirming_within(wait);
        assert_eq!(p.check(ReadCheck::Safe, T0), Step::Read);
        assert!(p.reading(T0).is_ok());
        assert_eq!(p.reads_done(Ok(2), false, T0), AfterReads::AwaitAcks { until: T0 + wait });
        assert_eq!(p.on_read_done_ack(true), None);
        assert_eq!(p.on_read_done_ack(true), Some(Verdict::Use));
        let mut p = Pull::new(&c, "p", 0, false, T0);
        p.check(ReadCheck::Safe, T0);
        p.reading(T0).unwrap();
        p.reads_done(Ok(1), false, T0);
        assert_eq!(p.on_deadline(), Verdict::Recompute(PullLost::NoReadDoneAck));
        let mut lost = Pull::new(&c, "p", 0, false, T0);
        assert!(matches!(lost.check(ReadCheck::Untracked, T0), Step::Lost(_)));
        assert_eq!(lost.reading(T0), Err(PullLost::LeaseLost), "never after a lost check");
    }

    /// SPEC D6 under loss: with a measured round trip, a renewal for a read is sent again after
    /// two of them (10 ms at least), then doubling; without one, after 50 ms.
    #[test]
    fn d6_a_lost_renewal_is_sent_again_after_two_measured_round_trips() {
        let c = cfg();
        let mut p = Pull::new(&c, "p", 7, false, T0);
        p.measured_round_trip(Duration::from_micros(300));
        assert_eq!(p.check(ReadCheck::RenewFirst, T0), Step::Wait { until: T0 + MIN_RESEND, renew: true }, "the floor");
        let mut p = Pull::new(&c, "p", 7, false, T0);
        p.measured_round_trip(Duration::from_millis(20));
        assert_eq!(p.check(ReadCheck::RenewFirst, T0), Step::Wait { until: T0 + Duration::from_millis(40), renew: true });
        let at = T0 + Duration::from_millis(40);
        p.measured_round_trip(Duration::from_millis(1));
        assert_eq!(
            p.check(ReadCheck::RenewFirst, at),
            Step::Wait { until: at + Duration::from_millis(80), renew: true },
            "the back-off is kept"
        );
    }

    /// SPEC §3, D6: a lease granted by another incarnation of P is never read.
    #[test]
    fn d6_a_restarted_prefill_engine_is_not_read() {
        let mut p = Pull::new(&cfg(), "p", 7, false, T0);
        assert_eq!(p.begin_read(Some((9, 1)), 8, 1, T0), Err(PullLost::Restarted { granted_by: 7, now: 9 }));
        let mut p = Pull::new(&cfg(), "p", 7, false, T0);
        assert_eq!(p.begin_read(None, 8, 1, T0), Err(PullLost::NoPeer));
        let mut p = Pull::new(&cfg(), "p", 7, false, T0);
        let (plan, until) = p.begin_read(Some((7, 2)), 8, 1, T0).unwrap();
        assert_eq!(plan.len(), 2, "T1: one read per overlapping P rank");
        assert_eq!(until, T0 + cfg().read_timeout());
    }

    /// SPEC D6: once the reads landed, P's confirmations are waited for at most 2 s whatever
    /// the lease (a lost one costs a prefill, not L/6 of a decode slot); then the pull recomputes.
    #[test]
    fn d6_read_done_acks_are_waited_for_briefly_whatever_the_lease() {
        for secs in [3.0, 30.0, 480.0] {
            let c = LeaseConfig::with_lease_secs(secs).unwrap();
            let mut p = Pull::new(&c, "p", 7, false, T0);
            p.begin_read(Some((7, 1)), 8, 1, T0).unwrap();
            let AfterReads::AwaitAcks { until } = p.reads_done(Ok(1), false, T0) else { panic!("NIXL waits for P's confirmation") };
            assert_eq!(until, T0 + c.read_timeout().min(Duration::from_secs(2)), "L = {secs} s");
            assert_eq!(p.on_deadline(), Verdict::Recompute(PullLost::NoReadDoneAck));
        }
    }

    /// SPEC D6: the bytes are used only when every read completion was confirmed live.
    #[test]
    fn d6_bytes_are_used_only_when_every_read_done_ack_says_live() {
        let start = |n| {
            let mut p = Pull::new(&cfg(), "p", 7, false, T0);
            p.begin_read(Some((7, n)), 8, 1, T0).unwrap();
            assert!(matches!(p.reads_done(Ok(n), false, T0), AfterReads::AwaitAcks { .. }));
            p
        };
        let mut p = start(2);
        assert_eq!(p.on_read_done_ack(true), None);
        assert_eq!(p.on_read_done_ack(true), Some(Verdict::Use));
        let mut p = start(2);
        assert_eq!(p.on_read_done_ack(false), Some(Verdict::Recompute(PullLost::EndedUnderRead)));
        let mut p = start(2);
        assert_eq!(p.on_read_done_ack(true), None);
        assert_eq!(p.on_deadline(), Verdict::Recompute(PullLost::NoReadDoneAck));
    }

    /// SPEC D6, P5: a loss reported before the read was posted decides the pull (never read);
    /// once the read is posted, or landed and awaits P's confirmation, the read's `ReadDone`
    /// decides: P answers it live when the lease ended on that very read.
    #[test]
    fn d6_a_loss_reported_after_the_read_was_posted_is_decided_by_its_read_done() {
        let mut p = Pull::new(&cfg(), "p", 7, false, T0);
        assert_eq!(p.on_lease_lost(), Some(Verdict::Recompute(PullLost::LeaseLost)));
        assert_eq!(p.check(ReadCheck::Safe, T0), Step::Lost(PullLost::LeaseLost), "decided: never read");
        let mut p = Pull::new(&cfg(), "p", 7, false, T0);
        assert_eq!(p.check(ReadCheck::Safe, T0), Step::Read);
        p.reading(T0).unwrap();
        assert_eq!(p.on_lease_lost(), None, "posted: its ReadDone decides");
        assert!(matches!(p.reads_done(Ok(1), false, T0), AfterReads::AwaitAcks { .. }));
        assert_eq!(p.on_lease_lost(), None, "landed: its ReadDone decides");
        assert_eq!(p.on_read_done_ack(true), Some(Verdict::Use), "the lease ended on this read: used, once");
        assert_eq!(p.on_lease_lost(), None, "decided already");
        let mut p = Pull::new(&cfg(), "p", 7, false, T0);
        p.begin_read(Some((7, 1)), 8, 1, T0).unwrap();
        assert!(matches!(p.reads_done(Ok(1), false, T0), AfterReads::AwaitAcks { .. }));
        assert_eq!(p.on_lease_lost(), None);
        assert_eq!(p.on_read_done_ack(false), Some(Verdict::Recompute(PullLost::EndedUnderRead)), "ended under the read: not used");
    }

    /// SPEC D6: a read that fails or outlives the read timeout is never used; under
    /// `kv_load_failure_policy: fail` the request fails instead of recomputing.
    #[test]
    fn d6_failed_reads_follow_the_load_failure_policy() {
        let mut c = cfg();
        c.load_failure_policy = LoadFailurePolicy::Fail;
        let mut p = Pull::new(&c, "p", 7, false, T0);
        p.begin_read(Some((7, 1)), 8, 1, T0).unwrap();
        assert_eq!(p.reads_done(Ok(1), true, T0), AfterReads::Decided(Verdict::Fail(PullLost::ReadTimedOut { after: c.read_timeout() })));
        for fenced in [false, true] {
            let mut p = Pull::new(&c, "p", 7, fenced, T0);
            p.begin_read(Some((7, 1)), 8, 1, T0).unwrap();
            let failure = ReadFailure::Transport("refused".into());
            let lost = PullLost::ReadFailed(failure.clone());
            assert_eq!(p.reads_done(Err(failure), false, T0), AfterReads::Decided(Verdict::Fail(lost.clone())));
            assert_eq!(lost.to_string(), "the read failed: refused");
        }
    }

    /// SPEC D6, P5, S4 over a fenced transport (issue 15): P's gate admitted the read for a live
    /// lease of this prompt and kept the blocks until it was out, so the pull does not wait for
    /// P's confirmation (nor renew first: `Renewer::read_check`); what fencing does not prove
    /// still stops it.
    #[test]
    fn d6_a_fenced_read_is_its_own_proof() {
        let mut p = Pull::new(&cfg(), "p", 7, true, T0);
        p.begin_read(Some((7, 2)), 8, 1, T0).unwrap();
        assert_eq!(p.reads_done(Ok(2), false, T0), AfterReads::Decided(Verdict::Use));
        assert!(!p.awaits_acks());
        let mut lost = Pull::new(&cfg(), "p", 7, true, T0);
        assert_eq!(lost.check(ReadCheck::Untracked, T0), Step::Lost(PullLost::LeaseLost), "a lease known lost is not read");
        let mut down = Pull::new(&cfg(), "p", 7, true, T0);
        assert!(matches!(down.check(ReadCheck::Unreachable, T0), Step::Lost(PullLost::Unreachable { .. })));
        let mut restarted = Pull::new(&cfg(), "p", 7, true, T0);
        assert_eq!(restarted.begin_read(Some((9, 1)), 8, 1, T0), Err(PullLost::Restarted { granted_by: 7, now: 9 }));
    }
}
