//! P's lease table against SPEC §4, one test per invariant.

use kvlease_core::config::LeaseConfig;
use kvlease_core::digest::PromptDigest;
use kvlease_core::lease_table::{Completion, Holder, LeaseTable, ReleaseReason, Released};
use kvlease_core::Nanos;
use std::num::NonZeroU32;
use std::time::Duration;

/// The decoder that holds the leases of most tests, and another engine of the cluster (SPEC S5).
const D: Holder = Holder(NonZeroU32::MIN);
const OTHER: Holder = Holder(NonZeroU32::MAX);
/// The prompt most tests' leases belong to (SPEC S4).
const DIGEST: PromptDigest = PromptDigest([7; 16]);

fn table() -> LeaseTable<&'static str> {
    LeaseTable::new(&LeaseConfig::default()) // L = 30 s, E = 20 s, I = 5 s, granularity 100 ms
}

fn secs(s: f64) -> Nanos {
    Nanos::from_secs_f64(s)
}

fn reasons<T>(r: &[Released<T>]) -> Vec<(u64, ReleaseReason)> {
    r.iter().map(|r| (r.lease_id, r.reason)).collect()
}

/// SPEC P1: a grant runs for L from now, counts its blocks, and ids are never reused.
#[test]
fn p1_grant_runs_for_l_and_ids_are_unique() {
    let mut t = table();
    let a = t.grant(secs(1.0), 4, "a");
    let b = t.grant(secs(1.0), 2, "b");
    assert_ne!(a, b);
    assert_eq!(t.deadline(a), Some(secs(31.0)));
    assert_eq!((t.live(), t.leased_blocks()), (2, 6));
    let mut rel = Vec::new();
    t.release(D, &[a], secs(2.0), &mut Vec::new(), &mut rel);
    let c = t.grant(secs(3.0), 1, "c");
    assert!(c != a && c != b, "a released id is never handed out again");
    assert_eq!(t.stats().granted, 3);
}

/// SPEC P2: a heartbeat sets max(deadline, now + E); it never shortens a lease.
#[test]
fn p2_renewal_takes_the_max_and_never_shortens() {
    let mut t = table();
    let a = t.grant(secs(0.0), 1, "a");
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    // now + E = 21 s < 30 s: unchanged.
    assert_eq!(t.renew(D, &[a], secs(1.0), &mut lost, &mut rel), 1);
    assert_eq!(t.deadline(a), Some(secs(30.0)));
    // now + E = 35 s > 30 s: extended.
    t.renew(D, &[a], secs(15.0), &mut lost, &mut rel);
    assert_eq!(t.deadline(a), Some(secs(35.0)));
    // An older heartbeat processed late cannot pull it back.
    t.renew(D, &[a], secs(14.0), &mut lost, &mut rel);
    assert_eq!(t.deadline(a), Some(secs(35.0)));
    assert!(lost.is_empty() && rel.is_empty());
    assert_eq!(t.stats().renewals, 3);
}

/// SPEC P3: each lease is released exactly once, by the first cause, counted under one reason;
/// everything after is answered as lost.
#[test]
fn p3_release_happens_once_under_the_first_reason() {
    let mut t = table();
    let ids: Vec<u64> = (0..4).map(|_| t.grant(secs(0.0), 1, "x")).collect();
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    assert_eq!(t.complete(D, ids[0], 0, 1, DIGEST, secs(1.0), &mut rel), Completion::Transferred);
    t.release(D, &[ids[1]], secs(1.0), &mut lost, &mut rel);
    t.tick(secs(40.0), &mut rel); // ids[2], ids[3] expire
    t.shutdown(secs(41.0), &mut rel); // nothing left
    assert_eq!(
        reasons(&rel),
        vec![
            (ids[0], ReleaseReason::Transferred),
            (ids[1], ReleaseReason::Released),
            (ids[2], ReleaseReason::Expired),
            (ids[3], ReleaseReason::Expired)
        ]
    );
    assert!(rel.iter().all(|r| r.payload.is_some()));
    // Late messages for all of them: lost, and nothing released twice.
    let n = rel.len();
    assert_eq!(t.renew(D, &ids, secs(42.0), &mut lost, &mut rel), 0);
    t.release(D, &ids, secs(42.0), &mut lost, &mut rel);
    assert_eq!(t.complete(D, ids[0], 1, 2, DIGEST, secs(42.0), &mut rel), Completion::Lost);
    assert_eq!(rel.len(), n);
    assert_eq!(lost.len(), 8);
    assert_eq!(t.stats().released, [1, 1, 2, 0]);
}

/// SPEC P3: shutdown releases whatever is live as `shutdown`, including a lease granted long
/// before, whose slot later grants skipped on every turn of the table.
#[test]
fn p3_shutdown_releases_everything_live() {
    let mut t = table();
    let old = t.grant(secs(0.0), 1, "old");
    let mut rel = Vec::new();
    // Many short-lived leases after `old`: the grants wrap around the table past its slot.
    for i in 0..5000 {
        let id = t.grant(secs(0.0), 1, "tmp");
        if i % 2 == 0 {
            t.release(D, &[id], secs(0.0), &mut Vec::new(), &mut rel);
        } else {
            t.complete(D, id, 0, 1, DIGEST, secs(0.0), &mut rel);
        }
    }
    let young = t.grant(secs(1.0), 3, "young");
    rel.clear();
    t.shutdown(secs(2.0), &mut rel);
    let mut got = reasons(&rel);
    got.sort();
    assert_eq!(got, vec![(old, ReleaseReason::Shutdown), (young, ReleaseReason::Shutdown)]);
    assert_eq!((t.live(), t.leased_blocks()), (0, 0));
}

