"""Crash-consistency harness: SIGKILL processes that are saving checkpoints, check what survives.

A child process trains a small model with Adam and saves after every step, in a loop, with
one of these writers: ``fastckpt.save_checkpoint`` (mode ``save_checkpoint``, pruning to the
last 3 indices), an async ``fastckpt.CheckpointManager`` rotating over 3 checkpoint
directories (mode ``manager_async``), a ``TrainingStrategy`` run with an async
``CheckpointHook(step_interval=1, keep_last=3)`` (mode ``checkpoint_hook``), incremental
``save_checkpoint`` + ``prune`` to 2 of a model with a frozen buffer, whose later saves
reference the first index of their process, so prunes set referenced bytes aside as
``.ref-<index>`` (mode ``prune``), or the same with 3 kept in an ``s3://`` root on a local
moto server the harness starts, where the store copies the frozen 12 MiB (UploadPartCopy)
and writers hold a 1.5 s lease (mode ``s3``). Its weights encode the iteration (step)
number. It reports ``saving N`` before each save and ``saved N`` once the save was
acknowledged (returned; for the async writers, once its future or the hook's
``last_checkpoint_index`` reported it committed), and ``pruning N`` / ``pruned N`` around
each prune in the last two modes. The harness SIGKILLs it at a random moment: either
anywhere (loading, training, saving) or a random fraction of a save's (or, mostly in mode
``prune``, a prune's) duration after its announcement, so that kills land inside file
writes, fsyncs, renames, uploads, deletions and the manifest commit. After each kill it
checks:

* every committed checkpoint verifies (``fastckpt.verify``) and the latest one loads;
* what loads is bitwise one of the states that were saved (model *and* optimizer state,
  compared with a replay of the same training in this process), never older than the last
  acknowledged save; a manager checkpoint directory that existed never disappears;
* leftovers (``.tmp-*``, ``.trash-*``, manifest temp files) only ever belong to the process
  just killed once it has completed a save: the next save cleans up after crashed ones
  (including index directories an interrupted prune left behind).

The next child resumes from what survived, so every cycle is also a "save in a new process
after a crash". A last child saves once and exits normally: then nothing temporary is left.

Run ``python tools/crash_harness.py --kills 300`` (see ``--help``); ``tests/test_crash.py``
runs a CI-sized version. Children are forked from a ``multiprocessing`` forkserver that has
imported torch and fastckpt once, so a kill cycle costs tens of milliseconds, not an import.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastckpt.format.records import MANIFEST
from fastckpt.storage.backend import ATOMIC_TEMP_INFIX, TEMP_PREFIX, TRASH_PREFIX

WIDTH = 64
HIDDEN = 1024
KEEP_LAST = 3
SLOTS = 3
MODES = ("save_checkpoint", "manager_async", "checkpoint_hook", "prune", "s3")
#: Modes that write a ``save_checkpoint`` root and prune it, announcing each prune.
PRUNING_MODES = ("prune", "s3")
#: Mode ``prune``: indices kept, and the frozen buffer later saves reference (256 KiB).
PRUNE_KEEP_LAST = 2
#: Mode ``s3``: the frozen buffer (12 MiB: incremental saves have the store copy most of it
#: with UploadPartCopy), the indices kept, and the writers' lease (short: a killed writer's
#: lease blocks the next child until it expires).
S3_FROZEN = 3 << 20
S3_KEEP_LAST = 3
S3_LEASE_TTL_S = 1.5
S3_BUCKET = "crash-harness"
#: Imported once by the forkserver, so that children start warm. ``torch._dynamo`` is imported
#: lazily by the first optimizer step otherwise (about a second per child).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.utils.data",
    "fastckpt",
    "fastckpt.verify",
    "crash_harness",
]
TEMP_MARKERS = (TEMP_PREFIX, TRASH_PREFIX, f".{MANIFEST}{ATOMIC_TEMP_INFIX}")

Send = Callable[[str], None]


# --------------------------------------------------------------------------- the training state


class CrashNet(nn.Module):
    """The model the children train: two linear layers and a marker buffer (and, with
    ``frozen`` > 0, a buffer of that many floats that training never changes: incremental
    saves reference it in the first index a process saved)."""

    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN, frozen: int = 0) -> None:
        """Build it (``width`` inputs/outputs, ``hidden`` units, ``frozen`` constant floats)."""
        super().__init__()
        self.width = width
        self.hidden = hidden
        self.inp = nn.Linear(width, hidden)
        self.out = nn.Linear(hidden, width)
        self.register_buffer("marker", torch.zeros(4))
        if frozen:
            values = torch.arange(frozen, dtype=torch.float32).remainder_(997).div_(997)
            self.register_buffer("frozen", values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Compute the output."""
        return self.out(torch.tanh(self.inp(x)))


def fresh_state(frozen: int = 0) -> tuple[CrashNet, torch.optim.Optimizer]:
    """The deterministic starting point (iteration -1); ``frozen``: see :class:`CrashNet`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CrashNet(frozen=frozen)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def encode(model: nn.Module, n: int) -> None:
    """Write ``n`` into the weights (first element of each parameter) and the marker."""
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            param.view(-1)[0] = n + i / 4
        model.get_buffer("marker").fill_(n)


def advance(model: CrashNet, optimizer: torch.optim.Optimizer, n: int) -> None:
    """Iteration ``n``: one Adam step on a fixed batch, then write ``n`` into the weights."""
    x = torch.linspace(-1.0, 1.0, 8 * model.width).reshape(8, model.width) * (1 + n % 5)
    loss = (model(x) - 0.1 * (n % 3)).square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    encode(model, n)


def hook_training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """The ``TrainingStrategy`` loss of mode ``checkpoint_hook``."""
    (x,) = batch
    return (model(x) - 0.1).square().mean()


def hook_loader() -> Any:
    """12 shuffled batches of fixed data (the shuffle draws from the global torch RNG)."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(96, WIDTH, generator=torch.Generator().manual_seed(5))
    return DataLoader(TensorDataset(x), batch_size=8, shuffle=True, num_workers=0)


