//! The params digest of SPEC S4: binds a lease (and the params that name it) to the tokens whose
//! KV it holds **and to every field D acts on** — the engine and incarnation that granted it, the
//! lease id, the number of tokens and the ordered list of blocks they sit in — with or without a
//! cluster secret.
//!
//! P puts the digest into its `kv_transfer_params` and keeps it with the lease; D computes it
//! again from its own prompt and the fields it received, and reads only when the two agree; it
//! sends it with every read and `ReadDone`, which P checks before serving and before confirming
//! the read. A router that hands D another request's params (vLLM #52234), or that reorders,
//! truncates, duplicates or mixes their fields (P hands block ids out in descending order, so a
//! router that merely sorts them would otherwise make D read block 0's KV as block 3's), gets a
//! recompute, never another block's KV. SHA-256 truncated to 128 bits: collisions cannot be
//! found, so no prompt or block list can pass for another.

use sha2::{Digest as _, Sha256};
use std::fmt;

/// The first 16 bytes of SHA-256 over a domain tag, the token ids (little-endian u32s) and, for
/// params, the fields of [`Bound`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PromptDigest(pub [u8; 16]);

/// SPEC S4: the fields of `kv_transfer_params`, besides the tokens, that D acts on when it reads
/// and that the digest therefore binds. The number of tokens is bound as the tokens' count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound<'a> {
    /// `remote_engine_id`: whose blocks.
    pub engine_id: &'a str,
    /// `remote_incarnation`: which life of that engine granted the lease.
    pub incarnation: u64,
    /// `remote_lease_id`: the fencing token.
    pub lease_id: u64,
    /// `remote_block_ids`, in order: block `i` holds tokens `i·block_size ..`.
    pub block_ids: &'a [u32],
}

impl PromptDigest {
    /// The digest of `tokens` alone (a prompt's identity, without a lease).
    pub fn of(tokens: &[u32]) -> PromptDigest {
        let mut h = Sha256::new();
        h.update(b"kvlease-prompt-v1\n");
        tokens_into(&mut h, tokens);
        finish(h)
    }

    /// SPEC S4: the digest P puts in its params and keeps with the lease: `tokens` (the token ids
    /// whose KV the blocks hold) bound to the fields D reads them by.
    pub fn bound(tokens: &[u32], fields: &Bound<'_>) -> PromptDigest {
        let mut h = Sha256::new();
        h.update(b"kvlease-params-v2\n");
        tokens_into(&mut h, tokens);
        h.update((fields.engine_id.len() as u64).to_le_bytes());
        h.update(fields.engine_id.as_bytes());
        h.update(fields.incarnation.to_le_bytes());
        h.update(fields.lease_id.to_le_bytes());
        h.update((fields.block_ids.len() as u64).to_le_bytes());
        for b in fields.block_ids {
            h.update(b.to_le_bytes());
        }
        finish(h)
    }

    /// SPEC S4, D's check before it reads: whether this digest, sent for a prompt of
    /// `num_tokens` tokens with `fields`, is the one P computed for `prompt` and those fields
    /// (the same length, the same tokens, the same blocks in the same order, the same lease).
    pub fn describes(&self, num_tokens: u32, prompt: &[u32], fields: &Bound<'_>) -> bool {
        prompt.len() == num_tokens as usize && PromptDigest::bound(prompt, fields) == *self
    }

    /// 32 lowercase hex digits, as it travels in `kv_transfer_params`.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses [`PromptDigest::to_hex`]'s form; `None` for anything else.
    pub fn from_hex(s: &str) -> Option<PromptDigest> {
        let mut out = [0u8; 16];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(PromptDigest(out))
    }
}

