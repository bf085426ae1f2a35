//! Advice to the kernel about fresh memory that the core is about to fill.
//!
//! A checkpoint loaded into new tensors writes every page of them once. With 4 KiB pages each
//! first write is a page fault (and a page to zero): for a 256 MiB state that is 65,536 faults,
//! more time than the copy itself. Transparent huge pages cut that to one fault per 2 MiB.
//! Where the system's THP mode is `madvise` (the common default) only memory advised with
//! `MADV_HUGEPAGE` gets them, so buffers are advised before they are filled.

/// Size of a transparent huge page on x86-64 and arm64 (4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// Buffers smaller than this are not advised: they may hold no whole huge page, and at most one.
pub const ADVISE_MIN_BYTES: usize = 2 * HUGE_PAGE;

/// Asks the kernel to back the whole, 2 MiB-aligned huge pages inside the `len` bytes at
/// `addr` with transparent huge pages when they are first touched. Only the part inside the
/// buffer is advised, so memory next to it (another allocation) keeps its policy. Returns
/// whether the advice was taken: false for a buffer under [`ADVISE_MIN_BYTES`], and where the
/// kernel refuses it (THP disabled or unsupported, not anonymous memory); the memory then
/// works as before, with base pages.
///
/// The advice changes no byte and no mapping: it is a hint, safe on memory the caller owns.
pub fn advise_huge_pages(addr: usize, len: usize) -> bool {
    match huge_interior(addr, len) {
        Some((start, interior)) => advise(start, interior),
        None => false,
    }
}

/// The whole huge pages inside the `len` bytes at `addr`, as `(start, len)`; None for a
/// buffer under [`ADVISE_MIN_BYTES`] or one that holds no whole huge page.
fn huge_interior(addr: usize, len: usize) -> Option<(usize, usize)> {
    if len < ADVISE_MIN_BYTES {
        return None;
    }
    let start = addr.div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let end = addr.checked_add(len)? / HUGE_PAGE * HUGE_PAGE;
    (end > start).then(|| (start, end - start))
}

#[cfg(target_os = "linux")]
fn advise(start: usize, len: usize) -> bool {
    // SAFETY: `start..start + len` lies inside memory the caller owns (page aligned: a huge
    // page is a multiple of the base page); MADV_HUGEPAGE changes no contents and no mapping.
    unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn advise(_start: usize, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer from the allocator (not aligned to a huge page on purpose).
    fn buffer(len: usize) -> Vec<u8> {
        vec![7u8; len + 1][1..].to_vec()
    }

    #[test]
    fn small_buffers_are_not_advised() {
        let data = buffer(ADVISE_MIN_BYTES - 1);
        assert!(!advise_huge_pages(data.as_ptr() as usize, data.len()));
    }

    #[test]
    fn advice_keeps_every_byte_and_the_buffer_stays_usable() {
        let mut data = buffer(16 << 20);
        let addr = data.as_ptr() as usize;
        // Taken or refused (THP off, an emulator): the bytes are the same either way. That the
        // advice reaches the kernel is checked from Python (tests/test_load_memory.py: VmFlags).
        advise_huge_pages(addr, data.len());
        assert!(data.iter().all(|&b| b == 7));
        data.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        assert!(data.iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    #[test]
    fn only_whole_huge_pages_inside_the_buffer_are_advised() {
        let page = HUGE_PAGE;
        // Unaligned at both ends: the pages wholly inside, nothing beyond either end.
        assert_eq!(
            huge_interior(10 * page + 4096, 5 * page),
            Some((11 * page, 4 * page))
        );
        // Aligned: all of it.
        assert_eq!(
            huge_interior(10 * page, 4 * page),
            Some((10 * page, 4 * page))
        );
        // Unaligned and just large enough: the one whole page inside.
        assert_eq!(
            huge_interior(10 * page + 1, 2 * page),
            Some((11 * page, page))
        );
        assert_eq!(huge_interior(10 * page, ADVISE_MIN_BYTES - 1), None);
        assert_eq!(huge_interior(usize::MAX - page, 3 * page), None);
    }
}
