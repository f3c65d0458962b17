//! The push machines against SPEC §13, one test per invariant, each named by its id. P and D
//! talk through hand-carried messages; time is explicit.

use super::sink::{PushAction, PushSink, PushVerdict, WriteLost};
use super::source::{PushGrantError, PushSettled, PushSource, WriteJob, WriteRefused};
use crate::config::LeaseConfig;
use crate::digest::PromptDigest;
use crate::holder::BlockGuard;
use crate::lease_table::ReleaseReason;
use crate::wire::{Message, PushFailure, PushKey, PushRegistration, PushRenewal};
use crate::Nanos;
use std::time::Duration;

const SEC: u64 = 1_000_000_000;
const T0: Nanos = Nanos(3_600 * SEC);
const P_INC: u64 = 7;
const D: &str = "d/1";
const TOKENS: [u32; 3] = [1, 2, 3];

#[derive(Debug, PartialEq, Eq)]
struct Ids(Vec<u32>);

impl BlockGuard for Ids {
    fn ids(&self) -> &[u32] {
        &self.0
    }
}

fn at(secs: u64) -> Nanos {
    T0 + Duration::from_secs(secs)
}

fn key(s: &str) -> PushKey {
    PushKey::Transfer(s.into())
}

fn source() -> PushSource<Ids> {
    PushSource::new(&LeaseConfig::default(), P_INC)
}

fn reg(k: &PushKey, attempt: u32, ranks: u32, stages: u32) -> PushRegistration {
    PushRegistration {
        key: k.clone(),
        attempt,
        incarnation: 1,
        granted_by: 0,
        digest: PromptDigest::of(&TOKENS),
        dst_ranks: ranks,
        stages,
        block_ids: vec![4, 5],
        window_ns: 30 * SEC,
        age_ns: 0,
    }
}

fn msgs(out: &PushSettled<Ids>) -> Vec<&Message> {
    out.send.iter().map(|o| &o.msg).collect()
}

fn lost(k: &PushKey) -> Message {
    Message::PushLost { keys: vec![k.clone()] }
}

/// P with a lease under `k` and D's registration of `ranks` × `stages` paired with it.
fn paired(k: &PushKey, ranks: u32, stages: u32) -> (PushSource<Ids>, WriteJob) {
    let mut p = source();
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(k, 1, ranks, stages)), T0, &mut out);
    p.grant(T0, Some(k.clone()), "r", Ids(vec![1, 2]), &TOKENS, &mut out).unwrap();
    let job = out.ready.pop().expect("paired at the grant");
    (p, job)
}

/// SPEC U1: a registration pairs with the one lease granted under its key; a registration under
/// another key pairs with nothing; a duplicate is acknowledged and changes nothing; a key is
/// granted once, so two dispatches never cross-match.
#[test]
fn u1_a_registration_pairs_by_its_key_exactly_once() {
    let mut p = source();
    let mut out = PushSettled::default();
    let (a, b) = (key("a"), PushKey::Request("a".into()));
    let ga = p.grant(T0, Some(a.clone()), "ra", Ids(vec![1]), &TOKENS, &mut out).unwrap();
    assert!(out.ready.is_empty(), "no registration yet");
    p.on_message(D, &Message::PushRegister(reg(&b, 1, 1, 1)), T0, &mut out);
    assert!(out.ready.is_empty(), "a request id spelled like the transfer id is another key");
    p.on_message(D, &Message::PushRegister(reg(&a, 1, 1, 1)), T0, &mut out);
    assert_eq!(out.ready.len(), 1);
    assert_eq!((out.ready[0].key.clone(), out.ready[0].lease_id), (a.clone(), ga.lease_id));
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(&a, 1, 1, 1)), T0, &mut out);
    assert_eq!(msgs(&out), vec![&Message::PushRegisterAck { key: a.clone(), attempt: 1, granted: true }], "acknowledged");
    assert!(out.ready.is_empty(), "a duplicate changes nothing");
    assert_eq!(p.grant(T0, Some(a.clone()), "ra2", Ids(vec![9]), &TOKENS, &mut out), Err(PushGrantError::KeyTaken(a.clone())));
    assert_eq!(out.freed, vec![Ids(vec![9])], "the second dispatch's blocks go back");
    // Without a transfer or request id the key is the lease id P returned.
    let g = p.grant(T0, None, "rc", Ids(vec![3]), &TOKENS, &mut out).unwrap();
    assert_eq!(g.key, PushKey::Lease(g.lease_id));
}

/// SPEC U2: D renews and registers from admission, before P's grant: P keeps both (not lost)
/// and applies them at the grant — the lease is the renewing engine's (S5) and the
/// registration is paired at once; D's heartbeats name the key before it is even registered.
#[test]
fn u2_renewal_and_registration_before_the_grant_are_kept_and_applied_at_it() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let mut d = PushSink::new(&cfg);
    d.admit("req", "p", k.clone(), T0);
    let mut acts = Vec::new();
    d.poll(T0 + cfg.heartbeat_interval, &mut acts);
    let hb = match &acts[..] {
        [PushAction::Send { engine_id, msg: m @ Message::PushHeartbeat { renewals, .. } }] => {
            assert_eq!(engine_id, "p");
            assert_eq!(renewals, &vec![PushRenewal { key: k.clone(), window_ns: 0 }], "not registered: no window yet");
            m.clone()
        }
        other => panic!("{other:?}"),
    };
    let mut p = source();
    let mut out = PushSettled::default();
    p.on_message(D, &hb, at(1), &mut out);
    assert!(out.send.is_empty(), "kept, not lost");
    assert_eq!(p.pending(), 1);
    p.on_message("other/2", &hb, at(1), &mut out);
    assert_eq!(msgs(&out), vec![&lost(&k)], "another engine's renewal of it is lost (S5)");
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(&k, 1, 1, 1)), at(2), &mut out);
    assert_eq!(msgs(&out), vec![&Message::PushRegisterAck { key: k.clone(), attempt: 1, granted: false }]);
    let mut out = PushSettled::default();
    let g = p.grant(at(3), Some(k.clone()), "r", Ids(vec![1]), &TOKENS, &mut out).unwrap();
    assert_eq!(out.ready.len(), 1, "the kept registration is paired at the grant");
    assert_eq!(msgs(&out), vec![&Message::PushRegisterAck { key: k.clone(), attempt: 1, granted: true }]);
    assert_eq!(p.pending(), 0);
    // The lease is D's: the other engine's release changes nothing.
    let mut out = PushSettled::default();
    p.on_message("other/2", &Message::PushRelease { keys: vec![k.clone()] }, at(4), &mut out);
    assert!(p.is_live(g.lease_id));
}

/// SPEC U3, P6: a registration or renewal of a key whose lease P no longer holds, or of a lease
/// id that is not live, is answered `PushLost` at once; D then fails over without waiting.
#[test]
fn u3_a_key_p_no_longer_holds_is_answered_lost_at_once() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let (mut p, _) = paired(&k, 1, 1);
    let mut out = PushSettled::default();
    while p.poll(at(31), &mut out) {}
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Expired]);
    for m in [
        Message::PushRegister(reg(&k, 2, 1, 1)),
        Message::PushHeartbeat { seq: 1, renewals: vec![PushRenewal { key: k.clone(), window_ns: 1 }] },
    ] {
        let mut out = PushSettled::default();
        p.on_message(D, &m, at(32), &mut out);
        assert_eq!(msgs(&out), vec![&lost(&k)], "{m:?}");
    }
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(&PushKey::Lease(999), 1, 1, 1)), at(32), &mut out);
    assert_eq!(msgs(&out), vec![&lost(&PushKey::Lease(999))]);

    let mut d = PushSink::new(&cfg);
    d.admit("req", "p", k.clone(), T0);
    d.register("req", 1, 0, PromptDigest::of(&TOKENS), 1, 1, vec![4], T0).unwrap();
    let mut acts = Vec::new();
    d.on_message("p", &lost(&k), at(1), &mut acts);
    assert_eq!(
        acts.iter().find(|a| matches!(a, PushAction::Failed { .. })),
        Some(&PushAction::Failed {
            request_id: "req".into(),
            verdict: PushVerdict::Recompute(WriteLost::LeaseLost),
            blocks_reusable: true
        })
    );
    assert!(!d.is_tracked("req"));
}

