"""fastckpt.integrations.lightning: real ``Trainer.fit`` runs on CPU, stopped and resumed
through fastckpt, compared bit for bit with Lightning's own ``TorchCheckpointIO``."""

from __future__ import annotations

import enum
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
from fastckpt.container.lazy import safe_open
from fastckpt.errors import ChecksumMismatchError, UntrustedTargetError

L = pytest.importorskip("lightning", reason="the 'lightning' extra is not installed")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import TorchCheckpointIO  # noqa: E402

from fastckpt.integrations.lightning import (  # noqa: E402
    AsyncFastCheckpointIO,
    FastCheckpointIO,
    load_lightning_checkpoint,
)

STOP, END = 6, 11  # 4 batches per epoch: the run stops mid-epoch and resumes there


@pytest.fixture(autouse=True)
def quiet_lightning() -> Iterator[None]:
    """Lightning's info logs and tips say nothing these tests check; ``deterministic=True``
    turns torch's deterministic mode on for the whole process: later tests get it back off."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logger.setLevel(level)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


class TinyModule(L.LightningModule):
    """Linear -> BatchNorm (a buffer, and a state_dict with module versions) -> Linear, Adam
    with a step scheduler: every kind of state a resume has to restore."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def loader(shuffle: bool) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)
    )
    order = torch.Generator().manual_seed(2) if shuffle else None
    return DataLoader(data, batch_size=8, shuffle=shuffle, generator=order)


def fit(
    io: Any, dirpath: Path, max_steps: int, ckpt_path: Path | None = None, shuffle: bool = True
) -> tuple[TinyModule, Any]:
    """One deterministic CPU run; checkpoints every 2 steps, top 2 by loss, plus last."""
    torch.manual_seed(0)
    module = TinyModule()
    trainer = L.Trainer(
        max_steps=max_steps,
        plugins=[io],
        accelerator="cpu",
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=dirpath,
        callbacks=[
            ModelCheckpoint(
                dirpath=dirpath,
                monitor="train_loss",
                save_top_k=2,
                every_n_train_steps=2,
                save_last=True,
            )
        ],
    )
    trainer.fit(module, loader(shuffle), ckpt_path=ckpt_path)
    return module, trainer


def assert_same_state(a: TinyModule, b: TinyModule) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def assert_equal_nests(a: Any, b: Any, path: str = "") -> None:
    """Equal structure, equal leaves, tensors bit for bit (dict types may differ)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for key in a:
            assert_equal_nests(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_nests(x, y, f"{path}.{i}")
    else:
        assert a == b and type(a) is type(b), path


def without_paths(checkpoint: dict[str, Any], directory: Path) -> dict[str, Any]:
    """ModelCheckpoint's state names its own directory: make two runs' states comparable."""
    text = str(directory)

    def fix(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(text, "<dir>")
        if isinstance(value, dict):
            return {fix(k): fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    return fix(checkpoint)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def torch_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same run through Lightning's own TorchCheckpointIO: stopped, then resumed."""
    directory = tmp_path_factory.mktemp("torch_io")
    stopped, _ = fit(TorchCheckpointIO(), directory, STOP)
    names = sorted(os.listdir(directory))
    last = torch.load(directory / "last.ckpt", weights_only=False)
    resumed, _ = fit(TorchCheckpointIO(), directory, END, directory / "last.ckpt")
    return {
        "dir": directory,
        "stopped": stopped,
        "names": names,
        "last": last,
        "resumed": resumed,
        "resumed_names": sorted(os.listdir(directory)),
    }


IO_KINDS: dict[str, Callable[[], Any]] = {
    "sync": FastCheckpointIO,
    "async": AsyncFastCheckpointIO,
}


