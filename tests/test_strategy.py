"""TrainingStrategy: exact resume, restore paths, fine-tuning, distributed (the hooks' own
behaviour is tested in test_hooks.py)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt.training import (
    EMAHook,
    FineTuningStrategy,
    OptimizerConfig,
    TrainingStrategy,
    create_model_spec,
    load_checkpoint,
    save_checkpoint,
)

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import training_support as support  # noqa: E402

TRUST = ["training_support.training_fn"]


def run_python(code: str, *args: str, timeout: int = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return support.without_gloo_banners(result.stdout)


# --------------------------------------------------------------------------- exact resume

RESUME_SECOND_HALF = """
import json, sys, torch, fastckpt, training_support as s
ema = fastckpt.EMAHook(model_key="main", decay=0.9)
recorder = s.LossRecorder()
strategy = fastckpt.TrainingStrategy.load_checkpoint(
    sys.argv[1], hooks=[ema, recorder], trusted=["training_support.training_fn"]
)
assert strategy.step_count == 10, strategy.counters
strategy.num_steps = 20
strategy.run(s.loader())
fastckpt.save_file(s.final_state(strategy, ema), sys.argv[2])
print(json.dumps(recorder.losses))
"""


def test_interrupted_equals_uninterrupted_in_a_fresh_process(tmp_path: Path) -> None:
    ema = EMAHook(model_key="main", decay=0.9)
    recorder = support.LossRecorder()
    straight = support.new_strategy([ema, recorder], num_steps=20)
    straight.run(support.loader())
    expected = support.final_state(straight, ema)

    ema_a = EMAHook(model_key="main", decay=0.9)
    recorder_a = support.LossRecorder()
    first = support.new_strategy([ema_a, recorder_a], num_steps=10)
    first.run(support.loader())
    first.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "second.safetensors"
    losses_b = json.loads(run_python(RESUME_SECOND_HALF, str(tmp_path / "ckpt"), str(out)))
    resumed = fastckpt.load_file(out)

    assert recorder_a.losses + losses_b == recorder.losses
    assert set(resumed) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(resumed[name], tensor), name


# --------------------------------------------------------------------------- restore paths


class _FailsOnce:
    """A hook raising once, at ``stage`` of step ``step`` (a NaN check, a watchdog...)."""

    def __init__(self, stage: fastckpt.TrainingStage, step: int) -> None:
        self.stage, self.step, self.fired = stage, step, False

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is self.stage and ctx.step_count == self.step and not self.fired:
            self.fired = True
            raise RuntimeError(f"hook failed at {stage.name}")


@pytest.mark.parametrize(
    "stage", [fastckpt.TrainingStage.AFTER_OPTIMIZER_STEP, fastckpt.TrainingStage.AFTER_BATCH]
)
def test_a_save_after_a_hook_raised_mid_step_resumes_after_that_batch(
    tmp_path: Path, stage: fastckpt.TrainingStage
) -> None:
    """Before, a hook raising at AFTER_OPTIMIZER_STEP left ``step_count`` one ahead of
    ``batch_count``/``epoch_step_count``: the emergency save of that state resumed by training
    the batch again, and the run ended with other weights than the uninterrupted one."""
    straight = support.new_strategy([], num_steps=12)
    straight.run(support.loader())
    failing = support.new_strategy([_FailsOnce(stage, 5)], num_steps=12)
    with pytest.raises(RuntimeError, match="hook failed"):
        failing.run(support.loader())
    counters = failing.counters
    assert counters["step_count"] == counters["batch_count"] == counters["epoch_step_count"] == 5
    failing.save_checkpoint(tmp_path)
    resumed = TrainingStrategy.load_checkpoint(tmp_path, hooks=[], trusted=TRUST)
    resumed.run(support.loader())
    assert resumed.counters == straight.counters
    theirs = straight.models["main"].state_dict()
    for name, tensor in resumed.models["main"].state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_restore_in_place_and_hook_state(tmp_path: Path) -> None:
    ema = EMAHook(model_key="main", decay=0.9)
    strategy = support.new_strategy([ema], num_steps=6)
    strategy.run(support.loader())
    strategy.save_checkpoint(tmp_path)

    restored_ema = EMAHook(model_key="main", decay=0.9)
    live = support.new_strategy([restored_ema], num_steps=6)
    assert live.restore_checkpoint(tmp_path) == 0
    assert live.counters == strategy.counters
    assert all(torch.equal(restored_ema.shadow[k], v) for k, v in ema.shadow.items())
    for (_, a), (_, b) in zip(
        live.models["main"].state_dict().items(),
        strategy.models["main"].state_dict().items(),
        strict=True,
    ):
        assert torch.equal(a, b)

    with pytest.raises(ValueError, match="decay"):
        support.new_strategy([EMAHook(decay=0.5)], num_steps=1).restore_checkpoint(tmp_path)
    with pytest.warns(UserWarning, match="EMAHook"):
        support.new_strategy([], num_steps=1).restore_checkpoint(tmp_path)


def test_restoring_into_other_optimizers_or_schedulers_is_refused_changing_nothing(
    tmp_path: Path,
) -> None:
    """``restore_checkpoint`` into a live strategy built otherwise: before, an
    ``ExponentialLR`` took the saved ``StepLR``'s gamma and step size, a strategy without the
    scheduler froze its learning rate, an SGD got Adam's groups (a bare ``KeyError`` at the
    next step), and an optimizer with other parameter groups failed only after the weights
    were overwritten. Now each is refused before anything live changes."""
    saved = support.new_strategy([], num_steps=6)
    saved.run(support.loader())
    saved.save_checkpoint(tmp_path)

    def live(config: Any) -> fastckpt.TrainingStrategy:
        torch.manual_seed(99)
        return fastckpt.TrainingStrategy(
            support.DropoutMLP(), config, training_fn=support.training_fn, num_steps=6
        )

    def exponential(gamma: float) -> Any:
        return fastckpt.OptimizerConfig(
            torch.optim.Adam, {"lr": 1e-2}, torch.optim.lr_scheduler.ExponentialLR, {"gamma": gamma}
        )

    cases = [
        (exponential(0.9), r"scheduler 'main' was saved as torch\.optim\.lr_scheduler\.StepLR"),
        (
            fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 1e-2}),
            r"schedulers \['main'\], this strategy has \[\]",
        ),
        (
            fastckpt.OptimizerConfig(
                torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9},
                torch.optim.lr_scheduler.StepLR, {"step_size": 5},
            ),
            r"optimizer 'main' was saved as torch\.optim\.adam\.Adam, .* torch\.optim\.sgd\.SGD",
        ),
    ]  # fmt: skip
    for config, message in cases:
        strategy = live(config)
        before = {k: v.clone() for k, v in strategy.models["main"].state_dict().items()}
        with pytest.raises(fastckpt.CheckpointMismatchError, match=message):
            strategy.restore_checkpoint(tmp_path)
        after = strategy.models["main"].state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        assert strategy.step_count == 0
    # Parameter groups that differ: refused before the weights are touched.
    torch.manual_seed(99)
    model = support.DropoutMLP()
    params = list(model.parameters())
    grouped = torch.optim.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}], lr=1e-2)
    strategy = fastckpt.TrainingStrategy(
        model, grouped, training_fn=support.training_fn, num_steps=6
    )
    strategy.schedulers["main"] = torch.optim.lr_scheduler.StepLR(grouped, step_size=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        fastckpt.CheckpointMismatchError,
        match=r"main\.json: .*group\(s\) of \[\d+\] parameters, this Adam 2 of \[1, \d+\]",
    ):
        strategy.restore_checkpoint(tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    # A class given as a dotted path of another spelling is the same class (review finding:
    # "torch.optim.Adam" against the recorded "torch.optim.adam.Adam" was refused).
    spelled = live(
        fastckpt.OptimizerConfig(
            "torch.optim.Adam", {"lr": 1e-2}, "torch.optim.lr_scheduler.StepLR", {"step_size": 5}
        )
    )
    assert spelled.restore_checkpoint(tmp_path) == 0
    spelled.save_checkpoint(tmp_path / "spelled")
    assert (
        live(
            fastckpt.OptimizerConfig(
                torch.optim.Adam, {"lr": 1e-2}, torch.optim.lr_scheduler.StepLR, {"step_size": 5}
            )
        ).restore_checkpoint(tmp_path / "spelled")
        == 0
    )
    # A recorded class whose module this process never imported is still another class
    # (review finding: it was taken as no mismatch, and the SGD failed at its next step).
    (tmp_path / "elsewhere_optim.py").write_text(
        "import torch\nclass MyAdam(torch.optim.Adam):\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import elsewhere_optim  # type: ignore[import-not-found]

        other = live(fastckpt.OptimizerConfig(elsewhere_optim.MyAdam, {"lr": 1e-2}))
        other.save_checkpoint(tmp_path / "elsewhere")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("elsewhere_optim", None)
    with pytest.raises(fastckpt.CheckpointMismatchError, match=r"elsewhere_optim\.MyAdam"):
        live(fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 1e-2})).restore_checkpoint(
            tmp_path / "elsewhere"
        )
    # The same kinds with other hyper-parameters restore, taking the saved ones (documented).
    strategy = live(
        fastckpt.OptimizerConfig(
            torch.optim.Adam, {"lr": 0.5}, torch.optim.lr_scheduler.StepLR, {"step_size": 2}
        )
    )
    assert strategy.restore_checkpoint(tmp_path) == 0
    assert strategy.schedulers["main"].step_size == 5
    assert (
        strategy.optimizers["main"].param_groups[0]["lr"]
        == saved.optimizers["main"].param_groups[0]["lr"]
    )


def test_training_fn_recorded_or_required(tmp_path: Path) -> None:
    support.new_strategy([], num_steps=1).save_checkpoint(tmp_path / "importable")
    # A plain function of an already-imported user module is restored without training_fn=.
    restored = TrainingStrategy.load_checkpoint(tmp_path / "importable")
    assert restored.training_fn is support.training_fn
    restored = TrainingStrategy.load_checkpoint(tmp_path / "importable", trusted=TRUST)
    assert restored.training_fn is support.training_fn

    def build_loss(scale: float) -> Any:
        def local_fn(model: nn.Module, batch: Any) -> torch.Tensor:
            return scale * support.training_fn(model, batch)

        return local_fn

    strategy = support.new_strategy([], num_steps=1)
    strategy.training_fn = build_loss(0.5)
    strategy.save_checkpoint(tmp_path / "closure")
    recipe = json.loads((tmp_path / "closure" / "0" / "strategy.json").read_text())
    assert recipe["training_fn"] == "must be supplied"
    with pytest.raises(ValueError, match="training_fn="):
        TrainingStrategy.load_checkpoint(tmp_path / "closure")
    explicit = build_loss(2.0)
    restored = TrainingStrategy.load_checkpoint(tmp_path / "closure", training_fn=explicit)
    assert restored.training_fn is explicit


def test_component_only_checkpoint_is_rejected_by_the_strategy(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, models={"main": (nn.Linear(2, 2), None)})
    with pytest.raises(ValueError, match=r"fastckpt\.load_checkpoint"):
        TrainingStrategy.load_checkpoint(tmp_path)


def test_module_level_load_returns_strategy_and_components(tmp_path: Path) -> None:
    strategy = support.new_strategy([], num_steps=3)
    strategy.run(support.loader())
    # Strategy as the second positional argument, as the seed allows.
    index = save_checkpoint(tmp_path, strategy)
    result = load_checkpoint(tmp_path, trusted=TRUST)
    assert result["checkpoint_index"] == index
    assert isinstance(result["strategy"], TrainingStrategy)
    assert result["strategy"].step_count == 3
    record = result["models"]["main"]
    assert set(record["optimizers"]) == {"main"} and set(record["schedulers"]) == {"main"}
    # training_fn is a plain function of an imported module: restored without trust.
    assert isinstance(load_checkpoint(tmp_path)["strategy"], TrainingStrategy)


def test_explicit_index_and_factory_with_device(tmp_path: Path) -> None:
    class_spec = create_model_spec(support.DropoutMLP, width=4, p=0.0)
    for width in (4, 4, 4, 4):
        model = class_spec.build()
        assert model.width == width
        strategy = TrainingStrategy(
            model, OptimizerConfig(torch.optim.SGD, {"lr": 0.1}), training_fn=support.training_fn
        )
        strategy.save_checkpoint(tmp_path)
    restored = TrainingStrategy.load_checkpoint(
        tmp_path, checkpoint_index=3, map_location="cpu", trusted=TRUST
    )
    assert restored.models["main"].width == 4


def test_fine_tuning_takes_weights_only(tmp_path: Path) -> None:
    strategy = support.new_strategy([EMAHook()], num_steps=5)
    strategy.run(support.loader())
    strategy.save_checkpoint(tmp_path)
    tuned = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path, use_original_opt_class=True, optimizer_lr=1e-3, training_fn=support.training_fn
    )
    assert tuned.step_count == 0 and tuned.hooks == [] and tuned.num_steps is None
    optimizer = tuned.optimizers["main"]
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["lr"] == 1e-3 and optimizer.state_dict()["state"] == {}
    for a, b in zip(
        tuned.models["main"].parameters(), strategy.models["main"].parameters(), strict=True
    ):
        assert torch.equal(a, b)
    default = FineTuningStrategy.from_pretrained_checkpoint(tmp_path, optimizer_lr=2e-5)
    assert isinstance(default.optimizers["main"], torch.optim.AdamW)
    assert default.training_fn is None
    untrusted = FineTuningStrategy.from_pretrained_checkpoint(tmp_path, use_original_loss=True)
    assert untrusted.training_fn is support.training_fn  # an imported user function
    original = FineTuningStrategy.from_pretrained_checkpoint(
        tmp_path, use_original_loss=True, trusted=TRUST
    )
    assert original.training_fn is support.training_fn


def test_live_optimizer_is_accepted(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    strategy = TrainingStrategy(model, optimizer, training_fn=support.training_fn, num_steps=2)
    strategy.run(support.loader())
    assert strategy.optimizers["main"] is optimizer
    assert strategy.optimizer_configs["main"].optimizer_kwargs["momentum"] == 0.9


# --------------------------------------------------------------------------- distributed

DDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
torch.manual_seed(0)
model = DDP(s.DropoutMLP(p=0.0))
hook = fastckpt.CheckpointHook(sys.argv[1], step_interval=4)
strategy = fastckpt.TrainingStrategy(
    model, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, hooks=[hook], num_steps=4,
)
strategy.run(s.loader(seed=rank))
dist.barrier()
restored = fastckpt.TrainingStrategy.load_checkpoint(
    sys.argv[1], map_location="cpu", trusted=["training_support.training_fn"]
)
restored.models["main"] = DDP(restored.models["main"])
restored.num_steps = 6
restored.run(s.loader(seed=rank))
weights = torch.cat([p.detach().flatten() for p in restored.models["main"].parameters()])
gathered = [torch.empty_like(weights) for _ in range(2)]
dist.all_gather(gathered, weights)
assert torch.equal(gathered[0], gathered[1]), "ranks diverged after resuming"
print("ok", rank, hook.last_checkpoint_index)
s.leave_process_group()
"""