/// SPEC U4: a write is posted only while the lease is live, checked at the moment of posting;
/// a lease released with a write in flight keeps its source blocks until the write ends, and
/// D's release is answered only then.
#[test]
fn u4_writes_are_posted_only_on_a_live_lease_and_hold_its_blocks_in_flight() {
    let k = key("t");
    let (mut p, job) = paired(&k, 2, 1);
    let mut out = PushSettled::default();
    let w0 = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
    p.on_message(D, &Message::PushRelease { keys: vec![k.clone()] }, at(2), &mut out);
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Released]);
    assert!(out.freed.is_empty(), "a write is in flight: the blocks are not reused");
    assert!(msgs(&out).iter().all(|m| !matches!(m, Message::PushLost { .. })), "not answered while a write is in flight");
    assert_eq!(p.begin_write(&k, job.attempt, 1, 0, at(2), &mut out).err(), Some(WriteRefused::NotLive), "checked when posting");
    let mut out = PushSettled::default();
    p.end_write(w0, true, at(3), &mut out);
    assert_eq!(out.freed, vec![Ids(vec![1, 2])], "back when the write ended");
    assert!(msgs(&out).contains(&&lost(&k)), "the release is answered now");
    assert!(!msgs(&out).iter().any(|m| matches!(m, Message::PushWriteDone { .. })), "not reported done: the lease is gone");

    // A lease past its deadline is not written either, whatever D's window says and whether
    // the reaper has run or not.
    let mut p = source();
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(PushRegistration { window_ns: 100 * SEC, ..reg(&k, 1, 1, 1) }), T0, &mut out);
    p.grant(T0, Some(k.clone()), "r", Ids(vec![1]), &TOKENS, &mut out).unwrap();
    assert_eq!(p.begin_write(&k, 1, 0, 0, at(31), &mut out).err(), Some(WriteRefused::NotLive));
    assert_eq!(out.ended.last().map(|e| e.reason), Some(ReleaseReason::Expired));
}

/// SPEC U5, P3, P8: the lease ends as `transferred` exactly once, on the last success of every
/// destination rank and pipeline stage; a write posted twice or a late completion changes
/// nothing.
#[test]
fn u5_the_lease_is_transferred_once_on_the_last_write_of_every_rank_and_stage() {
    let k = key("t");
    let (mut p, job) = paired(&k, 2, 2);
    let mut out = PushSettled::default();
    let mut tickets = Vec::new();
    for (r, s) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        tickets.push(p.begin_write(&k, job.attempt, r, s, at(1), &mut out).unwrap());
    }
    assert_eq!(p.begin_write(&k, job.attempt, 1, 1, at(1), &mut out).err(), Some(WriteRefused::NotExpected), "posted already");
    assert_eq!(p.begin_write(&k, job.attempt, 2, 0, at(1), &mut out).err(), Some(WriteRefused::NotExpected), "no such rank");
    let last = tickets.pop().unwrap();
    for t in tickets {
        p.end_write(t, true, at(2), &mut out);
    }
    assert!(out.ended.is_empty(), "three of four");
    assert_eq!(p.live(), 1);
    p.end_write(last, true, at(2), &mut out);
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Transferred]);
    assert_eq!(out.freed, vec![Ids(vec![1, 2])]);
    assert_eq!(msgs(&out).iter().filter(|m| matches!(m, Message::PushWriteDone { .. })).count(), 4);
    let mut out = PushSettled::default();
    while p.poll(at(60), &mut out) {}
    p.shutdown(at(60), &mut out);
    assert!(out.ended.is_empty() && out.freed.is_empty(), "released once");
    assert_eq!(p.stats().released(ReleaseReason::Transferred), 1);
    assert_eq!(p.stats().released.iter().sum::<u64>(), 1);
}

/// SPEC U5, U3 (found by `kvlease sim --cluster --push-engines`, seeds 25 and 162): D's renewal
/// or registration that reaches P after the lease ended `transferred` — its `PushWriteDone`s
/// lost or overtaken by the answer — is answered with every `PushWriteDone` again, not `PushLost`, so D decodes the
/// KV that landed instead of recomputing; another engine's renewal of the key is still lost.
#[test]
fn u5_a_renewal_after_the_last_write_landed_is_told_the_writes_again() {
    let k = key("t");
    let (mut p, job) = paired(&k, 2, 1);
    let mut out = PushSettled::default();
    let tickets: Vec<_> = [(0, 0), (1, 0)].map(|(r, s)| p.begin_write(&k, job.attempt, r, s, at(1), &mut out).unwrap()).into();
    for t in tickets {
        p.end_write(t, true, at(2), &mut out);
    }
    assert_eq!(p.stats().released(ReleaseReason::Transferred), 1);
    let renewal = Message::PushHeartbeat { seq: 9, renewals: vec![PushRenewal { key: k.clone(), window_ns: 0 }] };
    let mut out = PushSettled::default();
    p.on_message(D, &renewal, at(3), &mut out);
    assert_eq!(msgs(&out), vec![&done(&k, job.attempt, 0, 0), &done(&k, job.attempt, 1, 0)], "the writes again, not lost");

    // D's tally closes on them: ready, whichever copy comes first.
    let cfg = LeaseConfig::default();
    let mut d = d_registered(&cfg, &k, 2, 1);
    let mut actions = Vec::new();
    for m in msgs(&out) {
        d.on_message("p", m, at(3), &mut actions);
    }
    assert!(actions.iter().any(|a| matches!(a, PushAction::Ready { .. })), "{actions:?}");

    // The registration sent again (P's acknowledgement was late) is told the same.
    let mut again = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(&k, job.attempt, 2, 1)), at(3), &mut again);
    assert_eq!(msgs(&again), msgs(&out), "a registration sent again hears the writes too");

    let mut out = PushSettled::default();
    p.on_message("x/1", &renewal, at(3), &mut out);
    assert_eq!(msgs(&out), vec![&lost(&k)], "another engine's renewal is lost (S5)");
}

/// A way P's side of a transfer fails.
type FailBy = fn(&mut PushSource<Ids>, &PushKey, &mut PushSettled<Ids>);

/// The running totals of the last `PushWriteFailed` P sent.
fn last_failure(out: &PushSettled<Ids>) -> Option<(u32, u32, PushFailure)> {
    out.send.iter().rev().find_map(|o| match &o.msg {
        Message::PushWriteFailed { done, failed, why, .. } => Some((*done, *failed, *why)),
        _ => None,
    })
}

