//! Reading a safetensors file: header validation, then the crc32c of every tensor checked in
//! parallel pieces, either with positional reads ([`Reader`]: through small scratch buffers
//! for verifying files without keeping them, or straight into the caller's buffers, e.g. the
//! tensors a checkpoint is loaded into) or over the whole file already in memory
//! ([`MappedFile`], the caller's private mapping that loaded tensors are views of).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::checksum::{self, PieceCrc};
use crate::error::{Error, Result};
use crate::format::{self, Dtype, Header};
use crate::memory;
use crate::progress::Progress;
use crate::threads::on_threads;
use crate::writer::{AlignedBuf, ALIGN, DEFAULT_CHUNK_SIZE};

/// Bytes read and hashed per piece: large enough for throughput, small enough to be hashed
/// while still in cache.
const READ_PIECE: usize = 4 << 20;

/// A header that passed validation, with what checking the data against it needs.
struct Validated {
    path: PathBuf,
    header: Header,
    /// crc32c of the prefix and JSON header bytes, to derive the whole-file checksum.
    header_crc: u32,
}

impl Validated {
    /// Validates the 8-byte prefix and the JSON header of a `file_len`-byte file; `json_at`
    /// returns the `len` header bytes that follow the prefix.
    fn parse<'j>(
        path: &Path,
        file_len: u64,
        prefix: [u8; 8],
        json_at: impl FnOnce(u64) -> Result<std::borrow::Cow<'j, [u8]>>,
    ) -> Result<Validated> {
        let header_len = format::parse_prefix(path, &prefix, file_len)?;
        let json = json_at(header_len)?;
        let header = format::parse_header(path, &json, file_len)?;
        let header_crc = checksum::append(checksum::append(0, &prefix), &json);
        Ok(Validated {
            path: path.to_path_buf(),
            header,
            header_crc,
        })
    }

    /// Checks `pieces` (hashed pieces of every tensor, any order) against the stored
    /// checksums (tensors without one pass); returns the whole-file crc32c.
    fn check_all(&self, pieces: &mut [PieceCrc]) -> Result<u32> {
        let crcs = checksum::fold(self.header.tensors.len(), pieces);
        for (info, &actual) in self.header.tensors.iter().zip(&crcs) {
            if let Some(&expected) = self.header.checksums.get(&info.name) {
                if expected != actual {
                    return Err(Error::Checksum {
                        path: self.path.clone(),
                        tensor: info.name.clone(),
                        expected,
                        actual,
                    });
                }
            }
        }
        let lens = self.header.tensors.iter().map(|t| t.nbytes());
        Ok(checksum::concat(
            self.header_crc,
            crcs.into_iter().zip(lens),
        ))
    }
}

fn too_short(path: &Path, file_len: u64) -> Error {
    Error::format(
        path,
        "header_length",
        format!("the file has only {file_len} bytes; it is truncated or not safetensors"),
    )
}

/// Runs `work` on every item with `threads` threads (the caller's among them) pulling from one
/// queue (items are started in order); stops early and returns the first error.
///
/// A thread the process may not start (its thread limit: a container's pids limit,
/// `ulimit -u`, `ulimit -v`) is left out: the threads running take its share, the caller's
/// alone if need be.
fn parallel<T: Send, R: Send>(
    items: Vec<T>,
    threads: usize,
    work: impl Fn(T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let workers = threads.clamp(1, items.len().max(1));
    let queue = Mutex::new(items.into_iter());
    let failed = AtomicBool::new(false);
    let run = || {
        let mut done = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some(item) = next else { break };
            match work(item) {
                Ok(result) => done.push(result),
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
        Ok(done)
    };
    let results: Vec<Result<Vec<R>>> = on_threads(workers, run);
    let mut all = Vec::new();
    for result in results {
        all.extend(result?);
    }
    Ok(all)
}

/// Where a tensor (or a piece of it) is read into: the caller's buffer, and whether it is
/// fresh memory ([`Destination::fresh`]).
type Slot<'a> = (&'a mut [u8], bool);

/// A run of at most [`READ_PIECE`] bytes of one tensor, hashed on its own.
struct Piece {
    /// Index of the tensor in the header.
    tensor: usize,
    /// Offset of the piece inside the tensor.
    offset: u64,
    /// Offset of the piece inside the data section.
    at: u64,
    len: usize,
}

/// Every tensor of `header` cut into [`Piece`]s, in file order.
fn pieces(header: &Header) -> Vec<Piece> {
    let mut out = Vec::new();
    for (tensor, info) in header.tensors.iter().enumerate() {
        for offset in (0..info.nbytes()).step_by(READ_PIECE) {
            out.push(Piece {
                tensor,
                offset,
                at: info.begin + offset,
                len: (info.nbytes() - offset).min(READ_PIECE as u64) as usize,
            });
        }
    }
    out
}

/// Opens `path` for reading only if it is a regular file, without ever blocking: the open is
/// non-blocking (a FIFO without a writer does not hang it) and the type is checked on the
/// opened descriptor (`fstat`), so a FIFO, a device such as `/dev/zero` or a socket is refused
/// before anything is read. With `follow_symlinks` false a symbolic link as the last component
/// is refused too (`O_NOFOLLOW`); with it true a link is followed and its target checked.
/// A directory is an `EISDIR` I/O error, as `open()` reports it for writing.
pub fn open_regular(path: &Path, follow_symlinks: bool) -> Result<File> {
    let mut flags = libc::O_NONBLOCK | libc::O_CLOEXEC;
    if !follow_symlinks {
        flags |= libc::O_NOFOLLOW;
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) if !follow_symlinks && is_symlink(path) => Error::NotRegularFile {
                path: path.to_path_buf(),
                kind: "a symbolic link",
            },
            _ => Error::io(path, e),
        })?;
    let kind = file.metadata().map_err(|e| Error::io(path, e))?.file_type();
    let refused = if kind.is_file() {
        return Ok(file);
    } else if kind.is_dir() {
        return Err(Error::io(path, io::Error::from_raw_os_error(libc::EISDIR)));
    } else if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    };
    Err(Error::NotRegularFile {
        path: path.to_path_buf(),
        kind: refused,
    })
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// An open file with its validated header, read with positional reads.
pub struct Reader {
    file: File,
    valid: Validated,
}

