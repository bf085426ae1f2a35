"""The one check of a recorded file: is it there, a regular file, of the recorded size, with
the recorded crc32c?

Loaders and :func:`fastckpt.verify` both go through :func:`check_recorded`; loaders read the
content as part of the check (the crc32c comes from the same read that returns the JSON bytes
or maps the tensors) and raise on the first problem (:meth:`Checked.value_or_raise`);
``verify`` keeps the :class:`FileReport` and goes on to the next file.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from fastckpt import _native
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import COMMIT_RECORD, item_files, load_json
from fastckpt.io.paths import safe_join
from fastckpt.storage.access import read_refused
from fastckpt.storage.backend import StorageBackend
from fastckpt.storage.registry import backend_for, display_path, is_local

if TYPE_CHECKING:
    import torch

__all__ = [
    "Checked",
    "FileReport",
    "Status",
    "check_recorded",
    "read_json",
    "read_manager_item",
    "read_tensor_file",
    "read_tensor_file_into",
    "takes_direct_read",
    "verify_content",
]

T = TypeVar("T")

#: ``ok``: size and checksums match. ``mismatch``: the file is readable but its size or crc32c
#: differs from the commit record (truncated, replaced, swapped). ``missing``: the record
#: names it but it is not there. ``corrupt``: it cannot be read as what it should be (bad
#: header, tensor checksum failure, escapes the checkpoint, unreadable record). ``unchecked``:
#: no damage found, but some tensors carry no checksum and no record covers the file (a lone
#: file written by the ``safetensors`` package): its bytes were read, not verified.
#: ``unreadable``: this user may not read it (``EACCES`` / ``EPERM``, an object store's access
#: denied): nothing was checked, and nothing says it is damaged.
Status = Literal["ok", "mismatch", "missing", "corrupt", "unchecked", "unreadable"]

#: Reads a file's content: ``path -> (value, whole-file crc32c or None when not computed)``.
Content = Callable[[Path], "tuple[T, int | None]"]


@dataclass
class FileReport:
    """What a check found for one file.

    Attributes:
        path: the file.
        status: ``"ok"``, ``"mismatch"``, ``"missing"``, ``"corrupt"``, ``"unchecked"`` or
            ``"unreadable"`` (see :data:`Status`).
        expected_size: size from the commit record (None: no record, e.g. a lone file).
        expected_crc32c: whole-file crc32c from the commit record (None: no record).
        actual_size: size on disk (None: not readable).
        actual_crc32c: whole-file crc32c computed now (None: not computed).
        message: why it is not ok (empty when ok), naming the file and tensor/field.
        index: the committed index the file belongs to (save_checkpoint roots), else None.
        unchecked_tensors: tensors without a stored checksum (files written by the
            ``safetensors`` package); their bytes are only covered by the record's crc32c.
    """

    path: Path
    status: Status
    expected_size: int | None = None
    expected_crc32c: int | None = None
    actual_size: int | None = None
    actual_crc32c: int | None = None
    message: str = ""
    index: int | None = None
    unchecked_tensors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the file verified (an ``unchecked`` file did not: nothing proves its bytes)."""
        return self.status == "ok"

    def note_unchecked(self, names: list[str]) -> None:
        """Record the tensors the file holds without a checksum; a file that no record
        covers with its own crc32c is then ``unchecked``, not ``ok``."""
        self.unchecked_tensors = list(names)
        if self.status == "ok" and names and self.expected_crc32c is None:
            shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            self.status = "unchecked"
            self.message = (
                f"{display_path(self.path)}: {len(names)} tensor(s) without a checksum ({shown}): "
                "their bytes were read, not verified (written without fastckpt's checksums, e.g. "
                "by the safetensors package; re-save it with fastckpt.save_file to protect it)"
            )


