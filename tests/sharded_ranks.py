"""Rank scripts of the sharded CheckpointManager / TrainingStrategy tests, run by
``dcp_support.launch(..., ranks="sharded_ranks")`` as
``python -c "import sharded_ranks; sharded_ranks.NAME()" CHECKPOINT RANK RENDEZVOUS WORLD``
with a real gloo process group on CPU (FSDP2 models from ``dcp_support``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fastckpt
from dcp_support import (
    batch,
    build_model,
    compare,
    fsdp2_on,
    full_state,
    setup_rank,
    train_step,
)
from training_support import leave_process_group

#: FSDP2 on the default CPU mesh: each Linear, then the root (the ``parallelize=`` function).
shard = fsdp2_on("cpu")


def _sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = shard(build_model())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _strict_manager(kind: str) -> fastckpt.CheckpointManager:
    config = (
        fastckpt.CheckpointManager.Config.with_sync_save()
        if kind == "sync"
        else fastckpt.CheckpointManager.Config.with_async_save()
    )
    config.items = {"model": fastckpt.ItemSpec(), "optim": fastckpt.ItemSpec()}
    config.items["step"] = fastckpt.ItemSpec(requires_copy=False)
    config.default = None  # strict: unknown keys refused
    return fastckpt.CheckpointManager(config)


def manager_per_rank_values() -> None:
    """A manager save of DTensor state whose ranks hold different plain values is refused on
    every rank (nothing written); filed under a key of each rank's own, they save and each
    rank loads its own back."""
    root, rank, _ = setup_rank()
    model, optimizer = _sharded()
    msd, _ = get_state_dict(model, optimizer)
    report: dict[str, Any] = {"rank": rank}
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        try:
            m.save(root / "mixed", {"model": msd, "loader": {"position": 100 + rank}})
        except ValueError as err:
            report["refused"] = str(err)
        report["mixed_exists"] = (root / "mixed").exists()
        own = {f"rank{rank}": torch.tensor(100 + rank)}
        m.save(root / "own", {"model": msd, "loader": own, "step": 3})
        into = {"model": msd, "loader": {f"rank{rank}": torch.tensor(-1)}, "step": 0}
        loaded = m.load(root / "own", into=into)
    report["loaded"] = [int(loaded["loader"][f"rank{rank}"]), loaded["step"]]
    print(json.dumps(report))
    leave_process_group()


def manager_save() -> None:
    """Train 2 steps (FSDP2 + AdamW), save through a sync manager to ROOT/sync; train one
    more, save through an async manager to ROOT/async and train on (under lock()) while it
    uploads. Rank 0 writes the gathered references and the losses."""
    root, rank, _ = setup_rank()
    model, optimizer = _sharded()
    losses = [train_step(model, optimizer, step) for step in range(2)]
    report: dict[str, Any] = {}
    with _strict_manager("sync") as manager:
        msd, osd = get_state_dict(model, optimizer)
        assert manager.save(root / "sync", {"model": msd, "optim": osd, "step": 2}) is None
        try:
            manager.save(root / "refused", {"model": msd, "optim": osd, "step": 2, "lr": 0.1})
        except KeyError as err:
            report["strict"] = str(err)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as plain:
        plain.save(root / "module", {"model": model, "step": 2})  # the FSDP2 module itself
    reference = full_state(model, optimizer)
    if rank == 0:
        safetensors.torch.save_file(reference, root / "reference-sync.safetensors")

    with _strict_manager("async") as manager:
        losses.append(train_step(model, optimizer, 2))
        msd, osd = get_state_dict(model, optimizer)
        reference = full_state(model, optimizer)
        first = manager.save(root / "async", {"model": msd, "optim": osd, "step": 3})
        x, y = batch(3)
        loss = (model(x) - y).square().mean()
        loss.backward()
        with manager.lock():  # changes every saved tensor while the upload may still run
            optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.item()))
        assert first is not None
        first.result()
        # a second save reuses the manager's writer once the first is collected
        msd, osd = get_state_dict(model, optimizer)
        second = manager.save(root / "async-2", {"model": msd, "optim": osd, "step": 4})
        reference_2 = full_state(model, optimizer)
    report["second_done"] = second is not None and second.done()
    if rank == 0:
        safetensors.torch.save_file(reference, root / "reference-async.safetensors")
        safetensors.torch.save_file(reference_2, root / "reference-async-2.safetensors")
        report["losses"] = losses
        print(json.dumps(report))
    leave_process_group()


def manager_load() -> None:
    """On WORLD ranks: load ROOT/sync and ROOT/async through the manager into FSDP2
    get_state_dict templates (resharded in place), compare with the references bitwise,
    check the typed errors, and take the next training step."""
    root, rank, _ = setup_rank()
    report: dict[str, Any] = {"rank": rank}
    manager = fastckpt.CheckpointManager()
    for name in ("sync", "async"):
        model, optimizer = _sharded()
        msd, osd = get_state_dict(model, optimizer)
        loaded = manager.load(
            root / name, into={"model": msd, "optim": osd, "step": 0}, strict=True
        )
        set_state_dict(
            model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        gathered = full_state(model, optimizer)
        step = loaded["step"]
        report[f"{name}_step"] = step
        report[f"{name}_loss"] = train_step(model, optimizer, step)
        if rank == 0:
            expected = safetensors.torch.load_file(root / f"reference-{name}.safetensors")
            report[f"{name}_bad"] = compare(expected, gathered)
    model, optimizer = _sharded()
    loaded = manager.load(root / "module", into={"model": model, "step": 0}, strict=True)
    report["module_is_template"] = loaded["model"] is model
    gathered = full_state(model, optimizer)
    if rank == 0:
        expected = safetensors.torch.load_file(root / "reference-sync.safetensors")
        report["module_bad"] = compare(
            {name: tensor for name, tensor in expected.items() if name.startswith("model.")},
            {name: tensor for name, tensor in gathered.items() if name.startswith("model.")},
        )
    msd, osd = get_state_dict(model, optimizer)
    errors: dict[str, str] = {}
    wrong = {"0.weight": torch.zeros(301, 38)}  # a plain template of the wrong global shape
    for label, into, strict in (
        ("shape", {"model": wrong}, False),
        ("strict", {"model": msd, "optim": osd, "epoch": 0}, True),
        ("template", {"model": {"0.weight": object()}}, False),
    ):
        try:
            manager.load(root / "sync", into=into, strict=strict)
        except (fastckpt.CheckpointMismatchError, TypeError) as err:
            errors[label] = f"{type(err).__name__}: {err}"
    report["errors"] = errors
    manager.close()
    print(json.dumps(report))
    leave_process_group()


def _tiers_manager(root: Path, kind: str) -> fastckpt.CheckpointManager:
    config = (
        fastckpt.CheckpointManager.Config.with_sync_save()
        if kind == "sync"
        else fastckpt.CheckpointManager.Config.with_async_save()
    )
    config.tiers = fastckpt.TiersConfig(
        fast=root / "fast", durable=root / "durable", keep_last=2, durable_keep_last=2
    )
    return fastckpt.CheckpointManager(config)


def manager_tiers_save() -> None:
    """Train FSDP2 + AdamW and save step_1..step_3 through a manager with tiers (ROOT/fast,
    promoted to ROOT/durable, each keeping 2), sync or async (the last argument); rank 0
    writes the gathered state of step_3 and prints the promoter's report."""
    root, rank, _ = setup_rank()
    kind = sys.argv[-1]
    model, optimizer = _sharded()
    with _tiers_manager(root, kind) as manager:
        for step in range(1, 4):
            train_step(model, optimizer, step)
            msd, osd = get_state_dict(model, optimizer)
            future = manager.save(f"step_{step}", {"model": msd, "optim": osd, "step": step})
            if future is not None:
                future.result()
        reference = full_state(model, optimizer)
    report = {
        "rank": rank,
        "healthy": manager.promotion_healthy,
        "promoted": [] if manager.promoter is None else manager.promoter.promoted,
    }
    if rank == 0:
        safetensors.torch.save_file(reference, root / "reference-tiers.safetensors")
    print(json.dumps(report))
    leave_process_group()


