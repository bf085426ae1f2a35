//! The Python bindings: every function extracts its arguments, releases the GIL for all I/O
//! and hashing (`py.detach`), calls the core, and lets `From<Error> for PyErr` (defined here,
//! the only place that knows both the core's errors and Python's exceptions) map errors.
//!
//! Tensor bytes cross the boundary as buffer-protocol views (`numpy` uint8 views of tensor
//! storage): no copy is made, and the `PyBuffer` handles keep the Python objects alive and
//! their memory pinned until the call returns.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::error::Error;
use crate::format::{Dtype, Header, TensorDesc};
use crate::image;
use crate::progress::Progress;
use crate::reader::{Destination, MappedFile, Reader};
use crate::replace;
use crate::writer::{self, WriteOptions};

/// Builds an instance of `fastckpt.errors.<name>(message)`; falls back to ValueError if the
/// Python package cannot be imported (it always can when the extension is used normally).
fn python_error(name: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let class = py
            .import("fastckpt.errors")
            .and_then(|module| module.getattr(name));
        match class {
            Ok(class) => match class.call1((message.clone(),)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(err) => err,
            },
            Err(_) => PyValueError::new_err(message),
        }
    })
}

/// The core's errors as Python exceptions: OS errors keep their errno (so `OSError` picks
/// `FileNotFoundError`, `PermissionError`, ... and ENOSPC stays visible) and the file name;
/// format and checksum errors are `fastckpt.errors` classes, so Python owns the hierarchy.
impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        let message = err.to_string();
        match err {
            Error::Io { path, source } => match source.raw_os_error() {
                Some(errno) => PyOSError::new_err((
                    errno,
                    source.to_string(),
                    path.to_string_lossy().into_owned(),
                )),
                None => PyOSError::new_err(message),
            },
            Error::Format { .. } | Error::NotRegularFile { .. } => {
                python_error("CheckpointFormatError", message)
            }
            Error::Checksum { .. } => python_error("ChecksumMismatchError", message),
            Error::InvalidArgument(_) => python_error("InvalidInputError", message),
        }
    }
}

/// Address and length of a contiguous byte buffer, sendable to GIL-free threads.
#[derive(Clone, Copy)]
struct RawBytes {
    addr: usize,
    len: usize,
}

impl RawBytes {
    /// Takes the address of a C-contiguous byte buffer.
    fn of(buffer: &PyBuffer<u8>, what: &str) -> PyResult<RawBytes> {
        let slice = buffer.as_slice_ptr().ok_or_else(|| {
            PyValueError::new_err(format!(
                "{what}: buffer is not C-contiguous; call `.contiguous()` on the tensor first"
            ))
        })?;
        Ok(RawBytes {
            addr: slice.as_ptr() as *mut u8 as usize,
            len: slice.len(),
        })
    }

    /// # Safety
    ///
    /// The buffer this was taken from must stay alive for `'a`, and nothing in this process may
    /// write to it meanwhile (another process editing a mapped file can still change the
    /// bytes; readers only hash them, and a mismatch is then reported as corruption).
    unsafe fn as_slice<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller keeps the exporting object (and its `PyBuffer`) alive, so `addr`
        // points to `len` readable bytes for the whole call.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    /// # Safety
    ///
    /// As [`RawBytes::as_slice`], for a writable buffer, and nothing else may read or write it
    /// meanwhile.
    unsafe fn as_mut_slice<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above; the exporter said the buffer is writable.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// A byte counter the Rust core advances while it writes, reads or hashes tensor bytes (GIL
/// released): pass one as `progress=` to `save_file`, `check_mapped` or `verify_file` and
/// read `.value` from another thread to draw a progress bar.
#[pyclass(frozen, module = "fastckpt._native")]
pub struct ByteCounter {
    inner: Arc<Progress>,
}

#[pymethods]
impl ByteCounter {
    #[new]
    fn new() -> Self {
        ByteCounter {
            inner: Arc::new(Progress::default()),
        }
    }

