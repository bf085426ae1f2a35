"""A resumed strategy keeps checkpointing: ``TrainingStrategy.load_checkpoint`` without
``hooks=`` rebuilds the run's recorded ``CheckpointHook`` and ``EMAHook`` (with their state),
warns about hooks it cannot rebuild, and ``hooks=`` replaces them; ``resume_or_start`` is the
one call of a restartable script."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt.format.records import MANIFEST, seal_manifest
from fastckpt.training.hooks import rebuild


def log_losses(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
    """A plain function hook (nothing fastckpt can rebuild)."""


def _train(root: Path, steps: int = 4, *, extra: list[Any] | None = None) -> tuple[Any, Any]:
    hook = fastckpt.CheckpointHook(root, step_interval=2, keep_last=3, lock_timeout=30.0)
    ema = fastckpt.EMAHook(decay=0.9)
    strategy = support.new_strategy([hook, ema, *(extra or [])], num_steps=steps)
    strategy.run(support.loader())
    return strategy, ema


def _resume(root: Path, **kwargs: Any) -> fastckpt.TrainingStrategy:
    return fastckpt.TrainingStrategy.load_checkpoint(
        root, training_fn=support.training_fn, **kwargs
    )


def test_the_recorded_hooks_are_rebuilt_with_their_state_and_keep_checkpointing(
    tmp_path: Path,
) -> None:
    _, ema = _train(tmp_path, extra=[log_losses])
    with pytest.warns(UserWarning, match=r"hook tests?\.?.*log_losses.*cannot rebuild"):
        resumed = _resume(tmp_path)
    hook, rebuilt_ema = resumed.hooks
    assert isinstance(hook, fastckpt.CheckpointHook) and isinstance(rebuilt_ema, fastckpt.EMAHook)
    assert hook.checkpoint_dir == tmp_path and hook.step_interval == 2
    assert (hook.keep_last, hook.async_save, hook.lock_timeout) == (3, True, 30.0)
    assert (rebuilt_ema.decay, rebuilt_ema.num_updates) == (0.9, ema.num_updates)
    for name, tensor in ema.shadow.items():
        assert torch.equal(rebuilt_ema.shadow[name], tensor), name
    resumed.num_steps = 8
    resumed.run(support.loader())
    rows = fastckpt.list_checkpoints(tmp_path)
    assert [row["counters"]["step_count"] for row in rows] == [4, 6, 8]  # keep_last=3


def test_hooks_given_replace_the_recorded_ones_and_an_empty_list_means_none(
    tmp_path: Path,
) -> None:
    _train(tmp_path, extra=[log_losses])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _resume(tmp_path, hooks=[]).hooks == []
        mine = fastckpt.EMAHook(decay=0.9)
        assert _resume(tmp_path, hooks=[log_losses, mine]).hooks == [log_losses, mine]
    # The caller chose the hooks: nothing about rebuilding; only that hooks=[] drops the
    # recorded EMA state (as before).
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "cannot rebuild" in m], messages
    assert len([m for m in messages if "EMAHook (occurrence 0)" in m]) == 1, messages
    assert mine.num_updates == 4  # the state went into the hook given


def test_a_checkpoint_of_an_earlier_version_without_recorded_hooks_says_none_are_rebuilt(
    tmp_path: Path,
) -> None:
    """Earlier versions wrote no ``configs`` in hooks.json: a resume without ``hooks=`` went
    on without the run's CheckpointHook and saved nothing more, without a word (found by
    resuming a checkpoint of the 2026-11-30 version). Now a warning says so and names the
    fix; with ``hooks=`` the run saves on."""
    _train(tmp_path)
    for row in fastckpt.list_checkpoints(tmp_path):  # as the earlier version wrote them
        index = row["index"]
        path = tmp_path / str(index) / "hooks.json"
        document = json.loads(path.read_bytes())
        del document["configs"]
        data = json.dumps(document).encode()
        path.write_bytes(data)
        manifest = json.loads((tmp_path / MANIFEST).read_bytes())
        manifest["checkpoints"][str(index)]["files"]["hooks.json"] = {
            "size": len(data),
            "crc32c": fastckpt._native.crc32c(data),
        }
        (tmp_path / MANIFEST).write_text(json.dumps(seal_manifest(manifest)))
    with pytest.warns(UserWarning, match=r"earlier fastckpt version.*hooks=\[fastckpt\.Check"):
        resumed = _resume(tmp_path)
    assert resumed.hooks == []
    hook = fastckpt.CheckpointHook(tmp_path, step_interval=2, keep_last=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the EMA state no hook takes
        resumed = _resume(tmp_path, hooks=[hook])
    resumed.num_steps = 6
    resumed.run(support.loader())
    assert fastckpt.list_checkpoints(tmp_path)[-1]["counters"]["step_count"] == 6


def test_a_recorded_configuration_the_hook_refuses_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = [
        {
            "class": "fastckpt.training.hooks.checkpoint.CheckpointHook",
            "config": {"step_interval": 2},
        }
    ]
    monkeypatch.setattr(fastckpt.training.strategy, "record_hooks", lambda hooks: bad)
    _train(tmp_path)
    with pytest.raises(fastckpt.CheckpointFormatError, match=r"hooks\.json: field 'configs\[0\]"):
        _resume(tmp_path)
    # Only fastckpt's own classes are ever built: a name the checkpoint gives is not imported.
    other = [{"class": "os.system", "config": {"command": "false"}}]
    monkeypatch.setattr(fastckpt.training.strategy, "record_hooks", lambda hooks: other)
    _train(tmp_path / "other")
    with pytest.warns(UserWarning, match="os.system, which fastckpt cannot rebuild"):
        assert _resume(tmp_path / "other").hooks == []
    assert set(rebuild.REBUILDABLE) == {
        "fastckpt.training.hooks.checkpoint.CheckpointHook",
        "fastckpt.training.hooks.ema.EMAHook",
    }


def _hostile_records(monkeypatch: pytest.MonkeyPatch, **changes: Any) -> None:
    """Make the next runs record their CheckpointHook with ``changes`` to its configuration
    (what an edited ``hooks.json`` whose checksums were re-sealed holds)."""
    real = rebuild.record_hooks

    def record(hooks: Any) -> list[dict[str, Any]]:
        records = real(hooks)
        records[0]["config"].update(changes)
        return records

    monkeypatch.setattr(fastckpt.training.strategy, "record_hooks", record)


def test_a_rebuilt_hook_saves_and_prunes_only_where_the_caller_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint is untrusted input: before, a ``hooks.json`` naming another project's
    root (``keep_last=1``) made the resumed run save there and delete its checkpoints, and a
    key the hook never records (``overwrite=True``) was passed on."""
    victim = tmp_path / "victim"
    for step in range(3):
        fastckpt.save_checkpoint(victim, models={"m": torch.nn.Linear(2, 2)}, counters={"s": step})
    before = fastckpt.list_checkpoints(victim)

    _hostile_records(monkeypatch, checkpoint_dir=str(victim), keep_last=1)
    _train(tmp_path / "job")
    monkeypatch.undo()
    with pytest.warns(
        UserWarning, match="checkpoint_dir was .*victim.*; the resumed run uses .*job"
    ):
        resumed = _resume(tmp_path / "job")
    assert resumed.hooks[0].checkpoint_dir == tmp_path / "job"
    resumed.num_steps = 8
    resumed.run(support.loader())
    assert fastckpt.list_checkpoints(victim) == before
    assert [row["counters"]["step_count"] for row in fastckpt.list_checkpoints(tmp_path / "job")][
        -1
    ] == 8

    _hostile_records(monkeypatch, overwrite=True)
    _train(tmp_path / "keys")
    refused = r"'overwrite', which .* never records"
    with pytest.raises(fastckpt.CheckpointFormatError, match=refused):
        _resume(tmp_path / "keys")
    assert fastckpt.list_checkpoints(victim) == before