def test_ddp_two_ranks_rank_zero_writes_both_resume(tmp_path: Path) -> None:
    outputs = support.run_two_ranks(DDP_SCRIPT, tmp_path / "ckpt", tmp_path / "pg")
    assert outputs[0].split() == ["ok", "0", "0"]
    assert outputs[1].split() == ["ok", "1", "None"]  # rank 1 never wrote
    keys = fastckpt.read_metadata(tmp_path / "ckpt" / "0" / "models" / "main.safetensors")
    assert not any(k.startswith("module.") for k in keys["tensors"])
    # The resumed run (no hooks= given) rebuilt the recorded hook: its end of run saved too.
    rows = fastckpt.list_checkpoints(tmp_path / "ckpt")
    assert [(c["index"], c["counters"]["step_count"]) for c in rows] == [(0, 4), (1, 6)]


DDP_SEEDED_APART_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)

def strategy(steps, hooks):
    torch.manual_seed(0)
    model = DDP(s.DropoutMLP(p=0.5))
    torch.manual_seed(100 + rank)  # seeded apart: each rank its own dropout and shuffles
    return fastckpt.TrainingStrategy(
        model, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        training_fn=s.training_fn, hooks=hooks, num_steps=steps,
    )

straight = s.LossRecorder()
strategy(6, [straight]).run(s.loader())
first = s.LossRecorder()
savers = [  # two savers at one stage, from the first step (a prewarm snapshot precedes it)
    fastckpt.CheckpointHook(root + suffix, step_interval=1, async_save=sys.argv[4] == "async")
    for suffix in ("", "-b")
]
strategy(3, [*savers, first]).run(s.loader())
dist.barrier()
resumed = {}
for suffix in ("", "-b"):
    torch.manual_seed(5)  # scrambled: the resume must restore each rank's own streams
    recorder = s.LossRecorder()
    restored = fastckpt.TrainingStrategy.load_checkpoint(
        root + suffix, 0, hooks=[recorder], trusted=["training_support.training_fn"]
    )
    restored.models["main"] = DDP(restored.models["main"])
    restored.num_steps = 6
    restored.run(s.loader())
    resumed[suffix] = recorder.losses
