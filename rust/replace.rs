//! Atomic, durable replacement of one file: write a hidden temporary sibling, fsync it,
//! rename it over the target, fsync the directory. A crash at any point leaves the target
//! holding either its old content or the complete new one, plus at most a leftover sibling
//! whose name starts with [`temp_prefix`] (removed by whoever cleans the directory up).
//!
//! The temporary-name pattern is defined here and nowhere else; Python asks for it through
//! `fastckpt._native.temp_prefix` / `TEMP_MARKER`.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// The marker every temporary sibling's name contains: `.<file name>.fastckpt-tmp.<pid>.<n>`.
pub const TEMP_MARKER: &str = ".fastckpt-tmp.";
/// Suffix of a hidden link that keeps a replaced large file alive until its background
/// deletion (it also starts with [`temp_prefix`]).
const TRASH_SUFFIX: &str = ".fastckpt-trash";
/// Old versions at least this large are deleted in the background after a commit (freeing a
/// large file's blocks is slow); smaller ones are simply replaced by the rename.
const DEFER_DELETE_BYTES: u64 = 64 << 20;

static TEMP_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The prefix of every temporary sibling (and leftover link) of a file named `file_name`:
/// `.<file_name>.fastckpt-tmp.`. A directory entry starting with it is never a committed file.
pub fn temp_prefix(file_name: &str) -> String {
    format!(".{file_name}{TEMP_MARKER}")
}

/// A hidden name beside `path`, unique per process and call, starting with [`temp_prefix`].
fn sibling(path: &Path, suffix: &str) -> Result<PathBuf> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::InvalidArgument(format!("{}: not a file path", path.display())))?;
    let unique = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let prefix = temp_prefix(&name.to_string_lossy());
    Ok(path.with_file_name(format!("{prefix}{}.{unique}{suffix}", std::process::id())))
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// fsyncs a directory so that a rename inside it is durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    File::open(dir)
        .and_then(|handle| handle.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// A temporary sibling of a target file, removed on drop unless [`TempFile::commit`]ted.
pub struct TempFile {
    path: PathBuf,
    committed: bool,
}

impl TempFile {
    /// Reserves a fresh temporary name beside `target` (the file itself is created by the
    /// caller, with `create_new`).
    pub fn beside(target: &Path) -> Result<TempFile> {
        Ok(TempFile {
            path: sibling(target, "")?,
            committed: false,
        })
    }

    /// The temporary file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the finished (and, with `fsync`, already fsynced) temporary file over `target`
    /// and fsyncs the directory.
    ///
    /// When a large `target` already exists, its inode is first kept alive under a hidden hard
    /// link: the rename then replaces the directory entry atomically without freeing the old
    /// file's blocks (~0.2 s per GiB on ext4), and the old file is deleted on a background
    /// thread after the commit (by this call where no thread can start). A leftover link of a
    /// process that died first is removed by the next commit of the same target (links are
    /// made only while the target exists, and it exists after any crash that leaves one: a
    /// commit of a new file lists nothing, so writing N new files into one folder stays
    /// linear instead of listing the folder N times).
    pub fn commit(mut self, target: &Path, fsync: bool) -> Result<()> {
        let existing = fs::metadata(target).ok();
        if existing.is_some() {
            remove_stale_trash(target);
        }
        let trash = sibling(target, TRASH_SUFFIX)?;
        let large = existing.is_some_and(|m| m.len() >= DEFER_DELETE_BYTES);
        let kept = large && fs::hard_link(target, &trash).is_ok();
        if let Err(e) = fs::rename(&self.path, target) {
            if kept {
                let _ = fs::remove_file(&trash);
            }
            return Err(Error::io(target, e));
        }
        self.committed = true;
        let synced = if fsync {
            fsync_dir(parent_dir(target))
        } else {
            Ok(())
        };
        if kept {
            // The commit is done: nothing after it may fail the call. Where the process may
            // start no thread (its thread limit: a container's pids limit, `ulimit -u`,
            // `ulimit -v`), the old file is deleted here instead.
            let doomed = trash.clone();
            let deleting = std::thread::Builder::new().spawn(move || {
                let _ = fs::remove_file(doomed);
            });
            if deleting.is_err() {
                let _ = fs::remove_file(&trash);
            }
        }
        synced
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Deletes hidden links to old versions of `target` left by a process that died before its
/// background deletion ran.
fn remove_stale_trash(target: &Path) {
    let Some(name) = target.file_name() else {
        return;
    };
    let prefix = temp_prefix(&name.to_string_lossy());
    let Ok(entries) = fs::read_dir(parent_dir(target)) else {
        return;
    };
    for entry in entries.flatten() {
        let entry_name = entry.file_name().to_string_lossy().into_owned();
        if entry_name.starts_with(&prefix) && entry_name.ends_with(TRASH_SUFFIX) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Replaces `path` with `bytes` atomically and, with `fsync`, durably. Used for small JSON
/// records such as manifests.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8], fsync: bool) -> Result<()> {
    let temp = TempFile::beside(path)?;
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(temp.path())
        .map_err(|e| Error::io(path, e))?;
    file.write_all_at(bytes, 0)
        .and_then(|()| if fsync { file.sync_all() } else { Ok(()) })
        .map_err(|e| Error::io(path, e))?;
    drop(file);
    temp.commit(path, fsync)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn temp_names_start_with_the_prefix_and_are_unique() {
        let a = sibling(Path::new("d/x.json"), "").unwrap();
        let b = sibling(Path::new("d/x.json"), "").unwrap();
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(&temp_prefix("x.json")), "{name}");
        assert!(name.contains(TEMP_MARKER));
        assert_eq!(temp_prefix("manifest.json"), ".manifest.json.fastckpt-tmp.");
    }

    #[test]
    fn replaces_atomically_and_leaves_no_sibling() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("record.json");
        write_bytes_atomic(&path, b"old", true).unwrap();
        write_bytes_atomic(&path, b"new", true).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert_eq!(names(dir.path()), ["record.json"]);
    }

    #[test]
    fn an_uncommitted_temp_file_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("x");
        let temp = TempFile::beside(&target).unwrap();
        fs::write(temp.path(), b"partial").unwrap();
        drop(temp);
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn a_failed_rename_names_the_target_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("missing-dir").join("x");
        let err = write_bytes_atomic(&target, b"x", true).unwrap_err();
        assert!(matches!(err, Error::Io { ref path, .. } if path == &target));
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn stale_trash_of_a_dead_writer_is_removed_by_the_next_commit() {
        // A writer that died after linking the old version aside left the target in place.
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("x");
        fs::write(&target, b"old").unwrap();
        let stale = dir
            .path()
            .join(format!("{}1.2{TRASH_SUFFIX}", temp_prefix("x")));
        fs::hard_link(&target, &stale).unwrap();
        write_bytes_atomic(&target, b"new", true).unwrap();
        assert_eq!(names(dir.path()), ["x"]);
        assert_eq!(fs::read(&target).unwrap(), b"new");
    }

    #[test]
    fn a_commit_of_a_new_file_leaves_the_folder_unread() {
        // Only a replaced target can have trash: a new file's commit does not list the
        // folder (a trash link whose target was deleted by hand is the folder sweep's).
        let dir = tempfile::tempdir().unwrap();
        let orphan = dir
            .path()
            .join(format!("{}1.2{TRASH_SUFFIX}", temp_prefix("y")));
        fs::write(&orphan, b"old").unwrap();
        write_bytes_atomic(&dir.path().join("y"), b"new", true).unwrap();
        assert_eq!(names(dir.path()).len(), 2);
    }
}
