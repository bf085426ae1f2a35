//! Writing a safetensors file: chunk planning and parallel positional writes with the
//! checksum fused into the same pass, optionally O_DIRECT.
//!
//! The file is cut into chunks of `chunk_size` bytes at aligned absolute offsets and written
//! as one sequential stream, the access pattern of the disk's own ceiling:
//! - O_DIRECT: preparer threads copy each chunk into a reusable aligned buffer, computing the
//!   crc32c of every piece while it is hot in cache, ahead of one thread that issues the
//!   writes in file order (CPU work overlaps the disk).
//! - buffered: one thread hashes and `pwrite`s straight from tensor memory, with write-behind
//!   (`sync_file_range`) so the final fsync has little left to flush.
//!
//! The header goes in last, once the checksums are known; it has the same length as the
//! placeholder the plan was made with. The file is written into a temporary sibling that
//! [`crate::replace`] commits over the final path (fsync, rename, fsync of the directory).

use std::alloc::{self, Layout};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard, TryLockError};

use crate::checksum::{self, PieceCrc};
use crate::error::{Error, Result};
use crate::format::{self, Checksums, TensorDesc, TensorInfo};
use crate::progress::Progress;
use crate::replace::TempFile;

/// Alignment of chunk offsets and O_DIRECT buffers (a page; covers 512 B and 4 KiB sectors).
pub const ALIGN: u64 = 4096;
/// Bytes hashed and written per step inside a chunk: small enough to stay in cache between
/// the checksum and the copy.
pub(crate) const PIECE: usize = 1 << 20;
/// Buffered writes keep at most this many chunks of dirty pages before waiting for writeback.
const WRITE_BEHIND: usize = 2;
/// Default chunk size (the one definition: Python reads it as
/// `fastckpt._native.DEFAULT_CHUNK_SIZE`). 16 MiB measured fastest on the development VM,
/// ahead of 8 and 32 MiB (2.3 vs 1.6 GiB/s median at 32 MiB, commit 4f70a5f).
pub const DEFAULT_CHUNK_SIZE: u64 = 16 << 20;
/// Default number of writer threads: one preparer (copy + crc32c) ahead of one writer,
/// measured fastest on a 2-core machine (the one definition: Python reads it as
/// `fastckpt._native.DEFAULT_WRITE_THREADS`).
pub const DEFAULT_WRITE_THREADS: usize = 2;

/// How to write a file.
#[derive(Debug, Clone, Copy)]
pub struct WriteOptions {
    /// Threads: with O_DIRECT, `threads - 1` (at least one) prepare chunks and one writes.
    pub threads: usize,
    /// Chunk size in bytes (rounded up to [`ALIGN`]).
    pub chunk_size: u64,
    /// Try O_DIRECT; falls back to buffered writes when the filesystem refuses it.
    pub direct_io: bool,
    /// fsync the file and its directory (durability). Only benchmarks turn this off.
    pub fsync: bool,
    /// Compute and store per-tensor crc32c checksums (on by default; off only to measure
    /// their cost).
    pub checksums: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            threads: DEFAULT_WRITE_THREADS,
            chunk_size: DEFAULT_CHUNK_SIZE,
            direct_io: false,
            fsync: true,
            checksums: true,
        }
    }
}

/// What a write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteReport {
    /// Size of the committed file.
    pub file_len: u64,
    /// Whether O_DIRECT was actually used for the data (false after a fallback).
    pub direct_io: bool,
    /// crc32c per tensor name, in data order (empty when checksums are off).
    pub checksums: Vec<(String, u32)>,
    /// crc32c of the whole file (header included), when checksums are on.
    pub file_crc32c: Option<u32>,
}

/// One contiguous run of a tensor's bytes inside a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index of the tensor in data order.
    pub tensor: usize,
    /// Offset inside the tensor's bytes.
    pub tensor_offset: u64,
    /// Absolute offset in the file.
    pub file_offset: u64,
    pub len: u64,
}

