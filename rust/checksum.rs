//! crc32c (Castagnoli) checksums, hardware accelerated (SSE4.2 / ARMv8 CRC) by the `crc32c`
//! crate. Tensors are hashed in pieces by several threads; [`Crc32c`] folds the pieces back
//! into the checksum of the whole tensor without re-reading any byte.

/// crc32c of `bytes`, continuing from `crc` (start with 0).
pub fn append(crc: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, bytes)
}

/// Checksum of the concatenation A ++ B given crc(A), crc(B) and len(B).
pub fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    crc32c::crc32c_combine(crc_a, crc_b, len_b as usize)
}

/// Checksum of `first` followed by parts given as `(crc, len)`, in order.
pub fn concat(first: u32, parts: impl IntoIterator<Item = (u32, u64)>) -> u32 {
    parts
        .into_iter()
        .fold(first, |acc, (crc, len)| combine(acc, crc, len))
}

/// A piece of some tensor that was hashed independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceCrc {
    /// Which tensor (index into the caller's tensor list).
    pub tensor: usize,
    /// Offset of the piece inside the tensor.
    pub offset: u64,
    /// Length of the piece.
    pub len: u64,
    /// crc32c of the piece alone.
    pub crc: u32,
}

/// Folds independently hashed pieces into one crc32c per tensor.
///
/// `pieces` may come in any order; together they must tile each tensor exactly (the writer
/// and reader guarantee it; a gap or overlap is a bug and panics in debug builds).
pub fn fold(num_tensors: usize, pieces: &mut [PieceCrc]) -> Vec<u32> {
    pieces.sort_unstable_by_key(|p| (p.tensor, p.offset));
    let mut crcs = vec![0u32; num_tensors];
    let mut next_offset = vec![0u64; num_tensors];
    for piece in pieces.iter() {
        debug_assert_eq!(
            next_offset[piece.tensor], piece.offset,
            "pieces must tile tensors"
        );
        crcs[piece.tensor] = combine(crcs[piece.tensor], piece.crc, piece.len);
        next_offset[piece.tensor] = piece.offset + piece.len;
    }
    crcs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        // The standard crc32c check value.
        assert_eq!(append(0, b"123456789"), 0xe306_9283);
        assert_eq!(append(0, b""), 0);
    }

    #[test]
    fn folding_pieces_equals_hashing_whole() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let whole = append(0, &data);
        let cuts = [0usize, 1, 700, 4096, 9999, 10_000];
        let mut pieces: Vec<PieceCrc> = cuts
            .windows(2)
            .map(|w| PieceCrc {
                tensor: 0,
                offset: w[0] as u64,
                len: (w[1] - w[0]) as u64,
                crc: append(0, &data[w[0]..w[1]]),
            })
            .rev()
            .collect();
        assert_eq!(fold(1, &mut pieces), vec![whole]);
    }

    #[test]
    fn concat_equals_hashing_the_concatenation() {
        let (a, b, c) = (&b"header"[..], &b""[..], &b"tensor bytes"[..]);
        let parts = [(append(0, b), 0), (append(0, c), c.len() as u64)];
        assert_eq!(
            concat(append(0, a), parts),
            append(0, b"headertensor bytes")
        );
    }

    #[test]
    fn empty_tensor_has_zero_crc() {
        assert_eq!(fold(2, &mut []), vec![0, 0]);
    }
}
