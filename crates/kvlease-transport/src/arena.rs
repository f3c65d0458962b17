//! Registered block memory: the bytes of a rank's KV cache, shared by the engine (which writes
//! blocks it owns) and the agent (which copies leased blocks out, or fetched blocks in).
//!
//! Like GPU memory registered with NIXL, the arena is raw: who may touch which block when is
//! decided by the engine's block pool and the lease table (a leased block is never written; a
//! block being read is never reused, SPEC P5). The accessors are therefore `unsafe`: they copy
//! through raw pointers, or lend a range to a closure for the closure's run only (the engine's
//! emulated compute reads and writes its own blocks in place); no reference outlives a call.

use std::sync::Arc;

/// Alignment of an arena's start (a cache line).
const ARENA_ALIGN: usize = 64;

/// A fixed array of `num_blocks` blocks of `block_bytes` bytes each, 64-byte aligned.
pub struct BlockArena {
    /// The 64-byte aligned start; `base` is the allocation's.
    ptr: *mut u8,
    base: *mut u8,
    layout: std::alloc::Layout,
    size: usize,
    num_blocks: u32,
    block_bytes: usize,
}

// SAFETY: the arena is plain memory; access discipline is the callers' (see the module doc).
unsafe impl Send for BlockArena {}
unsafe impl Sync for BlockArena {}

impl std::fmt::Debug for BlockArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockArena").field("num_blocks", &self.num_blocks).field("block_bytes", &self.block_bytes).finish()
    }
}

impl BlockArena {
    /// Zeroed memory for `num_blocks` blocks of `block_bytes` (both > 0); panics where
    /// [`BlockArena::try_new`] errs (tests and tools with fixed sizes).
    pub fn new(num_blocks: u32, block_bytes: usize) -> Arc<BlockArena> {
        Self::try_new(num_blocks, block_bytes).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Zeroed memory for `num_blocks` blocks of `block_bytes`, or why not: an empty geometry,
    /// a size past the address space, or memory the system will not give (a configured
    /// `--num-gpu-blocks` too large for this machine is an error to report, not an abort).
    pub fn try_new(num_blocks: u32, block_bytes: usize) -> Result<Arc<BlockArena>, ArenaError> {
        if num_blocks == 0 || block_bytes == 0 {
            return Err(ArenaError::Empty);
        }
        let too_big = || ArenaError::TooBig { num_blocks, block_bytes };
        let size = (num_blocks as usize).checked_mul(block_bytes).ok_or_else(too_big)?;
        // Allocated with the allocator's own alignment and aligned here: `alloc_zeroed` with
        // an alignment above it writes every byte (a 10 GiB arena resident at start), where
        // this is `calloc`, whose large blocks are fresh zero pages taking memory only once
        // touched.
        let padded = size.checked_add(ARENA_ALIGN).ok_or_else(too_big)?;
        let layout = std::alloc::Layout::from_size_align(padded, 16).map_err(|_| too_big())?;
        // SAFETY: padded > 0.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(ArenaError::NoMemory { size, num_blocks, block_bytes });
        }
        // Computed, not `align_offset`, which may answer "impossible" (usize::MAX) by contract.
        let skip = (ARENA_ALIGN - base as usize % ARENA_ALIGN) % ARENA_ALIGN;
        // SAFETY: skip < ARENA_ALIGN, so the padding leaves `size` bytes after the aligned start.
        let ptr = unsafe { base.add(skip) };
        Ok(Arc::new(BlockArena { ptr, base, layout, size, num_blocks, block_bytes }))
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Base address and length, for registration with a NIC.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.size
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `len` bytes at `offset` in `block` lie inside the arena.
    pub fn contains(&self, block: u32, offset: usize, len: usize) -> bool {
        block < self.num_blocks && offset.checked_add(len).is_some_and(|end| end <= self.block_bytes)
    }

    /// `Ok` if `len` bytes at `offset` in `block` lie inside the arena; otherwise why not, naming
    /// the arena as `whose` ("our", or a peer's name).
    pub fn check(&self, block: u32, offset: u32, len: u32, whose: &str) -> Result<(), OutOfRange> {
        if self.contains(block, offset as usize, len as usize) {
            return Ok(());
        }
        Err(OutOfRange { block, offset, len, whose: whose.to_string(), num_blocks: self.num_blocks, block_bytes: self.block_bytes })
    }

    /// Copies `dst.len()` bytes from `offset` in `block` into `dst`.
    ///
    /// # Safety
    /// The range must be inside the arena ([`BlockArena::contains`]) and nobody may be writing it.
    pub unsafe fn copy_out(&self, block: u32, offset: usize, dst: &mut [u8]) {
        debug_assert!(self.contains(block, offset, dst.len()));
        let src = self.ptr.add(block as usize * self.block_bytes + offset);
        std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
    }

    /// Copies `src` to `offset` in `block`.
    ///
    /// # Safety
    /// The range must be inside the arena and owned by the caller: nobody else reads or writes it.
    pub unsafe fn copy_in(&self, block: u32, offset: usize, src: &[u8]) {
        debug_assert!(self.contains(block, offset, src.len()));
        let dst = self.ptr.add(block as usize * self.block_bytes + offset);
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
    }

    /// Runs `f` on the `len` bytes at `offset` in `block`, in place.
    ///
    /// # Safety
    /// As [`BlockArena::copy_out`]: in range, and nobody writes it while `f` runs.
    pub unsafe fn read_in_place<R>(&self, block: u32, offset: usize, len: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        debug_assert!(self.contains(block, offset, len));
        f(std::slice::from_raw_parts(self.ptr.add(block as usize * self.block_bytes + offset), len))
    }

    /// Runs `f` on the `len` bytes at `offset` in `block`, to write them in place.
    ///
    /// # Safety
    /// As [`BlockArena::copy_in`]: in range and owned by the caller, nobody else reads or writes
    /// it while `f` runs.
    pub unsafe fn write_in_place<R>(&self, block: u32, offset: usize, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
        debug_assert!(self.contains(block, offset, len));
        f(std::slice::from_raw_parts_mut(self.ptr.add(block as usize * self.block_bytes + offset), len))
    }
}

/// The message for a segment outside an arena of `num_blocks` blocks of `block_bytes` bytes.
/// Why an arena could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    #[error("an arena needs at least one non-empty block")]
    Empty,
    #[error("a KV arena of {num_blocks} blocks of {block_bytes} bytes does not fit in memory")]
    TooBig { num_blocks: u32, block_bytes: usize },
    #[error("cannot allocate {size} bytes for the KV arena ({num_blocks} blocks of {block_bytes} bytes)")]
    NoMemory { size: usize, num_blocks: u32, block_bytes: usize },
}

