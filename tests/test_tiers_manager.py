"""CheckpointManager tiers: every save to a fast root of checkpoints, every N-th promoted to a
durable root in the background, and restores from the newest intact copy across the tiers.

Real files with fsync, a real moto server for ``s3://`` durable tiers (stopped for the
failure case), fresh processes for the bitwise loads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.container import listing
from fastckpt.container.promote import forget_promoted
from fastckpt.container.promote_checkpoints import (
    CheckpointPromoter,
    committed_checkpoints,
    left_behind,
    nearest_intact_checkpoint,
    promote_checkpoint,
    prune_checkpoints,
    remove_checkpoint,
    tier_dates,
)
from fastckpt.errors import (
    CheckpointFormatError,
    ChecksumMismatchError,
    DamagedSourceError,
    NotCommittedError,
    PromotionError,
)
from fastckpt.format import records
from fastckpt.format.records import read_commit_record
from fastckpt.manager import CheckpointManager, TiersConfig
from fastckpt.storage.registry import backend_for
from s3_support import S3Server, s3_env, s3_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

__all__ = ["s3_env", "s3_server"]  # fixtures used by name below

#: Kills of a promoting process (each checked); FASTCKPT_CRASH_KILLS_SCALE scales it.
KILLS = round(100 * float(os.environ.get("FASTCKPT_CRASH_KILLS_SCALE", "1")))


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 16))
    model[0].requires_grad_(False)  # frozen: kept as linked files by incremental saves
    return model


def _train(model: torch.nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 256)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _manager(tiers: TiersConfig, *, async_save: bool = False) -> CheckpointManager:
    config = (
        CheckpointManager.Config.with_async_save()
        if async_save
        else CheckpointManager.Config.with_sync_save()
    )
    config.tiers = tiers
    return CheckpointManager(config)


def _run(manager: CheckpointManager, saves: int) -> list[dict[str, torch.Tensor]]:
    """``saves`` saves named step_0, step_1, ...; returns each save's weights."""
    model = _model()
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    states = []
    for step in range(saves):
        _train(model, optimizer)
        future = manager.save(f"step_{step}", {"model": model, "step": step})
        if future is not None:
            future.result()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _weights(loaded: dict[str, Any]) -> dict[str, torch.Tensor]:
    return dict(loaded["model"])


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_every_nth_save_is_promoted_each_tier_keeps_its_own_and_a_fresh_process_loads_it(
    tmp_path: Path, async_save: bool
) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    forget_promoted()
    tiers = TiersConfig(
        fast=fast, durable=durable, promote_every=2, keep_last=2, durable_keep_last=2
    )
    with _manager(tiers, async_save=async_save) as manager:
        states = _run(manager, 6)
    assert manager.promotion_healthy
    assert committed_checkpoints(fast) == ["step_4", "step_5"]
    # Saves 0, 2 and 4 were promoted; the durable tier keeps its newest two.
    assert committed_checkpoints(durable) == ["step_2", "step_4"]
    assert fastckpt.verify(durable / "step_4").ok
    # The frozen layer's file was not copied again: a hard link inside the durable tier.
    linked = [p for p in (durable / "step_4").rglob("*.safetensors") if "linked" in p.parts]
    assert linked and all(os.stat(p).st_nlink >= 2 for p in linked)
    # A fresh process loads the durable copy bitwise (the fast tier deleted first).
    shutil.rmtree(fast)
    torch.save(states[4], tmp_path / "want.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from fastckpt.manager import CheckpointManager
        manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
        got = dict(manager.load({str(durable / "step_4")!r})["model"])
        want = torch.load({str(tmp_path / "want.pt")!r})
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        print("bitwise")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "bitwise"


def test_load_latest_takes_the_newest_intact_copy_and_says_which(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    tiers = TiersConfig(fast=fast, durable=durable, promote_every=2)
    with _manager(tiers) as manager:
        states = _run(manager, 4)  # step_0 and step_2 promoted
        assert manager.latest().path == fast / "step_3"
        assert _equal(_weights(manager.load_latest()), states[3])
        assert manager.restored_from is not None and manager.restored_from.skipped == []
        # The fast tier's newest copy rots: the next intact one is fast's step_2.
        _flip_last_byte(fast / "step_3" / "model.safetensors")
        assert _equal(_weights(manager.load_latest()), states[2])
        where = manager.restored_from
        assert where is not None and where.path == fast / "step_2"
        assert len(where.skipped) == 1 and "step_3" in where.skipped[0]
        # Its copy of step_2 rots too: the durable copy of step_2.
        _flip_last_byte(fast / "step_2" / "model.safetensors")
        assert _equal(_weights(manager.load_latest()), states[2])
        assert manager.restored_from is not None
        assert manager.restored_from.path == durable / "step_2"
        assert "restoring step_2 from" in manager.restored_from.describe()
        # A new node: no fast tier at all.
        shutil.rmtree(fast)
        assert _equal(_weights(manager.load_latest()), states[2])
        # Nothing intact anywhere: a typed error naming what was passed over.
        _flip_last_byte(durable / "step_2" / "model.safetensors")
        _flip_last_byte(durable / "step_0" / "model.safetensors")
        with pytest.raises(NotCommittedError, match="no intact checkpoint"):
            manager.load_latest()


def test_a_checkpoint_the_fast_tier_lost_is_restored_from_the_durable_tier_in_its_place(
    tmp_path: Path,
) -> None:
    """The fast tier loses its newest checkpoint (a directory removed) which the durable tier
    holds intact: ``latest()`` restores that one from the durable tier, not the fast tier's
    older one. Before, names only a slower tier held were tried after every name of the
    fast tier, whatever their save dates: with saves less than 5 s apart the run resumed a
    checkpoint back without a word."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    tiers = TiersConfig(fast=fast, durable=durable, promote_every=1)
    with _manager(tiers) as manager:
        states = _run(manager, 5)
    assert committed_checkpoints(durable)[-1] == "step_4"
    shutil.rmtree(fast / "step_4")
    with _manager(tiers) as manager:
        assert manager.latest().path == durable / "step_4"
        assert _equal(_weights(manager.load_latest()), states[4])


def test_a_damaged_fast_checkpoint_is_passed_over_and_the_later_ones_are_promoted(
    tmp_path: Path,
) -> None:
    """The fast tier's newest checkpoint (not due, never promoted) rots; a new manager queues
    it at start. It can never be promoted: the promoter passes over it for the later saves
    and reports it (PromotionError caused by DamagedSourceError naming it). Before, it stayed
    first in the queue, every later promotion failed behind it for the manager's lifetime,
    and close() raised."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    tiers = TiersConfig(fast=fast, durable=durable, promote_every=2)
    with _manager(tiers) as manager:
        _run(manager, 4)  # step_0 and step_2 promoted
    _flip_last_byte(fast / "step_3" / "model.safetensors")
    manager = _manager(tiers)
    model = _model()
    for step in range(4, 7):
        manager.save(f"step_{step}", {"model": model, "step": step})
        assert manager.promoter is not None
        manager.promoter.wait()
        if step == 4:
            assert not manager.promotion_healthy
            error = manager.promoter.error
            assert error is not None and isinstance(error.__cause__, DamagedSourceError)
            assert "step_3" in str(error.__cause__)
    assert committed_checkpoints(durable) == ["step_0", "step_2", "step_4", "step_6"]
    assert manager.promotion_healthy
    manager.close()  # the last promotion succeeded


def test_a_fast_tier_left_from_an_earlier_run_neither_wins_nor_is_promoted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node's disk that held this job before (its fast tier stopped at step_1, an hour
    ago) while the run went on elsewhere to step_5 on the durable tier: the newest
    checkpoint is the durable step_5, not the node's old step_1, and opening the manager
    does not promote step_1, where it would become the durable tier's newest and push the
    run's real newest out of its retention (durable_keep_last=2). Before, the fast tier's
    order came first: step_1 was restored and promoted, and step_4 deleted."""
    old_node, durable = tmp_path / "old-node", tmp_path / "durable"
    forget_promoted()
    tiers = TiersConfig(fast=old_node, durable=durable, durable_keep_last=2)
    with _clock_behind(3600), _manager(tiers) as manager:
        _run(manager, 2)  # step_0, step_1 on the old node an hour ago, both promoted
    elsewhere = TiersConfig(fast=tmp_path / "other-node", durable=durable, durable_keep_last=2)
    with _manager(elsewhere) as manager:
        states = _run(manager, 6)  # the run went on elsewhere: step_0 .. step_5
    assert committed_checkpoints(durable) == ["step_4", "step_5"]
    forget_promoted()
    with caplog.at_level("WARNING", logger="fastckpt"), _manager(tiers) as back:
        assert back.latest().path == durable / "step_5"
        assert _equal(_weights(back.load_latest()), states[5])
        where = back.restored_from
        assert where is not None and "left from an earlier run" in where.describe()
    assert committed_checkpoints(durable) == ["step_4", "step_5"]
    assert any("left from an earlier run" in r.getMessage() for r in caplog.records)
    # A fast tier that is merely behind by a promotion's lag is not taken for one.
    assert left_behind({"step_3": 1000.0}, {"step_2": 990.0, "step_4": 1005.0}) is None


@contextlib.contextmanager
def _clock_behind(seconds: float) -> Iterator[None]:
    """Saves date their checkpoints ``seconds`` earlier (the clock of fastckpt's records)."""
    real = time.time_ns
    behind = types.SimpleNamespace(time_ns=lambda: real() - int(seconds * 1e9))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(records, "time", behind)
        yield


def test_a_fast_tier_left_two_minutes_before_the_run_went_on_elsewhere_does_not_win(
    tmp_path: Path,
) -> None:
    """A node that fails, then comes back a few minutes later to resume the job that went on
    elsewhere meanwhile (its checkpoints already promoted): the durable tier's newest is
    restored, not the node's own older newest. Checkpoints date when they were saved, a date
    promotion carries; before, the tiers dated them by when each store committed them, and a
    fast tier counted as left behind only by 10 minutes (promotion lag): step_1 won."""
    old_node, durable = tmp_path / "old-node", tmp_path / "durable"
    forget_promoted()
    tiers = TiersConfig(fast=old_node, durable=durable)
    with _clock_behind(120), _manager(tiers) as manager:
        _run(manager, 2)  # step_0, step_1, two minutes ago
    elsewhere = TiersConfig(fast=tmp_path / "other-node", durable=durable)
    with _manager(elsewhere) as manager:
        states = _run(manager, 4)  # the run went on: step_0 .. step_3, promoted
    for name in ("step_2", "step_3"):  # a promoted copy dates as its source
        here = read_commit_record(tmp_path / "other-node" / name)["saved_ns"]
        assert read_commit_record(durable / name)["saved_ns"] == here
    forget_promoted()
    with _manager(tiers) as back:
        nearest = back.latest()
        assert nearest.path == durable / "step_3", nearest.describe()
        assert "left from an earlier run" in nearest.describe()
        assert _equal(_weights(back.load_latest()), states[3])
    assert committed_checkpoints(durable)[-1] == "step_3"


def _earlier_run(tmp_path: Path, names: list[str]) -> tuple[Path, Path, TiersConfig]:
    """An old node's fast tier (``tmp_path/old-node``, durable ``tmp_path/durable``) that saved
    ``names`` an hour ago with an earlier run's weights: ``(old node, durable, its tiers)``."""
    old_node, durable = tmp_path / "old-node", tmp_path / "durable"
    forget_promoted()
    tiers = TiersConfig(fast=old_node, durable=durable)
    with _clock_behind(3600), _manager(tiers) as manager:
        earlier = _model()
        with torch.no_grad():
            earlier[1].weight.add_(1.0)  # the earlier run's weights
        for step, name in enumerate(names):
            manager.save(name, {"model": earlier, "step": step})
    return old_node, durable, tiers


def test_a_stale_fast_copy_under_a_name_the_run_saved_again_is_not_restored(
    tmp_path: Path,
) -> None:
    """The run that went on elsewhere saved step_1 again (other weights) and its newer
    checkpoint is damaged: the fallback is the run's step_1 from the durable tier, not the
    left-behind node's step_1 of the earlier run. Before, a name's copy on the fast tier came
    first, and the earlier run's weights were restored as the run's step_1."""
    old_node, durable, tiers = _earlier_run(tmp_path, ["step_1"])
    elsewhere = TiersConfig(fast=tmp_path / "other-node", durable=durable)
    with _manager(elsewhere) as manager:
        states = _run(manager, 3)  # step_0 .. step_2, promoted (step_1 replaced there)
    _flip_last_byte(durable / "step_2" / "model.safetensors")
    nearest = nearest_intact_checkpoint([old_node, durable])
    assert nearest.path == durable / "step_1", nearest.describe()
    assert "another run's checkpoint" in nearest.describe()
    forget_promoted()
    with _manager(tiers) as back:
        assert _equal(_weights(back.load_latest()), states[1])


def test_a_fast_tier_holding_only_names_the_run_saved_again_does_not_win(
    tmp_path: Path,
) -> None:
    """The node saved step_0 and step_1 an hour ago; the run went on elsewhere and saved (and
    promoted) step_0 and step_1 again, with other weights, so the durable tier holds no name
    the node lacks. The node is still judged left behind (the durable copies were saved after
    all of its checkpoints): the run's step_1 is restored, and the node's stale step_1 is not
    promoted over it. Before, only a name the fast tier lacked counted: the stale step_1 was
    restored, then promoted over the durable step_1, losing the run's newest everywhere."""
    _, durable, tiers = _earlier_run(tmp_path, ["step_0", "step_1"])
    elsewhere = TiersConfig(fast=tmp_path / "other-node", durable=durable)
    with _manager(elsewhere) as manager:
        states = _run(manager, 2)  # step_0, step_1 again, promoted
    saved_ns = read_commit_record(durable / "step_1")["saved_ns"]
    forget_promoted()
    with _manager(tiers) as back:
        nearest = back.latest()
        assert nearest.path == durable / "step_1", nearest.describe()
        assert "left from an earlier run" in nearest.describe()
        assert _equal(_weights(back.load_latest()), states[1])
        assert back.promoter is not None
        back.promoter.wait()
    assert read_commit_record(durable / "step_1")["saved_ns"] == saved_ns
    assert committed_checkpoints(durable) == ["step_0", "step_1"]


def test_a_promotion_never_replaces_a_later_save_under_the_same_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever queued it, a promotion of an older save of step_1 over a durable step_1 saved
    later (by the run that went on elsewhere) is skipped with a warning naming both."""
    old_node, durable, _ = _earlier_run(tmp_path, ["step_1"])
    elsewhere = TiersConfig(fast=tmp_path / "other-node", durable=durable)
    with _manager(elsewhere) as manager:
        states = _run(manager, 2)
    promoter = CheckpointPromoter(old_node, durable)
    with caplog.at_level(logging.WARNING):
        outcome = promoter.run_here()  # nothing queued: nothing happens
        promoter.enqueue("step_1")
        outcome = promoter.run_here()
    assert outcome == {"promoted": [], "done": ["step_1"], "damaged": []}
    assert "was saved later" in caplog.text and str(durable / "step_1") in caplog.text
    # `fastckpt promote` refuses it too (it replaced the later save: exit 0, "promoted").
    from fastckpt.cli.main import main as cli

    assert cli(["promote", str(old_node), str(durable)]) == 2
    with _manager(TiersConfig(fast=tmp_path / "fresh", durable=durable)) as manager:
        assert _equal(_weights(manager.load(durable / "step_1")), states[1])


def test_a_checkpoint_of_an_earlier_version_promoted_late_keeps_its_place(
    tmp_path: Path,
) -> None:
    """The first run after an upgrade: the fast tier's step_100 was saved by an earlier
    version (its record has no save date), its promotion finishes after the run saved
    step_110. The durable copy dates by when step_100 was saved (its record's date on the
    fast tier), so the durable tier's retention keeps step_110. Before, the copy was dated by
    its promotion, after step_110, and ``keep_last=1`` deleted step_110."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    forget_promoted()
    with _manager(TiersConfig(fast=fast, durable=tmp_path / "elsewhere")) as manager:
        manager.save("step_100", {"model": _model()})
        _as_earlier_version(fast / "step_100" / "commit.json", time.time() - 60)
        manager.save("step_110", {"model": _model()})
    promote_checkpoint(fast / "step_110", durable / "step_110")
    promote_checkpoint(fast / "step_100", durable / "step_100")  # late
    assert committed_checkpoints(durable) == ["step_100", "step_110"]
    assert prune_checkpoints(durable, 1) == ["step_100"]
    assert committed_checkpoints(durable) == ["step_110"]


def test_a_damaged_record_does_not_widen_the_left_behind_margin(tmp_path: Path) -> None:
    """A tier whose commit records give save dates stays judged by the 5 s margin when one
    record is damaged (it is no record of an earlier version): a node back two minutes after
    the run went on elsewhere still restores the run's newest. Before, the damaged record
    counted as undated, the margin went back to 10 minutes and the node's step_1 won."""
    old_node, durable = tmp_path / "old-node", tmp_path / "durable"
    forget_promoted()
    tiers = TiersConfig(fast=old_node, durable=durable)
    with _clock_behind(120), _manager(tiers) as manager:
        _run(manager, 2)
    elsewhere = TiersConfig(fast=tmp_path / "other-node", durable=durable)
    with _manager(elsewhere) as manager:
        states = _run(manager, 4)
    record = old_node / "step_0" / "commit.json"
    stamp = record.stat()
    _flip_last_byte(record)  # bit rot: the date stays (two minutes ago, as its saved_ns)
    os.utime(record, ns=(stamp.st_atime_ns, stamp.st_mtime_ns - 120 * 10**9))
    assert tier_dates(old_node).saved and list(tier_dates(old_node).dates) == ["step_0", "step_1"]
    nearest = nearest_intact_checkpoint([old_node, durable])
    assert nearest.path == durable / "step_3", nearest.describe()
    forget_promoted()
    with _manager(tiers) as back:
        assert _equal(_weights(back.load_latest()), states[3])


def test_a_damaged_durable_record_does_not_make_a_runs_own_fast_tier_look_left_behind(
    tmp_path: Path,
) -> None:
    """A single-node run; the durable copy of its newest checkpoint has a damaged commit
    record whose store date (its promotion's commit) is 30 s after the save. The damaged copy
    is no evidence: the fast tier is not left behind and its intact newest is restored."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    forget_promoted()
    with _manager(TiersConfig(fast=fast, durable=durable)) as manager:
        states = _run(manager, 3)
        assert manager.promoter is not None
        manager.promoter.wait()
    record = durable / "step_2" / "commit.json"
    _flip_last_byte(record)
    later = time.time() + 30
    os.utime(record, (later, later))
    nearest = nearest_intact_checkpoint([fast, durable])
    assert nearest.path == fast / "step_2", nearest.describe()
    assert "left from an earlier run" not in nearest.describe()
    forget_promoted()
    with _manager(TiersConfig(fast=fast, durable=durable)) as back:
        assert _equal(_weights(back.load_latest()), states[2])


def test_an_earlier_versions_late_promotion_does_not_hide_the_fast_tiers_newest(
    tmp_path: Path,
) -> None:
    """Records of an earlier version (no save date) on both tiers: step_100's promotion
    committed 16 minutes after its save, 11 after step_110 was saved on the fast tier (not
    due for promotion). With store dates a copy of a save may date long after it, so a name
    the fast tier holds is no sign of another run: step_110 stays the newest."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    forget_promoted()
    with _manager(TiersConfig(fast=fast, durable=tmp_path / "unused")) as manager:
        states = _run(manager, 2)
    for step, name in enumerate(("step_100", "step_110")):
        os.rename(fast / f"step_{step}", fast / name)
    promote_checkpoint(fast / "step_100", durable / "step_100")
    now = time.time()
    for record, minutes_ago in (
        (fast / "step_100", 30),
        (fast / "step_110", 25),
        (durable / "step_100", 14),  # the earlier promoter's copy: dated by its commit
    ):
        _as_earlier_version(record / "commit.json", now - minutes_ago * 60)
    nearest = nearest_intact_checkpoint([fast, durable])
    assert nearest.path == fast / "step_110", nearest.describe()
    forget_promoted()
    with _manager(TiersConfig(fast=fast, durable=durable)) as back:
        assert _equal(_weights(back.load_latest()), states[1])


def _as_earlier_version(record: Path, when: float) -> None:
    """Rewrite a commit record as fastckpt versions before ``saved_ns`` wrote it, dated
    ``when`` by its store."""
    document = json.loads(record.read_text())
    del document["saved_ns"], document[records.MANIFEST_CRC_FIELD]
    record.write_text(json.dumps(records.seal_manifest(document)))
    os.utime(record, (when, when))


def test_checkpoints_committed_within_one_timestamp_tick_keep_their_order(
    tmp_path: Path,
) -> None:
    """Filesystem timestamps tick coarsely (a few ms on many kernels): two checkpoints whose
    commit records share one keep the order in which they were saved, not their names'."""
    root = tmp_path / "fast"
    with _manager(TiersConfig(fast=root, durable=tmp_path / "durable")) as manager:
        names = [f"step_{i}" for i in (8, 9, 10, 11)]
        model = _model()
        for name in names:
            manager.save(name, {"model": model})  # a sync save: committed on return
    tick = os.stat(root / "step_8" / "commit.json").st_mtime
    for name in names:
        os.utime(root / name / "commit.json", (tick, tick))
    assert committed_checkpoints(root) == names  # by name: step_10, step_11, step_8, step_9
    assert nearest_intact_checkpoint([root]).name == "step_11"
    # fastckpt ls and prune of the directory take the manager's order, and prune keeps the
    # newest checkpoint that verifies, as the manager's retention does.
    assert [row["name"] for row in _cli("ls", str(root), "--json")["checkpoints"]] == names
    assert _cli("prune", str(root), "--keep-last", "1", "--dry-run", "--json")["deleted"] == [
        "step_8",
        "step_9",
        "step_10",
    ]
    _flip_last_byte(root / "step_11" / "model.safetensors")
    pruned = _cli("prune", str(root), "--keep-last", "1", "--json")
    assert (pruned["deleted"], pruned["kept"]) == (["step_8", "step_9"], ["step_10", "step_11"])
    assert committed_checkpoints(root) == ["step_10", "step_11"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_clock_stepped_back_between_saves_keeps_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """A wall clock stepped back an hour (an NTP step, a restored VM snapshot) between saves,
    in this process or in a new one, does not reorder them: ``keep_last`` keeps the newest
    saves, ``latest`` / ``load_latest`` and ``fastckpt prune`` take the last one saved."""
    root = tmp_path / "fast"
    real_ns = time.time_ns
    tiers = TiersConfig(fast=root, durable=tmp_path / "durable", promote_every=1000, keep_last=2)
    with _manager(tiers, async_save=async_save) as manager:
        _run(manager, 3)
        monkeypatch.setattr(time, "time_ns", lambda: real_ns() - 3600 * 10**9)
        model = _model()
        for step in (3, 4):
            model[1].weight.data.fill_(float(step))
            future = manager.save(f"step_{step}", {"model": model, "step": step})
            if future is not None:
                future.result()
        assert committed_checkpoints(root) == ["step_3", "step_4"]
        assert manager.load_latest()["step"] == 4
    listing._NEWEST_SAVED.clear()  # a new process, the clock still an hour back
    with _manager(tiers, async_save=async_save) as manager:
        future = manager.save("step_5", {"model": model, "step": 5})
        if future is not None:
            future.result()
    assert committed_checkpoints(root) == ["step_4", "step_5"]
    assert _cli("prune", str(root), "--keep-last", "1", "--dry-run", "--json")["deleted"] == [
        "step_4"
    ]


@pytest.mark.parametrize("value", ["1796411348945721639", -1, True, 1.5])
def test_a_commit_record_with_a_malformed_saved_ns_is_refused_naming_the_field(
    tmp_path: Path, value: object
) -> None:
    """A sealed record whose saved_ns is not an int >= 0 is refused as malformed (it would
    otherwise order the checkpoint anywhere); listing the tier still works (it is undated)."""
    root = tmp_path / "fast"
    with _manager(TiersConfig(fast=root, durable=tmp_path / "durable")) as manager:
        manager.save("step_0", {"model": _model()})
    path = root / "step_0" / "commit.json"
    record = json.loads(path.read_text())
    record.pop(records.MANIFEST_CRC_FIELD, None)
    record["saved_ns"] = value
    path.write_text(json.dumps(records.seal_manifest(record)))
    with pytest.raises(CheckpointFormatError, match="saved_ns"):
        read_commit_record(root / "step_0")
    assert committed_checkpoints(root) == ["step_0"]
    with pytest.raises(NotCommittedError, match="saved_ns"):
        nearest_intact_checkpoint([root])


def _cli(*args: str) -> Any:
    """``fastckpt ARGS`` in a fresh process; its JSON output."""
    done = subprocess.run(
        [sys.executable, "-m", "fastckpt", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_retention_keeps_what_waits_for_promotion_and_the_newest_intact(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    tiers = TiersConfig(fast=root, durable=tmp_path / "other")
    with _manager(tiers) as manager:
        _run(manager, 4)
    assert committed_checkpoints(root) == ["step_0", "step_1", "step_2", "step_3"]
    # Spared by name whatever its age.
    assert prune_checkpoints(root, 1, spare={"step_0"}) == ["step_1", "step_2"]
    assert committed_checkpoints(root) == ["step_0", "step_3"]
    # The newest does not verify: the newest older one that does is kept as well.
    _flip_last_byte(root / "step_3" / "model.safetensors")
    assert prune_checkpoints(root, 1) == []
    assert committed_checkpoints(root) == ["step_0", "step_3"]


def test_a_removal_killed_midway_leaves_no_directory_under_the_name_and_is_cleaned(
    tmp_path: Path,
) -> None:
    fast = tmp_path / "fast"
    with _manager(TiersConfig(fast=fast, durable=tmp_path / "unused")) as manager:
        _run(manager, 3)
    # A removal is a rename to a hidden sibling naming its process, then the delete: nothing
    # is left under the checkpoint's name at any moment.
    remove_checkpoint(fast / "step_0")
    assert sorted(p.name for p in fast.iterdir()) == ["step_1", "step_2"]
    # What a process killed between the two steps leaves (a sibling naming a dead pid) is
    # never listed, and the tier's next staging removes it.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"  # as named
    leftover = fast / f".tmp-step_1~{int(dead.stdout)}~{host}~0badc0de"
    shutil.copytree(fast / "step_1", leftover)
    assert committed_checkpoints(fast) == ["step_1", "step_2"]
    promote_checkpoint(fast / "step_1", fast / "step_9")  # a staging in the tier itself
    assert not leftover.exists()
    # step_9, a copy of step_1, dates as its source: it goes with it, before step_2.
    assert committed_checkpoints(fast) == ["step_1", "step_9", "step_2"]


def test_a_damaged_source_is_refused_and_the_target_untouched(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    tiers = TiersConfig(fast=fast, durable=tmp_path / "unused")
    with _manager(tiers) as manager:
        _run(manager, 2)
    promote_checkpoint(fast / "step_0", durable / "step_0")
    _flip_last_byte(fast / "step_1" / "model.safetensors")
    with pytest.raises(ChecksumMismatchError, match=r"model\.safetensors"):
        promote_checkpoint(fast / "step_1", durable / "step_1")
    assert committed_checkpoints(durable) == ["step_0"]
    assert sorted(p.name for p in durable.iterdir()) == ["step_0"]


def test_a_stopped_durable_server_costs_the_saves_nothing_and_is_reported(
    s3_server: S3Server, tmp_path: Path
) -> None:
    fast, durable = tmp_path / "fast", s3_server.url("manager-stopped")
    options = s3_server.options(max_retries=0, retry_timeout_s=1.0, connect_timeout_s=1.0)
    errors: list[tuple[PromotionError, bool]] = []
    manager: CheckpointManager

    def report(error: PromotionError) -> None:
        errors.append((error, manager.promotion_healthy))

    tiers = TiersConfig(
        fast=fast, durable=durable, keep_last=1, on_error=report, durable_storage_options=options
    )
    manager = _manager(tiers)
    s3_server.stop()
    try:
        with pytest.warns(RuntimeWarning, match="training goes on"):
            states = _run(manager, 3)
            manager.promoter.wait()  # type: ignore[union-attr]
        assert errors and all(isinstance(e, PromotionError) and not ok for e, ok in errors)
        # keep_last=1, yet the newest save waiting for its promotion is kept as well.
        assert committed_checkpoints(fast)[-1] == "step_2"
        with pytest.raises(PromotionError, match="manager-stopped"):
            manager.close()
        assert not manager.promotion_healthy  # raised once, still reported
    finally:
        s3_server.start()
    # The next manager on these tiers finishes the promotion of the newest checkpoint.
    with _manager(tiers) as again:
        again.promoter.wait()  # type: ignore[union-attr]
        assert again.promotion_healthy
    assert committed_checkpoints(durable) == ["step_2"]
    shutil.rmtree(fast)
    with _manager(tiers) as restorer:
        assert _equal(_weights(restorer.load_latest()), states[2])
        assert restorer.restored_from is not None
        assert str(restorer.restored_from.tier).endswith("manager-stopped")


def test_incremental_checkpoints_promoted_to_s3_load_after_their_bases_are_gone(
    s3_server: S3Server, tmp_path: Path
) -> None:
    fast, durable = tmp_path / "fast", s3_server.url("manager-tiers")
    forget_promoted()
    tiers = TiersConfig(
        fast=fast,
        durable=durable,
        durable_keep_last=1,
        durable_storage_options=s3_server.options(),
    )
    with _manager(tiers, async_save=True) as manager:
        states = _run(manager, 3)
    assert committed_checkpoints(durable) == ["step_2"]
    assert fastckpt.verify(f"{durable}/step_2").ok
    shutil.rmtree(fast)
    with _manager(tiers) as restorer:
        assert _equal(_weights(restorer.load_latest()), states[2])


def test_checkpoints_promoted_to_s3_within_one_second_keep_their_order(
    s3_server: S3Server, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """S3 dates objects to the second (LastModified): checkpoints committed within one
    second tie on it, and were then ordered by name, so a new node (fast tier gone) restored
    an older one as the latest, and durable retention could delete the newest. The order
    follows the commit records' generations (named to the millisecond) when dates tie. The
    ids count down, so that every tie ordered by name is in the wrong order."""
    fast, durable = tmp_path / "fast", s3_server.url("manager-order")
    forget_promoted()
    tiers = TiersConfig(fast=fast, durable=durable, durable_storage_options=s3_server.options())
    names = [f"left_{n}" for n in range(6, 0, -1)]
    with _manager(tiers) as manager:
        model = _model()
        for step, name in enumerate(names):
            manager.save(name, {"model": model, "step": step})
    assert manager.promotion_healthy
    dates = [backend_for(durable).stat(f"{durable}/{n}/commit.json").modified for n in names]
    assert len(set(dates)) < len(dates), "the premise: the store dated two commits alike"
    assert committed_checkpoints(durable) == names
    listed = subprocess.run(
        [sys.executable, "-m", "fastckpt", "ls", durable, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **s3_env},
    )
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]  # oldest commit first
    assert [row["name"] for row in rows] == names and rows[-1]["latest"]
    shutil.rmtree(fast)
    with _manager(tiers) as restorer:
        assert restorer.latest().name == names[-1]
        assert restorer.load_latest()["step"] == len(names) - 1
    pruned = subprocess.run(  # fastckpt prune of the S3 directory: the manager's order
        [sys.executable, "-m", "fastckpt", "prune", durable, "--keep-last", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **s3_env},
    )
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["deleted"] == names[:-1]
    assert committed_checkpoints(durable) == names[-1:]


def test_tiers_refuse_ids_outside_the_fast_tier_and_a_remote_fast_tier(tmp_path: Path) -> None:
    tiers = TiersConfig(fast=tmp_path / "fast", durable=tmp_path / "durable")
    with _manager(tiers) as manager, pytest.raises(ValueError, match="inside the fast tier"):
        manager.save(tmp_path / "elsewhere" / "step_0", {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="local directory"):
        _manager(TiersConfig(fast="s3://bucket/fast", durable=tmp_path / "durable"))
    with pytest.raises(ValueError, match="positive integer"):
        TiersConfig(fast=tmp_path, durable=tmp_path / "d", promote_every=0)
    with pytest.raises(ValueError, match=r"needs Config\.tiers"):
        CheckpointManager(CheckpointManager.Config.with_sync_save()).latest()


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {n: (r["size"], r["crc32c"]) for n, r in read_commit_record(path)["files"].items()}


def test_sigkill_at_random_moments_of_checkpoint_promotions_never_leaves_a_partial_one(
    tmp_path: Path,
) -> None:
    """A process promoting manager checkpoints is killed ``KILLS`` times at random moments
    (replacing checkpoints the durable tier already holds too). After every kill each
    committed checkpoint of the durable tier verifies and has exactly the source's files;
    the next promotion finishes the job and nothing the killed ones left remains."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    with _manager(TiersConfig(fast=fast, durable=tmp_path / "unused")) as manager:
        _run(manager, 3)
    names = committed_checkpoints(fast)
    rng = random.Random(26)
    kills = inside = 0
    while kills < KILLS:
        name = rng.choice(names)
        ended = crash_harness.kill_after(
            crash_harness.promote_checkpoint_and_report,
            (str(fast / name), str(durable / name)),
            rng.uniform(0.0, 0.03),
        )
        kills += ended.killed
        if not ended.promoted:
            assert ended.exitcode == -signal.SIGKILL, ended.exitcode
            inside += 1
        for committed in committed_checkpoints(durable):
            assert _files(durable / committed) == _files(fast / committed), (kills, committed)
            assert fastckpt.verify(durable / committed).ok, (kills, committed)
    assert inside >= KILLS // 3, inside
    for name in names:  # the next promotions finish the job
        promote_checkpoint(fast / name, durable / name)
    assert committed_checkpoints(durable) == names
    assert sorted(os.listdir(durable)) == names  # no staging directory of a killed one left
    assert all(fastckpt.verify(durable / name).ok for name in names)


def test_the_command_line_promotes_a_tiers_newest_checkpoint_once(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    with _manager(TiersConfig(fast=fast, durable=tmp_path / "unused")) as manager:
        states = _run(manager, 2)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fastckpt", "promote", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )

    done = cli(str(fast), str(durable), "--json")
    assert done.returncode == 0, done.stderr
    assert '"promoted": [\n    "step_1"\n  ]' in done.stdout
    again = cli(str(fast), str(durable))
    assert again.returncode == 0 and "already holds step_1" in again.stdout
    refused = cli(str(fast), str(durable), "--every", "2")
    assert refused.returncode == 2 and "--every applies to save_checkpoint roots" in refused.stderr
    assert committed_checkpoints(durable) == ["step_1"]
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        assert _equal(_weights(reader.load(durable / "step_1")), states[1])


def test_a_promotion_slower_than_the_saves_keeps_its_checkpoint_and_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fast tier's keep_last spared the newest queued checkpoint only: the one being
    # promoted (the queue's first) was deleted under a promotion outlasting a save interval.
    import fastckpt.container.promote_checkpoints as tiers_module

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    real = tiers_module.promote_checkpoint
    slowed: list[str] = []

    def slow_promote_checkpoint(source: Any, target: Any) -> Any:
        if not slowed:  # the first promotion lasts until three more saves committed
            slowed.append(Path(source).name)
            deadline = time.monotonic() + 60
            while "step_3" not in committed_checkpoints(fast) and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(source, target)

    monkeypatch.setattr(tiers_module, "promote_checkpoint", slow_promote_checkpoint)
    with _manager(TiersConfig(fast=fast, durable=durable, keep_last=1)) as manager:
        _run(manager, 5)
    assert slowed == ["step_0"]
    assert committed_checkpoints(durable)[0] == "step_0"  # completed, not pruned under it
    assert committed_checkpoints(durable)[-1] == "step_4"
    # The newest only: what the slow promotion held at the last save was spared then, and
    # close() applied keep_last once more when the promotions were done (before: one extra).
    assert committed_checkpoints(fast) == ["step_4"]


def test_a_damaged_linked_file_found_by_retention_is_not_linked_again(tmp_path: Path) -> None:
    # Each save linked the previous checkpoint's damaged file again (a link checks sizes and
    # header checksums only): no later checkpoint verified and keep_last deleted nothing.
    fast = tmp_path / "fast"
    tiers = TiersConfig(fast=fast, durable=tmp_path / "durable", keep_last=2, promote_every=100)
    model = _model()
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with _manager(tiers) as manager:
        for step in range(6):
            if step == 3:  # bit rot in the frozen layer's file, shared by links
                (linked,) = (fast / "step_2" / "linked").glob("*.safetensors")
                before = linked.stat()
                _flip_last_byte(linked)  # as the device did it: the file's times unchanged
                os.utime(linked, ns=(before.st_atime_ns, before.st_mtime_ns))
            _train(model, optimizer)
            manager.save(f"step_{step}", {"model": model, "step": step})
    assert committed_checkpoints(fast) == ["step_4", "step_5"]
    for name in ("step_4", "step_5"):
        assert fastckpt.verify(fast / name).ok, name
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        assert _equal(_weights(reader.load(fast / "step_5")), model.state_dict())


def test_an_older_spared_checkpoint_does_not_let_retention_delete_the_newest_that_verifies(
    tmp_path: Path,
) -> None:
    # step_0 (spared: being promoted, or an alias's target) verified, so the kept ones counted
    # as good and step_2, the newest that verifies, was deleted behind a damaged step_3.
    root = tmp_path / "tier"
    with _manager(TiersConfig(fast=root, durable=tmp_path / "other")) as manager:
        _run(manager, 4)
    _flip_last_byte(root / "step_3" / "model.safetensors")
    assert prune_checkpoints(root, 1, spare={"step_0"}) == ["step_1"]
    assert committed_checkpoints(root) == ["step_0", "step_2", "step_3"]


def test_retention_deletes_no_checkpoint_when_none_verifies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a folder of manager checkpoints none of which verified lost all but the newest
    to ``prune_checkpoints`` (``fastckpt prune DIR``, a tier's retention) without a word; a
    root's ``prune`` deletes nothing then, and so does this now, with a warning."""
    root = tmp_path / "tier"
    with _manager(TiersConfig(fast=root, durable=tmp_path / "other")) as manager:
        _run(manager, 3)
    for name in committed_checkpoints(root):
        _flip_last_byte(root / name / "model.safetensors")
    with caplog.at_level("WARNING"):
        assert prune_checkpoints(root, 1) == []
    assert "prune deleted nothing: no checkpoint verifies" in caplog.text
    assert committed_checkpoints(root) == ["step_0", "step_1", "step_2"]


def test_a_save_naming_its_base_after_retention_found_damage_writes_in_full(
    tmp_path: Path,
) -> None:
    # The damage notice was taken at save()'s early base check, so the plan's second check
    # raised "base=... is not this manager's previous save (none)" and the save was lost.
    fast = tmp_path / "fast"
    tiers = TiersConfig(fast=fast, durable=tmp_path / "durable", keep_last=2, promote_every=100)
    model = _model()
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with _manager(tiers) as manager:
        for step in range(5):
            if step == 3:
                (linked,) = (fast / "step_2" / "linked").glob("*.safetensors")
                before = linked.stat()
                _flip_last_byte(linked)
                os.utime(linked, ns=(before.st_atime_ns, before.st_mtime_ns))
            _train(model, optimizer)
            base = None if step == 0 else fast / f"step_{step - 1}"
            manager.save(f"step_{step}", {"model": model, "step": step}, base=base)
    assert committed_checkpoints(fast)[-1] == "step_4"
    assert fastckpt.verify(fast / "step_4").ok


def test_fastckpt_promote_repairs_a_damaged_newest_checkpoint_in_the_target(
    tmp_path: Path,
) -> None:
    # "already holds step_3" over a damaged durable copy (the commit records match).
    from fastckpt.cli.main import main as cli

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    with _manager(TiersConfig(fast=fast, durable=durable)) as manager:
        _run(manager, 4)
    _flip_last_byte(durable / "step_3" / "model.safetensors")
    assert not fastckpt.verify(durable / "step_3").ok
    assert cli(["promote", str(fast), str(durable)]) == 0
    assert fastckpt.verify(durable / "step_3").ok


@pytest.mark.parametrize("async_save", [False, True])
def test_the_finalize_callback_gets_the_checkpoint_inside_the_fast_tier(
    tmp_path: Path, async_save: bool
) -> None:
    """With tiers, ``CallbackArgs.path`` was the bare name (``step_0``, relative to the
    working directory, where a stale checkpoint of that name may be): it is the committed
    checkpoint inside the fast tier."""
    seen: list[tuple[str, bool]] = []
    tiers = TiersConfig(fast=tmp_path / "fast", durable=tmp_path / "durable")
    config = (
        CheckpointManager.Config.with_async_save()
        if async_save
        else CheckpointManager.Config.with_sync_save()
    )
    config.tiers = tiers
    config.finalize_callback = lambda args: seen.append(
        (args.path, (Path(args.path) / "commit.json").is_file())
    )
    with CheckpointManager(config) as manager:
        _run(manager, 1)
    assert seen == [(str(tmp_path / "fast" / "step_0"), True)]


def test_fastckpt_promote_refuses_a_tier_left_from_an_earlier_run(tmp_path: Path) -> None:
    """An old node's fast tier whose newest name the durable tier lacks, while the durable
    tier holds the run's later checkpoints: `fastckpt promote` from it would bury them under
    an older "newest" (and its retention could delete them): exit 2, nothing promoted."""
    from fastckpt.cli.main import main as cli

    old_node, durable, _ = _earlier_run(tmp_path, ["step_9"])
    shutil.rmtree(durable / "step_9")
    with _manager(TiersConfig(fast=tmp_path / "other-node", durable=durable)) as manager:
        _run(manager, 2)
    assert cli(["promote", str(old_node), str(durable)]) == 2
    assert committed_checkpoints(durable) == ["step_0", "step_1"]


def test_a_manager_that_only_restores_past_a_damaged_record_closes_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new manager queues the fast tier's newest checkpoint (an earlier process may have
    left its promotion unfinished). Its ``commit.json`` damaged, the restore came from the
    durable tier, but that queued promotion could never succeed and ``close()`` raised
    ``PromotionError`` in a run that only restored. It is named and not queued now."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    tiers = TiersConfig(fast=fast, durable=durable, promote_every=1)
    with _manager(tiers) as manager:
        states = _run(manager, 3)
    _flip_last_byte(fast / "step_2" / "commit.json")
    with caplog.at_level(logging.WARNING), _manager(tiers) as manager:
        assert _equal(_weights(manager.load_latest()), states[2])
        assert manager.restored_from is not None
        assert manager.restored_from.path == durable / "step_2"
    assert "step_2 is not promoted: its commit record does not read" in caplog.text
    assert fastckpt.verify(durable / "step_2").ok


def test_a_promotion_never_swaps_away_a_file_put_into_the_durable_copy(tmp_path: Path) -> None:
    """A promotion replaces the durable ``<id>`` whole: a user's file put into it (evaluation
    results beside the weights) was deleted without a word. It is refused now, as a save is."""
    from fastckpt.errors import NotACheckpointError

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    with _manager(TiersConfig(fast=fast, durable=durable)) as manager:
        _run(manager, 2)
    (durable / "step_1" / "eval.json").write_text('{"acc": 0.9}')
    with pytest.raises(NotACheckpointError, match=r"eval\.json"):
        promote_checkpoint(fast / "step_1", durable / "step_1")
    assert (durable / "step_1" / "eval.json").read_text() == '{"acc": 0.9}'
    assert fastckpt.verify(durable / "step_1").ok


@pytest.mark.parametrize("who", ["another host", "a dead process of this host"])
def test_a_durable_checkpoint_a_crashed_replace_moved_aside_is_restored_by_the_next_node(
    tmp_path: Path, who: str
) -> None:
    # On a filesystem without RENAME_EXCHANGE (NFS, the usual shared durable tier) a replace
    # renames the old copy aside, then the new one into place. A node dying between the two
    # left `.trash-latest~<pid>~<host>~...` alone; only a later save by a dead process's
    # own host put it back, so a new node's load_latest found no checkpoint (and a "resume
    # or start fresh" script started over).
    from fastckpt.storage import identity

    durable, fast = tmp_path / "durable", tmp_path / "fast"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(durable / "latest", {"w": torch.full((4,), 1.0), "step": 1})
    if who == "another host":
        owner = f"{os.getpid()}~node-a"
    else:
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        )
        owner = f"{int(child.stdout)}~{identity.HOST}"
    (durable / "latest").rename(durable / f".trash-latest~{owner}~0badcafe")
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    config.tiers = fastckpt.TiersConfig(fast=fast, durable=durable)
    with fastckpt.CheckpointManager(config) as m:
        state = m.load_latest()
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((4,), 1.0))
    assert sorted(p.name for p in durable.iterdir()) == ["latest"]
    assert fastckpt.verify(durable / "latest").ok


def test_a_removed_checkpoint_never_comes_back_from_a_copy_moved_aside(tmp_path: Path) -> None:
    # Restoring what a crashed replace moved aside (review of the fix above): a checkpoint
    # removed on purpose (prune, remove) must not come back from an older copy beside it,
    # and what an interrupted deletion left half-way (no commit record) is never put back.
    from fastckpt.container.promote_checkpoints import nearest_intact_checkpoint, remove_checkpoint

    tier = tmp_path / "tier"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tier / "step_2", {"step": 2})
        shutil.copytree(tier / "step_2", tier / ".trash-step_2~123~node-a~0badcafe")
        m.save(tier / "step_2", {"step": 22})  # a later save: the copy aside is obsolete
        m.save(tier / "step_3", {"step": 3})
        shutil.copytree(tier / "step_3", tier / ".trash-step_3~123~node-a~0badcafe")
        (tier / ".trash-step_3~123~node-a~0badcafe" / "commit.json").unlink()  # half deleted
        remove_checkpoint(tier / "step_2")
        remove_checkpoint(tier / "step_3")
        with pytest.raises(FileNotFoundError):  # nothing put back: nothing there
            nearest_intact_checkpoint([tier])
        assert not (tier / "step_2").exists() and not (tier / "step_3").exists()
        m.save(tier / "step_3", {"step": 33})  # not refused for leftovers under its name
        assert m.load(tier / "step_3")["step"] == 33
    assert sorted(p.name for p in tier.iterdir()) == ["step_3"]


def test_close_applies_the_fast_tiers_keep_last_once_the_last_promotion_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast tier's retention after the last save spares what the running promotion
    copies; before, nothing applied keep_last after that promotion ended, so a run with
    ``keep_last=1`` left two checkpoints on the fast tier (round-20 note). Now close()
    prunes once more when the promotions succeeded. The order is made explicit: step_4 is
    saved only once step_3's promotion runs, which lasts until step_4's retention is done."""
    import threading

    import fastckpt.container.promote_checkpoints as tiers_module
    import fastckpt.manager as manager_module

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    real_promote, real_prune = tiers_module.promote_checkpoint, manager_module.prune_checkpoints
    pruned_after: list[set[str]] = []
    copying_3 = threading.Event()

    def recorded_prune(root: Any, keep_last: int, **kwargs: Any) -> Any:
        result = real_prune(root, keep_last, **kwargs)
        pruned_after.append(set(committed_checkpoints(Path(root))))
        return result

    def slow_promote_checkpoint(source: Any, target: Any) -> Any:
        if Path(source).name == "step_3":  # held until the last save's retention ran
            copying_3.set()
            deadline = time.monotonic() + 60
            while not any("step_4" in names for names in pruned_after):
                assert time.monotonic() < deadline, pruned_after
                time.sleep(0.01)
        return real_promote(source, target)

    monkeypatch.setattr(tiers_module, "promote_checkpoint", slow_promote_checkpoint)
    monkeypatch.setattr(manager_module, "prune_checkpoints", recorded_prune)
    with _manager(TiersConfig(fast=fast, durable=durable, keep_last=1)) as manager:
        for step in range(5):
            if step == 4:
                assert copying_3.wait(60)
            manager.save(f"step_{step}", {"model": {"w": torch.full((4,), float(step))}})
        # The last save's retention spared step_3, which its promotion was copying.
        assert {"step_3", "step_4"} <= pruned_after[4]
    assert manager.promotion_healthy
    assert committed_checkpoints(durable)[-2:] == ["step_3", "step_4"]
    assert committed_checkpoints(fast) == ["step_4"]
