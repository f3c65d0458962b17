//! The metrics of SPEC §11, rendered as Prometheus text for `GET /metrics`.
//!
//! Names are part of the contract. Counters and gauges are atomics the engine updates where the
//! event happens; histograms have fixed buckets.

use kvlease_core::lease_table::ReleaseReason;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// The `reason` labels of `kvlease_messages_rejected_total`: SPEC §11's three, plus
/// `unauthenticated` (a peer that failed the proof of the cluster secret, SPEC S2) and
/// `overloaded` (a handshake refused because too many were pending).
pub const REJECT_REASONS: [&str; 5] = ["malformed", "unknown_agent", "oversized", "unauthenticated", "overloaded"];

/// The `reason` labels of `kvlease_handshakes_refused_total`: an operator's mistake between two
/// engines, named in both logs (SPEC O4): a model geometry that differs (`--num-layers`, ...),
/// two live engines with one `--engine-id`, or another refusal of a peer that holds the secret.
pub const REFUSED_REASONS: [&str; 3] = ["geometry", "duplicate_engine_id", "other"];

#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramState>,
}

#[derive(Debug)]
struct HistogramState {
    /// Cumulative counts per bound, as Prometheus buckets are.
    buckets: Vec<u64>,
    sum: f64,
    count: u64,
    max: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, inner: Mutex::new(HistogramState { buckets: vec![0; bounds.len()], sum: 0.0, count: 0, max: 0.0 }) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, HistogramState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn observe(&self, v: f64) {
        let mut g = self.state();
        for (i, b) in self.bounds.iter().enumerate() {
            if v <= *b {
                g.buckets[i] += 1;
            }
        }
        g.sum += v;
        g.count += 1;
        g.max = g.max.max(v);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.state().count
    }

    /// The largest observation so far (0 when none).
    pub fn max(&self) -> f64 {
        self.state().max
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let g = self.state();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&g.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", g.count, g.sum, g.count);
    }
}