@pytest.mark.parametrize("kind", list(IO_KINDS))
def test_fit_stop_resume_matches_torch_checkpoint_io_bitwise(
    kind: str, tmp_path: Path, torch_reference: dict[str, Any]
) -> None:
    directory = tmp_path / "ckpts"
    stopped, _ = fit(IO_KINDS[kind](), directory, STOP)
    assert_same_state(stopped, torch_reference["stopped"])
    # ModelCheckpoint kept and removed the same checkpoints (top 2 by loss, and last)
    assert sorted(os.listdir(directory)) == torch_reference["names"]
    for name in torch_reference["names"]:
        assert (directory / name / "commit.json").is_file()
        assert fastckpt.verify(directory / name).ok
    # what was saved is what Lightning's own checkpoint holds, tensors bit for bit
    ours = load_lightning_checkpoint(directory / "last.ckpt")
    assert_equal_nests(
        without_paths(ours, directory),
        without_paths(torch_reference["last"], torch_reference["dir"]),
    )

    resumed, trainer = fit(IO_KINDS[kind](), directory, END, directory / "last.ckpt")
    assert trainer.global_step == END
    assert_same_state(resumed, torch_reference["resumed"])
    assert sorted(os.listdir(directory)) == torch_reference["resumed_names"]


def test_resume_at_an_epoch_boundary_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    fit(FastCheckpointIO(), tmp_path / "a", 4, shuffle=False)
    resumed, _ = fit(
        FastCheckpointIO(), tmp_path / "a", 8, tmp_path / "a" / "last.ckpt", shuffle=False
    )
    straight, _ = fit(FastCheckpointIO(), tmp_path / "b", 8, shuffle=False)
    assert_same_state(resumed, straight)


def test_checkpoints_are_fastckpt_manager_checkpoints(
    tmp_path: Path, torch_reference: dict[str, Any]
) -> None:
    directory = tmp_path / "ckpts"
    module, _ = fit(FastCheckpointIO(), directory, 2)
    path = directory / "last.ckpt"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as mgr:
        loaded = mgr.load(path)
    weight = module.net[0].weight.detach()
    assert torch.equal(loaded["checkpoint"]["state_dict"]["net.0.weight"], weight)
    with safe_open(path, part="checkpoint") as handle:
        assert torch.equal(handle.get_tensor("state_dict.net.0.weight"), weight)
    # the state_dict keeps the modules' versions (BatchNorm reads them on load)
    for location in (None, "cpu"):
        ours = load_lightning_checkpoint(path, map_location=location)
        assert ours["state_dict"]._metadata == module.state_dict()._metadata
    # a TorchCheckpointIO file loads through the plugin too (switching a run over)
    torch_file = torch_reference["dir"] / "last.ckpt"
    assert_equal_nests(
        FastCheckpointIO().load_checkpoint(torch_file), torch.load(torch_file, weights_only=False)
    )


def test_a_corrupted_checkpoint_fails_the_resume_naming_the_file(tmp_path: Path) -> None:
    directory = tmp_path / "ckpts"
    fit(FastCheckpointIO(), directory, 2)
    tensors = directory / "last.ckpt" / "checkpoint.safetensors"
    info = fastckpt.read_metadata(tensors)
    begin, _ = info["tensors"]["state_dict.net.0.weight"]["data_offsets"]
    with open(tensors, "r+b") as handle:
        handle.seek(info["data_start"] + begin)
        byte = handle.read(1)
        handle.seek(info["data_start"] + begin)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=r"state_dict\.net\.0\.weight") as caught:
        fit(FastCheckpointIO(), directory, 4, directory / "last.ckpt")
    assert str(tensors) in str(caught.value)