/// SPEC U6: every failure reaches D with totals that close its tally: a write in error (the
/// rest not posted), writes that cannot be posted, the lease expiring, P's abort, P's shutdown.
#[test]
fn u6_every_failure_reaches_d_with_a_count_that_closes_its_tally() {
    let k = key("t");
    let (mut p, job) = paired(&k, 3, 1);
    let mut out = PushSettled::default();
    let a = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
    let b = p.begin_write(&k, job.attempt, 1, 0, at(1), &mut out).unwrap();
    p.end_write(a, false, at(2), &mut out);
    assert_eq!(last_failure(&out), Some((0, 2, PushFailure::WriteError)), "the failed one and the one never posted");
    p.end_write(b, true, at(2), &mut out);
    assert_eq!(msgs(&out).iter().filter(|m| matches!(m, Message::PushWriteDone { .. })).count(), 1);
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Released], "all stopped, nothing more to write");

    let cases: [(&str, FailBy); 4] = [
        ("not posted", |p, k, out| p.fail_writes(k, PushFailure::NotPosted, at(1), out)),
        ("expired", |p, _, out| while p.poll(at(31), out) {}),
        ("aborted", |p, k, out| p.abort(k, at(1), out)),
        ("shutdown", |p, _, out| p.shutdown(at(1), out)),
    ];
    for (what, fail) in cases {
        let (mut p, _) = paired(&k, 2, 2);
        let mut out = PushSettled::default();
        fail(&mut p, &k, &mut out);
        let (done, failed, _) = last_failure(&out).unwrap_or_else(|| panic!("{what}: D not told"));
        assert_eq!(done + failed, 4, "{what}: the tally closes");
        assert_eq!(p.live(), 0, "{what}");
    }
    // P aborts a request D only renewed: D learns the key is gone.
    let mut p = source();
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushHeartbeat { seq: 1, renewals: vec![PushRenewal { key: k.clone(), window_ns: 0 }] }, T0, &mut out);
    p.abort(&k, T0, &mut out);
    assert_eq!(msgs(&out), vec![&lost(&k)]);
}

fn d_registered(cfg: &LeaseConfig, k: &PushKey, ranks: u32, stages: u32) -> PushSink {
    let mut d = PushSink::new(cfg);
    d.admit("req", "p", k.clone(), T0);
    d.register("req", 1, 0, PromptDigest::of(&TOKENS), ranks, stages, vec![4, 5], T0).unwrap();
    d
}

fn done(k: &PushKey, attempt: u32, r: u32, s: u32) -> Message {
    Message::PushWriteDone { key: k.clone(), attempt, dst_rank: r, stage: s }
}

/// SPEC U7: D schedules only when every expected write (rank × stage) completed and none
/// failed — duplicates do not count twice — and on a failure applies the policy only once every
/// sibling write stopped, with blocks it may reuse.
#[test]
fn u7_ready_only_when_all_writes_landed_and_policy_only_after_all_stopped() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let mut d = d_registered(&cfg, &k, 2, 2);
    let mut acts = Vec::new();
    for (r, s) in [(0, 0), (0, 0), (0, 1), (1, 0), (5, 0)] {
        d.on_message("p", &done(&k, 1, r, s), at(1), &mut acts);
    }
    assert!(acts.is_empty(), "three distinct of four: {acts:?}");
    d.on_message("p", &done(&k, 1, 1, 1), at(1), &mut acts);
    assert_eq!(acts, vec![PushAction::Ready { request_id: "req".into() }]);

    let mut d = d_registered(&cfg, &k, 2, 1);
    let mut acts = Vec::new();
    let failed = |done, failed| Message::PushWriteFailed { key: k.clone(), attempt: 1, done, failed, why: PushFailure::WriteError };
    d.on_message("p", &failed(0, 1), at(1), &mut acts);
    assert!(acts.is_empty(), "a sibling write may still be landing: {acts:?}");
    d.on_message("p", &done(&k, 1, 1, 0), at(1), &mut acts);
    assert!(acts.contains(&PushAction::Failed {
        request_id: "req".into(),
        verdict: PushVerdict::Recompute(WriteLost::Failed(PushFailure::WriteError)),
        blocks_reusable: true
    }));
    assert!(acts.contains(&PushAction::Send { engine_id: "p".into(), msg: Message::PushRelease { keys: vec![k.clone()] } }));
    assert!(!acts.contains(&PushAction::Ready { request_id: "req".into() }));
}

/// SPEC U8: P posts no write within its margin of D's write deadline (renewed by D's
/// heartbeats); D reuses blocks only after their writes stopped, P answered its release, or
/// the deadline it told P passed, with a grace.
#[test]
fn u8_no_write_after_the_deadline_and_blocks_reused_only_when_safe() {
    let cfg = LeaseConfig::default();
    let margin = PushSource::<Ids>::write_margin(&cfg);
    let k = key("t");
    let (mut p, job) = paired(&k, 2, 1);
    let mut out = PushSettled::default();
    let late = T0 + Duration::from_secs(30) - margin + Duration::from_millis(1);
    // D's heartbeat says it still waits 30 s from now: the window moves.
    p.on_message(
        D,
        &Message::PushHeartbeat { seq: 1, renewals: vec![PushRenewal { key: k.clone(), window_ns: 30 * SEC }] },
        at(10),
        &mut out,
    );
    let w = p.begin_write(&k, job.attempt, 0, 0, late, &mut out).expect("the renewed window covers it");
    p.end_write(w, true, late, &mut out);
    let past = at(40) - margin + Duration::from_millis(1);
    let mut out = PushSettled::default();
    assert_eq!(p.begin_write(&k, job.attempt, 1, 0, past, &mut out).err(), Some(WriteRefused::Deadline));
    assert_eq!(last_failure(&out), Some((1, 1, PushFailure::Deadline)), "D is told");

    let grace = PushSink::write_grace(&cfg);
    let mut d = d_registered(&cfg, &k, 1, 1);
    let mut acts = Vec::new();
    d.poll(at(30), &mut acts);
    assert!(acts.iter().any(|a| matches!(a, PushAction::Failed { blocks_reusable: false, .. })), "{acts:?}");
    assert!(!acts.iter().any(|a| matches!(a, PushAction::BlocksFree { .. })));
    assert!(!d.blocks_reusable("req", 1, at(30) + grace - Duration::from_millis(1)));
    let mut acts = Vec::new();
    d.poll(at(30) + grace, &mut acts);
    assert_eq!(acts, vec![PushAction::BlocksFree { request_id: "req".into(), attempt: 1 }]);

    let mut d = d_registered(&cfg, &k, 1, 1);
    let mut acts = Vec::new();
    d.abort("req", at(1), &mut acts);
    assert!(!acts.iter().any(|a| matches!(a, PushAction::BlocksFree { .. })), "a write may be in flight");
    d.on_message("p", &lost(&k), at(2), &mut acts);
    assert_eq!(acts.last(), Some(&PushAction::BlocksFree { request_id: "req".into(), attempt: 1 }), "P answered the release");
}

/// SPEC U9, O3: any abort on D sends `PushRelease` at once — before its blocks were allocated,
/// after registration — and P frees now: a lease granted later under a released key is not
/// granted at all.
#[test]
fn u9_any_abort_on_d_releases_at_once() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let release = PushAction::Send { engine_id: "p".into(), msg: Message::PushRelease { keys: vec![k.clone()] } };
    let mut d = PushSink::new(&cfg);
    d.admit("req", "p", k.clone(), T0);
    let mut acts = Vec::new();
    d.abort("req", T0, &mut acts);
    assert_eq!(acts, vec![release.clone()], "before allocation");
    assert!(!d.is_tracked("req"));
    let mut d = d_registered(&cfg, &k, 1, 1);
    let mut acts = Vec::new();
    d.abort("req", T0, &mut acts);
    assert_eq!(acts.first(), Some(&release), "after registration");

    let mut p = source();
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRelease { keys: vec![k.clone()] }, T0, &mut out);
    assert_eq!(msgs(&out), vec![&lost(&k)]);
    assert_eq!(p.grant(at(1), Some(k.clone()), "r", Ids(vec![1]), &TOKENS, &mut out), Err(PushGrantError::Released(k.clone())));
    assert_eq!(out.freed, vec![Ids(vec![1])]);
    let (mut p, _) = paired(&k, 1, 1);
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRelease { keys: vec![k.clone()] }, at(1), &mut out);
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Released]);
    assert_eq!(out.freed.len(), 1);
}