print(json.dumps({"straight": straight.losses, "first": first.losses, "resumed": resumed}))
s.leave_process_group()
"""


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_ddp_ranks_seeded_apart_resume_their_own_random_streams(tmp_path: Path, mode: str) -> None:
    """A DDP run whose ranks draw apart (seeded apart here; on GPUs each rank advances its own
    device's generator): rank 0's checkpoints hold every rank's RNG states, gathered at each
    save (the first save, after the hook's prewarm snapshot, and a second hook's save at the
    same stage too), and each rank resumes its own. Before, the checkpoint held rank 0's
    only: rank 1 resumed with rank 0's dropout and shuffle streams, and the averaged
    gradients, so both ranks' losses, left the uninterrupted run's without a word."""
    script = DDP_SEEDED_APART_SCRIPT.replace("sys.argv[4]", repr(mode))
    outputs = support.run_two_ranks(script, tmp_path / "ckpt", tmp_path / "pg")
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert reports[0]["straight"] != reports[1]["straight"]  # the ranks do draw apart
    for rank, report in enumerate(reports):
        for where, losses in report["resumed"].items():  # from step 1, each root
            assert report["first"][:1] + losses == report["straight"], (rank, where)


DDP_HOOK_ON_RANK_ZERO_SCRIPT = """
import sys, warnings, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
torch.manual_seed(0)
hooks = [fastckpt.CheckpointHook(root, step_interval=2)] if rank == 0 else []
strategy = fastckpt.TrainingStrategy(
    DDP(s.DropoutMLP()), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, hooks=hooks, num_steps=4,
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    strategy.run(s.loader(seed=rank))
print(sum("do not all have the same checkpoint hooks" in str(w.message) for w in caught))
s.leave_process_group()
"""


def test_ddp_hook_on_rank_zero_only_saves_and_warns(tmp_path: Path) -> None:
    """A CheckpointHook given to rank 0 alone (the other ranks have none) must not wait for
    the other ranks' RNG states at each save, which they never send: the ranks find out at
    the start of the run, rank 0 warns that its checkpoints hold its own states only, and the
    saves happen."""
    outputs = support.run_two_ranks(DDP_HOOK_ON_RANK_ZERO_SCRIPT, tmp_path / "c", tmp_path / "pg")
    assert [out.strip() for out in outputs] == ["1", "0"]
    rows = fastckpt.list_checkpoints(tmp_path / "c")
    assert [c["counters"]["step_count"] for c in rows] == [2, 4]


def test_unmatched_hooks_warn_not_silently(tmp_path: Path) -> None:
    support.new_strategy([EMAHook(), EMAHook(decay=0.5)], num_steps=1).save_checkpoint(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        support.new_strategy([EMAHook()], num_steps=1).restore_checkpoint(tmp_path)
    assert any("occurrence 1" in str(w.message) for w in caught)


FSDP_SCRIPT = """
import sys, tempfile, torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
import fastckpt, training_support as s
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
fsdp1 = FullyShardedDataParallel(s.DropoutMLP(), device_id=torch.device("cpu"))
try:
    fastckpt.TrainingStrategy(
        fsdp1, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}), training_fn=s.training_fn
    )