class Opaque:
    """A user object JSON cannot hold."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


def checkpoint_with(extra: Any) -> dict[str, Any]:
    return {
        "epoch": 1,
        "global_step": 10,
        "state_dict": {"w": torch.arange(4.0)},
        "hyper_parameters": {"lr": 0.1, "extra": extra},
    }


def test_values_json_cannot_hold_are_refused_by_default(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    with pytest.raises(TypeError, match=r"hyper_parameters\.extra: .*Opaque.*allow_pickle"):
        FastCheckpointIO().save_checkpoint(checkpoint_with(Opaque(3)), path)
    assert not path.exists()
    assert not [p for p in tmp_path.iterdir() if p.name != "x.ckpt"]  # no temporary left
    with pytest.raises(TypeError, match="reserved"):
        FastCheckpointIO().save_checkpoint(checkpoint_with({"__fastckpt_pickled__": 0}), path)


def test_pickled_values_load_only_through_the_weights_only_unpickler(tmp_path: Path) -> None:
    io = FastCheckpointIO(allow_pickle=True)
    allowed = tmp_path / "allowed.ckpt"
    io.save_checkpoint(checkpoint_with([torch.float16, torch.Size([2, 3])]), allowed)
    loaded = io.load_checkpoint(allowed)
    assert loaded["hyper_parameters"]["extra"] == [torch.float16, torch.Size([2, 3])]
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))

    opaque = tmp_path / "opaque.ckpt"
    io.save_checkpoint(checkpoint_with({"thing": Opaque(5), "path": pathlib.Path("p")}), opaque)
    with pytest.raises(UntrustedTargetError, match=r"hyper_parameters\.extra\.thing"):
        io.load_checkpoint(opaque)
    with pytest.raises(UntrustedTargetError):  # never a general unpickler, even when asked
        io.load_checkpoint(opaque, weights_only=False)
    torch.serialization.add_safe_globals([Opaque, type(pathlib.Path("p"))])
    try:
        trusted = io.load_checkpoint(opaque)
    finally:
        torch.serialization.clear_safe_globals()
    assert trusted["hyper_parameters"]["extra"] == {"thing": Opaque(5), "path": pathlib.Path("p")}

    torch_file = tmp_path / "torch.ckpt"  # a TorchCheckpointIO file: the same guard
    torch.save(checkpoint_with(Opaque(1)), torch_file)
    with pytest.raises(UntrustedTargetError, match=r"torch\.ckpt"):
        io.load_checkpoint(torch_file, weights_only=False)


def test_remove_checkpoint_handles_directories_files_links_and_absence(tmp_path: Path) -> None:
    io = FastCheckpointIO()
    directory = tmp_path / "a.ckpt"
    io.save_checkpoint(checkpoint_with(1), directory)
    link = tmp_path / "last.ckpt"
    link.symlink_to(directory.name)
    single = tmp_path / "torch.ckpt"
    torch.save({"x": 1}, single)
    io.remove_checkpoint(link)
    assert not os.path.lexists(link) and directory.is_dir()  # the link, not its target
    io.remove_checkpoint(directory)
    io.remove_checkpoint(single)
    io.remove_checkpoint(tmp_path / "never-written.ckpt")
    assert sorted(os.listdir(tmp_path)) == []


def test_a_failed_background_write_is_raised_by_the_next_call(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where a directory must go")
    io = AsyncFastCheckpointIO()
    io.save_checkpoint(checkpoint_with(1), blocker / "x.ckpt")  # fails on the writer thread
    with pytest.raises(RuntimeError, match="background checkpoint write") as caught:
        io.save_checkpoint(checkpoint_with(2), tmp_path / "y.ckpt")
    assert isinstance(caught.value.__cause__, OSError)
    io.save_checkpoint(checkpoint_with(3), tmp_path / "y.ckpt")  # raised once: next one works
    io.teardown()
    assert io.load_checkpoint(tmp_path / "y.ckpt")["hyper_parameters"]["extra"] == 3


def test_async_io_waits_at_most_its_timeout_and_keeps_the_write_tracked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin runs on fastckpt's one async engine: a save that finds the previous write
    still running after ``wait_timeout`` raises ``TimeoutError`` naming it, the write stays
    tracked, and the next save after it ended goes through."""
    from fastckpt.integrations import lightning as plugin

    release = threading.Event()
    real = plugin.write_plan

    def slow(*args: Any, **kwargs: Any) -> None:
        assert release.wait(60)
        real(*args, **kwargs)

    monkeypatch.setattr(plugin, "write_plan", slow)
    io = AsyncFastCheckpointIO(wait_timeout=0.2)
    io.save_checkpoint(checkpoint_with(1), tmp_path / "a.ckpt")
    with pytest.raises(TimeoutError, match=r"a\.ckpt is still running after 0\.2 s"):
        io.save_checkpoint(checkpoint_with(2), tmp_path / "b.ckpt")
    release.set()
    io.save_checkpoint(checkpoint_with(2), tmp_path / "b.ckpt")
    io.teardown()
    assert io.load_checkpoint(tmp_path / "a.ckpt")["hyper_parameters"]["extra"] == 1
    assert io.load_checkpoint(tmp_path / "b.ckpt")["hyper_parameters"]["extra"] == 2


