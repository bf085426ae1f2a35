"""Loads with ``fallback_dirs`` beside a live writer that saves and prunes the fast tier.

An evaluation or resume job asks for the newest copy while the trainer (another process)
saves and prunes: the chosen index may be pruned before it is read, or while it is checked.
The writer is played here by the same process at the exact moment of the race (a
``save_checkpoint`` + ``prune`` of the fast tier inside the load), so that the race is
deterministic; the other process's part is that and nothing more.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt.checkpoint import api
from fastckpt.container import promote
from fastckpt.errors import IndexNotCommittedError


def _save(root: Path, step: int) -> None:
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(step)
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": step})


def _roots(tmp_path: Path) -> tuple[Path, Path]:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _save(fast, 1)
    _save(durable, 1)
    return fast, durable


def _weight(loaded: dict[str, Any]) -> float:
    return float(loaded["models"]["main"]["model"].weight[0, 0].detach())


def test_the_newest_copy_pruned_after_it_was_chosen_is_chosen_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the newest index was chosen, pruned by the writer before it was read, and
    ``load_checkpoint(fast, fallback_dirs=[durable])`` raised a bare ``KeyError`` naming an
    index the caller never asked for. Now the copy is chosen again and the load returns
    the writer's newest checkpoint, whole."""
    fast, durable = _roots(tmp_path)
    choose = api.choose_copy
    raced: list[int] = []

    def choose_then_writer_prunes(*args: Any, **kwargs: Any) -> Any:
        copy = choose(*args, **kwargs)
        if not raced:
            _save(fast, 2)
            raced.extend(fastckpt.prune(fast, keep_last=1))
        return copy

    monkeypatch.setattr(api, "choose_copy", choose_then_writer_prunes)
    loaded = fastckpt.load_checkpoint(fast, fallback_dirs=[durable])
    assert raced == [0]
    assert loaded["checkpoint_index"] == 1 and loaded["restored_from"]["index"] == 1
    assert _weight(loaded) == 2.0
    # An index asked for by number is not replaced by another: its error stands, typed
    # (a KeyError, as before; it was a bare KeyError, like a bad model name's).
    raced.clear()
    with pytest.raises(IndexNotCommittedError, match=r"index 0 is not in .*never saved, or pruned"):
        fastckpt.load_checkpoint(fast, 0)
    with pytest.raises(KeyError):
        fastckpt.verify(fast, index=0)


def test_a_strategy_load_of_the_newest_copy_pruned_after_it_was_chosen_chooses_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TrainingStrategy.load_checkpoint(fast, fallback_dirs=...)`` alike (before: the
    same bare ``KeyError``)."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    strategy = support.new_strategy([], 4)
    strategy.save_checkpoint(fast)
    strategy.save_checkpoint(durable)
    nearest = promote.nearest_intact
    raced: list[int] = []

    def nearest_then_writer_prunes(*args: Any, **kwargs: Any) -> Any:
        copy = nearest(*args, **kwargs)
        if not raced:
            strategy.save_checkpoint(fast)
            raced.extend(fastckpt.prune(fast, keep_last=1))
        return copy

    from fastckpt.training import strategy as strategy_module

    monkeypatch.setattr(strategy_module, "nearest_intact", nearest_then_writer_prunes)
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        fast, training_fn=support.training_fn, fallback_dirs=[durable]
    )
    assert raced == [0]
    assert resumed.restored_from is not None and resumed.restored_from.index == 1


def test_a_copy_pruned_while_it_was_checked_is_not_reported_as_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the fast tier's newest index, pruned by the writer while the choice checked
    its files, was passed over as damaged ("skipped: fast index 0: ... missing") and the
    notice said so, and the load took the durable tier's older copy. A pruned index is not
    damage: the tiers are looked at again, and the load takes the writer's newest copy."""
    fast, durable = _roots(tmp_path)
    check = promote.index_intact
    raced: list[int] = []

    def writer_prunes_then_check(manifest: Any, index: int, **kwargs: Any) -> Any:
        if not raced and manifest.root == fast:
            _save(fast, 2)
            raced.extend(fastckpt.prune(fast, keep_last=1))
        return check(manifest, index, **kwargs)

    monkeypatch.setattr(promote, "index_intact", writer_prunes_then_check)
    with caplog.at_level(logging.INFO):
        loaded = fastckpt.load_checkpoint(fast, fallback_dirs=[durable])
    assert raced == [0]
    assert loaded["restored_from"]["skipped"] == []
    assert not any("missing" in r.getMessage() for r in caplog.records)
    assert loaded["restored_from"]["path"].endswith("fast") and _weight(loaded) == 2.0
