//! Writing a file from its memory image: one aligned buffer laid out exactly as the file will
//! be on disk (header region, then the tensor data at the offsets [`format::plan_layout`]
//! gives), so that an async save's staging copy is the only copy of the state.
//!
//! [`write_file`](crate::writer::write_file) copies every byte from tensor memory into aligned
//! buffers before an O_DIRECT write (computing the crc32c in the same pass). A caller that
//! stages its tensors anyway can stage them straight into an image instead; [`write_image`]
//! then writes the image with O_DIRECT with no copy at all (the device reads the staging
//! memory), while a second thread computes the checksums from the same memory. The header
//! region is padded with spaces so that the data section starts at an [`ALIGN`] boundary; the
//! final header (with the checksums) is placed into the image and written last.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::checksum;
use crate::error::{Error, Result};
use crate::format::{self, Checksums, TensorDesc, TensorInfo};
use crate::progress::Progress;
use crate::replace::TempFile;
use crate::threads::on_threads;
use crate::writer::{normalize_chunk_size, Target, WriteOptions, WriteReport, ALIGN, PIECE};

/// Where everything goes in a file image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageLayout {
    /// The tensors in data order, offsets relative to `data_start` (as in the header).
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts: the header region, padded to a multiple of [`ALIGN`].
    pub data_start: u64,
    /// The file's length.
    pub file_len: u64,
    /// The image's length: `file_len` rounded up to [`ALIGN`] (O_DIRECT writes whole blocks).
    pub image_len: u64,
}

fn round_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// Lays out `descs` (any order) and `metadata` as a file image. With `checksums` the header
/// region has room for the checksum table (its width does not depend on the values).
pub fn image_layout(
    descs: Vec<TensorDesc>,
    metadata: &BTreeMap<String, String>,
    checksums: bool,
) -> Result<ImageLayout> {
    let tensors = format::plan_layout(descs)?;
    let kind = if checksums {
        Checksums::Placeholder
    } else {
        Checksums::Omitted
    };
    let header = format::encode_header(&tensors, metadata, kind)?;
    let data_start = round_up(header.len() as u64);
    let file_len = data_start + tensors.last().map_or(0, |t| t.end);
    Ok(ImageLayout {
        tensors,
        data_start,
        file_len,
        image_len: round_up(file_len),
    })
}

/// Writes `image` (laid out by [`image_layout`] with the same tensors, `metadata` and
/// checksum setting, tensor bytes already in place) to `path` durably and atomically, like
/// [`write_file`](crate::writer::write_file) writes the same tensors except for the header's
/// padding. The header region of `image` is overwritten with the final header.
///
/// With `options.direct_io` the image is written with O_DIRECT straight from its memory (it
/// must start at an [`ALIGN`]-aligned address); otherwise, or where the filesystem refuses
/// O_DIRECT, through the page cache. On any error the temporary file is removed and `path`
/// is untouched.
pub fn write_image(
    path: &Path,
    layout: &ImageLayout,
    image: &mut [u8],
    metadata: &BTreeMap<String, String>,
    options: &WriteOptions,
    progress: &Progress,
) -> Result<WriteReport> {
    if (image.len() as u64) < layout.image_len {
        return Err(Error::InvalidArgument(format!(
            "the file image of {} has {} bytes; its layout needs {}",
            path.display(),
            image.len(),
            layout.image_len
        )));
    }
    if image.as_ptr() as usize % ALIGN as usize != 0 {
        return Err(Error::InvalidArgument(format!(
            "the file image of {} does not start at a {ALIGN}-byte boundary",
            path.display()
        )));
    }
    let temp = TempFile::beside(path)?;
    let target = Target::open(temp.path(), path, options.direct_io)?;
    let crcs = write_data(&target, layout, image, options, progress)?;
    let kind = match &crcs {
        Some(values) => Checksums::Values(values),
        None => Checksums::Omitted,
    };
    let mut header = format::encode_header(&layout.tensors, metadata, kind)?;
    format::pad_header(&mut header, layout.data_start)?;
    let header_region = &mut image[..layout.data_start as usize];
    header_region.copy_from_slice(&header);
    target.write_aligned(header_region, header.len(), 0)?;
    let direct_io = target.finish(layout.file_len, options.fsync)?;
    temp.commit(path, options.fsync)?;
    let file_crc32c = crcs.as_ref().map(|crcs| {
        let sizes = layout.tensors.iter().map(TensorInfo::nbytes);
        checksum::concat(
            checksum::append(0, &header),
            crcs.iter().copied().zip(sizes),
        )
    });
    let checksums = match crcs {
        Some(crcs) => {
            let names = layout.tensors.iter().map(|t| t.name.clone());
            names.zip(crcs).collect()
        }
        None => Vec::new(),
    };
    Ok(WriteReport {
        file_len: layout.file_len,
        direct_io,
        checksums,
        file_crc32c,
    })
}