def manager_tiers_load() -> None:
    """On WORLD ranks: ``load_latest`` from the tiers of ROOT (its fast tier deleted by the
    test) into FSDP2 templates, resharded; rank 0 compares with the reference bitwise."""
    root, rank, _ = setup_rank()
    model, optimizer = _sharded()
    msd, osd = get_state_dict(model, optimizer)
    with _tiers_manager(root, "sync") as manager:
        loaded = manager.load_latest(into={"model": msd, "optim": osd, "step": 0})
        assert manager.restored_from is not None
        restored = [manager.restored_from.tier.name, manager.restored_from.name]
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    gathered = full_state(model, optimizer)
    report: dict[str, Any] = {"rank": rank, "restored": restored, "step": loaded["step"]}
    if rank == 0:
        expected = safetensors.torch.load_file(root / "reference-tiers.safetensors")
        report["bad"] = compare(expected, gathered)
    print(json.dumps(report))
    leave_process_group()


def manager_tiers_load_disagree() -> None:
    """:func:`manager_tiers_load` on 2 ranks that see different durable tiers: rank 0
    ROOT/durable (newest step_3), rank 1 ROOT/durable-old (step_2 only; the fast tier is gone
    for both). Prints what each restored and skipped; rank 0 writes the gathered state it
    loaded to ROOT/gathered-agreed.safetensors."""
    root, rank, _ = setup_rank()
    model, optimizer = _sharded()
    msd, osd = get_state_dict(model, optimizer)
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    durable = root / ("durable" if rank == 0 else "durable-old")
    config.tiers = fastckpt.TiersConfig(fast=root / "fast", durable=durable)
    with fastckpt.CheckpointManager(config) as manager:
        loaded = manager.load_latest(into={"model": msd, "optim": osd, "step": 0})
        copy = manager.restored_from
        assert copy is not None
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    gathered = full_state(model, optimizer)
    if rank == 0:
        safetensors.torch.save_file(gathered, root / "gathered-agreed.safetensors")
    report = {
        "rank": rank,
        "restored": [copy.tier.name, copy.name],
        "skipped": copy.skipped,
        "step": loaded["step"],
    }
    print(json.dumps(report))
    leave_process_group()


