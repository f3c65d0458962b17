//! Registered block memory: the bytes of a rank's KV cache, shared by the engine (which writes
//! blocks it owns) and the agent (which copies leased blocks out, or fetched blocks in).
//!
//! Like GPU memory registered with NIXL, the arena is raw: who may touch which block when is
//! decided by the engine's block pool and the lease table (a leased block is never written; a
//! block being read is never reused, SPEC P5). The accessors are therefore `unsafe`: they copy
//! through raw pointers, or lend a range to a closure for the closure's run only (the engine's
//! emulated compute reads and writes its own blocks in place); no reference outlives a call.

use std::sync::Arc;

/// A fixed array of `num_blocks` blocks of `block_bytes` bytes each, 64-byte aligned.
pub struct BlockArena {
    ptr: *mut u8,
    layout: std::alloc::Layout,
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
    /// Zeroed memory for `num_blocks` blocks of `block_bytes` (both > 0).
    pub fn new(num_blocks: u32, block_bytes: usize) -> Arc<BlockArena> {
        assert!(num_blocks > 0 && block_bytes > 0, "an arena needs at least one non-empty block");
        let size = (num_blocks as usize).checked_mul(block_bytes).expect("arena size overflows usize");
        let layout = std::alloc::Layout::from_size_align(size, 64).expect("arena layout");
        // SAFETY: size > 0.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Arc::new(BlockArena { ptr, layout, num_blocks, block_bytes })
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
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether `len` bytes at `offset` in `block` lie inside the arena.
    pub fn contains(&self, block: u32, offset: usize, len: usize) -> bool {
        block < self.num_blocks && offset.checked_add(len).is_some_and(|end| end <= self.block_bytes)
    }

    /// `Ok` if `len` bytes at `offset` in `block` lie inside the arena; otherwise a message that
    /// says so, naming the arena as `whose` ("our", or a peer's name).
    pub fn check(&self, block: u32, offset: u32, len: u32, whose: &str) -> Result<(), String> {
        if self.contains(block, offset as usize, len as usize) {
            return Ok(());
        }
        Err(out_of_range(block, offset, len, whose, self.num_blocks, self.block_bytes))
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
pub(crate) fn out_of_range(block: u32, offset: u32, len: u32, whose: &str, num_blocks: u32, block_bytes: usize) -> String {
    let arena = if whose == "our" { "our arena".to_string() } else { format!("{whose}'s arena") };
    format!("block {block} bytes {offset}..+{len} is outside {arena} of {num_blocks} blocks of {block_bytes} bytes")
}

impl Drop for BlockArena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}
