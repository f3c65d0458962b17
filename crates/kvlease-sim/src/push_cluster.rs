//! Push mode's real engines under deterministic simulation (issue #24; SPEC §13): the
//! [`crate::cluster`] simulation — several P and D engines, their schedulers, lease holders,
//! renewers and handshakes, in one thread under virtual time over the `mem` transport — with
//! every engine on `kv_connector: NixlPushConnector`: P's push driver (grant, writes under the
//! source's gate, reaper) and D's (admission, registration, the sink's timer, the write gate).
//!
//! Requests go as `kvlease proxy` sends them, driven by the core's
//! [`kvlease_core::route::Route`]: the first request to a prefiller one leg after the other (P's
//! answer, `transfer_mode: "push"`, teaches the router its coordinates), later ones both legs
//! at once (`SendBoth`, paired by a transfer id per dispatch), a failed prefill leg dropping
//! the decode leg (`CancelDecode`, U9) and releasing P's lease (O4).
//!
//! A seed draws, besides the cluster and its workload: notifications lost, duplicated,
//! reordered (lost registrations, lost completions); writes that fail half-way
//! (`Faults::write_fail`) or are slow; handshakes refused or hanging; partitions; a D killed
//! for good while requests wait for writes; a P killed (mid-write when its writes are slow)
//! and restarted as a new incarnation; a D cut from every P for longer than E (the engines run
//! on one runtime and cannot be paused one by one, so "D paused past E" is modelled as D
//! silenced past E: P hears nothing of it, while D's own timers run on); clients that leave
//! before their answer ends; long forward steps. Some seeds draw no fault at all.
//!
//! Every run keeps the pull cluster's checks (D7, P3, blocks, P4 reclaim — of push leases by
//! their key — and liveness) and push mode's own ([`crate::cluster`]'s `check_push`): a lease
//! counted `transferred` only when its KV was written and used (U5), and in a run with no fault
//! nothing recomputed and no lease expired (U2, U9). vLLM's push bugs are planted in the
//! engines' push driver by [`PlantedBug`] (`PushHeartbeatWrongKey`, `PushAbortNotSent`,
//! `PushFailureOnlyLogged`) and a seed finds each (tests/push_cluster.rs).
//!
//! `kvlease sim --cluster --push-engines --seed N` replays a seed.

use crate::cluster::{Cluster, ClusterCounts, Rng};
use crate::seeded::{Counts, Outcome, Seeded};
use kvlease_core::config::{LeaseConfig, LoadFailurePolicy};
use kvlease_core::pull::PlantedBug;
use kvlease_transport::mem::Faults;
use std::time::Duration;

/// A push cluster drawn from a seed ([`PushCluster::from_seed`]).
#[derive(Debug, Clone)]
pub struct PushCluster(pub Cluster);

/// A push cluster run's counts (the pull cluster's, `transferred` and `left` filled in).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PushClusterCounts(pub ClusterCounts);

impl Counts for PushClusterCounts {
    const FLAG: &'static str = "--cluster --push-engines";
    fn add(&mut self, o: &Self) {
        self.0.add(&o.0);
    }
}

impl Seeded for PushCluster {
    type Planted = PlantedBug;
    type Counts = PushClusterCounts;

    fn from_seed(seed: u64) -> PushCluster {
        let mut r = Rng(seed ^ 0x9005_cafe);
        let lease_secs = [3.0, 6.0, 30.0][r.below(3)];
        let lease = LeaseConfig::with_lease_secs(lease_secs).unwrap_or_default();
        let p_engines = 1 + r.below(3);
        let d_engines = 1 + r.below(3);
        let requests = 8 + r.below(40);
        let rate = 2.0 + r.unit() * 20.0;
        let span = requests as f64 / rate;
        let noisy = r.chance(0.5);
        let faults = Faults {
            seed: r.next(),
            loss: if noisy { r.unit() * 0.1 } else { 0.0 },
            duplicate: if noisy { r.unit() * 0.1 } else { 0.0 },
            delay: (Duration::ZERO, if r.chance(0.5) { r.secs(0.0, 0.05) } else { Duration::ZERO }),
            write_delay: (Duration::ZERO, if noisy && r.chance(0.4) { r.secs(0.0, 2.5) } else { r.secs(0.0, 0.05) }),
            write_fail: if noisy && r.chance(0.5) { r.unit() * 0.2 } else { 0.0 },
            refuse_handshake: if noisy && r.chance(0.3) { r.unit() * 0.3 } else { 0.0 },
            hang_handshake: if noisy && r.chance(0.2) { r.unit() * 0.1 } else { 0.0 },
            unfenced: r.chance(0.3),
            ..Faults::default()
        };
        let mut partitions = Vec::new();
        let mut d_crashes = Vec::new();
        let mut p_restarts = Vec::new();
        if noisy {
            for _ in 0..r.below(3) {
                partitions.push((r.secs(0.0, span + 1.0), r.secs(0.1, lease_secs * 1.5), r.below(p_engines), r.below(d_engines)));
            }
            // D silenced past E: cut from every P at once.
            if r.chance(0.3) {
                let (at, len, dj) = (r.secs(0.0, span + 1.0), lease.extension + r.secs(0.1, 2.0), r.below(d_engines));
                partitions.extend((0..p_engines).map(|pi| (at, len, pi, dj)));
            }
            if d_engines > 1 && r.chance(0.3) {
                d_crashes.push((r.secs(0.0, span + 1.0), r.below(d_engines)));
            }
            if r.chance(0.3) {
                p_restarts.push((r.secs(0.0, span + 1.0), r.below(p_engines), r.secs(0.0, 3.0)));
            }
        }
        let slow = r.chance(0.4);
        let min_timeout = lease.read_budget().as_secs_f64() + 1.0;
        PushCluster(Cluster {
            seed,
            p_engines,
            d_engines,
            requests,
            rate,
            lease_secs,
            policy: if r.chance(0.2) { LoadFailurePolicy::Fail } else { LoadFailurePolicy::Recompute },
            faults,
            partitions,
            d_crashes,
            p_restarts,
            decode_ms: if slow { r.unit() * 400.0 } else { r.unit() * 5.0 },
            max_num_seqs: [2, 4, 8][r.below(3)],
            prefill_ms: r.unit() * 0.5,
            planted: None,
            // Push mode reads no cached turns (SPEC §13): one turn per conversation.
            bidirectional: false,
            turn_ttl: Duration::from_secs(1),
            push_engines: true,
            push_timeout: r.secs(min_timeout.max(4.0), 20.0),
            leave: (if r.chance(0.5) { r.unit() * 0.3 } else { 0.0 }, r.secs(0.05, 3.0)),
        })
    }

    fn plant(&mut self, bug: Option<PlantedBug>) {
        self.0.planted = bug;
    }

    fn run(&self) -> Outcome<PushClusterCounts> {
        let out = self.0.run();
        Outcome {
            seed: out.seed,
            requests: out.requests,
            counts: PushClusterCounts(out.counts),
            violations: out.violations,
            trace: out.trace,
            simulated: out.simulated,
        }
    }
}