/// A unit of work for one writer thread: an aligned file range and the tensor bytes in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Absolute, [`ALIGN`]-aligned start of the range.
    pub file_offset: u64,
    /// Length of the range (only the last chunk may be shorter than the chunk size).
    pub len: u64,
    pub segments: Vec<Segment>,
}

/// Rounds a requested chunk size to a usable one (a positive multiple of [`ALIGN`]).
pub fn normalize_chunk_size(chunk_size: u64) -> u64 {
    chunk_size.max(ALIGN).div_ceil(ALIGN) * ALIGN
}

/// Cuts the file `[0, data_start + data_len)` into aligned chunks of `chunk_size` and lists the
/// tensor segments each one holds. The header region `[0, data_start)` belongs to the first
/// chunk but has no segments: it is written separately, last.
pub fn plan_chunks(tensors: &[TensorInfo], data_start: u64, chunk_size: u64) -> Vec<Chunk> {
    let chunk_size = normalize_chunk_size(chunk_size);
    let file_len = data_start + tensors.last().map_or(0, |t| t.end);
    let mut chunks: Vec<Chunk> = (0..file_len.div_ceil(chunk_size))
        .map(|k| {
            let start = k * chunk_size;
            Chunk {
                file_offset: start,
                len: chunk_size.min(file_len - start),
                segments: Vec::new(),
            }
        })
        .collect();
    for (index, tensor) in tensors.iter().enumerate() {
        let mut pos = data_start + tensor.begin;
        let end = data_start + tensor.end;
        while pos < end {
            let chunk = (pos / chunk_size) as usize;
            let chunk_end = (chunk as u64 + 1) * chunk_size;
            let len = chunk_end.min(end) - pos;
            chunks[chunk].segments.push(Segment {
                tensor: index,
                tensor_offset: pos - data_start - tensor.begin,
                file_offset: pos,
                len,
            });
            pos += len;
        }
    }
    chunks
}

