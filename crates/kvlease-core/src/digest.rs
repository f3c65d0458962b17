//! The prompt digest of SPEC S4: binds a lease (and the params that name it) to the tokens whose
//! KV it holds, with or without a cluster secret.
//!
//! P puts the digest of the token ids it prefilled into its `kv_transfer_params` and keeps it with
//! the lease; D compares it with the digest of its own prompt's prefix before it reads, and again
//! sends it with every `ReadDone`, which P checks before confirming the read. A router that hands
//! D another request's params (vLLM #52234) therefore gets a recompute, never another prompt's KV.
//! SHA-256 truncated to 128 bits: collisions cannot be found, so no prompt can pass for another.

use sha2::{Digest as _, Sha256};
use std::fmt;

/// The first 16 bytes of SHA-256 over a domain tag and the token ids (little-endian u32s).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PromptDigest(pub [u8; 16]);

impl PromptDigest {
    /// The digest of `tokens`, the token ids P prefilled (or D's prompt prefix of that length).
    pub fn of(tokens: &[u32]) -> PromptDigest {
        let mut h = Sha256::new();
        h.update(b"kvlease-prompt-v1\n");
        h.update((tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let full = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&full[..16]);
        PromptDigest(out)
    }

    /// SPEC S4, D's check before it reads: whether this digest, for a prompt of `num_tokens`
    /// tokens, is that of `prompt` (the same length, the same tokens).
    pub fn describes(&self, num_tokens: u32, prompt: &[u32]) -> bool {
        prompt.len() == num_tokens as usize && PromptDigest::of(prompt) == *self
    }

    /// 32 lowercase hex digits, as it travels in `kv_transfer_params`.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`PromptDigest::to_hex`]'s form; `None` for anything else.
    pub fn from_hex(s: &str) -> Option<PromptDigest> {
        let s = s.as_bytes();
        if s.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, pair) in s.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(PromptDigest(out))
    }
}

impl fmt::Debug for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PromptDigest({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::PromptDigest;

    /// SPEC S4: the digest tells prompts apart, including a prefix from the whole, and survives
    /// its hex form; malformed hex is refused.
    #[test]
    fn s4_digest_separates_prompts_and_round_trips() {
        let a = PromptDigest::of(&[1, 2, 3]);
        assert_eq!(a, PromptDigest::of(&[1, 2, 3]));
        assert_ne!(a, PromptDigest::of(&[1, 2, 4]));
        assert_ne!(a, PromptDigest::of(&[1, 2]));
        assert_ne!(PromptDigest::of(&[]), PromptDigest::of(&[0]));
        assert!(a.describes(3, &[1, 2, 3]));
        assert!(!a.describes(3, &[1, 2, 4]) && !a.describes(2, &[1, 2]) && !a.describes(4, &[1, 2, 3, 4]));
        assert_eq!(PromptDigest::from_hex(&a.to_hex()), Some(a));
        for bad in ["", "zz", &a.to_hex()[1..], &format!("{}0", a.to_hex()), &"g".repeat(32), "é"] {
            assert_eq!(PromptDigest::from_hex(bad), None, "{bad:?}");
        }
    }
}
