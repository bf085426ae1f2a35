//! The one error type of the Rust core. It knows nothing about Python: the bindings
//! (`py_api`) map each variant to a Python exception.

use std::io;
use std::path::{Path, PathBuf};

/// What a checksum mismatch adds to "the file is corrupt": a file another tool rewrote with
/// fastckpt's checksum keys copied into its metadata (safetensors' `save_file(tensors, out,
/// metadata=f.metadata())` of a fastckpt file) fails them too, with nothing damaged. Such a
/// file is still refused (its bytes cannot be told from damage); this says how to load it.
/// The keys are [`crate::format::CHECKSUM_KEY`] and [`crate::format::HEADER_CRC_KEY`].
pub const STALE_CHECKSUMS_HINT: &str = "(or another tool rewrote the file with fastckpt's \
     metadata keys `fastckpt.crc32c` and `fastckpt.header_crc32c` copied, now stale: drop both \
     keys from its metadata to load it unchecked)";

/// Everything that can go wrong while writing or reading a fastckpt/safetensors file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system error on a named file (keeps errno for the Python side).
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The file is not a valid safetensors file (or lies about its layout).
    #[error("{path}: malformed header field `{field}`: {message}")]
    Format {
        path: PathBuf,
        field: String,
        message: String,
    },
    /// Tensor bytes on disk do not match the crc32c recorded when they were written.
    #[error(
        "{path}: checksum mismatch in tensor `{tensor}` (stored crc32c {expected:08x}, \
         computed {actual:08x}); the file is corrupt: restore it or load an older checkpoint \
         {STALE_CHECKSUMS_HINT}"
    )]
    Checksum {
        path: PathBuf,
        tensor: String,
        expected: u32,
        actual: u32,
    },
    /// The path names something other than a regular file (a FIFO, a device, a socket, or a
    /// symbolic link where none is allowed); refused before reading a byte.
    #[error(
        "{path}: not a regular file ({kind}); fastckpt reads only regular files, refused \
         without reading it"
    )]
    NotRegularFile { path: PathBuf, kind: &'static str },
    /// The caller passed something the core cannot work with.
    #[error("{0}")]
    InvalidArgument(String),
}

impl Error {
    /// Wraps an `io::Error` with the path it happened on.
    pub fn io(path: &Path, source: io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// A format error on `path` about header field `field`.
    pub fn format(path: &Path, field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Format {
            path: path.to_path_buf(),
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Result alias for the core.
pub type Result<T> = std::result::Result<T, Error>;