fn read_exact(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::format(
                path,
                "data_offsets",
                "the file ended early: it is truncated",
            )
        } else {
            Error::io(path, e)
        }
    })
}

impl Reader {
    /// Opens `path` (a regular file, see [`open_regular`]; a symbolic link is followed only
    /// with `follow_symlinks`) and validates its header against the file size.
    pub fn open(path: &Path, follow_symlinks: bool) -> Result<Reader> {
        let file = open_regular(path, follow_symlinks)?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if file_len < format::PREFIX_LEN {
            return Err(too_short(path, file_len));
        }
        let mut prefix = [0u8; 8];
        read_exact(&file, path, &mut prefix, 0)?;
        let valid = Validated::parse(path, file_len, prefix, |len| {
            let mut json = vec![0u8; len as usize];
            read_exact(&file, path, &mut json, format::PREFIX_LEN)?;
            Ok(json.into())
        })?;
        Ok(Reader { file, valid })
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.valid.header
    }

    /// The file this reader reads.
    pub fn path(&self) -> &Path {
        &self.valid.path
    }

    /// Reads every tensor through small scratch buffers and checks its crc32c without keeping
    /// the data, advancing `progress` by each piece's bytes. Returns the whole-file crc32c and
    /// the names of the tensors that have no stored checksum.
    ///
    /// A file of at least [`DIRECT_IO_MIN_BYTES`] is read with O_DIRECT where the filesystem
    /// allows it (see [`DirectReads`]), else through the page cache.
    pub fn verify(&self, threads: usize, progress: &Progress) -> Result<(u32, Vec<String>)> {
        let direct = if self.header().file_len() >= DIRECT_IO_MIN_BYTES {
            DirectReads::open(&self.file)
        } else {
            None
        };
        self.verify_reading(direct.as_ref(), threads, progress)
    }

    /// [`Reader::verify`], with O_DIRECT reads from `direct` where given.
    fn verify_reading(
        &self,
        direct: Option<&DirectReads>,
        threads: usize,
        progress: &Progress,
    ) -> Result<(u32, Vec<String>)> {
        let header = self.header();
        let file_crc = self.read_pieces(Vec::new(), direct, threads, progress)?;
        let unchecked = header
            .tensors
            .iter()
            .filter(|info| !header.checksums.contains_key(&info.name))
            .map(|info| info.name.clone())
            .collect();
        Ok((file_crc, unchecked))
    }

