"""Sharded (DCP) saves of the fourteenth adversarial round: an async save that runs after its
job destroyed the process group, the raw ``CheckpointException`` of a failed async save, and
``fastckpt.dcp.Writer`` saving into another kind of checkpoint.

Real gloo process groups (two ranks on CPU), real DCP saves, real full disks (a size-limited
tmpfs; those tests skip where it cannot be mounted).
"""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

import fastckpt
import fastckpt.dcp
from dcp_support import check_ok, launch, row_tensors
from fastckpt.dcp.state import typed_dcp_error
from fastckpt.errors import CheckpointFormatError, NotACheckpointError
from fastckpt.format.records import COMMIT_RECORD, MANIFEST, SHARDED_RECORD
from test_manager import mount_small_tmpfs


@contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (skips the test where it cannot be), unmounted
    (lazily: a rank may still hold a file open) when the test ends."""
    if not mount_small_tmpfs(path, size):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root and mount rights)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def _dcp_failure(save: Callable[[], object]) -> BaseException:
    """What a rank raised in ``save`` (a raw ``dcp.save``: DCP wraps it in its
    ``CheckpointException``)."""
    with pytest.raises(CheckpointException) as info:
        save()
    return typed_dcp_error(info.value)


def _reports(results: list[tuple[int, str, str]]) -> list[dict[str, Any]]:
    return [json.loads(out.strip().splitlines()[-1]) for out in check_ok(results)]


def _assert_first_state_loads(root: Path) -> None:
    """The checkpoint at ``root`` is ``dcp_ranks._rows_state(1)``, bit for bit, and verifies."""
    state = fastckpt.dcp.load_state(root)
    assert state["step"] == 1
    assert torch.equal(state["w"], row_tensors()["model.w"] + 1)
    assert fastckpt.dcp.verify_sharded(root).ok


# --------------------------------------------------------------------------------------------
# 1. An async save must not run as a one-process save once its job left the process group
# --------------------------------------------------------------------------------------------


def test_async_save_after_the_process_group_is_destroyed_commits_nothing(
    tmp_path: Path,
) -> None:
    """Before: torch DCP's background save checks for a process group again when it starts;
    with the group destroyed in between (a job ending without waiting for the future), each
    rank saved alone as rank 0, committed a record naming only its own half of ``w``, removed
    the committed checkpoint, and reported success: the checkpoint no longer loaded. Now the
    writer refuses a save that runs under another world than it was staged in."""
    root = tmp_path / "ckpt"
    reports = _reports(launch("async_save_after_teardown", root, 2))
    for report in reports:
        assert report["outcome"].startswith("RuntimeError: "), report
        assert "the process group was destroyed" in report["outcome"], report
        assert "Nothing of this save was written or committed" in report["outcome"], report
    assert (root / SHARDED_RECORD).exists()
    _assert_first_state_loads(root)


def test_a_record_that_would_not_load_is_never_committed(tmp_path: Path) -> None:
    """Before: whatever the writer's results named was committed, and the committed checkpoint
    removed; a record naming half of a tensor's chunks (what a rank saving alone in a job of
    two writes) replaced a good checkpoint with one that does not load. Now the coordinator
    decodes the record as the reader will before it writes it."""

    class HalfTensorWriter(fastckpt.dcp.Writer):
        """Reports ``w`` twice as tall as the chunks it wrote: half of it has no chunk."""

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            entry = metadata.state_dict_metadata["w"]
            assert isinstance(entry, TensorStorageMetadata)
            rows, columns = entry.size
            metadata.state_dict_metadata["w"] = TensorStorageMetadata(
                entry.properties, torch.Size([2 * rows, columns]), entry.chunks
            )
            super().finish(metadata, results)

    root = tmp_path / "ckpt"
    first = {"w": row_tensors()["model.w"] + 1, "step": 1}
    fastckpt.dcp.save_state(root, first)
    second = {"w": row_tensors()["model.w"] + 2, "step": 2}
    with pytest.raises(CheckpointFormatError, match="would not load") as info:
        fastckpt.dcp.save_state(root, second, writer=HalfTensorWriter(root))
    assert "nothing was committed" in str(info.value)
    assert "of the tensor's 480 elements" in str(info.value)
    _assert_first_state_loads(root)


# --------------------------------------------------------------------------------------------
# 2. async_save_state's future raises the typed error save_state raises
# --------------------------------------------------------------------------------------------


def test_async_save_state_on_a_full_disk_raises_a_typed_oserror(tmp_path: Path) -> None:
    """Before: the future of ``fastckpt.dcp.async_save_state`` raised DCP's
    ``CheckpointException`` (a ``BaseException`` that ``except Exception`` misses) where
    ``save_state`` raises the ``OSError`` (ENOSPC) naming the checkpoint and the fix."""
    state = {"w": torch.ones(1_000_000), "step": 1}
    with small_disk(tmp_path / "disk", "1m") as disk:
        errors: dict[str, BaseException] = {}
        for label in ("save_state", "async_save_state"):
            path = disk / label
            try:
                if label == "save_state":
                    fastckpt.dcp.save_state(path, state)
                else:
                    writer = fastckpt.dcp.Writer(path)
                    fastckpt.dcp.async_save_state(path, state, writer=writer).result()
            except Exception as err:  # a BaseException escaping here fails the test
                errors[label] = err
        for label, error in errors.items():
            assert isinstance(error, OSError) and error.errno == errno.ENOSPC, (label, error)
            assert "nothing of this save was committed" in str(error)
            assert "free space" in str(error)
        assert sorted(errors) == ["async_save_state", "save_state"]


def test_async_manager_save_with_a_full_disk_on_one_rank_raises_a_typed_oserror(
    tmp_path: Path,
) -> None:
    """Before: an async sharded ``CheckpointManager`` save that failed on one rank's full disk
    raised a ``RuntimeError`` holding DCP's traceback text, where the sync save raises the
    ``OSError`` (ENOSPC) naming the checkpoint and the fix; now both ranks get that one."""
    root = tmp_path / "ckpt"
    root.mkdir()
    with small_disk(tmp_path / "disk", "256k") as disk:
        reports = _reports(launch("manager_async_save_disk_full", root, 2, str(disk)))
    for report in reports:
        assert report["type"] == "OSError" and report["errno"] == errno.ENOSPC, report
        assert "nothing of this save was committed" in report["message"], report
        assert "close" not in report, report  # the future delivered it
    state = fastckpt.dcp.load_state(root / "ok")
    assert state["step"] == 1 and torch.equal(state["w"], row_tensors()["model.w"] + 1)


# --------------------------------------------------------------------------------------------
# 3. fastckpt.dcp.Writer saves into no other kind of checkpoint
# --------------------------------------------------------------------------------------------


def test_writer_refuses_a_save_checkpoint_root(tmp_path: Path) -> None:
    """Before: ``dcp.save`` with ``fastckpt.dcp.Writer`` into a ``save_checkpoint`` root was
    accepted; the root then held a sharded record beside its manifest, every later
    ``save_checkpoint`` there was refused (NotACheckpointError) and verify was not ok. The
    reverse direction was already refused."""
    root = tmp_path / "root"
    net = torch.nn.Linear(3, 2)
    fastckpt.save_checkpoint(root, {"net": (net, None)})
    before = sorted(p.name for p in root.iterdir())
    raw = _dcp_failure(
        lambda: dcp.save({"w": torch.ones(4)}, storage_writer=fastckpt.dcp.Writer(root))
    )
    with pytest.raises(NotACheckpointError) as info:
        fastckpt.dcp.save_state(root, {"w": torch.ones(4)})
    for error in (raw, info.value):
        assert isinstance(error, NotACheckpointError), error
        assert f"{root} holds {MANIFEST}: it is a save_checkpoint root" in str(error)
        assert "nothing was written" in str(error)
    assert sorted(p.name for p in root.iterdir()) == before
    assert fastckpt.verify(root).ok
    fastckpt.save_checkpoint(root, {"net": (net, None)})  # the root takes its next save


def test_writer_refuses_a_checkpoint_manager_checkpoint(tmp_path: Path) -> None:
    """Before: ``dcp.save`` with ``fastckpt.dcp.Writer`` into a ``CheckpointManager``
    checkpoint was accepted; its ``commit.json`` stayed beside the sharded record and
    ``CheckpointManager.load`` silently returned the DCP state. A manager's own writer
    (``replace_unsharded=True``) still replaces one (a run moving from DDP to FSDP2)."""
    path = tmp_path / "mgr" / "step-1"
    with fastckpt.CheckpointManager() as manager:
        manager.save(path, {"model": {"w": torch.arange(4.0)}})
    before = sorted(p.name for p in path.iterdir())
    stray = {"model": {"w": torch.full((4,), 9.0)}}
    error = _dcp_failure(lambda: dcp.save(stray, storage_writer=fastckpt.dcp.Writer(path)))
    assert isinstance(error, NotACheckpointError), error
    assert f"{path} holds {COMMIT_RECORD}: it is a CheckpointManager checkpoint" in str(error)
    assert sorted(p.name for p in path.iterdir()) == before
    with fastckpt.CheckpointManager() as manager:
        assert torch.equal(manager.load(path)["model"]["w"], torch.arange(4.0))
    dcp.save(stray, storage_writer=fastckpt.dcp.Writer(path, replace_unsharded=True))
    assert (path / SHARDED_RECORD).exists()


class _Tied(torch.nn.Module):
    """An embedding and a head sharing one weight (as language models tie them)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4, 4)
        self.head = torch.nn.Linear(4, 4, bias=False)
        if tied:
            self.head.weight = self.emb.weight


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tied_template_loads_only_a_checkpoint_holding_one_value_there(tmp_path: Path) -> None:
    """An untied checkpoint loaded into a tied model (or one tensor given for two keys)
    loaded whichever key DCP copied last into the shared weight, without a word. Refused now
    from the record's chunk checksums, nothing loaded; a tied checkpoint still loads."""
    untied = _Tied(tied=False)
    fastckpt.dcp.save_state(tmp_path / "untied", {"model": untied.state_dict()})
    fastckpt.dcp.save_state(tmp_path / "tied", {"model": _Tied().state_dict()})
    live = _Tied()
    before = live.emb.weight.detach().clone()
    with pytest.raises(
        fastckpt.CheckpointMismatchError, match=r"model\.emb\.weight, model\.head\.weight"
    ):
        fastckpt.dcp.load_state(tmp_path / "untied", into={"model": live})
    assert torch.equal(live.emb.weight, before)
    with pytest.raises(fastckpt.CheckpointMismatchError, match="tied weights"):
        shared = torch.zeros(4, 4)
        fastckpt.dcp.load_state(
            tmp_path / "untied",
            into={"model": {"emb.weight": shared, "head.weight": shared}},
        )
    assert torch.equal(shared, torch.zeros(4, 4))
    fastckpt.dcp.load_state(tmp_path / "tied", into={"model": live})
    saved = fastckpt.dcp.load_state(tmp_path / "tied")["model"]
    assert torch.equal(live.emb.weight, saved["emb.weight"])