/// SPEC U10: D's wait for writes ends `push_registration_timeout` after registering unless P
/// makes progress, which pushes it back; then the request fails over and P is released.
#[test]
fn u10_ds_own_deadline_is_renewed_by_progress_and_fails_over() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let mut d = d_registered(&cfg, &k, 2, 1);
    let mut acts = Vec::new();
    d.on_message("p", &done(&k, 1, 0, 0), at(20), &mut acts);
    d.poll(at(30), &mut acts);
    assert!(!acts.iter().any(|a| matches!(a, PushAction::Failed { .. })), "progress at 20 s pushed the deadline to 50 s");
    assert_eq!(d.poll_timeout().map(|t| t <= at(50)), Some(true));
    d.poll(at(50), &mut acts);
    let timed_out = PushVerdict::Recompute(WriteLost::TimedOut { waited: cfg.push_registration_timeout });
    assert!(acts.contains(&PushAction::Failed { request_id: "req".into(), verdict: timed_out, blocks_reusable: false }), "{acts:?}");
    assert!(acts.contains(&PushAction::Send { engine_id: "p".into(), msg: Message::PushRelease { keys: vec![k.clone()] } }));
    let mut again = Vec::new();
    d.poll(at(51), &mut again);
    assert!(!again.iter().any(|a| matches!(a, PushAction::Failed { .. })), "once");
}

/// SPEC U11, S4: P writes only when the registration's digest is its prefill's and it names
/// this incarnation of P; D ignores completions of a registration it has superseded, and P
/// writes for the newest only.
#[test]
fn u11_digest_incarnation_and_superseded_registrations() {
    let k = key("t");
    let mut p = source();
    let mut out = PushSettled::default();
    p.grant(T0, Some(k.clone()), "r", Ids(vec![1]), &TOKENS, &mut out).unwrap();
    let other_prompt = PushRegistration { digest: PromptDigest::of(&[9]), ..reg(&k, 1, 1, 1) };
    p.on_message(D, &Message::PushRegister(other_prompt), T0, &mut out);
    assert!(out.ready.is_empty());
    assert_eq!(last_failure(&out), Some((0, 1, PushFailure::Digest)));
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(PushRegistration { granted_by: P_INC + 1, ..reg(&k, 2, 1, 1) }), T0, &mut out);
    assert_eq!(msgs(&out), vec![&lost(&k)], "another life of P");
    p.on_message(D, &Message::PushRegister(reg(&k, 3, 1, 1)), T0, &mut out);
    assert_eq!(out.ready.len(), 1, "the right prompt, this P");

    let (mut p, job) = paired(&k, 1, 1);
    let mut out = PushSettled::default();
    let old = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
    p.on_message(D, &Message::PushRegister(reg(&k, 2, 1, 1)), at(1), &mut out);
    assert_eq!(out.ready.last().map(|j| j.attempt), Some(2));
    assert_eq!(p.begin_write(&k, 1, 0, 0, at(1), &mut out).err(), Some(WriteRefused::NotRegistered));
    let mut out = PushSettled::default();
    p.end_write(old, true, at(2), &mut out);
    assert!(!msgs(&out).iter().any(|m| matches!(m, Message::PushWriteDone { .. })), "a superseded write is not reported done");
    assert_eq!(p.live(), 1, "nor does it end the lease");

    let cfg = LeaseConfig::default();
    let mut d = d_registered(&cfg, &k, 1, 1);
    d.register("req", 1, 0, PromptDigest::of(&TOKENS), 1, 1, vec![6], at(1)).unwrap();
    let mut acts = Vec::new();
    d.on_message("p", &done(&k, 1, 0, 0), at(2), &mut acts);
    assert!(!acts.contains(&PushAction::Ready { request_id: "req".into() }), "attempt 1 is superseded");
    assert!(acts.contains(&PushAction::BlocksFree { request_id: "req".into(), attempt: 1 }), "its blocks are free: its write stopped");
    d.on_message("p", &done(&k, 2, 0, 0), at(2), &mut acts);
    assert!(acts.contains(&PushAction::Ready { request_id: "req".into() }));
}

/// SPEC U8, U9 (found by `kvlease sim --push`, seed 26): a request aborted after registration
/// whose writes all land afterwards gets its blocks back once they stopped — its complete
/// tally is not a decoding request's, whose blocks the decode keeps.
#[test]
fn u8_blocks_of_a_request_aborted_before_its_last_write_landed_come_back() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let mut d = d_registered(&cfg, &k, 2, 1);
    let mut acts = Vec::new();
    d.on_message("p", &done(&k, 1, 0, 0), at(1), &mut acts);
    d.abort("req", at(1), &mut acts);
    assert!(!acts.iter().any(|a| matches!(a, PushAction::BlocksFree { .. })), "a write is in flight: {acts:?}");
    let mut acts = Vec::new();
    d.on_message("p", &done(&k, 1, 1, 0), at(2), &mut acts);
    assert_eq!(acts, vec![PushAction::BlocksFree { request_id: "req".into(), attempt: 1 }], "every write stopped");
    assert!(!acts.contains(&PushAction::Ready { request_id: "req".into() }));
    assert!(!d.is_tracked("req"));

    // A ready request's blocks stay the decode's.
    let mut d = d_registered(&cfg, &k, 1, 1);
    let mut acts = Vec::new();
    d.on_message("p", &done(&k, 1, 0, 0), at(1), &mut acts);
    d.finish("req", at(2), &mut acts);
    assert_eq!(acts, vec![PushAction::Ready { request_id: "req".into() }]);
}

/// SPEC U8, U3 (found by `kvlease sim --push`, seed 1313): while a write of an ended lease is in
/// flight — released by D, or expired — neither a duplicated registration nor a late heartbeat
/// is answered `PushLost` (D would reuse its blocks under the landing write); the answer goes
/// out when the write stops.
#[test]
fn u8_no_push_lost_while_a_write_of_the_ended_lease_is_in_flight() {
    let k = key("t");
    let hb = Message::PushHeartbeat { seq: 9, renewals: vec![PushRenewal { key: k.clone(), window_ns: 30 * SEC }] };
    // Released by D.
    let (mut p, job) = paired(&k, 1, 1);
    let mut out = PushSettled::default();
    let w = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
    p.on_message(D, &Message::PushRelease { keys: vec![k.clone()] }, at(1), &mut out);
    p.on_message(D, &Message::PushRegister(reg(&k, 1, 1, 1)), at(1), &mut out);
    p.on_message(D, &hb, at(1), &mut out);
    assert!(!msgs(&out).contains(&&lost(&k)), "a write is in flight: {:?}", msgs(&out));
    let mut out = PushSettled::default();
    p.end_write(w, true, at(2), &mut out);
    assert!(msgs(&out).contains(&&lost(&k)), "answered when the write stopped");
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(&k, 1, 1, 1)), at(2), &mut out);
    assert_eq!(msgs(&out), vec![&lost(&k)], "and at once from then on");

    // Expired.
    let (mut p, job) = paired(&k, 1, 1);
    let mut out = PushSettled::default();
    let w = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
    while p.poll(at(60), &mut out) {}
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Expired]);
    p.on_message(D, &hb, at(60), &mut out);
    assert!(!msgs(&out).contains(&&lost(&k)), "a write is in flight: {:?}", msgs(&out));
    let mut out = PushSettled::default();
    p.end_write(w, true, at(61), &mut out);
    assert!(msgs(&out).contains(&&lost(&k)));
}