/// Every metric of one engine.
#[derive(Debug)]
pub struct Metrics {
    pub leases_active: AtomicI64,
    pub leased_blocks: AtomicI64,
    pub leases_granted: AtomicU64,
    pub lease_renewals: AtomicU64,
    pub leases_released: [AtomicU64; 4],
    pub lease_lost: AtomicU64,
    /// Of those, the ones P said had ended (`LeaseLost`, or ended under the read): KV freed
    /// under a request that still wanted it.
    pub lease_ended_by_prefill: AtomicU64,
    pub heartbeats_sent: AtomicU64,
    pub heartbeats_received: AtomicU64,
    pub heartbeat_lateness: Histogram,
    pub lease_hold: Histogram,
    pub messages_rejected: [AtomicU64; REJECT_REASONS.len()],
    pub kv_blocks_free: AtomicI64,
    pub kv_blocks_total: AtomicI64,
    pub requests_waiting: AtomicI64,
    pub requests_running: AtomicI64,
    pub recomputed_requests: AtomicU64,
    /// P: reads the transfer agent refused because the lease was not live (SPEC P5).
    pub reads_refused: AtomicU64,
    /// D (multi-turn): finished turns kept under a cached-turn lease (SPEC B1).
    pub turns_kept: AtomicU64,
    /// D (multi-turn): cached turns ended early because new requests needed their blocks.
    pub turns_evicted: AtomicU64,
    /// P (multi-turn): prompt tokens whose KV was read back from a decoder's cached turn (B4).
    pub turn_tokens_read: AtomicU64,
    /// P (multi-turn): cached turns named by a request but not read: recomputed (B2, B4).
    pub turns_recomputed: AtomicU64,
    /// Prompt tokens prefilled on this engine.
    pub prefill_tokens: AtomicU64,
    /// Handshakes refused, or a peer's params refused, for an operator's mistake (SPEC O4).
    pub handshakes_refused: [AtomicU64; REFUSED_REASONS.len()],
    /// D: leases released over a P engine's side channel, no transfer link being there to carry
    /// the release (SPEC O4).
    pub side_channel_releases: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            leases_active: AtomicI64::new(0),
            leased_blocks: AtomicI64::new(0),
            leases_granted: AtomicU64::new(0),
            lease_renewals: AtomicU64::new(0),
            leases_released: Default::default(),
            lease_lost: AtomicU64::new(0),
            lease_ended_by_prefill: AtomicU64::new(0),
            heartbeats_sent: AtomicU64::new(0),
            heartbeats_received: AtomicU64::new(0),
            heartbeat_lateness: Histogram::new(&[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            lease_hold: Histogram::new(&[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0]),
            messages_rejected: Default::default(),
            kv_blocks_free: AtomicI64::new(0),
            kv_blocks_total: AtomicI64::new(0),
            requests_waiting: AtomicI64::new(0),
            requests_running: AtomicI64::new(0),
            recomputed_requests: AtomicU64::new(0),
            reads_refused: AtomicU64::new(0),
            turns_kept: AtomicU64::new(0),
            turns_evicted: AtomicU64::new(0),
            turn_tokens_read: AtomicU64::new(0),
            turns_recomputed: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            handshakes_refused: Default::default(),
            side_channel_releases: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn released(&self, reason: ReleaseReason) -> &AtomicU64 {
        &self.leases_released[reason as usize]
    }

    pub fn rejected(&self, reason: &str) {
        match REJECT_REASONS.iter().position(|r| *r == reason) {
            Some(i) => self.messages_rejected[i].fetch_add(1, Relaxed),
            None => {
                debug_assert!(false, "unknown reject reason {reason:?}");
                tracing::warn!("a message was rejected for an unlisted reason {reason:?}");
                0
            }
        };
    }

    /// Counts a refused handshake (or peer) under one of [`REFUSED_REASONS`] (others: `other`).
    pub fn handshake_refused(&self, reason: &str) {
        let i = REFUSED_REASONS.iter().position(|r| *r == reason).unwrap_or(REFUSED_REASONS.len() - 1);
        self.handshakes_refused[i].fetch_add(1, Relaxed);
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        one("kvlease_leases_active", "gauge", "Live leases on this engine.", self.leases_active.load(Relaxed).to_string());
        one("kvlease_leased_blocks", "gauge", "KV blocks pinned for remote decoders.", self.leased_blocks.load(Relaxed).to_string());
        one("kvlease_leases_granted_total", "counter", "Leases granted.", self.leases_granted.load(Relaxed).to_string());
        one(
            "kvlease_lease_renewals_total",
            "counter",
            "Leases renewed (one per lease per heartbeat).",
            self.lease_renewals.load(Relaxed).to_string(),
        );
        one(
            "kvlease_lease_lost_total",
            "counter",
            "Leases found lost before or during a read (D).",
            self.lease_lost.load(Relaxed).to_string(),
        );
        one(
            "kvlease_lease_ended_by_prefill_total",
            "counter",
            "Of the leases found lost, those the prefill engine said had ended (D): KV freed under a waiting request.",
            self.lease_ended_by_prefill.load(Relaxed).to_string(),
        );
        one("kvlease_heartbeats_sent_total", "counter", "Heartbeat messages sent.", self.heartbeats_sent.load(Relaxed).to_string());
        one(
            "kvlease_heartbeats_received_total",
            "counter",
            "Heartbeat messages received.",
            self.heartbeats_received.load(Relaxed).to_string(),
        );
        one("kvlease_kv_blocks_free", "gauge", "Free KV blocks.", self.kv_blocks_free.load(Relaxed).to_string());
        one("kvlease_kv_blocks_total", "gauge", "KV blocks.", self.kv_blocks_total.load(Relaxed).to_string());
        one("kvlease_requests_waiting", "gauge", "Requests in the waiting queue.", self.requests_waiting.load(Relaxed).to_string());
        one("kvlease_requests_running", "gauge", "Requests running.", self.requests_running.load(Relaxed).to_string());
        one(
            "kvlease_recomputed_requests_total",
            "counter",
            "Requests whose KV was recomputed locally after a lost lease or params of another prompt (D).",
            self.recomputed_requests.load(Relaxed).to_string(),
        );
        one(
            "kvlease_reads_refused_total",
            "counter",
            "Reads the transfer agent refused: the lease was not live, not the reader's, or not of those blocks (P).",
            self.reads_refused.load(Relaxed).to_string(),
        );
        one(
            "kvlease_turns_kept_total",
            "counter",
            "Finished turns kept under a cached-turn lease for the next turn's prefill (D, bidirectional). They count among the leases above.",
            self.turns_kept.load(Relaxed).to_string(),
        );
        one(
            "kvlease_turns_evicted_total",
            "counter",
            "Cached turns no prefill engine had claimed, ended early (as `released`) because new requests needed their blocks (D, bidirectional); the conversation's next turn is recomputed.",
            self.turns_evicted.load(Relaxed).to_string(),
        );
        one(
            "kvlease_turn_tokens_read_total",
            "counter",
            "Prompt tokens whose KV was read back from a decoder's cached turn instead of prefilled (P, bidirectional).",
            self.turn_tokens_read.load(Relaxed).to_string(),
        );
        one(
            "kvlease_turns_recomputed_total",
            "counter",
            "Cached turns a request named but that were recomputed: not a prefix, too short, expiring or lost (P, bidirectional).",
            self.turns_recomputed.load(Relaxed).to_string(),
        );
        one("kvlease_prefill_tokens_total", "counter", "Prompt tokens prefilled here.", self.prefill_tokens.load(Relaxed).to_string());
        let _ =
            writeln!(out, "# HELP kvlease_leases_released_total Leases released, by reason.\n# TYPE kvlease_leases_released_total counter");
        for r in ReleaseReason::ALL {
            let _ = writeln!(out, "kvlease_leases_released_total{{reason=\"{}\"}} {}", r.as_str(), self.released(r).load(Relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP kvlease_messages_rejected_total Messages dropped, by reason.\n# TYPE kvlease_messages_rejected_total counter"
        );
        for (i, r) in REJECT_REASONS.iter().enumerate() {
            let _ = writeln!(out, "kvlease_messages_rejected_total{{reason=\"{r}\"}} {}", self.messages_rejected[i].load(Relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP kvlease_handshakes_refused_total Handshakes (or a peer's params) refused for an operator's mistake, by reason.\n# TYPE kvlease_handshakes_refused_total counter"
        );
        for (i, r) in REFUSED_REASONS.iter().enumerate() {
            let _ = writeln!(out, "kvlease_handshakes_refused_total{{reason=\"{r}\"}} {}", self.handshakes_refused[i].load(Relaxed));
        }
        one_counter(
            &mut out,
            "kvlease_side_channel_releases_total",
            "Leases released over a prefill engine's side channel, with no transfer link to carry the release (D).",
            self.side_channel_releases.load(Relaxed),
        );
        self.heartbeat_lateness.render(&mut out, "kvlease_heartbeat_lateness_seconds", "Heartbeat send time minus due time (D).");
        self.lease_hold.render(&mut out, "kvlease_lease_hold_seconds", "Lease grant to release (P).");
        out
    }
}

fn one_counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC §11: every metric name of the contract is rendered.
    #[test]
    fn every_contract_metric_is_rendered() {
        let m = Metrics::default();
        m.released(ReleaseReason::Expired).fetch_add(2, Relaxed);
        m.rejected("oversized");
        m.lease_hold.observe(0.2);
        let text = m.render();
        for name in [
            "kvlease_leases_active ",
            "kvlease_leased_blocks ",
            "kvlease_leases_granted_total ",
            "kvlease_lease_renewals_total ",
            "kvlease_leases_released_total{reason=\"transferred\"} 0",
            "kvlease_leases_released_total{reason=\"expired\"} 2",
            "kvlease_leases_released_total{reason=\"released\"}",
            "kvlease_leases_released_total{reason=\"shutdown\"}",
            "kvlease_lease_lost_total ",
            "kvlease_heartbeats_sent_total ",
            "kvlease_heartbeats_received_total ",
            "kvlease_heartbeat_lateness_seconds_bucket",
            "kvlease_lease_hold_seconds_count 1",
            "kvlease_messages_rejected_total{reason=\"oversized\"} 1",
            "kvlease_messages_rejected_total{reason=\"unknown_agent\"} 0",
            "kvlease_messages_rejected_total{reason=\"malformed\"} 0",
            "kvlease_kv_blocks_free ",
            "kvlease_kv_blocks_total ",
            "kvlease_requests_waiting ",
            "kvlease_requests_running ",
            "kvlease_recomputed_requests_total ",
            "kvlease_reads_refused_total ",
            "kvlease_messages_rejected_total{reason=\"unauthenticated\"} 0",
            "kvlease_messages_rejected_total{reason=\"overloaded\"} 0",
            "kvlease_handshakes_refused_total{reason=\"geometry\"} 0",
            "kvlease_handshakes_refused_total{reason=\"duplicate_engine_id\"} 0",
            "kvlease_side_channel_releases_total 0",
        ] {
            assert!(text.contains(name), "missing {name}");
        }
    }
}