/// Writes the data section in chunks and hashes each tensor from the same memory; returns
/// the tensors' crc32c (None without checksums). `options.threads` threads in all, as for
/// [`write_file`](crate::writer::write_file): with one, the caller's thread writes, then
/// hashes; with more, one thread hashes while `threads - 1` write chunks (each takes the next
/// chunk not yet taken, so the writes stay roughly in file order).
fn write_data(
    target: &Target,
    layout: &ImageLayout,
    image: &[u8],
    options: &WriteOptions,
    progress: &Progress,
) -> Result<Option<Vec<u32>>> {
    let chunk = normalize_chunk_size(options.chunk_size);
    let data = &image[layout.data_start as usize..layout.image_len as usize];
    let stop = AtomicBool::new(false);
    let hash = || hash_tensors(&layout.tensors, data, &stop);
    std::thread::scope(|scope| {
        // Without a hashing thread (one thread in all, or the process may start no more: its
        // thread limit, a container's pids limit, `ulimit -u`, `ulimit -v`) this thread
        // hashes after the writes.
        let hasher = (options.checksums && options.threads > 1)
            .then(|| std::thread::Builder::new().spawn_scoped(scope, hash).ok())
            .flatten();
        let writers = options.threads.saturating_sub(1).max(1);
        let written = write_chunks(target, layout, image, chunk, writers, &stop, progress);
        if written.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let crcs = match hasher {
            Some(h) => Some(h.join().expect("the hashing thread does not panic")),
            None => (options.checksums && written.is_ok()).then(hash),
        };
        written.map(|()| crcs)
    })
}

/// Writes the data section's chunks with `writers` threads (the caller's among them; one the
/// process may not start, at its thread limit, is left out); the first error stops the
/// others (and `stop`, the hasher) and is returned.
fn write_chunks(
    target: &Target,
    layout: &ImageLayout,
    image: &[u8],
    chunk: u64,
    writers: usize,
    stop: &AtomicBool,
    progress: &Progress,
) -> Result<()> {
    let count = (layout.image_len - layout.data_start).div_ceil(chunk);
    let next = AtomicU64::new(0);
    let write_some = || -> Result<()> {
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(()); // another writer failed: its error is the one returned
            }
            let number = next.fetch_add(1, Ordering::Relaxed);
            if number >= count {
                return Ok(());
            }
            let offset = layout.data_start + number * chunk;
            let end = (offset + chunk).min(layout.image_len);
            let exact_end = end.min(layout.file_len);
            let written = target.write_aligned(
                &image[offset as usize..end as usize],
                (exact_end - offset) as usize,
                offset,
            );
            if written.is_err() {
                stop.store(true, Ordering::Relaxed);
                return written;
            }
            progress.add(exact_end - offset);
        }
    };
    let results = on_threads(writers.clamp(1, count.max(1) as usize), write_some);
    results.into_iter().find(Result::is_err).unwrap_or(Ok(()))
}