# --------------------------------------------------------------------------- TrainingStrategy


def training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean squared error on an (x, y) batch."""
    x, y = batch
    return (model(x) - y).square().mean()


def loader() -> Any:
    """64 samples of 37 features in shuffled batches of 16 (the same on every rank)."""
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 37, generator=gen)
    return DataLoader(TensorDataset(x, x[:, :1] * 2.0 - 1.0), batch_size=16, shuffle=True)


class Recorder:
    """Records each loss; at ``save_at`` steps writes the gathered full state (rank 0)."""

    def __init__(self, directory: Path, save_at: tuple[int, ...] = ()) -> None:
        self.directory = directory
        self.save_at = save_at
        self.losses: list[float] = []

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is not fastckpt.TrainingStage.AFTER_BATCH or ctx.loss is None:
            return
        self.losses.append(ctx.loss.item())
        if ctx.step_count in self.save_at:
            state = full_state(ctx.models["main"], ctx.optimizers["main"])  # collective
            if dist.get_rank() == 0:
                name = f"reference-step{ctx.step_count}.safetensors"
                safetensors.torch.save_file(state, self.directory / name)


class Settle:
    """A hook after a CheckpointHook: once it saved, waits for its background write and then
    for its promotion on this rank (no collective: each rank waits for its own), so that
    every due index reaches the durable tier before the next one is saved."""

    def __init__(self, hook: fastckpt.CheckpointHook) -> None:
        self.hook = hook

    def __call__(self, ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is not fastckpt.TrainingStage.AFTER_BATCH or ctx.step_count % 2:
            return
        while self.hook.writing:
            time.sleep(0.01)
        if self.hook.promoter is not None:
            self.hook.promoter.wait()


def strategy_train() -> None:
    """FSDP2 + AdamW + StepLR for 6 steps with a CheckpointHook every 2 steps (keep_last=2)."""
    root, rank, _ = setup_rank()
    torch.manual_seed(0)
    recorder = Recorder(root.parent, save_at=(3, 4, 6))
    hook = fastckpt.CheckpointHook(root, step_interval=2, keep_last=2)  # async (default)
    sync_hook = fastckpt.CheckpointHook(root.parent / "sync-run", step_interval=3, async_save=False)
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(
            torch.optim.AdamW,
            {"lr": 1e-2},
            torch.optim.lr_scheduler.StepLR,
            {"step_size": 3, "gamma": 0.5},
        ),
        training_fn=training_fn,
        hooks=[hook, sync_hook, recorder],
        num_steps=6,
    )
    strategy.run(loader())
    last = [hook.last_checkpoint_index, sync_hook.last_checkpoint_index]
    print(json.dumps({"rank": rank, "losses": recorder.losses, "last": last}))
    leave_process_group()


def bf16_training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """:func:`training_fn` of a bfloat16 model (the batch cast to it, the loss in float32)."""
    x, y = batch
    return (model(x.to(torch.bfloat16)).float() - y).square().mean()


def strategy_bf16_save() -> None:
    """An FSDP2 model converted to bfloat16 after construction (its first layer frozen),
    trained 2 steps with a live AdamW of two parameter groups and saved at step 2 by a
    synchronous CheckpointHook; rank 0 writes the gathered state to
    ROOT/../reference-bf16.safetensors."""
    root, rank, _ = setup_rank()
    torch.manual_seed(0)
    model = build_model().to(torch.bfloat16)
    model[0].requires_grad_(False)  # frozen before sharding: recorded, frozen again at rebuild
    model = shard(model)
    # two groups (no weight decay for biases, their own lr): rebuilt as two groups
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW(
        [
            {"params": weights, "weight_decay": 0.1},
            {"params": biases, "weight_decay": 0.0, "lr": 0.1},
        ],
        lr=1e-2,
    )
    strategy = fastckpt.TrainingStrategy(
        model,
        optimizer,
        training_fn=bf16_training_fn,
        hooks=[fastckpt.CheckpointHook(root, step_interval=2, async_save=False)],
        num_steps=2,
    )
    strategy.run(loader())
    _write_reference(strategy, root.parent / "reference-bf16.safetensors", rank)
    print(json.dumps({"rank": rank}))
    leave_process_group()


def noisy_training_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    """:func:`training_fn` with input noise drawn from torch's RNG (as dropout draws)."""
    x, y = batch
    return (model(x + 0.1 * torch.randn_like(x)) - y).square().mean()


