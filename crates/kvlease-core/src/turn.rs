//! Multi-turn (bidirectional) transfer, P's side (SPEC B2, B4): whether the next turn's prefill
//! reads the conversation's KV back from the decoder that holds it, and how much of it.
//!
//! D keeps a finished turn's blocks under a cached-turn lease (B1) and hands P, through the
//! router, params naming them: how many tokens they cover, the digest of those tokens bound to
//! the params' fields (S4), and when they expire (on D's clock, and as a clock-free
//! time-to-live). P reads them only when they cover a prefix of its own prompt (the digest of its
//! first `n` tokens with the fields it received is theirs), the prefix is
//! long enough to be worth a read (`kv_recompute_threshold`), and they will still be there when
//! the read ends — judged with the clock offset to D when there is a sample, else with the
//! time-to-live counted from when P received the request (B2). Anything else is recomputed,
//! never read. Once reading, the lease both ways (B3) and the pull's checks ([`crate::pull`])
//! apply as to any other read.

use crate::clock::ClockOffset;
use crate::digest::{Bound, PromptDigest};
use crate::Nanos;
use std::fmt;
use std::time::Duration;

/// What D's params say of its cached turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedTurn<'a> {
    /// Tokens whose KV the blocks hold (the conversation up to D's last generated token).
    pub num_tokens: u32,
    /// Digest of those tokens bound to `fields` (SPEC S4).
    pub digest: PromptDigest,
    /// The fields the params name the blocks by (S4: bound by the digest).
    pub fields: Bound<'a>,
    /// `remote_blocks_expiry_time`, in nanoseconds of D's monotonic clock.
    pub expiry_ns: Option<u64>,
    /// `remote_blocks_ttl_remaining`: how long the blocks had left when D answered.
    pub ttl_remaining: Option<Duration>,
}

/// Why a cached turn is not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoReuse {
    /// The prompt does not start with the cached tokens (another conversation, an edited one),
    /// or the params' fields are not the ones D sent (S4: a router mangled them).
    NotAPrefix,
    /// The shared prefix is shorter than `kv_recompute_threshold`.
    BelowThreshold { tokens: u32, threshold: u32 },
    /// The blocks expire, or may, before a read would end (B2).
    Expiring,
}

impl NoReuse {
    /// Whether P releases the decoder's turn at once rather than leaving it to the decoder's
    /// TTL: the router hands a turn's params out once, so a turn not worth a read, or not of
    /// this prompt, nobody will read (O4). An expiring one goes by itself.
    pub fn releases_turn(&self) -> bool {
        matches!(self, NoReuse::BelowThreshold { .. } | NoReuse::NotAPrefix)
    }
}

impl fmt::Display for NoReuse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoReuse::NotAPrefix => write!(f, "the prompt does not extend the cached turn, or its params were altered"),
            NoReuse::BelowThreshold { tokens, threshold } => {
                write!(f, "a cached prefix of {tokens} tokens is below kv_recompute_threshold ({threshold})")
            }
            NoReuse::Expiring => write!(f, "the cached turn expires before a read would end"),
        }
    }
}

/// The plan for a next-turn prefill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnPlan {
    /// Read the first `blocks` of D's blocks, covering the prompt's first `tokens` tokens; prefill
    /// only the tokens after them. The last block may be partial: P's prefill writes the rest.
    Read { tokens: u32, blocks: u32 },
    /// Prefill the whole prompt.
    Recompute(NoReuse),
}

/// SPEC B2, B4: the plan for `prompt`, given D's cached `turn`. `received`: when P got the
/// request (the time-to-live counts from then); `margin`: how long the read may take.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    prompt: &[u32],
    turn: &CachedTurn<'_>,
    block_size: u32,
    threshold: u32,
    clock: Option<&ClockOffset>,
    received: Nanos,
    now: Nanos,
    margin: Duration,
) -> TurnPlan {
    let n = turn.num_tokens as usize;
    if n == 0 || n > prompt.len() || !turn.digest.describes(turn.num_tokens, &prompt[..n], &turn.fields) {
        return TurnPlan::Recompute(NoReuse::NotAPrefix);
    }
    if turn.num_tokens < threshold {
        return TurnPlan::Recompute(NoReuse::BelowThreshold { tokens: turn.num_tokens, threshold });
    }
    if !still_there(turn, clock, received, now, margin) {
        return TurnPlan::Recompute(NoReuse::Expiring);
    }
    TurnPlan::Read { tokens: turn.num_tokens, blocks: turn.num_tokens.div_ceil(block_size.max(1)) }
}

