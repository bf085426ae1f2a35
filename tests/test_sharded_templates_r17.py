"""Sharded (DCP) loads into templates of the seventeenth adversarial round: templates whose
names, structure or dtype do not fit the checkpoint, and lazy negative / conjugate views.

A 2-rank FSDP2 checkpoint is saved by real gloo ranks (this module's :func:`save_fsdp_module`,
run by ``dcp_support.launch``); the loads run in the test process, on real files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fastckpt
import fastckpt.dcp
from dcp_support import check_ok, launch, setup_rank
from fastckpt.dcp.state import typed_dcp_error
from fastckpt.errors import CheckpointMismatchError
from training_support import leave_process_group


def _saved_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 1))


class Wrapped(nn.Module):
    """The saved model under a wrapper (as DDP's): every name gets a ``module.`` prefix."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.module = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 1))


def _grown_model() -> nn.Module:
    """The saved model with one more layer."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 1), nn.Linear(1, 1))


def save_fsdp_module() -> None:
    """Rank script: save ``{"model": <_saved_model() under FSDP2>, "step": 5}`` with a
    ``CheckpointManager`` to CHECKPOINT."""
    root, _, world = setup_rank()
    mesh = init_device_mesh("cpu", (world,))
    model = _saved_model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with fastckpt.CheckpointManager() as manager:
        manager.save(root, {"model": model, "step": 5})
    leave_process_group()


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP2 checkpoint of ``{"model": _saved_model(), "step": 5}``."""
    root = tmp_path_factory.mktemp("r17") / "ckpt"
    check_ok(launch("save_fsdp_module", root, 2, ranks="test_sharded_templates_r17"))
    return root


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    after = module.state_dict()
    return set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())


def _manager_load(root: Path, into: dict[str, Any], strict: bool) -> dict[str, Any]:
    with fastckpt.CheckpointManager() as manager:
        return manager.load(root, into=into, strict=strict)


def _load_state(root: Path, into: dict[str, Any], strict: bool) -> dict[str, Any]:
    return fastckpt.dcp.load_state(root, into=into, strict=strict)


LOADERS: dict[str, Callable[[Path, dict[str, Any], bool], dict[str, Any]]] = {
    "manager.load": _manager_load,
    "load_state": _load_state,
}


# --------------------------------------------------------------------------------------------
# F1. A template none of whose tensors the checkpoint holds loaded nothing, silently
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_module_template_with_other_names_is_refused_before_anything_is_read(
    fsdp_checkpoint: Path, loader: str, strict: bool
) -> None:
    """Before: a 2-rank FSDP2 checkpoint loaded into a module whose names carry a ``module.``
    prefix returned ``step == 5`` and left every weight at its init (non-strict), or named
    only the first missing key (strict). The unsharded manager refuses it: so does every
    sharded load now, with every template as it was."""
    target = Wrapped()
    before = _snapshot(target)
    into = {"model": target, "step": 0}
    with pytest.raises(CheckpointMismatchError, match="none of the template's 4 tensors") as info:
        LOADERS[loader](fsdp_checkpoint, into, strict)
    assert "'model.0.weight'" in str(info.value) and "'model.module.0.weight'" in str(info.value)
    assert _unchanged(target, before)
    assert into["step"] == 0


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_plain_template_with_other_names_is_refused(fsdp_checkpoint: Path, loader: str) -> None:
    """Before: a plain dict template (a state dict under other names) loaded nothing into its
    tensors and returned the saved ``step``."""
    template = {name: torch.zeros_like(t) for name, t in Wrapped().state_dict().items()}
    into: dict[str, Any] = {"model": template, "step": 0}
    with pytest.raises(CheckpointMismatchError, match="nothing was loaded"):
        LOADERS[loader](fsdp_checkpoint, into, False)
    assert all(not t.any() for t in template.values())