def _seeded_apart(steps: int, hooks: list[Any]) -> fastckpt.TrainingStrategy:
    """An FSDP2 strategy whose ranks are seeded apart (each shuffles and draws its own)."""
    model = shard(build_model())  # (build_model seeds torch itself)
    torch.manual_seed(1000 + dist.get_rank())
    return fastckpt.TrainingStrategy(
        model,
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=noisy_training_fn,
        hooks=hooks,
        num_steps=steps,
    )


def strategy_rank_seeds_train() -> None:
    """Ranks seeded apart: 4 steps straight, then 2 steps saved at step 2 (sync); prints each
    rank's losses of both runs."""
    root, rank, _ = setup_rank()
    straight = Recorder(root.parent)
    _seeded_apart(4, [straight]).run(loader())
    first = Recorder(root.parent)
    hook = fastckpt.CheckpointHook(root, step_interval=2, async_save=False)
    _seeded_apart(2, [hook, first]).run(loader())
    print(json.dumps({"rank": rank, "straight": straight.losses, "first": first.losses}))
    leave_process_group()


def strategy_rank_seeds_resume() -> None:
    """Resume :func:`strategy_rank_seeds_train`'s checkpoint (RNGs scrambled first) and train
    to step 4; prints each rank's resumed losses."""
    root, rank, _ = setup_rank()
    torch.manual_seed(5)
    resumed = Recorder(root.parent)
    strategy = fastckpt.TrainingStrategy.load_checkpoint(
        root, hooks=[resumed], training_fn=noisy_training_fn, parallelize=shard
    )
    strategy.num_steps = 4
    strategy.run(loader())
    print(json.dumps({"rank": rank, "resumed": resumed.losses}))
    leave_process_group()


class TwoLayers(nn.Module):
    """Two Linears, the first of which :func:`wrap_and_shard` wraps for activation
    checkpointing (its parameters' names gain ``_checkpoint_wrapped_module``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(37, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def wrap_and_shard(model: nn.Module) -> nn.Module:
    """A ``parallelize=`` that changes parameter names: activation checkpointing, then FSDP2."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model.a = checkpoint_wrapper(model.a)
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def strategy_wrapped_frozen() -> None:
    """A frozen layer wrapped for activation checkpointing: saved, then resumed with the same
    ``parallelize``; prints the resumed model's frozen parameter names."""
    root, rank, _ = setup_rank()
    torch.manual_seed(0)
    model = TwoLayers()
    model.a.requires_grad_(False)
    model = wrap_and_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    hook = fastckpt.CheckpointHook(root, step_interval=2, async_save=False)
    fastckpt.TrainingStrategy(
        model, optimizer, training_fn=training_fn, hooks=[hook], num_steps=2
    ).run(loader())
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        root, training_fn=training_fn, parallelize=wrap_and_shard
    )
    frozen = [n for n, p in resumed.models["main"].named_parameters() if not p.requires_grad]
    print(json.dumps({"rank": rank, "frozen": frozen}))
    leave_process_group()