@dataclass
class Checked(Generic[T]):
    """The outcome of :func:`check_recorded`: the report, the content read, and the error a
    loader raises when the file is not ok."""

    report: FileReport
    value: T | None = None
    error: BaseException | None = None

    def value_or_raise(self) -> T:
        """The content, or the typed error: ``FileNotFoundError`` (missing),
        ``CheckpointFormatError`` (size, not a regular file, bad content),
        ``ChecksumMismatchError`` (crc32c), each naming the file."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


def check_recorded(
    path: Path,
    expected: Mapping[str, int | None] | None,
    content: Content[T],
    *,
    source: str,
    index: int | None = None,
    backend: StorageBackend | None = None,
) -> Checked[T]:
    """Check one file against its record and read its content.

    Args:
        path: the file (already checked to stay inside its checkpoint).
        expected: its ``{"size", "crc32c"}`` record, or None (a lone file: no record).
        content: reads the file; returns the value and the whole-file crc32c it computed.
            Format and checksum errors it raises make the file ``corrupt``.
        source: the record, for messages (``ROOT/manifest.json``, ``CKPT/commit.json``).
        index: the committed index, copied into the report.
        backend: where the file lives (default: :func:`~fastckpt.storage.registry.backend_for`).
    """
    store = backend or backend_for(path)
    size = None if expected is None else expected["size"]
    crc = None if expected is None else expected["crc32c"]
    report = FileReport(path, "ok", size, crc, index=index)

    def fail(status: Status, error: BaseException, message: str | None = None) -> Checked[T]:
        report.status, report.message = status, message or str(error)
        return Checked(report, None, error)

    shown = display_path(path)
    shown_source = display_path(source)
    try:
        info = store.stat(path)
    except FileNotFoundError:
        message = f"{shown}: missing (listed in {shown_source})"
        return fail("missing", FileNotFoundError(errno.ENOENT, message, shown), message)
    except PermissionError as err:
        return _unreadable(report, path, err, store)
    except OSError as err:
        return fail("corrupt", err, f"{shown}: cannot be read ({err})")
    if not info.regular:
        return fail("corrupt", CheckpointFormatError(f"{shown}: not a regular file"))
    report.actual_size = info.size
    if size is not None and info.size != size:
        return fail(
            "mismatch",
            CheckpointFormatError(
                f"{shown}: size {info.size} differs from the recorded {size} ({shown_source}); the "
                "file was truncated or replaced"
            ),
        )
    try:
        value, actual = content(path)
    except (ChecksumMismatchError, CheckpointFormatError) as err:
        return fail("corrupt", err)
    except FileNotFoundError as err:
        return fail("missing", err, f"{shown}: disappeared while being read")
    except PermissionError as err:
        return _unreadable(report, path, err, store)
    except OSError as err:
        return fail("corrupt", err, f"{shown}: cannot be read ({err})")
    report.actual_crc32c = actual
    if crc is not None and actual is not None and actual != crc:
        return fail(
            "mismatch",
            ChecksumMismatchError(
                f"{shown}: file crc32c {actual:08x} differs from the recorded {crc:08x} "
                f"({shown_source}); the file was replaced, swapped with another checkpoint's, or "
                "corrupted"
            ),
        )
    return Checked(report, value)


def _unreadable(
    report: FileReport, path: Path, err: PermissionError, store: StorageBackend
) -> Checked[Any]:
    """``path`` this user may not read: ``unreadable``, never ``corrupt`` (before, a
    checkpoint of another user's was reported damaged); the error says who owns it and the
    fix (an object store's access denied as it is)."""
    error = read_refused(path, err) if is_local(store) else err
    report.status, report.message = "unreadable", error.strerror or str(error)
    return Checked(report, None, error)


# --------------------------------------------------------------------------- contents


def verify_content(threads: int, backend: StorageBackend | None = None) -> Content[list[str]]:
    """Read a file only to check it: tensor files tensor by tensor (the value is the list of
    tensors without a stored checksum), other files as bytes."""

    def read(path: Path) -> tuple[list[str], int | None]:
        store = backend or backend_for(path)
        if path.name.endswith(".safetensors"):
            return _swap(store.verify_tensors(path, threads))
        return [], store.checksum(path)[1]

    return read


def _swap(pair: tuple[int, list[str]]) -> tuple[list[str], int]:
    return pair[1], pair[0]


def _bytes_content(path: Path) -> tuple[bytes, int]:
    data = backend_for(path).read_bytes(path)
    return data, _native.crc32c(data)


def read_json(path: Path, expected: Mapping[str, int], *, source: str) -> Any:
    """The parsed JSON document of a recorded file (raising on any problem; the checksum is
    compared before the bytes are parsed, so damage is a checksum error)."""
    data = check_recorded(path, expected, _bytes_content, source=source).value_or_raise()
    return load_json(path, data)


def read_tensor_file(
    path: Path, expected: Mapping[str, int], *, source: str
) -> dict[str, torch.Tensor]:
    """The verified tensors of a recorded safetensors file (views of a private mapping)."""

    def content(path: Path) -> tuple[dict[str, torch.Tensor], int | None]:
        tensors, info = backend_for(path).open_tensors(path, verify=True)
        return tensors, info["file_crc32c"]

    return check_recorded(path, expected, content, source=source).value_or_raise()


def takes_direct_read(template: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether the bytes of a stored tensor of ``dtype`` and ``shape`` can be read straight
    into ``template``'s memory: a plain dense CPU tensor or parameter (subclasses may define
    their own storage), contiguous, of that dtype and shape, with no lazy conjugation or
    negation, not an inference tensor (``copy_`` refuses those outside inference mode; the
    copy path keeps that error)."""
    import torch  # deferred: the container layer imports without torch

    return (
        type(template) in (torch.Tensor, torch.nn.Parameter)
        and template.device.type == "cpu"
        and template.layout is torch.strided
        and template.dtype == dtype
        and list(template.shape) == shape
        and template.is_contiguous()
        and not template.is_conj()
        and not template.is_neg()
        and not template.is_inference()
    )


def read_tensor_file_into(
    path: Path,
    expected: Mapping[str, int],
    targets: Mapping[str, torch.Tensor] | None = None,
    *,
    source: str,
    threads: int | None = None,
    fresh_targets: bool = False,
) -> dict[str, torch.Tensor]:
    """The verified tensors of a recorded safetensors file on the local filesystem, read by
    positional reads straight into memory the caller keeps: each tensor named in ``targets``
    into that tensor (the caller checked it takes the bytes as they are, see
    :func:`takes_direct_read`), every other one into fresh CPU memory.
    Each byte is moved once (no mapping, no copy after it) by the Rust core's threads
    (``threads``, default :func:`fastckpt.io.headers.load_threads`), every tensor's stored
    crc32c checked on that pass and the whole file's compared with ``expected``, as
    :func:`read_tensor_file` does. The fresh memory's pages (and the targets', when
    ``fresh_targets`` says they were allocated for this load and never touched: a model
    rebuilt in uninitialized memory) are mapped in one call per piece before it is read into.

    Raises what :func:`read_tensor_file` raises; the targets may then hold partial bytes.
    """

    from fastckpt.io.files import byte_view, dtype_from_name, empty_tensor, read_into, torch_shape
    from fastckpt.io.headers import load_threads
    from fastckpt.io.progress import active_counter

    chosen = targets or {}

    shown = display_path(path)

    def content(path: Path) -> tuple[dict[str, torch.Tensor], int | None]:
        header = _native.read_header(str(path))
        tensors: dict[str, torch.Tensor] = {}
        entries = []
        fresh = set()  # allocated here, never touched: mapped in one call per piece
        for entry in header["tensors"]:
            name = entry["name"]
            tensor = chosen.get(name)
            if tensor is None:
                shape = torch_shape(f"{shown}: tensor {name!r}", entry["dtype"], entry["shape"])
                tensor = empty_tensor(shape, dtype_from_name(entry["dtype"]))
                fresh.add(name)
            elif fresh_targets:
                fresh.add(name)
            tensors[name] = tensor
            memory = byte_view(tensor.detach())
            entries.append((name, entry["dtype"], list(entry["shape"]), memory))
        unknown = sorted(set(chosen) - set(tensors))
        if unknown:
            raise CheckpointFormatError(f"{shown}: has no tensor {unknown[0]!r}")
        crc = read_into(
            str(path),
            entries,
            threads or load_threads(),
            progress=active_counter(),
            fresh=fresh,
        )
        return tensors, crc

    return check_recorded(path, expected, content, source=source).value_or_raise()


def read_manager_item(
    directory: Path, record: Mapping[str, Any], key: str, rank: int = 0
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The skeleton and the tensors of item ``key`` of a CheckpointManager checkpoint whose
    commit record is ``record``, both checked against it (rebuild the value with
    :func:`fastckpt.io.tree.unflatten`)."""
    source = str(directory / COMMIT_RECORD)

    def recorded(relpath: str) -> tuple[Path, Mapping[str, int]]:
        entry = record["files"].get(relpath)
        if entry is None:
            raise CheckpointFormatError(f"{directory / relpath}: not listed in {COMMIT_RECORD}")
        return safe_join(directory, relpath), entry

    skeleton_file, tensor_file = item_files(record, key, rank)
    document = read_json(*recorded(skeleton_file), source=source)
    if not isinstance(document, Mapping) or "skeleton" not in document:
        raise CheckpointFormatError(f"{directory / skeleton_file}: field 'skeleton' is required")
    return document["skeleton"], read_tensor_file(*recorded(tensor_file), source=source)
