//! Content digests: BLAKE3 of each buffer, for deciding that a tensor is unchanged.
//!
//! crc32c (see `checksum`) detects damage to bytes already chosen; it is too weak to prove
//! that two versions of a tensor are equal (one in 2^32 changed tensors would collide and be
//! skipped silently). An incremental save therefore compares a 256-bit BLAKE3 digest of the
//! bytes it would write with the digest of the bytes it wrote last time: equal digests mean
//! equal bytes for any input a training run produces.
//!
//! [`digest_all`] hashes many buffers on a few threads, largest first (one buffer is one
//! thread's job: BLAKE3 with SIMD hashes several GB/s per core).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::threads::on_threads;

/// Length of a digest in bytes.
pub const DIGEST_LEN: usize = 32;

/// A BLAKE3 digest.
pub type Digest = [u8; DIGEST_LEN];

/// BLAKE3 of `bytes`.
pub fn digest(bytes: &[u8]) -> Digest {
    *blake3::hash(bytes).as_bytes()
}

/// The digest of every buffer of `inputs`, in order, computed on up to `threads` threads (the
/// caller's among them). A thread the process may not start (its thread limit) is left out:
/// the others, the caller's alone if need be, hash its share.
pub fn digest_all(inputs: &[&[u8]], threads: usize) -> Vec<Digest> {
    let mut order: Vec<usize> = (0..inputs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(inputs[i].len()));
    let threads = threads.clamp(1, inputs.len().max(1));
    let next = AtomicUsize::new(0);
    let mut results = vec![[0u8; DIGEST_LEN]; inputs.len()];
    let run = || {
        let mut mine = Vec::new();
        loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = order.get(k) else { break };
            mine.push((i, digest(inputs[i])));
        }
        mine
    };
    let done: Vec<Vec<(usize, Digest)>> = on_threads(threads, run);
    for (i, value) in done.into_iter().flatten() {
        results[i] = value;
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        // BLAKE3 of the empty input (the reference test vector).
        let hex: String = digest(b"").iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }

    #[test]
    fn parallel_digests_equal_serial_ones_in_input_order() {
        let data: Vec<Vec<u8>> = (0..37)
            .map(|n| {
                (0..(n * 1031 % 70_000))
                    .map(|i| (i * 7 + n) as u8)
                    .collect()
            })
            .collect();
        let inputs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let serial: Vec<Digest> = inputs.iter().map(|b| digest(b)).collect();
        for threads in [1, 2, 5, 64] {
            assert_eq!(digest_all(&inputs, threads), serial);
        }
        assert!(digest_all(&[], 4).is_empty());
    }

    #[test]
    fn one_flipped_bit_changes_the_digest() {
        let mut data = vec![0u8; 1 << 20];
        let before = digest(&data);
        data[654_321] ^= 0x10;
        assert_ne!(digest(&data), before);
    }
}