@pytest.mark.parametrize("strict", [False, True])
def test_a_grown_module_is_refused_by_load_state_as_by_the_unsharded_manager(
    fsdp_checkpoint: Path, strict: bool
) -> None:
    """Before: ``load_state(into={"model": grown})`` with one layer more than the checkpoint
    loaded the saved layers and left the new one at its init without a word (non-strict).
    A module's own ``load_state_dict`` is strict, and the unsharded manager refuses such a
    module at any strictness ("would refuse the checkpoint's state"): so does ``load_state``,
    before anything is read."""
    grown = _grown_model()
    before = _snapshot(grown)
    with pytest.raises(
        CheckpointMismatchError, match=r"Missing key\(s\): \['2\.bias', '2\.weight'\]\)"
    ):
        fastckpt.dcp.load_state(fsdp_checkpoint, into={"model": grown}, strict=strict)
    assert _unchanged(grown, before)


def test_a_shrunk_module_is_refused_by_load_state(fsdp_checkpoint: Path) -> None:
    """Before: a module with one layer less loaded its layer and returned (non-strict); its
    ``load_state_dict`` would refuse the saved state (unexpected keys)."""
    torch.manual_seed(4)
    shrunk = nn.Sequential(nn.Linear(6, 5))
    before = _snapshot(shrunk)
    with pytest.raises(CheckpointMismatchError, match=r"Unexpected key\(s\): \['1\.bias'"):
        fastckpt.dcp.load_state(fsdp_checkpoint, into={"model": shrunk})
    assert _unchanged(shrunk, before)


def test_a_module_template_that_fits_loads_the_saved_weights(fsdp_checkpoint: Path) -> None:
    """The rule refuses only what does not fit: the module as saved loads bitwise, and a plain
    template naming part of the saved tensors still loads that part (non-strict)."""
    saved = _snapshot(_saved_model())
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 1))
    for loader in LOADERS.values():
        out = loader(fsdp_checkpoint, {"model": model, "step": 0}, False)
        assert out["step"] == 5
        assert _unchanged(model, saved)
    part = {"0.weight": torch.zeros(5, 6), "new.weight": torch.ones(2)}
    out = fastckpt.dcp.load_state(fsdp_checkpoint, into={"model": part})
    assert torch.equal(out["model"]["0.weight"], saved["0.weight"])
    assert torch.equal(out["model"]["new.weight"], torch.ones(2))  # kept, as unsharded


def test_a_grown_module_is_refused_by_the_manager_as_unsharded(fsdp_checkpoint: Path) -> None:
    """Before: the manager loaded the saved layers into a grown model and left the new one at
    its init (non-strict); the unsharded manager refuses it."""
    grown = _grown_model()
    before = _snapshot(grown)
    with pytest.raises(CheckpointMismatchError, match="would refuse"):
        _manager_load(fsdp_checkpoint, {"model": grown, "step": 0}, False)
    assert _unchanged(grown, before)


# --------------------------------------------------------------------------------------------
# F2. A saved tensor met by a mapping template (and the reverse) was skipped or "not in" it
# --------------------------------------------------------------------------------------------


