"""Rank scripts of the sharded-on-``s3://`` tests (``tests/test_sharded_s3.py``), run by
``dcp_support.launch`` as ``python -c "import s3_dcp_ranks; s3_dcp_ranks.NAME()" LOCAL RANK
RENDEZVOUS WORLD URL``: a real gloo process group on CPU, FSDP2, and a real S3 server (moto,
reached through the AWS variables every rank inherits). LOCAL is a local scratch directory
(rendezvous, the reference states); URL the checkpoints' ``s3://`` prefix."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.tensor import Shard, distribute_tensor

import fastckpt
import fastckpt.dcp
from dcp_ranks import BLOCK_BYTES, _sharded, _state, _tp_full
from dcp_support import compare, full_state, setup_rank, train_step
from fastckpt.storage.s3.client import S3Client
from training_support import leave_process_group


def _url() -> str:
    return sys.argv[5]


def save() -> None:
    """Two FSDP2 + AdamW steps, then ``dcp.save`` to URL/sync; one more step, then
    ``dcp.async_save`` to URL/async and a ``CheckpointManager`` save to URL/manager, with a
    training step while they upload. Rank 0 writes the gathered full states to LOCAL."""
    local, rank, world = setup_rank()
    url = _url()
    mesh, model, optimizer = _sharded(world)
    for step in range(2):
        train_step(model, optimizer, step)
    extra = {"step": 2, "tag": "s3", "blob": io.BytesIO(b"\x00raw\xff")}
    dcp.save(
        _state(mesh, model, optimizer, extra),
        storage_writer=fastckpt.dcp.Writer(f"{url}/sync", block_bytes=BLOCK_BYTES),
    )
    if rank == 0:
        safetensors.torch.save_file(full_state(model, optimizer), local / "reference-sync.st")
    else:
        full_state(model, optimizer)  # collective
    train_step(model, optimizer, 2)
    reference = full_state(model, optimizer)
    extra = {"step": 3, "tag": "s3", "blob": io.BytesIO(b"three")}
    group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        _state(mesh, model, optimizer, extra),
        storage_writer=fastckpt.dcp.Writer(f"{url}/async", block_bytes=BLOCK_BYTES),
        process_group=group,
    )
    with fastckpt.CheckpointManager() as manager:
        plain = {"step": 3, "tag": "s3"}  # a manager takes no file objects
        manager.save(f"{url}/manager", _state(mesh, model, optimizer, plain))
    train_step(model, optimizer, 3)  # changes every tensor while the async save uploads
    future.result()  # type: ignore[union-attr]
    if rank == 0:
        safetensors.torch.save_file(reference, local / "reference-async.st")
    leave_process_group()


def load() -> None:
    """Load URL/sync (``dcp.load``), URL/async (``fastckpt.dcp.load_state`` into templates) and
    URL/manager (``CheckpointManager.load(into=)``) onto WORLD FSDP2 ranks; rank 0 compares
    each gathered state with the saved one bitwise and prints a report."""
    local, rank, world = setup_rank()
    url = _url()
    report: dict[str, Any] = {"rank": rank}
    for name, how in (("sync", "dcp"), ("async", "load_state"), ("manager", "manager")):
        mesh, model, optimizer = _sharded(world)
        values: dict[str, Any] = {"step": 0, "tag": ""}
        if how != "manager":
            values["blob"] = io.BytesIO()
        templates = _state(mesh, model, optimizer, values)
        templates["tp"]["weight"] = distribute_tensor(torch.zeros(13, 29), mesh, [Shard(1)])
        if how == "dcp":
            reader = fastckpt.dcp.Reader(f"{url}/{name}")
            dcp.load(templates, storage_reader=reader)
            state = templates
            report[f"{name}_bytes_read"] = reader.bytes_read
        elif how == "load_state":
            state = fastckpt.dcp.load_state(f"{url}/{name}", into=templates, strict=True)
        else:
            with fastckpt.CheckpointManager() as manager:
                state = manager.load(f"{url}/{name}", into=templates)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        loaded = full_state(model, optimizer)
        tp_ok = torch.equal(state["tp"]["weight"].full_tensor(), _tp_full())
        if rank == 0:
            saved_as = "async" if name == "manager" else name  # the same training state
            expected = safetensors.torch.load_file(local / f"reference-{saved_as}.st")
            report[name] = {
                "bad": compare(expected, loaded),
                "n": len(loaded),
                "tp_ok": tp_ok,
                "step": state["extra"]["step"],
                "blob": state["extra"]["blob"].getvalue().decode("latin-1")
                if "blob" in state["extra"]
                else None,
            }
    print(json.dumps(report))
    leave_process_group()


def save_and_hang() -> None:
    """Save URL/sync again (five training steps and a 24 MiB sharded tensor more: 12 MiB per
    rank, uploaded as multipart uploads of 5 MiB parts), and stop forever inside this rank's
    upload once more than a part of it went out: the test waits until both ranks' uploads
    exist on the server, then SIGKILLs every rank there."""
    _, rank, world = setup_rank()
    url = _url()
    fastckpt.configure_storage(url, part_size=5 << 20)
    mesh, model, optimizer = _sharded(world)
    for step in range(5):
        train_step(model, optimizer, step)
    real = S3Client.put_stream

    def put_stream(self: S3Client, key: str, pieces: Any, size: int) -> Any:
        if size <= self.options.single_put_max:
            return real(self, key, pieces, size)

        def announced() -> Any:
            sent = 0
            for piece in pieces:
                yield piece
                sent += memoryview(piece).nbytes
                if sent > self.options.part_size:  # the first part is on its way
                    Path(os.environ["FASTCKPT_TEST_MARK"] + f".{rank}").touch()
                    time.sleep(3600)

        return real(self, key, announced(), size)

    S3Client.put_stream = put_stream  # type: ignore[method-assign]
    state = _state(mesh, model, optimizer, {"step": 5, "tag": "killed", "blob": io.BytesIO()})
    state["big"] = distribute_tensor(torch.randn(2 * world, 3 << 19), mesh, [Shard(0)])
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(f"{url}/sync", block_bytes=BLOCK_BYTES))


def save_losing_a_rank_file() -> None:
    """Save URL/lost (every rank a shard of a DTensor), then again with other values while the
    store loses rank 1's tensor object right after acknowledging its upload (deleted once
    stored: what a store not keeping it, or a cleaner, does). Prints each rank's outcome of
    the second save and, after it, what URL/lost loads on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    _, rank, world = setup_rank()
    url = f"{_url()}/lost"
    mesh = init_device_mesh("cpu", (world,))

    def state(value: float) -> dict[str, Any]:
        return {"w": distribute_tensor(torch.full((4 * world, 8), value), mesh, [Shard(0)])}

    dcp.save(state(1.0), storage_writer=fastckpt.dcp.Writer(url))
    if rank == 1:
        for name in ("put", "put_stream"):
            real = getattr(S3Client, name)

            def losing(self: S3Client, key: str, *args: Any, _real: Any = real, **kw: Any) -> Any:
                etag = _real(self, key, *args, **kw)
                if key.endswith("rank-00001.safetensors"):
                    self.delete([key])
                return etag

            setattr(S3Client, name, losing)
    outcome = "saved"
    try:
        dcp.save(state(2.0), storage_writer=fastckpt.dcp.Writer(url))
    except BaseException as err:  # DCP's CheckpointException is no Exception
        outcome = f"{type(err).__name__}: {err}"
    dist.barrier()
    loaded = state(0.0)
    dcp.load(loaded, storage_reader=fastckpt.dcp.Reader(url))
    value = float(loaded["w"].full_tensor().unique().item())
    print(json.dumps({"rank": rank, "outcome": outcome, "loaded": value}))
    leave_process_group()


