//! `--kv-transfer-config`: the JSON `vllm serve` takes, parsed into the lease parameters (SPEC §2).
//!
//! Pure parsing and validation. Invalid values are refused with a message naming the key; keys we
//! do not know are returned as warnings for the caller to log, never fatal, so a config written
//! for vLLM starts here unchanged.

use serde_json::{Map, Value};
use std::time::Duration;
use thiserror::Error;

/// What D does when the lease on its remote KV is lost (SPEC D6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadFailurePolicy {
    /// Compute the prompt's KV locally; the output is the same (SPEC D7).
    Recompute,
    /// Fail the request with a clear error.
    Fail,
}

/// The engine's role as configured; each request's role comes from its `kv_transfer_params`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRole {
    Producer,
    Consumer,
    Both,
}

/// The lease parameters every engine derives from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseConfig {
    /// L: the initial lease P grants.
    pub lease_duration: Duration,
    /// I = L/6: D sends at most one heartbeat per P engine per interval.
    pub heartbeat_interval: Duration,
    /// E = 2L/3: each heartbeat sets `deadline = max(deadline, now + E)`.
    pub extension: Duration,
    /// SPEC P9: renewals never push a deadline past `grant + max_lifetime`.
    pub max_lifetime: Option<Duration>,
    /// SPEC B1: how long D keeps a finished turn's blocks in bidirectional mode.
    pub decoder_kv_blocks_ttl: Duration,
    pub bidirectional: bool,
    /// SPEC B4: a cached prefix shorter than this many tokens is recomputed, not read.
    pub kv_recompute_threshold: u32,
    pub load_failure_policy: LoadFailurePolicy,
    /// SPEC D2: heartbeats are split into messages of at most this many bytes.
    pub max_notif_bytes: usize,
    /// SPEC U10: push mode, how long D waits for its writes without progress from P before the
    /// request fails over to `load_failure_policy` (`push_registration_timeout`).
    pub push_registration_timeout: Duration,
}

/// The most D waits for P's `ReadDoneAck`s after its reads ([`LeaseConfig::read_done_ack_wait`]).
pub const READ_DONE_ACK_WAIT_MAX: Duration = Duration::from_secs(2);

/// The largest read budget ([`LeaseConfig::read_budget`]), whatever the lease.
pub const READ_BUDGET_MAX: Duration = Duration::from_secs(5);

impl LeaseConfig {
    /// SPEC P4: how late after its deadline a lease may be reaped, min(I/10, 100 ms).
    pub fn reap_granularity(&self) -> Duration {
        (self.heartbeat_interval / 10).min(Duration::from_millis(100))
    }

    /// SPEC D6: D reads only while an acknowledged heartbeat covers at least this much more:
    /// E/4, at most [`READ_BUDGET_MAX`] (5 s, E/4 at the default lease). A read takes
    /// milliseconds to seconds whatever the lease; a budget that grew with L made the read
    /// timeout and the NIXL quarantine grow with it (161 s at L = 480 s), so every lost message
    /// pinned blocks for minutes and longer leases served fewer requests under loss.
    pub fn read_budget(&self) -> Duration {
        (self.extension / 4).min(READ_BUDGET_MAX)
    }

    /// How long D lets a pull's reads run before abandoning them: the read budget, at least 1 s
    /// (a large prompt on a busy machine needs it whatever the lease). A read that outlives the
    /// acknowledged lease is caught by P's `ReadDoneAck`.
    pub fn read_timeout(&self) -> Duration {
        self.read_budget().max(Duration::from_secs(1))
    }

    /// How long D waits for P's `ReadDoneAck`s once its reads have landed: P answers a
    /// `ReadDone` at once, so the wait only covers a lost message, a round trip and a busy P.
    /// Capped at 2 s whatever the lease: under loss, a wait that grew with L (E/4) held a decode
    /// slot for L/6 per lost acknowledgement, so longer leases served fewer requests. Giving up
    /// costs one prefill (the bytes are never used unconfirmed).
    pub fn read_done_ack_wait(&self) -> Duration {
        self.read_timeout().min(READ_DONE_ACK_WAIT_MAX)
    }