/// SPEC P4 (vLLM #58222): expiry does not depend on insertion order — a renewed lease granted
/// first does not strand expired leases granted after it — and happens on a tick of an otherwise
/// idle table.
#[test]
fn p4_expiry_is_in_deadline_order_not_insertion_order() {
    let mut t = table();
    let first = t.grant(secs(0.0), 1, "renewed");
    let later: Vec<u64> = (0..100).map(|_| t.grant(secs(1.0), 1, "stale")).collect();
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    for s in [10.0, 20.0, 30.0] {
        t.renew(D, &[first], secs(s), &mut lost, &mut rel);
    }
    t.tick(secs(31.0), &mut rel);
    let expired: Vec<u64> = rel.iter().map(|r| r.lease_id).collect();
    assert_eq!(expired, later, "all later leases expire although the first one is still live");
    assert_eq!(t.deadline(first), Some(secs(50.0)));
    rel.clear();
    t.tick(secs(50.0), &mut rel);
    assert_eq!(reasons(&rel), vec![(first, ReleaseReason::Expired)]);
}

/// SPEC P4: a lease whose deadline ≤ now is gone after the next tick, whatever the tick spacing,
/// and never before its deadline.
#[test]
fn p4_every_tick_reaps_exactly_the_expired() {
    let cfg = LeaseConfig::with_lease_secs(0.6).unwrap(); // E = 0.4 s, granularity 10 ms
    let mut t: LeaseTable<()> = LeaseTable::new(&cfg);
    let mut rel = Vec::new();
    let mut ids = Vec::new();
    for i in 0..2000u64 {
        // Grants spread over 2 s, some renewed once.
        let now = Nanos(i * 1_000_000);
        let id = t.grant(now, 1, ());
        if i % 3 == 0 {
            t.renew(D, &[id], now + Duration::from_millis(500), &mut Vec::new(), &mut rel);
        }
        ids.push(id);
    }
    assert!(rel.is_empty());
    let mut now = Nanos(0);
    for step in [7u64, 1, 13, 100, 3, 250, 1, 999] {
        for _ in 0..6 {
            now = now + Duration::from_millis(step);
            t.tick(now, &mut rel);
            for r in rel.drain(..) {
                assert_eq!(r.reason, ReleaseReason::Expired);
            }
            for &id in &ids {
                if let Some(d) = t.deadline(id) {
                    assert!(d > now, "lease {id} with deadline {d:?} survived a tick at {now:?}");
                }
            }
        }
    }
}

/// SPEC P4: after a long quiet spell a single tick reaps everything (no turn of the wheel missed),
/// including leases renewed far past the wheel's horizon.
#[test]
fn p4_long_gaps_and_far_deadlines() {
    let cfg = LeaseConfig { max_lifetime: None, ..LeaseConfig::with_lease_secs(0.06).unwrap() };
    let mut t: LeaseTable<()> = LeaseTable::new(&cfg);
    let mut rel = Vec::new();
    let a = t.grant(Nanos(0), 1, ());
    let b = t.grant(Nanos(0), 1, ());
    // Keep `a` alive for 10 s with renewals every 10 ms while ticking.
    let mut now = Nanos(0);
    for _ in 0..1000 {
        now = now + Duration::from_millis(10);
        t.renew(D, &[a], now, &mut Vec::new(), &mut rel);
        t.tick(now, &mut rel);
    }
    assert_eq!(reasons(&rel), vec![(b, ReleaseReason::Expired)]);
    rel.clear();
    t.tick(now + Duration::from_secs(3600), &mut rel);
    assert_eq!(reasons(&rel), vec![(a, ReleaseReason::Expired)]);
    assert_eq!(t.next_expiry(), None);
}

/// SPEC P5: a read begins only on a live lease; a lease released mid-read keeps its payload
/// (its blocks) until the last reader ends.
#[test]
fn p5_no_reuse_under_a_reader() {
    let mut t = table();
    let a = t.grant(secs(0.0), 2, "blocks");
    let mut rel = Vec::new();
    let r1 = t.begin_read(D, a, None, secs(1.0), &mut rel).unwrap();
    let r2 = t.begin_read(D, a, None, secs(1.0), &mut rel).unwrap();
    t.tick(secs(31.0), &mut rel);
    assert_eq!(rel.len(), 1);
    assert!(rel[0].payload.is_none(), "payload must stay parked while read");
    assert_eq!(t.parked(), 1);
    assert!(t.begin_read(D, a, None, secs(31.0), &mut rel).is_none(), "no new read of a dead lease");
    assert_eq!(t.end_read(r1), None);
    assert_eq!(t.end_read(r2), Some("blocks"));
    assert_eq!(t.parked(), 0);
    // A read that ends normally returns nothing; the lease stays live.
    let b = t.grant(secs(40.0), 1, "b");
    let r = t.begin_read(D, b, None, secs(40.0), &mut rel).unwrap();
    assert_eq!(t.end_read(r), None);
    assert!(t.deadline(b).is_some());
}