    /// Bytes of tensor data done so far.
    #[getter]
    fn value(&self) -> u64 {
        self.inner.get()
    }
}

/// The core's counter behind an optional Python `ByteCounter` (a private one when None).
fn counter(progress: Option<PyRef<'_, ByteCounter>>) -> Arc<Progress> {
    progress.map_or_else(|| Arc::new(Progress::default()), |p| p.inner.clone())
}

fn parse_dtype(name: &str, tensor: &str) -> PyResult<Dtype> {
    Dtype::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "tensor `{tensor}`: unknown safetensors dtype `{name}`"
        ))
    })
}

/// Writes tensors to `path` as a safetensors file with crc32c checksums, atomically.
///
/// `tensors` is a list of `(name, dtype, shape, bytes_view)`; `progress` (a `ByteCounter`)
/// advances by the tensor bytes written. Returns
/// `{"file_len": int, "direct_io": bool, "checksums": {name: int}}`.
#[pyfunction]
#[pyo3(signature = (
    path, tensors, metadata, threads, chunk_size, direct_io, fsync, checksums=true, progress=None
))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn save_file<'py>(
    py: Python<'py>,
    path: PathBuf,
    tensors: Vec<(String, String, Vec<u64>, Bound<'py, PyAny>)>,
    metadata: BTreeMap<String, String>,
    threads: usize,
    chunk_size: u64,
    direct_io: bool,
    fsync: bool,
    checksums: bool,
    progress: Option<PyRef<'py, ByteCounter>>,
) -> PyResult<Bound<'py, PyDict>> {
    let progress = counter(progress);
    let mut descs = Vec::with_capacity(tensors.len());
    let mut buffers = Vec::with_capacity(tensors.len());
    let mut raws = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, data) in tensors {
        let buffer = PyBuffer::<u8>::get(&data)?;
        raws.push((name.clone(), RawBytes::of(&buffer, &name)?));
        buffers.push(buffer);
        descs.push(TensorDesc {
            dtype: parse_dtype(&dtype, &name)?,
            name,
            shape,
        });
    }
    let options = WriteOptions {
        threads: threads.max(1),
        chunk_size,
        direct_io,
        fsync,
        checksums,
    };
    let report = py.detach(|| {
        // SAFETY: `buffers` (alive until this function returns) keeps every view valid.
        let inputs = raws
            .iter()
            .map(|(name, raw)| (name.clone(), unsafe { raw.as_slice() }))
            .collect();
        writer::write_file(&path, descs, inputs, &metadata, &options, &progress)
    })?;
    drop(buffers);
    report_dict(py, report)
}

fn report_dict(py: Python<'_>, report: writer::WriteReport) -> PyResult<Bound<'_, PyDict>> {
    let result = PyDict::new(py);
    result.set_item("file_len", report.file_len)?;
    result.set_item("direct_io", report.direct_io)?;
    result.set_item("file_crc32c", report.file_crc32c)?;
    let checksums = PyDict::new(py);
    for (name, crc) in report.checksums {
        checksums.set_item(name, crc)?;
    }
    result.set_item("checksums", checksums)?;
    Ok(result)
}

/// Validates the safetensors file whose whole content is `data` (a byte view of a private
/// mapping of `path`, which names the file in errors) and, with `verify`, checks every
/// tensor's crc32c reading `data` on `threads` threads without the GIL (advancing `progress`
/// by the bytes hashed).
///
/// Returns the header as :func:`read_header` does, plus `"file_crc32c"` (an int with
/// `verify`, else None).
#[pyfunction]
#[pyo3(signature = (path, data, verify, threads, progress=None))]
pub fn check_mapped<'py>(
    py: Python<'py>,
    path: PathBuf,
    data: Bound<'py, PyAny>,
    verify: bool,
    threads: usize,
    progress: Option<PyRef<'py, ByteCounter>>,
) -> PyResult<Bound<'py, PyDict>> {
    let progress = counter(progress);
    let buffer = PyBuffer::<u8>::get(&data)?;
    let raw = RawBytes::of(&buffer, &path.display().to_string())?;
    let (header, file_crc) = py.detach(|| {
        // SAFETY: `buffer` keeps the mapping alive until this function returns.
        let mapped = MappedFile::parse(&path, unsafe { raw.as_slice() })?;
        let file_crc = if verify {
            Some(mapped.verify(threads.max(1), &progress)?)
        } else {
            None
        };
        crate::error::Result::Ok((mapped.header().clone(), file_crc))
    })?;
    drop(buffer);
    let result = header_dict(py, &header)?;
    result.set_item("file_crc32c", file_crc)?;
    Ok(result)
}