    /// How long D waits for P's answer to a renewal or a read completion before giving up on the
    /// lease: E, since a lease nobody renewed for E may be gone anyway (never less than 1 s).
    pub fn ack_wait(&self) -> Duration {
        self.extension.max(Duration::from_secs(1))
    }

    /// SPEC P5 where the transport cannot fence reads (NIXL): how long blocks that a READ may
    /// still target are kept out of use after their lease ended, or after D gave up on a pull.
    /// A READ is posted only within the read budget of an acknowledged deadline and abandoned
    /// after the read timeout; this outlasts both with a margin.
    pub fn quarantine(&self) -> Duration {
        self.read_budget() + self.read_timeout() + Duration::from_secs(1)
    }

    /// The lease parameters for a lease duration of `secs`, everything else at its default.
    pub fn with_lease_secs(secs: f64) -> Result<LeaseConfig, ConfigError> {
        let mut extra = Map::new();
        extra.insert("kv_lease_duration".into(), Value::from(secs));
        Self::from_extra(&extra, &mut Vec::new())
    }

    fn from_extra(extra: &Map<String, Value>, warnings: &mut Vec<String>) -> Result<LeaseConfig, ConfigError> {
        let lease = secs_key(extra, "kv_lease_duration", 30.0)?;
        let interval = lease / 6;
        if interval < Duration::from_millis(1) {
            return Err(ConfigError::Invalid {
                key: "kv_lease_duration",
                why: format!(
                    "{} s gives a heartbeat interval of {:?}; it must be at least 1 ms (use ≥ 0.006)",
                    lease.as_secs_f64(),
                    interval
                ),
            });
        }
        let max_lifetime = match extra.get("kv_lease_max_lifetime") {
            None | Some(Value::Null) => None,
            Some(_) => Some(secs_key(extra, "kv_lease_max_lifetime", 0.0)?),
        };
        let max_notif_bytes = match extra.get("max_notif_bytes") {
            None => crate::wire::DEFAULT_MAX_NOTIF_BYTES,
            Some(v) => {
                let n = number(v).filter(|n| n.fract() == 0.0 && *n >= crate::wire::MIN_MAX_NOTIF_BYTES as f64 && *n <= u32::MAX as f64);
                match n {
                    Some(n) => n as usize,
                    None => {
                        return Err(ConfigError::Invalid {
                            key: "max_notif_bytes",
                            why: format!("{v} is not a whole number of bytes ≥ {}", crate::wire::MIN_MAX_NOTIF_BYTES),
                        })
                    }
                }
            }
        };
        let load_failure_policy = match extra.get("kv_load_failure_policy") {
            None => LoadFailurePolicy::Recompute,
            Some(v) => policy(v)?,
        };
        for key in extra.keys() {
            if !KNOWN_EXTRA_KEYS.contains(&key.as_str()) {
                warnings.push(format!("kv_connector_extra_config: unknown key {key:?} ignored"));
            }
        }
        let bidirectional = bool_key(extra, "bidirectional_kv_xfer", false)?;
        let kv_recompute_threshold = match extra.get("kv_recompute_threshold") {
            None | Some(Value::Null) => {
                if bidirectional {
                    64
                } else {
                    0
                }
            }
            Some(v) => match number(v).filter(|n| n.fract() == 0.0 && *n >= 0.0 && *n <= f64::from(u32::MAX)) {
                Some(n) => n as u32,
                None => {
                    return Err(ConfigError::Invalid {
                        key: "kv_recompute_threshold",
                        why: format!("{v} is not a whole number of tokens ≥ 0"),
                    })
                }
            },
        };
        let cfg = LeaseConfig {
            lease_duration: lease,
            heartbeat_interval: interval,
            extension: lease * 2 / 3,
            max_lifetime,
            decoder_kv_blocks_ttl: secs_key(extra, "decoder_kv_blocks_ttl", 480.0)?,
            bidirectional,
            kv_recompute_threshold,
            load_failure_policy,
            max_notif_bytes,
            push_registration_timeout: secs_key(extra, "push_registration_timeout", 30.0)?,
        };
        if cfg.bidirectional && cfg.decoder_kv_blocks_ttl <= cfg.read_budget() {
            // SPEC B2: P reads a cached turn only if it outlives the read budget; a TTL that
            // short means no turn is ever read back, only held.
            warnings.push(format!(
                "kv_connector_extra_config: decoder_kv_blocks_ttl ({} s) is not above the read budget (kv_lease_duration/6, at most 5 s: {} s): \
                 no cached turn would ever be read back, only held; raise it or lower kv_lease_duration",
                cfg.decoder_kv_blocks_ttl.as_secs_f64(),
                cfg.read_budget().as_secs_f64()
            ));
        }
        Ok(cfg)
    }
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self::from_extra(&Map::new(), &mut Vec::new()).expect("defaults are valid")
    }
}