/// SPEC U3, U10 (found by `kvlease sim --push`, seed 4): a registration lost on the way is not
/// waited out behind heartbeats that keep P's lease alive: until P acknowledges it paired (or
/// reports a write of it) it goes out again with each heartbeat round, carrying what is left of
/// D's wait (U8); P pairs the copy. Repeated acknowledgements that P only keeps it do not push
/// D's deadline back.
#[test]
fn u3_a_lost_registration_goes_out_again_until_p_pairs_it() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let mut d = d_registered(&cfg, &k, 1, 1);
    let regs = |acts: &[PushAction]| -> Vec<PushRegistration> {
        acts.iter()
            .filter_map(|a| match a {
                PushAction::Send { msg: Message::PushRegister(r), .. } => Some(r.clone()),
                _ => None,
            })
            .collect()
    };
    let i = cfg.heartbeat_interval;
    let mut acts = Vec::new();
    d.poll(T0 + i, &mut acts);
    let again = regs(&acts);
    assert_eq!(again.len(), 1, "the registration again: {acts:?}");
    assert_eq!((again[0].attempt, again[0].block_ids.clone()), (1, vec![4, 5]));
    assert_eq!(again[0].window_ns, (cfg.push_registration_timeout - i).as_nanos() as u64, "what is left of the wait");
    assert!(acts.iter().any(|a| matches!(a, PushAction::Send { msg: Message::PushHeartbeat { .. }, .. })));

    // P kept the copy, not granted yet: acknowledged, not paired; a repeat is not progress.
    let kept = Message::PushRegisterAck { key: k.clone(), attempt: 1, granted: false };
    d.on_message("p", &kept, T0 + i, &mut Vec::new());
    d.on_message("p", &kept, T0 + i * 2, &mut Vec::new());
    assert_eq!(d.poll_timeout().map(|t| t <= T0 + i + cfg.push_registration_timeout), Some(true), "one push back");
    let mut acts = Vec::new();
    d.poll(T0 + i * 2, &mut acts);
    assert_eq!(regs(&acts).len(), 1, "not paired yet: again");

    // P paired it: no more copies.
    d.on_message("p", &Message::PushRegisterAck { key: k.clone(), attempt: 1, granted: true }, T0 + i * 2, &mut Vec::new());
    let mut acts = Vec::new();
    d.poll(T0 + i * 3, &mut acts);
    assert!(regs(&acts).is_empty(), "{acts:?}");

    // P, having lost the first, pairs the copy.
    let mut p = source();
    let mut out = PushSettled::default();
    p.grant(T0, Some(k.clone()), "r", Ids(vec![1]), &TOKENS, &mut out).unwrap();
    p.on_message(D, &Message::PushRegister(again[0].clone()), T0 + i, &mut out);
    assert_eq!(out.ready.len(), 1);
}

/// SPEC U6, U1 (found by `kvlease sim --push`, seed 3753): a duplicate of a registration whose
/// writes P failed is answered with the failure again, not an acknowledgement that it is
/// paired — the first report may have been lost, and D, still sending its registration until it
/// hears, would take "paired" as progress and wait on.
#[test]
fn u6_a_duplicate_of_a_failed_registration_is_told_the_failure_again() {
    let k = key("t");
    let mut p = source();
    let mut out = PushSettled::default();
    let short = PushRegistration { window_ns: 2 * SEC, ..reg(&k, 1, 2, 1) };
    p.on_message(D, &Message::PushRegister(short.clone()), T0, &mut out);
    p.grant(at(2), Some(k.clone()), "r", Ids(vec![1]), &TOKENS, &mut out).unwrap();
    assert!(out.ready.is_empty(), "D's deadline passed while P prefilled");
    assert_eq!(last_failure(&out), Some((0, 2, PushFailure::Deadline)));
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(short), at(3), &mut out);
    assert_eq!(last_failure(&out), Some((0, 2, PushFailure::Deadline)), "told again");
    assert!(!msgs(&out).iter().any(|m| matches!(m, Message::PushRegisterAck { .. })), "{:?}", msgs(&out));
}

/// SPEC O3, O4, S5: a router's release of a key: a lease no decoder holds ends at once as
/// `released`; a key not granted yet is fenced (its grant is refused, the blocks back at once);
/// a lease a decoder renewed or registered for is that decoder's and stays; a second release
/// changes nothing.
#[test]
fn o4_a_routers_release_ends_an_unheld_push_lease_but_never_a_decoders() {
    let mut p = source();
    let mut out = PushSettled::default();
    let k = key("unheld");
    let g = p.grant(T0, Some(k.clone()), "r", Ids(vec![1, 2]), &TOKENS, &mut out).unwrap();
    assert!(p.release_unheld(&k, at(1), &mut out));
    assert!(!p.is_live(g.lease_id));
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Released]);
    assert_eq!(out.freed, vec![Ids(vec![1, 2])]);
    assert!(!p.release_unheld(&k, at(1), &mut out), "released once");

    let early = key("early");
    let mut out = PushSettled::default();
    assert!(p.release_unheld(&early, T0, &mut out), "fenced before the grant");
    assert_eq!(p.grant(at(1), Some(early.clone()), "r", Ids(vec![3]), &TOKENS, &mut out), Err(PushGrantError::Released(early)));
    assert_eq!(out.freed, vec![Ids(vec![3])]);

    let (mut p, _) = paired(&key("held"), 1, 1);
    let mut out = PushSettled::default();
    assert!(!p.release_unheld(&key("held"), at(1), &mut out), "S5: the registering decoder holds it");
    assert!(p.lease_of(&key("held")).is_some());
    assert!(out.ended.is_empty() && out.freed.is_empty());
    let mut p = source();
    p.on_message(D, &Message::PushRegister(reg(&key("pending"), 1, 1, 1)), T0, &mut out);
    assert!(!p.release_unheld(&key("pending"), T0, &mut out), "held before the grant too (U2)");
    assert!(p.grant(at(1), Some(key("pending")), "r", Ids(vec![5]), &TOKENS, &mut out).is_ok());
}