def strategy_refreeze_on_restore() -> None:
    """A hook froze the first Linear after step 2 of an FSDP2 run saved at step 4; a strategy
    built all trainable, as the run was at its start, restores the checkpoint: prints its
    frozen parameter names, and whether training 2 more steps left the frozen ones as saved
    (rank 0 decides)."""
    root, rank, _ = setup_rank()

    def freeze_at_2(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == 2:
            ctx.models["main"][0].requires_grad_(False)

    def make(hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
        return fastckpt.TrainingStrategy(
            shard(build_model()),
            fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 0.01}),
            training_fn=training_fn,
            hooks=[freeze_at_2, *hooks],
            num_steps=steps,
        )

    hook = fastckpt.CheckpointHook(root, step_interval=4, async_save=False)
    make([hook], 4).run(loader())
    live = make([], 6)
    live.restore_checkpoint(root)
    model = live.models["main"]
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    before = full_state(model, live.optimizers["main"])
    live.run(loader())
    after = full_state(model, live.optimizers["main"])
    if rank == 0:
        kept = [k for k in ("model.0.weight", "model.0.bias") if torch.equal(before[k], after[k])]
        trained = not torch.equal(before["model.2.weight"], after["model.2.weight"])
        print(json.dumps({"frozen": frozen, "kept": kept, "trained": trained}))
    else:
        print(json.dumps({"frozen": frozen}))
    leave_process_group()


def strategy_ema_refused() -> None:
    """An EMAHook over an FSDP2 model (DTensor averages) with a CheckpointHook (async or sync,
    the last argument): prints each rank's error."""
    root, rank, _ = setup_rank()
    model = shard(build_model())
    hook = fastckpt.CheckpointHook(
        root, step_interval=2, async_save=sys.argv[-1] == "async", wait_timeout_secs=20
    )
    strategy = fastckpt.TrainingStrategy(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        training_fn=training_fn,
        hooks=[fastckpt.EMAHook(), hook],
        num_steps=4,
    )
    try:
        strategy.run(loader())
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    print(json.dumps({"rank": rank, "error": error}))
    leave_process_group()


def strategy_node_train() -> None:
    """:func:`strategy_train`'s run with each rank saving to its own fast root (ROOT/../node<R>:
    one simulated node each) and its durable tier ROOT/../durable, each save promoted before the
    next (:class:`Settle`: node-local tiers promote only the newest due index); prints the last
    index. With ``refused`` as the last argument, without a durable tier: prints the save's
    error."""
    root, rank, _ = setup_rank()
    torch.manual_seed(0)
    refused = sys.argv[-1] == "refused"
    durable = None if refused else root.parent / "durable"
    recorder = Recorder(root.parent, save_at=(4, 6))
    hook = fastckpt.CheckpointHook(
        root.parent / f"node{rank}", step_interval=2, keep_last=2, durable_dir=durable
    )
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=training_fn,
        hooks=[hook, recorder, Settle(hook)],
        num_steps=6,
    )
    try:
        strategy.run(loader())
    except Exception as err:  # the async save's failure, raised when the hook closes
        if not refused:
            raise
        print(json.dumps({"rank": rank, "error": f"{type(err).__name__}: {err}"}))
    else:
        print(json.dumps({"rank": rank, "last": hook.last_checkpoint_index}))
    leave_process_group()


def strategy_node_direct_save() -> None:
    """Each rank calls ``TrainingStrategy.save_checkpoint`` on its own directory
    (ROOT/../node<R>, one simulated node each): once plainly (prints the error every rank
    gets), then with ``node_local=True`` (prints the index)."""
    root, rank, _ = setup_rank()
    torch.manual_seed(0)
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=training_fn,
        num_steps=2,
    )
    strategy.run(loader())
    node = root.parent / f"node{rank}"
    try:
        strategy.save_checkpoint(node)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    else:
        error = None
    index = strategy.save_checkpoint(node, node_local=True)
    print(json.dumps({"rank": rank, "error": error, "index": index}))
    leave_process_group()


def resume_and_compare(
    root: str | Path, references: Path, rank: int, fallback_dirs: list[str] | None = None
) -> dict[str, Any]:
    """Rebuild the strategy from ``root``'s index 1 (step 4; from the first of
    ``fallback_dirs`` holding it intact when ``root`` does not) with parallelize=shard on this
    process group, check the gathered state against ``references``' step-4 state (bitwise),
    train on to step 6 and compare with the step-6 one; returns the report (rank 0 compares)."""
    recorder = Recorder(references)
    strategy = fastckpt.TrainingStrategy.load_checkpoint(
        root,
        1,
        hooks=[recorder],
        training_fn=training_fn,
        parallelize=shard,
        fallback_dirs=fallback_dirs,
    )
    model, optimizer = strategy.models["main"], strategy.optimizers["main"]
    loaded = full_state(model, optimizer)
    report: dict[str, Any] = {
        "rank": rank,
        "sharded": strategy.sharded,
        "step": strategy.step_count,
        "lr": strategy.schedulers["main"].get_last_lr() if strategy.schedulers else None,
        "restored_from": None
        if strategy.restored_from is None
        else str(strategy.restored_from.root),
        "node_local": strategy.restored_from is not None and strategy.restored_from.node_local,
    }
    strategy.run(loader())
    final = full_state(model, optimizer)
    report["losses"] = recorder.losses
    if rank == 0:
        step4 = safetensors.torch.load_file(references / "reference-step4.safetensors")
        step6 = safetensors.torch.load_file(references / "reference-step6.safetensors")
        report["loaded_bad"] = compare(step4, loaded)
        report["final_bad"] = compare(step6, final)
        report["final_close"] = all(
            torch.allclose(step6[name], final[name], rtol=1e-4, atol=1e-6) for name in step6
        )
    return report