/// SPEC P5, P6: a read, renewal or completion arriving after the deadline but before the reaper
/// tick finds the lease dead (and releases it as expired), never live.
#[test]
fn p5_p6_past_deadline_is_dead_before_the_reaper_runs() {
    let mut t = table();
    let (a, b, c) = (t.grant(secs(0.0), 1, "a"), t.grant(secs(0.0), 1, "b"), t.grant(secs(0.0), 1, "c"));
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    assert!(t.begin_read(D, a, None, secs(30.0), &mut rel).is_none());
    assert_eq!(t.renew(D, &[b], secs(30.0), &mut lost, &mut rel), 0);
    assert_eq!(t.complete(D, c, 0, 1, DIGEST, secs(30.0), &mut rel), Completion::Lost);
    assert_eq!(lost, vec![b]);
    assert_eq!(reasons(&rel), vec![(a, ReleaseReason::Expired), (b, ReleaseReason::Expired), (c, ReleaseReason::Expired)]);
}

/// SPEC P6: unknown and released ids in a heartbeat are answered lost; live ones renew.
#[test]
fn p6_unknown_ids_are_reported_lost() {
    let mut t = table();
    let a = t.grant(secs(0.0), 1, "a");
    let b = t.grant(secs(0.0), 1, "b");
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    t.release(D, &[b], secs(1.0), &mut lost, &mut rel);
    assert_eq!(t.renew(D, &[a, b, 999, 0, u64::MAX], secs(15.0), &mut lost, &mut rel), 1);
    assert_eq!(lost, vec![b, 999, 0, u64::MAX]);
    assert_eq!(t.deadline(a), Some(secs(35.0)));
}

/// SPEC P8: with n expected consumers the lease is transferred at the n-th distinct one;
/// duplicates do not count twice.
#[test]
fn p8_transferred_after_n_distinct_consumers() {
    let mut t = table();
    let a = t.grant(secs(0.0), 1, "a");
    let mut rel = Vec::new();
    assert_eq!(t.complete(D, a, 0, 3, DIGEST, secs(1.0), &mut rel), Completion::Pending);
    assert_eq!(t.complete(D, a, 0, 3, DIGEST, secs(1.0), &mut rel), Completion::Pending, "duplicate");
    assert_eq!(t.complete(D, a, 2, 3, DIGEST, secs(1.0), &mut rel), Completion::Pending);
    assert!(rel.is_empty());
    assert_eq!(t.complete(D, a, 1, 3, DIGEST, secs(1.0), &mut rel), Completion::Transferred);
    assert_eq!(reasons(&rel), vec![(a, ReleaseReason::Transferred)]);
    assert_eq!(rel[0].held, Duration::from_secs(1));
    // n = 0 is read as 1: a malformed count cannot pin a lease forever nor free it twice.
    let b = t.grant(secs(0.0), 1, "b");
    assert_eq!(t.complete(D, b, 7, 0, DIGEST, secs(1.0), &mut rel), Completion::Transferred);
}

/// SPEC P9: with kv_lease_max_lifetime, renewals stop at grant + max_lifetime.
#[test]
fn p9_max_lifetime_caps_renewals() {
    let cfg = LeaseConfig { max_lifetime: Some(Duration::from_secs(60)), ..LeaseConfig::default() };
    let mut t: LeaseTable<()> = LeaseTable::new(&cfg);
    let a = t.grant(secs(10.0), 1, ());
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    for s in (15..=120).step_by(5) {
        t.renew(D, &[a], secs(s as f64), &mut lost, &mut rel);
        t.tick(secs(s as f64), &mut rel);
    }
    assert_eq!(reasons(&rel), vec![(a, ReleaseReason::Expired)]);
    assert_eq!(rel[0].held, Duration::from_secs(60));
    // Off by default: the same renewals keep a lease forever.
    let mut t: LeaseTable<()> = LeaseTable::new(&LeaseConfig::default());
    let b = t.grant(secs(10.0), 1, ());
    rel.clear();
    for s in (15..=1000).step_by(5) {
        t.renew(D, &[b], secs(s as f64), &mut lost, &mut rel);
        t.tick(secs(s as f64), &mut rel);
    }
    assert!(rel.is_empty());
}

/// Memory stays O(live): one lease kept alive while 200,000 come and go keeps its slot and its
/// renewals, and the table does not grow.
#[test]
fn table_stays_small_behind_a_long_lived_lease() {
    let mut t: LeaseTable<u32> = LeaseTable::new(&LeaseConfig::default());
    let keep = t.grant(Nanos(0), 1, 0);
    let mut rel = Vec::new();
    for i in 0..200_000u32 {
        let id = t.grant(Nanos(0), 1, i);
        t.complete(D, id, 0, 1, DIGEST, Nanos(0), &mut rel);
    }
    assert_eq!(t.live(), 1);
    assert_eq!(t.capacity(), 16, "never more than two leases live");
    assert_eq!(t.get(keep), Some(&0));
    let mut lost = Vec::new();
    assert_eq!(t.renew(D, &[keep], secs(25.0), &mut lost, &mut rel), 1);
    assert_eq!(t.deadline(keep), Some(secs(45.0)));
    assert_eq!(*t.stats(), kvlease_core::lease_table::LeaseStats { granted: 200_001, renewals: 1, released: [200_000, 0, 0, 0] });
}