/// The whole `--kv-transfer-config`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTransferConfig {
    /// `NixlConnector`, `NixlPullConnector`, `KvLeaseConnector` or `NixlPushConnector`, as given.
    pub kv_connector: String,
    pub kv_role: KvRole,
    /// `engine_id` if the config names one.
    pub engine_id: Option<String>,
    pub lease: LeaseConfig,
}

impl KvTransferConfig {
    /// Parses the JSON text of `--kv-transfer-config`. Returns the config and the warnings to log.
    pub fn parse(json: &str) -> Result<(KvTransferConfig, Vec<String>), ConfigError> {
        let value: Value = serde_json::from_str(json).map_err(|e| ConfigError::Json(e.to_string()))?;
        let Value::Object(top) = value else {
            return Err(ConfigError::Json("expected a JSON object".into()));
        };
        let mut warnings = Vec::new();
        let kv_connector = match top.get("kv_connector") {
            None => "NixlConnector".to_string(),
            Some(Value::String(s)) if CONNECTORS.contains(&s.as_str()) => s.clone(),
            Some(v) => {
                return Err(ConfigError::Invalid { key: "kv_connector", why: format!("{v} is not supported; use one of {CONNECTORS:?}") })
            }
        };
        let kv_role = match top.get("kv_role") {
            None => KvRole::Both,
            Some(Value::String(s)) => match s.as_str() {
                "kv_producer" => KvRole::Producer,
                "kv_consumer" => KvRole::Consumer,
                "kv_both" => KvRole::Both,
                _ => {
                    return Err(ConfigError::Invalid {
                        key: "kv_role",
                        why: format!("{s:?} is not one of kv_producer, kv_consumer, kv_both"),
                    })
                }
            },
            Some(v) => return Err(ConfigError::Invalid { key: "kv_role", why: format!("{v} is not a string") }),
        };
        let engine_id = match top.get("engine_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(v) => return Err(ConfigError::Invalid { key: "engine_id", why: format!("{v} is not a non-empty string") }),
        };
        let empty = Map::new();
        let extra = match top.get("kv_connector_extra_config") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(v) => return Err(ConfigError::Invalid { key: "kv_connector_extra_config", why: format!("{v} is not an object") }),
        };
        let mut lease = LeaseConfig::from_extra(extra, &mut warnings)?;
        // vLLM keeps kv_load_failure_policy at the top level of the config; we accept both places.
        if let Some(v) = top.get("kv_load_failure_policy") {
            lease.load_failure_policy = policy(v)?;
        }
        for key in top.keys() {
            if !KNOWN_TOP_KEYS.contains(&key.as_str()) {
                warnings.push(format!("kv-transfer-config: unknown key {key:?} ignored"));
            }
        }
        if kv_connector == PUSH_CONNECTOR && lease.bidirectional {
            return Err(ConfigError::Invalid {
                key: "kv_connector",
                why: format!(
                    "{PUSH_CONNECTOR:?} (push mode) with bidirectional_kv_xfer is not supported; cached turns are read in pull mode"
                ),
            });
        }
        if kv_connector == PUSH_CONNECTOR && lease.push_registration_timeout <= lease.read_budget() {
            // SPEC U8: P posts no write within its write margin of D's deadline; a wait that
            // short would see every write refused and every prompt recomputed.
            return Err(ConfigError::Invalid {
                key: "push_registration_timeout",
                why: format!(
                    "{} s is not above P's write margin (kv_lease_duration/6, at most 5 s: {} s): no write could ever be posted in time; \
                     raise it or lower kv_lease_duration",
                    lease.push_registration_timeout.as_secs_f64(),
                    lease.read_budget().as_secs_f64()
                ),
            });
        }
        Ok((KvTransferConfig { kv_connector, kv_role, engine_id, lease }, warnings))
    }

    /// SPEC §13: whether this engine runs push mode (P writes into D's registered blocks).
    pub fn push_mode(&self) -> bool {
        self.kv_connector == PUSH_CONNECTOR
    }

    /// The transfer mode's name, as handshakes and errors say it.
    pub fn mode_name(&self) -> &'static str {
        if self.push_mode() {
            "push"
        } else {
            "pull"
        }
    }
}