def strategy_node_local_resume() -> None:
    """:func:`resume_and_compare` of :func:`strategy_node_train`'s index 1 on WORLD ranks,
    each from its own node's fast root ROOT/../node<R> (absent on a node that joined), falling
    back to ROOT/../durable; prints the report, or the error every rank got."""
    root, rank, _ = setup_rank()
    try:
        report = resume_and_compare(
            root.parent / f"node{rank}",
            root.parent,
            rank,
            fallback_dirs=[str(root.parent / "durable")],
        )
    except Exception as err:
        report = {"rank": rank, "error": f"{type(err).__name__}: {err}"}
    print(json.dumps(report))
    leave_process_group()


def strategy_node_local_resume_or_start() -> None:
    """``TrainingStrategy.resume_or_start`` of :func:`strategy_node_train`'s run on each
    rank's own node root (rank 1's holds no manifest), ROOT/../durable as its durable tier;
    prints the step it resumed at and where from (a fresh start prints step None)."""
    root, rank, _ = setup_rank()
    started: list[int] = []

    def start() -> fastckpt.TrainingStrategy:
        started.append(rank)
        return _strategy(6)

    strategy = fastckpt.TrainingStrategy.resume_or_start(
        root.parent / f"node{rank}",
        start,
        training_fn=training_fn,
        parallelize=shard,
        fallback_dirs=[str(root.parent / "durable")],
    )
    copy = strategy.restored_from
    report = {
        "rank": rank,
        "step": None if started else strategy.step_count,
        "restored_from": None if copy is None else [str(copy.root), copy.index, copy.node_local],
    }
    print(json.dumps(report))
    leave_process_group()


def strategy_resume() -> None:
    """:func:`resume_and_compare` of ROOT on WORLD ranks, and FSDP1 refused at construction."""
    root, rank, _ = setup_rank()
    report = resume_and_compare(root, root.parent, rank)
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel(build_model(), device_id=torch.device("cpu"))
    try:
        fastckpt.TrainingStrategy(fsdp1, training_fn=training_fn)
    except ValueError as err:
        report["fsdp1"] = str(err)
    print(json.dumps(report))
    leave_process_group()


# --------------------------------------------------------------------------- replacements


def _strategy(steps: int) -> fastckpt.TrainingStrategy:
    """FSDP2 + AdamW + StepLR (seeded), trained for ``steps`` steps."""
    torch.manual_seed(0)
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(
            torch.optim.AdamW,
            {"lr": 1e-2},
            torch.optim.lr_scheduler.StepLR,
            {"step_size": 3, "gamma": 0.5},
        ),
        training_fn=training_fn,
        num_steps=steps,
    )
    strategy.run(loader())
    return strategy


def strategy_torn_restore() -> None:
    """Save index 0 of ROOT at step 2, then restore it into a run at step 4 with a validator
    refusing on rank 1 only (rank 1's shards are the checkpoint's, its counters the run's):
    the next save and run() are refused on every rank, naming rank 1, until a restore
    completes on every rank; then it saves the checkpoint's step."""
    from fastckpt.errors import InterruptedStepError

    root, rank, _ = setup_rank()
    _strategy(2).save_checkpoint(root)
    live = _strategy(4)

    def refuse_on_rank_1(model: nn.Module) -> None:
        if rank == 1:
            raise RuntimeError("rank 1 refuses")

    report: dict[str, Any] = {}
    try:
        live.restore_checkpoint(root, validators=[refuse_on_rank_1])
        report["restored"] = True
    except ValueError:
        report["restored"] = False
    try:
        report["refused"] = f"saved index {live.save_checkpoint(root)}"
    except InterruptedStepError as err:
        report["refused"] = str(err)
    live.num_steps = 6
    try:
        live.run(loader())
        report["run"] = f"trained to step {live.step_count}"
    except InterruptedStepError as err:
        report["run"] = str(err)
    report["index"] = live.restore_checkpoint(root, 0)
    report["saved"] = live.save_checkpoint(root)
    report["step"] = live.step_count
    print(json.dumps(report))
    leave_process_group()