/// SPEC P4: with sparse ticks (several buckets apart) renewed leases refiled past the wheel's
/// horizon are still reaped on the first tick after their deadline, not a turn of the wheel later.
#[test]
fn p4_sparse_ticks_with_renewals() {
    let cfg = LeaseConfig::with_lease_secs(0.6).unwrap(); // E = 400 ms, buckets of 10 ms, ring ~ 630 ms
    for gaps in [[30u64, 50, 70, 130, 290], [290, 60, 13, 250, 80], [7, 290, 45, 1, 300]] {
        let mut t: LeaseTable<()> = LeaseTable::new(&cfg);
        let mut rel = Vec::new();
        let ids: Vec<u64> = (0..50).map(|i| t.grant(Nanos(i * 3_000_000), 1, ())).collect();
        let mut now = Nanos(0);
        for round in 0..60u64 {
            let gap_ms = gaps[round as usize % gaps.len()];
            now = now + Duration::from_millis(gap_ms);
            // Keep renewing a shrinking subset, so deadlines move while the cursor lags.
            let keep = &ids[..ids.len().saturating_sub(round as usize)];
            t.renew(D, keep, now, &mut Vec::new(), &mut rel);
            t.tick(now, &mut rel);
            for &id in &ids {
                if let Some(d) = t.deadline(id) {
                    assert!(d > now, "gap {gap_ms} ms: lease {id} due {d:?} survived a tick at {now:?}");
                }
            }
        }
    }
}

/// SPEC P9 × D6: a renewal the lifetime cap keeps from reaching now + E is reported lost to D
/// (it must not count on it), while P keeps the lease until the cap.
#[test]
fn p9_capped_renewal_is_reported_lost_but_lease_lives_to_its_cap() {
    let cfg = LeaseConfig { max_lifetime: Some(Duration::from_secs(40)), ..LeaseConfig::default() };
    let mut t: LeaseTable<()> = LeaseTable::new(&cfg);
    let a = t.grant(secs(0.0), 1, ());
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    assert_eq!(t.renew(D, &[a], secs(15.0), &mut lost, &mut rel), 1, "15 + 20 ≤ 40: a full renewal");
    assert!(lost.is_empty());
    assert_eq!(t.renew(D, &[a], secs(25.0), &mut lost, &mut rel), 0, "25 + 20 > 40: capped");
    assert_eq!(lost, vec![a]);
    assert_eq!(t.deadline(a), Some(secs(40.0)));
    t.tick(secs(39.9), &mut rel);
    assert!(rel.is_empty(), "still live until the cap");
}

/// SPEC P2, P3, P6, P8: P's answer to each message from D, in one place.
#[test]
fn p6_every_message_gets_its_answer() {
    use kvlease_core::wire::Message;
    let mut t = table();
    let a = t.grant(secs(0.0), 1, "a");
    let b = t.grant(secs(0.0), 1, "b");
    let mut rel = Vec::new();
    let hb = t.on_message(D, &Message::Heartbeat { seq: 9, lease_ids: vec![a, 77] }, secs(15.0), &mut rel);
    assert_eq!(hb.reply, Some(Message::HeartbeatAck { seq: 9, lost_ids: vec![77] }));
    assert_eq!(hb.renewed, 1);
    let r = t.on_message(D, &Message::Release { lease_ids: vec![b, 78] }, secs(15.0), &mut rel);
    assert_eq!(r.reply, Some(Message::LeaseLost { lease_ids: vec![78] }));
    let d = t.on_message(D, &Message::ReadDone { lease_id: a, consumer_rank: 0, n: 1, digest: DIGEST }, secs(16.0), &mut rel);
    assert_eq!(d.reply, Some(Message::ReadDoneAck { lease_id: a, live: true }));
    let again = t.on_message(D, &Message::ReadDone { lease_id: a, consumer_rank: 0, n: 1, digest: DIGEST }, secs(16.0), &mut rel);
    assert_eq!(again.reply, Some(Message::ReadDoneAck { lease_id: a, live: false }), "a late duplicate is told lost");
    assert_eq!(reasons(&rel), vec![(b, ReleaseReason::Released), (a, ReleaseReason::Transferred)]);
    let ping = t.on_message(D, &Message::ClockPing { seq: 1, t0: 5 }, secs(17.0), &mut rel);
    assert!(matches!(ping.reply, Some(Message::ClockPong { seq: 1, t0: 5, .. })));
    assert_eq!(t.on_message(D, &Message::LeaseLost { lease_ids: vec![1] }, secs(17.0), &mut rel).reply, None, "not for P");
}

/// SPEC P3, P8 over a fenced transport: a completion of a live lease is not acknowledged (the
/// read passed `begin_read`, and D used the bytes without waiting), a completion of a lease no
/// longer live is still answered `live: false`, and the lease ends `transferred` as before.
#[test]
fn p8_a_fenced_completion_of_a_live_lease_needs_no_answer() {
    use kvlease_core::wire::Message;
    let mut t = table();
    t.set_fenced_reads(true);
    let a = t.grant(secs(0.0), 1, "a");
    let mut rel = Vec::new();
    let done = Message::ReadDone { lease_id: a, consumer_rank: 0, n: 1, digest: DIGEST };
    assert_eq!(t.on_message(D, &done, secs(1.0), &mut rel).reply, None, "live: no acknowledgement");
    assert_eq!(reasons(&rel), vec![(a, ReleaseReason::Transferred)]);
    assert_eq!(t.on_message(D, &done, secs(1.0), &mut rel).reply, Some(Message::ReadDoneAck { lease_id: a, live: false }), "told lost");
}