/// Returns the validated header of `path` as a dict:
/// `{"tensors": [{"name", "dtype", "shape", "data_offsets"}], "metadata": {..},
/// "checksums": {name: int}, "header_crc32c": int | None, "data_start": int, "file_len": int}`.
/// `path` must be a regular file (a symbolic link is followed only with `follow_symlinks`).
#[pyfunction]
#[pyo3(signature = (path, follow_symlinks=true))]
pub fn read_header(
    py: Python<'_>,
    path: PathBuf,
    follow_symlinks: bool,
) -> PyResult<Bound<'_, PyDict>> {
    let reader = py.detach(|| Reader::open(&path, follow_symlinks))?;
    header_dict(py, reader.header())
}

fn header_dict<'py>(py: Python<'py>, header: &Header) -> PyResult<Bound<'py, PyDict>> {
    let tensors = PyList::empty(py);
    for info in &header.tensors {
        let entry = PyDict::new(py);
        entry.set_item("name", &info.name)?;
        entry.set_item("dtype", info.dtype.name())?;
        entry.set_item("shape", info.shape.clone())?;
        entry.set_item("data_offsets", (info.begin, info.end))?;
        tensors.append(entry)?;
    }
    let result = PyDict::new(py);
    result.set_item("tensors", tensors)?;
    result.set_item("metadata", header.metadata.clone())?;
    result.set_item("checksums", header.checksums.clone())?;
    result.set_item("header_crc32c", header.header_crc32c)?;
    result.set_item("data_start", header.data_start)?;
    result.set_item("file_len", header.file_len())?;
    Ok(result)
}

/// Reads every tensor of `path` (a regular file; a symbolic link is followed only with
/// `follow_symlinks`) and checks its crc32c (advancing `progress` by the bytes read); raises
/// on any mismatch. Returns
/// `(file_crc32c, names of tensors without a stored checksum)`.
#[pyfunction]
#[pyo3(signature = (path, threads, follow_symlinks=true, progress=None))]
pub fn verify_file(
    py: Python<'_>,
    path: PathBuf,
    threads: usize,
    follow_symlinks: bool,
    progress: Option<PyRef<'_, ByteCounter>>,
) -> PyResult<(u32, Vec<String>)> {
    let progress = counter(progress);
    Ok(py.detach(|| Reader::open(&path, follow_symlinks)?.verify(threads.max(1), &progress))?)
}

