"""Non-tensor values of a DCP state dict, stored without pickle.

DCP's default planner hands a storage layer every non-tensor value as ``torch.save`` bytes (a
pickle), and its ``FileSystemReader`` unpickles them on load. fastckpt instead takes the value
itself from the planner and stores

* ``io.BytesIO`` and ``bytes`` values as their raw bytes, and
* nests of dicts/lists/tuples of None, bool, int, float and str as UTF-8 JSON (the encoding of
  :mod:`fastckpt.io.tree`, which keeps tuples, int keys and NaN/inf),

and refuses anything else with :class:`~fastckpt.errors.UnsupportedValueError` before a
byte is written. Reading decodes raw bytes or JSON only; nothing read from disk is ever
unpickled (the pickle that DCP's planner then loads is made here from the decoded value).
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

from fastckpt.errors import CheckpointFormatError, UnsupportedValueError
from fastckpt.format.records import MAX_JSON_DEPTH, load_json
from fastckpt.format.sharded import ValueKind
from fastckpt.io.tree import flatten_measured, unflatten

__all__ = ["as_planner_bytes", "decode_value", "encode_value", "load_skeleton", "planner_object"]


def planner_object(planner: Any, item: Any) -> Any:
    """The value behind a DCP ``BYTE_IO`` write item, without a pickle round trip.

    DCP's default planner exposes ``lookup_object``; for another planner, its ``resolve_data``
    bytes are decoded with ``torch.load(weights_only=True)``, which refuses arbitrary objects.

    Raises:
        UnsupportedValueError: the planner's bytes are not loadable with ``weights_only``.
    """
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        return lookup(item.index)
    data = planner.resolve_data(item)
    if not isinstance(data, io.BytesIO):
        raise UnsupportedValueError(f"{item.index.fqn}: the planner gave {type(data).__name__}")
    try:
        return torch.load(data, weights_only=True)
    except Exception as err:
        raise UnsupportedValueError(
            f"{item.index.fqn}: the planner's bytes are not a weights-only torch.save payload "
            f"({err}); fastckpt stores non-tensor values without pickle"
        ) from None


def encode_value(fqn: str, value: Any) -> tuple[ValueKind, bytes]:
    """``(kind, payload)`` for a non-tensor value.

    Raises:
        UnsupportedValueError: the value (or something inside it) would need pickle, or its
            lists and dicts nest deeper than a load reads (:data:`MAX_JSON_DEPTH` levels).
    """
    if isinstance(value, io.BytesIO):
        return "bytesio", value.getvalue()
    if isinstance(value, (bytes, bytearray)):
        return "bytes", bytes(value)
    try:
        skeleton, tensors, depth = flatten_measured(value)
    except TypeError as err:
        raise UnsupportedValueError(
            f"{fqn}: {err}. fastckpt stores non-tensor values without pickle: io.BytesIO and "
            "bytes raw, plain values as JSON"
        ) from None
    if tensors:
        raise UnsupportedValueError(
            f"{fqn}: a non-tensor value holds tensors ({', '.join(sorted(tensors))}); put them "
            "in the state dict as entries of their own"
        )
    if depth > MAX_JSON_DEPTH:
        raise UnsupportedValueError(
            f"{fqn}: its lists, tuples and dicts nest too deeply (more than {MAX_JSON_DEPTH} "
            "levels as stored) for a checkpoint to load back; flatten it (e.g. join the inner "
            "keys into one)"
        )
    return "json", json.dumps(skeleton, allow_nan=False).encode()


def decode_value(where: str, kind: ValueKind, payload: bytes) -> Any:
    """The value :func:`encode_value` stored (``where`` names file and key in errors).

    Raises:
        CheckpointFormatError: a JSON payload that is not JSON as fastckpt writes it (see
            :func:`load_skeleton`) or not our encoding.
    """
    if kind == "bytesio":
        return io.BytesIO(payload)
    if kind == "bytes":
        return payload
    return unflatten(load_skeleton(where, payload), {}, where)


def load_skeleton(where: str, payload: bytes) -> Any:
    """The JSON skeleton of a stored plain value, read as strictly as every checkpoint
    document (:func:`fastckpt.format.records.load_json`): a payload that is not UTF-8 JSON
    (e.g. a pickle), or that holds what :func:`encode_value` never writes (``NaN``,
    ``Infinity``, a number no float holds, a duplicate key, nesting past
    :data:`MAX_JSON_DEPTH`), is a format error naming ``where`` (file and key).

    Raises:
        CheckpointFormatError: as said.
    """
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointFormatError(
            f"{where}: the stored value is not JSON ({err}); fastckpt never unpickles it"
        ) from None
    try:
        return load_json(where, payload)
    except CheckpointFormatError as err:
        raise CheckpointFormatError(
            f"{err}; fastckpt did not write this stored value (it was edited or damaged, and "
            "is never unpickled): restore the checkpoint from a copy"
        ) from None


def as_planner_bytes(value: Any) -> io.BytesIO:
    """``value`` as the ``torch.save`` stream a DCP ``LoadPlanner.load_bytes`` expects.

    The stream is made here from an already decoded value, so the planner's ``torch.load``
    only ever sees what :func:`decode_value` produced.
    """
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream
