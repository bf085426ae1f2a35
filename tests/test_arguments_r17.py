"""Hostile arguments to the public API are refused with a typed error naming the argument,
before anything is written. Each case below was accepted, used wrongly or failed with a bare
error naming no argument before 2026-12-07 (an adversarial tester's fuzzing; what happened
before is said at each test)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import fastckpt.dcp as dcp
from fastckpt import CheckpointHook


def _damaged_file(tmp_path: Path) -> Path:
    """A fastckpt file whose last tensor byte is flipped (its crc32c no longer matches)."""
    path = tmp_path / "f.safetensors"
    fastckpt.save_file({"b": torch.ones(2)}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("keyword", ["verify", "verify_slices"])
@pytest.mark.parametrize("value", [None, 0, 1, "no", "yes"])
def test_safe_open_refuses_a_verify_flag_that_is_no_bool(
    tmp_path: Path, keyword: str, value: Any
) -> None:
    # verify=None (falsy) turned checksum checking off: get_tensor returned the damaged
    # values without a word; verify=0 / "no" and verify_slices="no" were taken unchecked.
    path = _damaged_file(tmp_path)
    with pytest.raises(TypeError, match=f"{keyword} must be a bool"):
        fastckpt.safe_open(path, **{keyword: value})
    with fastckpt.safe_open(path) as handle, pytest.raises(fastckpt.ChecksumMismatchError):
        handle.get_tensor("b")  # the default still catches the damage


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("fsync", "no"),
        ("fsync", 0),
        ("fsync", None),
        ("checksums", 1),
        ("checksums", "no"),
        ("direct_io", "no"),
        ("direct_io", 0),
    ],
)
def test_save_file_refuses_flags_that_are_no_bool_before_writing(
    tmp_path: Path, keyword: str, value: Any
) -> None:
    # PyO3's "'str' object is not an instance of 'bool'", naming no argument.
    with pytest.raises(TypeError, match=f"save_file: {keyword} must be a bool"):
        fastckpt.save_file({"a": torch.ones(1)}, tmp_path / "f.st", **{keyword: value})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("direct_io", [None, True, False])
def test_save_file_still_takes_a_bool_or_none_for_direct_io(
    tmp_path: Path, direct_io: bool | None
) -> None:
    fastckpt.save_file({"a": torch.ones(1)}, tmp_path / "f.st", direct_io=direct_io)
    assert torch.equal(fastckpt.load_file(tmp_path / "f.st")["a"], torch.ones(1))


@pytest.mark.parametrize("value", [None, 0, "no"])
def test_load_file_refuses_a_verify_that_is_no_bool(tmp_path: Path, value: Any) -> None:
    # "'int' object is not an instance of 'bool'" (PyO3), naming no argument.
    path = _damaged_file(tmp_path)
    with pytest.raises(TypeError, match="load_file: verify must be a bool"):
        fastckpt.load_file(path, verify=value)


@pytest.mark.parametrize(
    "call",
    [
        lambda path: fastckpt.save_file({"a": torch.ones(1)}, os.fsencode(path)),
        lambda path: fastckpt.load_file(os.fsencode(path)),
        lambda path: fastckpt.read_metadata(os.fsencode(path)),
    ],
    ids=["save_file", "load_file", "read_metadata"],
)
def test_file_functions_refuse_a_bytes_path_naming_the_fix(
    tmp_path: Path, call: Callable[[Path], Any]
) -> None:
    # "'bytes' object is not an instance of 'str'" from PyO3, naming no argument.
    path = tmp_path / "f.st"
    with pytest.raises(TypeError, match=r"must be a str or os.PathLike.*os\.fsdecode"):
        call(path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keyword", ["on_save_error", "on_promotion_error"])
def test_checkpoint_hook_refuses_an_error_callback_that_is_not_callable(
    tmp_path: Path, keyword: str
) -> None:
    # on_save_error=3 was stored, and the first failed save raised "'int' object is not
    # callable" from inside the report of that failure.
    with pytest.raises(TypeError, match=f"CheckpointHook {keyword} must be callable or None"):
        CheckpointHook(
            tmp_path / "run", step_interval=1, durable_dir=tmp_path / "dur", **{keyword: 3}
        )
    assert list(tmp_path.iterdir()) == []
    CheckpointHook(tmp_path / "run", step_interval=1, on_save_error=None)


@pytest.mark.parametrize("threads", [0, -1, True, 2.0, "2", 10**30])
def test_latest_intact_refuses_threads_as_verify_does(tmp_path: Path, threads: Any) -> None:
    # 0, -1 and True were accepted (0 and -1 as the default), "2" was "'>' not supported
    # between instances of 'str' and 'int'", 10**30 an OverflowError from the Rust core.
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"m": (torch.nn.Linear(2, 2), None)})
    with pytest.raises(TypeError, match="threads must be an int from 1 to 65536 or None"):
        fastckpt.latest_intact(root, threads=threads)
    assert fastckpt.latest_intact(root, threads=2) == 0


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"threads": 0}, TypeError, "threads must be an int from 1 to 65536"),
        ({"threads": "2"}, TypeError, "threads must be an int from 1 to 65536"),
        ({"block_bytes": 2.5}, TypeError, "block_bytes must be an int"),
        ({"block_bytes": True}, TypeError, "block_bytes must be an int"),
        ({"block_bytes": 0}, ValueError, "block_bytes must be positive"),
        ({"direct_io": "no"}, TypeError, "direct_io must be a bool or None"),
        ({"fsync": "no"}, TypeError, "fsync must be a bool"),
        ({"node_local": 1}, TypeError, "node_local must be a bool"),
        ({"replace_unsharded": "yes"}, TypeError, "replace_unsharded must be a bool"),
    ],
)
def test_dcp_writer_checks_its_arguments_when_made_not_at_the_save(
    tmp_path: Path, keywords: dict[str, Any], error: type[Exception], match: str
) -> None:
    # Checked only by the save, after a generation folder (and with block_bytes=2.5 a rank's
    # tensor file) was written into the checkpoint directory.
    path = tmp_path / "dcp"
    with pytest.raises(error, match=f"fastckpt.dcp.Writer: {match}"):
        dcp.Writer(path, **keywords)
    assert not path.exists()


def test_configure_storage_refuses_options_that_are_no_mapping() -> None:
    # configure_storage("s3://b/x", []) was accepted (as "no options": the setting removed).
    with pytest.raises(TypeError, match=r"storage_options must be a mapping"):
        fastckpt.configure_storage("s3://b/x", [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"storage_options must be a mapping"):
        fastckpt.configure_storage("s3://b/x", "region=x")  # type: ignore[arg-type]


@pytest.mark.parametrize("type_", [int, str, float, bool, type(None), list, tuple, dict])
def test_register_type_serializer_refuses_types_specs_store_themselves(type_: type) -> None:
    # Accepted, and never called: the spec encoder stores these types itself.
    with pytest.raises(TypeError, match=r"specs store .* themselves"):
        fastckpt.register_type_serializer(type_, lambda x: x, lambda x: x)


@pytest.mark.parametrize("scheduler", [None, 3, "StepLR"])
def test_save_checkpoint_refuses_a_scheduler_that_is_no_scheduler(
    tmp_path: Path, scheduler: Any
) -> None:
    # A bare AttributeError: 'NoneType' object has no attribute 'state_dict'.
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    root = tmp_path / "root"
    with pytest.raises(TypeError, match=r"scheduler 'm': expected an LR scheduler"):
        fastckpt.save_checkpoint(
            root,
            models={"m": (model, None)},
            optimizers={"m": optimizer},
            schedulers={"m": scheduler},
        )
    assert not root.exists()


@pytest.mark.parametrize(
    "validators",
    [3, "x", {"m": 3}, {"m": [len, 3]}, [3], {3: len}],
    ids=["int", "str", "map-int", "map-list-int", "list-int", "map-key-int"],
)
def test_load_checkpoint_refuses_validators_of_the_wrong_shape(
    tmp_path: Path, validators: Any
) -> None:
    # 3 and {"m": 3}: "'int' object is not iterable"; "x": "validator 'x' rejected model 'm'",
    # blaming the model for a malformed argument.
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"m": (torch.nn.Linear(2, 2), None)})
    with pytest.raises(TypeError, match=r"validators\S* must"):
        fastckpt.load_checkpoint(root, validators=validators)
    seen: list[torch.nn.Module] = []
    loaded = fastckpt.load_checkpoint(root, validators={"m": [seen.append]})
    assert seen == [loaded["models"]["m"]["model"]]


@pytest.mark.parametrize(
    ("models", "match"),
    [
        # A bare UnicodeEncodeError from the file writer.
        ({"\ud800": (torch.nn.Linear(2, 2), None)}, "model name .* is not valid Unicode"),
        # Refused by the writer only, after the root was made.
        ({"m": (torch.nn.Linear(2, 2, device="meta"), None)}, "a meta tensor has no values"),
    ],
    ids=["surrogate-name", "meta-model"],
)
def test_a_save_refused_for_its_input_leaves_no_new_root_behind(
    tmp_path: Path, models: dict[str, Any], match: str
) -> None:
    # The refusal came with an empty root folder left behind.
    root = tmp_path / "root"
    with pytest.raises(TypeError, match=match):
        fastckpt.save_checkpoint(root, models=models)
    assert not root.exists()