/// crc32c of each tensor's bytes in `data` (the data section), piece by piece so that a
/// failed write can stop it early (its result is then unused).
fn hash_tensors(tensors: &[TensorInfo], data: &[u8], stop: &AtomicBool) -> Vec<u32> {
    let mut crcs = Vec::with_capacity(tensors.len());
    for tensor in tensors {
        let mut crc = 0;
        for piece in data[tensor.begin as usize..tensor.end as usize].chunks(PIECE) {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            crc = checksum::append(crc, piece);
        }
        crcs.push(crc);
    }
    crcs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Dtype;
    use crate::writer::write_file;

    /// A heap buffer aligned to [`ALIGN`], like the staging memory Python hands in.
    struct Aligned {
        bytes: Vec<u8>,
        start: usize,
        len: usize,
    }

    impl Aligned {
        fn new(len: usize) -> Aligned {
            let bytes = vec![0u8; len + ALIGN as usize];
            let start =
                (ALIGN as usize - bytes.as_ptr() as usize % ALIGN as usize) % ALIGN as usize;
            Aligned { bytes, start, len }
        }

        fn slice(&mut self) -> &mut [u8] {
            &mut self.bytes[self.start..self.start + self.len]
        }
    }

    fn descs() -> Vec<TensorDesc> {
        vec![
            TensorDesc {
                name: "weight".into(),
                dtype: Dtype::F32,
                shape: vec![3000, 7],
            },
            TensorDesc {
                name: "bias".into(),
                dtype: Dtype::U8,
                shape: vec![13],
            },
            TensorDesc {
                name: "empty".into(),
                dtype: Dtype::F16,
                shape: vec![0],
            },
        ]
    }

    fn tensor_bytes(info: &TensorInfo) -> Vec<u8> {
        (0..info.nbytes())
            .map(|i| (i as u8).wrapping_mul(31) ^ info.name.len() as u8)
            .collect()
    }

    fn write_both(direct_io: bool, checksums: bool, threads: usize) {
        let dir = tempfile::tempdir().unwrap();
        let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let layout = image_layout(descs(), &metadata, checksums).unwrap();
        assert_eq!(layout.data_start % ALIGN, 0);
        assert_eq!(layout.image_len % ALIGN, 0);
        let mut image = Aligned::new(layout.image_len as usize);
        let owned: Vec<(String, Vec<u8>)> = layout
            .tensors
            .iter()
            .map(|t| (t.name.clone(), tensor_bytes(t)))
            .collect();
        for (t, (_, bytes)) in layout.tensors.iter().zip(&owned) {
            let at = (layout.data_start + t.begin) as usize;
            image.slice()[at..at + bytes.len()].copy_from_slice(bytes);
        }
        let options = WriteOptions {
            direct_io,
            checksums,
            threads,
            chunk_size: 2 * ALIGN,
            ..WriteOptions::default()
        };
        let from_image = dir.path().join("image.safetensors");
        let progress = Progress::default();
        let report = write_image(
            &from_image,
            &layout,
            image.slice(),
            &metadata,
            &options,
            &progress,
        )
        .unwrap();
        assert_eq!(progress.get(), layout.file_len - layout.data_start);
        let from_tensors = dir.path().join("tensors.safetensors");
        let inputs = owned
            .iter()
            .map(|(n, b)| (n.clone(), b.as_slice()))
            .collect();
        let expected = write_file(
            &from_tensors,
            descs(),
            inputs,
            &metadata,
            &options,
            &Progress::default(),
        )
        .unwrap();
        // Same tensors, same checksums; only the header's padding differs.
        assert_eq!(report.checksums, expected.checksums);
        let written = std::fs::read(&from_image).unwrap();
        assert_eq!(written.len() as u64, report.file_len);
        let reader = crate::reader::Reader::open(&from_image, false).unwrap();
        assert_eq!(reader.header().data_start, layout.data_start);
        for (t, (_, bytes)) in layout.tensors.iter().zip(&owned) {
            let at = (layout.data_start + t.begin) as usize;
            assert_eq!(&written[at..at + bytes.len()], bytes.as_slice());
        }
        if checksums {
            assert_eq!(
                report.file_crc32c,
                Some(checksum::append(0, &written)),
                "the reported file checksum is the file's"
            );
            let (file_crc, _) = reader.verify(2, &Progress::default()).unwrap();
            assert_eq!(Some(file_crc), report.file_crc32c);
        }
    }

    #[test]
    fn an_image_writes_the_same_tensors_as_write_file() {
        for direct_io in [false, true] {
            for checksums in [false, true] {
                // One thread (write, then hash), the default two, and several writers taking
                // chunks out of order with respect to one another.
                for threads in [1, 2, 5] {
                    write_both(direct_io, checksums, threads);
                }
            }
        }
    }

    #[test]
    fn a_short_or_misaligned_image_is_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let metadata = BTreeMap::new();
        let layout = image_layout(descs(), &metadata, true).unwrap();
        let path = dir.path().join("x.safetensors");
        let options = WriteOptions::default();
        let mut short = Aligned::new(layout.image_len as usize - 1);
        let err = write_image(
            &path,
            &layout,
            short.slice(),
            &metadata,
            &options,
            &Progress::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("layout needs"), "{err}");
        let mut padded = Aligned::new(layout.image_len as usize + 1);
        let err = write_image(
            &path,
            &layout,
            &mut padded.slice()[1..],
            &metadata,
            &options,
            &Progress::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("boundary"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn an_empty_file_image_has_only_its_header() {
        let dir = tempfile::tempdir().unwrap();
        let layout = image_layout(Vec::new(), &BTreeMap::new(), true).unwrap();
        assert_eq!(layout.file_len, layout.data_start);
        let mut image = Aligned::new(layout.image_len as usize);
        let path = dir.path().join("e.safetensors");
        let options = WriteOptions::default();
        let report = write_image(
            &path,
            &layout,
            image.slice(),
            &BTreeMap::new(),
            &options,
            &Progress::default(),
        )
        .unwrap();
        assert_eq!(report.file_len, layout.data_start);
        let reader = crate::reader::Reader::open(&path, false).unwrap();
        reader.verify(1, &Progress::default()).unwrap();
    }
}
