//! The KV block pool: which block ids are free. The bytes live in the ranks' arenas; a block id
//! names the same block in every rank's arena (each rank holds its shard of the heads).
//!
//! Blocks are handed out as a [`Blocks`] guard and come back when it is dropped, so every exit
//! path — finished, aborted, lease released, read ended — frees exactly once.

use crate::metrics::Metrics;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

#[derive(Debug)]
pub struct BlockPool {
    free: Mutex<Vec<u32>>,
    total: u32,
    metrics: Arc<Metrics>,
    /// Woken whenever blocks come back, so the scheduler can admit waiting requests.
    pub freed: Notify,
}

impl BlockPool {
    pub fn new(total: u32, metrics: Arc<Metrics>) -> Arc<BlockPool> {
        metrics.kv_blocks_total.store(i64::from(total), Relaxed);
        metrics.kv_blocks_free.store(i64::from(total), Relaxed);
        // Reversed so block 0 goes out first: easier to read in logs.
        Arc::new(BlockPool { free: Mutex::new((0..total).rev().collect()), total, metrics, freed: Notify::new() })
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    /// Blocks free now.
    pub fn free(&self) -> u32 {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len() as u32
    }

    /// `n` blocks, or `None` if fewer are free.
    pub fn alloc(self: &Arc<Self>, n: usize) -> Option<Blocks> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < n {
            return None;
        }
        let at = free.len() - n;
        let ids = free.split_off(at);
        self.metrics.kv_blocks_free.store(free.len() as i64, Relaxed);
        Some(Blocks { pool: self.clone(), ids })
    }
}

/// Owned blocks; dropping returns them to the pool.
#[derive(Debug)]
pub struct Blocks {
    pool: Arc<BlockPool>,
    ids: Vec<u32>,
}

impl Blocks {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

impl BlockPool {
    fn give_back(&self, ids: Vec<u32>) {
        if ids.is_empty() {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.extend(ids);
        self.metrics.kv_blocks_free.store(free.len() as i64, Relaxed);
        drop(free);
        self.freed.notify_waiters();
        self.freed.notify_one();
    }
}

impl Drop for Blocks {
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
        assert_eq!(m.kv_blocks_free.load(Relaxed), 1);
        drop(a);
        assert_eq!(m.kv_blocks_free.load(Relaxed), 4);
        assert_eq!(pool.alloc(4).map(|b| b.ids().len()), Some(4));
    }
}