/// SPEC B2: with a clock sample, the expiry on D's clock, turned into ours with the offset and
/// its uncertainty; without, the time-to-live counted from when the request arrived. Either way
/// the read must end `margin` before it; without either, nothing is read.
fn still_there(turn: &CachedTurn<'_>, clock: Option<&ClockOffset>, received: Nanos, now: Nanos, margin: Duration) -> bool {
    if let (Some(expiry), Some(clock)) = (turn.expiry_ns, clock) {
        if clock.estimate(now).is_some() {
            return clock.usable(expiry, now, margin);
        }
    }
    match turn.ttl_remaining {
        Some(ttl) => received + ttl > now + margin,
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ClockSample;

    const S: u64 = 1_000_000_000;

    const FIELDS: Bound<'static> = Bound { engine_id: "d0", incarnation: 3, lease_id: 9, block_ids: &[7, 6, 5, 4, 3, 2, 1] };

    fn turn(tokens: &[u32], expiry_ns: Option<u64>, ttl: Option<Duration>) -> CachedTurn<'static> {
        CachedTurn {
            num_tokens: tokens.len() as u32,
            digest: PromptDigest::bound(tokens, &FIELDS),
            fields: FIELDS,
            expiry_ns,
            ttl_remaining: ttl,
        }
    }

    /// SPEC B4: only a prefix of the prompt is read, covering whole and partial blocks; another
    /// conversation, or a prefix below the threshold, is recomputed.
    #[test]
    fn b4_reads_only_a_prefix_of_the_prompt_above_the_threshold() {
        let prompt: Vec<u32> = (0..100).collect();
        let ttl = Some(Duration::from_secs(60));
        let t = turn(&prompt[..70], None, ttl);
        assert_eq!(plan(&prompt, &t, 16, 64, None, Nanos(0), Nanos(0), Duration::ZERO), TurnPlan::Read { tokens: 70, blocks: 5 });
        assert_eq!(
            plan(&prompt, &t, 16, 80, None, Nanos(0), Nanos(0), Duration::ZERO),
            TurnPlan::Recompute(NoReuse::BelowThreshold { tokens: 70, threshold: 80 })
        );
        let other: Vec<u32> = (1..71).collect();
        assert_eq!(
            plan(&prompt, &turn(&other, None, ttl), 16, 0, None, Nanos(0), Nanos(0), Duration::ZERO),
            TurnPlan::Recompute(NoReuse::NotAPrefix)
        );
        let longer: Vec<u32> = (0..101).collect();
        assert_eq!(
            plan(&prompt, &turn(&longer, None, ttl), 16, 0, None, Nanos(0), Nanos(0), Duration::ZERO),
            TurnPlan::Recompute(NoReuse::NotAPrefix)
        );
        // SPEC S4: the right conversation with its block list reordered by a router is not read.
        let mut mangled = turn(&prompt[..70], None, ttl);
        mangled.fields.block_ids = &[1, 2, 3, 4, 5, 6, 7];
        assert_eq!(plan(&prompt, &mangled, 16, 0, None, Nanos(0), Nanos(0), Duration::ZERO), TurnPlan::Recompute(NoReuse::NotAPrefix));
    }

    /// SPEC B2: with a clock sample, the expiry on D's clock decides, whatever the skew; without
    /// one, the time-to-live from when the request arrived; without either, no read.
    #[test]
    fn b2_expiry_is_judged_across_clocks_or_by_ttl() {
        let prompt: Vec<u32> = (0..100).collect();
        // D's clock is ten minutes ahead of ours.
        let skew = 600 * S;
        let mut clock = ClockOffset::default();
        clock.add(ClockSample { t0: 10 * S, t1: 10 * S + skew + 1_000, t2: 10 * S + skew + 2_000, t3: 10 * S + 3_000 });
        let now = Nanos(20 * S);
        let margin = Duration::from_secs(5);
        let d_now = now.0 + skew;
        let alive = turn(&prompt[..80], Some(d_now + 60 * S), None);
        assert!(matches!(plan(&prompt, &alive, 16, 64, Some(&clock), now, now, margin), TurnPlan::Read { .. }));
        let close = turn(&prompt[..80], Some(d_now + 4 * S), None);
        assert_eq!(plan(&prompt, &close, 16, 64, Some(&clock), now, now, margin), TurnPlan::Recompute(NoReuse::Expiring));
        // Without the offset, D's expiry (ten minutes "ahead") would have looked alive.
        let gone = turn(&prompt[..80], Some(d_now - S), None);
        assert_eq!(plan(&prompt, &gone, 16, 64, Some(&clock), now, now, margin), TurnPlan::Recompute(NoReuse::Expiring));
        // No sample: the TTL from arrival.
        let ttl = turn(&prompt[..80], Some(d_now + 60 * S), Some(Duration::from_secs(30)));
        assert!(matches!(plan(&prompt, &ttl, 16, 64, None, now, now + Duration::from_secs(20), margin), TurnPlan::Read { .. }));
        assert_eq!(plan(&prompt, &ttl, 16, 64, None, now, now + Duration::from_secs(26), margin), TurnPlan::Recompute(NoReuse::Expiring));
        assert_eq!(plan(&prompt, &turn(&prompt[..80], None, None), 16, 64, None, now, now, margin), TurnPlan::Recompute(NoReuse::Expiring));
    }
}
