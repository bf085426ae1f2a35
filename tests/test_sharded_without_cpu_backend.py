"""Async sharded saves on a process group without a CPU backend: what a one-GPU job on NCCL
alone has. DCP's ``async_save`` needs a CPU backend on the group it is given; the manager and
the ``CheckpointHook`` made their own gloo group only for two ranks or more, so on one NCCL
rank every async sharded save raised "A CPU backend must be enabled for async save" (found on
an H200 by ``tests/test_cuda_sharded.py``). Reproduced here without a GPU: a one-rank group
whose only backend is registered for CUDA devices (``"cuda:gloo"``) lacks the CPU backend in
the same way."""

from __future__ import annotations

import textwrap
from pathlib import Path

from dcp_support import script_report

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import fastckpt
    from dcp_support import compare, first_feature_loss, fsdp2_on, full_state, hooked_strategy

    work = Path(sys.argv[1])
    dist.init_process_group(
        "cuda:gloo", init_method=f"file://{work / 'rendezvous'}", rank=0, world_size=1
    )
    report = {"cpu_backend": torch.device("cpu") in dist.group.WORLD._device_types}
    strategy = hooked_strategy(fsdp2_on("cpu"), work / "hooked")  # async saves
    model, optimizer = strategy.models["main"], strategy.optimizers["main"]
    expected = full_state(model, optimizer)
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_async_save()) as manager:
        msd, osd = get_state_dict(model, optimizer)
        manager.save(work / "managed", {"model": msd, "optim": osd}).result()

    # Loads on this group would move object collectives to a CUDA device this machine lacks
    # (a real NCCL job has one): the checkpoints are loaded in one process instead.
    dist.destroy_process_group()
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        work / "hooked", training_fn=first_feature_loss
    )
    restored = full_state(resumed.models["main"], resumed.optimizers["main"])
    report["hooked"] = compare(expected, restored)
    report["hooked_step"] = resumed.step_count
    loaded = fastckpt.CheckpointManager().load(work / "managed")
    flat = {f"model.{k}": v for k, v in loaded["model"].items()}
    flat.update(
        (f"optim.{fqn}.{key}", value if torch.is_tensor(value) else torch.tensor(value))
        for fqn, state in loaded["optim"]["state"].items()
        for key, value in state.items()
    )
    report["managed"] = compare(expected, flat)
    print(json.dumps(report))
    """
)


def test_async_sharded_saves_work_on_one_rank_without_a_cpu_backend(tmp_path: Path) -> None:
    report = script_report(_SCRIPT, str(tmp_path))
    assert report["cpu_backend"] is False, report  # the group is the one a NCCL-only job has
    assert report["hooked"] == [] and report["hooked_step"] == 4, report
    assert report["managed"] == [], report