/// Reads tensors of `path` (a regular file; a symbolic link is followed only with
/// `follow_symlinks`) straight into the caller's buffers with positional reads on `threads`
/// threads, GIL released: `tensors` lists `(name, dtype, shape, buffer)`, each buffer a
/// writable C-contiguous byte view (a uint8 numpy view of a tensor's memory) of exactly that
/// tensor's size; buffers must not overlap. Every tensor is hashed as it is read (the others
/// through scratch buffers) and its crc32c checked; raises on any mismatch, naming file and
/// tensor (the buffers then hold partial or damaged bytes). Returns the whole-file crc32c.
/// `fresh` names the tensors whose buffers are fresh memory (allocated for this read, never
/// touched): their pages are mapped in one call per piece before the read, not faulted in
/// one by one.
#[pyfunction]
#[pyo3(signature = (path, tensors, threads, follow_symlinks=true, progress=None, fresh=None))]
#[allow(clippy::type_complexity)]
pub fn read_into<'py>(
    py: Python<'py>,
    path: PathBuf,
    tensors: Vec<(String, String, Vec<u64>, Bound<'py, PyAny>)>,
    threads: usize,
    follow_symlinks: bool,
    progress: Option<PyRef<'py, ByteCounter>>,
    fresh: Option<std::collections::HashSet<String>>,
) -> PyResult<u32> {
    let fresh = fresh.unwrap_or_default();
    let progress = counter(progress);
    let mut buffers = Vec::with_capacity(tensors.len());
    let mut targets = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, data) in tensors {
        let buffer = PyBuffer::<u8>::get(&data)?;
        if buffer.readonly() {
            return Err(PyValueError::new_err(format!(
                "{}: the buffer of tensor `{name}` is read-only",
                path.display()
            )));
        }
        let raw = RawBytes::of(&buffer, &name)?;
        buffers.push(buffer);
        targets.push((name.clone(), parse_dtype(&dtype, &name)?, shape, raw));
    }
    // The destinations become `&mut` slices used by several threads: they must be disjoint.
    let mut spans: Vec<(usize, usize, &str)> = targets
        .iter()
        .filter(|(.., raw)| raw.len > 0)
        .map(|(name, .., raw)| (raw.addr, raw.addr + raw.len, name.as_str()))
        .collect();
    spans.sort_unstable();
    if let Some(pair) = spans.windows(2).find(|pair| pair[0].1 > pair[1].0) {
        return Err(PyValueError::new_err(format!(
            "{}: the buffers of tensors `{}` and `{}` overlap",
            path.display(),
            pair[0].2,
            pair[1].2
        )));
    }
    let crc = py.detach(|| {
        let destinations = targets
            .into_iter()
            .map(|(name, dtype, shape, raw)| Destination {
                fresh: fresh.contains(&name),
                name,
                dtype,
                shape,
                // SAFETY: `buffers` (alive until this function returns) keeps every writable
                // buffer valid, the spans were checked to be disjoint, and the caller does not
                // touch them while the read runs.
                bytes: unsafe { raw.as_mut_slice() },
            })
            .collect();
        Reader::open(&path, follow_symlinks)?.read_into(destinations, threads.max(1), &progress)
    })?;
    drop(buffers);
    Ok(crc)
}

/// Opens `path` read-only if it is a regular file and returns the descriptor (the caller owns
/// it: wrap it with `os.fdopen` or close it). FIFOs, devices and sockets raise
/// `CheckpointFormatError` at once without blocking or reading; a symbolic link as the last
/// component is refused unless `follow_symlinks`; a directory raises `IsADirectoryError`.
#[pyfunction]
#[pyo3(signature = (path, follow_symlinks=true))]
pub fn open_regular(py: Python<'_>, path: PathBuf, follow_symlinks: bool) -> PyResult<i32> {
    use std::os::fd::IntoRawFd;
    let file = py.detach(|| crate::reader::open_regular(&path, follow_symlinks))?;
    Ok(file.into_raw_fd())
}

/// crc32c of any C-contiguous buffer (`bytes`, `memoryview`, a numpy array...; hardware
/// accelerated, GIL released, no copy), continuing from `value`.
#[pyfunction]
#[pyo3(signature = (data, value=0))]
pub fn crc32c(py: Python<'_>, data: Bound<'_, PyAny>, value: u32) -> PyResult<u32> {
    let buffer = PyBuffer::<u8>::get(&data)?;
    let raw = RawBytes::of(&buffer, "crc32c input")?;
    // SAFETY: `buffer` keeps the exporter alive and pinned until this function returns.
    let crc = py.detach(|| crate::checksum::append(value, unsafe { raw.as_slice() }));
    drop(buffer);
    Ok(crc)
}