def strategy_train() -> None:
    """A ``TrainingStrategy`` on FSDP2 + AdamW for 6 steps whose async ``CheckpointHook``
    saves to URL/run every 2 steps (keep_last=2); rank 0 writes the gathered state at step 4
    to LOCAL and prints the losses."""
    from dcp_support import build_model
    from sharded_ranks import Recorder, loader, shard, training_fn

    local, rank, _ = setup_rank()
    torch.manual_seed(0)
    recorder = Recorder(local, save_at=(4, 6))
    hook = fastckpt.CheckpointHook(f"{_url()}/run", step_interval=2, keep_last=2)
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=training_fn,
        hooks=[hook, recorder],
        num_steps=6,
    )
    strategy.run(loader())
    print(json.dumps({"rank": rank, "losses": recorder.losses, "last": hook.last_checkpoint_index}))
    leave_process_group()


def strategy_resume() -> None:
    """``sharded_ranks.resume_and_compare`` of URL/run (index 1, step 4) on WORLD ranks:
    bitwise at step 4 against the saving run, close at step 6 after training on."""
    from sharded_ranks import resume_and_compare

    local, rank, _ = setup_rank()
    print(json.dumps(resume_and_compare(f"{_url()}/run", local, rank)))
    leave_process_group()


def strategy_tiers_train() -> None:
    """:func:`strategy_train` with two tiers: every checkpoint goes to the fast root
    LOCAL/fast (a directory the ranks of this node share; keep_last=2) and is promoted in the
    background to URL/tiers (durable_keep_last=2); prints the losses and the hook's health."""
    from dcp_support import build_model
    from sharded_ranks import Recorder, loader, shard, training_fn

    local, rank, _ = setup_rank()
    torch.manual_seed(0)
    recorder = Recorder(local, save_at=(4, 6))
    hook = fastckpt.CheckpointHook(
        local / "fast",
        step_interval=2,
        keep_last=2,
        durable_dir=f"{_url()}/tiers",
        durable_keep_last=2,
    )
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=training_fn,
        hooks=[hook, recorder],
        num_steps=6,
    )
    strategy.run(loader())
    report = {"rank": rank, "losses": recorder.losses, "healthy": hook.promotion_healthy}
    print(json.dumps(report))
    leave_process_group()