    /// Reads the tensors named by `destinations` straight into their buffers with positional
    /// reads on `threads` threads, hashing each piece as it lands (still in cache), and every
    /// other tensor through scratch buffers; then checks every stored checksum. Returns the
    /// whole-file crc32c.
    ///
    /// Each destination must describe a tensor of the file exactly (name, dtype, shape, and a
    /// buffer of its size), else nothing is read and a format error says the file differs
    /// from what the caller expected (it was replaced since the caller read its header); a
    /// tensor may be named once. On a checksum or read error the buffers hold what was read
    /// until then: the caller must not use them.
    pub fn read_into(
        &self,
        destinations: Vec<Destination<'_>>,
        threads: usize,
        progress: &Progress,
    ) -> Result<u32> {
        let header = self.header();
        let index: HashMap<&str, usize> = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, info)| (info.name.as_str(), i))
            .collect();
        let mut slots: Vec<Option<Slot<'_>>> = Vec::new();
        slots.resize_with(header.tensors.len(), || None);
        for dest in destinations {
            let Some(&i) = index.get(dest.name.as_str()) else {
                return Err(self.changed(&dest.name, "the file has no such tensor"));
            };
            let info = &header.tensors[i];
            if info.dtype != dest.dtype
                || info.shape != dest.shape
                || info.nbytes() != dest.bytes.len() as u64
            {
                return Err(self.changed(
                    &dest.name,
                    &format!(
                        "the file holds {} {:?} ({} bytes), the destination is {} {:?} ({} bytes)",
                        info.dtype.name(),
                        info.shape,
                        info.nbytes(),
                        dest.dtype.name(),
                        dest.shape,
                        dest.bytes.len()
                    ),
                ));
            }
            if slots[i].is_some() {
                return Err(Error::InvalidArgument(format!(
                    "{}: tensor `{}` is given two destinations",
                    self.path().display(),
                    dest.name
                )));
            }
            slots[i] = Some((dest.bytes, dest.fresh));
        }
        self.read_pieces(slots, None, threads, progress)
    }

    /// Fills `bytes` (one piece) from the file at `at` and hashes them (still in cache).
    fn read_hashed(&self, bytes: &mut [u8], at: u64, piece: &Piece) -> Result<PieceCrc> {
        read_exact(&self.file, self.path(), bytes, at)?;
        Ok(piece_crc(piece.tensor, piece.offset, bytes))
    }

    fn changed(&self, tensor: &str, what: &str) -> Error {
        Error::format(
            self.path(),
            format!("tensors.{tensor}"),
            format!("{what}; the file changed since its header was read"),
        )
    }

    /// Reads every tensor in pieces on `threads` threads: into `slots[i]` for tensor `i` when
    /// given (a buffer of its size, and whether it is fresh memory), else through reused
    /// scratch buffers; checks the stored checksums and returns the whole-file crc32c. An
    /// empty `slots` reads everything through scratch buffers.
    fn read_pieces(
        &self,
        slots: Vec<Option<Slot<'_>>>,
        direct: Option<&DirectReads>,
        threads: usize,
        progress: &Progress,
    ) -> Result<u32> {
        let header = self.header();
        let mut slots = slots.into_iter();
        let mut work: Vec<(Piece, Option<Slot<'_>>)> = Vec::new();
        let mut all = pieces(header).into_iter().peekable();
        for tensor in 0..header.tensors.len() {
            // A destination is cut where the pieces are, so that each is hashed alone.
            let (mut chunks, fresh) = match slots.next().flatten() {
                Some((buf, fresh)) => (Some(buf.chunks_mut(READ_PIECE)), fresh),
                None => (None, false),
            };
            while let Some(piece) = all.next_if(|piece| piece.tensor == tensor) {
                let chunk = chunks.as_mut().and_then(Iterator::next);
                work.push((piece, chunk.map(|bytes| (bytes, fresh))));
            }
        }
        // Scratch buffers (aligned ones for O_DIRECT) are reused, see `with_pooled`.
        let scratch = Mutex::new(Vec::<Vec<u8>>::new());
        let aligned = Mutex::new(Vec::<AlignedBuf>::new());
        let data_start = header.data_start;
        let mut crcs = parallel(work, threads, |(piece, dest)| {
            let at = data_start + piece.at;
            let result = match dest {
                Some((bytes, fresh)) => {
                    if fresh {
                        // Its pages mapped in one call, not one page fault each.
                        memory::prefault_for_write(bytes);
                    }
                    self.read_hashed(bytes, at, &piece)
                }
                None => {
                    let read_direct = |direct: &DirectReads| {
                        with_pooled(
                            &aligned,
                            || AlignedBuf::new(DirectReads::BUFFER),
                            |buf| {
                                let bytes = direct.read(buf.as_mut_slice(), at, piece.len)?;
                                Some(piece_crc(piece.tensor, piece.offset, bytes))
                            },
                        )
                    };
                    match direct.and_then(read_direct) {
                        Some(crc) => Ok(crc),
                        None => with_pooled(
                            &scratch,
                            || vec![0u8; READ_PIECE],
                            |buf| self.read_hashed(&mut buf[..piece.len], at, &piece),
                        ),
                    }
                }
            };
            progress.add(piece.len as u64);
            result
        })?;
        self.valid.check_all(&mut crcs)
    }
}

