"""A load returns the saved state in the saved dtypes, and checkpoint indices are ints.

1. A model rebuilt from its spec is built by its constructor in the default dtype; a model
   converted after construction (``.to(torch.bfloat16)``, some layers only) must still load
   with every parameter and buffer in its saved dtype and bits, parameters kept as
   ``Parameter`` objects (tied ones tied), optimizers over those parameters with their state
   in its saved dtypes, on every load path (read directly, through ``load_state_dict``,
   through references to an earlier index, a strategy resumed whole).
2. ``checkpoint_index`` / ``index`` must be an ``int`` (or None): ``True``, ``2.0`` and
   ``"1"`` are ``TypeError`` naming the argument; a string ``model_names`` is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import fastckpt
import training_support
from fastckpt.checkpoint.api import load_checkpoint, save_checkpoint
from fastckpt.container.verify import verify

# --------------------------------------------------------------------------- models


class Mixed(nn.Module):
    """Built all float32; converted after construction to mixed dtypes by :func:`_mixed`."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 2, bias=False)
        self.register_buffer("seen", torch.zeros(3))


class TiedHalf(nn.Module):
    """Tied weights, converted to bfloat16 after construction."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.encode = nn.Linear(width, width, bias=False)
        self.decode = nn.Linear(width, width, bias=False)
        self.decode.weight = self.encode.weight


class Hooked(nn.Module):
    """A load_state_dict pre-hook: never read directly, always through load_state_dict."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self._register_load_state_dict_pre_hook(self._noop)

    def _noop(self, *args: Any) -> None:
        return None


def _mixed() -> Mixed:
    torch.manual_seed(0)
    model = Mixed()
    model.body.to(torch.float16)
    model.head.to(torch.bfloat16)
    model.seen = torch.tensor([3, 1, 4], dtype=torch.int32)  # float32 -> int32 buffer
    return model


def _assert_same_state(got: nn.Module, saved: nn.Module) -> None:
    """Same names, dtypes and bits; parameters are Parameters with the saved requires_grad."""
    want = saved.state_dict(keep_vars=True)
    have = got.state_dict(keep_vars=True)
    assert set(have) == set(want)
    for name, tensor in want.items():
        assert have[name].dtype == tensor.dtype, name
        assert torch.equal(have[name].detach(), tensor.detach()), name
    saved_params = dict(saved.named_parameters())
    got_params = dict(got.named_parameters())
    assert set(got_params) == set(saved_params)
    for name, param in saved_params.items():
        assert type(got_params[name]) is nn.Parameter, name
        assert got_params[name].requires_grad == param.requires_grad, name


# --------------------------------------------------------------------------- 1. dtypes


def test_a_bfloat16_linear_loads_in_bfloat16_bitwise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    save_checkpoint(tmp_path, models={"main": (model, None)})
    got = load_checkpoint(tmp_path)["models"]["main"]["model"]
    assert got.weight.dtype == torch.bfloat16
    _assert_same_state(got, model)


@pytest.mark.parametrize("second_save", [False, True], ids=["own-file", "referenced"])
def test_mixed_dtypes_and_an_int_buffer_round_trip(tmp_path: Path, second_save: bool) -> None:
    model = _mixed()
    save_checkpoint(tmp_path, models={"m": (model, None)})
    if second_save:  # index 1 holds references to index 0's bytes (another load path)
        save_checkpoint(tmp_path, models={"m": (model, None)})
    got = load_checkpoint(tmp_path)["models"]["m"]["model"]
    assert got.body.weight.dtype == torch.float16
    assert got.norm.weight.dtype == torch.float32
    assert got.head.weight.dtype == torch.bfloat16
    assert got.seen.dtype == torch.int32
    _assert_same_state(got, model)
    with torch.no_grad():  # it runs in its saved dtypes, as the saved model does
        x = torch.randn(2, 8)
        out = got.head(got.norm(got.body(x.half()).float()).bfloat16())
    assert out.dtype == torch.bfloat16