def strategy_tiers_agreed_resume() -> None:
    """Resume the newest index from LOCAL/fast (deleted by the test) falling back to
    URL/tiers, on every rank; rank 1 looks as if before index 2 was promoted (its own look
    finds index 1). Prints the index and step each rank resumed at."""
    from fastckpt.container.promote import NearestCopy
    from fastckpt.training import strategy as strategy_module
    from sharded_ranks import shard, training_fn

    local, rank, _ = setup_rank()
    durable = f"{_url()}/tiers"
    if rank == 1:
        strategy_module.nearest_intact = lambda tiers, index=None: NearestCopy(  # type: ignore[assignment]
            Path(durable), 1, []
        )
    strategy = fastckpt.TrainingStrategy.load_checkpoint(
        local / "fast",
        hooks=[],
        training_fn=training_fn,
        parallelize=shard,
        fallback_dirs=[durable],
    )
    assert strategy.restored_from is not None
    report = {"rank": rank, "index": strategy.restored_from.index, "step": strategy.step_count}
    print(json.dumps(report))
    leave_process_group()


class _PromotedFirst:
    """A hook after a CheckpointHook: at the run's first step, waits until the promotion the
    hook started with the run (what the fast tier held) is done on this rank, so that the
    run's own saves come after it (node-local tiers promote only the newest due index: a
    save committed first would supersede it)."""

    def __init__(self, hook: fastckpt.CheckpointHook) -> None:
        self.hook = hook
        self.done = False

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and not self.done:
            self.done = True
            if self.hook.promoter is not None:
                self.hook.promoter.wait()


