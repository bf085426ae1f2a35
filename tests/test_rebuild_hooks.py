"""A model rebuilt from its checkpoint keeps what its constructor attached to its parameters
and buffers: gradient hooks (``register_hook``, ``register_post_accumulate_grad_hook``),
Python attributes, a ``Parameter`` subclass, a buffer's ``requires_grad``.

Before, ``load_checkpoint`` (and ``TrainingStrategy.load_checkpoint``) gave such a model
uninitialized memory from its meta-device build (``to_empty``), which replaces every
parameter and buffer with a bare new tensor: the hooks, attributes and subclass stayed on the
discarded meta tensors, and a resumed run trained without its gradient clipping, diverging
from the uninterrupted run without a word. Such a model is now built for real. Hooks on
modules (forward hooks) and parametrizations live on the modules, which ``to_empty`` keeps:
those models keep the fast path and resume exactly too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
from fastckpt.checkpoint.fill import fully_restored_by


def clip(grad: torch.Tensor) -> torch.Tensor:
    """Gradient value clipping, as a tensor hook."""
    return grad.clamp(-0.01, 0.01)


def halve(param: torch.Tensor) -> None:
    """Halves an accumulated gradient in place, as a post-accumulate-grad hook."""
    assert param.grad is not None
    param.grad.mul_(0.5)


class ClippedGrads(nn.Module):
    """Clips its gradients' values with ``register_hook`` on each parameter (the usual
    place to clip inside a training strategy)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        for param in self.parameters():
            param.register_hook(clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class HalvedGrads(nn.Module):
    """Halves each accumulated gradient with ``register_post_accumulate_grad_hook``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        for param in self.parameters():
            param.register_post_accumulate_grad_hook(halve)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Symmetric(nn.Module):
    """A parametrization: the weight is the symmetric matrix of its upper triangle."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).t()


class ModuleHooks(nn.Module):
    """A forward pre-hook scaling the input and a parametrized weight: both live on modules."""

    def __init__(self) -> None:
        super().__init__()
        self.square = nn.Linear(4, 4)
        parametrize.register_parametrization(self.square, "weight", Symmetric())
        self.lin = nn.Linear(4, 1)
        self.lin.register_forward_pre_hook(self._scale)

    @staticmethod
    def _scale(module: nn.Module, args: tuple[Any, ...]) -> tuple[torch.Tensor]:
        return (args[0] * 0.25,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.square(x))


def loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Squared distance of the output from 10 (large gradients, so clipping matters)."""
    return ((model(batch[0]) - 10.0) ** 2).mean()


def loader() -> DataLoader[Any]:
    """8 batches of 8 samples."""
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=8)


def strategy(cls: type[nn.Module], steps: int) -> fastckpt.TrainingStrategy:
    torch.manual_seed(0)
    return fastckpt.TrainingStrategy(
        cls(),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=loss,
        num_steps=steps,
    )


def hook_counts(model: nn.Module) -> list[tuple[int, int]]:
    """For each parameter, how many tensor hooks and post-accumulate-grad hooks it has."""
    return [
        (len(p._backward_hooks or {}), len(p._post_accumulate_grad_hooks or {}))
        for p in model.parameters()
    ]


@pytest.mark.parametrize("cls", [ClippedGrads, HalvedGrads, ModuleHooks])
def test_a_resumed_run_keeps_the_hooks_its_model_registers_and_trains_exactly(
    tmp_path: Path, cls: type[nn.Module]
) -> None:
    """Train 4 steps, save, resume with ``TrainingStrategy.load_checkpoint`` and train to 8:
    the weights equal the uninterrupted run's bitwise, and the rebuilt parameters carry the
    hooks the constructor registered. Before, ``ClippedGrads`` and ``HalvedGrads`` came back
    with no hooks (``[(0, 0), (0, 0)]``) and the resumed run diverged; ``ModuleHooks`` (hooks
    and parametrizations on modules) already resumed exactly and keeps the fast path."""
    straight = strategy(cls, 8)
    straight.run(loader())
    first = strategy(cls, 4)
    first.run(loader())
    first.save_checkpoint(tmp_path / "run")
    expected_hooks = hook_counts(first.models["main"])

    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "run", hooks=[], training_fn=loss
    )
    assert hook_counts(resumed.models["main"]) == expected_hooks
    resumed.num_steps = 8
    resumed.run(loader())
    expected = straight.models["main"].state_dict()
    got = resumed.models["main"].state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    model = cls()
    assert fully_restored_by(model, model.state_dict()) is (cls is ModuleHooks)


class MarkedParam(nn.Parameter):
    """A parameter subclass (a library's marker type)."""


class Tagged(nn.Module):
    """A parameter with a Python attribute (``no_decay``, read when param groups are made)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.lin.bias.no_decay = True  # type: ignore[attr-defined]


class Subclassed(nn.Module):
    """A parameter of a ``Parameter`` subclass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.scale = MarkedParam(torch.ones(1))


class GradBuffer(nn.Module):
    """A buffer that requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("shift", torch.zeros(1, requires_grad=True))


@pytest.mark.parametrize("cls", [ClippedGrads, HalvedGrads, Tagged, Subclassed, GradBuffer])
def test_load_checkpoint_rebuilds_what_the_constructor_attached_to_its_tensors(
    tmp_path: Path, cls: type[nn.Module]
) -> None:
    """``fastckpt.load_checkpoint`` of each model returns its saved values in tensors like
    the constructor's: same types, attributes, hooks and ``requires_grad``. Before, all of
    them were dropped (a plain ``Parameter`` with no attribute and no hook, a buffer not
    requiring grad)."""
    torch.manual_seed(0)
    model = cls()
    assert not fully_restored_by(model, model.state_dict())
    fastckpt.save_checkpoint(tmp_path / "ckpt", models={"main": (model, None)})
    loaded = fastckpt.load_checkpoint(tmp_path / "ckpt")["models"]["main"]["model"]
    assert isinstance(loaded, cls)
    live = dict([*model.named_parameters(), *model.named_buffers()])
    rebuilt = dict([*loaded.named_parameters(), *loaded.named_buffers()])
    assert set(rebuilt) == set(live)
    for name, tensor in live.items():
        again = rebuilt[name]
        assert torch.equal(again, tensor), name
        assert type(again) is type(tensor), name
        assert vars(again) == vars(tensor), name
        assert again.requires_grad == tensor.requires_grad, name
        assert len(again._backward_hooks or {}) == len(tensor._backward_hooks or {}), name
        assert len(again._post_accumulate_grad_hooks or {}) == len(
            tensor._post_accumulate_grad_hooks or {}
        ), name