/// SPEC S5: the first engine to name a lease owns it; another engine's heartbeat, release,
/// completion or read of it is answered lost and changes nothing, and the holder's request goes
/// on unaffected.
#[test]
fn s5_a_lease_belongs_to_its_first_holder() {
    use kvlease_core::wire::Message;
    let mut t = table();
    let (a, b, c) = (t.grant(secs(0.0), 1, "a"), t.grant(secs(0.0), 1, "b"), t.grant(secs(0.0), 1, "c"));
    let mut rel = Vec::new();
    // D claims a and b with a heartbeat, c by reading it.
    let hb = t.on_message(D, &Message::Heartbeat { seq: 1, lease_ids: vec![a, b] }, secs(1.0), &mut rel);
    assert_eq!(hb.reply, Some(Message::HeartbeatAck { seq: 1, lost_ids: vec![] }));
    let ticket = t.begin_read(D, c, None, secs(1.0), &mut rel).expect("D reads its own lease");
    assert!(t.end_read(ticket).is_none());
    // Another engine of the cluster, guessing the sequential ids, gets nowhere.
    let r = t.on_message(OTHER, &Message::Release { lease_ids: vec![a, b, c] }, secs(2.0), &mut rel);
    assert_eq!(r.reply, Some(Message::LeaseLost { lease_ids: vec![a, b, c] }));
    let done = t.on_message(OTHER, &Message::ReadDone { lease_id: a, consumer_rank: 0, n: 1, digest: DIGEST }, secs(2.0), &mut rel);
    assert_eq!(done.reply, Some(Message::ReadDoneAck { lease_id: a, live: false }));
    let hb = t.on_message(OTHER, &Message::Heartbeat { seq: 9, lease_ids: vec![a, b, c] }, secs(25.0), &mut rel);
    assert_eq!(hb.reply, Some(Message::HeartbeatAck { seq: 9, lost_ids: vec![a, b, c] }));
    assert_eq!(hb.renewed, 0);
    assert!(t.begin_read(OTHER, b, None, secs(2.0), &mut rel).is_none(), "no read of another engine's lease");
    assert!(rel.is_empty(), "nothing released by the other engine");
    assert_eq!(t.deadline(a), Some(secs(30.0)), "not kept alive by the other engine");
    assert_eq!(t.live(), 3);
    // The holder's own messages still work.
    assert_eq!(t.complete(D, a, 0, 1, DIGEST, secs(3.0), &mut rel), Completion::Transferred);
    t.release(D, &[b], secs(3.0), &mut Vec::new(), &mut rel);
    assert_eq!(reasons(&rel), vec![(a, ReleaseReason::Transferred), (b, ReleaseReason::Released)]);
    // Interned holders are stable per authenticated engine name.
    let mut t2 = table();
    let (h1, h2) = (t2.holder("D1/1f"), t2.holder("D1/2a"));
    assert_ne!(h1, h2, "another incarnation is another holder");
    assert_eq!(t2.holder("D1/1f"), h1);
}

/// SPEC S4: P confirms a read only for the prompt it granted the lease for; a completion naming
/// another prompt's digest is answered lost and counts for nothing.
#[test]
fn s4_completion_for_another_prompt_is_not_confirmed() {
    // The digest lives in the payload the engine attaches (`LeasePayload`).
    let mut t: LeaseTable<(PromptDigest, &str)> = LeaseTable::new(&LeaseConfig::default());
    let a = t.grant(secs(0.0), 1, (PromptDigest::of(&[1, 2, 3]), "a"));
    let mut rel = Vec::new();
    assert_eq!(t.complete(D, a, 0, 1, PromptDigest::of(&[1, 2, 4]), secs(1.0), &mut rel), Completion::Lost);
    assert!(rel.is_empty());
    assert_eq!(t.live(), 1);
    assert_eq!(t.complete(D, a, 0, 1, PromptDigest::of(&[1, 2, 3]), secs(1.0), &mut rel), Completion::Transferred);
}

/// SPEC S4 over a fenced transport: a reader that shows another prompt's digest is refused
/// before a byte is served; the right digest, or none shown, is served.
#[test]
fn s4_a_read_for_another_prompt_is_refused_at_its_start() {
    let mut t: LeaseTable<(PromptDigest, &str)> = LeaseTable::new(&LeaseConfig::default());
    let a = t.grant(secs(0.0), 1, (PromptDigest::of(&[1, 2, 3]), "a"));
    let mut rel = Vec::new();
    assert!(t.begin_read(D, a, Some(PromptDigest::of(&[1, 2, 4])), secs(1.0), &mut rel).is_none());
    assert_eq!(t.live(), 1, "the lease is untouched");
    let ticket = t.begin_read(D, a, Some(PromptDigest::of(&[1, 2, 3])), secs(1.0), &mut rel).expect("its own prompt is served");
    assert!(t.end_read(ticket).is_none());
    let ticket = t.begin_read(D, a, None, secs(1.0), &mut rel).expect("no digest shown: checked at completion instead");
    assert!(t.end_read(ticket).is_none());
    assert!(rel.is_empty());
}

/// Memory follows the live count, not the grant pattern: 100 leases kept alive while a million
/// come and go never need more than the slots for the peak (SPEC P3 exactly once all along).
#[test]
fn capacity_follows_peak_live_under_churn() {
    let mut t: LeaseTable<u32> = LeaseTable::new(&LeaseConfig::default());
    let keep: Vec<u64> = (0..100).map(|i| t.grant(Nanos(0), 1, i)).collect();
    let mut rel = Vec::new();
    let mut window = std::collections::VecDeque::new();
    for i in 0..1_000_000u32 {
        window.push_back(t.grant(Nanos(0), 1, i));
        if window.len() > 50 {
            let id = window.pop_front().unwrap();
            t.complete(D, id, 0, 1, DIGEST, Nanos(0), &mut rel);
        }
    }
    assert_eq!(t.live(), 150);
    assert!(t.capacity() <= 256, "capacity {} for 150 live", t.capacity());
    for (i, &id) in keep.iter().enumerate() {
        assert_eq!(t.get(id), Some(&(i as u32)));
    }
    assert_eq!(t.renew(D, &keep, secs(25.0), &mut Vec::new(), &mut rel), 100);
}

