//! The metrics of SPEC §11, exposed through `prometheus-client` for `GET /metrics`.
//!
//! Names are part of the contract. Counters and gauges are `prometheus-client`'s atomics, bumped
//! where the event happens (no lock, no allocation); a labelled counter's children are created
//! once, here, so the hot path holds a plain counter. The server and the proxy register these,
//! and their own, into one [`Registry`] per process and answer with [`exposition`].

use kvlease_core::lease_table::ReleaseReason;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
pub use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The `Content-Type` of [`exposition`]'s text: OpenMetrics, which Prometheus asks for first.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The whole of `registry`, OpenMetrics text ending in `# EOF`.
pub fn exposition(registry: &Registry) -> String {
    let mut out = String::with_capacity(8192);
    // Writing into a String cannot fail; a metric that could not encode would be a bug of ours.
    if let Err(e) = encode(&mut out, registry) {
        tracing::error!("metrics could not be encoded: {e}");
    }
    out
}

/// A label set of one pair, as the labelled counters here have.
pub type OneLabel = [(&'static str, &'static str); 1];

/// A counter family with one label whose values are known up front: the family (to register) and
/// one child per value, in `values`' order (to count into without a lock).
pub fn labelled_counters<const N: usize>(key: &'static str, values: [&'static str; N]) -> (Family<OneLabel, Counter>, [Counter; N]) {
    let family = Family::<OneLabel, Counter>::default();
    let children = values.map(|v| family.get_or_create_owned(&[(key, v)]));
    (family, children)
}

/// The `reason` labels of `kvlease_messages_rejected_total`: SPEC §11's three, plus
/// `unauthenticated` (a peer that failed the proof of the cluster secret, SPEC S2) and
/// `overloaded` (a handshake refused because too many were pending).
pub const REJECT_REASONS: [&str; 5] = ["malformed", "unknown_agent", "oversized", "unauthenticated", "overloaded"];

/// The `reason` labels of `kvlease_handshakes_refused_total`: an operator's mistake between two
/// engines, named in both logs (SPEC O4): a model geometry that differs (`--num-layers`, ...),
/// two live engines with one `--engine-id`, a certificate (SPEC S6: of another CA, or of
/// another engine than the one claimed), or another refusal of a peer that holds the secret.
/// `mode`: a push engine and a pull engine (SPEC §13).
pub const REFUSED_REASONS: [&str; 5] = ["geometry", "duplicate_engine_id", "certificate", "mode", "other"];