def test_a_second_checkpoint_hook_is_rebuilt_only_on_a_root_the_caller_names(
    tmp_path: Path,
) -> None:
    """A run with a rolling hook and an archive hook. A checkpoint's recorded paths never
    decide by themselves where the resumed run saves and prunes: before, an edited
    ``hooks.json`` adding a hook on another run's root (``keep_last=1``) made the resumed
    run delete that run's checkpoints. Now a hook on a root the caller did not name is left
    out with a warning; ``hooks=[...]`` keeps both."""
    steps, epochs = tmp_path / "steps", tmp_path / "epochs"
    rolling = fastckpt.CheckpointHook(steps, step_interval=2, keep_last=2, async_save=False)
    archive = fastckpt.CheckpointHook(epochs, epoch_interval=1, save_last=False, async_save=False)
    support.new_strategy([rolling, archive], num_steps=8).run(support.loader())
    archived = fastckpt.list_checkpoints(epochs)
    with pytest.warns(UserWarning, match=r"saving to .*epochs.*a root you did not name"):
        resumed = _resume(steps)
    assert [hook.checkpoint_dir for hook in resumed.hooks] == [steps]
    resumed.num_steps = 20
    resumed.run(support.loader())
    assert fastckpt.list_checkpoints(epochs) == archived  # not written, not pruned
    both = [
        fastckpt.CheckpointHook(steps, step_interval=2, keep_last=2, async_save=False),
        fastckpt.CheckpointHook(epochs, epoch_interval=1, save_last=False, async_save=False),
    ]
    resumed = _resume(steps, hooks=both)
    resumed.num_steps = 28
    resumed.run(support.loader())
    assert [r["counters"]["step_count"] for r in fastckpt.list_checkpoints(epochs)][-1] == 24