def _write_reference(strategy: fastckpt.TrainingStrategy, path: Path, rank: int) -> None:
    """The gathered full model and optimizer state (collective; rank 0 writes it)."""
    state = full_state(strategy.models["main"], strategy.optimizers["main"])
    if rank == 0:
        safetensors.torch.save_file(state, path)


def replace_killed() -> None:
    """Save index 0 of ROOT at step 2 (reference-step2), train to step 4, then replace index 0
    with rank 0 SIGKILLed once the sharded part is committed, right before the index's
    manifest commit. Rank 1 then waits for rank 0 until the test kills it."""
    import os
    import signal

    from fastckpt.checkpoint import components

    root, rank, _ = setup_rank()
    strategy = _strategy(2)
    _write_reference(strategy, root.parent / "reference-step2.safetensors", rank)
    assert strategy.save_checkpoint(root) == 0
    strategy.num_steps = 4
    strategy.run(loader())
    if rank == 0:

        def killed(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)

        components.write_snapshot = killed  # type: ignore[assignment]
    print("replacing", flush=True)
    strategy.save_checkpoint(root, checkpoint_index=0)
    print("replaced", flush=True)  # never reached on rank 0
    leave_process_group()


def replace_loop() -> None:
    """One rank: train two states A (step 2) and B (step 4), write their references, save A,
    touch ROOT.ready, then replace the checkpoint ITERATIONS times alternating B, A, B, ...

    MODE ``index``: index 0 of the strategy root ROOT (``save_checkpoint(checkpoint_index=0)``).
    MODE ``manager``: the CheckpointManager checkpoint ROOT (model, optim and step)."""
    root, rank, _ = setup_rank()
    mode, iterations = sys.argv[5], int(sys.argv[6])
    states = [_strategy(2), _strategy(4)]
    for strategy in states:
        name = f"reference-step{strategy.step_count}.safetensors"
        _write_reference(strategy, root.parent / name, rank)
    manager = fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())

    def save(strategy: fastckpt.TrainingStrategy) -> None:
        if mode == "index":
            strategy.save_checkpoint(root, checkpoint_index=0)
        else:
            model, optimizer = strategy.models["main"], strategy.optimizers["main"]
            msd, osd = get_state_dict(model, optimizer)
            manager.save(root, {"model": msd, "optim": osd, "step": strategy.step_count})

    save(states[0])
    Path(f"{root}.ready").touch()
    for i in range(iterations):
        save(states[(i + 1) % 2])
    manager.close()
    print(json.dumps({"rank": rank, "saves": iterations + 1}))
    leave_process_group()


OTHER_RUN = """
import sys, torch, fastckpt
fastckpt.save_checkpoint(sys.argv[1], models={"main": (torch.nn.Linear(2, 2), None)},
                         counters={"step_count": 3})
"""


def strategy_mixed_run() -> None:
    """FSDP2 + AdamW for 6 steps with a CheckpointHook every step (``async`` or ``sync``: the
    fifth argument) into ROOT (or the ``s3://`` root given sixth); at step 3, once the hook's
    save chose its index and wrote its shards, another process (rank 0 starts it) commits an
    index of its own there, with the same number. Prints each rank's error type and
    message."""
    import subprocess

    root, rank, _ = setup_rank()
    async_save = sys.argv[5] == "async"
    if len(sys.argv) > 6:  # an s3:// root (the local one holds the rendezvous only)
        root = sys.argv[6]  # type: ignore[assignment]
    torch.manual_seed(0)

    import fastckpt.checkpoint.components as components
    import fastckpt.training.hooks.checkpoint as checkpoint_hook

    real = components.write_snapshot

    def after_the_other_run(*args: Any, **kwargs: Any) -> Any:
        # This save's index was chosen (2) and its shards written: the other run commits
        # its own index 2 now, before this commit takes the root's lock.
        components.write_snapshot = checkpoint_hook.write_snapshot = real  # type: ignore[attr-defined]
        subprocess.run([sys.executable, "-c", OTHER_RUN, str(root)], check=True)
        return real(*args, **kwargs)

    def other_run(ctx: fastckpt.TrainContext, stage: fastckpt.TrainingStage) -> None:
        if stage is fastckpt.TrainingStage.AFTER_BATCH and ctx.step_count == 3:
            while hook.writing:  # this run's index of step 2 is committed first
                time.sleep(0.01)
            if rank == 0:  # the commit of the save of step 3 (sync or async)
                components.write_snapshot = after_the_other_run  # type: ignore[assignment]
                checkpoint_hook.write_snapshot = after_the_other_run  # type: ignore[attr-defined]

    hook = fastckpt.CheckpointHook(root, step_interval=1, async_save=async_save)
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
        training_fn=training_fn,
        hooks=[other_run, hook],
        num_steps=6,
    )
    error: BaseException | None = None
    try:
        strategy.run(loader())
    except Exception as err:
        error = err
    print(
        json.dumps(
            {
                "rank": rank,
                "error": None if error is None else type(error).__name__,
                "message": str(error),
                "step": strategy.step_count,
            }
        )
    )
    leave_process_group()


