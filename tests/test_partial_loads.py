"""Failed and partial loads tell the truth: an optimizer built from its parameters in
another order is refused before anything is read into a template; a load that fails or is
interrupted part-way names every item whose template it already wrote into, and advises what
works for the kind of checkpoint at hand; ``fastckpt.latest_intact`` on a CheckpointManager
checkpoint says what it is instead of finding nothing."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import fastckpt.manager as manager_module
import fastckpt.manager.load as manager_load
from fastckpt import CheckpointMismatchError, ChecksumMismatchError
from fastckpt.io.files import read_metadata
from fastckpt.manager import CheckpointManager
from fastckpt.manager.stateful import PARAMETER_SHAPED_OPTIMIZERS, PARAMETER_SHAPED_STATE

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import training_support as support  # noqa: E402


def _sync() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config.with_sync_save())


def _stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One training step, so that the optimizer holds per-parameter state."""
    torch.manual_seed(0)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()


def _flip_data_byte(path: Path, at: int = 100) -> None:
    data_start = read_metadata(path)["data_start"]
    with open(path, "r+b") as handle:
        handle.seek(data_start + at)
        byte = handle.read(1)
        handle.seek(data_start + at)
        handle.write(bytes([byte[0] ^ 1]))


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tensor data a load reads: each direct read's file, and each item loaded through
    the file mapping."""
    calls: list[str] = []
    real_read = manager_load._native.read_into
    real_load = manager_module._load_item

    def direct(path: str, *args: Any, **kwargs: Any) -> int:
        calls.append(Path(path).name)
        return real_read(path, *args, **kwargs)

    def mapped(directory: Path, record: Any, key: str, *args: Any) -> Any:
        calls.append(key)
        return real_load(directory, record, key, *args)

    monkeypatch.setattr(manager_load._native, "read_into", direct)
    monkeypatch.setattr(manager_module, "_load_item", mapped)
    return calls


# --------------------------------------------------------------------------- parameter order


def test_an_optimizer_over_its_parameters_in_another_order_is_refused_before_any_read(
    tmp_path: Path, reads: list[str]
) -> None:
    """Before, ``load(into={"model": m, "opt": Adam(reversed(params))})`` succeeded: each
    parameter got another parameter's moments, and the first ``step()`` raised torch's bare
    ``output with shape [4] doesn't match the broadcast shape [8, 4]``. Now the saved moments'
    shapes (from the headers) are compared with the live parameters before any data is
    read."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _stepped(model, optimizer)
    live = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    reversed_adam = torch.optim.Adam(list(live.parameters())[::-1], lr=0.1)
    before = {key: value.clone() for key, value in live.state_dict().items()}
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": model, "opt": optimizer})
        reads.clear()
        with pytest.raises(CheckpointMismatchError) as caught:
            manager.load(tmp_path / "c", into={"model": live, "opt": reversed_adam})
    message = str(caught.value)
    assert message.startswith("opt.state.0.exp_avg: "), message
    assert "(8, 4)" in message and "(4,)" in message
    assert "same order" in message and "Adam" in message
    assert reads == []  # refused from the headers: no tensor data was read
    assert all(torch.equal(value, before[key]) for key, value in live.state_dict().items())
    assert reversed_adam.state_dict()["state"] == {}