def test_a_resumed_run_saves_where_it_was_loaded_from_after_a_move_or_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the recorded relative ``checkpoint_dir`` was resolved against the new working
    directory: a run copied elsewhere, resumed from another directory, saved into a new root
    there, and the copy it resumed from never got the new checkpoints."""
    monkeypatch.chdir(tmp_path)
    _train(Path("job"))
    shutil.copytree(tmp_path / "job", tmp_path / "copy")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.warns(UserWarning, match="checkpoint_dir was 'job'"):
        resumed = _resume(tmp_path / "copy")
    resumed.num_steps = 8
    resumed.run(support.loader())
    steps = [row["counters"]["step_count"] for row in fastckpt.list_checkpoints(tmp_path / "copy")]
    assert steps[-1] == 8
    assert not (tmp_path / "elsewhere" / "job").exists()
    assert fastckpt.list_checkpoints(tmp_path / "job")[-1]["counters"]["step_count"] == 4


def test_a_tiered_run_resumed_from_its_fast_tier_keeps_promoting_to_its_durable_tier(
    tmp_path: Path,
) -> None:
    """The durable tier the run recorded is kept without being named, also when the fast tier
    keeps none of the promoted indices (keep_last=1, promote_every=2)."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(
        fast, step_interval=1, keep_last=1, durable_dir=durable, promote_every=2, async_save=False
    )
    strategy = support.new_strategy([hook], num_steps=4)
    strategy.run(support.loader())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = _resume(fast)
    assert (resumed.hooks[0].checkpoint_dir, resumed.hooks[0].durable_dir) == (fast, durable)
    # A copy of the run, its fast tier lost, resumed with its own durable tier as fallback:
    # it saves and promotes into the copy's tiers, not the original's.
    shutil.copytree(durable, tmp_path / "copy" / "durable")
    with pytest.warns(UserWarning, match="durable_dir was .*; the resumed run uses .*copy"):
        moved = _resume(tmp_path / "copy" / "fast", fallback_dirs=[tmp_path / "copy" / "durable"])
    hook = moved.hooks[0]
    assert (hook.checkpoint_dir, hook.durable_dir) == (
        tmp_path / "copy" / "fast",
        tmp_path / "copy" / "durable",
    )


