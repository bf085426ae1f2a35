//! Reading a safetensors file: header validation, then parallel ranged reads straight into
//! caller-provided buffers, with the crc32c verified in the same pass.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::checksum::{self, PieceCrc};
use crate::error::{Error, Result};
use crate::format::{self, Header, TensorInfo};

/// Bytes read (and hashed) per request: large enough for throughput, small enough to be hashed
/// while still in cache.
const READ_PIECE: usize = 4 << 20;
/// Default number of reader threads.
pub const DEFAULT_THREADS: usize = 4;

/// An open file with its validated header.
pub struct Reader {
    path: PathBuf,
    file: File,
    header: Header,
    /// crc32c of the prefix and JSON header bytes, to derive the whole-file checksum.
    header_crc: u32,
}

/// A destination for one tensor's bytes.
pub struct ReadTarget<'a> {
    pub name: String,
    pub dest: &'a mut [u8],
}

/// Asks for transparent huge pages on the 2 MiB-aligned interior of a large destination
/// buffer: freshly allocated tensors are otherwise faulted in 4 KiB at a time while we copy
/// into them, which costs more than the copy itself.
fn advise_huge_pages(dest: &mut [u8]) {
    const HUGE: usize = 2 << 20;
    let start = dest.as_mut_ptr() as usize;
    let aligned_start = start.div_ceil(HUGE) * HUGE;
    let aligned_end = (start + dest.len()) / HUGE * HUGE;
    if aligned_end > aligned_start {
        // SAFETY: the range lies inside `dest`, memory we hold a unique borrow of; the advice
        // does not change its contents, only how the kernel backs it. Errors are ignored.
        unsafe {
            libc::madvise(
                aligned_start as *mut libc::c_void,
                aligned_end - aligned_start,
                libc::MADV_HUGEPAGE,
            );
        }
    }
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
    /// Opens `path` and validates its header against the file size.
    pub fn open(path: &Path) -> Result<Reader> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if file_len < format::PREFIX_LEN {
            return Err(Error::format(
                path,
                "header_length",
                format!("the file has only {file_len} bytes; it is truncated or not safetensors"),
            ));
        }
        let mut prefix = [0u8; 8];
        read_exact(&file, path, &mut prefix, 0)?;
        let header_len = format::parse_prefix(path, &prefix, file_len)?;
        let mut json = vec![0u8; header_len as usize];
        read_exact(&file, path, &mut json, format::PREFIX_LEN)?;
        let header = format::parse_header(path, &json, file_len)?;
        let header_crc = checksum::append(checksum::append(0, &prefix), &json);
        Ok(Reader {
            path: path.to_path_buf(),
            file,
            header,
            header_crc,
        })
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The file this reader reads.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.header.tensor(name).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{}: no tensor named `{name}` in this file",
                self.path.display()
            ))
        })
    }

    /// Fills every target with its tensor's bytes using `threads` parallel readers; with
    /// `verify`, checks each tensor against its stored crc32c (files without checksums, e.g.
    /// written by the safetensors package, are read unverified).
    ///
    /// Returns the crc32c of the whole file when `verify` is set and the targets cover every
    /// tensor (a manifest can then check that this is the file it recorded).
    ///
    /// On error the targets hold unspecified bytes; callers must discard them.
    pub fn read_into(
        &self,
        targets: &mut [ReadTarget],
        verify: bool,
        threads: usize,
    ) -> Result<Option<u32>> {
        let mut pieces = Vec::new();
        let mut infos = Vec::with_capacity(targets.len());
        for (index, target) in targets.iter_mut().enumerate() {
            let info = self.info(&target.name)?;
            if target.dest.len() as u64 != info.nbytes() {
                return Err(Error::InvalidArgument(format!(
                    "{}: tensor `{}` has {} bytes but the destination holds {}",
                    self.path.display(),
                    info.name,
                    info.nbytes(),
                    target.dest.len()
                )));
            }
            let base = self.header.data_start + info.begin;
            advise_huge_pages(target.dest);
            for (k, dest) in target.dest.chunks_mut(READ_PIECE).enumerate() {
                let offset = (k * READ_PIECE) as u64;
                pieces.push((index, offset, base + offset, dest));
            }
            infos.push(info);
        }
        let crcs = self.run_pieces(pieces, verify, threads)?;
        if !verify {
            return Ok(None);
        }
        self.check(&infos, &crcs)?;
        let by_name: std::collections::HashMap<&str, u32> =
            infos.iter().map(|i| i.name.as_str()).zip(crcs).collect();
        if by_name.len() != self.header.tensors.len() {
            return Ok(None);
        }
        Ok(Some(self.file_crc(|info| by_name[info.name.as_str()])))
    }

    /// crc32c of the whole file given each tensor's crc.
    fn file_crc(&self, crc_of: impl Fn(&TensorInfo) -> u32) -> u32 {
        let parts = self.header.tensors.iter().map(|t| (crc_of(t), t.nbytes()));
        checksum::concat(self.header_crc, parts)
    }

    /// Reads every tensor through small scratch buffers and checks its crc32c without keeping
    /// the data. Returns the whole-file crc32c and the names of the tensors that have no
    /// stored checksum.
    pub fn verify(&self, threads: usize) -> Result<(u32, Vec<String>)> {
        let infos: Vec<&TensorInfo> = self.header.tensors.iter().collect();
        let workers = threads.max(1);
        let mut scratch = vec![vec![0u8; READ_PIECE]; workers];
        // Pieces are assigned round-robin to scratch buffers and processed in `workers`-sized
        // waves so that every buffer is used by one thread at a time.
        let mut all_crcs = Vec::new();
        let mut queue: Vec<(usize, u64, u64, usize)> = Vec::new();
        for (index, info) in infos.iter().enumerate() {
            let mut offset = 0;
            while offset < info.nbytes() {
                let len = (info.nbytes() - offset).min(READ_PIECE as u64) as usize;
                queue.push((
                    index,
                    offset,
                    self.header.data_start + info.begin + offset,
                    len,
                ));
                offset += len as u64;
            }
        }
        for wave in queue.chunks(workers) {
            let pieces = wave
                .iter()
                .zip(scratch.iter_mut())
                .map(|(&(index, offset, at, len), buf)| (index, offset, at, &mut buf[..len]))
                .collect();
            all_crcs.extend(self.run_pieces_raw(pieces, true, workers)?);
        }
        let crcs = checksum::fold(infos.len(), &mut all_crcs);
        self.check(&infos, &crcs)?;
        let unchecked = infos
            .iter()
            .filter(|info| !self.header.checksums.contains_key(&info.name))
            .map(|info| info.name.clone())
            .collect();
        Ok((self.file_crc(|info| crcs[self.index_of(info)]), unchecked))
    }

    fn index_of(&self, info: &TensorInfo) -> usize {
        self.header
            .tensors
            .iter()
            .position(|t| t.name == info.name)
            .expect("info comes from this header")
    }

    fn check(&self, infos: &[&TensorInfo], crcs: &[u32]) -> Result<()> {
        for (info, &actual) in infos.iter().zip(crcs) {
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
        Ok(())
    }

    fn run_pieces(
        &self,
        pieces: Vec<(usize, u64, u64, &mut [u8])>,
        verify: bool,
        threads: usize,
    ) -> Result<Vec<u32>> {
        let count = pieces.iter().map(|p| p.0 + 1).max().unwrap_or(0);
        let mut crcs = self.run_pieces_raw(pieces, verify, threads)?;
        Ok(checksum::fold(count, &mut crcs))
    }

    /// Reads each `(tensor, tensor_offset, file_offset, dest)` piece on a pool of scoped
    /// threads; returns the crc of every piece when `verify` is set.
    fn run_pieces_raw(
        &self,
        pieces: Vec<(usize, u64, u64, &mut [u8])>,
        verify: bool,
        threads: usize,
    ) -> Result<Vec<PieceCrc>> {
        let workers = threads.clamp(1, pieces.len().max(1));
        let queue = Mutex::new(pieces.into_iter());
        let failed = AtomicBool::new(false);
        let results: Vec<Result<Vec<PieceCrc>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    scope.spawn(|| {
                        let mut crcs = Vec::new();
                        while !failed.load(Ordering::Relaxed) {
                            let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                            let Some((tensor, offset, at, dest)) = next else {
                                break;
                            };
                            if let Err(e) = read_exact(&self.file, &self.path, dest, at) {
                                failed.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                            if verify {
                                crcs.push(PieceCrc {
                                    tensor,
                                    offset,
                                    len: dest.len() as u64,
                                    crc: checksum::append(0, dest),
                                });
                            }
                        }
                        Ok(crcs)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("reader thread panicked"))
                .collect()
        });
        let mut all = Vec::new();
        for result in results {
            all.extend(result?);
        }
        Ok(all)
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
        write_file(path, descs, inputs, &BTreeMap::new(), &opts).unwrap();
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

    fn read_all(path: &Path, verify: bool) -> Result<Vec<Vec<u8>>> {
        let reader = Reader::open(path)?;
        let mut bufs: Vec<Vec<u8>> = sample()
            .iter()
            .map(|(_, _, _, b)| vec![0u8; b.len()])
            .collect();
        let mut targets: Vec<ReadTarget> = sample()
            .iter()
            .zip(bufs.iter_mut())
            .map(|((n, ..), dest)| ReadTarget {
                name: n.to_string(),
                dest: dest.as_mut_slice(),
            })
            .collect();
        reader.read_into(&mut targets, verify, 3)?;
        Ok(bufs)
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
            let (file_crc, unchecked) = Reader::open(&path).unwrap().verify(2).unwrap();
            assert!(unchecked.is_empty());
            let whole = std::fs::read(&path).unwrap();
            assert_eq!(file_crc, crate::checksum::append(0, &whole));
        }
        // Only the committed files remain: no temp siblings.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn overwriting_replaces_the_file_and_cleans_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let large = vec![("big", Dtype::U8, vec![64 << 20], vec![1u8; 64 << 20])];
        write(&path, &large, WriteOptions::default());
        let newer = vec![("only", Dtype::U8, vec![3], vec![9, 8, 7])];
        write(&path, &newer, WriteOptions::default());
        let reader = Reader::open(&path).unwrap();
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
        let header = Reader::open(&path).unwrap().header().clone();
        let big = header.tensor("big").unwrap();
        bytes[(header.data_start + big.begin + 5_000_000) as usize] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        match read_all(&path, true) {
            Err(Error::Checksum { tensor, .. }) => assert_eq!(tensor, "big"),
            other => panic!("expected checksum error, got {:?}", other.map(|_| ())),
        }
        assert!(matches!(
            Reader::open(&path).unwrap().verify(2),
            Err(Error::Checksum { .. })
        ));
        // Unverified reads do not look at checksums.
        assert!(read_all(&path, false).is_ok());
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
                matches!(Reader::open(&path), Err(Error::Format { .. })),
                "cut at {cut}"
            );
        }
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
        );
        assert!(matches!(err, Err(Error::Io { .. })));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
