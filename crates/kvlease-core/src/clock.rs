//! Clock-offset estimation between two engines (SPEC B2).
//!
//! In bidirectional mode D tells P when its cached blocks expire, on D's monotonic clock. P turns
//! that into its own clock with an offset estimated NTP-style from probe round trips: for a probe
//! sent at `t0` (P), received at `t1` and answered at `t2` (D), and back at `t3` (P),
//! `offset = ((t1 - t0) + (t2 - t3)) / 2` and the error is at most half the round trip. Of a window
//! of samples the one with the smallest round trip wins; its bound grows with its age to cover
//! drift between the two clocks.

use crate::Nanos;
use std::collections::VecDeque;
use std::time::Duration;

/// One probe round trip, all four stamps in nanoseconds on their own clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSample {
    pub t0: u64,
    pub t1: u64,
    pub t2: u64,
    pub t3: u64,
}

impl ClockSample {
    /// Remote clock minus local clock, in ns; `None` for an impossible sample (t3 < t0, t2 < t1).
    fn offset_and_rtt(&self) -> Option<(i128, u64)> {
        let rtt = self.t3.checked_sub(self.t0)?.checked_sub(self.t2.checked_sub(self.t1)?)?;
        let offset = ((self.t1 as i128 - self.t0 as i128) + (self.t2 as i128 - self.t3 as i128)) / 2;
        Some((offset, rtt))
    }
}

/// The current estimate: remote ≈ local + `offset_ns`, within ± `uncertainty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffsetEstimate {
    pub offset_ns: i128,
    pub uncertainty: Duration,
}

/// Clock-offset estimator toward one remote engine.
#[derive(Debug, Clone)]
pub struct ClockOffset {
    window: usize,
    refresh: Duration,
    /// Assumed worst relative drift of two monotonic clocks, parts per million.
    drift_ppm: u64,
    samples: VecDeque<(ClockSample, i128, u64)>,
    last_sample: Option<Nanos>,
}

impl Default for ClockOffset {
    fn default() -> Self {
        ClockOffset::new(8, Duration::from_secs(30))
    }
}

impl ClockOffset {
    /// Keep the last `window` samples; a new probe is due every `refresh`.
    pub fn new(window: usize, refresh: Duration) -> ClockOffset {
        ClockOffset { window: window.max(1), refresh, drift_ppm: 100, samples: VecDeque::new(), last_sample: None }
    }

    /// Adds a sample taken at local time `t3`. Impossible samples are ignored (returns false).
    pub fn add(&mut self, s: ClockSample) -> bool {
        let Some((offset, rtt)) = s.offset_and_rtt() else { return false };
        if self.samples.len() == self.window {
            self.samples.pop_front();
        }
        self.samples.push_back((s, offset, rtt));
        self.last_sample = Some(Nanos(s.t3));
        true
    }

    /// Whether a new probe should be sent at `now` (none yet, or the last is `refresh` old).
    pub fn probe_due(&self, now: Nanos) -> bool {
        match self.last_sample {
            None => true,
            Some(t) => now.since(t) >= self.refresh,
        }
    }

    /// The minimum-RTT sample of the window, its bound widened by drift since it was taken.
    pub fn estimate(&self, now: Nanos) -> Option<OffsetEstimate> {
        let (s, offset, rtt) = self.samples.iter().min_by_key(|(_, _, rtt)| *rtt)?;
        let age = now.0.saturating_sub(s.t3);
        let drift = age / 1_000_000 * self.drift_ppm;
        Some(OffsetEstimate { offset_ns: *offset, uncertainty: Duration::from_nanos(rtt / 2 + drift) })
    }

    /// SPEC B2: may blocks that expire at `remote_expiry` (remote clock, ns) still be read, if the
    /// read finishes within `margin` of `now`? False when no estimate exists: never guess.
    pub fn usable(&self, remote_expiry: u64, now: Nanos, margin: Duration) -> bool {
        let Some(est) = self.estimate(now) else { return false };
        let expiry_local = remote_expiry as i128 - est.offset_ns;
        let latest_needed = now.0 as i128 + margin.as_nanos() as i128 + est.uncertainty.as_nanos() as i128;
        latest_needed < expiry_local
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A remote clock `skew` ns ahead; one-way delays `out` and `back`, `proc` in between.
    fn sample(at: u64, skew: i64, out: u64, proc: u64, back: u64) -> ClockSample {
        let t1 = (at + out) as i64 + skew;
        ClockSample { t0: at, t1: t1 as u64, t2: t1 as u64 + proc, t3: at + out + proc + back }
    }

    /// SPEC B2: the offset of the minimum-RTT sample is kept, within half its round trip.
    #[test]
    fn b2_min_rtt_sample_wins_and_bounds_the_error() {
        let mut c = ClockOffset::new(4, Duration::from_secs(30));
        let skew = 5_000_000_000i64;
        assert!(c.add(sample(1_000, skew, 9_000_000, 1_000, 1_000_000))); // asymmetric, slow
        assert!(c.add(sample(20_000_000, skew, 50_000, 10_000, 60_000))); // fast
        assert!(c.add(sample(40_000_000, skew, 3_000_000, 0, 100)));
        let e = c.estimate(Nanos(40_000_000)).unwrap();
        assert!((e.offset_ns - skew as i128).unsigned_abs() <= e.uncertainty.as_nanos(), "{e:?}");
        assert!(e.uncertainty < Duration::from_micros(100), "{e:?}");
    }

    /// SPEC B2: a read is declined when it could end after the expiry, counting the uncertainty,
    /// and declined when there is no estimate at all.
    #[test]
    fn b2_declines_reads_that_could_outlive_the_expiry() {
        let mut c = ClockOffset::default();
        assert!(!c.usable(u64::MAX / 2, Nanos(0), Duration::ZERO), "no estimate, no read");
        let skew = -2_000_000_000i64; // remote clock 2 s behind
        c.add(sample(10_000_000_000, skew, 100_000, 0, 100_000));
        let now = Nanos(10_000_200_000);
        let margin = Duration::from_millis(50);
        // Expiry 1 s from now on the remote clock: fine.
        let remote_now = (now.0 as i64 + skew) as u64;
        assert!(c.usable(remote_now + 1_000_000_000, now, margin));
        // Expiry 50 ms from now: the read might end after it.
        assert!(!c.usable(remote_now + 50_000_000, now, margin));
        // Already expired.
        assert!(!c.usable(remote_now - 1, now, margin));
    }

    #[test]
    fn impossible_samples_are_ignored_and_refresh_is_periodic() {
        let mut c = ClockOffset::new(2, Duration::from_secs(1));
        assert!(!c.add(ClockSample { t0: 10, t1: 5, t2: 4, t3: 20 }));
        assert!(!c.add(ClockSample { t0: 10, t1: 5, t2: 6, t3: 9 }));
        assert!(c.probe_due(Nanos(0)));
        c.add(ClockSample { t0: 10, t1: 5, t2: 6, t3: 20 });
        assert!(!c.probe_due(Nanos(20 + 999_999_999)));
        assert!(c.probe_due(Nanos(20 + 1_000_000_000)));
    }
}
