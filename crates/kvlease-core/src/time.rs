//! Protocol time: a point on the caller's monotonic clock, in nanoseconds.
//!
//! The core never reads a clock. Drivers convert `std::time::Instant` (runtime) or virtual time
//! (simulator) into [`Nanos`] measured from an origin of their choosing; only differences and
//! order matter.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time, nanoseconds since the driver's origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Nanos(pub u64);

impl Nanos {
    pub const ZERO: Nanos = Nanos(0);
    pub const MAX: Nanos = Nanos(u64::MAX);

    pub fn from_secs_f64(s: f64) -> Nanos {
        Nanos((s * 1e9) as u64)
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Nanos) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Nanos {
    type Output = Nanos;
    fn add(self, d: Duration) -> Nanos {
        Nanos(self.0.saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)))
    }
}

impl Sub<Duration> for Nanos {
    type Output = Nanos;
    fn sub(self, d: Duration) -> Nanos {
        Nanos(self.0.saturating_sub(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)))
    }
}