def test_a_model_loaded_through_load_state_dict_keeps_its_saved_dtype(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Hooked().to(torch.float16)
    save_checkpoint(tmp_path, models={"m": (model, None)})
    got = load_checkpoint(tmp_path)["models"]["m"]["model"]
    _assert_same_state(got, model)


def test_tied_bfloat16_weights_stay_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedHalf().to(torch.bfloat16)
    save_checkpoint(tmp_path, models={"m": (model, None)})
    got = load_checkpoint(tmp_path)["models"]["m"]["model"]
    assert got.decode.weight is got.encode.weight
    _assert_same_state(got, model)


def test_an_optimizer_keeps_the_model_parameters_and_its_state_dtypes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().square().mean().backward()
    optimizer.step()
    # A moment kept in float32 for a bfloat16 parameter: it must not come back rounded.
    optimizer.state[model.weight]["exp_avg_sq"] = torch.rand(4, 8, dtype=torch.float32) / 3
    save_checkpoint(tmp_path, models={"m": (model, None)}, optimizers={"o": (optimizer, None)})

    record = load_checkpoint(tmp_path)["models"]["m"]
    got, got_opt = record["model"], record["optimizers"]["o"]["optimizer"]
    _assert_same_state(got, model)
    live = [p for group in got_opt.param_groups for p in group["params"]]
    assert [id(p) for p in live] == [id(p) for p in got.parameters()]
    for param, saved_param in zip(got.parameters(), model.parameters(), strict=True):
        for key, value in optimizer.state[saved_param].items():
            loaded = got_opt.state[param][key]
            assert loaded.dtype == value.dtype, key
            assert torch.equal(loaded, value), key


def _bf16_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (model(batch.to(torch.bfloat16)).float() - 1.0).square().mean()


def _bf16_strategy() -> fastckpt.TrainingStrategy:
    torch.manual_seed(0)
    return fastckpt.TrainingStrategy(
        nn.Linear(16, 4).to(torch.bfloat16),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=_bf16_loss,
        num_steps=2,
    )


def test_a_bfloat16_strategy_resumes_and_trains_in_bfloat16(tmp_path: Path) -> None:
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    original = _bf16_strategy()
    original.run(batches)
    original.save_checkpoint(tmp_path)

    resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path, training_fn=_bf16_loss)
    model, saved = resumed.models["main"], original.models["main"]
    _assert_same_state(model, saved)
    optimizer = next(iter(resumed.optimizers.values()))
    saved_opt = next(iter(original.optimizers.values()))
    live = [p for group in optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in live] == [id(p) for p in model.parameters()]
    for param, saved_param in zip(model.parameters(), saved.parameters(), strict=True):
        for key, value in saved_opt.state[saved_param].items():
            assert optimizer.state[param][key].dtype == value.dtype, key
            assert torch.equal(optimizer.state[param][key], value), key

    # One more step each: the resumed run trains in bfloat16, as the uninterrupted one does.
    for strategy in (original, resumed):
        strategy.num_steps = 3
        strategy.run(batches)
    assert resumed.step_count == original.step_count == 3
    assert model.weight.dtype == torch.bfloat16
    assert all(
        v.dtype == torch.bfloat16 for k, v in optimizer.state[model.weight].items() if k != "step"
    )
    _assert_same_state(model, saved)