impl Default for KvTransferConfig {
    fn default() -> Self {
        KvTransferConfig { kv_connector: "NixlConnector".into(), kv_role: KvRole::Both, engine_id: None, lease: LeaseConfig::default() }
    }
}

/// Pull mode under vLLM's names (`NixlPullConnector` is `NixlConnector`'s name beside push mode)
/// and kvlease's own, and push mode under vLLM's name (SPEC §13).
const CONNECTORS: [&str; 4] = ["NixlConnector", "NixlPullConnector", "KvLeaseConnector", PUSH_CONNECTOR];

/// vLLM's name for push mode (SPEC §13): P writes the KV into blocks D registered.
pub const PUSH_CONNECTOR: &str = "NixlPushConnector";

/// vLLM's `KVTransferConfig` fields: accepted silently, used where they mean something here.
const KNOWN_TOP_KEYS: [&str; 13] = [
    "kv_connector",
    "engine_id",
    "kv_buffer_device",
    "kv_buffer_size",
    "kv_role",
    "kv_rank",
    "kv_parallel_size",
    "kv_ip",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
];

const KNOWN_EXTRA_KEYS: [&str; 10] = [
    "kv_lease_duration",
    "kv_lease_max_lifetime",
    "decoder_kv_blocks_ttl",
    "bidirectional_kv_xfer",
    "kv_recompute_threshold",
    "kv_load_failure_policy",
    "max_notif_bytes",
    "push_registration_timeout",
    "backends",
    "num_threads",
];

/// Why a `--kv-transfer-config` was refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    #[error("--kv-transfer-config is not valid JSON: {0}")]
    Json(String),
    #[error("--kv-transfer-config: {key}: {why}")]
    Invalid { key: &'static str, why: String },
}

/// A JSON number, or a string holding one (vLLM applies `float()` to these values).
fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    }
}

/// The longest duration any key accepts: enough for any lease, small enough that deadlines
/// computed from it never overflow a clock.
const MAX_SECS: f64 = 1e6;

fn secs_key(extra: &Map<String, Value>, key: &'static str, default: f64) -> Result<Duration, ConfigError> {
    let secs = match extra.get(key) {
        None => default,
        Some(v) => number(v).ok_or_else(|| ConfigError::Invalid { key, why: format!("{v} is not a number of seconds") })?,
    };
    if !secs.is_finite() || secs <= 0.0 {
        return Err(ConfigError::Invalid { key, why: format!("{secs} must be a positive, finite number of seconds") });
    }
    if secs > MAX_SECS {
        return Err(ConfigError::Invalid { key, why: format!("{secs} s is more than {MAX_SECS} s (about 11 days)") });
    }
    Duration::try_from_secs_f64(secs).map_err(|e| ConfigError::Invalid { key, why: format!("{secs} s: {e}") })
}

fn bool_key(extra: &Map<String, Value>, key: &'static str, default: bool) -> Result<bool, ConfigError> {
    match extra.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(false),
        Some(v) => Err(ConfigError::Invalid { key, why: format!("{v} is not true or false") }),
    }
}

