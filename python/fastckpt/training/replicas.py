"""Which models a data-parallel run replicates over every rank (DDP): what decides that only
rank 0 may save them by hand and that every rank must resume the same checkpoint."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from fastckpt.checkpoint.components import is_compiled

__all__ = ["data_parallel_over_world"]


def data_parallel_over_world(model: torch.nn.Module, world: int) -> bool:
    """Whether ``model`` is a DDP module replicated over every rank of a world of ``world``
    ranks (its process group is the default one, or one as large), also inside
    ``torch.compile``'s wrapper (``torch.compile(DDP(module))``)."""
    import torch.distributed as dist

    while is_compiled(model):
        model = getattr(model, "_orig_mod")  # noqa: B009 (Module.__getattr__ types it loosely)
    if not isinstance(model, DistributedDataParallel):
        return False
    group = getattr(model, "process_group", None)
    return group is None or dist.get_world_size(group) == world
