//! fastckpt's Rust core: safetensors-compatible files written with parallel chunked I/O and
//! per-tensor and header crc32c checksums, and the PyO3 bindings that expose it as
//! `fastckpt._native`.
//!
//! The core modules (`format`, `json`, `checksum`, `digest`, `writer`, `image`, `replace`, `reader`,
//! `progress`, `memory`, `error`, `threads`) know nothing about Python; the bindings, and the mapping of core errors to Python
//! exceptions, live in `py_api` and are compiled only with the `python` feature (maturin).

pub mod checksum;
pub mod digest;
pub mod error;
pub mod format;
pub mod image;
pub mod json;
pub mod memory;
pub mod progress;
pub mod reader;
pub mod replace;
mod threads;
pub mod writer;

#[cfg(feature = "python")]
mod py_api;

#[cfg(feature = "python")]
#[pyo3::pymodule]
mod _native {
    #[pymodule_export]
    use crate::py_api::{
        check_mapped, crc32c, crc32c_combine, digests, encode_header, fsync_dir, image_layout,
        open_regular, read_header, read_into, save_file, temp_prefix, verify_file,
        write_bytes_atomic, write_ceiling, write_image, ByteCounter,
    };

    #[pymodule_export]
    const TEMP_MARKER: &str = crate::replace::TEMP_MARKER;
    #[pymodule_export]
    const DEFAULT_CHUNK_SIZE: u64 = crate::writer::DEFAULT_CHUNK_SIZE;
    #[pymodule_export]
    const DEFAULT_WRITE_THREADS: usize = crate::writer::DEFAULT_WRITE_THREADS;
    #[pymodule_export]
    const DIRECT_IO_MIN_BYTES: u64 = crate::reader::DIRECT_IO_MIN_BYTES;
    #[pymodule_export]
    const STALE_CHECKSUMS_HINT: &str = crate::error::STALE_CHECKSUMS_HINT;
}