@pytest.fixture
def mixed_checkpoint(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    fastckpt.dcp.save_state(
        root, {"w": torch.arange(4.0), "opt": {"m": torch.ones(3), "n": 2}, "step": 9}
    )
    return root


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_mapping_template_for_a_saved_tensor_is_a_mismatch(
    mixed_checkpoint: Path, loader: str, strict: bool
) -> None:
    """Before: non-strict, the template was returned untouched with the saved ``step``; strict,
    "w.a: not in checkpoint", which hides that ``w`` is there, as a tensor."""
    inner = torch.zeros(4)
    into: dict[str, Any] = {"w": {"a": inner}, "step": 0}
    with pytest.raises(CheckpointMismatchError, match=r"^w: the checkpoint has a tensor"):
        LOADERS[loader](mixed_checkpoint, into, strict)
    assert not inner.any() and into["step"] == 0


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_tensor_template_for_a_saved_mapping_is_a_mismatch(
    mixed_checkpoint: Path, loader: str, strict: bool
) -> None:
    """Before: as above, for a saved mapping ``opt`` met by a tensor template."""
    template = torch.zeros(3)
    into: dict[str, Any] = {"opt": template, "step": 0}
    with pytest.raises(CheckpointMismatchError, match=r"^opt: the checkpoint has a mapping"):
        LOADERS[loader](mixed_checkpoint, into, strict)
    assert not template.any() and into["step"] == 0


# --------------------------------------------------------------------------------------------
# F3. Negative and conjugate views failed in the fill pass, after other templates were filled
# --------------------------------------------------------------------------------------------


def _dcp_load(root: Path, into: dict[str, Any]) -> None:
    dcp.load(into, storage_reader=fastckpt.dcp.Reader(root))


def _view_templates() -> dict[str, torch.Tensor]:
    return {
        "a": torch.zeros(2),
        "w": torch._neg_view(torch.zeros(3)),
        "c": torch.zeros(2, dtype=torch.complex64).conj(),
        "z": torch.zeros(1),
    }


@pytest.mark.parametrize("loader", ["dcp.load", "load_state", "manager.load"])
def test_negative_and_conjugate_view_templates_are_filled(tmp_path: Path, loader: str) -> None:
    """Before: a ``torch._neg_view`` template raised a bare ``RuntimeError`` ("view is not
    supported for tensors with negative bit set") naming no key, after ``a`` had been filled:
    a half-applied load. The unsharded manager fills such views (``copy_`` resolves the bit):
    so do sharded loads now, every template holding the saved values."""
    saved = {
        "a": torch.tensor([5.0, 6.0]),
        "w": torch.tensor([1.0, 2.0, 3.0]),
        "c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "z": torch.tensor([7.0]),
    }
    fastckpt.dcp.save_state(tmp_path / "fc", saved)
    into = _view_templates()
    if loader == "dcp.load":
        _dcp_load(tmp_path / "fc", into)
    elif loader == "load_state":
        fastckpt.dcp.load_state(tmp_path / "fc", into=into)
    else:
        _manager_load(tmp_path / "fc", into, False)
    assert into["w"].is_neg() and into["c"].is_conj()
    for key, value in saved.items():
        assert torch.equal(into[key].resolve_conj().resolve_neg(), value), key


# --------------------------------------------------------------------------------------------
# F4. dcp.load with fastckpt's Reader cast into a template of another dtype
# --------------------------------------------------------------------------------------------


def test_dcp_load_into_a_template_of_another_dtype_is_a_typed_mismatch(tmp_path: Path) -> None:
    """Before: ``dcp.load`` with ``fastckpt.dcp.Reader`` cast the saved int64 values into a
    float32 template (as torch's ``FileSystemReader`` does): 2**40 + 3 came back as
    1099511627776.0, another value than was saved. Now the Reader refuses, naming the key,
    both dtypes and the fix, before it fills any template."""
    saved = {"i64": torch.arange(4, dtype=torch.int64) * (2**40 + 3), "a": torch.ones(2)}
    dcp.save(dict(saved), storage_writer=fastckpt.dcp.Writer(tmp_path / "fc"))
    into = {"a": torch.zeros(2), "i64": torch.zeros(4, dtype=torch.float32)}
    with pytest.raises(CheckpointException) as info:
        _dcp_load(tmp_path / "fc", into)
    error = typed_dcp_error(info.value)
    assert isinstance(error, CheckpointMismatchError)
    message = str(error)
    assert message.startswith("i64: ") and "torch.int64" in message and "torch.float32" in message
    assert "then cast" in message
    assert not into["a"].any() and not into["i64"].any()
    # a template of the saved dtype loads exactly
    into = {"a": torch.zeros(2), "i64": torch.zeros(4, dtype=torch.int64)}
    _dcp_load(tmp_path / "fc", into)
    assert torch.equal(into["i64"], saved["i64"]) and torch.equal(into["a"], saved["a"])
