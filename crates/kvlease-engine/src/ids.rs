//! Random identifiers (request ids, engine ids, incarnations, sampling seeds), from the OS's
//! random source (`getrandom`, and `uuid` for the UUID-shaped ones).
//!
//! They only need to be unique, not secret; the OS's source is what every process has.

use uuid::Uuid;

/// A random u64.
pub fn random_u64() -> u64 {
    // Linux's getrandom(2) does not fail once the pool is seeded (at boot); a system without a
    // random source cannot run an engine whose ids must not collide.
    getrandom::u64().unwrap_or_else(|e| panic!("the OS gave no random bytes (getrandom): {e}"))
}

/// `bytes` random bytes as lower-case hex.
pub fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    getrandom::fill(&mut b).unwrap_or_else(|e| panic!("the OS gave no random bytes (getrandom): {e}"));
    hex::encode(b)
}

/// A random (v4) UUID as 32 lower-case hex digits: vLLM's `random_uuid()` (`uuid4().hex`), the
/// shape of its request ids (`cmpl-<32 hex>`) and engine ids.
pub fn random_uuid_hex() -> String {
    Uuid::new_v4().simple().to_string()
}

/// A random (v4) UUID, 8-4-4-4-12 hex digits.
pub fn random_uuid() -> String {
    Uuid::new_v4().hyphenated().to_string()
}