def test_async_io_removes_a_replaced_checkpoint_only_once_its_replacement_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ModelCheckpoint`` removes the previous checkpoint right after submitting the save
    that replaces it: the removal is put off until that write is durable (the next save,
    load or teardown), and when the write fails the previous checkpoint is kept. Before, it
    was removed at once, and a crash during the write (Lightning's default checkpointing,
    SIGKILLed) left no checkpoint at all."""
    from fastckpt.integrations import lightning as plugin

    release = threading.Event()
    real = plugin.write_plan

    def slow(target: Path, *args: Any, **kwargs: Any) -> None:
        if target.name != "first.ckpt":
            assert release.wait(60)
        if target.name == "fails.ckpt":
            raise OSError(28, "No space left on device")
        real(target, *args, **kwargs)

    monkeypatch.setattr(plugin, "write_plan", slow)
    io = AsyncFastCheckpointIO()
    io.save_checkpoint(checkpoint_with(1), tmp_path / "first.ckpt")
    io.wait()
    io.save_checkpoint(checkpoint_with(2), tmp_path / "second.ckpt")  # in flight
    io.remove_checkpoint(tmp_path / "first.ckpt")
    assert (tmp_path / "first.ckpt").exists()  # the newest durable checkpoint stays
    release.set()
    io.wait()
    assert not (tmp_path / "first.ckpt").exists()
    release.clear()
    io.save_checkpoint(checkpoint_with(3), tmp_path / "fails.ckpt")  # in flight, fails
    io.remove_checkpoint(tmp_path / "second.ckpt")
    release.set()
    with pytest.raises(RuntimeError, match="background checkpoint write"):
        io.teardown()
    assert io.load_checkpoint(tmp_path / "second.ckpt")["hyper_parameters"]["extra"] == 2


def test_async_io_guard_keeps_a_copy_from_seeing_a_half_updated_state(tmp_path: Path) -> None:
    """A thread mutating the state under ``guard()`` excludes the save's copy: the saved
    tensors are from before or after the whole update, never between."""
    io = AsyncFastCheckpointIO()
    checkpoint = checkpoint_with(1)
    a, b = torch.zeros(1 << 16), torch.zeros(1 << 16)
    checkpoint["state_dict"] = {"a": a, "b": b}
    inside = threading.Event()

    def update() -> None:
        with io.guard():
            a.add_(1)
            inside.set()
            time.sleep(0.3)  # the save below starts while the update is half done
            b.add_(1)

    thread = threading.Thread(target=update)
    thread.start()
    assert inside.wait(10)
    io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    thread.join()
    io.teardown()
    saved = io.load_checkpoint(tmp_path / "x.ckpt")["state_dict"]
    assert torch.equal(saved["a"], saved["b"]) and float(saved["a"][0]) == 1.0


def test_async_io_finishes_a_pending_write_at_interpreter_exit(tmp_path: Path) -> None:
    """A script that never calls ``teardown`` (no ``fit``) still gets its last write: the
    engine finishes it when the interpreter exits."""
    code = f"""
import time, torch
from fastckpt.integrations import lightning as plugin
real = plugin.write_plan
def slow(*args, **kwargs):
    time.sleep(1.0)
    real(*args, **kwargs)
