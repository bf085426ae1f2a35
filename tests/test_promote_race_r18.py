"""Two promoters into one target: a `fastckpt promote` that read the target's manifest, then
waited while the trainer's promoter committed and pruned there, promoted every pruned index
back (each logged as "does not verify"). Round 18: the target is read again for each index,
and once more under its lock."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.container import commit as commit_module
from fastckpt.container import promote as promote_module
from fastckpt.container.promote import Promoter, promote, promote_index
from s3_support import s3_env, s3_root, s3_server

__all__ = ["s3_env", "s3_root", "s3_server"]  # fixtures used by name below


def _saves(root: Path, model: torch.nn.Module, steps: range) -> None:
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        fastckpt.save_checkpoint(root, {"main": model}, counters={"step": step})


def _durable(root: Path | str) -> list[int]:
    return [c["index"] for c in fastckpt.list_checkpoints(root)]


@pytest.mark.parametrize("moment", ["after_reading_the_target", "just_before_the_lock"])
def test_a_promotion_racing_another_promoters_retention_brings_nothing_back(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    moment: str,
) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = torch.nn.Linear(16, 16)
    _saves(fast, model, range(3))
    promote(fast, durable, every=1)
    _saves(fast, model, range(3, 12))
    raced: list[bool] = []

    def other_promoter() -> None:  # the trainer's: every 2nd index, keep_last=2
        if not raced:
            raced.append(True)
            Promoter(fast, durable, every=2, keep_last=2).run_here()

    if moment == "after_reading_the_target":
        clean = promote_module._clean

        def racing_clean(target: Path) -> None:
            clean(target)
            other_promoter()

        monkeypatch.setattr(promote_module, "_clean", racing_clean)
    else:  # after the per-index read, before this promotion takes the target's lock
        real = promote_module.IndexWriter

        def racing_writer(*args: Any, **kwargs: Any) -> Any:
            other_promoter()
            return real(*args, **kwargs)

        monkeypatch.setattr(promote_module, "IndexWriter", racing_writer)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        report = promote(fast, durable, every=1)
    assert raced
    assert _durable(durable) == [8, 10, 11], report
    assert report.promoted == [11], report
    assert "does not verify" not in caplog.text
    assert fastckpt.verify(durable).ok
    for index in _durable(durable):
        got = fastckpt.load_checkpoint(durable, index)["models"]["main"]["model"]
        want = fastckpt.load_checkpoint(fast, index)["models"]["main"]["model"]
        assert torch.equal(got.weight, want.weight)


def test_a_promotion_whose_source_moved_on_says_so_not_another_run(tmp_path: Path) -> None:
    """When the index a `fastckpt promote` was promoting is pruned from the source while it
    runs, and a newer one saved there, nothing is promoted. Before, the command said "the
    target's newest index 8 is newer than the source's newest, 9 ... is the target another
    run's?"; now it says the source moved on, and to run it again."""
    from fastckpt.cli.promote import _nothing_promoted

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    model = torch.nn.Linear(4, 4)
    _saves(fast, model, range(2))
    promote(fast, durable, every=1)
    _saves(fast, model, range(2, 4))  # saved after the promotion looked
    said = _nothing_promoted(fast, durable, target_newest=1)
    assert "newest index is now 3, saved after this promotion looked" in said, said
    assert "run it again" in said and "another run" not in said and "pruned" not in said
    said = _nothing_promoted(fast, durable, target_newest=1, vanished=[2])
    assert "pruned 2 while this ran" in said, said
    # The first promotion into an empty target, overtaken the same way (review: "already
    # holds the newest index of fast, 2; it lacks 0, 1, 2").
    empty = tmp_path / "empty"
    promote(fast, empty, every=1)
    shutil.rmtree(empty)
    empty.mkdir()
    said = _nothing_promoted(fast, empty, target_newest=None)
    assert "run it again" in said and "already holds" not in said, said


def test_an_index_skipped_on_an_object_store_is_never_withdrawn_first(
    s3_env: dict[str, str], s3_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the first version decided to skip after the object store's writer had taken
    the held index out of the manifest and copied it aside (two manifest rewrites, a copy
    there and back, a window without it, and "was being replaced" logged). Now the decision
    is made under the lock before anything changes."""
    fast = tmp_path / "fast"
    _saves(fast, torch.nn.Linear(4, 4), range(3))
    promote(fast, s3_root, every=1)
    set_aside: list[Any] = []
    real = commit_module._set_aside_object_index

    def spy(*args: Any, **kwargs: Any) -> Any:
        set_aside.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(commit_module, "_set_aside_object_index", spy)
    assert promote_index(fast, s3_root, 1, newest_only=True) is None
    assert set_aside == []
    assert _durable(s3_root) == [0, 1, 2]
    assert fastckpt.verify(s3_root).ok
