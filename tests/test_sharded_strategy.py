"""TrainingStrategy + CheckpointHook with FSDP2: a 2-rank gloo run saved by every rank, resumed
with ``load_checkpoint(..., parallelize=)`` on 1 and 3 ranks (and unsharded in this process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import fastckpt
import fastckpt.dcp
from dcp_support import check_ok, launch
from fastckpt.container.commit import prune_indices
from fastckpt.container.verify import CheckpointSkippedWarning
from fastckpt.dcp import is_sharded_checkpoint
from sharded_ranks import Recorder, bf16_training_fn, loader, training_fn


def _reports(results: list[tuple[int, str, str]]) -> list[dict[str, Any]]:
    return [json.loads(out.strip().splitlines()[-1]) for out in check_ok(results)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    root = tmp_path_factory.mktemp("sharded-strategy") / "run"
    reports = _reports(launch("strategy_train", root, 2, ranks="sharded_ranks"))
    assert reports[0]["losses"] == reports[1]["losses"]
    # every rank took part in every save: async every 2 steps, sync at steps 3 and 6
    assert [r["last"] for r in reports] == [[2, 1], [2, 1]]
    return root, reports[0]["losses"]


def test_every_rank_saves_its_shards_and_rank_0_commits_once(
    trained: tuple[Path, list[float]],
) -> None:
    root, _ = trained
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [1, 2]  # keep_last=2
    assert sorted(p.name for p in (root / "sharded").iterdir()) == ["1", "2"]  # 0 pruned too
    for index in (1, 2):
        recipe = json.loads((root / str(index) / "strategy.json").read_text())
        assert sorted(recipe["sharded"]["models"]) == ["main"]
        assert not (root / str(index) / "models").exists()  # model state only as shards
        # the index names the one part its save wrote, with its commit record's crc32c
        (part,) = (root / "sharded" / str(index)).iterdir()
        assert recipe["sharded"]["part"] == part.name and is_sharded_checkpoint(part)
        record = (part / fastckpt.dcp.RECORD_NAME).read_bytes()
        assert recipe["sharded"]["record_crc32c"] == fastckpt._native.crc32c(record)
    ranks = {p.name for p in (root / "sharded" / "2").rglob("*.safetensors")}
    assert len(ranks) == 2, ranks


def test_resume_on_one_rank_with_parallelize_continues_bitwise(
    trained: tuple[Path, list[float]],
) -> None:
    root, losses = trained
    report = _reports(launch("strategy_resume", root, 1, ranks="sharded_ranks"))[0]
    assert report["sharded"] and report["step"] == 4
    assert report["loaded_bad"] == []  # gathered state == the 2-rank run's at step 4
    assert report["losses"] == losses[4:]  # identical gradients averaged over 2 ranks: exact
    assert report["final_bad"] == []
    assert "FullyShardedDataParallel (FSDP1)" in report["fsdp1"]
    assert "torch.distributed.fsdp.fully_shard" in report["fsdp1"]


def test_resume_on_three_ranks_with_parallelize_reshards_and_trains_on(
    trained: tuple[Path, list[float]],
) -> None:
    root, losses = trained
    reports = _reports(launch("strategy_resume", root, 3, ranks="sharded_ranks"))
    rank0 = reports[0]
    assert all(r["step"] == 4 and r["sharded"] for r in reports)
    assert rank0["loaded_bad"] == []
    assert rank0["lr"] == pytest.approx([5e-3])  # StepLR state restored (halved at step 3)
    assert rank0["losses"] == pytest.approx(losses[4:], rel=1e-5)
    assert rank0["final_close"]


def test_sharded_checkpoint_resumes_unsharded_without_a_process_group(
    trained: tuple[Path, list[float]],
) -> None:
    root, losses = trained
    recorder = Recorder(root.parent)
    strategy = fastckpt.TrainingStrategy.load_checkpoint(
        root, 1, hooks=[recorder], training_fn=training_fn
    )
    assert not strategy.sharded and strategy.step_count == 4
    step4 = safetensors.torch.load_file(root.parent / "reference-step4.safetensors")
    model = strategy.models["main"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, step4[f"model.{name}"]), name
    strategy.run(loader())
    assert recorder.losses == pytest.approx(losses[4:], rel=1e-6)


def test_damaged_shards_make_prune_and_latest_intact_keep_the_newest_index_that_verifies(
    trained: tuple[Path, list[float]], tmp_path: Path
) -> None:
    """Before, which index verified was decided by the root's own files only: a flipped byte
    in the newest index's shard file left ``latest_intact`` pointing at it and
    ``prune(keep_last=1)`` deleted the only index that verified (nothing loaded after)."""
    source, _ = trained
    root = tmp_path / "run"
    shutil.copytree(source, root)
    (rank_file,) = (root / "sharded" / "2").glob("*/*/rank-00001.safetensors")
    data = bytearray(rank_file.read_bytes())
    data[-5] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    assert not fastckpt.verify(root).ok
    with pytest.warns(CheckpointSkippedWarning, match="index 2.*rank-00001"):
        assert fastckpt.latest_intact(root) == 1
    assert fastckpt.prune(root, keep_last=1) == []
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [1, 2]
    assert fastckpt.TrainingStrategy.load_checkpoint(root, 1, training_fn=training_fn).step_count
    # A hook's keep_last (after every save) checks the shards' record and sizes only, not
    # their bytes: a truncated shard counts there too.
    rank_file.write_bytes(bytes(data[:-8]))
    assert prune_indices(root, 1, read_shards=False) == []
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [1, 2]
    # ... and so does the full prune, and latest_intact, of the truncated shard
    with pytest.warns(CheckpointSkippedWarning, match="index 2.*rank-00001"):
        assert fastckpt.latest_intact(root) == 1
    assert fastckpt.prune(root, keep_last=1) == []
    assert [c["index"] for c in fastckpt.list_checkpoints(root)] == [1, 2]


def test_load_checkpoint_of_a_sharded_index_says_how_to_load_it(
    trained: tuple[Path, list[float]],
) -> None:
    """Before, ``fastckpt.load_checkpoint`` of an FSDP2 strategy root returned no model and
    no strategy without a word, and ``model_names=["main"]`` raised a bare KeyError."""
    root, _ = trained
    for options in ({}, {"model_names": ["main"]}, {"training_fn": training_fn}):
        with pytest.raises(ValueError, match=r"FSDP2-sharded models.*TrainingStrategy"):
            fastckpt.load_checkpoint(root, **options)


def test_synchronous_hook_saves_load_too(trained: tuple[Path, list[float]]) -> None:
    root, _ = trained
    run = root.parent / "sync-run"
    assert [c["index"] for c in fastckpt.list_checkpoints(run)] == [0, 1]
    strategy = fastckpt.TrainingStrategy.load_checkpoint(run, 0, training_fn=training_fn)
    assert strategy.step_count == 3
    step3 = safetensors.torch.load_file(root.parent / "reference-step3.safetensors")
    for name, tensor in strategy.models["main"].state_dict().items():
        assert torch.equal(tensor, step3[f"model.{name}"]), name
    optimizer = strategy.optimizers["main"].state_dict()
    assert optimizer["state"][0]["step"].item() == 3.0


def test_a_bfloat16_model_is_rebuilt_in_bfloat16(tmp_path: Path) -> None:
    """An FSDP2 model converted to bfloat16 after construction is rebuilt from its sharded
    checkpoint in bfloat16 (the dtypes the part holds), bitwise, optimizer state included,
    the layer frozen before sharding is frozen again, and the live optimizer's two parameter
    groups are two groups again, with their settings.
    Before, it was rebuilt in its constructor's float32 and the load cast every tensor to it:
    the resumed run trained in float32 without a word."""
    root = tmp_path / "run"
    _reports(launch("strategy_bf16_save", root, 2, ranks="sharded_ranks"))
    strategy = fastckpt.TrainingStrategy.load_checkpoint(root, training_fn=bf16_training_fn)
    reference = safetensors.torch.load_file(tmp_path / "reference-bf16.safetensors")
    model = strategy.models["main"]
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"0.weight", "0.bias"}  # frozen before sharding, frozen again
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, reference[f"model.{name}"]), name
    groups = strategy.optimizers["main"].param_groups
    settings = [(g["lr"], g["weight_decay"], len(g["params"])) for g in groups]
    assert settings == [(1e-2, 0.1, 3), (0.1, 0.0, 3)]  # before: one group of group 0's
    state = strategy.optimizers["main"].state_dict()["state"]
    names = [n for n, _ in model.named_parameters() if n.endswith("weight")]
    names += [n for n, _ in model.named_parameters() if n.endswith("bias")]
    for number, moments in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            saved = reference[f"optim.{names[number]}.{key}"]
            assert moments[key].dtype == torch.bfloat16
            assert torch.equal(moments[key], saved), (names[number], key)


def test_ranks_seeded_apart_resume_their_own_random_streams(tmp_path: Path) -> None:
    """Ranks seeded apart (each its own shuffle and noise) resume with their own RNG states:
    a sharded save gathers them when they differ, and each rank of a resume on as many ranks
    takes its own. Before, every rank resumed with rank 0's: rank 1 replayed rank 0's data
    and noise, and the run diverged without a word."""
    root = tmp_path / "run"
    saved = {
        r["rank"]: r
        for r in _reports(launch("strategy_rank_seeds_train", root, 2, ranks="sharded_ranks"))
    }
    assert saved[0]["straight"] != saved[1]["straight"]  # the ranks do draw apart
    resumed = {
        r["rank"]: r
        for r in _reports(launch("strategy_rank_seeds_resume", root, 2, ranks="sharded_ranks"))
    }
    for rank in (0, 1):
        assert saved[rank]["first"] + resumed[rank]["resumed"] == saved[rank]["straight"], rank


def test_a_frozen_layer_under_a_renaming_parallelize_resumes_frozen(tmp_path: Path) -> None:
    """Frozen parameters are recorded without the segments wrappers add to names
    (``_checkpoint_wrapped_module``), as DCP names them, so a ``parallelize`` that wraps the
    layer again finds them. Before, the record held the wrapped names, applied to the rebuilt
    model before ``parallelize``: the checkpoint could not be loaded at all."""
    (report,) = _reports(
        launch("strategy_wrapped_frozen", tmp_path / "run", 1, ranks="sharded_ranks")
    )
    assert report["frozen"] == [
        "a._checkpoint_wrapped_module.weight",
        "a._checkpoint_wrapped_module.bias",
    ]


def test_a_restore_into_a_live_fsdp2_strategy_freezes_what_the_saved_run_froze(
    tmp_path: Path,
) -> None:
    """The sharded side of ``restore_checkpoint``'s refreeze (2 gloo ranks): a hook froze the
    first layer mid-run; restored into a strategy built all trainable, every rank freezes it
    again, and the restored run leaves it as saved while the rest trains."""
    reports = _reports(
        launch("strategy_refreeze_on_restore", tmp_path / "run", 2, ranks="sharded_ranks")
    )
    for report in reports:
        assert report["frozen"] == ["0.bias", "0.weight"], report
    assert reports[0]["kept"] == ["model.0.weight", "model.0.bias"]
    assert reports[0]["trained"] is True


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_hook_state_holding_dtensors_is_refused_on_every_rank(tmp_path: Path, mode: str) -> None:
    """An EMAHook over an FSDP2 model keeps DTensor averages, which rank 0 cannot write whole:
    every rank raises the same UnsupportedValueError naming the hook, before the save starts.
    Before: DCP/copy errors, and in async mode rank 0 failed alone while the other ranks
    waited for its commit."""
    reports = _reports(
        launch("strategy_ema_refused", tmp_path / "run", 2, mode, ranks="sharded_ranks")
    )
    for report in reports:
        assert report["error"].startswith("UnsupportedValueError: hook "), report
        assert "EMAHook" in report["error"] and "DTensor" in report["error"], report


def test_parallelize_is_refused_for_unsharded_checkpoints(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 1)
    strategy = fastckpt.TrainingStrategy(
        model, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}), training_fn=training_fn
    )
    strategy.save_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="parallelize= applies to checkpoints of FSDP2"):
        fastckpt.TrainingStrategy.load_checkpoint(tmp_path, parallelize=lambda m: m)


def test_a_hand_attached_scheduler_of_a_sharded_strategy_needs_no_recipe(tmp_path: Path) -> None:
    # check_recordable's check of hand-attached schedulers (whose recipe an unsharded save
    # records) must not refuse a sharded strategy, whose save keeps their state alone.
    outputs = check_ok(
        launch("hand_attached_scheduler", tmp_path / "ckpt", 1, ranks="sharded_ranks")
    )
    assert json.loads(outputs[0].strip().splitlines()[-1]) == {
        "index": 0,
        "recordable": True,
        "refused": True,
        "restored": 0,
    }


def test_restore_into_an_fsdp2_strategy_with_pending_gradients_loads_every_moment(
    tmp_path: Path,
) -> None:
    # Before: refused ("the checkpoint holds 18 tensors the templates lack"), and before that
    # the moments were silently left out.
    outputs = check_ok(
        launch("restore_with_pending_gradients", tmp_path / "ckpt", 1, ranks="sharded_ranks")
    )
    assert json.loads(outputs[0].strip().splitlines()[-1]) == {"mismatches": [], "grads_kept": True}


def test_a_restore_stopped_part_way_on_one_rank_refuses_every_ranks_save(tmp_path: Path) -> None:
    """Round 22: a restore stopped after rank 1's shards were applied (its validator refused)
    left rank 1 torn; the save is a collective of every rank's shards, so every rank refuses
    it (``InterruptedStepError`` naming rank 1), and so does every rank's ``run()`` (rank 0
    training alone would wait in its first collective until it timed out), until a restore
    completes everywhere."""
    reports = _reports(launch("strategy_torn_restore", tmp_path / "run", 2, ranks="sharded_ranks"))
    assert [r["restored"] for r in reports] == [True, False]
    for report in reports:
        assert "stopped part-way on rank 1" in report["refused"], report["refused"]
        assert "nothing was saved" in report["refused"]
        assert "stopped part-way on rank 1" in report["run"], report["run"]
        assert "nothing was trained on" in report["run"]
        assert (report["index"], report["saved"], report["step"]) == (0, 1, 2)
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "run")] == [0, 1]