/// A range of bytes outside an arena ("our", or the peer `whose`'s, of `num_blocks` blocks of
/// `block_bytes`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("block {block} bytes {offset}..+{len} is outside {} of {num_blocks} blocks of {block_bytes} bytes", arena_name(whose))]
pub struct OutOfRange {
    pub block: u32,
    pub offset: u32,
    pub len: u32,
    pub whose: String,
    pub num_blocks: u32,
    pub block_bytes: usize,
}

fn arena_name(whose: &str) -> String {
    if whose == "our" {
        "our arena".to_string()
    } else {
        format!("{whose}'s arena")
    }
}

/// Crosses the wire (and the `Agent` trait) as its message.
impl From<OutOfRange> for crate::TransportError {
    fn from(e: OutOfRange) -> Self {
        crate::TransportError::OutOfRange(e.to_string())
    }
}

impl Drop for BlockArena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.base, self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message names the block, the bytes and whose arena (it crosses the wire as text).
    #[test]
    fn out_of_range_names_the_block_the_bytes_and_the_arena() {
        let a = BlockArena::new(4, 128);
        assert_eq!(a.check(3, 100, 28, "our"), Ok(()));
        assert_eq!(
            a.check(3, 100, 29, "our").unwrap_err().to_string(),
            "block 3 bytes 100..+29 is outside our arena of 4 blocks of 128 bytes"
        );
        assert_eq!(
            a.check(4, 0, 1, "p/1/0").unwrap_err().to_string(),
            "block 4 bytes 0..+1 is outside p/1/0's arena of 4 blocks of 128 bytes"
        );
        let e: crate::TransportError = a.check(u32::MAX, u32::MAX, u32::MAX, "our").unwrap_err().into();
        assert!(matches!(e, crate::TransportError::OutOfRange(m) if m.starts_with("block 4294967295 bytes")));
    }

    /// Resident memory of this process, bytes (Linux).
    fn resident() -> u64 {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
        statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
    }

    /// An arena starts 64-byte aligned, zeroed, and takes memory only for the blocks touched
    /// (sizes it cannot have are errors, not aborts):
    /// a 4 GiB arena (the simulator's P is sized for every request a run could bring) does not
    /// become resident when created.
    #[test]
    fn arenas_are_aligned_zeroed_and_lazy() {
        for (n, b) in [(1, 1), (3, 100), (1000, 4096)] {
            let a = BlockArena::new(n, b);
            assert_eq!(a.as_ptr() as usize % ARENA_ALIGN, 0);
            assert_eq!(a.len(), n as usize * b);
            let mut seen = vec![1u8; b];
            // SAFETY: block n-1 is in range; nothing else touches this arena.
            unsafe { a.copy_out(n - 1, 0, &mut seen) };
            assert!(seen.iter().all(|&x| x == 0));
        }
        assert!(BlockArena::try_new(0, 8).is_err() && BlockArena::try_new(8, 0).is_err());
        let refused = BlockArena::try_new(u32::MAX, usize::MAX / 2).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("does not fit"), "a size past the address space is an error, not an abort: {refused}");
        let refused = BlockArena::try_new(u32::MAX, 1 << 20).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("cannot allocate"), "memory the system will not give (4 PiB) is an error: {refused}");
        let before = resident();
        let big = BlockArena::new(1 << 20, 4096);
        let grown = resident().saturating_sub(before);
        assert!(grown < 256 << 20, "a 4 GiB arena made {grown} bytes resident at creation");
        // SAFETY: block 7 is in range.
        unsafe { big.copy_in(7, 0, &[9u8; 4096]) };
        let mut back = [0u8; 4096];
        unsafe { big.copy_out(7, 0, &mut back) };
        assert_eq!(back, [9u8; 4096]);
    }
}
