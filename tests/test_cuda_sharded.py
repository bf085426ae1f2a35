"""The sharded path on a GPU: FSDP2 on CUDA under an NCCL process group (one rank, one GPU),
saved and loaded through ``fastckpt.dcp.Writer``/``Reader`` under ``dcp.save``/``dcp.load``,
``CheckpointManager`` (sync and async), ``TrainingStrategy.save_checkpoint`` and an async
``CheckpointHook``, restored with ``load_checkpoint(parallelize=...)``, each bitwise against
the gathered state it saved. An async sharded save on NCCL alone once failed in DCP ("A CPU
backend must be enabled for async save"): the manager and the hook made their gloo group
only for two ranks or more.
The CPU suite runs the same paths with gloo on CPU tensors; this one checks what only CUDA
has (device DTensors staged to host, NCCL collectives in the planner, CUDA generator state
in a strategy index). Skipped without CUDA; ``tools/gpu_check.py`` runs it on a GPU
machine."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from dcp_support import script_report

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import fastckpt, fastckpt.dcp
    from dcp_support import (
        build_model, compare, feature_batches, first_feature_loss, fsdp2_on, full_state,
        hooked_strategy,
    )

    work = Path(sys.argv[1])
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{work / 'rendezvous'}", rank=0, world_size=1,
        device_id=torch.device("cuda", 0),
    )
    shard = fsdp2_on("cuda")

    def trained():
        model = shard(build_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x in feature_batches(3):
            first_feature_loss(model, x).backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    def fresh():
        model = shard(build_model())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    report = {}
    model, optimizer = trained()
    expected = full_state(model, optimizer)
    assert all(t.device.type == "cuda" for t in model.state_dict().values())

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, storage_writer=fastckpt.dcp.Writer(work / "dcp"))
    target, target_optimizer = fresh()
    tmsd, tosd = get_state_dict(target, target_optimizer)
    dcp.load({"model": tmsd, "optim": tosd}, storage_reader=fastckpt.dcp.Reader(work / "dcp"))
    set_state_dict(target, target_optimizer, model_state_dict=tmsd, optim_state_dict=tosd)
    report["dcp"] = compare(expected, full_state(target, target_optimizer))
    report["dcp_verified"] = fastckpt.verify(work / "dcp").ok

    for kind in ("sync", "async"):
        config = getattr(fastckpt.CheckpointManager.Config, f"with_{kind}_save")()
        with fastckpt.CheckpointManager(config) as manager:
            msd, osd = get_state_dict(model, optimizer)
            future = manager.save(work / kind, {"model": msd, "optim": osd, "step": 3})
            if future is not None:
                future.result()
            target, target_optimizer = fresh()
            tmsd, tosd = get_state_dict(target, target_optimizer)
            loaded = manager.load(work / kind, into={"model": tmsd, "optim": tosd, "step": 0})
        set_state_dict(
            target, target_optimizer,
            model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
        )
        report[kind] = compare(expected, full_state(target, target_optimizer))
        report[f"{kind}_step"] = loaded["step"]

    strategy = hooked_strategy(shard, work / "hooked")  # async saves
    saved = full_state(strategy.models["main"], strategy.optimizers["main"])
    strategy.save_checkpoint(work / "run")
    for name in ("run", "hooked"):
        resumed = fastckpt.TrainingStrategy.load_checkpoint(
            work / name, training_fn=first_feature_loss, parallelize=shard
        )
        loaded = full_state(resumed.models["main"], resumed.optimizers["main"])
        report[name] = compare(saved, loaded)
        report[f"{name}_step"] = resumed.step_count
        report[f"{name}_sharded"] = resumed.sharded
    print(json.dumps(report))
    dist.destroy_process_group()
    """
)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp2_state_on_cuda_round_trips_bitwise_under_nccl(tmp_path: Path) -> None:
    report = script_report(_SCRIPT, str(tmp_path))
    for path in ("dcp", "sync", "async", "run", "hooked"):
        assert report[path] == [], (path, report)
    assert report["dcp_verified"], report
    assert report["sync_step"] == report["async_step"] == 3, report
    for name in ("run", "hooked"):  # save_checkpoint, and the hook's async save at step 4
        assert report[f"{name}_step"] == 4 and report[f"{name}_sharded"], report
