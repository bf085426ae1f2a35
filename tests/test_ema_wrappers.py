"""``EMAHook`` over wrapped models: a DDP or ``torch.compile`` model's averaged weights are
keyed by the unwrapped module's names, as fastckpt saves and rebuilds the model itself, so a
run resumes with its EMA whichever side is wrapped; a shadow that does not fit the model is a
typed error before training moves anything.

Before, the shadow carried the wrapper's ``module.`` / ``_orig_mod.`` prefixes: a resumed run
accepted it, then died at the first ``AFTER_OPTIMIZER_STEP`` (after the optimizer had moved
the weights) with a bare ``KeyError``, and ``copy_to`` raised ``KeyError`` too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt import CheckpointMismatchError, EMAHook

DDP_SAVE_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
torch.manual_seed(0)
ema = fastckpt.EMAHook(decay=0.9)
model = DDP(s.DropoutMLP(p=0.0))
hook = fastckpt.CheckpointHook(sys.argv[1], step_interval=2, async_save=False)
strategy = fastckpt.TrainingStrategy(
    model, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, hooks=[ema, hook], num_steps=2,
)
strategy.run(s.loader())
ema.copy_to(model)  # the wrapped model takes the averaged weights too
assert all(torch.equal(p, ema.shadow[n]) for n, p in model.module.named_parameters())
print(" ".join(sorted(ema.shadow)))
s.leave_process_group()
"""


def _names(model: torch.nn.Module) -> list[str]:
    return sorted(name for name, _ in model.named_parameters())


def _strategy(model: torch.nn.Module, hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
    return fastckpt.TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 0.01}),
        training_fn=support.training_fn,
        hooks=hooks,
        num_steps=steps,
    )


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    compiled = torch.compile(model, backend="eager")
    assert isinstance(compiled, torch.nn.Module)
    return compiled


def _straight_ema(steps: int) -> dict[str, torch.Tensor]:
    """The averaged weights of an uninterrupted, unwrapped run of ``steps`` steps."""
    torch.manual_seed(0)
    ema = EMAHook(decay=0.9)
    _strategy(support.DropoutMLP(), [ema], steps).run(support.loader())
    return ema.shadow


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


def test_a_ddp_run_resumes_with_its_ema_in_a_plain_process(tmp_path: Path) -> None:
    """A real 1-rank gloo DDP run saves; a plain process resumes it (DDP is saved unwrapped).
    Before: shadow keys ``module.net.0.weight``...; the resumed run raised ``KeyError:
    'net.0.weight'`` at its first step (step_count already moved) and ``copy_to`` too."""
    root = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", DDP_SAVE_SCRIPT, str(root), str(tmp_path / "pg")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)},
    )
    assert done.returncode == 0, done.stderr
    plain_names = _names(support.DropoutMLP())
    assert support.without_gloo_banners(done.stdout).split() == plain_names
    resumed = fastckpt.TrainingStrategy.load_checkpoint(root, training_fn=support.training_fn)
    ema = next(hook for hook in resumed.hooks if isinstance(hook, EMAHook))
    assert sorted(ema.shadow) == plain_names and ema.num_updates == 2
    resumed.num_steps = 4
    resumed.run(support.loader())
    assert ema.num_updates == 4 and sorted(ema.shadow) == plain_names
    target = support.DropoutMLP()
    ema.copy_to(target)
    assert all(torch.equal(p, ema.shadow[n]) for n, p in target.named_parameters())


def test_a_compiled_run_resumes_uncompiled_with_exactly_its_ema(tmp_path: Path) -> None:
    """Saved from ``torch.compile(model)``, resumed (rebuilt uncompiled): the EMA goes on as
    an unwrapped run's. Before: ``_orig_mod.``-keyed shadow, ``KeyError`` at the first step."""
    expected = _straight_ema(6)
    torch.manual_seed(0)
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=3, async_save=False)
    ema = EMAHook(decay=0.9)
    _strategy(_compiled(support.DropoutMLP()), [ema, hook], 3).run(support.loader())
    assert sorted(ema.shadow) == _names(support.DropoutMLP())
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", training_fn=support.training_fn
    )
    assert type(resumed.models["main"]) is support.DropoutMLP
    resumed.num_steps = 6
    resumed.run(support.loader())
    rebuilt = next(hook for hook in resumed.hooks if isinstance(hook, EMAHook))
    _assert_same(rebuilt.shadow, expected)


