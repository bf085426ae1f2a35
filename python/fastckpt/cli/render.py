"""Text rendering for the commands: tables, timestamps, shapes, specs, file listings."""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from fastckpt import _native
from fastckpt.cli.text import printable
from fastckpt.errors import CheckpointFormatError
from fastckpt.io.progress import format_bytes, polled_progress
from fastckpt.storage.registry import backend_for


@contextmanager
def counted_progress(
    label: str,
    total: int | None,
    *,
    stream: TextIO | None = None,
    enabled: bool | None = None,
    interval: float = 0.1,
) -> Iterator[_native.ByteCounter]:
    """A progress bar (on stderr, terminals only, unless ``stream``/``enabled`` say
    otherwise) fed by a :class:`fastckpt._native.ByteCounter` that the Rust core advances where
    the bytes are moved: pass it as ``progress=``."""
    counter = _native.ByteCounter()
    with polled_progress(
        label, total, lambda: counter.value, stream=stream, enabled=enabled, interval=interval
    ):
        yield counter


def print_json(document: Any) -> None:
    """Print ``document`` as indented, strict JSON (unknown types as strings, and so are the
    floats JSON has no number for: ``"inf"``, ``"-inf"``, ``"nan"``)."""
    print(json.dumps(_finite(document), indent=2, default=str, allow_nan=False))


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its name (containers rebuilt)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "") -> str:
    """Left-aligned columns separated by two spaces; every cell :func:`printable` (a tensor
    name read from a file holds what it likes: a newline split its row in two)."""
    cells = [[printable(h) for h in headers], *([printable(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(indent + line.rstrip() for line in lines)


def when(iso: str | None) -> str:
    """An ISO-8601 timestamp as ``YYYY-MM-DD HH:MM:SS`` in UTC (``-`` when absent)."""
    if not iso:
        return "-"
    try:
        moment = _dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return iso
    if moment.tzinfo is not None:
        moment = moment.astimezone(_dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def mtime_iso(path: Path) -> str | None:
    """A file's (or object's) modification time as an ISO-8601 UTC timestamp (None when the
    store does not say)."""
    stamp = backend_for(path).stat(path).modified
    if stamp is None:
        return None
    return _dt.datetime.fromtimestamp(stamp, _dt.UTC).isoformat()


def counter(counters: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` present in ``counters`` (None when none is)."""
    for name in names:
        if name in counters:
            return counters[name]
    return None


def dash(value: Any) -> str:
    """``str(value)``, or ``-`` for None."""
    return "-" if value is None else str(value)


def size_text(size: int, linked_size: int = 0) -> str:
    """A checkpoint's size as every command shows it (the definition is
    :func:`fastckpt.container.links.split_sizes`): the bytes its save wrote, then the bytes it holds
    as links to files an earlier save wrote (``17.5 KiB + 16.5 KiB linked``)."""
    text = format_bytes(size)
    return f"{text} + {format_bytes(linked_size)} linked" if linked_size else text


def shape_text(shape: Sequence[int]) -> str:
    """A shape as ``[d0, d1, ...]``."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


#: The markers of the JSON encoding of a spec's keyword arguments (fastckpt.checkpoint.specs).
_TUPLE, _SPEC, _TYPE, _DICT = "__tuple__", "__spec__", "__type__", "__dict__"


def _short(value: Any, limit: int = 60) -> str:
    """A compact rendering of a spec argument as stored (the JSON encoding of
    fastckpt.checkpoint.specs,
    read without decoding it: no torch, nothing imported)."""
    if isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in (_TUPLE, _SPEC):
        ((marker, inner),) = value.items()
        if marker == _SPEC and isinstance(inner, Mapping):
            text = _spec_call(inner, "spec", limit)
        else:
            items = inner if isinstance(inner, list) else [inner]
            text = (
                "(" + ", ".join(_short(v, limit) for v in items) + ("," if len(items) == 1 else "")
            )
            text += ")"
    elif isinstance(value, Mapping) and set(value) == {_TYPE, "value"}:
        text = _typed_text(str(value[_TYPE]), value["value"], limit)
    elif isinstance(value, Mapping) and set(value) == {_DICT}:
        inner = value[_DICT]
        pairs = inner.items() if isinstance(inner, Mapping) else inner
        text = "{" + ", ".join(_pair_text(pair, limit) for pair in pairs) + "}"
    elif isinstance(value, list):
        text = "[" + ", ".join(_short(v, limit) for v in value) + "]"
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k!r}: {_short(v, limit)}" for k, v in value.items()) + "}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pair_text(pair: Any, limit: int) -> str:
    if isinstance(pair, (list, tuple)) and len(pair) == 2:
        return f"{_short(pair[0], limit)}: {_short(pair[1], limit)}"
    return _short(pair, limit)


def _typed_text(type_name: str, value: Any, limit: int) -> str:
    """A registered type's value: tensors by dtype and shape, dtypes and devices as torch
    prints them, others as ``Type(value)``."""
    if type_name == "torch.Tensor" and isinstance(value, Mapping):
        return f"tensor({value.get('dtype')}, {shape_text(value.get('shape') or [])})"
    if type_name == "torch.dtype":
        return str(value)
    if type_name == "torch.device":
        return f"device({value!r})"
    return f"{type_name.rsplit('.', 1)[-1]}({_short(value, limit)})"


def _spec_call(document: Mapping[str, Any], where: str, limit: int = 60) -> str:
    cls_path = document.get("cls_path")
    kwargs = document.get("kwargs")
    if not isinstance(cls_path, str) or not isinstance(kwargs, Mapping):
        raise CheckpointFormatError(
            f"{where}: a spec needs a string cls_path and an object of kwargs"
        )
    return f"{cls_path}({_kwargs_text(kwargs, limit)})"


def _kwargs_text(kwargs: Mapping[str, Any], limit: int = 60) -> str:
    return ", ".join(f"{key}={_short(value, limit)}" for key, value in kwargs.items())


def spec_text(document: Any, where: str) -> str:
    """``cls.path(kw=value, ...)`` for a stored spec document (read as stored: listing never
    imports the classes it names, nor torch)."""
    if not isinstance(document, Mapping):
        raise CheckpointFormatError(f"{where}: spec must be a JSON object")
    return _spec_call(document, where)


def tensor_table(tensors: Sequence[Mapping[str, Any]], indent: str) -> str:
    """One row per tensor: name, dtype, shape, bytes."""
    return table(
        ["TENSOR", "DTYPE", "SHAPE", "BYTES"],
        (
            [t["name"], t["dtype"], shape_text(t["shape"]), format_bytes(t["bytes"])]
            for t in tensors
        ),
        indent,
    )


def metadata_text(metadata: Mapping[str, Any]) -> str:
    """A safetensors file's metadata as ``key=value, ...``, each :func:`printable`."""
    return ", ".join(f"{printable(key)}={printable(value)}" for key, value in metadata.items())


def file_lines(files: Sequence[Mapping[str, Any]]) -> list[str]:
    """The file listing of ``inspect``: size, tensor count, metadata, tensor table."""
    lines = []
    for item in files:
        path = printable(item["path"])
        if "tensors" not in item:
            lines.append(f"{path}  {format_bytes(item['size'])}")
            continue
        count = len(item["tensors"])
        lines.append(f"{path}  {format_bytes(item['size'])}, {count} tensor(s)")
        if item["metadata"]:
            lines.append(f"  metadata: {metadata_text(item['metadata'])}")
        if count:
            lines.append(tensor_table(item["tensors"], "  "))
    return lines