def save_indices() -> None:
    """Save indices 0, 1 and 2 of ROOT at steps 1, 2 and 3 (one rank or more)."""
    root, _, _ = setup_rank()
    strategy = _strategy(1)
    strategy.save_checkpoint(root)
    for steps in (2, 3):
        strategy.num_steps = steps
        strategy.run(loader())
        strategy.save_checkpoint(root)
    leave_process_group()


def manager_unsharded_then_sharded() -> None:
    """Save plain state to ROOT/last through a manager, then FSDP2 state to the same id (a
    run moving from DDP to FSDP2 under one name). Rank 0 prints the folder's names."""
    root, rank, _ = setup_rank()
    model, optimizer = _sharded()
    train_step(model, optimizer, 0)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(root / "last", {"w": torch.ones(2), "step": 1})
        msd, osd = get_state_dict(model, optimizer)
        m.save(root / "last", {"model": msd, "optim": osd, "step": 2})
    if rank == 0:
        print(json.dumps(sorted(p.name for p in (root / "last").iterdir())))
    leave_process_group()


def hand_attached_scheduler() -> None:
    """An FSDP2 strategy with a LambdaLR put into ``strategy.schedulers`` by hand: a sharded
    save keeps its state_dict() alone, so check_recordable must not ask for its recipe.
    Prints ``{"index": ..., "recordable": true}``."""
    root, rank, _ = setup_rank()
    strategy = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=training_fn,
    )
    name = next(iter(strategy.optimizers))
    strategy.schedulers[name] = torch.optim.lr_scheduler.LambdaLR(
        strategy.optimizers[name], lambda epoch: 0.9**epoch
    )
    strategy.check_recordable()
    index = strategy.save_checkpoint(root)
    # load_checkpoint cannot rebuild it: refused, naming the fix (before: resumed without the
    # scheduler, its learning rate frozen); restore_checkpoint into a strategy with it works.
    try:
        fastckpt.TrainingStrategy.load_checkpoint(root, training_fn=training_fn)
        refused = ""
    except fastckpt.CheckpointMismatchError as err:
        refused = str(err)
    again = fastckpt.TrainingStrategy(
        shard(build_model()),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=training_fn,
    )
    again.schedulers[name] = torch.optim.lr_scheduler.LambdaLR(
        again.optimizers[name], lambda epoch: 0.9**epoch
    )
    restored = again.restore_checkpoint(root)
    if rank == 0:
        print(
            json.dumps(
                {
                    "index": index,
                    "recordable": True,
                    "refused": "attached by hand" in refused and "restore_checkpoint" in refused,
                    "restored": restored,
                }
            )
        )
    leave_process_group()


def restore_with_pending_gradients() -> None:
    """``restore_checkpoint`` into an FSDP2 strategy whose parameters hold gradients (a
    backward pass before the restore): DCP builds the optimizer-state template only without
    them, so the load refused every saved moment. Prints whether every moment came back."""
    root, rank, _ = setup_rank()

    def make() -> fastckpt.TrainingStrategy:
        return fastckpt.TrainingStrategy(
            shard(build_model()),
            fastckpt.OptimizerConfig(torch.optim.Adam, {"lr": 0.1}),
            training_fn=training_fn,
        )

    saved = make()
    model, optimizer = saved.models["main"], saved.optimizers["main"]
    training_fn(model, batch(0)).backward()
    optimizer.step()
    optimizer.zero_grad()
    saved.save_checkpoint(root)
    live = make()
    training_fn(live.models["main"], batch(1)).backward()  # gradients pending, no step yet
    grads = [p.grad for p in live.models["main"].parameters()]
    live.restore_checkpoint(root)
    same = compare(
        full_state(saved.models["main"], saved.optimizers["main"]),
        full_state(live.models["main"], live.optimizers["main"]),
    )
    kept = all(p.grad is g for p, g in zip(live.models["main"].parameters(), grads, strict=True))
    if rank == 0:
        print(json.dumps({"mismatches": same, "grads_kept": kept}))
    leave_process_group()