/// BLAKE3 digests (32 bytes each) of C-contiguous buffers, in order, computed on up to
/// `threads` threads with the GIL released (no copy): the content proof incremental saves
/// compare before they skip a tensor.
#[pyfunction]
#[pyo3(signature = (buffers, threads=2))]
pub fn digests<'py>(
    py: Python<'py>,
    buffers: Vec<Bound<'py, PyAny>>,
    threads: usize,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let mut held = Vec::with_capacity(buffers.len());
    let mut raws = Vec::with_capacity(buffers.len());
    for data in &buffers {
        let buffer = PyBuffer::<u8>::get(data)?;
        raws.push(RawBytes::of(&buffer, "digest input")?);
        held.push(buffer);
    }
    let values = py.detach(|| {
        // SAFETY: `held` keeps every exporter alive and pinned until this function returns.
        let inputs: Vec<&[u8]> = raws.iter().map(|raw| unsafe { raw.as_slice() }).collect();
        crate::digest::digest_all(&inputs, threads)
    });
    drop(held);
    Ok(values.iter().map(|v| PyBytes::new(py, v)).collect())
}

/// crc32c of the concatenation A + B from `crc32c(A)`, `crc32c(B)` and `len(B)`.
#[pyfunction]
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    crate::checksum::combine(crc_a, crc_b, len_b)
}

/// The safetensors header fastckpt writes for `tensors` (`(name, dtype, shape)`, in any
/// order) and `metadata`: the tensors are laid out as `save_file` lays them out, and with
/// `checksums` (`{name: crc32c}`) the header carries the per-tensor table and the header
/// checksum. Returns `(header bytes: prefix + padded JSON, [(name, begin, end)] in data order)`
/// so that a writer elsewhere (object storage) produces exactly what `save_file` would.
#[pyfunction]
#[pyo3(signature = (tensors, metadata, checksums=None))]
#[allow(clippy::type_complexity)]
pub fn encode_header<'py>(
    py: Python<'py>,
    tensors: Vec<(String, String, Vec<u64>)>,
    metadata: BTreeMap<String, String>,
    checksums: Option<std::collections::HashMap<String, u32>>,
) -> PyResult<(Bound<'py, pyo3::types::PyBytes>, Vec<(String, u64, u64)>)> {
    let layout = crate::format::plan_layout(tensor_descs(tensors)?)?;
    let crcs = match &checksums {
        None => None,
        Some(by_name) => Some(
            layout
                .iter()
                .map(|t| {
                    by_name.get(&t.name).copied().ok_or_else(|| {
                        PyValueError::new_err(format!("no checksum given for tensor `{}`", t.name))
                    })
                })
                .collect::<PyResult<Vec<u32>>>()?,
        ),
    };
    let kind = match &crcs {
        None => crate::format::Checksums::Omitted,
        Some(values) => crate::format::Checksums::Values(values),
    };
    let header = crate::format::encode_header(&layout, &metadata, kind)?;
    let ranges = layout
        .into_iter()
        .map(|t| (t.name, t.begin, t.end))
        .collect();
    Ok((pyo3::types::PyBytes::new(py, &header), ranges))
}

fn tensor_descs(tensors: Vec<(String, String, Vec<u64>)>) -> PyResult<Vec<TensorDesc>> {
    tensors
        .into_iter()
        .map(|(name, dtype, shape)| {
            Ok(TensorDesc {
                dtype: parse_dtype(&dtype, &name)?,
                name,
                shape,
            })
        })
        .collect()
}

/// The file image layout of `tensors` (`(name, dtype, shape)`, any order) and `metadata`: an
/// async save stages its tensors into one aligned buffer laid out like this and hands it to
/// [`write_image`]. Returns `(data_start, image_len, [(name, begin, end)] in data order)`,
/// offsets relative to `data_start`.
#[pyfunction]
#[pyo3(signature = (tensors, metadata, checksums=true))]
#[allow(clippy::type_complexity)]
pub fn image_layout(
    tensors: Vec<(String, String, Vec<u64>)>,
    metadata: BTreeMap<String, String>,
    checksums: bool,
) -> PyResult<(u64, u64, Vec<(String, u64, u64)>)> {
    let layout = image::image_layout(tensor_descs(tensors)?, &metadata, checksums)?;
    let ranges = layout
        .tensors
        .into_iter()
        .map(|t| (t.name, t.begin, t.end))
        .collect();
    Ok((layout.data_start, layout.image_len, ranges))
}