except ValueError as err:
    assert "fully_shard" in str(err), err
    print("refused")
fsdp2 = s.DropoutMLP()
fully_shard(fsdp2)
strategy = fastckpt.TrainingStrategy(
    fsdp2, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}), training_fn=s.training_fn
)
print("saved", strategy.save_checkpoint(sys.argv[1]))
s.leave_process_group()
"""


def test_fsdp1_is_refused_at_construction_and_fsdp2_saves(tmp_path: Path) -> None:
    out = run_python(FSDP_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "pg"))
    assert out.split() == ["refused", "saved", "0"]
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "ckpt")] == [0]
    # verify covers the index's sharded part; export consolidates the model from it.
    report = fastckpt.verify(tmp_path / "ckpt")
    assert report.ok
    assert any("sharded" in f.path.parts and f.path.name.startswith("rank-") for f in report.files)
    exported = tmp_path / "main.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "fastckpt", "export", str(tmp_path / "ckpt"), "--to", str(exported)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert set(fastckpt.load_file(exported)) == set(support.DropoutMLP().state_dict())


def test_a_resumed_run_keeps_no_checkpoint_file_mapped(tmp_path: Path) -> None:
    # Loads map files; what a run keeps (optimizer moments, EMA weights, RNG state) must be
    # copied out, or a pruned checkpoint's disk space stays held until the process exits.
    trained = support.new_strategy([EMAHook()], num_steps=3)
    trained.run(support.loader())
    trained.save_checkpoint(tmp_path)
    live = support.new_strategy([EMAHook()], num_steps=1)
    assert live.restore_checkpoint(tmp_path) == 0
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(tmp_path) not in maps, [line for line in maps.splitlines() if str(tmp_path) in line]
    assert live.optimizers["main"].state_dict()["state"], "optimizer state was not restored"


def test_frozen_parameters_stay_frozen_in_a_resumed_run(tmp_path: Path) -> None:
    """Parameters frozen after construction (``requires_grad_(False)``, a fine-tuning recipe)
    are frozen in the rebuilt model too, so the resumed run trains what the saved one did.
    Before, every rebuilt parameter required grad: the frozen layer trained on, and the run
    diverged at its first resumed step."""

    def fresh(hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
        torch.manual_seed(0)
        model = support.DropoutMLP()
        model.net[0].requires_grad_(False)
        return fastckpt.TrainingStrategy(
            model,
            fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
            training_fn=support.training_fn,
            hooks=hooks,
            num_steps=steps,
        )

    straight = fresh([], 10)
    straight.run(support.loader())
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=5, async_save=False)
    fresh([hook], 5).run(support.loader())
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", training_fn=support.training_fn
    )
    frozen = {n for n, p in resumed.models["main"].named_parameters() if not p.requires_grad}
    assert frozen == {"net.0.weight", "net.0.bias"}
    resumed.num_steps = 10
    resumed.run(support.loader())
    for name, tensor in straight.models["main"].state_dict().items():
        assert torch.equal(resumed.models["main"].state_dict()[name], tensor), name


def test_a_restore_into_a_live_strategy_freezes_what_the_saved_run_froze_mid_run(
    tmp_path: Path,
) -> None:
    """A hook froze the first layer after step 3; a run saved at step 6 and restored with
    ``restore_checkpoint`` into a strategy built as the saved one was (all trainable) trained
    that layer on (before: no word, diverged from step 7). Now the recorded frozen
    parameters are frozen again and the run continues bitwise; a parameter frozen live but
    trained by the saved run stays frozen, with a warning."""

    def freeze_at_3(ctx: Any, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == 3:
            ctx.models["main"].net[0].requires_grad_(False)

    def fresh(hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
        torch.manual_seed(0)
        return fastckpt.TrainingStrategy(
            support.DropoutMLP(),
            fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 0.01}),
            training_fn=support.training_fn,
            hooks=[freeze_at_3, *hooks],
            num_steps=steps,
        )

    straight = fresh([], 10)
    straight.run(support.loader())
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=6, async_save=False)
    fresh([hook], 6).run(support.loader())
    live = fresh([], 10)
    live.restore_checkpoint(tmp_path / "run")
    frozen = {n for n, p in live.models["main"].named_parameters() if not p.requires_grad}
    assert frozen == {"net.0.weight", "net.0.bias"}
    live.run(support.loader())
    for name, tensor in straight.models["main"].state_dict().items():
        assert torch.equal(live.models["main"].state_dict()[name], tensor), name
    other = fresh([], 10)
    other.models["main"].net[3].requires_grad_(False)
    with pytest.warns(UserWarning, match=r"net\.3\.bias.*frozen here but not recorded"):
        other.restore_checkpoint(tmp_path / "run")
    assert not other.models["main"].net[3].weight.requires_grad


def test_a_compiled_model_is_saved_as_its_module_and_resumes_exactly(tmp_path: Path) -> None:
    """``torch.compile(model)`` (its wrapper, ``OptimizedModule``) was refused as a recipe
    that cannot be recorded, and ``attach_spec`` with the right recipe then failed naming the
    wrapper's ``_orig_mod.`` keys as other tensors. Its module is saved now (as DDP's is),
    rebuilt uncompiled; restored into a compiled model, or resumed, the run goes on exactly."""

    def fresh(hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
        torch.manual_seed(0)
        return fastckpt.TrainingStrategy(
            torch.compile(support.DropoutMLP(), backend="eager"),
            fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 0.01}),
            training_fn=support.training_fn,
            hooks=hooks,
            num_steps=steps,
        )

    straight = fresh([], 10)
    straight.run(support.loader())
    expected = codec_module(straight).state_dict()
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=6, async_save=False)
    fresh([hook], 6).run(support.loader())
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", training_fn=support.training_fn
    )
    assert type(resumed.models["main"]) is support.DropoutMLP  # rebuilt uncompiled
    resumed.num_steps = 10
    resumed.run(support.loader())
    live = fresh([], 10)
    live.restore_checkpoint(tmp_path / "run")
    live.run(support.loader())
    for strategy in (resumed, live):
        got = codec_module(strategy).state_dict()
        assert list(got) == list(expected)  # no _orig_mod. prefix
        assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


def codec_module(strategy: fastckpt.TrainingStrategy) -> torch.nn.Module:
    """The strategy's model, unwrapped from torch.compile's wrapper."""
    model = strategy.models["main"]
    return getattr(model, "_orig_mod", model)


def test_frozen_parameters_stay_frozen_in_a_component_checkpoint(tmp_path: Path) -> None:
    """``save_checkpoint`` records frozen parameters in the manifest entry and
    ``load_checkpoint`` freezes them again in the rebuilt model (before, every rebuilt
    parameter required grad: a fine-tuning run resumed this way trained its backbone)."""
    model = support.DropoutMLP()
    model.net[0].requires_grad_(False)
    fastckpt.save_checkpoint(tmp_path, models={"main": model})
    loaded = fastckpt.load_checkpoint(tmp_path)["models"]["main"]["model"]
    assert {n for n, p in loaded.named_parameters() if not p.requires_grad} == {
        "net.0.weight",
        "net.0.bias",
    }


def _lr_factor(epoch: int) -> float:
    """A LambdaLR lr_lambda: a function, which a recipe cannot record."""
    return 0.5**epoch


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_recipe_that_cannot_be_recorded_is_refused_before_the_first_step(
    tmp_path: Path, async_save: bool
) -> None:
    """A scheduler argument a checkpoint cannot record (LambdaLR's function) stops the run
    before any step, naming the optimizer and the argument, sync and async alike. Before, a
    sync hook raised it at its first save, after ``step_interval`` steps of work."""
    steps: list[int] = []

    def count(ctx: Any, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_OPTIMIZER_STEP:
            steps.append(ctx.step_count)

    config = OptimizerConfig(
        torch.optim.SGD, {"lr": 0.1}, torch.optim.lr_scheduler.LambdaLR, {"lr_lambda": _lr_factor}
    )
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=5, async_save=async_save)
    strategy = TrainingStrategy(
        support.DropoutMLP(), config, training_fn=support.training_fn, hooks=[count, hook]
    )
    strategy.num_steps = 8
    with pytest.raises(TypeError, match=r"optimizers\['main'\].*lr_lambda"):
        strategy.run(support.loader())
    assert steps == [] and not (tmp_path / "run" / "manifest.json").exists()


def test_a_scheduler_that_needs_a_metric_is_refused_when_built() -> None:
    """The strategy steps schedulers without an argument: ReduceLROnPlateau is refused at
    construction with the way out. Before, the run died at its first step with torch's bare
    ``TypeError: step() missing 1 required positional argument: 'metrics'``."""
    config = OptimizerConfig(
        torch.optim.SGD, {"lr": 0.1}, torch.optim.lr_scheduler.ReduceLROnPlateau, {"patience": 1}
    )
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau\.step\(\) needs metrics.*hook"):
        TrainingStrategy(support.DropoutMLP(), config, training_fn=support.training_fn)


@pytest.mark.parametrize(
    "attach",
    [
        lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5]),
        lambda opt: torch.optim.lr_scheduler.SequentialLR(
            opt,
            [
                torch.optim.lr_scheduler.LinearLR(opt, total_iters=2),
                torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
            ],
            milestones=[2],
        ),
    ],
    ids=["MultiStepLR", "SequentialLR"],
)
def test_a_scheduler_attached_by_hand_that_cannot_be_recorded_stops_before_training(
    tmp_path: Path, attach: Any
) -> None:
    # Before: check_recordable looked at OptimizerConfigs only; a sync hook trained 4 steps
    # and failed at its first save ("kwargs['milestones']: cannot store a value of type
    # Counter", naming no component).
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=4, async_save=False)
    strategy = fastckpt.TrainingStrategy(
        model, optimizer, training_fn=lambda m, b: m(b).sum(), hooks=[hook], num_steps=8
    )
    strategy.schedulers["main"] = attach(optimizer)
    with pytest.raises(TypeError, match=r"schedulers\['main'\] .*OptimizerConfig\(scheduler_cls"):
        strategy.run([torch.ones(1, 2)] * 8)
    assert strategy.step_count == 0
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_a_recordable_scheduler_attached_by_hand_passes_the_check(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = fastckpt.TrainingStrategy(
        model, optimizer, training_fn=lambda m, b: m(b).sum(), num_steps=2
    )
    strategy.schedulers["main"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    strategy.check_recordable()
    strategy.run([torch.ones(1, 2)] * 2)
    assert strategy.save_checkpoint(tmp_path / "run") == 0


def test_schedulers_put_in_by_hand_that_cannot_be_stepped_or_recorded_are_refused_first(
    tmp_path: Path,
) -> None:
    """Before: a ReduceLROnPlateau put into ``strategy.schedulers`` by hand passed
    ``check_recordable`` and ``run`` died in torch's ``step()`` after the optimizer had
    stepped (weights changed, step_count 0); a ChainedScheduler was recorded as
    ``ChainedScheduler(optimizer)`` and every checkpoint of the run failed to load."""
    from torch.optim import lr_scheduler as schedulers

    x = torch.randn(32, 4)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )

    def strategy(hooks: list[Any]) -> fastckpt.TrainingStrategy:
        return fastckpt.TrainingStrategy(
            torch.nn.Linear(4, 1),
            fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
            training_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
            hooks=hooks,
            num_steps=4,
        )

    plateau = strategy([])
    plateau.schedulers["main"] = schedulers.ReduceLROnPlateau(plateau.optimizers["main"])
    before = plateau.models["main"].weight.clone()
    for attempt in (plateau.check_recordable, lambda: plateau.run(loader)):
        with pytest.raises(TypeError, match=r"ReduceLROnPlateau\.step\(\) needs metrics"):
            attempt()
    assert torch.equal(before, plateau.models["main"].weight) and plateau.step_count == 0

    root = tmp_path / "chained"
    chained = strategy([fastckpt.CheckpointHook(root, step_interval=2, async_save=False)])
    opt = chained.optimizers["main"]
    chained.schedulers["main"] = schedulers.ChainedScheduler(
        [schedulers.LinearLR(opt, 0.1, total_iters=4), schedulers.ExponentialLR(opt, 0.9)]
    )
    with pytest.raises(TypeError, match=r"ChainedScheduler.*takes 'schedulers' first"):
        chained.run(loader)
    assert not fastckpt.list_checkpoints(root)