def test_a_live_strategy_over_its_parameters_in_another_order_is_refused(
    tmp_path: Path,
) -> None:
    """``restore_checkpoint`` into a live strategy whose Adam was built over the model's
    parameters in reverse order: before, it restored without a word (moments of other
    shapes, a bare torch error at the next step). Now refused, naming the optimizer's file
    and the state path, with the live strategy unchanged."""
    saved = support.new_strategy([], num_steps=6)
    saved.run(support.loader())
    saved.save_checkpoint(tmp_path)
    torch.manual_seed(99)
    model = support.DropoutMLP()
    optimizer = torch.optim.Adam(list(model.parameters())[::-1], lr=1e-2)
    live = fastckpt.TrainingStrategy(model, optimizer, training_fn=support.training_fn, num_steps=6)
    live.schedulers["main"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(
        CheckpointMismatchError, match=r"optimizers/main\.json: state\.0\.exp_avg: .*same order"
    ):
        live.restore_checkpoint(tmp_path)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert optimizer.state_dict()["state"] == {} and live.step_count == 0


def _two_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


def test_parameters_of_the_same_shapes_in_another_order_are_refused_by_their_names(
    tmp_path: Path,
) -> None:
    """Two layers of the same shapes, the optimizer built from ``named_parameters()`` with
    the layers swapped: no shape tells them apart, and before, each layer silently took the
    other's moments. The recorded ``param_names`` do: refused naming both names. Names that
    differ otherwise (a ``module.`` prefix, as DDP adds, in the saved order) still load."""
    model = _two_layers()
    optimizer = torch.optim.Adam(model.named_parameters(), lr=0.1)
    _stepped(model, optimizer)
    live = _two_layers()
    named = list(live.named_parameters())
    swapped = torch.optim.Adam(named[2:] + named[:2], lr=0.1)
    with _sync() as manager:
        manager.save(tmp_path / "c", {"opt": optimizer})
        with pytest.raises(
            CheckpointMismatchError,
            match=r"^opt\.param_groups\.0\.param_names\.0: .*'0\.weight'.*'1\.weight'",
        ):
            manager.load(tmp_path / "c", into={"opt": swapped})
        assert swapped.state_dict()["state"] == {}
        wrapped = torch.optim.Adam([(f"module.{n}", p) for n, p in named], lr=0.1)
        manager.load(tmp_path / "c", into={"opt": wrapped})
    saved_state = optimizer.state_dict()["state"]
    for index, state in wrapped.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], saved_state[index]["exp_avg"])


def _optimizer(cls: type[torch.optim.Optimizer], params: list[torch.nn.Parameter]) -> Any:
    if cls is torch.optim.SGD:
        return cls(params, lr=0.1, momentum=0.9)
    return cls(params)


