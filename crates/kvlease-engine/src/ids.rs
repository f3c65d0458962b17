//! Random identifiers (request ids, engine ids, incarnations, sampling seeds) without a
//! random-number dependency.
//!
//! They only need to be unique, not secret: std's per-process random hasher keys, a counter and
//! the clock are enough, and keep the crates free of an RNG crate.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A random u64, distinct for every call in this process.
pub fn random_u64() -> u64 {
    // The process id once: `getpid` is a system call every time (one per request, when ids or
    // seeds are drawn per request).
    static PID: OnceLock<u32> = OnceLock::new();
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default());
    h.write_u32(*PID.get_or_init(std::process::id));
    h.finish()
}

/// `bytes` random bytes as lower-case hex.
pub fn random_hex(bytes: usize) -> String {
    let mut s = String::with_capacity(bytes * 2);
    while s.len() < bytes * 2 {
        s.push_str(&format!("{:016x}", random_u64()));
    }
    s.truncate(bytes * 2);
    s
}
