"""Sharded (DCP) checkpoints are never silently wrong (issue 22): the commit record is
checksummed, templates are filled only after every byte was verified, special files and links
out of the checkpoint are refused at once, and DCP's errors come out typed.

Real files, real FIFOs and symlinks, DCP without a process group in this process, and real
2-rank gloo process groups spawned by the tests.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fastckpt
import fastckpt.dcp
from dcp_support import (
    TESTS,
    build_model,
    check_ok,
    compare,
    full_state,
    launch,
    row_tensors,
)
from fastckpt.container.sharded.commit import RECORD_NAME
from fastckpt.errors import CheckpointFormatError, FastCkptError
from fastckpt.format.records import seal_manifest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(6, 4), "b": torch.randn(4)},
        "meta": {"step": 7, "tag": "x"},
        "blob": io.BytesIO(b"raw"),
    }


def _templates() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)},
        "meta": {"step": 0, "tag": ""},
        "blob": None,
    }


def _same_as_saved(loaded: dict[str, Any]) -> bool:
    saved = _state()
    return (
        all(
            torch.equal(loaded["model"][k].view(torch.uint8), saved["model"][k].view(torch.uint8))
            for k in ("w", "b")
        )
        and loaded["meta"] == saved["meta"]
        and loaded["blob"].getvalue() == b"raw"
    )


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process sharded checkpoint with tensors, plain values and raw bytes."""
    path = tmp_path_factory.mktemp("small") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fastckpt.dcp.save_state(path, _state())
    return path


def _generation(checkpoint: Path) -> Path:
    return checkpoint / json.loads((checkpoint / RECORD_NAME).read_bytes())["generation"]


# ------------------------------------------------------------------------- 22.2: the record