plugin.write_plan = slow
io = plugin.AsyncFastCheckpointIO()
state = {{"state_dict": {{"w": torch.arange(8.0)}}, "epoch": 3}}
io.save_checkpoint(state, {str(tmp_path / "x.ckpt")!r})
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = FastCheckpointIO().load_checkpoint(tmp_path / "x.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(8.0)) and loaded["epoch"] == 3


def test_async_io_writes_large_items_from_a_file_image(tmp_path: Path) -> None:
    io = AsyncFastCheckpointIO()
    checkpoint = checkpoint_with(1)
    checkpoint["state_dict"] = {"w": torch.randn(512, 256), "b": torch.zeros(256)}  # 513 KiB
    expected = checkpoint["state_dict"]["w"].clone()
    io.save_checkpoint(checkpoint, tmp_path / "x.ckpt")
    checkpoint["state_dict"]["w"].add_(1)  # after the capture: not in the checkpoint
    io.teardown()
    files = sorted((tmp_path / "x.ckpt").rglob("*.safetensors"))
    starts = {f.name: 8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files}
    # The item holding the state dict went through its image (data aligned to 4096 bytes).
    assert 4096 in starts.values(), starts
    loaded = io.load_checkpoint(tmp_path / "x.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], expected)


def test_storage_options_and_urls_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        FastCheckpointIO().save_checkpoint(checkpoint_with(1), tmp_path / "x.ckpt", {"a": 1})
    monkeypatch.chdir(tmp_path)
    for io in (FastCheckpointIO(), AsyncFastCheckpointIO()):
        with pytest.raises(ValueError, match=r"s3://bucket/run/last\.ckpt: .*local"):
            io.save_checkpoint(checkpoint_with(1), "s3://bucket/run/last.ckpt")
        with pytest.raises(ValueError, match="URLs"):
            io.load_checkpoint("s3://bucket/run/last.ckpt")
    assert list(tmp_path.iterdir()) == []  # no local 's3:' directory


def test_save_last_as_a_link_and_ckpt_path_last_resolve_to_fastckpt_directories(
    tmp_path: Path,
) -> None:
    def run(max_steps: int, ckpt_path: str | None) -> Any:
        torch.manual_seed(0)
        trainer = L.Trainer(
            max_steps=max_steps,
            plugins=[FastCheckpointIO()],
            accelerator="cpu",
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            default_root_dir=tmp_path,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last="link")],
        )
        trainer.fit(TinyModule(), loader(shuffle=False), ckpt_path=ckpt_path)
        return trainer

    run(4, None)
    last = tmp_path / "last.ckpt"
    assert last.is_symlink() and (last / "commit.json").is_file()
    assert load_lightning_checkpoint(last)["global_step"] == 4
    resumed = run(6, "last")
    assert resumed.global_step == 6
    assert load_lightning_checkpoint(last)["global_step"] == 6


CRASH_WRITER = """
import sys
import torch
from fastckpt.integrations.lightning import FastCheckpointIO

io = FastCheckpointIO()
step = 0
while True:
    step += 1
    io.save_checkpoint(
        {"global_step": step, "state_dict": {"w": torch.full((4 << 20,), float(step))}},
        sys.argv[1],
    )
    print(step, flush=True)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        committed = [int(child.stdout.readline()) for _ in range(2)]
        time.sleep(0.02)  # inside the next 16 MiB save
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        committed += [int(line) for line in child.stdout.read().split()]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    loaded = load_lightning_checkpoint(path)
    step = loaded["global_step"]
    assert step in (committed[-1], committed[-1] + 1)  # the last reported one, or one that
    # committed before the kill but was not reported yet: never a mix, never a torn file
    assert torch.equal(loaded["state_dict"]["w"], torch.full((4 << 20,), float(step)))
    assert fastckpt.verify(path).ok


ASYNC_KILLED_WRITER = """
import os, sys, time
import torch
import fastckpt.integrations.lightning as plugin

real = plugin.write_plan
def slow_disk(*args, **kwargs):  # a slow disk: the kill lands inside this write
    if "step=2" in str(args[0]):
        time.sleep(60)
    return real(*args, **kwargs)
plugin.write_plan = slow_disk
io = plugin.AsyncFastCheckpointIO()
folder = sys.argv[1]
for step in (1, 2):
    io.save_checkpoint({"global_step": step, "state_dict": {"w": torch.full((4,), float(step))}},
                       os.path.join(folder, f"epoch=0-step={step}.ckpt"))
    os.symlink(f"epoch=0-step={step}.ckpt", os.path.join(folder, f"last-{step}.ckpt"))
    os.replace(os.path.join(folder, f"last-{step}.ckpt"), os.path.join(folder, "last.ckpt"))
    print(step, flush=True)  # as ModelCheckpoint(save_last="link") does after each save
time.sleep(60)
"""


def test_a_save_interrupted_in_flight_says_which_checkpoint_to_resume_from(tmp_path: Path) -> None:
    """A SIGKILL while an async save is written leaves its reserved, empty folder, and a
    ``save_last="link"`` last.ckpt pointing at it: ``ckpt_path="last"`` failed on every
    restart with "not a committed fastckpt checkpoint (no commit.json)". Now the error says it
    is an interrupted save and names the newest committed checkpoint beside it."""
    child = subprocess.Popen(
        [sys.executable, "-c", ASYNC_KILLED_WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert [child.stdout.readline().strip() for _ in range(2)] == ["1", "2"]
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert os.listdir(tmp_path / "epoch=0-step=2.ckpt") == []
    newest = tmp_path / "epoch=0-step=1.ckpt"
    # A complete staging folder a killed save never put in place is no checkpoint to resume
    # from, however new its record (before, the message named it as the newest committed).
    staged = tmp_path / ".tmp-epoch=0-step=3.ckpt~1~host~0badcafe"
    shutil.copytree(newest, staged)
    (staged / "commit.json").touch()
    with pytest.raises(FileNotFoundError, match=r"empty folder.*interrupted.*step=1\.ckpt"):
        AsyncFastCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert load_lightning_checkpoint(newest)["global_step"] == 1
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_lightning_checkpoint(tmp_path / "missing.ckpt")


class _Scored(TinyModule):
    """Logs a fixed score per step: the first checkpoint is the best, the next worse."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("score", [1.0, 5.0, 4.0, 3.0, 2.0, 6.0][self.global_step % 6])
        return loss