def test_a_tiered_run_resumed_from_its_durable_tier_elsewhere_keeps_its_two_tiers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative tiers recorded, the fast one lost, the run resumed from its durable tier in
    another working directory: before, its fast-tier saves went into the durable root and
    its promotions to a new ``durable`` folder under the new working directory."""
    monkeypatch.chdir(tmp_path)
    hook = fastckpt.CheckpointHook(
        "fast", step_interval=1, durable_dir="durable", promote_every=2, async_save=False
    )
    support.new_strategy([hook], num_steps=4).run(support.loader())
    shutil.rmtree(tmp_path / "fast")  # the node is lost
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.warns(UserWarning, match="checkpoint_dir was 'fast'; the resumed run uses"):
        resumed = _resume(tmp_path / "durable")
    hook = resumed.hooks[0]
    assert (hook.checkpoint_dir, hook.durable_dir) == (tmp_path / "fast", tmp_path / "durable")
    resumed.num_steps = 8
    resumed.run(support.loader())
    assert list((tmp_path / "elsewhere").iterdir()) == []
    fast_steps = [r["counters"]["step_count"] for r in fastckpt.list_checkpoints(tmp_path / "fast")]
    durable = fastckpt.list_checkpoints(tmp_path / "durable")
    assert fast_steps[-4:] == [5, 6, 7, 8]
    assert [row["counters"]["step_count"] for row in durable] == [1, 3, 5, 7]
    # A copy of the durable tier (now recording absolute tiers): the same, in the copy's place.
    shutil.copytree(tmp_path / "durable", tmp_path / "copy" / "durable")
    with pytest.warns(UserWarning, match="durable_dir was '.*'; the resumed run uses .*copy"):
        copied = _resume(tmp_path / "copy" / "durable")
    hook = copied.hooks[0]
    assert (hook.checkpoint_dir, hook.durable_dir) == (
        tmp_path / "copy" / "fast",
        tmp_path / "copy" / "durable",
    )


def test_a_run_resumed_with_its_durable_tier_named_keeps_its_fast_tier_from_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative fast tier beside an absolute durable one, the fast tier resumed from
    another working directory with the durable tier in ``fallback_dirs``: the tiers stay the
    caller's (a first version of the durable-tier placement took the fast root for the
    durable tier, by its path names, and placed the fast tier in a made-up folder)."""
    run = tmp_path / "home" / "u" / "exp1"
    run.mkdir(parents=True)
    durable = tmp_path / "shared" / "exp1" / "ckpt"
    monkeypatch.chdir(run)
    hook = fastckpt.CheckpointHook(
        "ckpt", step_interval=1, durable_dir=durable, promote_every=2, async_save=False
    )
    support.new_strategy([hook], num_steps=4).run(support.loader())
    monkeypatch.chdir(tmp_path / "home" / "u")
    with pytest.warns(UserWarning, match="checkpoint_dir was 'ckpt'"):
        resumed = _resume(Path("exp1") / "ckpt", fallback_dirs=[durable])
    hook = resumed.hooks[0]
    assert (hook.checkpoint_dir, hook.durable_dir) == (run / "ckpt", durable)


def test_every_key_a_hook_records_is_one_its_rebuild_accepts(tmp_path: Path) -> None:
    """``RECORDED_KEYS`` lists what ``hook_config()`` writes: a key added there alone would
    make every resume of such a run a CheckpointFormatError."""
    every_option = fastckpt.CheckpointHook(
        tmp_path / "fast",
        step_interval=1,
        keep_last=2,
        lock_timeout=5.0,
        durable_dir=tmp_path / "durable",
        promote_every=2,
        durable_keep_last=3,
        strict_promotion=True,
        detached_promotion=True,
        strict_saves=False,
    )
    plain = fastckpt.CheckpointHook(tmp_path, epoch_interval=1)
    for hook in (every_option, plain, fastckpt.EMAHook()):
        assert set(hook.hook_config()) <= rebuild.RECORDED_KEYS[type(hook)], hook


def test_an_ema_hook_configured_otherwise_is_a_mismatch_not_damage(tmp_path: Path) -> None:
    """Before, resuming with ``EMAHook(decay=0.95)`` a checkpoint written with ``decay=0.9``
    raised ``CheckpointFormatError`` ("refused it"), pointing users at a damaged file."""
    _train(tmp_path)
    conflict = r"hooks\.json: hooks\[0\].*decay=0.9, this hook has decay=0.95"
    with pytest.raises(fastckpt.CheckpointMismatchError, match=conflict):
        _resume(tmp_path, hooks=[fastckpt.EMAHook(decay=0.95)])