/// Runs `f` on a buffer taken from `pool` (made by `make` when the pool is empty) and puts it
/// back after: fresh memory would cost page faults on every piece.
fn with_pooled<B, R>(
    pool: &Mutex<Vec<B>>,
    make: impl FnOnce() -> B,
    f: impl FnOnce(&mut B) -> R,
) -> R {
    let pooled = pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let mut buf = pooled.unwrap_or_else(make);
    let result = f(&mut buf);
    pool.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
    result
}

/// Files of at least this many bytes are written with O_DIRECT by default and verified with
/// O_DIRECT reads (the one definition: Python reads it as
/// `fastckpt._native.DIRECT_IO_MIN_BYTES`): four default write chunks.
pub const DIRECT_IO_MIN_BYTES: u64 = 4 * DEFAULT_CHUNK_SIZE;

/// O_DIRECT reads of one file for [`Reader::verify`], which hashes every byte once and keeps
/// none: what a save wrote with O_DIRECT is not in the page cache, and reading it back
/// through the cache would cost a kernel copy and a page-cache page per 4 KiB (and push the
/// training's own pages out) for bytes that are dropped at once; read straight from the
/// device, the bytes checked are the ones stored there. Pages of the file still in the cache
/// are written back first by the kernel, so the read sees the latest bytes either way.
///
/// Best effort: a filesystem without O_DIRECT (tmpfs on older kernels, some network
/// filesystems) refuses the open, and a read it refuses (or that ends early: a truncated
/// file) makes the caller read that piece, and every later one, through the page cache,
/// which reports the real error.
struct DirectReads {
    file: File,
    usable: AtomicBool,
    /// Pieces read with O_DIRECT so far.
    pieces: AtomicUsize,
}

impl DirectReads {
    /// Bytes of each aligned read buffer: a whole piece plus the blocks around it.
    const BUFFER: usize = READ_PIECE + 2 * ALIGN as usize;

    /// Opens the file `opened` again with O_DIRECT, through `/proc/self/fd` (the very file
    /// whose header was read, whatever its path names by now, no link followed again); None
    /// where that fails (no `/proc`, no O_DIRECT on the filesystem).
    fn open(opened: &File) -> Option<DirectReads> {
        use std::os::fd::AsRawFd;
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(format!("/proc/self/fd/{}", opened.as_raw_fd()))
            .ok()?;
        Some(DirectReads {
            file,
            usable: AtomicBool::new(true),
            pieces: AtomicUsize::new(0),
        })
    }

    /// The `len` bytes at `at`, read into `buf` (aligned, [`Self::BUFFER`] bytes) as whole
    /// aligned blocks; None when O_DIRECT failed for them (the caller reads them otherwise).
    fn read<'b>(&self, buf: &'b mut [u8], at: u64, len: usize) -> Option<&'b [u8]> {
        if !self.usable.load(Ordering::Relaxed) {
            return None;
        }
        let start = at - at % ALIGN;
        let skip = (at - start) as usize;
        let end = (at + len as u64).div_ceil(ALIGN) * ALIGN;
        let window = &mut buf[..(end - start) as usize];
        let mut got = 0;
        while got < skip + len {
            match self.file.read_at(&mut window[got..], start + got as u64) {
                Ok(n) if n > 0 && (got + n >= skip + len || n % ALIGN as usize == 0) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                _ => {
                    self.usable.store(false, Ordering::Relaxed);
                    return None;
                }
            }
        }
        self.pieces.fetch_add(1, Ordering::Relaxed);
        Some(&window[skip..skip + len])
    }
}

/// A caller's buffer that [`Reader::read_into`] fills with one tensor of the file, and what
/// the caller expects that tensor to be.
pub struct Destination<'a> {
    /// The tensor's name in the header.
    pub name: String,
    /// Its dtype, as the caller expects it.
    pub dtype: Dtype,
    /// Its shape (header convention), as the caller expects it.
    pub shape: Vec<u64>,
    /// Exactly the tensor's bytes.
    pub bytes: &'a mut [u8],
    /// Whether the buffer is fresh memory (allocated for this read, never touched): its pages
    /// are then mapped writable piece by piece in one call each before being read into
    /// ([`memory::prefault_for_write`]), not one page fault per page. Memory already in use
    /// (a live model's parameters) gains nothing from it.
    pub fresh: bool,
}

fn piece_crc(tensor: usize, offset: u64, bytes: &[u8]) -> PieceCrc {
    PieceCrc {
        tensor,
        offset,
        len: bytes.len() as u64,
        crc: checksum::append(0, bytes),
    }
}

