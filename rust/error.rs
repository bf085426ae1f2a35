//! The one error type of the Rust core, and its single conversion to Python exceptions.
//!
//! The core modules (`format`, `checksum`, `writer`, `reader`) return [`Error`]; only the
//! `From<Error> for PyErr` impl at the bottom knows about Python. The Python classes it
//! raises live in `fastckpt.errors` so that Python owns the exception hierarchy.

use std::io;
use std::path::{Path, PathBuf};

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
         computed {actual:08x}); the file is corrupt: restore it or load an older checkpoint"
    )]
    Checksum {
        path: PathBuf,
        tensor: String,
        expected: u32,
        actual: u32,
    },
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

#[cfg(feature = "python")]
mod python {
    use super::Error;
    use pyo3::exceptions::{PyOSError, PyValueError};
    use pyo3::prelude::*;

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

    impl From<Error> for PyErr {
        fn from(err: Error) -> PyErr {
            let message = err.to_string();
            match err {
                // OSError(errno, strerror, filename) picks the right subclass
                // (FileNotFoundError, PermissionError, ...) and keeps errno for ENOSPC.
                Error::Io { path, source } => match source.raw_os_error() {
                    Some(errno) => PyOSError::new_err((
                        errno,
                        source.to_string(),
                        path.to_string_lossy().into_owned(),
                    )),
                    None => PyOSError::new_err(message),
                },
                Error::Format { .. } => python_error("CheckpointFormatError", message),
                Error::Checksum { .. } => python_error("ChecksumMismatchError", message),
                Error::InvalidArgument(_) => PyValueError::new_err(message),
            }
        }
    }
}
