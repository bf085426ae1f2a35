//! A byte counter the core advances while it hashes, reads or writes tensor bytes, so that
//! another thread can show progress where the work actually happens (a mapped load reads the
//! file while hashing it, not when Python touches the tensors).

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of tensor data processed so far; shared by reference with the worker threads.
#[derive(Debug, Default)]
pub struct Progress(AtomicU64);

impl Progress {
    /// Counts `bytes` more as done.
    pub fn add(&self, bytes: u64) {
        self.0.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes done so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}