/// SPEC U4 (vLLM #55470 over NIXL): a write P gives up on (it outlived the write timeout) over a
/// transport that cannot cancel it still reads its source blocks: D is told at once (`TimedOut`,
/// its tally closes) and the lease ends, but the blocks stay out of the pool — held by the pull
/// mode's quarantine — until the transport says the write ended, or the quarantine passes; only
/// then does D hear `PushLost` (nothing more lands). Over a fenced transport giving up is ending:
/// the blocks come back at once.
#[test]
fn u4_a_write_given_up_on_keeps_its_source_blocks_until_it_ended_or_the_quarantine_passed() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let hb = Message::PushHeartbeat { seq: 9, renewals: vec![PushRenewal { key: k.clone(), window_ns: 30 * SEC }] };
    for transport_says_ended in [true, false] {
        let (mut p, job) = paired(&k, 1, 1);
        p.set_fenced_writes(false);
        let mut out = PushSettled::default();
        let w = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
        let mut out = PushSettled::default();
        let id = p.abandon_write(w, at(3), &mut out).expect("held: the write runs on");
        assert_eq!(last_failure(&out), Some((0, 1, PushFailure::TimedOut)), "D is told at once, and that it may still land");
        assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Released], "the lease ends");
        assert!(out.freed.is_empty(), "the WRITE still reads the source blocks");
        assert!(!msgs(&out).contains(&&lost(&k)), "no PushLost while it may land: {:?}", msgs(&out));
        assert_eq!(p.abandoned_writes(), 1);
        assert!(!p.is_live(job.lease_id));
        assert_eq!(p.begin_write(&k, job.attempt, 0, 0, at(3), &mut out).err(), Some(WriteRefused::NotLive), "nothing more is posted");
        let mut out = PushSettled::default();
        p.on_message(D, &hb, at(4), &mut out);
        p.on_message(D, &Message::PushRelease { keys: vec![k.clone()] }, at(4), &mut out);
        assert!(!msgs(&out).contains(&&lost(&k)), "still in flight: {:?}", msgs(&out));
        let until = at(3) + cfg.quarantine();
        assert!(p.poll_timeout(at(4)).is_some_and(|t| t <= until), "the reaper wakes for the quarantine");
        p.poll(until - Duration::from_nanos(1), &mut out);
        assert!(out.freed.is_empty(), "held for the whole quarantine");
        let mut out = PushSettled::default();
        if transport_says_ended {
            p.abandoned_write_ended(id, &mut out);
        } else {
            p.poll(until, &mut out);
        }
        assert_eq!(out.freed, vec![Ids(vec![1, 2])], "back once the write ended (or the quarantine passed)");
        assert_eq!(msgs(&out), vec![&lost(&k)], "D hears that nothing more lands");
        assert_eq!(p.abandoned_writes(), 0);
        let mut out = PushSettled::default();
        p.abandoned_write_ended(id, &mut out);
        p.poll(until + Duration::from_secs(60), &mut out);
        assert!(out.freed.is_empty() && out.send.is_empty(), "once only");
    }
    // Fenced (tcp, mem): the dropped write stopped; giving up is ending it.
    let (mut p, job) = paired(&k, 1, 1);
    let mut out = PushSettled::default();
    let w = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
    let mut out = PushSettled::default();
    assert_eq!(p.abandon_write(w, at(3), &mut out), None);
    assert_eq!(last_failure(&out), Some((0, 1, PushFailure::WriteError)));
    assert_eq!(out.freed, vec![Ids(vec![1, 2])]);
    assert!(msgs(&out).contains(&&lost(&k)));
}

/// SPEC U8, U7, U10 (vLLM #55470 over NIXL, D's side): told a write was given up on but may still
/// land (`TimedOut`), D fails over at once, into other blocks (`blocks_reusable: false`), and
/// reuses the registered ones only when P says nothing more lands (`PushLost`). Where writes are
/// not fenced, D's own deadline keeps the blocks a quarantine longer too: a write P posted at the
/// deadline's edge and gave up on may land that long.
#[test]
fn u8_blocks_a_write_given_up_on_may_still_land_in_wait_for_it_to_stop() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let timed_out = Message::PushWriteFailed { key: k.clone(), attempt: 1, done: 0, failed: 1, why: PushFailure::TimedOut };
    let mut d = d_registered(&cfg, &k, 1, 1);
    d.set_fenced_writes(false);
    let mut acts = Vec::new();
    d.on_message("p", &timed_out, at(3), &mut acts);
    assert!(
        acts.iter().any(|a| matches!(
            a,
            PushAction::Failed { verdict: PushVerdict::Recompute(WriteLost::Failed(PushFailure::TimedOut)), blocks_reusable: false, .. }
        )),
        "fails over at once, not in these blocks: {acts:?}"
    );
    assert!(acts.iter().any(|a| matches!(a, PushAction::Send { msg: Message::PushRelease { .. }, .. })), "P is told (U9)");
    assert!(!acts.iter().any(|a| matches!(a, PushAction::BlocksFree { .. })));
    assert!(!d.blocks_reusable("req", 1, at(4)));
    let mut acts = Vec::new();
    d.on_message("p", &lost(&k), at(5), &mut acts);
    assert_eq!(acts, vec![PushAction::BlocksFree { request_id: "req".into(), attempt: 1 }], "P says the write stopped");

    // P's PushLost lost: D's bound, past its deadline by the grace and the quarantine.
    let grace = PushSink::write_grace(&cfg);
    let mut d = d_registered(&cfg, &k, 1, 1);
    d.set_fenced_writes(false);
    let mut acts = Vec::new();
    d.on_message("p", &timed_out, at(3), &mut acts);
    d.poll(at(30) + grace, &mut acts);
    assert!(!acts.iter().any(|a| matches!(a, PushAction::BlocksFree { .. })), "unfenced: the write may still land");
    let bound = at(30) + grace + cfg.quarantine();
    assert!(d.poll_timeout().is_some_and(|t| t <= bound));
    let mut acts = Vec::new();
    d.poll(bound, &mut acts);
    assert_eq!(acts, vec![PushAction::BlocksFree { request_id: "req".into(), attempt: 1 }]);

    // D's own deadline passes with a write in flight, unfenced: the same bound.
    let mut d = d_registered(&cfg, &k, 1, 1);
    d.set_fenced_writes(false);
    let mut acts = Vec::new();
    d.poll(at(30), &mut acts);
    assert!(acts.iter().any(|a| matches!(a, PushAction::Failed { blocks_reusable: false, .. })), "{acts:?}");
    let mut acts = Vec::new();
    d.poll(bound - Duration::from_nanos(1), &mut acts);
    assert!(!acts.iter().any(|a| matches!(a, PushAction::BlocksFree { .. })));
    d.poll(bound, &mut acts);
    assert_eq!(acts, vec![PushAction::BlocksFree { request_id: "req".into(), attempt: 1 }]);
}

/// P prefilling `k` (request "r") with D's registration of one rank and stage come first: the
/// early job is out.
fn prefilling_registered(k: &PushKey) -> PushSource<Ids> {
    let mut p = source();
    let mut out = PushSettled::default();
    assert!(p.prefill_started(k, "r", &TOKENS, &[1, 2], &mut out));
    assert!(out.early.is_empty(), "no registration yet: nothing to write into");
    p.on_message(D, &Message::PushRegister(reg(k, 1, 1, 1)), T0, &mut out);
    let job = out.early.pop().expect("a registration while P prefills makes an early job");
    assert_eq!((job.attempt, job.to.as_str(), job.block_ids.clone()), (1, D, vec![4, 5]));
    assert_eq!(msgs(&out), vec![&Message::PushRegisterAck { key: k.clone(), attempt: 1, granted: false }]);
    p
}

/// SPEC U4 (early writes), U5: while P still prefills, the blocks it computed may be written
/// into D's registration; those writes count toward nothing (no `PushWriteDone`, no lease
/// ended), and the transfer completes only by the writes after the grant.
#[test]
fn u4_early_writes_fill_computed_blocks_before_the_grant_and_count_toward_nothing() {
    let k = key("t");
    let mut p = prefilling_registered(&k);
    let mut out = PushSettled::default();
    let e = p.begin_early_write(&k, 1, at(1), &mut out).unwrap();
    assert_eq!(p.begin_early_write(&k, 2, at(1), &mut out).err(), Some(WriteRefused::NotRegistered), "only the newest registration");
    p.end_early_write(e, &mut out);
    assert!(out.send.is_empty() && out.ended.is_empty() && out.freed.is_empty(), "an early write counts toward nothing");
    p.grant(at(2), Some(k.clone()), "r", Ids(vec![1, 2]), &TOKENS, &mut out).unwrap();
    let job = out.ready.pop().expect("paired at the grant");
    let w = p.begin_write(&k, job.attempt, 0, 0, at(2), &mut out).unwrap();
    assert_eq!(p.begin_early_write(&k, 1, at(2), &mut out).err(), Some(WriteRefused::NotExpected), "none once the transfer writes");
    p.end_write(w, true, at(2), &mut out);
    assert!(msgs(&out).contains(&&done(&k, 1, 0, 0)));
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Transferred]);

    // A registration that came first is announced when the prefill starts; one for another
    // prompt never is (U11), and a second prefill under the same key gets no early writes.
    let mut p = source();
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(&k, 1, 1, 1)), T0, &mut out);
    assert!(p.prefill_started(&k, "r", &TOKENS, &[1, 2], &mut out));
    assert_eq!(out.early.len(), 1);
    assert!(!p.prefill_started(&k, "r2", &TOKENS, &[3], &mut out), "two dispatches never share early writes");
    let mut p = source();
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(reg(&k, 1, 1, 1)), T0, &mut out);
    assert!(p.prefill_started(&k, "r", &[9, 9], &[1, 2], &mut out));
    assert!(out.early.is_empty(), "registered for another prompt: nothing written early");
    assert_eq!(p.begin_early_write(&k, 1, at(1), &mut out).err(), Some(WriteRefused::NotRegistered));
}