/// A whole safetensors file that the caller already has in memory, typically a private
/// read-only mapping: loading then costs no copy, and the page faults of hashing it are
/// what bring the file in from disk.
pub struct MappedFile<'a> {
    data: &'a [u8],
    valid: Validated,
}

impl<'a> MappedFile<'a> {
    /// Validates the header found in `data` (the whole content of `path`).
    pub fn parse(path: &Path, data: &'a [u8]) -> Result<MappedFile<'a>> {
        let file_len = data.len() as u64;
        if file_len < format::PREFIX_LEN {
            return Err(too_short(path, file_len));
        }
        let prefix: [u8; 8] = data[..8].try_into().expect("8 bytes");
        let valid = Validated::parse(path, file_len, prefix, |len| {
            // `parse_prefix` checked that the header fits inside the file.
            Ok(data[8..8 + len as usize].into())
        })?;
        Ok(MappedFile { data, valid })
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.valid.header
    }

    /// Hashes every tensor in pieces on `threads` threads and checks the stored checksums
    /// (tensors without one pass), advancing `progress` by each piece's bytes. Returns the
    /// crc32c of the whole file.
    pub fn verify(&self, threads: usize, progress: &Progress) -> Result<u32> {
        let start = self.header().data_start;
        let mut crcs = parallel(pieces(self.header()), threads, |piece| {
            let begin = (start + piece.at) as usize;
            let bytes = &self.data[begin..begin + piece.len];
            populate(&self.valid.path, bytes)?;
            let crc = piece_crc(piece.tensor, piece.offset, bytes);
            progress.add(piece.len as u64);
            Ok(crc)
        })?;
        self.valid.check_all(&mut crcs)
    }
}

/// Faults the pages of `bytes` (part of a file mapping) in with one call, reading them from
/// disk, so that a read error or a file shrunk since it was mapped comes back as an error
/// naming the file rather than a SIGBUS on first access. Memory that is not a file mapping,
/// and kernels before 5.14, refuse the request (EINVAL); the pages are then faulted in by
/// hashing them, as before.
fn populate(path: &Path, bytes: &[u8]) -> Result<()> {
    const PAGE: usize = 4096;
    if bytes.is_empty() {
        return Ok(());
    }
    let start = bytes.as_ptr() as usize / PAGE * PAGE;
    let end = bytes.as_ptr() as usize + bytes.len();
    loop {
        // SAFETY: the page-aligned range covers `bytes`, memory the caller holds for the
        // duration; MADV_POPULATE_READ only faults pages in and changes no contents.
        let rc = unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_READ,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EFAULT) | Some(libc::EIO) | Some(libc::EHWPOISON) => {
                return Err(Error::io(
                    path,
                    io::Error::new(
                        err.kind(),
                        format!(
                            "reading the file failed ({err}): a disk error, or it was \
                             truncated while loading"
                        ),
                    ),
                ))
            }
            _ => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Dtype, TensorDesc};
    use crate::writer::{write_file, WriteOptions};
    use std::collections::BTreeMap;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
            .collect()
    }

    fn write(path: &Path, tensors: &[(&str, Dtype, Vec<u64>, Vec<u8>)], opts: WriteOptions) {
        let descs = tensors
            .iter()
            .map(|(n, d, s, _)| TensorDesc {
                name: n.to_string(),
                dtype: *d,
                shape: s.clone(),
            })
            .collect();
        let inputs = tensors
            .iter()
            .map(|(n, _, _, b)| (n.to_string(), b.as_slice()))
            .collect();
        write_file(
            path,
            descs,
            inputs,
            &BTreeMap::new(),
            &opts,
            &Progress::default(),
        )
        .unwrap();
    }

    fn sample() -> Vec<(&'static str, Dtype, Vec<u64>, Vec<u8>)> {
        vec![
            (
                "big",
                Dtype::F32,
                vec![3, 1_000_003],
                pattern(12_000_036, 7),
            ),
            ("small", Dtype::I16, vec![5], pattern(10, 3)),
            ("empty", Dtype::F64, vec![0, 9], vec![]),
            ("scalar", Dtype::U8, vec![], vec![42]),
        ]
    }

    /// Every sample tensor's bytes, read through [`MappedFile`] (the whole file in memory).
    fn read_all(path: &Path, verify: bool) -> Result<Vec<Vec<u8>>> {
        let data = std::fs::read(path).unwrap();
        let mapped = MappedFile::parse(path, &data)?;
        if verify {
            assert_eq!(
                mapped.verify(3, &Progress::default())?,
                crate::checksum::append(0, &data)
            );
        }
        let header = mapped.header();
        Ok(sample()
            .iter()
            .map(|(name, ..)| {
                let info = header.tensor(name).unwrap();
                let start = (header.data_start + info.begin) as usize;
                data[start..start + info.nbytes() as usize].to_vec()
            })
            .collect())
    }

    #[test]
    fn round_trip_buffered_and_direct_with_small_chunks() {
        let dir = tempfile::tempdir().unwrap();
        for direct_io in [false, true] {
            let path = dir.path().join(format!("x{direct_io}.safetensors"));
            let opts = WriteOptions {
                threads: 3,
                chunk_size: 1 << 20,
                direct_io,
                fsync: true,
                checksums: true,
            };
            write(&path, &sample(), opts);
            let bufs = read_all(&path, true).unwrap();
            for ((_, _, _, want), got) in sample().iter().zip(&bufs) {
                assert_eq!(want, got);
            }
            let (file_crc, unchecked) = Reader::open(&path, true)
                .unwrap()
                .verify(2, &Progress::default())
                .unwrap();
            assert!(unchecked.is_empty());
            let whole = std::fs::read(&path).unwrap();
            assert_eq!(file_crc, crate::checksum::append(0, &whole));
        }
        // Only the committed files remain: no temp siblings.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn progress_counts_every_tensor_byte_written_and_verified() {
        let dir = tempfile::tempdir().unwrap();
        let total: u64 = sample().iter().map(|(.., bytes)| bytes.len() as u64).sum();
        for direct_io in [false, true] {
            let path = dir.path().join(format!("p{direct_io}.safetensors"));
            let descs = sample()
                .iter()
                .map(|(n, d, s, _)| TensorDesc {
                    name: n.to_string(),
                    dtype: *d,
                    shape: s.clone(),
                })
                .collect();
            let owned = sample();
            let inputs = owned
                .iter()
                .map(|(n, _, _, b)| (n.to_string(), b.as_slice()))
                .collect();
            let options = WriteOptions {
                chunk_size: 1 << 20,
                direct_io,
                ..WriteOptions::default()
            };
            let written = Progress::default();
            write_file(&path, descs, inputs, &BTreeMap::new(), &options, &written).unwrap();
            assert_eq!(written.get(), total, "direct_io={direct_io}");
            let read = Progress::default();
            Reader::open(&path, true).unwrap().verify(3, &read).unwrap();
            assert_eq!(read.get(), total);
            let data = std::fs::read(&path).unwrap();
            let hashed = Progress::default();
            MappedFile::parse(&path, &data)
                .unwrap()
                .verify(2, &hashed)
                .unwrap();
            assert_eq!(hashed.get(), total);
        }
    }

    #[test]
    fn overwriting_replaces_the_file_and_cleans_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let large = vec![("big", Dtype::U8, vec![64 << 20], vec![1u8; 64 << 20])];
        write(&path, &large, WriteOptions::default());
        let newer = vec![("only", Dtype::U8, vec![3], vec![9, 8, 7])];
        write(&path, &newer, WriteOptions::default());
        let reader = Reader::open(&path, true).unwrap();
        assert_eq!(reader.header().tensors.len(), 1);
        // The old version is deleted in the background after the commit.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::fs::read_dir(dir.path()).unwrap().count() > 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "old version never deleted"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn flipped_byte_is_a_checksum_error_naming_the_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write(&path, &sample(), WriteOptions::default());
        let mut bytes = std::fs::read(&path).unwrap();
        let header = Reader::open(&path, true).unwrap().header().clone();
        let big = header.tensor("big").unwrap();
        bytes[(header.data_start + big.begin + 5_000_000) as usize] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        match read_all(&path, true) {
            Err(Error::Checksum { tensor, .. }) => assert_eq!(tensor, "big"),
            other => panic!("expected checksum error, got {:?}", other.map(|_| ())),
        }
        assert!(matches!(
            Reader::open(&path, true)
                .unwrap()
                .verify(2, &Progress::default()),
            Err(Error::Checksum { .. })
        ));
        // Unverified reads do not look at checksums.
        assert!(read_all(&path, false).is_ok());
    }

    /// The destinations of `bufs`: (name, dtype, shape, buffer) each.
    fn destinations<'a>(
        bufs: &'a mut [(String, Dtype, Vec<u64>, Vec<u8>)],
    ) -> Vec<Destination<'a>> {
        bufs.iter_mut()
            .map(|(name, dtype, shape, bytes)| Destination {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                bytes: bytes.as_mut_slice(),
                fresh: false,
            })
            .collect()
    }

    /// Zeroed buffers for the sample tensors named in `names`.
    fn empty_buffers(names: &[&str]) -> Vec<(String, Dtype, Vec<u64>, Vec<u8>)> {
        sample()
            .into_iter()
            .filter(|(name, ..)| names.contains(name))
            .map(|(name, dtype, shape, bytes)| {
                (name.to_string(), dtype, shape, vec![0; bytes.len()])
            })
            .collect()
    }

    #[test]
    fn read_into_fills_the_destinations_and_checks_every_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write(&path, &sample(), WriteOptions::default());
        let whole = std::fs::read(&path).unwrap();
        let reader = Reader::open(&path, true).unwrap();
        // "big" spans several pieces (read by several threads); "small" is left to scratch.
        let mut bufs = empty_buffers(&["big", "empty", "scalar"]);
        let read = Progress::default();
        let crc = reader.read_into(destinations(&mut bufs), 3, &read).unwrap();
        assert_eq!(crc, crate::checksum::append(0, &whole));
        let total: u64 = sample().iter().map(|(.., b)| b.len() as u64).sum();
        assert_eq!(read.get(), total);
        let want = sample();
        for (name, _, _, got) in &bufs {
            let (.., expected) = want.iter().find(|(n, ..)| n == name).unwrap();
            assert_eq!(got, expected, "{name}");
        }
    }

    #[test]
    fn read_into_reports_a_flipped_byte_in_a_destination_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write(&path, &sample(), WriteOptions::default());
        let header = Reader::open(&path, true).unwrap().header().clone();
        let mut bytes = std::fs::read(&path).unwrap();
        let big = header.tensor("big").unwrap();
        bytes[(header.data_start + big.begin + 9_000_000) as usize] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();
        let mut bufs = empty_buffers(&["big"]);
        let reader = Reader::open(&path, true).unwrap();
        match reader.read_into(destinations(&mut bufs), 2, &Progress::default()) {
            Err(Error::Checksum {
                tensor, path: p, ..
            }) => {
                assert_eq!(tensor, "big");
                assert_eq!(p, path);
            }
            other => panic!("expected a checksum error, got {other:?}"),
        }
    }

    #[test]
    fn direct_reads_return_any_unaligned_range_and_stop_at_the_end_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.bin");
        let data = pattern(3 * ALIGN as usize * 1000 + 1234, 5);
        std::fs::write(&path, &data).unwrap();
        let opened = File::open(&path).unwrap();
        // The path replaced since the open: the opened file is the one read.
        std::fs::rename(&path, dir.path().join("old.bin")).unwrap();
        std::fs::write(&path, pattern(data.len(), 6)).unwrap();
        let Some(direct) = DirectReads::open(&opened) else {
            eprintln!("no O_DIRECT on this filesystem: nothing to test");
            return;
        };
        let mut buf = AlignedBuf::new(DirectReads::BUFFER);
        let len = data.len() as u64;
        let ranges = [
            (0, 10),
            (4095, 2),
            (5000, READ_PIECE),
            (len - 7, 7),
            (len - 1, 1),
        ];
        for (at, n) in ranges {
            let got = direct.read(buf.as_mut_slice(), at, n).expect("direct read");
            let want = &data[at as usize..at as usize + n];
            assert_eq!(got, want, "at {at}, {n} bytes");
        }
        assert_eq!(direct.pieces.load(Ordering::Relaxed), ranges.len());
        // Bytes past the end (a file truncated after its header was read) are not made up:
        // the direct reads give up, and the caller's buffered read reports the truncation.
        assert!(direct.read(buf.as_mut_slice(), len - 4, 8).is_none());
        let given_up = direct.read(buf.as_mut_slice(), 0, 8);
        assert!(given_up.is_none(), "given up for good");
    }

    #[test]
    fn verifying_with_direct_reads_checks_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write(&path, &sample(), WriteOptions::default());
        let reader = Reader::open(&path, true).unwrap();
        let Some(direct) = DirectReads::open(&reader.file) else {
            eprintln!("no O_DIRECT on this filesystem: nothing to test");
            return;
        };
        let buffered = reader.verify_reading(None, 3, &Progress::default());
        let read = Progress::default();
        let verified = reader.verify_reading(Some(&direct), 3, &read).unwrap();
        assert_eq!(verified, buffered.unwrap());
        let whole = std::fs::read(&path).unwrap();
        assert_eq!(verified.0, crate::checksum::append(0, &whole));
        let total: u64 = sample().iter().map(|(.., b)| b.len() as u64).sum();
        assert_eq!(read.get(), total);
        // Every piece came from the device, none through the page cache.
        let pieces = pieces(reader.header()).len();
        assert_eq!(direct.pieces.load(Ordering::Relaxed), pieces);

        let header = reader.header().clone();
        let mut bytes = whole.clone();
        let big = header.tensor("big").unwrap();
        bytes[(header.data_start + big.begin + 5_000_001) as usize] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let reader = Reader::open(&path, true).unwrap();
        let direct = DirectReads::open(&reader.file).unwrap();
        match reader.verify_reading(Some(&direct), 2, &Progress::default()) {
            Err(Error::Checksum { tensor, .. }) => assert_eq!(tensor, "big"),
            other => panic!("expected a checksum error, got {other:?}"),
        }
        assert!(direct.pieces.load(Ordering::Relaxed) > 0);

        // Truncated after its header was read: the direct reads give up at the end of the
        // file, and the buffered read says what happened.
        std::fs::write(&path, &whole).unwrap();
        let reader = Reader::open(&path, true).unwrap();
        let direct = DirectReads::open(&reader.file).unwrap();
        let writable = OpenOptions::new().write(true).open(&path).unwrap();
        writable.set_len(whole.len() as u64 / 2).unwrap();
        match reader.verify_reading(Some(&direct), 2, &Progress::default()) {
            Err(Error::Format { message, .. }) => assert!(message.contains("truncated")),
            other => panic!("expected a truncation error, got {other:?}"),
        }
    }

    #[test]
    fn read_into_refuses_destinations_that_do_not_match_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write(&path, &sample(), WriteOptions::default());
        let reader = Reader::open(&path, true).unwrap();
        let mut buf = [0u8; 10];
        let cases = [
            ("nope", Dtype::I16, vec![5], 10),
            ("small", Dtype::U16, vec![5], 10),
            ("small", Dtype::I16, vec![10], 10),
            ("small", Dtype::I16, vec![5], 8),
        ];
        for (name, dtype, shape, len) in cases {
            let dest = Destination {
                name: name.into(),
                dtype,
                shape,
                bytes: &mut buf[..len],
                fresh: true,
            };
            assert!(
                matches!(
                    reader.read_into(vec![dest], 2, &Progress::default()),
                    Err(Error::Format { .. })
                ),
                "{name} {dtype:?} {len}"
            );
        }
        let (mut a, mut b) = (vec![0u8; 10], vec![0u8; 10]);
        let twice = ["small", "small"]
            .iter()
            .zip([&mut a, &mut b])
            .map(|(name, bytes)| Destination {
                name: name.to_string(),
                dtype: Dtype::I16,
                shape: vec![5],
                bytes: bytes.as_mut_slice(),
                fresh: false,
            })
            .collect();
        assert!(matches!(
            reader.read_into(twice, 2, &Progress::default()),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn truncated_file_is_a_format_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        write(&path, &sample(), WriteOptions::default());
        let bytes = std::fs::read(&path).unwrap();
        for cut in [0, 4, 8, 20, bytes.len() - 1] {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            assert!(
                matches!(Reader::open(&path, true), Err(Error::Format { .. })),
                "cut at {cut}"
            );
            assert!(
                matches!(
                    MappedFile::parse(&path, &bytes[..cut]),
                    Err(Error::Format { .. })
                ),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn special_files_are_refused_at_once_without_reading() {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe.safetensors");
        let c_path = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a directory entry.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let zero = dir.path().join("zero.safetensors");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let real = dir.path().join("real.safetensors");
        write(&real, &sample(), WriteOptions::default());
        let link = dir.path().join("link.safetensors");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        for (path, follow, kind) in [
            (&fifo, true, "FIFO"),
            (&zero, true, "character device"),
            (&link, false, "symbolic link"),
        ] {
            match Reader::open(path, follow) {
                Err(Error::NotRegularFile {
                    path: named,
                    kind: got,
                }) => {
                    assert_eq!(&named, path);
                    assert!(got.contains(kind), "{got}");
                }
                other => panic!(
                    "{}: expected a refusal, got {:?}",
                    path.display(),
                    other.err()
                ),
            }
        }
        assert!(
            Reader::open(&link, true).is_ok(),
            "links are followed when allowed"
        );
        assert!(matches!(
            Reader::open(dir.path(), true),
            Err(Error::Io { source, .. }) if source.raw_os_error() == Some(libc::EISDIR)
        ));
    }

    #[test]
    fn failed_write_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no-such-dir").join("x.safetensors");
        let descs = vec![TensorDesc {
            name: "a".into(),
            dtype: Dtype::U8,
            shape: vec![1],
        }];
        let inputs = [("a".to_string(), &[1u8][..])].into_iter().collect();
        let err = write_file(
            &missing,
            descs,
            inputs,
            &BTreeMap::new(),
            &WriteOptions::default(),
            &Progress::default(),
        );
        assert!(matches!(err, Err(Error::Io { .. })));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