fn tokens_into(h: &mut Sha256, tokens: &[u32]) {
    h.update((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
}

fn finish(h: Sha256) -> PromptDigest {
    let full = h.finalize();
    let mut out = [0u8; 16];
    out.copy_from_slice(&full[..16]);
    PromptDigest(out)
}

/// SPEC S4, P's read gate: whether a read naming `read` reads the blocks of a lease whose params
/// named `lease` — exactly those blocks, in that order; where `prefix` is allowed (a cached turn,
/// read only as far as the next turn's prompt shares it, B4), a non-empty in-order prefix of them.
/// A read that reorders, repeats, skips or mixes blocks would put one block's KV where another's
/// belongs; it is refused before a byte is served.
pub fn reads_lease_blocks(lease: &[u32], read: &[u32], prefix: bool) -> bool {
    if prefix {
        !read.is_empty() && lease.starts_with(read)
    } else {
        lease == read
    }
}

impl fmt::Debug for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PromptDigest({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::{reads_lease_blocks, Bound, PromptDigest};

    /// SPEC S4: the digest tells prompts apart, including a prefix from the whole, and survives
    /// its hex form; malformed hex is refused.
    #[test]
    fn s4_digest_separates_prompts_and_round_trips() {
        let a = PromptDigest::of(&[1, 2, 3]);
        assert_eq!(a, PromptDigest::of(&[1, 2, 3]));
        assert_ne!(a, PromptDigest::of(&[1, 2, 4]));
        assert_ne!(a, PromptDigest::of(&[1, 2]));
        assert_ne!(PromptDigest::of(&[]), PromptDigest::of(&[0]));
        assert_eq!(PromptDigest::from_hex(&a.to_hex()), Some(a));
        for bad in ["", "zz", &a.to_hex()[1..], &format!("{}0", a.to_hex()), &"g".repeat(32), "é"] {
            assert_eq!(PromptDigest::from_hex(bad), None, "{bad:?}");
        }
    }

    /// SPEC S4: params bind the prompt and every field D reads by: the same prompt with its blocks
    /// reversed, rotated, repeated, truncated or extended, another lease id, incarnation or
    /// engine, or another length, is not described by the digest P sent.
    #[test]
    fn s4_digest_binds_the_ordered_block_list_and_the_lease() {
        let prompt = [5u32, 6, 7, 8, 9];
        let blocks = [3u32, 2, 1, 0];
        let fields = Bound { engine_id: "p0", incarnation: 7, lease_id: 42, block_ids: &blocks };
        let d = PromptDigest::bound(&prompt, &fields);
        assert!(d.describes(5, &prompt, &fields));
        assert_ne!(d, PromptDigest::of(&prompt), "a params digest is not a bare prompt digest");
        let mangled: [&[u32]; 6] = [&[0, 1, 2, 3], &[2, 1, 0, 3], &[3, 3, 3, 3], &[3, 2, 1], &[3, 2, 1, 0, 4], &[2, 3, 1, 0]];
        for b in mangled {
            assert!(!d.describes(5, &prompt, &Bound { block_ids: b, ..fields }), "{b:?}");
        }
        assert!(!d.describes(5, &prompt, &Bound { lease_id: 43, ..fields }));
        assert!(!d.describes(5, &prompt, &Bound { incarnation: 8, ..fields }));
        assert!(!d.describes(5, &prompt, &Bound { engine_id: "p1", ..fields }));
        assert!(!d.describes(4, &prompt, &fields), "another remote_num_tokens");
        assert!(!d.describes(5, &[5, 6, 7, 8, 10], &fields), "another prompt");
        // Field boundaries cannot be shifted: ("p0", 7) and ("p", …) hash apart.
        assert_ne!(d, PromptDigest::bound(&prompt, &Bound { engine_id: "p", ..fields }));
    }

    /// SPEC S4 (P's gate): a read names exactly the lease's blocks in order; a cached turn may be
    /// read as an in-order prefix (B4), nothing else.
    #[test]
    fn s4_a_read_names_exactly_the_leases_blocks_in_order() {
        let lease = [3u32, 2, 1, 0];
        assert!(reads_lease_blocks(&lease, &[3, 2, 1, 0], false));
        for bad in [&[0u32, 1, 2, 3][..], &[3, 3, 3, 3], &[3, 2, 1], &[2, 1, 0, 3], &[], &[3, 2, 1, 0, 0]] {
            assert!(!reads_lease_blocks(&lease, bad, false), "{bad:?}");
        }
        assert!(reads_lease_blocks(&lease, &[3, 2], true));
        assert!(reads_lease_blocks(&lease, &[3, 2, 1, 0], true));
        for bad in [&[2u32, 1][..], &[], &[3, 1], &[3, 2, 1, 0, 4]] {
            assert!(!reads_lease_blocks(&lease, bad, true), "{bad:?}");
        }
    }
}