/// A zeroed, [`ALIGN`]-aligned heap buffer for O_DIRECT writes.
pub(crate) struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain heap memory owned by this value; moving it between threads is
// fine and it is only ever accessed through `&mut self`.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len, ALIGN as usize).expect("chunk size fits a Layout")
    }

    pub(crate) fn new(len: usize) -> AlignedBuf {
        Self::try_new(len).unwrap_or_else(|_| alloc::handle_alloc_error(Self::layout(len)))
    }

    /// Like [`AlignedBuf::new`], but a failed allocation is an `ENOMEM` error instead of an
    /// abort of the whole process (a buffer sized by a caller's `chunk_size`).
    pub(crate) fn try_new(len: usize) -> io::Result<AlignedBuf> {
        let layout = Layout::from_size_align(len, ALIGN as usize)
            .map_err(|_| io::Error::from_raw_os_error(libc::ENOMEM))?;
        // SAFETY: `layout` has a non-zero size (chunk sizes are >= ALIGN).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        Ok(AlignedBuf { ptr, len })
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` initialized (zeroed at allocation) bytes we own.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// O_DIRECT buffers are kept between saves: fresh pages cost a page fault each, and a training
/// job saves the same sizes over and over. Bounded by threads x chunk size of the last saves.
static BUFFER_POOL: Mutex<Vec<AlignedBuf>> = Mutex::new(Vec::new());
const MAX_POOLED_BUFFERS: usize = 16;

/// The process that first used [`BUFFER_POOL`] (0: none yet). An atomic, not a lazily
/// initialized cell: a fork during another thread's first use must not leave the child
/// waiting for that initialization.
static POOL_OWNER: AtomicU32 = AtomicU32::new(0);

/// [`BUFFER_POOL`], locked; None in the child of a `fork()` when the pool is locked: a thread
/// of the parent may have held it at the fork, and that thread does not exist in the child,
/// so waiting would hang the child's save for good (it allocates its buffers instead).
fn buffer_pool() -> Option<MutexGuard<'static, Vec<AlignedBuf>>> {
    let me = std::process::id();
    let owner = match POOL_OWNER.compare_exchange(0, me, Ordering::Relaxed, Ordering::Relaxed) {
        Ok(_) => me,
        Err(first) => first,
    };
    match BUFFER_POOL.try_lock() {
        Ok(pool) => Some(pool),
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) if owner != me => None,
        Err(TryLockError::WouldBlock) => {
            Some(BUFFER_POOL.lock().unwrap_or_else(|e| e.into_inner()))
        }
    }
}

/// A buffer of at least `len` bytes: the smallest pooled one that is long enough (callers
/// use its first `len` bytes), else a new one. A small file's save therefore reuses the
/// chunk-sized buffers of the saves around it instead of evicting them.
fn take_buffer(len: usize) -> io::Result<AlignedBuf> {
    let Some(mut pool) = buffer_pool() else {
        return AlignedBuf::try_new(len);
    };
    let fitting = (0..pool.len())
        .filter(|&i| pool[i].len >= len)
        .min_by_key(|&i| pool[i].len);
    match fitting {
        Some(i) => Ok(pool.swap_remove(i)),
        None => AlignedBuf::try_new(len),
    }
}

/// Keeps `buf` for a later save; a full pool keeps its longest buffers (at most
/// [`MAX_POOLED_BUFFERS`], each at most one chunk).
fn return_buffer(buf: AlignedBuf) {
    let Some(mut pool) = buffer_pool() else {
        return; // a forked child whose pool a parent thread held: the buffer is freed
    };
    if pool.len() < MAX_POOLED_BUFFERS {
        pool.push(buf);
        return;
    }
    let shortest = (0..pool.len()).min_by_key(|&i| pool[i].len);
    if let Some(i) = shortest.filter(|&i| pool[i].len < buf.len) {
        pool[i] = buf;
    }
}

/// The open temporary file: a buffered handle, and an O_DIRECT one when the filesystem allows.
pub(crate) struct Target<'a> {
    path: &'a Path,
    buffered: File,
    direct: Option<File>,
    direct_ok: AtomicBool,
}

impl<'a> Target<'a> {
    pub(crate) fn open(temp: &Path, path: &'a Path, want_direct: bool) -> Result<Target<'a>> {
        let buffered = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(temp)
            .map_err(|e| Error::io(path, e))?;
        let direct = if want_direct {
            // EINVAL (tmpfs, some network filesystems) just means "no O_DIRECT here".
            OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(temp)
                .ok()
        } else {
            None
        };
        let direct_ok = AtomicBool::new(direct.is_some());
        Ok(Target {
            path,
            buffered,
            direct,
            direct_ok,
        })
    }

    pub(crate) fn write_buffered(&self, bytes: &[u8], offset: u64) -> Result<()> {
        self.buffered
            .write_all_at(bytes, offset)
            .map_err(|e| Error::io(self.path, e))
    }

    /// Asks the kernel to start writing back a chunk's dirty pages (best effort).
    fn start_writeback(&self, chunk: &Chunk) {
        self.sync_range(chunk, libc::SYNC_FILE_RANGE_WRITE);
    }

    /// Waits until a chunk's pages are written back (best effort; fsync remains the
    /// durability point).
    fn wait_writeback(&self, chunk: &Chunk) {
        self.sync_range(
            chunk,
            libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER,
        );
    }

    fn sync_range(&self, chunk: &Chunk, flags: libc::c_uint) {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor and an in-range offset/length; the call only
        // schedules or waits for writeback and cannot touch our memory. Errors (e.g. ENOSYS)
        // are ignored: this is a throughput hint, fsync provides durability.
        unsafe {
            libc::sync_file_range(
                self.buffered.as_raw_fd(),
                chunk.file_offset as libc::off64_t,
                chunk.len as libc::off64_t,
                flags,
            );
        }
    }

    /// Cuts the file to `file_len` (direct writes round the last chunk up to the alignment)
    /// and, with `fsync`, makes it durable; returns whether O_DIRECT was used for the data.
    pub(crate) fn finish(self, file_len: u64, fsync: bool) -> Result<bool> {
        self.buffered
            .set_len(file_len)
            .map_err(|e| Error::io(self.path, e))?;
        if fsync {
            self.buffered
                .sync_all()
                .map_err(|e| Error::io(self.path, e))?;
        }
        Ok(self.direct_ok.load(Ordering::Relaxed))
    }

    /// Writes an aligned buffer with O_DIRECT; on EINVAL switches the whole file to buffered
    /// writes and writes `exact_len` bytes of it that way instead.
    pub(crate) fn write_aligned(&self, buf: &[u8], exact_len: usize, offset: u64) -> Result<()> {
        if let (Some(direct), true) = (&self.direct, self.direct_ok.load(Ordering::Relaxed)) {
            match direct.write_all_at(buf, offset) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(Error::io(self.path, e)),
            }
        }
        self.write_buffered(&buf[..exact_len], offset)
    }
}

/// The bytes of each tensor in data order.
struct Sources<'s> {
    tensors: Vec<TensorInfo>,
    data: Vec<&'s [u8]>,
}

impl Sources<'_> {
    /// The source bytes of one segment.
    fn slice(&self, seg: &Segment) -> &[u8] {
        let start = seg.tensor_offset as usize;
        &self.data[seg.tensor][start..start + seg.len as usize]
    }
}

impl PieceCrc {
    fn of(seg: &Segment, crc: u32) -> PieceCrc {
        PieceCrc {
            tensor: seg.tensor,
            offset: seg.tensor_offset,
            len: seg.len,
            crc,
        }
    }
}

fn match_sources<'s>(
    tensors: Vec<TensorInfo>,
    mut inputs: BTreeMap<String, &'s [u8]>,
) -> Result<Sources<'s>> {
    let mut data = Vec::with_capacity(tensors.len());
    for tensor in &tensors {
        let bytes = inputs
            .remove(&tensor.name)
            .expect("layout comes from the inputs");
        if bytes.len() as u64 != tensor.nbytes() {
            return Err(Error::InvalidArgument(format!(
                "tensor `{}`: got {} bytes but dtype {} x shape {:?} needs {}",
                tensor.name,
                bytes.len(),
                tensor.dtype.name(),
                tensor.shape,
                tensor.nbytes()
            )));
        }
        data.push(bytes);
    }
    Ok(Sources { tensors, data })
}

/// Hashes and writes one segment piece by piece, straight from the tensor's memory.
fn write_segment_buffered(
    target: &Target,
    src: &[u8],
    file_offset: u64,
    hash: bool,
) -> Result<u32> {
    let mut crc = 0;
    let mut offset = file_offset;
    for piece in src.chunks(PIECE) {
        if hash {
            crc = checksum::append(crc, piece);
        }
        target.write_buffered(piece, offset)?;
        offset += piece.len() as u64;
    }
    Ok(crc)
}

/// Hashes one segment while copying it into the chunk's aligned buffer.
fn copy_segment(dst: &mut [u8], src: &[u8], hash: bool) -> u32 {
    let mut crc = 0;
    for (dst_piece, src_piece) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
        if hash {
            crc = checksum::append(crc, src_piece);
        }
        dst_piece.copy_from_slice(src_piece);
    }
    crc
}

/// Copies (and hashes) one chunk's segments into an aligned buffer; returns the bytes to write.
fn prepare_chunk<'b>(
    sources: &Sources,
    chunk: &Chunk,
    buf: &'b mut AlignedBuf,
    hash: bool,
    crcs: &mut Vec<PieceCrc>,
) -> &'b [u8] {
    let aligned = (chunk.len.div_ceil(ALIGN) * ALIGN) as usize;
    let bytes = &mut buf.as_mut_slice()[..aligned];
    // Header placeholder and tail padding are zeros: the header is rewritten last and the
    // padding is truncated away.
    bytes.fill(0);
    for seg in &chunk.segments {
        let at = (seg.file_offset - chunk.file_offset) as usize;
        let crc = copy_segment(
            &mut bytes[at..at + seg.len as usize],
            sources.slice(seg),
            hash,
        );
        crcs.push(PieceCrc::of(seg, crc));
    }
    bytes
}

/// Buffered mode: one sequential stream written straight from tensor memory, hashed in the
/// same pass, with write-behind (`sync_file_range`) so the disk works while we copy and the
/// final fsync has little left to do. Dirty memory stays bounded to a few chunks.
fn write_buffered_stream(
    target: &Target,
    sources: &Sources,
    chunks: &[Chunk],
    hash: bool,
    progress: &Progress,
) -> Result<Vec<PieceCrc>> {
    let mut crcs = Vec::new();
    for (index, chunk) in chunks.iter().enumerate() {
        for seg in &chunk.segments {
            let crc = write_segment_buffered(target, sources.slice(seg), seg.file_offset, hash)?;
            crcs.push(PieceCrc::of(seg, crc));
            progress.add(seg.len);
        }
        target.start_writeback(chunk);
        if let Some(older) = index.checked_sub(WRITE_BEHIND).map(|i| &chunks[i]) {
            target.wait_writeback(older);
        }
    }
    Ok(crcs)
}

/// O_DIRECT mode: `threads - 1` (at least one) preparer threads copy and hash chunks into
/// aligned buffers ahead of this thread, which writes them strictly in file order: the same
/// access pattern as the disk ceiling, with the CPU work overlapped. A preparer the process
/// may not start (its thread limit: a container's pids limit, `ulimit -u`, `ulimit -v`) is
/// left out; without any, this thread prepares and writes each chunk in turn.
fn write_direct_pipeline(
    target: &Target,
    sources: &Sources,
    chunks: &[Chunk],
    options: &WriteOptions,
    progress: &Progress,
) -> Result<Vec<PieceCrc>> {
    let preparers = options
        .threads
        .saturating_sub(1)
        .clamp(1, chunks.len().max(1));
    let depth = preparers + 1;
    // No buffer is longer than the longest chunk: a chunk size far above the file's length
    // (allowed) must not allocate, and zero, memory the write never uses.
    let longest = chunks.iter().map(|chunk| chunk.len).max().unwrap_or(ALIGN);
    let buffer_len = normalize_chunk_size(options.chunk_size.min(longest)) as usize;
    let (free_tx, free_rx) = mpsc::channel::<AlignedBuf>();
    for _ in 0..depth {
        let buffer = take_buffer(buffer_len).map_err(|e| Error::io(target.path, e))?;
        free_tx.send(buffer).expect("receiver alive");
    }
    let free_rx = Mutex::new(free_rx);
    let next = AtomicUsize::new(0);
    let (filled_tx, filled_rx) = mpsc::sync_channel::<(usize, AlignedBuf, Vec<PieceCrc>)>(depth);
    let outcome = std::thread::scope(|scope| {
        let mut started = 0;
        for _ in 0..preparers {
            let filled_tx = filled_tx.clone();
            let (free_rx, next) = (&free_rx, &next);
            let preparer = std::thread::Builder::new().spawn_scoped(scope, move || loop {
                // Take a buffer before a chunk index, so the lowest index in flight always
                // owns a buffer and the writer can never wait on a starved chunk.
                let received = free_rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                let Ok(mut buf) = received else { return };
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(chunk) = chunks.get(index) else {
                    return_buffer(buf);
                    return;
                };
                let mut crcs = Vec::new();
                prepare_chunk(sources, chunk, &mut buf, options.checksums, &mut crcs);
                if filled_tx.send((index, buf, crcs)).is_err() {
                    return; // the writer stopped on an error
                }
            });
            if preparer.is_err() {
                break;
            }
            started += 1;
        }
        drop(filled_tx);
        let outcome = if started == 0 {
            let received = free_rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
            let mut buf = received.expect("the buffers were queued above");
            let outcome = write_one_by_one(target, sources, chunks, options, &mut buf, progress);
            return_buffer(buf);
            outcome
        } else {
            write_in_order(target, chunks, filled_rx, &free_tx, progress)
        };
        drop(free_tx); // wakes preparers waiting for a buffer
        outcome
    });
    // Buffers left in the free channel go back to the pool for the next save.
    let free_rx = free_rx.into_inner().unwrap_or_else(|e| e.into_inner());
    for buf in free_rx.try_iter() {
        return_buffer(buf);
    }
    outcome
}

/// [`write_direct_pipeline`] on this thread alone: each chunk is prepared into `buf`, then
/// written.
fn write_one_by_one(
    target: &Target,
    sources: &Sources,
    chunks: &[Chunk],
    options: &WriteOptions,
    buf: &mut AlignedBuf,
    progress: &Progress,
) -> Result<Vec<PieceCrc>> {
    let mut crcs = Vec::new();
    for chunk in chunks {
        prepare_chunk(sources, chunk, buf, options.checksums, &mut crcs);
        write_prepared(target, chunk, buf, progress)?;
    }
    Ok(crcs)
}

/// Writes `chunk`, prepared in `buf`, and advances `progress` by its tensor bytes.
fn write_prepared(
    target: &Target,
    chunk: &Chunk,
    buf: &mut AlignedBuf,
    progress: &Progress,
) -> Result<()> {
    let aligned = (chunk.len.div_ceil(ALIGN) * ALIGN) as usize;
    target.write_aligned(
        &buf.as_mut_slice()[..aligned],
        chunk.len as usize,
        chunk.file_offset,
    )?;
    progress.add(chunk.segments.iter().map(|seg| seg.len).sum());
    Ok(())
}

/// The writer side of [`write_direct_pipeline`]: reorders prepared chunks and writes them.
fn write_in_order(
    target: &Target,
    chunks: &[Chunk],
    filled_rx: mpsc::Receiver<(usize, AlignedBuf, Vec<PieceCrc>)>,
    free_tx: &mpsc::Sender<AlignedBuf>,
    progress: &Progress,
) -> Result<Vec<PieceCrc>> {
    let mut pending = BTreeMap::new();
    let mut crcs = Vec::new();
    let mut expected = 0;
    while expected < chunks.len() {
        let (index, buf, piece_crcs) = filled_rx.recv().expect("preparers finish every chunk");
        pending.insert(index, buf);
        crcs.extend(piece_crcs);
        while let Some(mut buf) = pending.remove(&expected) {
            let result = write_prepared(target, &chunks[expected], &mut buf, progress);
            // Keep the buffer for the next save whatever happened.
            if let Err(returned) = free_tx.send(buf) {
                return_buffer(returned.0);
            }
            result?;
            expected += 1;
        }
    }
    Ok(crcs)
}

/// Writes the chunk plan, advancing `progress` by the tensor bytes of each chunk written;
/// returns every piece's checksum.
fn write_chunks(
    target: &Target,
    sources: &Sources,
    chunks: &[Chunk],
    options: &WriteOptions,
    progress: &Progress,
) -> Result<Vec<PieceCrc>> {
    if target.direct.is_some() {
        write_direct_pipeline(target, sources, chunks, options, progress)
    } else {
        write_buffered_stream(target, sources, chunks, options.checksums, progress)
    }
}

/// Writes `inputs` (name -> raw little-endian bytes, with dtype and shape in `descs`) to `path`
/// as a safetensors file with crc32c checksums, durably and atomically, advancing `progress`
/// by the tensor bytes written.
///
/// On any error the temporary file is removed and `path` is untouched.
pub fn write_file(
    path: &Path,
    descs: Vec<TensorDesc>,
    inputs: BTreeMap<String, &[u8]>,
    metadata: &BTreeMap<String, String>,
    options: &WriteOptions,
    progress: &Progress,
) -> Result<WriteReport> {
    if descs.len() != inputs.len() {
        return Err(Error::InvalidArgument(
            "every tensor needs exactly one byte buffer".to_string(),
        ));
    }
    let tensors = format::plan_layout(descs)?;
    let sources = match_sources(tensors, inputs)?;
    let placeholder_kind = if options.checksums {
        Checksums::Placeholder
    } else {
        Checksums::Omitted
    };
    let placeholder = format::encode_header(&sources.tensors, metadata, placeholder_kind)
        .map_err(|error| format::for_file(path, error))?;
    let data_start = placeholder.len() as u64;
    let chunks = plan_chunks(&sources.tensors, data_start, options.chunk_size);
    let file_len = data_start + sources.tensors.last().map_or(0, |t| t.end);

    let temp = TempFile::beside(path)?;
    let target = Target::open(temp.path(), path, options.direct_io)?;
    let mut pieces = write_chunks(&target, &sources, &chunks, options, progress)?;
    let crcs = checksum::fold(sources.tensors.len(), &mut pieces);
    let final_kind = if options.checksums {
        Checksums::Values(&crcs)
    } else {
        Checksums::Omitted
    };
    let header = format::encode_header(&sources.tensors, metadata, final_kind)?;
    assert_eq!(
        header.len(),
        placeholder.len(),
        "checksums have a fixed width"
    );
    target.write_buffered(&header, 0)?;
    let direct_io = target.finish(file_len, options.fsync)?;
    temp.commit(path, options.fsync)?;
    let file_crc32c = options.checksums.then(|| {
        let sizes = sources.tensors.iter().map(TensorInfo::nbytes);
        checksum::concat(
            checksum::append(0, &header),
            crcs.iter().copied().zip(sizes),
        )
    });
    let checksums = if options.checksums {
        let names = sources.tensors.iter().map(|t| t.name.clone());
        names.zip(crcs).collect()
    } else {
        Vec::new()
    };
    Ok(WriteReport {
        file_len,
        direct_io,
        checksums,
        file_crc32c,
    })
}

/// Writes `len` bytes of a repeating pattern to `path` as one O_DIRECT stream of aligned
/// `block` writes, then fsyncs: the disk's own sequential-write ceiling, for benchmarks.
/// Returns false when the filesystem refuses O_DIRECT (then it writes buffered).
pub fn write_ceiling(path: &Path, len: u64, block: u64) -> Result<bool> {
    let block = normalize_chunk_size(block);
    let direct = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    let (file, is_direct) = match direct {
        Ok(file) => (file, true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            let file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
                .map_err(|e| Error::io(path, e))?;
            (file, false)
        }
        Err(e) => return Err(Error::io(path, e)),
    };
    let mut buf = take_buffer(block as usize).map_err(|e| Error::io(path, e))?;
    let pattern = &mut buf.as_mut_slice()[..block as usize]; // a pooled buffer may be longer
    for (i, byte) in pattern.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    let mut offset = 0;
    let result = (|| -> io::Result<()> {
        while offset < len {
            file.write_all_at(&buf.as_mut_slice()[..block as usize], offset)?;
            offset += block;
        }
        file.set_len(len)?;
        file.sync_all()
    })();
    return_buffer(buf);
    result.map_err(|e| Error::io(path, e))?;
    Ok(is_direct)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Dtype;

    /// A child forked while a parent thread holds the buffer pool gets its buffers without
    /// waiting (before, its first O_DIRECT save waited for the pool forever).
    #[test]
    fn a_child_forked_while_the_pool_is_held_does_not_wait_for_it() {
        return_buffer(take_buffer(4096).unwrap()); // the pool is this process's
        let (held_tx, held_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _pool = BUFFER_POOL.lock().unwrap_or_else(|e| e.into_inner());
            held_tx.send(()).unwrap();
            release_rx.recv().ok();
        });
        held_rx.recv().unwrap();
        // SAFETY: the child only takes and returns a buffer, then leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let buf = take_buffer(8192);
            let ok = buf.as_ref().is_ok_and(|b| b.len >= 8192);
            if let Ok(buf) = buf {
                return_buffer(buf);
            }
            // SAFETY: leaves the child at once, running no destructor of the parent's state.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let mut status = 0;
        let outcome = loop {
            // SAFETY: waits for the child this test forked, without blocking.
            let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if done == pid {
                break Some(libc::WEXITSTATUS(status));
            }
            if std::time::Instant::now() > deadline {
                // SAFETY: the child is this test's own.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        assert_eq!(
            outcome,
            Some(0),
            "the child hung on the parent's buffer pool"
        );
    }

    fn info(name: &str, begin: u64, end: u64) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: Dtype::U8,
            shape: vec![end - begin],
            begin,
            end,
        }
    }

    #[test]
    fn chunk_size_is_normalized_to_alignment() {
        assert_eq!(normalize_chunk_size(0), ALIGN);
        assert_eq!(normalize_chunk_size(ALIGN + 1), 2 * ALIGN);
        assert_eq!(normalize_chunk_size(8 * ALIGN), 8 * ALIGN);
    }

    #[test]
    fn chunks_tile_the_data_exactly_and_start_aligned() {
        let tensors = vec![
            info("a", 0, 5000),
            info("b", 5000, 5000),
            info("c", 5000, 20000),
        ];
        let data_start = 64;
        let chunks = plan_chunks(&tensors, data_start, 4096);
        let file_len = data_start + 20000;
        assert_eq!(chunks.len() as u64, file_len.div_ceil(4096));
        let mut covered = data_start;
        for (k, chunk) in chunks.iter().enumerate() {
            assert_eq!(chunk.file_offset, k as u64 * 4096);
            for seg in &chunk.segments {
                assert_eq!(seg.file_offset, covered, "segments are contiguous");
                assert!(seg.file_offset >= chunk.file_offset);
                assert!(seg.file_offset + seg.len <= chunk.file_offset + chunk.len);
                let t = &tensors[seg.tensor];
                assert_eq!(seg.file_offset, data_start + t.begin + seg.tensor_offset);
                covered += seg.len;
            }
        }
        assert_eq!(covered, file_len);
        assert_eq!(
            chunks.last().unwrap().len,
            file_len - (chunks.len() as u64 - 1) * 4096
        );
        // The zero-size tensor has no segment.
        assert!(chunks
            .iter()
            .flat_map(|c| &c.segments)
            .all(|s| s.tensor != 1));
    }

    #[test]
    fn empty_file_has_one_header_chunk() {
        let chunks = plan_chunks(&[], 16, 4096);
        assert_eq!(chunks.len(), 1);
        assert!(chunks[0].segments.is_empty());
    }

    proptest::proptest! {
        #[test]
        fn chunk_plan_covers_every_byte_once(
            sizes in proptest::collection::vec(0u64..20_000, 0..10),
            header in 1u64..100,
            chunk_pages in 1u64..4,
        ) {
            let mut begin = 0;
            let tensors: Vec<_> = sizes.iter().enumerate().map(|(i, &n)| {
                let t = info(&format!("t{i}"), begin, begin + n);
                begin += n;
                t
            }).collect();
            let data_start = header * 8;
            let chunks = plan_chunks(&tensors, data_start, chunk_pages * ALIGN);
            let mut per_tensor = vec![0u64; tensors.len()];
            for chunk in &chunks {
                proptest::prop_assert_eq!(chunk.file_offset % ALIGN, 0);
                for seg in &chunk.segments {
                    proptest::prop_assert_eq!(seg.tensor_offset, per_tensor[seg.tensor]);
                    per_tensor[seg.tensor] += seg.len;
                }
            }
            for (t, n) in tensors.iter().zip(per_tensor) {
                proptest::prop_assert_eq!(t.nbytes(), n);
            }
        }
    }
}