class StepEncoder:
    """Hook: after each optimizer step, write the step count into the weights."""

    def __call__(self, ctx: Any, stage: Any) -> None:
        """Encode at ``AFTER_OPTIMIZER_STEP`` (inside the strategy's mutation guard)."""
        from fastckpt import TrainingStage

        if stage is TrainingStage.AFTER_OPTIMIZER_STEP:
            encode(ctx.models["main"], ctx.step_count)


def new_hook_strategy(hooks: list[Any]) -> Any:
    """The seeded ``TrainingStrategy`` of mode ``checkpoint_hook`` (RNG: seed 0, then init)."""
    from fastckpt import OptimizerConfig, TrainingStrategy

    torch.manual_seed(0)
    return TrainingStrategy(
        CrashNet(),
        OptimizerConfig(torch.optim.Adam, {"lr": 1e-3}),
        training_fn=hook_training_fn,
        hooks=hooks,
        num_steps=0,
    )


def encoded(model: nn.Module) -> int:
    """The iteration a model's weights encode.

    Raises:
        AssertionError: the tensors disagree (a mix of two states).
    """
    marker = model.get_buffer("marker")
    n = int(marker[0].item())
    assert torch.equal(marker, torch.full_like(marker, n)), f"marker {marker.tolist()}"
    for i, param in enumerate(model.parameters()):
        assert param.view(-1)[0].item() == n + i / 4, f"parameter {i} encodes another iteration"
    return n


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """The first difference between two nests of tensors/values (bitwise), or None."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{path}: expected a tensor, found {type(actual).__name__}"
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            mine, theirs = list(expected.shape), list(actual.shape)
            return f"{path}: {expected.dtype}{mine} vs {actual.dtype}{theirs}"
        return None if torch.equal(expected, actual) else f"{path}: values differ"
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(expected) != set(actual):
            return f"{path}: keys differ"
        for key in expected:
            found = difference(expected[key], actual[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            return f"{path}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            found = difference(a, b, f"{path}.{i}")
            if found:
                return found
        return None
    return None if expected == actual else f"{path}: {expected!r} != {actual!r}"


class Reference:
    """Replays the children's training in this process: the state after each iteration."""

    def __init__(self, keep: int = 16, frozen: int = 0) -> None:
        """Start from :func:`fresh_state` (with ``frozen``), caching the last ``keep`` states."""
        self.keep = keep
        self.frozen = frozen
        self._reset()

    def _reset(self) -> None:
        self.model, self.optimizer = fresh_state(self.frozen)
        self.n = -1
        self.cache: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}

    def state(self, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(model.state_dict(), optimizer.state_dict())`` after iteration ``n``."""
        if n in self.cache:
            return self.cache[n]
        if n < self.n:
            self._reset()
        while self.n < n:
            self.n += 1
            advance(self.model, self.optimizer, self.n)
            self.cache[self.n] = (
                _clone(self.model.state_dict()),
                _clone(self.optimizer.state_dict()),
            )
            self.cache.pop(self.n - self.keep, None)
        return self.cache[n]


class HookReference:
    """Replays mode ``checkpoint_hook`` in this process: the strategy's state after step n."""

    def __init__(self) -> None:
        """Start from :func:`new_hook_strategy` (its RNG kept apart from the caller's)."""
        self._reset()

    def _reset(self) -> None:
        with torch.random.fork_rng(devices=[]):
            self.strategy = new_hook_strategy([StepEncoder()])
            self.rng = torch.get_rng_state()
        self.loader = hook_loader()
        self.cache: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}

    def state(self, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(model.state_dict(), optimizer.state_dict())`` after step ``n``."""
        if n in self.cache:
            return self.cache[n]
        if n < self.strategy.step_count:
            self._reset()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            self.strategy.num_steps = n
            self.strategy.run(self.loader)
            self.rng = torch.get_rng_state()
        self.cache = {
            n: (
                _clone(self.strategy.models["main"].state_dict()),
                _clone(self.strategy.optimizers["main"].state_dict()),
            )
        }
        return self.cache[n]


# --------------------------------------------------------------------------- the children


def child_main(
    mode: str,
    root: str,
    conn: Connection,
    iterations: int,
    options: dict[str, Any] | None = None,
) -> None:
    """Entry point of a child process: save in a loop, reporting over ``conn`` (``options``:
    the object-store options of mode ``s3``, whose ``root`` is an ``s3://`` URL)."""
    torch.set_num_threads(1)
    lock = threading.Lock()

    def send(message: str) -> None:
        with lock:
            conn.send_bytes(message.encode())

    try:
        if mode == "save_checkpoint":
            _child_save_checkpoint(Path(root), send, iterations)
        elif mode == "manager_async":
            _child_manager(Path(root), send, iterations)
        elif mode == "checkpoint_hook":
            _child_checkpoint_hook(Path(root), send, iterations)
        elif mode == "prune":
            _child_pruning(root, send, iterations, PRUNE_FROZEN, PRUNE_KEEP_LAST)
        elif mode == "s3":
            from fastckpt.storage.registry import configure_storage

            configure_storage(root, options)
            _child_pruning(root, send, iterations, S3_FROZEN, S3_KEEP_LAST)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        send("done")
    except BaseException:
        send("error " + traceback.format_exc())
        raise SystemExit(1) from None


def _child_save_checkpoint(root: Path, send: Send, iterations: int) -> None:
    from fastckpt import create_model_spec, load_checkpoint, prune, save_checkpoint

    if (root / MANIFEST).exists():
        loaded = load_checkpoint(root)["models"]["main"]
        model, optimizer = loaded["model"], loaded["optimizers"]["adam"]["optimizer"]
        n = encoded(model) + 1
    else:
        model, optimizer = fresh_state()
        n = 0
    send(f"resumed {n - 1}")
    spec = create_model_spec(CrashNet, width=WIDTH, hidden=HIDDEN)
    for _ in range(iterations):
        advance(model, optimizer, n)
        send(f"saving {n}")
        index = save_checkpoint(
            root,
            models={"main": (model, spec)},
            optimizers={"adam": (optimizer, None)},
            counters={"n": n},
        )
        send(f"saved {n} {index}")
        prune(root, keep_last=KEEP_LAST)
        n += 1


def _child_pruning(root: str, send: Send, iterations: int, frozen: int, keep_last: int) -> None:
    """Modes ``prune`` and ``s3``: incremental ``save_checkpoint`` + ``prune`` of a model with
    a frozen buffer, so that every save after a process's first references (locally) or has
    the store copy (``s3://``) the buffer of that first index, and pruning that index keeps
    its bytes (``.ref-<index>``). Announces ``pruning N`` / ``pruned N`` around each prune."""
    from fastckpt import create_model_spec, load_checkpoint, prune, save_checkpoint
    from fastckpt.format.records import Manifest
    from fastckpt.storage.registry import backend_for, is_local

    backend = backend_for(root)
    if not is_local(backend):
        # Wait out the lease a killed predecessor left (it expires unrenewed) before the
        # first announced save, so that the save durations the kills are timed by are saves.
        with backend.lock(Path(root)):
            pass
    if Manifest.load(root).latest is not None:
        loaded = load_checkpoint(root)["models"]["main"]
        model, optimizer = loaded["model"], loaded["optimizers"]["adam"]["optimizer"]
        n = encoded(model) + 1
    else:
        model, optimizer = fresh_state(frozen)
        n = 0
    send(f"resumed {n - 1}")
    spec = create_model_spec(CrashNet, width=WIDTH, hidden=HIDDEN, frozen=frozen)
    for _ in range(iterations):
        advance(model, optimizer, n)
        send(f"saving {n}")
        index = save_checkpoint(
            root,
            models={"main": (model, spec)},
            optimizers={"adam": (optimizer, None)},
            counters={"n": n},
        )
        send(f"saved {n} {index}")
        send(f"pruning {n}")
        prune(root, keep_last=keep_last)
        send(f"pruned {n}")
        n += 1


def manager_slots(root: Path, manager: Any) -> dict[int, tuple[int, dict[str, Any]]]:
    """``{slot: (n, state)}`` for every manager checkpoint directory present under ``root``."""
    found = {}
    for slot in range(SLOTS):
        directory = root / f"slot{slot}"
        if directory.exists():
            state = manager.load(directory)
            found[slot] = (int(state["meta"]["n"]), state)
    return found


def _child_manager(root: Path, send: Send, iterations: int) -> None:
    from fastckpt import CheckpointManager

    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    model, optimizer = fresh_state()
    n = 0
    slots = manager_slots(root, manager)
    if slots:
        latest, state = max(slots.values(), key=lambda item: item[0])
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        n = latest + 1
    send(f"resumed {n - 1}")

    def report(future: Any, n: int) -> None:
        error = future.exception()
        send(f"saved {n}" if error is None else f"error save {n} failed: {error!r}")

    for _ in range(iterations):
        with manager.lock():  # the previous snapshot must be captured before we mutate
            advance(model, optimizer, n)
        send(f"saving {n}")
        future = manager.save(
            root / f"slot{n % SLOTS}",
            {"model": model.state_dict(), "optim": optimizer.state_dict(), "meta": {"n": n}},
        )
        assert future is not None
        future.add_done_callback(functools.partial(report, n=n))
        n += 1
    manager.close()


class _HookReporter:
    """Reports around the CheckpointHook at AFTER_BATCH: ``saving N`` before it (it is about
    to snapshot step N), ``saved N`` after it once its ``last_checkpoint_index`` moved (it
    collects the previous background write when it starts the next one; index = step - 1)."""

    def __init__(self, send: Send, hook: Any, *, before: bool) -> None:
        self.send, self.hook, self.before = send, hook, before
        self.reported: int | None = None

    def __call__(self, ctx: Any, stage: Any) -> None:
        from fastckpt import TrainingStage

        if stage is not TrainingStage.AFTER_BATCH:
            return
        if self.before:
            self.send(f"saving {ctx.step_count}")
            return
        self.report()

    def report(self) -> None:
        """Send ``saved N`` if the hook collected a newer committed index."""
        index = self.hook.last_checkpoint_index
        if index is not None and index != self.reported:
            self.reported = index
            self.send(f"saved {index + 1}")


def _child_checkpoint_hook(root: Path, send: Send, iterations: int) -> None:
    from fastckpt import CheckpointHook, TrainingStrategy

    hook = CheckpointHook(root, step_interval=1, async_save=True, keep_last=KEEP_LAST)
    after = _HookReporter(send, hook, before=False)
    hooks = [StepEncoder(), _HookReporter(send, hook, before=True), hook, after]
    if (root / MANIFEST).exists():
        strategy = TrainingStrategy.load_checkpoint(root, training_fn=hook_training_fn, hooks=hooks)
    else:
        strategy = new_hook_strategy(hooks)
    send(f"resumed {strategy.step_count}")
    strategy.num_steps = strategy.step_count + iterations
    strategy.run(hook_loader())  # leaving run() flushes the last background write
    after.report()


# --------------------------------------------------------------------------- other children


def concurrent_saver(root: str, writer: int, count: int, api: str, conn: Connection) -> None:
    """Child of the concurrent-writers tests: ``count`` saves into ``root``, then sends the
    indices it got. Each saved model's marker is ``1000 * writer + i``.

    ``api``: ``"save_checkpoint"`` or ``"index_writer"`` (``IndexWriter(root, None)``).
    """
    torch.set_num_threads(1)
    from fastckpt import create_model_spec, save_checkpoint
    from fastckpt.container.commit import IndexWriter

    spec = create_model_spec(CrashNet, width=8, hidden=8)
    indices = []
    try:
        for i in range(count):
            model = CrashNet(width=8, hidden=8)
            model.get_buffer("marker").fill_(1000 * writer + i)
            counters = {"writer": writer, "i": i}
            if api == "save_checkpoint":
                index = save_checkpoint(root, models={"main": (model, spec)}, counters=counters)
            else:
                index_writer = IndexWriter(Path(root), None)
                try:
                    index_writer.add_tensors("models/main.safetensors", model.state_dict())
                    index_writer.commit_entry(
                        {"created": "", "counters": counters, "components": {}, "associations": {}}
                    )
                except BaseException:
                    index_writer.abort()
                    raise
                index = index_writer.index
            indices.append(index)
        conn.send(("ok", indices))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def hold_root_lock(root: str, conn: Connection) -> None:
    """Child of the lock tests: take the root lock, say so, and wait to be killed."""
    from fastckpt.container.commit import RootLock

    lock = RootLock(Path(root))
    lock.acquire()
    conn.send_bytes(b"locked")
    time.sleep(600)


def replace_index_and_die(root: str, index: int, moment: str, conn: Connection) -> None:
    """Child: replace committed ``index`` of ``root`` and SIGKILL itself at ``moment`` of the
    replacement: ``withdrawn`` (right after the manifest withdrew the index), ``set aside``
    (the old directory renamed aside, the new one not in place) or ``published`` (the new
    directory in place, the manifest not yet naming it)."""
    from fastckpt.container.commit import IndexWriter
    from fastckpt.format.records import Manifest

    writer = IndexWriter(Path(root), index)
    writer.add_tensors("models/main.safetensors", {"x": torch.ones(3)})
    swap = writer.commit

    def die() -> None:
        conn.send_bytes(moment.encode())
        os.kill(os.getpid(), signal.SIGKILL)

    if moment == "withdrawn":
        commit = Manifest.commit

        def commit_then_die(self: Manifest) -> None:
            commit(self)
            die()

        Manifest.commit = commit_then_die  # type: ignore[method-assign]
    elif moment == "set aside":
        writer.commit = die  # type: ignore[method-assign]
    else:

        def swap_then_die() -> None:
            swap()
            die()

        writer.commit = swap_then_die  # type: ignore[method-assign]
    writer.commit_entry({"created": "", "counters": {}, "components": {}, "associations": {}})


#: Floats of the frozen buffer of the prune children (256 KiB, referenced by later saves).
PRUNE_FROZEN = 64 * 1024


class MutationCounter:
    """Counts the filesystem mutations this process makes (links, renames, unlinks, rmdirs,
    mkdirs, directory fsyncs and commit-record writes) once :meth:`arm` was called, and
    SIGKILLs the process right before mutation number ``kill_at`` (0: never).

    Installed by patching the functions every store operation goes through (``os``'s, the
    Rust core's ``fsync_dir`` and the local backend's ``put_record``), so every step of a
    prune, including each file its directory deletions remove, is a kill point."""

    def __init__(self, kill_at: int) -> None:
        """Patch the functions (counting starts at :meth:`arm`)."""
        from fastckpt import _native
        from fastckpt.storage.backend import LocalFileSystem

        self.kill_at = kill_at
        self.count = 0
        self.armed = False
        for owner, name in (
            (os, "link"),
            (os, "rename"),
            (os, "replace"),
            (os, "unlink"),
            (os, "rmdir"),
            (os, "mkdir"),
            (_native, "fsync_dir"),
            (LocalFileSystem, "put_record"),
        ):
            setattr(owner, name, self._wrap(getattr(owner, name)))

    def _wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.count += 1
                if self.count == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return function(*args, **kwargs)

        return counted

    def arm(self) -> None:
        """Start counting (and killing)."""
        self.armed = True


@contextlib.contextmanager
def legacy_references() -> Any:
    """Save incrementally as fastckpt did before every index was self-contained: unchanged
    tensors referenced in the earlier index's own file (``refs.json`` naming that index), no
    file linked in. Roots written so must keep loading and pruning safely (a pruned index
    that a kept one references lives on as ``.ref-<index>``)."""
    from fastckpt.checkpoint import components

    original = components.link_into

    def keep_references(
        staging: Any, manifest: Any, index: int, refs: Any
    ) -> tuple[dict[str, dict[str, Any]], list[tuple[str, str]]]:
        return {relpath: dict(names) for relpath, names in refs.items()}, []

    components.link_into = keep_references  # type: ignore[assignment]
    try:
        yield
    finally:
        components.link_into = original  # type: ignore[assignment]


def prune_at_kill_point(root: str, kill_at: int, legacy: bool, conn: Connection) -> None:
    """Child of the prune kill-point test: four incremental saves (iterations 0-3 as indices
    0-3; the later three reference index 0's frozen buffer), then ``prune(root, 2)`` (index 0
    goes, and index 1), SIGKILLed right before its filesystem mutation number ``kill_at``
    (see :class:`MutationCounter`). ``legacy``: the saves are written as earlier versions
    wrote them (:func:`legacy_references`), so the prune keeps index 0's bytes as ``.ref-0``.
    Sends the number of mutations the prune made when it was not killed."""
    from fastckpt import create_model_spec, prune, save_checkpoint

    torch.set_num_threads(1)
    counter = MutationCounter(kill_at)
    model, optimizer = fresh_state(PRUNE_FROZEN)
    spec = create_model_spec(CrashNet, width=WIDTH, hidden=HIDDEN, frozen=PRUNE_FROZEN)
    with legacy_references() if legacy else contextlib.nullcontext():
        for n in range(4):
            advance(model, optimizer, n)
            save_checkpoint(
                root,
                models={"main": (model, spec)},
                optimizers={"adam": (optimizer, None)},
                counters={"n": n},
            )
    counter.arm()
    prune(root, keep_last=2)
    conn.send(counter.count)


def promote_and_report(source: str, target: str, index: int, conn: Connection) -> None:
    """Child: promote index ``index`` of the root ``source`` into the root ``target``
    (:func:`fastckpt.container.promote.promote_index`); sends ``"started"``, then
    ``"promoted"`` once the target's manifest is committed."""
    from fastckpt.container.promote import promote_index

    conn.send("started")
    promote_index(source, target, index)
    conn.send("promoted")


def promote_part_and_report(
    source: str, target: str, index: int, node_local: bool, conn: Connection
) -> None:
    """Child: promote index ``index`` of a sharded strategy's root ``source`` (with its
    sharded part; ``node_local``: as rank 0 of node-local fast tiers, the other ranks' shards
    already uploaded) into ``target``; sends ``"started"``, then ``"promoted"``."""
    from fastckpt.container.promote import promote_index
    from fastckpt.format import sharded  # noqa: F401  (imports DCP before the clock starts)

    conn.send("started")
    promote_index(source, target, index, node_local=node_local, wait_s=60)
    conn.send("promoted")


def promote_checkpoint_and_report(source: str, target: str, conn: Connection) -> None:
    """Child: promote the CheckpointManager checkpoint ``source`` to ``target``
    (:func:`fastckpt.container.promote_checkpoints.promote_checkpoint`); sends ``"started"``,
    then ``"promoted"`` once the target's commit record is written."""
    from fastckpt.container.promote_checkpoints import promote_checkpoint

    conn.send("started")
    promote_checkpoint(source, target)
    conn.send("promoted")


def start(target: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    """Run ``target(*args, conn)`` in a forkserver child; returns ``(process, conn)``."""
    context = _context()
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(*args, writer), daemon=True)
    process.start()
    writer.close()
    return process, reader


@dataclass(frozen=True)
class Killed:
    """How :func:`kill_after` ended: ``killed`` (a SIGKILL was sent), ``promoted`` (the child
    said so first), the child's exit code."""

    killed: bool
    promoted: bool
    exitcode: int | None


def kill_after(target: Callable[..., None], args: tuple[Any, ...], delay: float) -> Killed:
    """Run a ``*_and_report`` child (:func:`start`), SIGKILL it ``delay`` seconds after it
    said ``"started"`` unless it ended already, and reap it.

    Raises:
        AssertionError: the child did not start within a minute.
    """
    process, conn = start(target, *args)
    assert conn.poll(60), "the promoting child did not start"
    assert conn.recv() == "started"
    time.sleep(delay)
    killed = process.is_alive()
    if killed:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile (a forkserver child is reaped there)
            killed = False
    process.join(30)
    messages = []
    with contextlib.suppress(EOFError):  # a killed child's end of the pipe is closed
        while conn.poll(0):
            messages.append(conn.recv())
    return Killed(killed, "promoted" in messages, process.exitcode)


# --------------------------------------------------------------------------- the parent


@dataclass
class Stats:
    """What a harness run did and found."""

    mode: str
    kills: int = 0
    kills_in_save: int = 0
    kills_in_prune: int = 0
    acknowledged: int = 0
    latest: int = -1
    orphans: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One-line summary."""
        inside = f"{self.kills_in_save} inside a save"
        if self.mode in PRUNING_MODES:
            inside += f", {self.kills_in_prune} inside a prune"
        return (
            f"{self.mode}: {self.kills} kills ({inside}), "
            f"{self.acknowledged} acknowledged saves, latest state {self.latest}, "
            f"{self.orphans} unreferenced index dirs, {len(self.failures)} failure(s), "
            f"{self.seconds:.1f} s"
        )


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _leftover_pid(name: str) -> int | None:
    """The pid in a temporary name fastckpt made, or None for other names."""
    if name.startswith(TEMP_MARKERS[2]):
        pid = name[len(TEMP_MARKERS[2]) :].split(".")[0]
        return int(pid) if pid.isdigit() else -1
    if name.startswith(TEMP_MARKERS[:2]):
        parts = name.split("~")
        return int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else -1
    return None


class Harness:
    """Runs kill cycles for one mode against one directory and checks after each.

    Mode ``s3`` writes ``s3://crash-harness/<run>`` on a local moto server that the harness
    starts (``fastckpt.bench.s3.local_server``) and stops when :meth:`run` returns (or at
    :meth:`close`); ``root`` then only holds nothing (the local-leftover check finds it empty).
    """

    def __init__(self, mode: str, root: Path, *, seed: int = 0, verbose: bool = False) -> None:
        """Prepare (``root`` is created; it should start empty)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; available: {MODES}")
        self.mode = mode
        self.root = root
        self.rng = random.Random(seed)
        self.verbose = verbose
        self.context = _context()
        frozen = {"prune": PRUNE_FROZEN, "s3": S3_FROZEN}.get(mode, 0)
        self.reference: Reference | HookReference = (
            HookReference() if mode == "checkpoint_hook" else Reference(frozen=frozen)
        )
        self.stats = Stats(mode)
        self.acked = -1
        self.attempted: set[int] = set()
        self.slots_acked: set[int] = set()
        # First guesses of a save's and a prune's duration (learned from the children's).
        self.save_seconds = 0.6 if mode == "s3" else 0.05
        self.prune_seconds = 0.3 if mode == "s3" else 0.02
        root.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(1)
        self._server = contextlib.ExitStack()
        self.options: dict[str, Any] | None = None
        self.target = str(root)
        self._stray_before: set[int] = set()
        if mode == "s3":
            self._start_server(seed)

    def _start_server(self, seed: int) -> None:
        import boto3

        from fastckpt.bench.s3 import local_server
        from fastckpt.storage.registry import configure_storage

        endpoint, _ = self._server.enter_context(local_server("moto"))
        keys = {"access_key_id": "harness", "secret_access_key": "harness"}
        self.options = {
            "endpoint_url": endpoint,
            "region": "us-east-1",
            **keys,
            "part_size": 5 << 20,
            "lease_ttl_s": S3_LEASE_TTL_S,
        }
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="harness",
            aws_secret_access_key="harness",
        ).create_bucket(Bucket=S3_BUCKET)
        self.target = f"s3://{S3_BUCKET}/run-{seed}-{os.getpid()}"
        configure_storage(self.target, self.options)
        self._server.callback(configure_storage, self.target)

    def close(self) -> None:
        """Stop the harness's object-store server (mode ``s3``; nothing otherwise)."""
        self._server.close()

    # ---------------------------------------------------------------- one child

    def _start(self, iterations: int) -> tuple[Any, Connection]:
        reader, writer = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=child_main,
            args=(self.mode, self.target, writer, iterations, self.options),
            daemon=True,
        )
        process.start()
        writer.close()
        return process, reader

    def _handle(self, message: str, now: float, state: dict[str, Any]) -> None:
        kind, _, rest = message.partition(" ")
        if kind == "saving":
            n = int(rest)
            self.attempted.add(n)
            state["saving"][n] = now
            state["open"] = n
            state["savings_seen"] += 1
        elif kind == "saved":
            n = int(rest.split()[0])
            self.acked = max(self.acked, n)
            self.slots_acked.add(n % SLOTS)
            self.stats.acknowledged += 1
            state["acked_here"] += 1
            if state.get("open") == n:
                state["open"] = None
            began = state["saving"].pop(n, None)
            if began is not None:
                self.save_seconds = 0.8 * self.save_seconds + 0.2 * (now - began)
        elif kind == "pruning":
            state["pruning"] = now
            state["prunings_seen"] += 1
        elif kind == "pruned":
            began = state.pop("pruning", None)
            if began is not None:
                self.prune_seconds = 0.8 * self.prune_seconds + 0.2 * (now - began)
        elif kind == "error":
            self.stats.failures.append(f"child failed: {rest}")
            state["error"] = True

    def cycle(self) -> None:
        """Start a child, SIGKILL it at a random moment, check the directory."""
        process, reader = self._start(iterations=1_000_000)
        state: dict[str, Any] = {
            "saving": {},
            "open": None,
            "savings_seen": 0,
            "prunings_seen": 0,
            "acked_here": 0,
        }
        started = time.monotonic()
        # Which announcement the kill is timed after: a save's, or (modes that prune) a
        # prune's, a random fraction of its usual duration later.
        marker, seen = "saving", "savings_seen"
        if self.mode in PRUNING_MODES and self.rng.random() < (
            0.8 if self.mode == "prune" else 0.35
        ):
            marker, seen = "pruning", "prunings_seen"
        if self.rng.random() < 0.25:
            deadline: float | None = started + self.rng.uniform(0.0, 0.5)
            target = 0
        else:
            deadline, target = None, self.rng.randint(1, 4 if marker == "pruning" else 3)
        usual = self.prune_seconds if marker == "pruning" else self.save_seconds
        delay = self.rng.uniform(0.0, 1.3 * usual)
        exited = False
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if now - started > 120:
                self.stats.failures.append(f"{self.mode}: child made no progress in 120 s")
                break
            wait = 1.0 if deadline is None else max(0.0, deadline - now)
            if not reader.poll(wait):
                continue
            try:
                message = reader.recv_bytes().decode()
            except EOFError:
                exited = True
                break
            now = time.monotonic()
            self._handle(message, now, state)
            if state.get("error"):
                break
            if target and message.startswith(marker) and state[seen] == target:
                deadline = now + delay
        if not exited:
            os.kill(process.pid, signal.SIGKILL)
        process.join()
        while True:  # messages the child sent before it died count (acknowledged saves)
            try:
                if not reader.poll(0):
                    break
                self._handle(reader.recv_bytes().decode(), time.monotonic(), state)
            except EOFError:
                break
        reader.close()
        if exited and not state.get("error"):
            self.stats.failures.append(f"{self.mode}: child exited on its own ({process.exitcode})")
        self.stats.kills += 1
        self.stats.kills_in_save += state["open"] is not None
        self.stats.kills_in_prune += "pruning" in state
        self._check(process.pid, cleaned=state["acked_here"] > 0)

    # ---------------------------------------------------------------- checks

    def _fail(self, message: str) -> None:
        self.stats.failures.append(f"{self.mode} kill {self.stats.kills}: {message}")
        if self.verbose:
            print("FAILURE", self.stats.failures[-1], flush=True)

    def _retained_in_use(self) -> set[str]:
        """``.ref-<index>`` directories of a root that committed (incremental) indices still
        reference: checkpoint content, not leftovers."""
        from fastckpt.container.refs import RETAINED_PREFIX, referenced_indices
        from fastckpt.format.records import MANIFEST, Manifest

        if not (self.root / MANIFEST).exists():
            return set()
        manifest = Manifest.load(self.root)
        used = referenced_indices(manifest, list(manifest.entries))
        return {f"{RETAINED_PREFIX}{index}" for index in used if index not in manifest.entries}

    def _check(self, pid: int | None, *, cleaned: bool) -> None:
        try:
            if self.mode in ("save_checkpoint", "prune"):
                self._check_root()
            elif self.mode == "s3":
                self._check_s3(cleaned=cleaned)
            elif self.mode == "checkpoint_hook":
                self._check_hook()
            else:
                self._check_manager()
        except Exception:
            self._fail(traceback.format_exc())
        for name in sorted(os.listdir(self.root)):
            owner = _leftover_pid(name)
            if owner is not None and cleaned and owner != pid:
                self._fail(f"leftover {name} of an earlier process survived a later save")

    def _root_verifies(self) -> bool:
        """Whether the root has a manifest (required once a save was acknowledged) and every
        committed checkpoint verifies; failures are recorded."""
        from fastckpt.container.verify import verify

        if not (self.root / MANIFEST).exists():
            if self.acked >= 0:
                self._fail("manifest.json is gone after an acknowledged save")
            return False
        report = verify(self.root)
        if not report.ok:
            self._fail(report.summary())
            return False
        return True

    def _check_root(self) -> None:
        from fastckpt import load_checkpoint

        if not self._root_verifies():
            return
        result = load_checkpoint(self.root)
        loaded = result["models"]["main"]
        n = encoded(loaded["model"])
        if result["checkpoint_index"] != n:
            self._fail(f"index {result['checkpoint_index']} holds iteration {n}")
        self._compare(n, loaded["model"].state_dict(), loaded["optimizers"]["adam"]["optimizer"])
        self._judge_latest(n)
        self._count_orphans()

    def _count_orphans(self) -> None:
        from fastckpt.format.records import Manifest

        committed = set(Manifest.load(self.root).entries)
        on_disk = {int(p.name) for p in self.root.iterdir() if p.name.isdigit()}
        self.stats.orphans = len(on_disk - committed)
        if committed - on_disk:
            self._fail(f"committed indices without a directory: {sorted(committed - on_disk)}")

    def _check_s3(self, *, cleaned: bool) -> None:
        """Mode ``s3``: every committed index verifies (its objects whole, every tensor's
        checksum); the latest loads bitwise as a saved state, never older than the last
        acknowledged one; an uncommitted index prefix older than the latest (what a prune
        killed after its commit left) is gone once a later process saved (``cleaned``).
        Newer ones are what a killed save was writing: the next save of that index deletes
        them first."""
        from fastckpt import load_checkpoint
        from fastckpt.container.verify import verify
        from fastckpt.format.records import Manifest

        manifest = Manifest.load(self.target)
        if manifest.latest is None:
            if self.acked >= 0:
                self._fail("the manifest is gone (or empty) after an acknowledged save")
            return
        report = verify(self.target)
        if not report.ok:
            self._fail(report.summary())
            return
        result = load_checkpoint(self.target)
        loaded = result["models"]["main"]
        n = encoded(loaded["model"])
        if result["checkpoint_index"] != n:
            self._fail(f"index {result['checkpoint_index']} holds iteration {n}")
        self._compare(n, loaded["model"].state_dict(), loaded["optimizers"]["adam"]["optimizer"])
        self._judge_latest(n)
        stray = self._s3_prefixes() - set(manifest.entries)
        self.stats.orphans = len(stray)
        older = {i for i in stray if i < manifest.latest}
        survived = sorted(older & self._stray_before) if cleaned else []
        if survived:
            self._fail(f"uncommitted index prefixes survived a later save: {survived}")
        self._stray_before = older

    def _s3_prefixes(self) -> set[int]:
        from fastckpt.storage.registry import backend_for

        names = backend_for(self.target).list_dir(Path(self.target))
        return {int(name) for name in names if name.isdigit()}

    def _s3_leftovers(self) -> list[str]:
        """What a clean last save must not leave on the store: uncommitted index prefixes,
        unfinished multipart uploads, the lease."""
        from fastckpt.format.records import Manifest
        from fastckpt.storage.lock import LOCK_FILE
        from fastckpt.storage.registry import backend_for

        backend: Any = backend_for(self.target)
        committed = set(Manifest.load(self.target).entries)
        left = [str(i) for i in sorted(self._s3_prefixes() - committed)]
        prefix = self.target.split("/", 3)[3] + "/"
        left += [upload.key for upload in backend.client.pending_uploads(prefix)]
        if LOCK_FILE in backend.list_dir(Path(self.target)):
            left.append(LOCK_FILE)
        return left

    def _check_hook(self) -> None:
        from fastckpt import TrainingStrategy
        from fastckpt.format.records import Manifest

        if not self._root_verifies():
            return
        strategy = TrainingStrategy.load_checkpoint(self.root, training_fn=hook_training_fn)
        model = strategy.models["main"]
        n = encoded(model)
        latest = Manifest.load(self.root).latest
        if strategy.step_count != n or latest != n - 1:
            self._fail(f"index {latest} holds step_count {strategy.step_count}, weights of {n}")
        self._compare(n, model.state_dict(), strategy.optimizers["main"])
        self._judge_latest(n)
        self._count_orphans()

    def _check_manager(self) -> None:
        from fastckpt import CheckpointManager
        from fastckpt.container.verify import verify

        latest = -1
        with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
            for slot in range(SLOTS):
                directory = self.root / f"slot{slot}"
                if not directory.exists():
                    if slot in self.slots_acked:
                        self._fail(f"{directory} existed (acknowledged save) and is gone")
                    continue
                report = verify(directory)
                if not report.ok:
                    self._fail(report.summary())
                    continue
                state = manager.load(directory)
                n = int(state["meta"]["n"])
                if n % SLOTS != slot:
                    self._fail(f"{directory} holds iteration {n}")
                model = CrashNet()
                model.load_state_dict(state["model"])
                encoded(model)
                self._compare(n, state["model"], state["optim"])
                latest = max(latest, n)
        self._judge_latest(latest)

    def _compare(self, n: int, model_state: Any, optimizer: Any) -> None:
        if n not in self.attempted:
            self._fail(f"loaded iteration {n}, which no child ever tried to save")
        expected_model, expected_optimizer = self.reference.state(n)
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer.state_dict()
        for what, expected, actual in (
            ("model", expected_model, dict(model_state)),
            ("optimizer", expected_optimizer, optimizer),
        ):
            found = difference(expected, actual)
            if found:
                self._fail(f"iteration {n}: {what} state is not the saved one ({found})")

    def _judge_latest(self, n: int) -> None:
        self.stats.latest = n
        if n < self.acked:
            self._fail(f"latest loadable iteration {n} is older than acknowledged {self.acked}")

    # ---------------------------------------------------------------- whole runs

    def finish(self) -> None:
        """A last child saves once and exits normally: nothing temporary may remain."""
        process, reader = self._start(iterations=1)
        state: dict[str, Any] = {
            "saving": {},
            "open": None,
            "savings_seen": 0,
            "prunings_seen": 0,
            "acked_here": 0,
        }
        done = False
        while not done and reader.poll(120):
            try:
                message = reader.recv_bytes().decode()
            except EOFError:
                break
            self._handle(message, time.monotonic(), state)
            done = message == "done" or message.startswith("error")
        process.join(120)
        reader.close()
        if process.exitcode != 0 or state["acked_here"] != 1:
            self._fail(f"the clean save after the last kill failed (exit {process.exitcode})")
        self._check(process.pid, cleaned=True)
        left = [
            name
            for name in os.listdir(self.root)
            if name.startswith(".") and name not in self._retained_in_use()
        ]
        if self.mode == "s3":
            left += self._s3_leftovers()
        if left:
            self._fail(f"temporary files left after a clean save: {left}")
        if self.stats.orphans:
            self._fail(f"{self.stats.orphans} unreferenced index directories after a clean save")

    def run(self, kills: int, *, time_limit: float | None = None) -> Stats:
        """``kills`` kill cycles (fewer if ``time_limit`` seconds run out), then :meth:`finish`."""
        began = time.monotonic()
        try:
            for _ in range(kills):
                if time_limit is not None and time.monotonic() - began > time_limit:
                    break
                self.cycle()
                if self.verbose and self.stats.kills % 25 == 0:
                    print(self.stats.line(), flush=True)
            self.finish()
        finally:
            self.close()
        self.stats.seconds = time.monotonic() - began
        return self.stats