/// A histogram with fixed buckets, and the largest observation (which tests bound).
#[derive(Debug)]
pub struct Histogram {
    inner: prometheus_client::metrics::histogram::Histogram,
    /// The bits of the largest observation; observations are non-negative, so the bits order as
    /// the values do.
    max: AtomicU64,
    /// Observations so far (the crate's own count is for its tests only).
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            inner: prometheus_client::metrics::histogram::Histogram::new(bounds.iter().copied()),
            max: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        let v = v.max(0.0);
        self.inner.observe(v);
        self.max.fetch_max(v.to_bits(), Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The largest observation so far (0 when none).
    pub fn max(&self) -> f64 {
        f64::from_bits(self.max.load(Relaxed))
    }
}

/// Every metric of one engine.
#[derive(Debug)]
pub struct Metrics {
    pub leases_active: Gauge,
    pub leased_blocks: Gauge,
    pub leases_granted: Counter,
    pub lease_renewals: Counter,
    pub leases_released: [Counter; ReleaseReason::ALL.len()],
    pub lease_lost: Counter,
    /// Of those, the ones P said had ended (`LeaseLost`, or ended under the read): KV freed
    /// under a request that still wanted it.
    pub lease_ended_by_prefill: Counter,
    pub heartbeats_sent: Counter,
    pub heartbeats_received: Counter,
    pub heartbeat_lateness: Histogram,
    pub lease_hold: Histogram,
    /// D: a request's KV reads, posted to landed (the P→D transfer), when every one landed.
    pub read_time: Histogram,
    pub messages_rejected: [Counter; REJECT_REASONS.len()],
    pub kv_blocks_free: Gauge,
    pub kv_blocks_total: Gauge,
    pub requests_waiting: Gauge,
    pub requests_running: Gauge,
    pub recomputed_requests: Counter,
    /// P: reads the transfer agent refused because the lease was not live (SPEC P5).
    pub reads_refused: Counter,
    /// D (push mode): writes the transfer agent refused: no live registration of those blocks
    /// for that prompt from that engine (SPEC U4, U8, U11).
    pub writes_refused: Counter,
    /// P (push mode): blocks written into D's registration while the prefill still computed the
    /// rest (SPEC U4, early writes).
    pub push_early_blocks: Counter,
    /// D (multi-turn): finished turns kept under a cached-turn lease (SPEC B1).
    pub turns_kept: Counter,
    /// D (multi-turn): cached turns ended early because new requests needed their blocks.
    pub turns_evicted: Counter,
    /// P (multi-turn): prompt tokens whose KV was read back from a decoder's cached turn (B4).
    pub turn_tokens_read: Counter,
    /// P (multi-turn): cached turns named by a request but not read: recomputed (B2, B4).
    pub turns_recomputed: Counter,
    /// Prompt tokens prefilled on this engine.
    pub prefill_tokens: Counter,
    /// Handshakes refused, or a peer's params refused, for an operator's mistake (SPEC O4).
    pub handshakes_refused: [Counter; REFUSED_REASONS.len()],
    /// D: leases released over a P engine's side channel, no transfer link being there to carry
    /// the release (SPEC O4).
    pub side_channel_releases: Counter,
    released_family: Family<OneLabel, Counter>,
    rejected_family: Family<OneLabel, Counter>,
    refused_family: Family<OneLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let (released_family, leases_released) = labelled_counters("reason", ReleaseReason::ALL.map(ReleaseReason::as_str));
        let (rejected_family, messages_rejected) = labelled_counters("reason", REJECT_REASONS);
        let (refused_family, handshakes_refused) = labelled_counters("reason", REFUSED_REASONS);
        Metrics {
            leases_active: Gauge::default(),
            leased_blocks: Gauge::default(),
            leases_granted: Counter::default(),
            lease_renewals: Counter::default(),
            leases_released,
            lease_lost: Counter::default(),
            lease_ended_by_prefill: Counter::default(),
            heartbeats_sent: Counter::default(),
            heartbeats_received: Counter::default(),
            heartbeat_lateness: Histogram::new(&[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
            lease_hold: Histogram::new(&[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0]),
            read_time: Histogram::new(&[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0]),
            messages_rejected,
            kv_blocks_free: Gauge::default(),
            kv_blocks_total: Gauge::default(),
            requests_waiting: Gauge::default(),
            requests_running: Gauge::default(),
            recomputed_requests: Counter::default(),
            reads_refused: Counter::default(),
            writes_refused: Counter::default(),
            push_early_blocks: Counter::default(),
            turns_kept: Counter::default(),
            turns_evicted: Counter::default(),
            turn_tokens_read: Counter::default(),
            turns_recomputed: Counter::default(),
            prefill_tokens: Counter::default(),
            handshakes_refused,
            side_channel_releases: Counter::default(),
            released_family,
            rejected_family,
            refused_family,
        }
    }
}

impl Metrics {
    pub fn released(&self, reason: ReleaseReason) -> &Counter {
        &self.leases_released[reason as usize]
    }

    pub fn rejected(&self, reason: &str) {
        match REJECT_REASONS.iter().position(|r| *r == reason) {
            Some(i) => {
                self.messages_rejected[i].inc();
            }
            None => {
                debug_assert!(false, "unknown reject reason {reason:?}");
                tracing::warn!("a message was rejected for an unlisted reason {reason:?}");
            }
        }
    }

    /// Counts a refused handshake (or peer) under one of [`REFUSED_REASONS`] (others: `other`).
    pub fn handshake_refused(&self, reason: &str) {
        let i = REFUSED_REASONS.iter().position(|r| *r == reason).unwrap_or(REFUSED_REASONS.len() - 1);
        self.handshakes_refused[i].inc();
    }