/// SPEC U4, U7: P's prefill aborted while an early write is in flight: its source blocks stay
/// out of the pool and D hears the failure only once the write ended (D takes a failure as
/// "nothing more lands in these blocks").
#[test]
fn u4_u7_an_abort_during_an_early_write_holds_the_blocks_and_the_failure_until_it_ended() {
    let k = key("t");
    let mut p = prefilling_registered(&k);
    let mut out = PushSettled::default();
    let e = p.begin_early_write(&k, 1, at(1), &mut out).unwrap();
    p.abort_prefill(&k, "r", Some(Ids(vec![1, 2])), at(1), &mut out);
    assert!(out.freed.is_empty(), "an early write reads the blocks");
    assert!(out.send.is_empty(), "no failure while a write may still land: {:?}", msgs(&out));
    assert!(p.grant(at(1), Some(k.clone()), "r", Ids(vec![3]), &TOKENS, &mut out).is_err(), "an aborted key is never granted");
    let mut out = PushSettled::default();
    p.end_early_write(e, &mut out);
    assert_eq!(out.freed, vec![Ids(vec![1, 2]), Ids(vec![3])], "back once the write ended");
    assert_eq!(last_failure(&out).map(|(_, _, why)| why), Some(PushFailure::Aborted));
    assert!(msgs(&out).contains(&&lost(&k)), "and the key is gone");
}

/// SPEC U4, U5: the prefill's last blocks, computed as it ended, may still be written early
/// after the grant, before the transfer's first write: under the live lease (its blocks held by
/// the write like a read, also if the lease ends under it), into D's newest registration. The
/// transfer's writes then carry no byte and complete it. Never once the lease ended.
#[test]
fn u4_u5_an_early_write_after_the_grant_holds_the_lease_and_the_transfer_completes_after_it() {
    let k = key("t");
    let mut p = prefilling_registered(&k);
    let mut out = PushSettled::default();
    p.grant(at(1), Some(k.clone()), "r", Ids(vec![1, 2]), &TOKENS, &mut out).unwrap();
    let job = out.ready.pop().expect("paired at the grant");
    let e = p.begin_early_write(&k, 1, at(1), &mut out).expect("the last block, after the grant");
    assert_eq!(p.begin_early_write(&k, 2, at(1), &mut out).err(), Some(WriteRefused::NotRegistered), "only the newest registration");
    p.on_message(D, &Message::PushRelease { keys: vec![k.clone()] }, at(2), &mut out);
    assert!(out.freed.is_empty(), "the early write reads the lease's blocks");
    assert!(!msgs(&out).contains(&&lost(&k)), "not answered while a write is in flight");
    let mut out = PushSettled::default();
    p.end_early_write(e, &mut out);
    assert_eq!(out.freed, vec![Ids(vec![1, 2])], "back once it ended");
    assert_eq!(p.begin_early_write(&k, 1, at(2), &mut out).err(), Some(WriteRefused::NotLive), "never after the lease ended");
    assert!(p.begin_write(&k, job.attempt, 0, 0, at(2), &mut out).is_err());

    // Landed whole early: the transfer's write (no byte) completes it, exactly once.
    let mut p = prefilling_registered(&k);
    let mut out = PushSettled::default();
    p.grant(at(1), Some(k.clone()), "r", Ids(vec![1, 2]), &TOKENS, &mut out).unwrap();
    let job = out.ready.pop().expect("paired at the grant");
    let mut out = PushSettled::default();
    let e = p.begin_early_write(&k, 1, at(1), &mut out).unwrap();
    p.end_early_write(e, &mut out);
    assert!(out.send.is_empty() && out.ended.is_empty() && out.freed.is_empty(), "it counts toward nothing");
    let w = p.begin_write(&k, job.attempt, 0, 0, at(1), &mut out).unwrap();
    p.end_write(w, true, at(1), &mut out);
    assert!(msgs(&out).contains(&&done(&k, 1, 0, 0)));
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Transferred]);
    assert_eq!(out.freed, vec![Ids(vec![1, 2])]);
}

/// SPEC U1, U4: two dispatches under one key on P (a router's mistake), the one writing early
/// not the one granted: its early writer may write neither while the other holds the lease nor
/// after its own prefill was refused the key and gave its blocks back — also when both carry the
/// same request id (the blocks tell them apart).
#[test]
fn u1_u4_after_the_grant_only_the_granted_prefills_early_writer_may_write() {
    for other in ["r2", "r"] {
        let k = key("t");
        let mut p = prefilling_registered(&k);
        let mut out = PushSettled::default();
        p.grant(at(1), Some(k.clone()), other, Ids(vec![7, 8]), &TOKENS, &mut out).unwrap();
        assert_eq!(p.begin_early_write(&k, 1, at(1), &mut out).err(), Some(WriteRefused::NotLive), "{other}: another's lease");
        let mut out = PushSettled::default();
        assert_eq!(p.grant(at(2), Some(k.clone()), "r", Ids(vec![1, 2]), &TOKENS, &mut out), Err(PushGrantError::KeyTaken(k.clone())));
        assert_eq!(out.freed, vec![Ids(vec![1, 2])], "{other}: the early prefill's blocks are back");
        assert_eq!(p.begin_early_write(&k, 1, at(2), &mut out).err(), Some(WriteRefused::NotLive), "{other}: not from blocks given back");
    }
}

/// SPEC U4: a grant while an early write is in flight: the lease's blocks stay held by it, also
/// if the lease ends first.
#[test]
fn u4_a_lease_granted_during_an_early_write_keeps_its_blocks_until_it_ended() {
    let k = key("t");
    let mut p = prefilling_registered(&k);
    let mut out = PushSettled::default();
    let e = p.begin_early_write(&k, 1, at(1), &mut out).unwrap();
    p.grant(at(1), Some(k.clone()), "r", Ids(vec![1, 2]), &TOKENS, &mut out).unwrap();
    p.on_message(D, &Message::PushRelease { keys: vec![k.clone()] }, at(2), &mut out);
    assert_eq!(out.ended.iter().map(|e| e.reason).collect::<Vec<_>>(), vec![ReleaseReason::Released]);
    assert!(out.freed.is_empty(), "the early write still reads them");
    assert!(!msgs(&out).contains(&&lost(&k)), "not answered while a write is in flight");
    let mut out = PushSettled::default();
    p.end_early_write(e, &mut out);
    assert_eq!(out.freed, vec![Ids(vec![1, 2])]);
    assert!(msgs(&out).contains(&&lost(&k)));
}