def strategy_node_tiers_train() -> None:
    """:func:`strategy_tiers_train` with node-local fast tiers: rank R saves to LOCAL/node<R>
    (its own directory, one simulated node each), both promote to URL/node-tiers
    (durable_keep_last=2), each save promoted before the next (:class:`sharded_ranks.Settle`);
    prints the losses, the hook's health and what the rank promoted."""
    from dcp_support import build_model
    from sharded_ranks import Recorder, Settle, loader, shard, training_fn

    local, rank, _ = setup_rank()
    torch.manual_seed(0)
    recorder = Recorder(local, save_at=(4, 6))
    hook = fastckpt.CheckpointHook(
        local / f"node{rank}",
        step_interval=2,
        keep_last=2,
        durable_dir=f"{_url()}/node-tiers",
        durable_keep_last=2,
    )
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=training_fn,
        hooks=[hook, recorder, Settle(hook)],
        num_steps=6,
    )
    strategy.run(loader())
    promoter = hook.promoter
    report = {
        "rank": rank,
        "losses": recorder.losses,
        "healthy": hook.promotion_healthy,
        "promoter": type(promoter).__name__,
        "promoted": [] if promoter is None else promoter.promoted,
    }
    print(json.dumps(report))
    leave_process_group()


def strategy_node_tiers_resume() -> None:
    """``sharded_ranks.resume_and_compare`` of index 1 on WORLD ranks from the node-local fast
    root LOCAL/node0 (which holds rank 0's shards only) falling back to URL/node-tiers."""
    from sharded_ranks import resume_and_compare

    local, rank, _ = setup_rank()
    tiers = [f"{_url()}/node-tiers"]
    report = resume_and_compare(local / "node0", local, rank, fallback_dirs=tiers)
    print(json.dumps(report))
    leave_process_group()


def strategy_node_tiers_restart() -> None:
    """Restart of :func:`strategy_node_tiers_train`'s run on its node-local fast roots with
    the same hook (URL/node-tiers durable): restored from the newest index the nodes' fast
    roots hold together, it trains 2 steps more than the first run (one more save); prints
    where it resumed and the hook's health. With ``detached`` after the URL, every rank's
    promotions run in detached processes."""
    from sharded_ranks import loader, shard, training_fn

    local, rank, _ = setup_rank()
    durable = f"{_url()}/node-tiers"
    detached = sys.argv[6:] == ["detached"]
    hook = fastckpt.CheckpointHook(
        local / f"node{rank}",
        step_interval=2,
        keep_last=2,
        durable_dir=durable,
        durable_keep_last=2,
        detached_promotion=detached,
    )
    strategy = fastckpt.TrainingStrategy.load_checkpoint(
        local / f"node{rank}",
        hooks=[hook, _PromotedFirst(hook)],
        training_fn=training_fn,
        parallelize=shard,
        fallback_dirs=[durable],
    )
    assert strategy.restored_from is not None
    start = strategy.step_count
    restored = [strategy.restored_from.root.name, strategy.restored_from.index]
    strategy.num_steps = 8
    strategy.run(loader())
    report = {
        "rank": rank,
        "start": start,
        "restored": restored,
        "step": strategy.step_count,
        "healthy": hook.promotion_healthy,
        "detached": hook.promoter is not None and hook.promoter.detached,
        "promoted": [] if hook.promoter is None else hook.promoter.promoted,
    }
    print(json.dumps(report))
    leave_process_group()


def strategy_tiers_resume() -> None:
    """``sharded_ranks.resume_and_compare`` of index 1 from the fast root LOCAL/fast (deleted
    by the test: a new node) falling back to URL/tiers, on WORLD ranks."""
    from sharded_ranks import resume_and_compare

    local, rank, _ = setup_rank()
    report = resume_and_compare(local / "fast", local, rank, fallback_dirs=[f"{_url()}/tiers"])
    print(json.dumps(report))
    leave_process_group()
