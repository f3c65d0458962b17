//! Heartbeat traffic at scale (issue #12, part 4): many P and D engines, only their lease
//! machinery, under virtual time.
//!
//! What crosses the wire for lease renewal is decided entirely by the protocol core: D's
//! [`Renewer`] (one batched heartbeat per P engine per interval, split at `max_notif_bytes`) and
//! P's [`LeaseTable`] (the acknowledgement and its lost ids), through the [`wire`] codec. So this
//! runs those, and nothing else: one `Renewer` per D and one `LeaseTable` per P, exchanging real
//! encoded messages in process, delivered at once, every message counted by kind and by P. The
//! engines' schedulers, KV and transport are left out, so 64 P × 256 D at 10^5 live leases per P
//! (6.4 million) runs in seconds instead of not at all.
//!
//! Traffic: each P holds `live_per_p` leases from the start, each granted for a request routed to
//! a D (at random, or in turn); a lease lives `hold` (its request waits on D, then D reads it),
//! then D stops tracking it (read done) and P releases it, and a new grant replaces it at once, so
//! the live count stays exact. The first `hold` of leases end evenly spread, so churn is steady
//! from the first second.
//!
//! The baseline is vLLM's heartbeat for the same traffic: in vLLM's NixlConnector (the lease
//! renewal of PR #38027 as reviewed; PR #41383 merged it, still one send per engine), D sends
//! each remote P engine, every heartbeat interval, one notification `"HB:" + ",".join(req_ids)`
//! naming every request it tracks toward that engine, unsplit; P answers nothing. Request ids here are vLLM-shaped (`cmpl-<32 hex>-0`, 39 bytes), the same ids
//! kvlease's renewer tracks, and vLLM's interval is taken to be kvlease's I (5 s at the default
//! 30 s lease, as vLLM's ~5 s).
//!
//! [`wire`]: kvlease_core::wire

use crate::cluster::Rng;
use kvlease_core::config::LeaseConfig;
use kvlease_core::lease_table::{Holder, LeaseTable};
use kvlease_core::renewer::{Action, Handshook, Remote, Renewer, SendKind, Untrack};
use kvlease_core::wire::Message;
use kvlease_core::{LeaseId, Nanos};
use std::collections::VecDeque;
use std::time::Duration;

/// How a new lease's request picks its D.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    Random,
    /// In turn per P: P's k-th grant goes to D k mod decoders.
    RoundRobin,
}

/// The cluster and its traffic.
#[derive(Debug, Clone)]
pub struct Scale {
    pub seed: u64,
    pub prefills: usize,
    pub decoders: usize,
    /// Live leases per P, held exactly at every step.
    pub live_per_p: usize,
    pub lease: LeaseConfig,
    /// How long a lease lives before D reads it (done) and P releases it; `None`: no churn.
    pub hold: Option<Duration>,
    /// Measured after a warm-up of 2 I; whole intervals are best.
    pub window: Duration,
    pub routing: Routing,
}

impl Scale {
    /// `prefills` × `decoders` at `live_per_p`, the default lease (L = 30 s, I = 5 s, 64 KiB
    /// notifications), leases held 30 s, 60 s measured.
    pub fn new(prefills: usize, decoders: usize, live_per_p: usize) -> Scale {
        Scale {
            seed: 1,
            prefills,
            decoders,
            live_per_p,
            lease: LeaseConfig::with_lease_secs(30.0).unwrap_or_else(|e| panic!("the default lease is valid: {e}")),
            hold: Some(Duration::from_secs(30)),
            window: Duration::from_secs(60),
            routing: Routing::Random,
        }
    }
}

/// Messages and their payload bytes (the notification as sent; no transport framing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flow {
    pub msgs: u64,
    pub bytes: u64,
}

impl Flow {
    fn add(&mut self, bytes: usize) {
        self.msgs += 1;
        self.bytes += bytes as u64;
    }
}

/// What one P engine received and sent within the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerP {
    /// kvlease heartbeats received (periodic rounds and read renewals).
    pub heartbeats: Flow,
    /// kvlease `HeartbeatAck`s sent (with any lost ids: the `LeaseLost` answer).
    pub acks: Flow,
    /// Everything else kvlease exchanged with this P about leases: releases, clock probes and
    /// their answers, `LeaseLost`.
    pub other: Flow,
    /// vLLM's text heartbeats this P would have received for the same traffic.
    pub vllm: Flow,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ScaleReport {
    pub window: Duration,
    pub per_p: Vec<PerP>,
    /// Leases D learned were lost (none should be: every lease is renewed in time).
    pub lost: u64,
    /// Live leases per P, the least and most seen at any step.
    pub live_min: usize,
    pub live_max: usize,
    pub grants: u64,
}