    /// Registers every metric of the engine into `registry` (they stay shared: the engine's
    /// counting shows in the registry). Counters are named without `_total`, which the
    /// exposition appends; help texts without their final full stop, which it adds.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry;
        r.register("kvlease_leases_active", "Live leases on this engine", self.leases_active.clone());
        r.register("kvlease_leased_blocks", "KV blocks pinned for remote decoders", self.leased_blocks.clone());
        r.register("kvlease_leases_granted", "Leases granted", self.leases_granted.clone());
        r.register("kvlease_lease_renewals", "Leases renewed (one per lease per heartbeat)", self.lease_renewals.clone());
        r.register("kvlease_lease_lost", "Leases found lost before or during a read (D)", self.lease_lost.clone());
        r.register(
            "kvlease_lease_ended_by_prefill",
            "Of the leases found lost, those the prefill engine said had ended (D): KV freed under a waiting request",
            self.lease_ended_by_prefill.clone(),
        );
        r.register("kvlease_heartbeats_sent", "Heartbeat messages sent", self.heartbeats_sent.clone());
        r.register("kvlease_heartbeats_received", "Heartbeat messages received", self.heartbeats_received.clone());
        r.register("kvlease_kv_blocks_free", "Free KV blocks", self.kv_blocks_free.clone());
        r.register("kvlease_kv_blocks_total", "KV blocks", self.kv_blocks_total.clone());
        r.register("kvlease_requests_waiting", "Requests in the waiting queue", self.requests_waiting.clone());
        r.register("kvlease_requests_running", "Requests running", self.requests_running.clone());
        r.register(
            "kvlease_recomputed_requests",
            "Requests whose KV was recomputed locally after a lost lease or params of another prompt (D)",
            self.recomputed_requests.clone(),
        );
        r.register(
            "kvlease_reads_refused",
            "Reads the transfer agent refused: the lease was not live, not the reader's, or not of those blocks (P)",
            self.reads_refused.clone(),
        );
        r.register(
            "kvlease_writes_refused",
            "Push mode: writes the transfer agent refused: no live registration of those blocks for that prompt from that engine (D)",
            self.writes_refused.clone(),
        );
        r.register(
            "kvlease_push_early_blocks",
            "Push mode: blocks written into the decoder's registration while the prefill still computed the rest (P)",
            self.push_early_blocks.clone(),
        );
        r.register(
            "kvlease_turns_kept",
            "Finished turns kept under a cached-turn lease for the next turn's prefill (D, bidirectional). They count among the leases above",
            self.turns_kept.clone(),
        );
        r.register(
            "kvlease_turns_evicted",
            "Cached turns no prefill engine had claimed, ended early (as `released`) because new requests needed their blocks (D, bidirectional); the conversation's next turn is recomputed",
            self.turns_evicted.clone(),
        );
        r.register(
            "kvlease_turn_tokens_read",
            "Prompt tokens whose KV was read back from a decoder's cached turn instead of prefilled (P, bidirectional)",
            self.turn_tokens_read.clone(),
        );
        r.register(
            "kvlease_turns_recomputed",
            "Cached turns a request named but that were recomputed: not a prefix, too short, expiring or lost (P, bidirectional)",
            self.turns_recomputed.clone(),
        );
        r.register("kvlease_prefill_tokens", "Prompt tokens prefilled here", self.prefill_tokens.clone());
        r.register("kvlease_leases_released", "Leases released, by reason", self.released_family.clone());
        r.register("kvlease_messages_rejected", "Messages dropped, by reason", self.rejected_family.clone());
        r.register(
            "kvlease_handshakes_refused",
            "Handshakes (or a peer's params) refused for an operator's mistake, by reason",
            self.refused_family.clone(),
        );
        r.register(
            "kvlease_side_channel_releases",
            "Leases released over a prefill engine's side channel, with no transfer link to carry the release (D)",
            self.side_channel_releases.clone(),
        );
        r.register("kvlease_heartbeat_lateness_seconds", "Heartbeat send time minus due time (D)", self.heartbeat_lateness.inner.clone());
        r.register("kvlease_lease_hold_seconds", "Lease grant to release (P)", self.lease_hold.inner.clone());
        r.register(
            "kvlease_read_seconds",
            "A request's KV reads, posted to landed: the P-to-D transfer, when every read landed (D)",
            self.read_time.inner.clone(),
        );
    }

    /// The engine's metrics alone, as [`exposition`] renders them.
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        self.register(&mut registry);
        exposition(&registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC §11: every metric name of the contract is rendered.
    #[test]
    fn every_contract_metric_is_rendered() {
        let m = Metrics::default();
        m.released(ReleaseReason::Expired).inc_by(2);
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
        // OpenMetrics, as Prometheus parses it: a counter's family without `_total`, the
        // histogram's bounds as before, one full stop after a help text, the end marked.
        for line in [
            "# TYPE kvlease_leases_granted counter\n",
            "# HELP kvlease_leases_active Live leases on this engine.\n",
            "kvlease_lease_hold_seconds_bucket{le=\"0.5\"} 1\n",
            "kvlease_lease_hold_seconds_bucket{le=\"0.1\"} 0\n",
            "kvlease_lease_hold_seconds_bucket{le=\"300.0\"} 1\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains(".."), "a help text ends in two full stops:\n{text}");
        assert!(text.ends_with("# EOF\n"));
        assert_eq!(m.lease_hold.count(), 1);
        assert_eq!(m.lease_hold.max(), 0.2);
    }
}
