//! A counting global allocator for the benches' memory figures, shared by the bench targets
//! (`#[path]`-included; each target installs it as its global allocator).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::Relaxed};

/// Counts the bytes held by allocations made while `COUNTING` is set (net of frees then).
pub struct Counting;
pub static COUNTING: AtomicBool = AtomicBool::new(false);
pub static HELD: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            HELD.fetch_add(l.size() as isize, Relaxed);
        }
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if COUNTING.load(Relaxed) {
            HELD.fetch_sub(l.size() as isize, Relaxed);
        }
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            HELD.fetch_add(new as isize - l.size() as isize, Relaxed);
        }
        unsafe { System.realloc(p, l, new) }
    }
}

/// Runs `f` with the allocator counting.
pub fn counted<R>(f: impl FnOnce() -> R) -> R {
    COUNTING.store(true, Relaxed);
    let r = f();
    COUNTING.store(false, Relaxed);
    r
}