impl ScaleReport {
    /// The mean over P engines of `f`, per second of the window.
    pub fn per_sec(&self, f: impl Fn(&PerP) -> u64) -> f64 {
        let total: u64 = self.per_p.iter().map(f).sum();
        total as f64 / self.per_p.len().max(1) as f64 / self.window.as_secs_f64()
    }

    /// The most any P engine saw of `f`, per second of the window.
    pub fn max_per_sec(&self, f: impl Fn(&PerP) -> u64) -> f64 {
        self.per_p.iter().map(f).max().unwrap_or(0) as f64 / self.window.as_secs_f64()
    }
}

/// vLLM's request id for request `n`: `cmpl-<32 hex>-0`.
pub fn request_id(n: u64) -> String {
    let x = u128::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
    format!("cmpl-{x:032x}-0")
}

/// Bytes of vLLM's `"HB:" + ",".join(ids)` for `n` ids of `id_len` bytes each.
pub fn vllm_heartbeat_bytes(n: usize, id_len: usize) -> usize {
    3 + n * id_len + n.saturating_sub(1)
}

const ID_LEN: usize = 39;

struct Lease {
    end: Nanos,
    id: LeaseId,
    d: u32,
    request: u64,
}

struct P {
    table: LeaseTable<()>,
    /// Holder of each D (SPEC S5).
    holders: Vec<Holder>,
    remote: Remote,
    /// Live leases, in order of their end.
    live: VecDeque<Lease>,
    grants: u64,
}

fn p_index(engine_id: &str) -> Option<usize> {
    engine_id.strip_prefix('p')?.parse().ok()
}

