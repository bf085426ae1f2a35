"""Tensors whose memory does not hold their values (a storage freed or shrunk below what the
tensor's elements reach, as FSDP-style code frees unsharded parameters with
``untyped_storage().resize_(0)``; a functionalization wrapper, whose storage is no real one)
are refused at save(), typed and named, through every front door; tensors that reach only
what their storage holds are saved as before."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import InvalidInputError
from fastckpt.manager import CheckpointManager


def _freed() -> torch.Tensor:
    tensor = torch.arange(1000.0)
    tensor.untyped_storage().resize_(0)
    return tensor


def _shrunk() -> torch.Tensor:
    tensor = torch.arange(1000.0)
    tensor.untyped_storage().resize_(400)  # 100 of its 1000 floats
    return tensor


def _view_past_its_storage() -> torch.Tensor:
    base = torch.arange(100.0)
    view = base[10:20]  # storage offset 10: reaches float 19
    base.untyped_storage().resize_(15 * 4)
    return view


def _transposed_one_element_short() -> torch.Tensor:
    tensor = torch.arange(100.0).view(10, 10).t()  # non-contiguous: reaches float 99
    tensor.untyped_storage().resize_(99 * 4)
    return tensor


def _functional() -> torch.Tensor:
    return torch._to_functional_tensor(torch.ones(3))  # type torch.Tensor, no real storage


#: kind -> (a tensor whose memory does not hold its values, what the message says).
UNHELD: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "freed": (_freed, "resize_"),
    "shrunk": (_shrunk, "resize_"),
    "view past its storage": (_view_past_its_storage, "resize_"),
    "transposed, one element short": (_transposed_one_element_short, "resize_"),
    "functional": (_functional, "functional"),
}


def _manager(mode: str) -> CheckpointManager:
    config = getattr(CheckpointManager.Config, f"with_{mode}_save")()
    return CheckpointManager(config)


def _manager_refusals(root: Path, mode: str) -> None:
    """Each kind saved by a ``mode`` manager after a good save of the same key (incremental):
    refused at save() naming the key path, nothing written, the good checkpoint intact."""
    for kind, (make, fix) in UNHELD.items():
        where = root / mode / kind
        with _manager(mode) as manager:
            future = manager.save(where / "good", {"model": {"layer.weight": torch.ones(3)}})
            if future is not None:
                future.result()
            with pytest.raises(InvalidInputError, match=fix) as info:
                manager.save(where / "bad", {"model": {"layer.weight": make()}})
            assert "model.layer.weight" in str(info.value), (mode, kind, info.value)
            assert not (where / "bad").exists(), (mode, kind)
            loaded = manager.load(where / "good")["model"]["layer.weight"]
            assert torch.equal(loaded, torch.ones(3)), (mode, kind)


@pytest.mark.parametrize("kind", sorted(UNHELD))
def test_save_file_refuses_a_tensor_whose_memory_does_not_hold_it(
    tmp_path: Path, kind: str
) -> None:
    """Before: a freed or functional tensor raised NumPy's bare ValueError ("data is NULL")
    naming no key; a shrunk one was saved with the memory past its storage (garbage)."""
    make, fix = UNHELD[kind]
    path = tmp_path / "f.safetensors"
    with pytest.raises(InvalidInputError, match=fix) as info:
        fastckpt.save_file({"layer.weight": make()}, path)
    assert "'layer.weight'" in str(info.value)
    assert not path.exists()


def test_a_sync_manager_refuses_a_tensor_whose_memory_does_not_hold_it(tmp_path: Path) -> None:
    """Before: a bare ValueError / RuntimeError naming no key (freed, functional), or a
    checkpoint holding the memory past a shrunk storage that loaded and verified."""
    _manager_refusals(tmp_path, "sync")


def test_an_async_manager_refuses_a_tensor_whose_memory_does_not_hold_it(
    tmp_path: Path,
) -> None:
    """Run in a child process: before, the stager's copy of a freed tensor killed the whole
    process with SIGSEGV; a shrunk one was committed with garbage that verified, a functional
    one failed with a bare RuntimeError. Now every kind is refused in-process at save()."""
    code = (
        "import sys; from pathlib import Path; "
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_tensor_memory as t; "
        f"t._manager_refusals(Path({str(tmp_path)!r}), 'async'); print('refused')"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert child.returncode == 0 and child.stdout.split() == ["refused"], (
        child.returncode,
        child.stdout,
        child.stderr[-3000:],
    )


@pytest.mark.parametrize("kind", sorted(UNHELD))
def test_save_checkpoint_refuses_a_tensor_whose_memory_does_not_hold_it(
    tmp_path: Path, kind: str
) -> None:
    """In an optimizer's state, and (freed and shrunk storages) as a model's weight. Before:
    NumPy's bare ValueError or torch's RuntimeError naming no key, or an index holding the
    memory past a shrunk weight that loaded and verified."""
    make, fix = UNHELD[kind]
    model = torch.nn.Linear(1000, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fastckpt.save_checkpoint(tmp_path, models={"main": (model, None)})
    optimizer.state[model.weight]["k"] = make()
    with pytest.raises(InvalidInputError, match=fix) as info:
        fastckpt.save_checkpoint(
            tmp_path, models={"main": (model, None)}, optimizers={"sgd": (optimizer, None)}
        )
    assert "state.0.k" in str(info.value)
    if kind in ("freed", "shrunk"):
        optimizer.state.clear()
        model.weight.untyped_storage().resize_(0 if kind == "freed" else 400)
        with pytest.raises(InvalidInputError, match=fix) as info:
            fastckpt.save_checkpoint(tmp_path, models={"main": (model, None)})
        assert "weight" in str(info.value)
    assert [row["index"] for row in fastckpt.list_checkpoints(tmp_path)] == [0]
    assert fastckpt.verify(tmp_path).ok


def _held() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (a tensor that reaches only bytes its storage holds, its values)."""
    base = torch.arange(10.0)
    head = base[:3]
    base.untyped_storage().resize_(3 * 4)  # exactly what ``head`` reaches
    empty = torch.arange(10.0)[10:]  # reaches nothing
    empty.untyped_storage().resize_(0)
    expanded = torch.arange(2.0).view(2, 1).expand(2, 3)  # stride 0
    return {
        "head": (head, torch.arange(3.0)),
        "empty": (empty, torch.zeros(0)),
        "expanded": (expanded, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])),
    }


def test_tensors_that_reach_only_what_their_storage_holds_are_saved(tmp_path: Path) -> None:
    """The refusal counts the bytes the elements reach, not the storage or the shape: a view
    of a storage shrunk to just its elements, an empty tensor of a freed storage and an
    expanded (stride 0) tensor are saved and load back equal."""
    held = _held()
    tensors = {name: tensor for name, (tensor, _) in held.items()}
    fastckpt.save_file(tensors, tmp_path / "f.safetensors")
    loaded = fastckpt.load_file(tmp_path / "f.safetensors")
    for mode in ("sync", "async"):
        with _manager(mode) as manager:
            future = manager.save(tmp_path / mode, {"model": tensors})
            if future is not None:
                future.result()
            for name, (_, values) in held.items():
                assert torch.equal(loaded[name], values), name
                assert torch.equal(manager.load(tmp_path / mode)["model"][name], values), name
