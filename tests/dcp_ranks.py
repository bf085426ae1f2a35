"""Rank scripts of the sharded (DCP) tests, run by ``dcp_support.launch`` or
``training_support.run_two_ranks`` as ``python -c "import dcp_ranks; dcp_ranks.NAME()"
CHECKPOINT RANK RENDEZVOUS [WORLD [ARGS...]]`` with a real gloo process group on CPU."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import fastckpt.dcp
from dcp_support import (
    build_model,
    compare,
    full_state,
    row_tensors,
    setup_rank,
    train_step,
)
from training_support import leave_process_group

BLOCK_BYTES = 1024  # small verification blocks, so resharded reads can skip most of a chunk


def _sharded(world: int) -> tuple[DeviceMesh, nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world,))
    model = build_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _tp_full() -> torch.Tensor:
    return torch.arange(13 * 29, dtype=torch.float32).reshape(13, 29) / 7


def _state(mesh: DeviceMesh, model: nn.Module, optimizer: Any, extra: dict[str, Any]) -> Any:
    msd, osd = get_state_dict(model, optimizer)
    tp = distribute_tensor(_tp_full(), mesh, [Shard(1)])  # a column-sharded TP weight
    return {"model": msd, "optim": osd, "tp": {"weight": tp}, "extra": extra}


def save_fsdp() -> None:
    """Train 2 steps on FSDP2 + AdamW, dcp.save to ROOT/sync; one more step, dcp.async_save
    to ROOT/async and train on while it uploads. Rank 0 writes the gathered full states."""
    root, rank, world = setup_rank()
    mesh, model, optimizer = _sharded(world)
    losses = [train_step(model, optimizer, step) for step in range(2)]
    extra = {"step": 2, "tag": "run-1", "loss": losses[-1], "blob": io.BytesIO(b"\x00raw\xff")}
    dcp.save(
        _state(mesh, model, optimizer, extra),
        storage_writer=fastckpt.dcp.Writer(root / "sync", block_bytes=BLOCK_BYTES),
    )
    fastckpt.dcp.save_state(root / "manager-sync", _state(mesh, model, optimizer, extra))
    reference = full_state(model, optimizer)
    if rank == 0:
        safetensors.torch.save_file(reference, root / "reference-sync.safetensors")

    losses.append(train_step(model, optimizer, 2))
    extra = {"step": 3, "tag": "run-1", "loss": losses[-1], "blob": io.BytesIO(b"three")}
    reference = full_state(model, optimizer)
    checkpoint_group = dist.new_group(backend="gloo")
    manager_group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        _state(mesh, model, optimizer, extra),
        storage_writer=fastckpt.dcp.Writer(root / "async", block_bytes=BLOCK_BYTES),
        process_group=checkpoint_group,
    )
    manager_future = fastckpt.dcp.async_save_state(
        root / "manager-async",
        _state(mesh, model, optimizer, extra),
        writer=fastckpt.dcp.Writer(root / "manager-async"),
        process_group=manager_group,
    )
    losses.append(train_step(model, optimizer, 3))  # changes every tensor during the uploads
    future.result()  # type: ignore[union-attr]
    manager_future.result()
    if rank == 0:
        safetensors.torch.save_file(reference, root / "reference-async.safetensors")
        print(json.dumps({"losses": losses}))
    leave_process_group()


def load_fsdp() -> None:
    """Load ROOT/sync into an FSDP2 model on WORLD ranks, compare the gathered state with the
    saved one bitwise, then take the next training step and compare with the original run."""
    root, rank, world = setup_rank()
    mesh, model, optimizer = _sharded(world)
    extra = {"step": 0, "tag": "", "loss": 0.0, "blob": io.BytesIO()}
    state = _state(mesh, model, optimizer, extra)
    state["tp"]["weight"] = distribute_tensor(torch.zeros(13, 29), mesh, [Shard(1)])
    reader = fastckpt.dcp.Reader(root / "sync")
    dcp.load(state, storage_reader=reader)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loaded = full_state(model, optimizer)
    tp_ok = torch.equal(state["tp"]["weight"].full_tensor(), _tp_full())
    loss = train_step(model, optimizer, 2)
    stepped = full_state(model, optimizer)
    report: dict[str, Any] = {"rank": rank, "bytes_read": reader.bytes_read, "tp_ok": tp_ok}

    # the CheckpointManager-shaped path: async-saved on 2 ranks, loaded strictly on WORLD
    _, model, optimizer = _sharded(world)
    templates = _state(mesh, model, optimizer, {"step": 0, "tag": "", "loss": 0.0, "blob": None})
    loaded_state = fastckpt.dcp.load_state(root / "manager-async", into=templates, strict=True)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=loaded_state["model"],
        optim_state_dict=loaded_state["optim"],
    )
    manager_loaded = full_state(model, optimizer)
    report["manager_step"] = loaded_state["extra"]["step"]
    if rank == 0:
        saved = safetensors.torch.load_file(root / "reference-sync.safetensors")
        expected = safetensors.torch.load_file(root / "reference-async.safetensors")
        report["bad"] = compare(saved, loaded)
        report["manager_bad"] = compare(expected, manager_loaded)
        report["n_tensors"] = len(loaded)
        report["extra"] = {k: v for k, v in extra.items() if k != "blob"}
        report["blob"] = state["extra"]["blob"].getvalue().decode("latin-1")
        report["loss"] = loss
        report["resumed_close"] = all(
            torch.allclose(expected[name], stepped[name], rtol=1e-4, atol=1e-6) for name in expected
        )
    print(json.dumps(report))
    leave_process_group()


def _killed_after_write(root: Any, rank: int) -> fastckpt.dcp.Writer:
    """A writer whose rank 1 is SIGKILLed right after writing its files (before the commit)."""

    class KilledAfterWrite(fastckpt.dcp.Writer):
        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return future

    return KilledAfterWrite(root)


def torn_save() -> None:
    """Commit one save to ROOT, then start a second where rank 1 is SIGKILLed after writing its
    files and before the commit. Rank 0 reports how its save ended."""
    root, rank, _ = setup_rank()
    dcp.save({f"r{rank}": torch.full((64, 3), 1.0)}, storage_writer=fastckpt.dcp.Writer(root))
    dist.barrier()
    try:
        dcp.save(
            {f"r{rank}": torch.full((64, 3), 2.0)}, storage_writer=_killed_after_write(root, rank)
        )
        print("committed")
    except BaseException as err:  # DCP raises CheckpointException (a BaseException)
        print(f"failed {type(err).__name__}")
    sys.stdout.flush()
    os._exit(0)  # the process group lost a rank: no orderly teardown


def torn_save_state() -> None:
    """As :func:`torn_save` through ``fastckpt.dcp.save_state``, rank 1 SIGKILLed after
    writing its files: rank 0 prints the error it got (type, then message)."""
    root, rank, _ = setup_rank()
    fastckpt.dcp.save_state(root, {f"r{rank}": torch.full((64, 3), 1.0)})
    dist.barrier()
    try:
        fastckpt.dcp.save_state(
            root, {f"r{rank}": torch.full((64, 3), 2.0)}, writer=_killed_after_write(root, rank)
        )
        print("committed")
    except BaseException as err:
        print(f"{type(err).__name__}\n{err}")
    sys.stdout.flush()
    os._exit(0)  # the process group lost a rank: no orderly teardown


def save_rows() -> None:
    """Save :func:`dcp_support.row_tensors` row-sharded over WORLD ranks (one chunk of each
    tensor per rank file) with a plain value, as ROOT/rows through ``save_state``."""
    root, _, world = setup_rank()
    mesh = init_device_mesh("cpu", (world,))
    full = row_tensors()
    state = {
        "model": {
            "w": distribute_tensor(full["model.w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["model.b"], mesh, [Shard(0)]),
        },
        "meta": {"step": 5, "tag": "rows"},
    }
    fastckpt.dcp.save_state(root / "rows", state)
    leave_process_group()


def load_corrupt() -> None:
    """Load ROOT/corrupt (a copy of ROOT/rows with one chunk of rank 1's file damaged) into
    row-sharded DTensor templates holding a sentinel, through ``load_state`` and through
    ``CheckpointManager.load``; report per rank what was raised and whether its templates kept
    every bit."""
    root, rank, world = setup_rank()
    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, Any] = {"rank": rank}
    for label in ("load_state", "manager"):
        sentinel = {name: torch.full_like(t, -3.5) for name, t in row_tensors().items()}
        templates = {
            "model": {
                "w": distribute_tensor(sentinel["model.w"], mesh, [Shard(0)]),
                "b": distribute_tensor(sentinel["model.b"], mesh, [Shard(0)]),
            },
            "meta": {"step": -1, "tag": "none"},
        }
        try:
            if label == "load_state":
                fastckpt.dcp.load_state(root / "corrupt", into=templates)
            else:
                fastckpt.CheckpointManager().load(root / "corrupt", into=templates)
            report[label] = "loaded"
        except BaseException as err:
            report[label] = type(err).__name__
        local = {name: templates["model"][name.split(".")[1]].to_local() for name in sentinel}
        expected = {name: sentinel[name].chunk(world)[rank] for name in sentinel}
        report[f"{label}_changed"] = compare(expected, local)
        report[f"{label}_meta"] = templates["meta"]
    print(json.dumps(report))
    leave_process_group()


def _rows_state(mesh: DeviceMesh, step: int) -> dict[str, Any]:
    """:func:`dcp_support.row_tensors`' ``model.w`` plus ``step``, row-sharded over ``mesh``."""
    full = row_tensors()["model.w"] + step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def async_save_after_teardown() -> None:
    """Commit ``_rows_state(1)`` to ROOT, then start ``async_save_state`` of
    ``_rows_state(2)`` and destroy the process group without waiting for it (a job ending);
    the background save is held back until the group is gone, as a busy GIL holds it. Print
    how its future ended (JSON)."""
    from torch.distributed.checkpoint import _async_thread_executor

    root, rank, world = setup_rank()
    mesh = init_device_mesh("cpu", (world,))
    fastckpt.dcp.save_state(root, _rows_state(mesh, 1))
    dist.barrier()
    group = dist.new_group(backend="gloo")
    gate = threading.Event()
    original = _async_thread_executor.save_wrapper

    def held_back(*args: Any, **kwargs: Any) -> Any:
        gate.wait()
        return original(*args, **kwargs)

    _async_thread_executor.save_wrapper = held_back  # type: ignore[assignment]
    writer = fastckpt.dcp.Writer(root)
    future = fastckpt.dcp.async_save_state(
        root, _rows_state(mesh, 2), writer=writer, process_group=group
    )
    dist.destroy_process_group()
    gate.set()
    report: dict[str, Any] = {"rank": rank}
    try:
        future.result(timeout=120)
        report["outcome"] = "committed"
    except Exception as err:
        report["outcome"] = f"{type(err).__name__}: {err}"
    except BaseException as err:
        report["outcome"] = f"untyped {type(err).__name__}: {err}"
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


def manager_async_save_disk_full() -> None:
    """Commit ``_rows_state(1)`` to ROOT/ok through an async CheckpointManager; then save
    ``_rows_state(2)`` and 2 MiB more to ROOT/full (rank 0) / ARG/full (rank 1: a tmpfs
    smaller than its 1 MiB share); print the
    type, errno and message of the failed save's future (JSON)."""
    root, rank, world = setup_rank()
    small = Path(sys.argv[5])
    mesh = init_device_mesh("cpu", (world,))
    report: dict[str, Any] = {"rank": rank}
    config = fastckpt.CheckpointManager.Config.with_async_save()
    with fastckpt.CheckpointManager(config) as manager:
        first = manager.save(root / "ok", _rows_state(mesh, 1))
        assert first is not None
        first.result()
        big = {
            **_rows_state(mesh, 2),
            "big": distribute_tensor(torch.ones(512, 1024), mesh, [Shard(0)]),
        }
        full = manager.save((small if rank == 1 else root) / "full", big)
        assert full is not None
        error = full.exception(timeout=120)
        report["type"] = type(error).__name__
        report["errno"] = getattr(error, "errno", None)
        report["message"] = str(error)
        try:
            manager.close()
        except BaseException as err:
            report["close"] = f"{type(err).__name__}: {err}"
    print(json.dumps(report))
    leave_process_group()