/// Runs the cluster for 2 I of warm-up and the window; deterministic for a seed.
pub fn run(sc: &Scale) -> ScaleReport {
    let cfg = &sc.lease;
    let interval = cfg.heartbeat_interval;
    let dt = (interval / 50).clamp(Duration::from_millis(1), Duration::from_millis(100));
    let warm = Nanos::ZERO + interval * 2;
    let end = warm + sc.window;
    let in_window = |t: Nanos| t >= warm && t < end;
    let mut rng = Rng(sc.seed ^ 0x0048_4253_4341_4c45);
    let mut report =
        ScaleReport { window: sc.window, per_p: vec![PerP::default(); sc.prefills], lost: 0, live_min: usize::MAX, live_max: 0, grants: 0 };
    let mut ds: Vec<Renewer> = (0..sc.decoders).map(|_| Renewer::new(cfg)).collect();
    // Requests each D tracks toward each P, for vLLM's heartbeat: counts[d * prefills + p].
    let mut counts = vec![0u32; sc.decoders * sc.prefills];
    let mut next_request = 0u64;
    let mut ps: Vec<P> = (0..sc.prefills)
        .map(|p| {
            let mut table = LeaseTable::with_capacity(cfg, sc.live_per_p);
            let holders = (0..sc.decoders).map(|d| table.holder(&format!("d{d}"))).collect();
            let remote = Remote { engine_id: format!("p{p}"), host: "10.0.0.1".into(), port: 5600 + p as u16, incarnation: 1 };
            P { table, holders, remote, live: VecDeque::with_capacity(sc.live_per_p), grants: 0 }
        })
        .collect();

    let grant = |p: &mut P, pi: usize, now: Nanos, end: Nanos, ds: &mut [Renewer], counts: &mut [u32], rng: &mut Rng, next: &mut u64| {
        let id = p.table.grant(now, 1, ());
        let d = match sc.routing {
            Routing::Random => rng.below(sc.decoders),
            Routing::RoundRobin => (p.grants % sc.decoders as u64) as usize,
        };
        p.grants += 1;
        let request = *next;
        *next += 1;
        ds[d].track(&request_id(request), &p.remote, id, now);
        counts[d * sc.prefills + pi] += 1;
        p.live.push_back(Lease { end, id, d: d as u32, request });
    };

    // The first leases end evenly over the first `hold`: steady churn from the start.
    for (pi, p) in ps.iter_mut().enumerate() {
        for i in 0..sc.live_per_p {
            let until = match sc.hold {
                Some(h) => Nanos::ZERO + h.mul_f64((i + 1) as f64 / sc.live_per_p as f64),
                None => Nanos::MAX,
            };
            grant(p, pi, Nanos::ZERO, until, &mut ds, &mut counts, &mut rng, &mut next_request);
        }
    }

    let mut actions = Vec::new();
    let mut released = Vec::new();
    let mut lost_ids = Vec::new();
    let mut next_vllm = Nanos::ZERO;
    let mut now = Nanos::ZERO;
    while now < end {
        // Churn: leases read (D stops tracking, P releases) and as many new grants.
        for (pi, p) in ps.iter_mut().enumerate() {
            while p.live.front().is_some_and(|l| l.end <= now) {
                let Some(l) = p.live.pop_front() else { break };
                ds[l.d as usize].untrack(&request_id(l.request), Untrack::Transferred);
                counts[l.d as usize * sc.prefills + pi] -= 1;
                p.table.release(p.holders[l.d as usize], &[l.id], now, &mut lost_ids, &mut released);
                let until = now + sc.hold.unwrap_or(Duration::MAX);
                grant(p, pi, now, until, &mut ds, &mut counts, &mut rng, &mut next_request);
            }
            p.table.tick(now, &mut released);
            report.live_min = report.live_min.min(p.table.live());
            report.live_max = report.live_max.max(p.table.live());
        }
        report.lost += lost_ids.len() as u64;
        lost_ids.clear();
        released.clear();
        // vLLM: every interval, one text heartbeat per (D, P) with requests tracked.
        if now >= next_vllm {
            next_vllm = now + interval;
            if in_window(now) {
                for d in 0..sc.decoders {
                    for (pi, per_p) in report.per_p.iter_mut().enumerate() {
                        let n = counts[d * sc.prefills + pi] as usize;
                        if n > 0 {
                            per_p.vllm.add(vllm_heartbeat_bytes(n, ID_LEN));
                        }
                    }
                }
            }
        }
        // kvlease: every renewer polled when due; its messages delivered and answered at once.
        for (d, renewer) in ds.iter_mut().enumerate() {
            while renewer.poll_timeout().is_some_and(|t| t <= now) {
                renewer.poll(now, &mut actions);
                let mut handshook = false;
                for action in actions.drain(..) {
                    match action {
                        Action::Handshake { engine_id, .. } => {
                            let agents = vec![format!("{engine_id}-0")];
                            renewer.handshake_done(&engine_id, Ok(Handshook { incarnation: 1, agents }), now);
                            handshook = true;
                        }
                        Action::Send { engine_id, bytes, kind } => {
                            let Some(pi) = p_index(&engine_id) else { continue };
                            let Ok(msg) = Message::decode(&bytes) else { panic!("the renewer sent bytes that do not decode") };
                            let p = &mut ps[pi];
                            let answer = p.table.on_message(p.holders[d], &msg, now, &mut released);
                            released.clear();
                            let counted = in_window(now);
                            let per_p = &mut report.per_p[pi];
                            if counted {
                                match kind {
                                    SendKind::Heartbeat { .. } | SendKind::ReadRenewal => per_p.heartbeats.add(bytes.len()),
                                    SendKind::Release | SendKind::ClockProbe => per_p.other.add(bytes.len()),
                                }
                            }
                            if let Some(reply) = answer.reply {
                                let out = reply.encode();
                                if counted {
                                    match reply {
                                        Message::HeartbeatAck { .. } => per_p.acks.add(out.len()),
                                        _ => per_p.other.add(out.len()),
                                    }
                                }
                                renewer.on_message(&engine_id, &reply, now);
                            }
                        }
                        Action::Lost { .. } => report.lost += 1,
                        // Every handshake here succeeds: nothing goes over a side channel.
                        Action::Forget { .. } | Action::ReleaseOverSideChannel(_) | Action::DuplicateEngine { .. } => {}
                    }
                }
                if !handshook {
                    break;
                }
            }
        }
        now = now + dt;
    }
    report.grants = ps.iter().map(|p| p.grants).sum();
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_heartbeat_bytes_is_the_joined_string() {
        for n in [1, 2, 7] {
            let ids: Vec<String> = (0..n as u64).map(request_id).collect();
            assert!(ids.iter().all(|i| i.len() == ID_LEN));
            assert_eq!(format!("HB:{}", ids.join(",")).len(), vllm_heartbeat_bytes(n, ID_LEN));
        }
    }
}