# --------------------------------------------------------------------------- 2. indices


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with indices 0, 1, 2 of a model named "main"."""
    path = tmp_path_factory.mktemp("indices")
    model = nn.Linear(4, 4)
    for _ in range(3):
        save_checkpoint(path, models={"main": (model, None)})
    return path


BAD_INDICES = [True, False, 2.0, "1", 1.5, [1], np.bool_(True), torch.tensor(True)]


@pytest.mark.parametrize("bad", BAD_INDICES, ids=repr)
def test_verify_refuses_an_index_that_is_not_an_int(root: Path, bad: Any) -> None:
    with pytest.raises(TypeError, match=r"^index must be an int .*not "):
        verify(root, index=bad)


@pytest.mark.parametrize("bad", BAD_INDICES, ids=repr)
def test_load_checkpoint_refuses_an_index_that_is_not_an_int(root: Path, bad: Any) -> None:
    with pytest.raises(TypeError, match=r"^checkpoint_index must be an int .*not "):
        load_checkpoint(root, checkpoint_index=bad)
    with pytest.raises(TypeError, match=r"^checkpoint_index must be an int "):
        load_checkpoint(root, checkpoint_index=bad, fallback_dirs=[root])


def test_save_checkpoint_refuses_an_index_that_is_not_an_int(tmp_path: Path) -> None:
    shutil.rmtree(tmp_path)
    for bad in (True, 2.0, "0"):
        with pytest.raises(TypeError, match=r"^checkpoint_index must be an int "):
            save_checkpoint(
                tmp_path, models={"main": (nn.Linear(2, 2), None)}, checkpoint_index=bad
            )
    assert not tmp_path.exists()  # nothing was written


def test_save_checkpoint_refuses_an_index_its_manifest_cannot_hold(tmp_path: Path) -> None:
    # Before, index time.time_ns() (19 digits) was committed and every later read of the
    # root (its other indices too), save, prune and list raised CheckpointFormatError.
    from fastckpt.format.records import MAX_INDEX

    model = nn.Linear(2, 2)
    save_checkpoint(tmp_path, models={"main": (model, None)})
    for bad in (MAX_INDEX + 1, 1_796_504_249_489_275_099):
        with pytest.raises(ValueError, match=r"from 0 to 999999999999999999"):
            save_checkpoint(tmp_path, models={"main": (model, None)}, checkpoint_index=bad)
    assert [row["index"] for row in fastckpt.list_checkpoints(tmp_path)] == [0]
    assert save_checkpoint(tmp_path, models={"main": (model, None)}, checkpoint_index=MAX_INDEX)
    assert verify(tmp_path).ok
    assert load_checkpoint(tmp_path)["checkpoint_index"] == MAX_INDEX
    assert load_checkpoint(tmp_path, checkpoint_index=0)["checkpoint_index"] == 0
    with pytest.raises(ValueError, match="latest index is already 999999999999999999"):
        save_checkpoint(tmp_path, models={"main": (model, None)})


def test_none_means_the_latest_and_integer_scalars_are_ints(root: Path) -> None:
    assert load_checkpoint(root, checkpoint_index=None)["checkpoint_index"] == 2
    assert load_checkpoint(root, checkpoint_index=np.int64(1))["checkpoint_index"] == 1
    assert load_checkpoint(root, checkpoint_index=0)["checkpoint_index"] == 0
    assert verify(root, index=None).indices == [0, 1, 2]
    assert verify(root, index=-1).indices == [2]
    report = verify(root, index=np.int64(1))
    assert report.ok and report.indices == [1]


def test_an_int_index_that_is_not_committed_is_still_a_key_error(root: Path) -> None:
    with pytest.raises(KeyError, match="checkpoint index 7 is not in"):
        verify(root, index=7)
    with pytest.raises(KeyError, match="checkpoint index 7 is not in"):
        load_checkpoint(root, checkpoint_index=7)


def test_a_string_model_names_is_refused(root: Path) -> None:
    with pytest.raises(
        TypeError, match=r"model_names must be a list .*for one model pass \['main'\]"
    ):
        load_checkpoint(root, model_names="main")
    with pytest.raises(TypeError, match="model_names must hold model names"):
        load_checkpoint(root, model_names=[0])
    assert list(load_checkpoint(root, model_names=["main"])["models"]) == ["main"]
    assert list(load_checkpoint(root, model_names=("main",))["models"]) == ["main"]


@pytest.mark.parametrize("bad", [True, 2.0, "1"])
def test_training_strategy_load_checkpoint_refuses_a_non_int_index(
    tmp_path: Path, bad: object
) -> None:
    strategy = training_support.new_strategy([], num_steps=2)
    strategy.save_checkpoint(tmp_path / "root")
    with pytest.raises(TypeError, match="checkpoint_index must be"):
        fastckpt.TrainingStrategy.load_checkpoint(
            tmp_path / "root", checkpoint_index=bad, training_fn=training_support.training_fn
        )


def test_training_strategy_load_checkpoint_takes_none_as_the_latest(tmp_path: Path) -> None:
    strategy = training_support.new_strategy([], num_steps=2)
    strategy.save_checkpoint(tmp_path / "root")
    strategy.run(training_support.loader())
    strategy.save_checkpoint(tmp_path / "root")
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        tmp_path / "root", checkpoint_index=None, training_fn=training_support.training_fn
    )
    assert resumed.step_count == strategy.step_count == 2


@pytest.mark.parametrize("bad", [True, 2.0, "1"])
def test_safe_open_and_tiered_strategy_loads_refuse_a_non_int_index(
    tmp_path: Path, bad: object
) -> None:
    strategy = training_support.new_strategy([], num_steps=2)
    strategy.save_checkpoint(tmp_path / "root")
    strategy.save_checkpoint(tmp_path / "root")
    with pytest.raises(TypeError, match="index must be"):
        fastckpt.safe_open(tmp_path / "root", index=bad)
    with pytest.raises(TypeError, match="checkpoint_index must be"):
        fastckpt.TrainingStrategy.load_checkpoint(
            tmp_path / "root",
            checkpoint_index=bad,
            training_fn=training_support.training_fn,
            fallback_dirs=[tmp_path / "durable"],
        )