def test_an_uncompiled_checkpoint_restores_into_a_compiled_model_exactly(tmp_path: Path) -> None:
    """The reverse: saved unwrapped, restored into a live compiled strategy (as its weights
    are). Before: ``KeyError: '_orig_mod.net.0.weight'`` at the first step."""
    expected = _straight_ema(6)
    torch.manual_seed(0)
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=3, async_save=False)
    _strategy(support.DropoutMLP(), [EMAHook(decay=0.9), hook], 3).run(support.loader())
    ema = EMAHook(decay=0.9)
    compiled = _compiled(support.DropoutMLP())
    live = _strategy(compiled, [ema], 6)
    assert live.restore_checkpoint(tmp_path / "run") == 0
    live.run(support.loader())
    _assert_same(ema.shadow, expected)
    ema.copy_to(compiled)  # through the wrapper
    _assert_same(
        dict(compiled.named_parameters()), {f"_orig_mod.{k}": v for k, v in expected.items()}
    )


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_a_shadow_saved_with_wrapper_prefixes_before_the_fix_still_loads(
    tmp_path: Path, prefix: str
) -> None:
    """Checkpoints written before the fix hold the wrapper's prefixes: they are mapped to the
    unwrapped names the model has (before, a plain or compiled model raised ``KeyError``)."""
    expected = _straight_ema(6)
    torch.manual_seed(0)
    saved = EMAHook(decay=0.9)
    hook = fastckpt.CheckpointHook(tmp_path / "run", step_interval=3, async_save=False)
    _strategy(support.DropoutMLP(), [saved, hook], 3).run(support.loader())
    old = saved.state_dict()
    old["shadow"] = {prefix + name: tensor for name, tensor in old["shadow"].items()}
    ema = EMAHook(decay=0.9)
    ema.load_state_dict(old)
    plain = support.DropoutMLP()
    ema.copy_to(plain)
    _assert_same(dict(plain.named_parameters()), saved.shadow)
    live = _strategy(_compiled(support.DropoutMLP()), [EMAHook(decay=0.9)], 6)
    live.restore_checkpoint(tmp_path / "run")
    live.hooks[0].load_state_dict(old)  # as an earlier fastckpt's checkpoint would give it
    live.run(support.loader())
    _assert_same(live.hooks[0].shadow, expected)


def _misfit_checkpoint(root: Path, damage: str) -> None:
    """A checkpoint whose EMA state does not fit its model (as a hand-edited or foreign
    hooks file would hold): a key dropped and one added, or a tensor of another shape."""
    torch.manual_seed(0)
    ema = EMAHook(decay=0.9)
    strategy = _strategy(support.DropoutMLP(), [ema], 2)
    strategy.run(support.loader())
    if damage == "keys":
        ema.shadow["net.9.weight"] = ema.shadow.pop("net.3.bias")
    else:
        ema.shadow["net.3.bias"] = torch.zeros(2)
    strategy.save_checkpoint(root)


MISFIT = {
    "keys": (
        r"EMAHook\(model_key='main'\).*missing \['net\.3\.bias'\]"
        r".*unexpected \['net\.9\.weight'\]"
    ),
    "shape": r"EMAHook\(model_key='main'\).*net\.3\.bias.*\[2\].*\[1\]",
}


@pytest.mark.parametrize("damage", sorted(MISFIT))
def test_a_shadow_that_does_not_fit_the_model_is_refused_before_training_moves(
    tmp_path: Path, damage: str
) -> None:
    """Before: accepted at load; the first step moved the weights and counters, then a bare
    ``KeyError`` (a shape mismatch broadcast or raised a bare ``RuntimeError``)."""
    _misfit_checkpoint(tmp_path / "run", damage)
    # A hook that knows its model (it has run) refuses the state at load, changing nothing.
    torch.manual_seed(0)
    ema = EMAHook(decay=0.9)
    live = _strategy(support.DropoutMLP(), [ema], 2)
    live.run(support.loader())
    before = {name: tensor.clone() for name, tensor in ema.shadow.items()}
    weights = {k: v.clone() for k, v in live.models["main"].state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=MISFIT[damage]):
        live.restore_checkpoint(tmp_path / "run")
    _assert_same(ema.shadow, before)
    _assert_same(live.models["main"].state_dict(), weights)
    assert live.step_count == 2
    # A rebuilt strategy's hook meets its model when the run starts: refused there, before
    # the first optimizer step.
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", training_fn=support.training_fn, hooks=[EMAHook(decay=0.9)]
    )
    weights = {k: v.clone() for k, v in resumed.models["main"].state_dict().items()}
    resumed.num_steps = 4
    with pytest.raises(CheckpointMismatchError, match=MISFIT[damage] + r".*fix"):
        resumed.run(support.loader())
    assert resumed.step_count == 2
    _assert_same(resumed.models["main"].state_dict(), weights)
    # copy_to and update say the same instead of KeyError.
    for method in (resumed.hooks[0].copy_to, resumed.hooks[0].update):
        with pytest.raises(CheckpointMismatchError, match=MISFIT[damage]):
            method(support.DropoutMLP())
