//! The KV block pool: which block ids are free. The bytes live in the ranks' arenas; a block id
//! names the same block in every rank's arena (each rank holds its shard of the heads).
//!
//! Blocks are handed out as a [`Blocks`] guard and come back when it is dropped, so every exit
//! path — finished, aborted, lease released, read ended — frees exactly once.

use crate::metrics::Metrics;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

#[derive(Debug)]
pub struct BlockPool {
    free: Mutex<Free>,
    total: u32,
    metrics: Arc<Metrics>,
    /// Woken whenever blocks come back, so the scheduler can admit waiting requests.
    pub freed: Notify,
}

impl BlockPool {
    pub fn new(total: u32, metrics: Arc<Metrics>) -> Arc<BlockPool> {
        metrics.kv_blocks_total.set(i64::from(total));
        metrics.kv_blocks_free.set(i64::from(total));
        Arc::new(BlockPool { free: Mutex::new(Free { returned: Vec::new(), fresh: 0, total }), total, metrics, freed: Notify::new() })
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    /// Blocks free now.
    pub fn free(&self) -> u32 {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// `n` blocks, or `None` if fewer are free.
    pub fn alloc(self: &Arc<Self>, n: usize) -> Option<Blocks> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let ids = free.take(n)?;
        self.metrics.kv_blocks_free.set(i64::from(free.len()));
        Some(Blocks(Arc::new(Owned { pool: self.clone(), ids })))
    }
}

/// The free blocks: those given back (a stack), then those never handed out, `fresh..total`.
/// Blocks never used take no memory, so a pool sized for every request a simulated run could
/// bring costs nothing up front. It hands out ids in the order of a stack that started as
/// `total-1, …, 1, 0` (block 0 first: easier to read in logs): the last given back first, then
/// fresh ids, each allocation listing its fresh ids highest first.
#[derive(Debug)]
struct Free {
    returned: Vec<u32>,
    fresh: u32,
    total: u32,
}

impl Free {
    fn len(&self) -> u32 {
        self.returned.len() as u32 + (self.total - self.fresh)
    }

    fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.len() as usize {
            return None;
        }
        let from_fresh = n.saturating_sub(self.returned.len()) as u32;
        let mut ids: Vec<u32> = (self.fresh..self.fresh + from_fresh).rev().collect();
        self.fresh += from_fresh;
        let at = self.returned.len() - (n - from_fresh as usize);
        ids.extend(self.returned.drain(at..));
        Some(ids)
    }
}

/// Owned blocks; dropping returns them to the pool, once every hold on them ([`Blocks::pin`]) is
/// dropped.
#[derive(Debug)]
pub struct Blocks(Arc<Owned>);

#[derive(Debug)]
struct Owned {
    pool: Arc<BlockPool>,
    ids: Vec<u32>,
}

impl Blocks {
    pub fn ids(&self) -> &[u32] {
        &self.0.ids
    }

    /// Another hold on the same blocks, for a reader that must see them unchanged while their
    /// owner may let them go (a push prefill's source blocks, handed to the lease as P computes
    /// its first token from them): no block goes back to the pool before every hold is dropped.
    pub(crate) fn pin(&self) -> Blocks {
        Blocks(self.0.clone())
    }
}

impl BlockPool {
    fn give_back(&self, ids: Vec<u32>) {
        if ids.is_empty() {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.returned.extend(ids);
        self.metrics.kv_blocks_free.set(i64::from(free.len()));
        drop(free);
        self.freed.notify_waiters();
        self.freed.notify_one();
    }
}

/// The holder keeps leased and quarantined blocks as this guard (SPEC P5).
impl kvlease_core::holder::BlockGuard for Blocks {
    fn ids(&self) -> &[u32] {
        &self.0.ids
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.ids));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_back_on_drop_exactly_once() {
        let m = Arc::new(Metrics::default());
        let pool = BlockPool::new(4, m.clone());
        let a = pool.alloc(3).unwrap();
        assert!(pool.alloc(2).is_none());
        assert_eq!(m.kv_blocks_free.get(), 1);
        drop(a);
        assert_eq!(m.kv_blocks_free.get(), 4);
        assert_eq!(pool.alloc(4).map(|b| b.ids().len()), Some(4));
    }

    /// A pinned block goes back only when its owner and every pin are dropped, in any order.
    #[test]
    fn pinned_blocks_come_back_after_the_last_hold() {
        let m = Arc::new(Metrics::default());
        let pool = BlockPool::new(4, m.clone());
        let a = pool.alloc(3).unwrap();
        let pin = a.pin();
        assert_eq!(pin.ids(), a.ids());
        drop(a);
        assert_eq!(m.kv_blocks_free.get(), 1, "the pin still holds the blocks");
        assert!(pool.alloc(2).is_none());
        drop(pin);
        assert_eq!(m.kv_blocks_free.get(), 4);
    }

    /// The lazy free list hands out exactly the ids, in exactly the order, of the stack it
    /// replaced (`total-1, …, 0`, split off at the top, given back on top): the simulator's
    /// seeded runs stay the same, and no id is ever out twice.
    #[test]
    fn lazy_free_list_hands_out_what_the_eager_stack_did() {
        let total = 200u32;
        let pool = BlockPool::new(total, Arc::new(Metrics::default()));
        let mut stack: Vec<u32> = (0..total).rev().collect();
        let mut held: Vec<Blocks> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..5_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if !x.is_multiple_of(3) || held.is_empty() {
                let n = (x >> 8) as usize % 40;
                let want = (stack.len() >= n).then(|| stack.split_off(stack.len() - n));
                let got = pool.alloc(n);
                assert_eq!(got.as_ref().map(|b| b.ids().to_vec()), want);
                held.extend(got);
            } else {
                let b = held.swap_remove((x >> 8) as usize % held.len());
                stack.extend_from_slice(b.ids());
                drop(b);
            }
            assert_eq!(pool.free() as usize, stack.len());
        }
    }
}