/// SPEC U4, U6: an early write the transport cannot cancel (NIXL), given up on: D is told
/// `TimedOut` at once (it fails over elsewhere, keeping its blocks), and `PushLost` only once the
/// write ended — or, if the transport never says so, once the quarantine passed; the source
/// blocks are held until then. Over a fenced transport giving up is ending it.
#[test]
fn u4_an_early_write_given_up_on_is_told_timed_out_at_once_and_lost_when_it_ended() {
    let k = key("t");
    for told in [true, false] {
        let mut p = prefilling_registered(&k);
        p.set_fenced_writes(false);
        let mut out = PushSettled::default();
        let e = p.begin_early_write(&k, 1, at(1), &mut out).unwrap();
        let id = p.abandon_early_write(e, at(5), &mut out).expect("held: the transport cannot cancel it");
        assert_eq!(last_failure(&out).map(|(_, _, why)| why), Some(PushFailure::TimedOut));
        assert!(!msgs(&out).contains(&&lost(&k)));
        p.abort_prefill(&k, "r", Some(Ids(vec![1])), at(6), &mut out);
        assert!(out.freed.is_empty(), "the write may still read them");
        let mut out = PushSettled::default();
        if told {
            p.abandoned_write_ended(id, &mut out);
        } else {
            let release = p.poll_timeout(at(6)).expect("the quarantine's end is a deadline");
            assert!(release > at(6) && release <= at(5) + LeaseConfig::default().quarantine());
            while p.poll(release, &mut out) {}
        }
        assert_eq!(out.freed, vec![Ids(vec![1])], "told {told}");
        assert!(msgs(&out).contains(&&lost(&k)), "told {told}");
        assert_eq!(p.abandoned_writes(), 0);
    }
    let mut p = prefilling_registered(&k);
    let mut out = PushSettled::default();
    let e = p.begin_early_write(&k, 1, at(1), &mut out).unwrap();
    assert_eq!(p.abandon_early_write(e, at(5), &mut out), None, "fenced: dropping it stopped it");
    assert!(out.send.is_empty(), "nothing to tell: the transfer's writes carry the blocks");
}

/// SPEC U4, U8: D's gate lets a write fill a run of the registration's blocks in their order
/// (an early write fills a prefix) and nothing else.
#[test]
fn u4_ds_gate_takes_a_run_of_the_registered_blocks_in_order() {
    let k = key("t");
    let d = d_registered(&LeaseConfig::default(), &k, 1, 1);
    let digest = PromptDigest::of(&TOKENS);
    let may = |blocks: &[u32]| d.may_write("p", &k, 1, blocks, &digest.0, T0);
    assert!(may(&[4, 5]) && may(&[4]) && may(&[5]));
    assert!(!may(&[5, 4]) && !may(&[4, 6]) && !may(&[6]) && !may(&[]));
}

/// SPEC U2, U4: a key not granted yet that D stopped renewing is forgotten after E — also when an
/// early write was in flight at that moment: then once it has ended (never while it runs).
#[test]
fn u4_a_forsaken_key_with_an_early_write_in_flight_is_forgotten_once_it_ended() {
    let k = key("t");
    let mut p = prefilling_registered(&k);
    let mut out = PushSettled::default();
    let e = p.begin_early_write(&k, 1, at(1), &mut out).unwrap();
    // Past E and past the registration's deadline: every timer of the key has come due once.
    let late = at(LeaseConfig::default().extension.as_secs() + 31);
    while p.poll(late, &mut out) {}
    assert_eq!(p.pending(), 1, "kept while the early write runs");
    p.end_early_write(e, &mut out);
    let next = p.poll_timeout(late).expect("looked at again");
    while p.poll(next, &mut out) {}
    assert_eq!(p.pending(), 0, "forgotten once it ended");
}

fn failed_over(acts: &[PushAction], req: &str) -> Option<(PushVerdict, bool)> {
    acts.iter().find_map(|a| match a {
        PushAction::Failed { request_id, verdict, blocks_reusable } if request_id == req => Some((verdict.clone(), *blocks_reusable)),
        _ => None,
    })
}

/// SPEC D5, O4: the handshake that would carry D's registrations to P failed: every request
/// registered with that P fails over at once (its policy, in other blocks: its own wait for
/// U8's bound, as a write posted before the link broke might still land), P told, instead of
/// waiting out `push_registration_timeout` in a slot of D's. A request toward another P, or one
/// not registered yet (it registers over the next handshake), waits on.
#[test]
fn d5_o4_a_failed_handshake_fails_the_registered_requests_over_at_once() {
    let cfg = LeaseConfig::default();
    let k = key("t");
    let mut d = d_registered(&cfg, &k, 1, 1);
    d.admit("queued", "p", key("q"), T0);
    d.admit("other", "p2", key("o"), T0);
    d.register("other", 1, 0, PromptDigest::of(&TOKENS), 1, 1, vec![6], T0).unwrap();
    let mut acts = Vec::new();
    d.link_failed("p", at(1), &mut acts);
    assert_eq!(failed_over(&acts, "req"), Some((PushVerdict::Recompute(WriteLost::NoLink), false)), "{acts:?}");
    assert!(acts.contains(&PushAction::Send { engine_id: "p".into(), msg: Message::PushRelease { keys: vec![k.clone()] } }));
    assert_eq!(failed_over(&acts, "queued"), None, "not registered: it registers over the next handshake");
    assert_eq!(failed_over(&acts, "other"), None, "another engine's");
    let mut again = Vec::new();
    d.link_failed("p", at(2), &mut again);
    assert_eq!(failed_over(&again, "req"), None, "once");
}

/// SPEC D5, §3: a restarted P (it started 10 s ago) gets registrations for keys it holds
/// nothing of but D's renewals. One from a request D admitted 30 s ago had its prefill at an
/// earlier incarnation: answered lost at once (D fails over, U3) instead of kept for a prefill
/// that will not come. One from a request admitted 10.5 s ago may have its prefill leg still on
/// its way here (within the skew a prefill leg may trail its decode leg), one without an age
/// (an older D) is not judged, and one for a key whose prefill runs here is paired as ever.
#[test]
fn d5_a_restarted_p_answers_lost_a_registration_older_than_itself() {
    use super::source::PREFILL_LEG_SKEW;
    let started = at(0);
    let now = at(10);
    let mut p = PushSource::<Ids>::new(&LeaseConfig::default(), P_INC).started_at(started);
    let old = key("old");
    let renewal = |k: &PushKey| Message::PushHeartbeat { seq: 1, renewals: vec![PushRenewal { key: k.clone(), window_ns: 0 }] };
    let mut out = PushSettled::default();
    p.on_message(D, &renewal(&old), now, &mut out);
    let aged = |k: &PushKey, age: Duration| PushRegistration { age_ns: age.as_nanos() as u64, ..reg(k, 1, 1, 1) };
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(aged(&old, Duration::from_secs(30))), now, &mut out);
    assert_eq!(msgs(&out), vec![&lost(&old)], "admitted 30 s ago, P lived 10 s");

    let recent = key("recent");
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(aged(&recent, Duration::from_secs(10) + PREFILL_LEG_SKEW / 2)), now, &mut out);
    assert_eq!(msgs(&out), vec![&Message::PushRegisterAck { key: recent.clone(), attempt: 1, granted: false }], "kept");

    let ageless = key("ageless");
    let mut out = PushSettled::default();
    p.on_message(D, &Message::PushRegister(aged(&ageless, Duration::ZERO)), now, &mut out);
    assert!(!msgs(&out).contains(&&lost(&ageless)), "not judged: {:?}", msgs(&out));

    let prefilled = key("prefilled");
    let mut out = PushSettled::default();
    p.grant(now, Some(prefilled.clone()), "r", Ids(vec![1]), &TOKENS, &mut out).unwrap();
    p.on_message(D, &Message::PushRegister(aged(&prefilled, Duration::from_secs(30))), now, &mut out);
    assert_eq!(out.ready.len(), 1, "a key whose lease is here pairs, whatever its age");

    let mut unstarted = source();
    let mut out = PushSettled::default();
    unstarted.on_message(D, &Message::PushRegister(aged(&old, Duration::from_secs(30))), now, &mut out);
    assert!(!msgs(&out).contains(&&lost(&old)), "a source not told when it started judges no age");
}