def test_resume_or_start_starts_fresh_then_resumes(tmp_path: Path) -> None:
    started: list[int] = []

    def start() -> fastckpt.TrainingStrategy:
        started.append(1)
        hook = fastckpt.CheckpointHook(tmp_path, step_interval=2, async_save=False)
        return support.new_strategy([hook], num_steps=4)

    first = fastckpt.TrainingStrategy.resume_or_start(
        tmp_path, start, training_fn=support.training_fn
    )
    assert started == [1] and first.step_count == 0
    first.run(support.loader())
    second = fastckpt.TrainingStrategy.resume_or_start(
        tmp_path, start, training_fn=support.training_fn
    )
    assert started == [1] and second.step_count == 4
    assert isinstance(second.hooks[0], fastckpt.CheckpointHook)  # the recorded hook, rebuilt


def test_resume_or_start_resumes_from_a_durable_tier_when_the_fast_one_is_empty(
    tmp_path: Path,
) -> None:
    # A new node: its fast root is empty, the durable tier holds the run. Resuming, not a
    # fresh start that would bury the run (and later prune its durable copies).
    _train(tmp_path / "durable")
    resumed = fastckpt.TrainingStrategy.resume_or_start(
        tmp_path / "fast",
        lambda: pytest.fail("started afresh"),
        training_fn=support.training_fn,
        fallback_dirs=[tmp_path / "durable"],
    )
    assert resumed.step_count > 0
    assert resumed.restored_from is not None and resumed.restored_from.root == tmp_path / "durable"


def test_resume_or_start_refuses_a_damaged_manifest(tmp_path: Path) -> None:
    _train(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(fastckpt.CheckpointFormatError):
        fastckpt.TrainingStrategy.resume_or_start(tmp_path, lambda: pytest.fail("started"))


class _LossLog:
    """Checkpointable: every batch loss, appended at AFTER_BATCH."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.loss is not None:
            self.losses.append(ctx.loss.item())

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = list(state["losses"])


@pytest.mark.parametrize("async_save", [False, True])
def test_a_hook_listed_after_the_checkpoint_hook_is_in_its_checkpoints(
    tmp_path: Path, async_save: bool
) -> None:
    """The CheckpointHook runs after the other hooks of each stage whatever the list order,
    so a checkpoint holds their work of that stage (a resumed run does not replay it). Before,
    ``hooks=[CheckpointHook, log]`` saved the log without the step it was taken at: the
    resumed log lacked one loss."""
    straight = _LossLog()
    support.new_strategy([straight], num_steps=8).run(support.loader())
    hook = fastckpt.CheckpointHook(
        tmp_path / "run", step_interval=3, save_last=False, async_save=async_save
    )
    first = _LossLog()
    support.new_strategy([hook, first], num_steps=7).run(support.loader())  # dies after step 7
    resumed_log = _LossLog()
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", hooks=[resumed_log], training_fn=support.training_fn
    )
    assert resumed.step_count == 6 and resumed_log.losses == straight.losses[:6]
    resumed.num_steps = 8
    resumed.run(support.loader())
    assert resumed_log.losses == straight.losses


def test_a_moved_run_with_two_checkpoint_hooks_keeps_saving_where_it_is_loaded_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review found a run with two hooks recorded under relative roots, resumed from
    another working directory, going on with no CheckpointHook at all (neither recorded
    root named the caller's). The one recorded under the root's name saves there now."""
    job = tmp_path / "job"
    job.mkdir()
    monkeypatch.chdir(job)
    rolling = fastckpt.CheckpointHook("ckpt/steps", step_interval=2, async_save=False)
    archive = fastckpt.CheckpointHook("ckpt/epochs", epoch_interval=1, save_last=False)
    support.new_strategy([rolling, archive], num_steps=8).run(support.loader())
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"ckpt/epochs.*a root you did not name"):
        resumed = _resume(job / "ckpt" / "steps")
    assert [hook.checkpoint_dir for hook in resumed.hooks] == [job / "ckpt" / "steps"]
    resumed.num_steps = 10
    resumed.run(support.loader())
    steps = [
        row["counters"]["step_count"] for row in fastckpt.list_checkpoints(job / "ckpt" / "steps")
    ]
    assert steps[-1] == 10