def _stepped_params(cls: type[torch.optim.Optimizer]) -> tuple[list[Any], Any]:
    """Parameters of several shapes and an optimizer of ``cls`` stepped twice over them."""
    torch.manual_seed(0)
    shapes = [(8, 4), (8,), (3, 5, 2), (), (2, 2)]
    if cls.__name__ == "Muon":  # 2-D parameters only
        shapes = [(8, 4), (2, 2)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    optimizer = _optimizer(cls, params)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = sum((param**2).sum() for param in params)
        loss.backward()
        return loss

    for _ in range(2):
        optimizer.step(closure)
    return params, optimizer


@pytest.mark.parametrize(
    "cls",
    sorted(
        [c for c in PARAMETER_SHAPED_OPTIMIZERS if c is not torch.optim.SparseAdam]
        + [c for c in (getattr(torch.optim, "Adafactor", None), torch.optim.LBFGS) if c],
        key=lambda c: c.__name__,
    ),
    ids=lambda c: c.__name__,
)
def test_optimizers_over_their_parameters_in_the_saved_order_load(
    tmp_path: Path, cls: type[torch.optim.Optimizer]
) -> None:
    """The rule refuses only what is proven: every class it applies to keeps state of its
    parameters' shapes under the keys it compares (this fails when a torch upgrade changes
    that), and every class,
    those whose state has other shapes too (``Adafactor``'s factored moments, ``LBFGS``),
    loads into an optimizer over the same parameters in the same order."""
    params, optimizer = _stepped_params(cls)
    if cls in PARAMETER_SHAPED_OPTIMIZERS:
        for index, state in optimizer.state_dict()["state"].items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1:
                    assert value.shape == params[index].shape, (cls.__name__, name)
                    assert name in PARAMETER_SHAPED_STATE, (cls.__name__, name)  # compared
    fresh = _optimizer(cls, [torch.nn.Parameter(torch.zeros_like(p)) for p in params])
    with _sync() as manager:
        manager.save(tmp_path / "c", {"opt": optimizer})
        manager.load(tmp_path / "c", into={"opt": fresh})
    assert fresh.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


# --------------------------------------------------------------------------- partial loads


def test_a_damaged_last_item_names_every_template_already_read_into(tmp_path: Path) -> None:
    """``load(into={"a": ..., "b": ..., "c": ...})`` with ``c``'s file damaged: before, the
    error named only ``c``'s template as possibly partial (``a`` and ``b`` were already
    overwritten with the checkpoint's values) and advised ``fastckpt.latest_intact``, which
    does not read CheckpointManager checkpoints."""
    torch.manual_seed(0)
    saved = {key: torch.nn.Linear(64, 64) for key in "abc"}
    with _sync() as manager:
        manager.save(tmp_path / "run" / "step_1", saved)
    _flip_data_byte(tmp_path / "run" / "step_1" / "c.safetensors")
    fresh = {key: torch.nn.Linear(64, 64) for key in "abc"}
    with _sync() as manager, pytest.raises(ChecksumMismatchError) as caught:
        manager.load(tmp_path / "run" / "step_1", into=fresh)
    message = str(caught.value)
    assert "into={'a': ..., 'b': ..., 'c': ...}" in message, message
    assert "c.safetensors" in message and "latest_intact" not in message
    assert "an earlier checkpoint" in message and "fastckpt ls" in message
    assert torch.equal(fresh["a"].weight, saved["a"].weight)  # what the message says


def test_latest_intact_on_manager_checkpoints_names_what_it_finds(tmp_path: Path) -> None:
    """``fastckpt.latest_intact`` of a CheckpointManager checkpoint, or of a folder of them,
    returned None ("no committed index") without a word; now it raises as
    ``list_checkpoints`` and ``prune`` do there. An empty folder is still a root not saved
    into yet."""
    with _sync() as manager:
        for step in (10, 20):
            manager.save(tmp_path / "run" / f"step_{step}", {"w": torch.zeros(2)})
    with pytest.raises(
        FileNotFoundError,
        match=r"which latest_intact reads\); it is a CheckpointManager checkpoint: load it",
    ):
        fastckpt.latest_intact(tmp_path / "run" / "step_20")
    with pytest.raises(FileNotFoundError, match=r"folder of 2 CheckpointManager checkpoint"):
        fastckpt.latest_intact(tmp_path / "run")
    (tmp_path / "new").mkdir()
    assert fastckpt.latest_intact(tmp_path / "new") is None


@pytest.fixture
def ctrl_c_raises() -> Any:
    """SIGINT as an interactive Python has it (``KeyboardInterrupt``): a process started in
    the background by a shell (CI's) inherits it ignored, and Python then leaves it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupt_reading(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """SIGINT to this process as the direct read of file ``name`` begins."""
    real_read = manager_load._native.read_into

    def read_into(path: str, *args: Any, **kwargs: Any) -> int:
        if Path(path).name == name:
            os.kill(os.getpid(), signal.SIGINT)
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(manager_load._native, "read_into", read_into)


def test_an_interrupted_load_says_which_templates_it_read_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrl_c_raises: None
) -> None:
    """A real SIGINT during ``load(into=...)``, as item ``b``'s file is read: before, the
    ``KeyboardInterrupt`` carried no word that ``a``'s template already held the
    checkpoint's values (``restore_checkpoint`` adds such a note). Now it names them."""
    torch.manual_seed(0)
    with _sync() as manager:
        manager.save(tmp_path / "c", {key: torch.randn(1000) for key in "abc"})
    fresh = {key: torch.zeros(1000) for key in "abc"}
    _interrupt_reading(monkeypatch, "b.safetensors")
    with _sync() as manager, pytest.raises(KeyboardInterrupt) as caught:
        manager.load(tmp_path / "c", into=fresh)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "stopped part-way" in notes and "into={'a': ..., 'b': ...}" in notes, notes
    assert "'c'" not in notes
    assert fresh["a"].abs().sum() > 0 and fresh["c"].abs().sum() == 0


class _InterruptedState:
    """A stateful object whose ``load_state_dict`` is interrupted by a real SIGINT."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        os.kill(os.getpid(), signal.SIGINT)


def test_an_interrupted_load_state_dict_says_which_templates_were_read_into(
    tmp_path: Path, ctrl_c_raises: None
) -> None:
    """A SIGINT while a stateful item's ``load_state_dict`` runs, after a tensor item was read
    into directly: before, no note; now the note names both items."""
    with _sync() as manager:
        manager.save(tmp_path / "c", {"w": torch.ones(8), "s": _InterruptedState()})
    with _sync() as manager, pytest.raises(KeyboardInterrupt) as caught:
        manager.load(tmp_path / "c", into={"w": torch.zeros(8), "s": _InterruptedState()})
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "into={'w': ..., 's': ...}" in notes, notes


def test_a_load_read_again_names_the_template_it_was_reading_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is replaced while item ``b`` is read (its old file gone), so the load
    reads again from ``a``, whose new file is damaged. Before, the templates were named in
    the order first written into (``a``, then ``b``: "the last one perhaps in part" named
    ``b``, read in full); now each is moved to the end when written into again (``a``)."""
    checkpoint = tmp_path / "c"
    torch.manual_seed(0)
    with _sync() as manager:
        manager.save(checkpoint, {key: torch.randn(1000) for key in "ab"})
    real_read = manager_load._native.read_into
    replaced: list[bool] = []

    def read_into(path: str, *args: Any, **kwargs: Any) -> int:
        if Path(path).name == "b.safetensors" and not replaced:
            replaced.append(True)
            with _sync() as manager:  # a save replacing the checkpoint meanwhile
                manager.save(checkpoint, {key: torch.randn(1000) for key in "ab"})
            _flip_data_byte(checkpoint / "a.safetensors")
            raise FileNotFoundError(path)  # the old file was replaced
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(manager_load._native, "read_into", read_into)
    fresh = {key: torch.zeros(1000) for key in "ab"}
    with _sync() as manager, pytest.raises(ChecksumMismatchError) as caught:
        manager.load(checkpoint, into=fresh)
    assert replaced
    message = str(caught.value)
    assert "a.safetensors" in message and "into={'b': ..., 'a': ...}" in message, message


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_an_optimizer_state_with_a_step_of_one_element_loads(
    tmp_path: Path, cls: type[torch.optim.Optimizer]
) -> None:
    """torch 1.12/1.13 Adam and AdamW with ``capturable=True`` saved ``state[i]["step"]`` as a
    tensor of shape (1,), which torch's ``load_state_dict`` takes. Before, the check of the
    saved state against the parameters' shapes compared ``step`` too and refused that
    legitimate state ("the parameters were passed in another order"); now only the keys
    those classes keep in their parameters' shape are compared."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = cls(params)
    (params[0].sum() + params[1].sum()).backward()
    optimizer.step()
    saved = optimizer.state_dict()
    for state in saved["state"].values():
        state["step"] = state["step"].reshape(1)  # the torch 1.12/1.13 capturable layout
    fresh = cls([torch.nn.Parameter(torch.zeros(8, 4)), torch.nn.Parameter(torch.zeros(4))])
    with _sync() as manager:
        manager.save(tmp_path / "c", {"opt": saved})
        manager.load(tmp_path / "c", into={"opt": fresh})
    loaded = fresh.state_dict()["state"]
    assert torch.equal(loaded[0]["exp_avg"], saved["state"][0]["exp_avg"])
    assert loaded[0]["step"].shape == (1,)
    # A moment of another shape is still refused.
    saved["state"][1]["exp_avg"] = torch.zeros(5)
    with _sync() as manager:
        manager.save(tmp_path / "d", {"opt": saved})
        with pytest.raises(CheckpointMismatchError, match=r"state\.1\.exp_avg"):
            manager.load(tmp_path / "d", into={"opt": fresh})