def test_model_checkpoint_gives_a_pending_async_save_s_name_to_no_other_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ModelCheckpoint`` names a save ``ck-v1.ckpt`` when ``ck.ckpt`` exists: an async save's
    path exists when ``save_checkpoint`` returns, so the best checkpoint keeps its name and
    content, as with ``TorchCheckpointIO``. Before, the pending ``ck.ckpt`` did not exist yet,
    the next (worse) save took its name, and the best checkpoint (step 1) was replaced."""
    import fastckpt.integrations.lightning as plugin

    write = plugin.write_plan

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.2)  # a slow disk: the write is pending when the next save is named
        write(*args, **kwargs)

    monkeypatch.setattr(plugin, "write_plan", slow)
    callback = ModelCheckpoint(
        dirpath=tmp_path, filename="ck", monitor="score", save_top_k=2, every_n_train_steps=1
    )
    trainer = L.Trainer(
        max_steps=6,
        plugins=[AsyncFastCheckpointIO()],
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback],
    )
    torch.manual_seed(0)
    trainer.fit(_Scored(), loader(False))
    scores = {Path(k).name: float(v) for k, v in callback.best_k_models.items()}
    assert scores == {"ck.ckpt": 1.0, "ck-v1.ckpt": 2.0}
    io = AsyncFastCheckpointIO()
    steps = {name: io.load_checkpoint(tmp_path / name)["global_step"] for name in scores}
    io.teardown()
    assert steps == {"ck.ckpt": 1, "ck-v1.ckpt": 5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck-v1.ckpt", "ck.ckpt"]


@pytest.mark.parametrize("plugin", [FastCheckpointIO, AsyncFastCheckpointIO])
def test_a_save_into_a_folder_of_other_files_is_refused(tmp_path: Path, plugin: type) -> None:
    """``trainer.save_checkpoint("outputs")`` (the folder, not a file in it) is refused,
    naming what is there; nothing is deleted. A ``torch.save`` file of the same name is
    replaced, as ``TorchCheckpointIO`` replaces it. Before, the folder's files (another
    checkpoint, results) were deleted by the save."""
    outputs = tmp_path / "outputs"
    (outputs / "older.ckpt").mkdir(parents=True)
    (outputs / "results.csv").write_text("a,b\n")
    io = plugin()
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "global_step": 3}
    with pytest.raises(fastckpt.errors.NotACheckpointError, match=r"results\.csv"):
        io.save_checkpoint(checkpoint, outputs)
    assert sorted(p.name for p in outputs.iterdir()) == ["older.ckpt", "results.csv"]
    torch.save({"global_step": 1}, tmp_path / "last.ckpt")
    io.save_checkpoint(checkpoint, tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 3
    io.teardown()


def test_a_damaged_torch_file_is_a_format_error_not_an_untrusted_one(tmp_path: Path) -> None:
    """A truncated, empty or garbage ``torch.save`` file is a ``CheckpointFormatError`` saying
    it is damaged; only the weights-only unpickler's refusal is ``UntrustedTargetError``.
    Before, all were "untrusted", with advice to allow-list types."""
    good = tmp_path / "good.ckpt"
    torch.save({"global_step": 1, "w": torch.ones(3)}, good)
    damaged = {
        "truncated": good.read_bytes()[:-40],
        "empty": b"",
        "garbage": b"not a checkpoint at all",
    }
    io = FastCheckpointIO()
    for name, data in damaged.items():
        path = tmp_path / f"{name}.ckpt"
        path.write_bytes(data)
        with pytest.raises(fastckpt.CheckpointFormatError, match="damaged"):
            io.load_checkpoint(path)
    torch.save([1, 2], tmp_path / "list.ckpt")
    with pytest.raises(fastckpt.CheckpointFormatError, match="not a Lightning checkpoint"):
        io.load_checkpoint(tmp_path / "list.ckpt")


class _Level(enum.IntEnum):
    LOW = 1


class _Act(enum.StrEnum):
    RELU = "relu"


def test_enums_and_numpy_scalars_are_never_stored_as_their_base_type(tmp_path: Path) -> None:
    """An ``IntEnum``, a ``str`` enum, a numpy float, and an enum dict key are refused by
    default (naming the key) and stored with their type under ``allow_pickle=True``. Before,
    they were stored as plain int/str/float without a word and came back so (a rebuilt
    module's ``hparams.act.name`` raised AttributeError)."""
    import numpy as np

    torch.serialization.add_safe_globals([_Level, _Act])
    values = {"lvl": _Level.LOW, "act": _Act.RELU, "f": np.float64(0.1), "keyed": {_Level.LOW: 1}}
    for key, value in values.items():
        with pytest.raises(TypeError, match=r"hyper_parameters\.extra.*allow_pickle"):
            FastCheckpointIO().save_checkpoint(checkpoint_with({key: value}), tmp_path / key)
    io = FastCheckpointIO(allow_pickle=True)
    io.save_checkpoint(checkpoint_with({"lvl": _Level.LOW, "act": _Act.RELU}), tmp_path / "ok")
    loaded = io.load_checkpoint(tmp_path / "ok")["hyper_parameters"]["extra"]
    assert loaded["lvl"] is _Level.LOW and loaded["act"] is _Act.RELU


@pytest.mark.parametrize("kind", ["dicts", "tuples"])
def test_a_checkpoint_nested_too_deeply_to_load_is_refused_at_save(
    tmp_path: Path, kind: str
) -> None:
    """Hyperparameters nested past what a load reads (198 dicts, or 99 tuples: a tuple takes
    two levels as stored). Before, the save succeeded and every load failed with "nested more
    than 200 levels deep; fastckpt never writes such a document (it was edited or damaged)";
    at 400+ levels the save died with a bare RecursionError. Now refused at save, naming the
    item, nothing written; a nest well within the limit saves and loads."""
    value: Any = "leaf"
    for _ in range(198 if kind == "dicts" else 99):
        value = {"k": value} if kind == "dicts" else (value,)
    io = FastCheckpointIO()
    path = tmp_path / "deep.ckpt"
    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"cfg": value}}
    where = r"hyper_parameters\.cfg\.k\.k(\.k)+" if kind == "dicts" else "the checkpoint"
    with pytest.raises(TypeError, match=rf"{where}: its dicts, lists and tuples nest too deeply"):
        io.save_checkpoint(checkpoint, path)
    assert not path.exists()
    deeper: Any = "leaf"
    for _ in range(1000):
        deeper = {"k": deeper}
    with pytest.raises(TypeError, match="nest too deeply"):
        io.save_checkpoint({"hyper_parameters": deeper}, path)
    shallow: Any = "leaf"
    for _ in range(150):
        shallow = {"k": shallow}
    io.save_checkpoint({"hyper_parameters": {"cfg": shallow}}, path)
    assert io.load_checkpoint(path)["hyper_parameters"]["cfg"] == shallow


def test_a_checkpoint_a_killed_replace_left_aside_is_put_back_by_the_load(tmp_path: Path) -> None:
    """Where the filesystem cannot exchange two paths (NFS), a replace of ``last.ckpt`` renames
    the committed checkpoint aside (``.trash-last.ckpt~<pid>~<host>~...``), then the new one
    in: a kill between the two left no ``last.ckpt``. Only the next save put it back; before,
    a load of that path said "no such checkpoint", the trained checkpoint hidden. The load
    now puts back what a dead process left aside, then loads it."""
    from fastckpt.storage.backend import HOST, TRASH_PREFIX

    io = FastCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "global_step": 7}, path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.rename(tmp_path / f"{TRASH_PREFIX}last.ckpt~{dead.pid}~{HOST}~0badc0de")
    with pytest.warns(RuntimeWarning, match="put back; a replace killed between its two"):
        loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 7 and torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