fn policy(v: &Value) -> Result<LoadFailurePolicy, ConfigError> {
    match v.as_str() {
        Some("recompute") => Ok(LoadFailurePolicy::Recompute),
        Some("fail") => Ok(LoadFailurePolicy::Fail),
        _ => Err(ConfigError::Invalid { key: "kv_load_failure_policy", why: format!("{v} is not \"recompute\" or \"fail\"") }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_derive_interval_and_extension_from_lease() {
        let (c, w) = KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#).unwrap();
        assert!(w.is_empty());
        assert_eq!(c.lease.lease_duration, Duration::from_secs(30));
        assert_eq!(c.lease.heartbeat_interval, Duration::from_secs(5));
        assert_eq!(c.lease.extension, Duration::from_secs(20));
        assert_eq!(c.lease.decoder_kv_blocks_ttl, Duration::from_secs(480));
        assert_eq!(c.lease.load_failure_policy, LoadFailurePolicy::Recompute);
        assert_eq!(c.lease.max_lifetime, None);
        assert!(!c.lease.bidirectional);
        assert_eq!(c.lease.reap_granularity(), Duration::from_millis(100));
        assert_eq!(c.lease.push_registration_timeout, Duration::from_secs(30));
    }

    /// SPEC D6, P5: the read budget is E/4 up to 5 s whatever the lease, so the read timeout
    /// and the NIXL quarantine a lost message costs do not grow with L.
    #[test]
    fn d6_read_budget_and_quarantine_do_not_grow_with_the_lease() {
        for (secs, budget_ms) in [(3.0, 500), (30.0, 5_000), (480.0, 5_000)] {
            let c = LeaseConfig::with_lease_secs(secs).unwrap();
            assert_eq!(c.read_budget(), Duration::from_millis(budget_ms), "L = {secs} s");
        }
        let long = LeaseConfig::with_lease_secs(480.0).unwrap();
        assert_eq!(long.quarantine(), Duration::from_secs(11), "as at the default lease, not 161 s");
        assert_eq!(long.read_timeout(), Duration::from_secs(5));
    }

    #[test]
    fn spec_example_and_fractional_seconds() {
        let (c, _) = KvTransferConfig::parse(
            r#"{"kv_connector":"KvLeaseConnector","kv_role":"kv_producer",
                "kv_connector_extra_config":{"kv_lease_duration":1.5,"decoder_kv_blocks_ttl":"60",
                "bidirectional_kv_xfer":true,"kv_load_failure_policy":"fail","kv_lease_max_lifetime":90,
                "push_registration_timeout":2.5}}"#,
        )
        .unwrap();
        assert_eq!(c.kv_role, KvRole::Producer);
        assert_eq!(c.lease.lease_duration, Duration::from_millis(1500));
        assert_eq!(c.lease.heartbeat_interval, Duration::from_millis(250));
        assert_eq!(c.lease.extension, Duration::from_millis(1000));
        assert_eq!(c.lease.decoder_kv_blocks_ttl, Duration::from_secs(60));
        assert_eq!(c.lease.max_lifetime, Some(Duration::from_secs(90)));
        assert_eq!(c.lease.load_failure_policy, LoadFailurePolicy::Fail);
        assert!(c.lease.bidirectional);
        assert_eq!(c.lease.reap_granularity(), Duration::from_millis(25));
        assert_eq!(c.lease.push_registration_timeout, Duration::from_millis(2500));
    }

    #[test]
    fn invalid_values_name_the_key() {
        for (json, key) in [
            (r#"{"kv_connector_extra_config":{"kv_lease_duration":0}}"#, "kv_lease_duration"),
            (r#"{"kv_connector_extra_config":{"kv_lease_duration":-3}}"#, "kv_lease_duration"),
            (r#"{"kv_connector_extra_config":{"kv_lease_duration":"NaN"}}"#, "kv_lease_duration"),
            (r#"{"kv_connector_extra_config":{"kv_lease_duration":"soon"}}"#, "kv_lease_duration"),
            (r#"{"kv_connector_extra_config":{"kv_lease_duration":0.001}}"#, "kv_lease_duration"),
            (r#"{"kv_connector_extra_config":{"kv_lease_duration":1e19}}"#, "kv_lease_duration"),
            (r#"{"kv_connector_extra_config":{"decoder_kv_blocks_ttl":[]}}"#, "decoder_kv_blocks_ttl"),
            (r#"{"kv_connector_extra_config":{"kv_load_failure_policy":"retry"}}"#, "kv_load_failure_policy"),
            (r#"{"kv_connector_extra_config":{"max_notif_bytes":16}}"#, "max_notif_bytes"),
            (r#"{"kv_connector_extra_config":{"bidirectional_kv_xfer":3}}"#, "bidirectional_kv_xfer"),
            (r#"{"kv_connector_extra_config":{"push_registration_timeout":0}}"#, "push_registration_timeout"),
            (r#"{"kv_connector_extra_config":{"push_registration_timeout":"later"}}"#, "push_registration_timeout"),
            (r#"{"kv_role":"kv_reader"}"#, "kv_role"),
            (r#"{"kv_connector":"LMCacheConnector"}"#, "kv_connector"),
            (r#"{"kv_connector_extra_config":"x"}"#, "kv_connector_extra_config"),
        ] {
            let err = KvTransferConfig::parse(json).unwrap_err();
            assert!(err.to_string().contains(key), "{json}: {err}");
        }
        assert!(matches!(KvTransferConfig::parse("{not json"), Err(ConfigError::Json(_))));
        assert!(matches!(KvTransferConfig::parse("[]"), Err(ConfigError::Json(_))));
    }

    /// vLLM's names for the two modes: pull under either pull name, push under vLLM's push
    /// name; push with cached turns is refused, naming both.
    #[test]
    fn kv_connector_takes_vllms_names_for_both_modes() {
        let (c, _) = KvTransferConfig::parse(r#"{"kv_connector":"NixlPullConnector"}"#).unwrap();
        assert_eq!(c.kv_connector, "NixlPullConnector");
        assert!(!c.push_mode());
        let (c, _) = KvTransferConfig::parse(r#"{"kv_connector":"NixlPushConnector"}"#).unwrap();
        assert!(c.push_mode());
        assert_eq!(c.mode_name(), "push");
        let err =
            KvTransferConfig::parse(r#"{"kv_connector":"NixlPushConnector","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("kv_connector") && err.contains("push mode") && err.contains("bidirectional_kv_xfer"), "{err}");
        // SPEC U8: a wait no write could be posted within is refused, naming the key.
        let err =
            KvTransferConfig::parse(r#"{"kv_connector":"NixlPushConnector","kv_connector_extra_config":{"push_registration_timeout":5}}"#)
                .unwrap_err()
                .to_string();
        assert!(err.contains("push_registration_timeout") && err.contains("write margin"), "{err}");
        assert!(KvTransferConfig::parse(
            r#"{"kv_connector":"NixlPushConnector","kv_connector_extra_config":{"push_registration_timeout":6}}"#
        )
        .is_ok());
    }

    #[test]
    fn a_cached_turn_ttl_no_read_could_use_is_warned_about() {
        let cfg = r#"{"kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_lease_duration":60,"decoder_kv_blocks_ttl":5}}"#;
        let (_, warnings) = KvTransferConfig::parse(cfg).unwrap();
        assert!(warnings.iter().any(|w| w.contains("decoder_kv_blocks_ttl")), "{warnings:?}");
        let fine = r#"{"kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_lease_duration":60,"decoder_kv_blocks_ttl":60}}"#;
        assert!(KvTransferConfig::parse(fine).unwrap().1.is_empty());
    }

    #[test]
    fn unknown_keys_warn_and_vllm_keys_are_accepted() {
        let (c, w) = KvTransferConfig::parse(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cuda",
                "engine_id":"p0","kv_load_failure_policy":"fail","colour":"red",
                "kv_connector_extra_config":{"backends":["UCX"],"flavour":1}}"#,
        )
        .unwrap();
        assert_eq!(c.engine_id.as_deref(), Some("p0"));
        assert_eq!(c.kv_role, KvRole::Consumer);
        assert_eq!(c.lease.load_failure_policy, LoadFailurePolicy::Fail);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w.iter().any(|m| m.contains("colour")) && w.iter().any(|m| m.contains("flavour")));
    }
}
