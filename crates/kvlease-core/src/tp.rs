//! Heterogeneous tensor parallelism (SPEC T1, T2): which P rank each D rank reads, and which
//! slice of a block.
//!
//! Each rank of an engine holds a contiguous range of the KV heads, and within a block the heads
//! are the outermost dimension, so the heads two ranks share are one contiguous byte range in
//! either's block. D rank `d` reads from every P rank whose heads overlap its own; P expects one
//! read completion per such pair (SPEC P8).

use std::ops::Range;

/// One read of a pull: D rank `d_rank` reads heads `heads` from P rank `p_rank`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPair {
    pub d_rank: u32,
    pub p_rank: u32,
    pub heads: Range<u32>,
    /// Byte offset of those heads in P's block, and in D's, in units of one head's block bytes.
    pub p_head_offset: u32,
    pub d_head_offset: u32,
}

/// The reads of one pull, in a fixed order (the consumer rank of each is its index). `None` if
/// either TP size does not divide the number of heads.
pub fn read_plan(num_heads: u32, p_tp: u32, d_tp: u32) -> Option<Vec<ReadPair>> {
    if p_tp == 0 || d_tp == 0 || !num_heads.is_multiple_of(p_tp) || !num_heads.is_multiple_of(d_tp) {
        return None;
    }
    let (hp, hd) = (num_heads / p_tp, num_heads / d_tp);
    let mut plan = Vec::new();
    for d in 0..d_tp {
        for p in 0..p_tp {
            let (lo, hi) = ((d * hd).max(p * hp), ((d + 1) * hd).min((p + 1) * hp));
            if lo < hi {
                plan.push(ReadPair { d_rank: d, p_rank: p, heads: lo..hi, p_head_offset: lo - p * hp, d_head_offset: lo - d * hd });
            }
        }
    }
    Some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC T1, T2: every head is read exactly once, by the D rank that holds it, from the P rank
    /// that holds it; P TP > D TP gives several P ranks per D rank, D TP > P TP the reverse.
    #[test]
    fn t1_t2_every_head_read_once_from_its_holder() {
        for heads in [1u32, 2, 4, 8, 12] {
            for p_tp in 1..=heads {
                for d_tp in 1..=heads {
                    let Some(plan) = read_plan(heads, p_tp, d_tp) else {
                        assert!(!heads.is_multiple_of(p_tp) || !heads.is_multiple_of(d_tp));
                        continue;
                    };
                    let mut seen = vec![0; heads as usize];
                    for r in &plan {
                        for h in r.heads.clone() {
                            seen[h as usize] += 1;
                            assert_eq!(h / (heads / p_tp), r.p_rank);
                            assert_eq!(h / (heads / d_tp), r.d_rank);
                        }
                        assert_eq!(r.p_head_offset, r.heads.start - r.p_rank * (heads / p_tp));
                        assert_eq!(r.d_head_offset, r.heads.start - r.d_rank * (heads / d_tp));
                    }
                    assert!(seen.iter().all(|&n| n == 1), "{heads} heads, P tp {p_tp}, D tp {d_tp}");
                }
            }
        }
        assert_eq!(read_plan(4, 4, 2).map(|p| p.len()), Some(4));
        assert_eq!(read_plan(4, 1, 4).map(|p| p.len()), Some(4));
        assert_eq!(read_plan(4, 3, 1), None);
    }
}