/// SPEC §3 fencing token: a lease id is never handed out again, and an id whose slot a later
/// lease took over is lost to every operation, never taken for that lease — also across growth
/// of the table.
#[test]
fn stale_id_of_a_reused_slot_is_lost_not_another_lease() {
    let mut t = table();
    let mut rel = Vec::new();
    let old = t.grant(secs(0.0), 1, "old");
    t.release(D, &[old], secs(0.0), &mut Vec::new(), &mut rel);
    // Grant until some lease sits in the old lease's slot (ids equal mod the capacity).
    let cap = t.capacity() as u64;
    let mut ids = Vec::new();
    let reuser = loop {
        let id = t.grant(secs(0.0), 1, "new");
        ids.push(id);
        if id % cap == old % cap {
            break id;
        }
    };
    assert_ne!(reuser, old);
    let mut lost = Vec::new();
    assert_eq!(t.renew(D, &[old], secs(15.0), &mut lost, &mut rel), 0);
    assert_eq!(lost, vec![old]);
    assert_eq!(t.deadline(old), None);
    assert_eq!(t.get(old), None);
    assert!(t.begin_read(D, old, None, secs(1.0), &mut rel).is_none());
    assert_eq!(t.complete(D, old, 0, 1, DIGEST, secs(1.0), &mut rel), Completion::Lost);
    t.release(D, &[old], secs(1.0), &mut lost, &mut rel);
    assert_eq!(rel.len(), 1, "only the first release of `old`");
    assert_eq!(t.deadline(reuser), Some(secs(30.0)), "the new lease is untouched");
    assert_eq!(t.get(reuser), Some(&"new"));
}

mod id_scheme {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    #[derive(Debug, Clone)]
    enum Op {
        Grant(u8),
        End(usize),
        Probe(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u8..40).prop_map(Op::Grant),
            3 => any::<usize>().prop_map(Op::End),
            2 => any::<usize>().prop_map(Op::Probe),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// SPEC §3, P6 against a model, through growth and slot reuse: ids never repeat; every
        /// id that was released (or never issued) is lost to renew, release, read and
        /// completion and leaves the live leases as they were; every live id finds its own
        /// payload.
        #[test]
        fn model_ids_unique_and_stale_ids_lost(ops in prop::collection::vec(op(), 1..120)) {
            let mut t: LeaseTable<u64> = LeaseTable::new(&LeaseConfig::default());
            let mut live: BTreeMap<u64, u64> = BTreeMap::new();
            let mut dead: Vec<u64> = Vec::new();
            let mut issued: BTreeSet<u64> = BTreeSet::new();
            let mut rel = Vec::new();
            let now = secs(1.0);
            for op in ops {
                match op {
                    Op::Grant(n) => {
                        for _ in 0..n {
                            let tag = issued.len() as u64;
                            let id = t.grant(now, 1, tag);
                            prop_assert!(issued.insert(id), "id {} handed out twice", id);
                            live.insert(id, tag);
                        }
                    }
                    Op::End(i) => {
                        if let Some((&id, _)) = live.iter().nth(i % live.len().max(1)) {
                            t.release(D, &[id], now, &mut Vec::new(), &mut rel);
                            live.remove(&id);
                            dead.push(id);
                        }
                    }
                    Op::Probe(i) => {
                        let stale = if dead.is_empty() || i % 4 == 0 { issued.last().map_or(1, |l| l + 1 + (i % 1000) as u64) } else { dead[i % dead.len()] };
                        let mut lost = Vec::new();
                        prop_assert_eq!(t.renew(D, &[stale], now, &mut lost, &mut rel), 0);
                        prop_assert_eq!(&lost, &vec![stale]);
                        t.release(D, &[stale], now, &mut lost, &mut rel);
                        prop_assert_eq!(lost.len(), 2);
                        prop_assert!(t.begin_read(D, stale, None, now, &mut rel).is_none());
                        prop_assert_eq!(t.complete(D, stale, 0, 1, DIGEST, now, &mut rel), Completion::Lost);
                        prop_assert_eq!(t.get(stale), None);
                    }
                }
                prop_assert_eq!(t.live(), live.len());
                prop_assert_eq!(rel.len(), dead.len(), "exactly the released ones were released");
                for (&id, &tag) in &live {
                    prop_assert_eq!(t.get(id), Some(&tag));
                    prop_assert_eq!(t.deadline(id), Some(secs(31.0)));
                }
            }
        }