def _flip(fd: int, original: bytes, bit: int) -> None:
    """Restore the file behind ``fd`` to ``original`` with bit ``bit`` flipped."""
    os.pwrite(fd, original, 0)
    os.pwrite(fd, bytes([original[bit // 8] ^ (1 << (bit % 8))]), bit // 8)


def test_every_bit_flip_in_the_sharded_record_is_refused_or_harmless(
    small: Path, tmp_path: Path
) -> None:
    """Issue 22.2: every single-bit flip of fastckpt-dcp.json either raises a typed error on
    load (and verify reports the record not ok), or loads exactly the saved state; never a
    load with a tensor left at its template's values."""
    copy = tmp_path / "ckpt"
    shutil.copytree(small, copy)
    record = copy / RECORD_NAME
    original = record.read_bytes()
    silent: list[str] = []
    outcomes = {"refused": 0, "harmless": 0}
    fd = os.open(record, os.O_RDWR)  # flipped in place: rewriting the file costs more
    for bit in range(len(original) * 8):
        _flip(fd, original, bit)
        templates = _templates()
        try:
            loaded = fastckpt.dcp.load_state(copy, into=templates)
        except FastCkptError:
            outcomes["refused"] += 1
            if fastckpt.verify(copy).ok:
                silent.append(f"bit {bit}: load refused it but verify says ok")
            continue
        except BaseException as err:
            silent.append(f"bit {bit}: untyped {type(err).__name__}: {str(err)[:200]}")
            continue
        if _same_as_saved(loaded):
            outcomes["harmless"] += 1
        else:
            silent.append(f"bit {bit}: loaded a different state")
        if len(silent) >= 20:
            break
    os.pwrite(fd, original, 0)
    os.close(fd)
    assert silent == [], f"{len(silent)} bad flips (first 20): {silent}"
    assert outcomes["refused"] == len(original) * 8, outcomes  # compact JSON: no spare bytes


def test_a_record_without_a_checksum_still_loads_and_a_damaged_checksum_is_named(
    small: Path, tmp_path: Path
) -> None:
    """Records written before the checksum (no ``crc32c`` field) load and verify as before;
    one with an unknown field, or a wrong checksum, is refused with a typed error naming the
    file."""
    copy = tmp_path / "ckpt"
    shutil.copytree(small, copy)
    record = copy / RECORD_NAME
    document = json.loads(record.read_bytes())
    assert isinstance(document.pop("crc32c"), int)  # new records are sealed
    record.write_bytes(json.dumps(document, separators=(",", ":")).encode())
    assert _same_as_saved(fastckpt.dcp.load_state(copy, into=_templates()))
    assert fastckpt.verify(copy).ok

    document["extra"] = 1
    record.write_bytes(json.dumps(document).encode())
    with pytest.raises(fastckpt.CheckpointFormatError, match=f"{RECORD_NAME}.*'extra'"):
        fastckpt.dcp.load_state(copy, into=_templates())
    assert not fastckpt.verify(copy).ok

    sealed = json.loads(small.joinpath(RECORD_NAME).read_bytes())
    sealed["crc32c"] ^= 1
    record.write_bytes(json.dumps(sealed).encode())
    with pytest.raises(fastckpt.ChecksumMismatchError, match=RECORD_NAME):
        fastckpt.dcp.load_state(copy)
    with pytest.raises(fastckpt.ChecksumMismatchError, match=RECORD_NAME):
        fastckpt.CheckpointManager().load(copy)
    report = fastckpt.verify(copy)
    assert not report.ok and report.failures[0].path.name == RECORD_NAME


# ------------------------------------------------------------------------- 22.3: templates


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/rows: row_tensors() saved row-sharded by 2 gloo ranks (one chunk per rank file)."""
    root = tmp_path_factory.mktemp("rows")
    check_ok(launch("save_rows", root, 2))
    return root


def _corrupt_rank_1(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` and flip a bit inside rank 1's chunk of model.w."""
    shutil.copytree(source, target)
    file = _generation(target) / "rank-00001.safetensors"
    header = fastckpt.read_metadata(file)
    begin, _ = header["tensors"]["model.w"]["data_offsets"]
    data = bytearray(file.read_bytes())
    data[header["data_start"] + begin + 9] ^= 0x04
    file.write_bytes(bytes(data))


def _sentinel_templates() -> dict[str, Any]:
    full = row_tensors()
    return {
        "model": {
            "w": torch.full_like(full["model.w"], -3.5),
            "b": torch.full_like(full["model.b"], -3.5),
        },
        "meta": {"step": -1, "tag": "none"},
    }


def test_a_corrupt_chunk_leaves_every_template_unchanged(rows: Path, tmp_path: Path) -> None:
    """Issue 22.3: a 2-rank save with one damaged chunk (in rank 1's file, read after rank
    0's): load_state, CheckpointManager.load and dcp.load with the Reader into templates raise
    ChecksumMismatchError and leave every template bit and value as it was."""
    checkpoint = tmp_path / "corrupt"
    _corrupt_rank_1(rows / "rows", checkpoint)
    loads: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("load_state", lambda t: fastckpt.dcp.load_state(checkpoint, into=t)),
        ("manager", lambda t: fastckpt.CheckpointManager().load(checkpoint, into=t)),
        ("dcp.load", lambda t: dcp.load(t, storage_reader=fastckpt.dcp.Reader(checkpoint))),
    ]
    for label, load in loads:
        templates = _sentinel_templates()
        flat_before = {f"model.{k}": v.clone() for k, v in templates["model"].items()}
        with pytest.raises((fastckpt.ChecksumMismatchError, CheckpointException)) as caught:
            load(templates)
        error = caught.value
        if isinstance(error, CheckpointException):
            assert label == "dcp.load"
            error = next(iter(error.failures.values()))[0]
        assert isinstance(error, fastckpt.ChecksumMismatchError), (label, error)
        assert "rank-00001.safetensors" in str(error) and "model.w" in str(error)
        after = {f"model.{k}": v for k, v in templates["model"].items()}
        assert compare(flat_before, after) == [], label
        assert templates["meta"] == {"step": -1, "tag": "none"}, label
    # the intact checkpoint fills the same templates
    templates = _sentinel_templates()
    fastckpt.dcp.load_state(rows / "rows", into=templates)
    assert compare(row_tensors(), {f"model.{k}": v for k, v in templates["model"].items()}) == []
    assert templates["meta"] == {"step": 5, "tag": "rows"}


def test_a_corrupt_chunk_on_one_rank_leaves_every_rank_s_templates_unchanged(
    rows: Path,
) -> None:
    """Issue 22.3 on 2 ranks: rank 1 reads the damaged chunk, rank 0 only intact ones; both
    raise ChecksumMismatchError and neither rank's DTensor templates (nor values) change."""
    _corrupt_rank_1(rows / "rows", rows / "corrupt")
    reports = [json.loads(out) for out in check_ok(launch("load_corrupt", rows, 2))]
    for report in reports:
        for label in ("load_state", "manager"):
            assert report[label] == "ChecksumMismatchError", report
            assert report[f"{label}_changed"] == [], report
            assert report[f"{label}_meta"] == {"step": -1, "tag": "none"}, report


# ------------------------------------------------------------------------- 22.11: special files


@contextlib.contextmanager
def _within(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``."""

    def expired(signum: int, frame: Any) -> None:
        raise AssertionError(f"still running after {seconds} s: a read blocks")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _place(checkpoint: Path, target: str, kind: str, outside: Path) -> Path:
    """Put a FIFO, a link to /dev/zero or a link to an identical copy outside the checkpoint
    in place of the record, a rank file, the values file or the generation directory."""
    generation = _generation(checkpoint)
    path = {
        "record": checkpoint / RECORD_NAME,
        "rank": generation / "rank-00000.safetensors",
        "values": generation / "rank-00000.values",
        "generation": generation,
    }[target]
    outside.mkdir(parents=True, exist_ok=True)
    if kind == "outside":
        moved = outside / path.name
        shutil.move(path, moved)
        path.symlink_to(moved, target_is_directory=moved.is_dir())
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        path.unlink()
        path.symlink_to("/dev/zero")
    return path


def _refused(load: Callable[[], Any], name: str) -> None:
    """``load`` raises a CheckpointFormatError naming ``name`` (inside DCP's
    CheckpointException for dcp.load)."""
    try:
        load()
    except CheckpointException as err:
        errors = [failure for failure, _ in err.failures.values()]
    except BaseException as err:
        errors = [err]
    else:
        raise AssertionError(f"loaded although {name} is not a regular file in the checkpoint")
    assert any(isinstance(e, fastckpt.CheckpointFormatError) and name in str(e) for e in errors), (
        errors
    )


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        ("record", "fifo"),
        ("record", "dev-zero"),
        ("record", "outside"),
        ("rank", "fifo"),
        ("rank", "dev-zero"),
        ("rank", "outside"),
        ("values", "fifo"),
        ("values", "outside"),
        ("generation", "outside"),
    ],
)
def test_special_files_in_a_sharded_checkpoint_are_refused_at_once(
    small: Path, tmp_path: Path, target: str, kind: str
) -> None:
    """Issue 22.11: a FIFO, a link to /dev/zero or a link out of the checkpoint in place of
    the record, a rank file, the values file or the generation directory: CheckpointManager
    .load, load_state, dcp.load with the Reader and verify end at once, naming it."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(small, checkpoint)
    path = _place(checkpoint, target, kind, tmp_path / "outside")
    with _within(20):
        _refused(lambda: fastckpt.CheckpointManager().load(checkpoint), path.name)
        _refused(
            lambda: fastckpt.CheckpointManager().load(checkpoint, into=_templates()), path.name
        )
        _refused(lambda: fastckpt.dcp.load_state(checkpoint, into=_templates()), path.name)
        _refused(
            lambda: dcp.load(_templates(), storage_reader=fastckpt.dcp.Reader(checkpoint)),
            path.name,
        )
        report = fastckpt.verify(checkpoint)
    assert not report.ok
    assert path.name in str(report), report


# ------------------------------------------------------------------------- 22.12: typed errors


@pytest.fixture(scope="module")
def strategy_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Indices 0, 1, 2 of an FSDP2 strategy root saved by 2 gloo ranks."""
    root = tmp_path_factory.mktemp("strategy") / "run"
    check_ok(launch("save_indices", root, 2, ranks="sharded_ranks"))
    return root


def _rank_files(root: Path, index: int) -> list[Path]:
    return sorted((root / "sharded" / str(index)).rglob("rank-*.safetensors"))


def test_a_damaged_shard_of_a_strategy_index_raises_a_typed_error(
    strategy_root: Path, tmp_path: Path
) -> None:
    """Issue 22.12: TrainingStrategy.load_checkpoint of a sharded index with a damaged chunk
    raises ChecksumMismatchError naming the file (DCP's CheckpointException as its cause), not
    the CheckpointException itself, which ``except Exception`` does not catch."""
    from sharded_ranks import training_fn

    root = tmp_path / "run"
    shutil.copytree(strategy_root, root)
    file = _rank_files(root, 1)[-1]
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x20
    file.write_bytes(bytes(data))
    with pytest.raises(fastckpt.ChecksumMismatchError, match=file.name) as caught:
        fastckpt.TrainingStrategy.load_checkpoint(root, 1, training_fn=training_fn)
    assert isinstance(caught.value.__cause__, CheckpointException)
    strategy = fastckpt.TrainingStrategy.load_checkpoint(root, 2, training_fn=training_fn)
    assert strategy.step_count == 3


def _load_manager(path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optimizer)
    loaded = fastckpt.CheckpointManager().load(
        path, into={"model": msd, "optim": osd, "step": 0}, strict=True
    )
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    return loaded["step"], full_state(model, optimizer)


def test_manager_loads_during_sharded_replacements_see_the_old_or_the_new(
    tmp_path: Path,
) -> None:
    """Issue 22.12: one process replaces a sharded CheckpointManager checkpoint in a loop,
    alternating two FSDP2 states; every load here meanwhile returns one of them whole (step
    and every tensor), none raises."""
    path = tmp_path / "ckpt"
    writer = _start_writer("manager", path, 40)
    loads = 0
    try:
        expected = _wait_ready(writer, path)
        while writer.poll() is None or loads < 5:
            step, got = _load_manager(path)
            assert compare(expected[step], got) == [], f"load {loads}: step {step} torn"
            loads += 1
    finally:
        _stop(writer)
    assert writer.returncode == 0, writer.stderr.read() if writer.stderr else ""
    assert loads >= 5


def _start_writer(mode: str, path: Path, iterations: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    rendezvous = path.parent / f"rendezvous-writer-{mode}"
    code = "import sharded_ranks; sharded_ranks.replace_loop()"
    return subprocess.Popen(
        [sys.executable, "-c", code, str(path), "0", str(rendezvous), "1", mode, str(iterations)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_ready(writer: subprocess.Popen[str], path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Wait for the writer's first save; the two states it alternates, by step."""
    ready = Path(f"{path}.ready")
    for _ in range(2400):
        if ready.exists():
            break
        if writer.poll() is not None:
            raise AssertionError(writer.stderr.read() if writer.stderr else "writer died")
        time.sleep(0.05)
    else:
        raise AssertionError("the writer never got ready")
    return {
        step: safetensors.torch.load_file(path.parent / f"reference-step{step}.safetensors")
        for step in (2, 4)
    }


def _stop(writer: subprocess.Popen[str]) -> None:
    if writer.poll() is None:
        writer.kill()
    writer.communicate()


def test_seeded_flips_of_a_two_rank_record_are_refused(rows: Path, tmp_path: Path) -> None:
    """Issue 22.2 on the record of a 2-rank save (block checksums, two files): 600 seeded
    single-bit flips, each loaded through CheckpointManager.load into templates: a typed error
    and a failed verify every time."""
    copy = tmp_path / "rows"
    shutil.copytree(rows / "rows", copy)
    record = copy / RECORD_NAME
    original = record.read_bytes()
    rng = random.Random(22)
    problems = []
    fd = os.open(record, os.O_RDWR)
    for bit in rng.sample(range(len(original) * 8), 600):
        _flip(fd, original, bit)
        templates = _sentinel_templates()
        try:
            fastckpt.CheckpointManager().load(copy, into=templates)
            problems.append(f"bit {bit}: loaded")
        except FastCkptError:
            if fastckpt.verify(copy).ok:
                problems.append(f"bit {bit}: verify ok")
        except BaseException as err:
            problems.append(f"bit {bit}: {type(err).__name__}")
    os.close(fd)
    assert problems == []


def _storage(record: dict[str, Any], fqn: str) -> dict[str, Any]:
    return next(item for item in record["dcp"]["storage_data"] if item["fqn"] == fqn)


def _entry(record: dict[str, Any], fqn: str) -> dict[str, Any]:
    return dict(record["dcp"]["state_dict_metadata"][fqn])


#: Edits of a sharded record whose parts then disagree (re-sealed, as an attacker or a buggy
#: tool would): before, each loaded other dtypes' bits, a shifted tensor, uninitialized memory
#: (``load_state``: a planner path renamed), another tensor's bytes (a chunk naming another
#: entry of its file), or dropped a tensor, while ``verify`` said ok; or verify said ok of a
#: checkpoint no reader could load.
RECORD_EDITS: dict[str, Callable[[dict[str, Any]], object]] = {
    "dtype": lambda r: _storage(r, "model.w").update(dtype="I32"),
    "chunk shape": lambda r: r["dcp"]["state_dict_metadata"]["model.w"]["chunks"][0].update(
        sizes=[2, 3]
    ),
    "no chunks": lambda r: r["dcp"]["state_dict_metadata"]["model.w"].update(chunks=[]),
    "chunk outside": lambda r: (
        r["dcp"]["state_dict_metadata"]["model.w"]["chunks"][0].update(offsets=[2, 0]),
        _storage(r, "model.w").update(offset=[2, 0]),
    ),
    "size": lambda r: r["dcp"]["state_dict_metadata"]["model.w"].update(size=[8, 3]),
    "no stored data": lambda r: r["dcp"].update(
        storage_data=[x for x in r["dcp"]["storage_data"] if x["fqn"] != "model.w"]
    ),
    "unknown fqn": lambda r: _storage(r, "model.w").update(fqn="ghost"),
    "planner path twice": lambda r: r["dcp"]["planner_data"].update(
        {"model.w": {"__tuple__": ["model", "b"]}}
    ),
    "planner path renamed": lambda r: r["dcp"]["planner_data"].update(
        {"model.b": {"__tuple__": ["model", "renamed"]}}
    ),
    "another tensor's bytes": lambda r: _storage(r, "model.w").update(name="model.b"),
    "value as tensor": lambda r: r["dcp"]["state_dict_metadata"].update(step=_entry(r, "model.b")),
    "length": lambda r: _storage(r, "model.w").update(length=24),
    "past the file": lambda r: _storage(r, "model.w").update(byte_offset=10**6),
    "block count": lambda r: _storage(r, "model.w").update(block_bytes=4, blocks=[0, 0]),
}


@pytest.mark.parametrize("edit", sorted(RECORD_EDITS))
def test_a_record_whose_parts_disagree_is_refused_by_every_reader_and_verify(
    tmp_path: Path, edit: str
) -> None:
    """Every stored chunk belongs to an entry of its kind, has its dtype, shape and size and
    lies inside its file; a tensor's chunks tile it, each with stored bytes; planner paths
    are unique: else ``CheckpointFormatError`` naming the record, and ``verify`` not ok."""
    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(4, 3), "b": torch.arange(5)}, "step": 7}
    path = tmp_path / "ckpt"
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(path))
    record = json.loads((path / RECORD_NAME).read_text())
    RECORD_EDITS[edit](record)
    seal_manifest(record)
    (path / RECORD_NAME).write_text(json.dumps(record))
    with pytest.raises(CheckpointFormatError, match=RECORD_NAME):
        fastckpt.dcp.load_state(path)
    template = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}}
    with pytest.raises((CheckpointFormatError, CheckpointException)):
        dcp.load(template, storage_reader=fastckpt.dcp.Reader(path))
    assert torch.equal(template["model"]["w"], torch.zeros(4, 3))
    report = fastckpt.verify(path)
    assert not report.ok and RECORD_NAME in report.failures[0].message, report


def test_planner_data_that_is_no_key_path_is_a_typed_error_of_load_state(tmp_path: Path) -> None:
    """A planner path that is no sequence of keys (an int, a list inside) failed
    ``load_state`` with a bare TypeError from inside fastckpt or torch; it names the record
    now. (DCP's own load with templates does not use the planner data: it still loads.)"""
    path = tmp_path / "ckpt"
    dcp.save({"a": torch.ones(3), "b": torch.arange(4)}, storage_writer=fastckpt.dcp.Writer(path))
    for bad in (3, {"__tuple__": [["b"]]}, "b"):
        record = json.loads((path / RECORD_NAME).read_text())
        record["dcp"]["planner_data"]["b"] = bad
        seal_manifest(record)
        (path / RECORD_NAME).write_text(json.dumps(record))
        with pytest.raises(CheckpointFormatError, match=f"{RECORD_NAME}.*planner"):
            fastckpt.dcp.load_state(path)
    template = {"a": torch.zeros(3), "b": torch.zeros(4, dtype=torch.int64)}
    dcp.load(template, storage_reader=fastckpt.dcp.Reader(path))
    assert torch.equal(template["b"], torch.arange(4))
