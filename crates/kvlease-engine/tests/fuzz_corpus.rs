//! The fuzz targets on stable Rust, in `cargo test` (CI has no nightly for cargo-fuzz): every
//! input of `fuzz/corpus/<target>/` (built by running the targets, minimized, crashes found
//! kept as regressions) replayed through the same checks the fuzzer runs (`fuzz/src/lib.rs`),
//! then a short, seeded, time-boxed mutation of those inputs.
//!
//! SPEC §9 and P7 (the wire decoder accepts any bytes without panicking), the side channel's
//! Hello (§3, D5) and `kv_transfer_params` (§10, S1, S4).

#[path = "../../../fuzz/src/lib.rs"]
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 3] = [("wire", targets::wire), ("hello", targets::hello), ("kv_params", targets::kv_params)];

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a readable corpus directory").path())
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path, bytes)
        })
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty(), "{}: an empty corpus replays nothing", dir.display());
    inputs
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs `target` on `input`; on a panic, fails naming the input (hex) so it can be kept.
fn run(name: &str, target: Target, input: &[u8], origin: &str) {
    if catch_unwind(AssertUnwindSafe(|| target(input))).is_err() {
        panic!("fuzz target {name} panicked on {origin}: input (hex) {}", hex(input));
    }
}

/// SPEC §9, P7, S1, S4: every corpus input of every target goes through without a panic.
#[test]
fn p7_fuzz_corpus_replays_without_panic() {
    for (name, target) in TARGETS {
        for (path, bytes) in corpus(name) {
            run(name, target, &bytes, &path.display().to_string());
        }
    }
}

/// xorshift64*: a seeded, dependency-free generator, so a failing mutation replays exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One to four byte-level edits: flip a bit, set a byte to an interesting value, insert or
/// delete a byte, duplicate a slice, or splice in part of another corpus input.
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(out.len() + 1);
        match rng.below(6) {
            0 if at < out.len() => out[at] ^= 1 << rng.below(8),
            1 if at < out.len() => out[at] = [0, 1, 0x7f, 0x80, 0xff, b'"', b'{', b'['][rng.below(8)],
            2 => out.insert(at, rng.next() as u8),
            3 if at < out.len() => {
                out.remove(at);
            }
            4 if at < out.len() => {
                let end = (at + 1 + rng.below(16)).min(out.len());
                let slice = out[at..end].to_vec();
                out.splice(at..at, slice);
            }
            _ if !other.is_empty() => {
                let from = rng.below(other.len());
                let end = (from + 1 + rng.below(32)).min(other.len());
                out.splice(at..at, other[from..end].iter().copied());
            }
            _ => {}
        }
    }
    out
}

/// SPEC §9, P7, S1, S4: a short stable fuzz: corpus inputs mutated from a fixed seed, for about
/// a second per target (`KVLEASE_FUZZ_SECS` to run longer, `KVLEASE_FUZZ_SEED` for another seed).
#[test]
fn p7_fuzz_seeded_mutations_do_not_panic() {
    let secs: f64 = std::env::var("KVLEASE_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let seed: u64 = std::env::var("KVLEASE_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x006b_766c_6561_7365);
    for (name, target) in TARGETS {
        let inputs = corpus(name);
        let mut rng = Rng(seed | 1);
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let mut runs = 0u64;
        while Instant::now() < deadline {
            for _ in 0..64 {
                let input = &inputs[rng.below(inputs.len())].1;
                let other = &inputs[rng.below(inputs.len())].1;
                let mutated = mutate(&mut rng, input, other);
                run(name, target, &mutated, &format!("a mutation (seed {seed}, run {runs})"));
                runs += 1;
            }
        }
        eprintln!("{name}: {runs} mutated inputs in {secs} s");
    }
}