def main(argv: list[str] | None = None) -> int:
    """Command line: run the harness, print the counts and any failure; exit 1 on failures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=300, help="total kills (all modes)")
    parser.add_argument("--mode", choices=[*MODES, "all"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, help="work directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    work = args.root or Path(tempfile.mkdtemp(prefix="fastckpt-crash-"))
    shares = [args.kills // len(modes) + (i < args.kills % len(modes)) for i in range(len(modes))]
    print(f"crash harness: {args.kills} kills over {modes}, seed {args.seed}, in {work}")
    all_stats = []
    try:
        for i, (mode, kills) in enumerate(zip(modes, shares, strict=True)):
            harness = Harness(mode, work / mode, seed=args.seed + i, verbose=args.verbose)
            stats = harness.run(kills)
            all_stats.append(stats)
            print(stats.line(), flush=True)
            for failure in stats.failures:
                print(f"FAILURE {failure}")
    finally:
        if not args.keep and args.root is None:
            shutil.rmtree(work, ignore_errors=True)
    total = sum(s.kills for s in all_stats)
    failures = sum(len(s.failures) for s in all_stats)
    inside = sum(s.kills_in_save for s in all_stats)
    pruning = sum(s.kills_in_prune for s in all_stats)
    print(
        f"TOTAL: {total} kills ({inside} inside a save, {pruning} inside a prune), "
        f"{failures} failure(s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import crash_harness  # run the importable module, so children can find its functions

    sys.exit(crash_harness.main())
