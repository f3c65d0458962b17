//! Identifiers for the HTTP layer: the random ones are the engine's ([`kvlease_engine::ids`]).

pub use kvlease_engine::ids::{random_hex, random_u64, random_uuid, random_uuid_hex};
use std::time::{SystemTime, UNIX_EPOCH};

/// The header that carries a request's id, in and out (and from the proxy to both legs).
pub const REQUEST_ID: &str = "x-request-id";

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
        assert_eq!(&u[14..15], "4", "a v4 UUID");
        let r = random_uuid_hex();
        assert_eq!(r.len(), 32);
        assert!(r.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(&r[12..13], "4", "a v4 UUID, as vLLM's uuid4().hex");
        assert_ne!(random_u64(), random_u64());
    }
}
