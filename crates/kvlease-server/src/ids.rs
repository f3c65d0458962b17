//! Identifiers for the HTTP layer: the random ones are the engine's ([`kvlease_engine::ids`]).

pub use kvlease_engine::ids::{random_hex, random_u64};
use std::time::{SystemTime, UNIX_EPOCH};

/// The header that carries a request's id, in and out (and from the proxy to both legs).
pub const REQUEST_ID: &str = "x-request-id";

/// A random id in the shape of a UUID (8-4-4-4-12 hex digits).
pub fn random_uuid() -> String {
    let h = random_hex(16);
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// Seconds since the Unix epoch, for the `created` field of responses (display only).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_distinct_and_well_shaped() {
        let a = random_hex(16);
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, random_hex(16));
        let u = random_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(u.matches('-').count(), 4);
    }
}