        /// SPEC P4 with a work budget: ticks of any budget, repeated while they report work
        /// left, leave no lease with a deadline ≤ now; no tick does more than its budget's worth;
        /// `next_expiry` is never later than the earliest live deadline.
        #[test]
        fn budgeted_ticks_reap_everything_and_next_expiry_is_never_late(
            steps in prop::collection::vec((0u64..120, 1usize..8, prop::collection::vec(0usize..64, 0..4)), 1..80),
        ) {
            let cfg = LeaseConfig::with_lease_secs(0.6).unwrap(); // E = 0.4 s, buckets of 10 ms
            let mut t: LeaseTable<()> = LeaseTable::new(&cfg);
            let mut ids = Vec::new();
            let mut rel = Vec::new();
            let mut now = Nanos(0);
            for (ms, budget, renew) in steps {
                now = now + Duration::from_millis(ms);
                for _ in 0..3 {
                    ids.push(t.grant(now, 1, ()));
                }
                let pick: Vec<u64> = renew.iter().filter_map(|&i| ids.get(i).copied()).collect();
                t.renew(D, &pick, now, &mut Vec::new(), &mut rel);
                rel.clear();
                let before = t.live();
                let more = t.tick_budget(now, budget, &mut rel);
                prop_assert!(rel.len() <= budget, "{} released on a budget of {}", rel.len(), budget);
                prop_assert_eq!(before - rel.len(), t.live());
                if more {
                    prop_assert_eq!(t.next_expiry(), Some(now));
                }
                let mut guard = 0;
                while t.tick_budget(now, budget, &mut rel) {
                    guard += 1;
                    prop_assert!(guard < 100_000);
                }
                let earliest = ids.iter().filter_map(|&id| t.deadline(id)).min();
                for &id in &ids {
                    if let Some(d) = t.deadline(id) {
                        prop_assert!(d > now, "lease {} due {:?} survived budgeted ticks at {:?}", id, d, now);
                    }
                }
                if let Some(e) = earliest {
                    prop_assert!(t.next_expiry().is_some_and(|n| n <= e), "next_expiry {:?} later than {:?}", t.next_expiry(), e);
                }
            }
        }
    }
}

/// A table sized for its most live leases never grows (growing splits slots, moving leases),
/// and still takes more when asked; it is sized at 31/32 full, not to the next power of two.
#[test]
fn with_capacity_never_grows_up_to_its_size() {
    let mut t: LeaseTable<u32> = LeaseTable::with_capacity(&LeaseConfig::default(), 1000);
    let cap = t.capacity();
    assert!((1000 * 32 / 31..=1040).contains(&cap), "capacity {cap}");
    let ids: Vec<u64> = (0..1000).map(|i| t.grant(Nanos(0), 1, i)).collect();
    assert_eq!(t.capacity(), cap);
    t.grant(Nanos(0), 1, 1000);
    assert!(t.capacity() >= cap);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(t.get(*id), Some(&(i as u32)));
    }
    assert_eq!(LeaseTable::<()>::with_capacity(&LeaseConfig::default(), 0).capacity(), 16);
}

/// A clock at the very end of its range (`u64::MAX` ns) moves the epoch once and then never
/// again: the table's time of the next move saturates there, and a second call at the same
/// time must not try to move it by a negative amount (it panicked in a debug build). A lease
/// granted and released there leaves the expiry index at the next tick, which returns (the
/// reaper looped forever on its emptied bucket: no deadline is later than u64::MAX).
#[test]
fn p4_a_clock_at_the_end_of_its_range_moves_the_epoch_once() {
    let mut t: LeaseTable<u32> = LeaseTable::new(&LeaseConfig::default());
    let end = Nanos(u64::MAX);
    let mut rel = Vec::new();
    t.tick(end, &mut rel);
    t.tick(end, &mut rel);
    let id = t.grant(end, 1, 7);
    let mut lost = Vec::new();
    t.release(D, &[id], end, &mut lost, &mut rel);
    t.tick(end, &mut rel);
    assert!(rel.iter().any(|r| r.lease_id == id), "{rel:?}");
    assert_eq!(t.live(), 0);
}

/// The table's times are 32-bit milliseconds from an epoch that moves forward (about every 12
/// days): a lease renewed for 60 days keeps its exact deadlines across four moves (SPEC P2),
/// leases granted around each move expire exactly at their deadlines and in deadline order
/// (P4), and stale ids stay lost.
#[test]
fn p2_p4_long_lived_lease_across_epoch_moves() {
    let cfg = LeaseConfig::with_lease_secs(3600.0).unwrap();
    let e = cfg.extension;
    let step = cfg.heartbeat_interval;
    let mut t: LeaseTable<u32> = LeaseTable::new(&cfg);
    let t0 = Nanos(20 * 86_400 * 1_000_000_000 + 123_000_000);
    let keep = t.grant(t0, 1, 0);
    let mut keep_deadline = t0 + cfg.lease_duration;
    let mut rel = Vec::new();
    let mut now = t0;
    let mut expired_seen = 0;
    let mut short: Vec<(u64, Nanos)> = Vec::new();
    let mut dead = Vec::new();
    while now < t0 + Duration::from_secs(60 * 86_400) {
        now = now + step;
        let mut lost = Vec::new();
        assert_eq!(t.renew(D, &[keep], now, &mut lost, &mut rel), 1, "renewed at {now:?}");
        keep_deadline = keep_deadline.max(now + e);
        assert_eq!(t.deadline(keep), Some(keep_deadline), "exact deadline at {now:?}");
        // A lease of L granted at each step, and three shorter cached turns now and then.
        let id = t.grant(now, 1, 1);
        assert_eq!(t.deadline(id), Some(now + cfg.lease_duration));
        short.push((id, now + cfg.lease_duration));
        if short.len().is_multiple_of(97) {
            for ms in [300u64, 100, 200] {
                let d = now + Duration::from_millis(ms);
                short.push((t.grant_for(now, Duration::from_millis(ms), 1, 2), d));
            }
        }
        rel.clear();
        t.tick(now, &mut rel);
        let mut want: Vec<(Nanos, u64)> = short.iter().filter(|(_, d)| *d <= now).map(|(id, d)| (*d, *id)).collect();
        want.sort_unstable();
        let got: Vec<u64> = rel.iter().map(|r| r.lease_id).collect();
        assert_eq!(got, want.iter().map(|(_, id)| *id).collect::<Vec<_>>(), "deadline order at {now:?}");
        assert!(rel.iter().all(|r| r.reason == ReleaseReason::Expired));
        expired_seen += rel.len();
        dead.extend(got);
        short.retain(|(_, d)| *d > now);
        for &(id, d) in &short {
            assert_eq!(t.deadline(id), Some(d));
        }
    }
    assert!(expired_seen > 1000);
    let mut lost = Vec::new();
    assert_eq!(t.renew(D, &dead, now, &mut lost, &mut rel), 0);
    assert_eq!(lost, dead, "stale ids stay lost across epoch moves");
    rel.clear();
    t.release(D, &[keep], now, &mut Vec::new(), &mut rel);
    // Hold time is counted from the grant for 12 days at least, then from the epoch.
    assert!(rel[0].held >= Duration::from_secs(12 * 86_400) && rel[0].held <= now.since(t0));
}