/// Writes a file image (a writable, 4096-byte aligned byte buffer laid out by
/// [`image_layout`] for the same `tensors`, `metadata` and `checksums`, tensor bytes in
/// place) to `path` atomically, without copying it: O_DIRECT straight from the image with
/// `direct_io`; `threads` in all (>= 1: with more than one, one computes the checksums from
/// the same memory while the others write). `data_start` must be the one `image_layout`
/// returned. Returns what `save_file` returns.
#[pyfunction]
#[pyo3(signature = (
    path, tensors, image, data_start, metadata, chunk_size, direct_io, fsync, checksums=true,
    progress=None, threads=crate::writer::DEFAULT_WRITE_THREADS
))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn write_image<'py>(
    py: Python<'py>,
    path: PathBuf,
    tensors: Vec<(String, String, Vec<u64>)>,
    image: Bound<'py, PyAny>,
    data_start: u64,
    metadata: BTreeMap<String, String>,
    chunk_size: u64,
    direct_io: bool,
    fsync: bool,
    checksums: bool,
    progress: Option<PyRef<'py, ByteCounter>>,
    threads: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let progress = counter(progress);
    let layout = image::image_layout(tensor_descs(tensors)?, &metadata, checksums)
        .map_err(|error| crate::format::for_file(&path, error))?;
    if layout.data_start != data_start {
        return Err(PyValueError::new_err(format!(
            "{}: the file image was laid out for data at {data_start}, but these tensors and \
             metadata put it at {}; lay it out again with image_layout",
            path.display(),
            layout.data_start
        )));
    }
    let buffer = PyBuffer::<u8>::get(&image)?;
    if buffer.readonly() {
        return Err(PyValueError::new_err(format!(
            "{}: the file image must be writable (its header region is filled in)",
            path.display()
        )));
    }
    let raw = RawBytes::of(&buffer, "file image")?;
    let options = WriteOptions {
        chunk_size,
        threads: threads.max(1),
        direct_io,
        fsync,
        checksums,
    };
    let report = py.detach(|| {
        // SAFETY: `buffer` (alive until this function returns) keeps the writable image valid;
        // the caller does not touch it while the write runs.
        let image = unsafe { raw.as_mut_slice() };
        image::write_image(&path, &layout, image, &metadata, &options, &progress)
    })?;
    drop(buffer);
    report_dict(py, report)
}

/// Replaces `path` with `data` atomically and (with `fsync`) durably.
#[pyfunction]
#[pyo3(signature = (path, data, fsync=true))]
pub fn write_bytes_atomic(py: Python<'_>, path: PathBuf, data: &[u8], fsync: bool) -> PyResult<()> {
    Ok(py.detach(|| replace::write_bytes_atomic(&path, data, fsync))?)
}

/// fsyncs a directory (makes renames inside it durable).
#[pyfunction]
pub fn fsync_dir(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    Ok(py.detach(|| replace::fsync_dir(&path))?)
}

/// The prefix of every temporary sibling fastckpt creates while replacing a file named
/// `file_name` (`".<file_name>.fastckpt-tmp."`): a directory entry starting with it is never a
/// committed file and may be removed once no writer is running.
#[pyfunction]
pub fn temp_prefix(file_name: &str) -> String {
    replace::temp_prefix(file_name)
}

/// Benchmark helper: writes `length` bytes to `path` as one O_DIRECT stream of `block`-sized
/// aligned writes plus fsync. Returns whether O_DIRECT was available.
#[pyfunction]
pub fn write_ceiling(py: Python<'_>, path: PathBuf, length: u64, block: u64) -> PyResult<bool> {
    Ok(py.detach(|| writer::write_ceiling(&path, length, block))?)
}