/// SPEC B1, B3, P5: the engine that keeps cached turns takes them back when it needs blocks, as
/// `released`, in this order: the oldest no engine claimed; then the oldest a prefill engine
/// renews but is not reading; never one under a read (its blocks come back when the read ends).
/// Ordinary leases are never evicted; an expired turn met on the way ends as `expired`.
#[test]
fn b1_evicts_unclaimed_turns_oldest_first_then_claimed_never_under_a_read() {
    use kvlease_core::lease_table::Evicted;
    use kvlease_core::wire::Message;
    let mut t = table();
    let ttl = Duration::from_secs(480);
    let lease = t.grant(secs(0.0), 1, "an ordinary lease");
    let reading = t.grant_turn(secs(0.0), ttl, 1, "read");
    let renewed_old = t.grant_turn(secs(0.0), ttl, 1, "renewed, older");
    let renewed = t.grant_turn(secs(0.0), ttl, 1, "renewed");
    let old = t.grant_turn(secs(0.0), ttl, 1, "unclaimed, older");
    let young = t.grant_turn(secs(0.0), ttl, 1, "unclaimed");
    assert_eq!(t.turns(), 5);
    let mut rel = Vec::new();
    t.on_message(D, &Message::Heartbeat { seq: 1, lease_ids: vec![renewed_old, renewed] }, secs(1.0), &mut rel);
    let ticket = t.begin_read(D, reading, None, secs(1.0), &mut rel).expect("read");
    assert!(rel.is_empty());
    let mut order = Vec::new();
    while let Some(e) = t.evict_turn(secs(2.0), &mut rel) {
        order.push(e);
    }
    assert_eq!(
        order,
        [Evicted::Unclaimed(old), Evicted::Unclaimed(young), Evicted::Claimed(renewed_old), Evicted::Claimed(renewed)],
        "unclaimed oldest first, then claimed oldest first"
    );
    assert_eq!(reasons(&rel), [old, young, renewed_old, renewed].map(|id| (id, ReleaseReason::Released)));
    assert!(rel.iter().all(|r| r.payload.is_some()), "blocks of turns nobody reads come back at once");
    assert_eq!((t.live(), t.turns()), (2, 1), "the ordinary lease and the turn under a read stay");
    // P6: the prefill engine renewing an evicted turn learns at once.
    let answer = t.on_message(D, &Message::Heartbeat { seq: 2, lease_ids: vec![renewed] }, secs(2.5), &mut rel);
    assert!(matches!(answer.reply, Some(Message::HeartbeatAck { lost_ids, .. }) if lost_ids == [renewed]));
    // P5: once the read ends the turn may go (its reader would have reported completion first).
    assert!(t.end_read(ticket).is_none());
    rel.clear();
    assert_eq!(t.evict_turn(secs(3.0), &mut rel), Some(Evicted::Claimed(reading)));
    assert_eq!(t.evict_turn(secs(3.0), &mut rel), None, "an ordinary lease is not a cached turn");
    assert_eq!(t.deadline(lease), Some(secs(30.0)));
    // Past its TTL: released as `expired` by the scan, not counted as an eviction.
    let late = t.grant_turn(secs(3.0), Duration::from_secs(10), 1, "late");
    rel.clear();
    assert_eq!(t.evict_turn(secs(14.0), &mut rel), None);
    assert_eq!(reasons(&rel), [(late, ReleaseReason::Expired)]);
    assert_eq!(t.turns(), 0);
}

/// SPEC P1, P2, P4 with times that are not whole milliseconds (the table keeps milliseconds):
/// a deadline is rounded up, never down — the lease is live up to the nanosecond it was given,
/// and `deadline()` is never earlier than asked.
#[test]
fn p1_p2_p4_deadlines_round_up_never_early() {
    let mut t = table(); // L = 30 s, E = 20 s
    let mut rel = Vec::new();
    let mut lost = Vec::new();
    let granted = Nanos(1_000_000_001); // 1 s + 1 ns
    let a = t.grant(granted, 1, "a");
    let want = Nanos(granted.0 + 30_000_000_000);
    assert!(t.deadline(a).expect("live") >= want);
    t.tick(Nanos(want.0 - 1), &mut rel);
    assert!(rel.is_empty(), "live at its deadline - 1 ns");
    let renewed = Nanos(20_999_999_999); // just under 21 s: asks for 40.999999999 s
    assert_eq!(t.renew(D, &[a], renewed, &mut lost, &mut rel), 1);
    let want = Nanos(renewed.0 + 20_000_000_000);
    assert!(t.deadline(a).expect("live") >= want);
    t.tick(Nanos(want.0 - 1), &mut rel);
    assert!(rel.is_empty() && lost.is_empty(), "live at its renewed deadline - 1 ns");
    assert!(t.deadline(a).expect("live").0 < want.0 + 1_000_000, "rounded up by less than a millisecond");
}
