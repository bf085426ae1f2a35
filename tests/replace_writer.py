"""A writer process for the reader-during-replacement tests (tests/test_store.py): replaces a
checkpoint in a loop, alternating two trained states.

Usage: ``python replace_writer.py MODE PATH ITERATIONS`` where MODE is ``index`` (replace index
0 of the root PATH), ``manager`` (replace the CheckpointManager checkpoint PATH) or ``prune``
(save a new index of the root PATH, then prune all but the last two).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from checkpoint_support import Net, manager_state, trained
from fastckpt import CheckpointManager, prune, save_checkpoint
from fastckpt.checkpoint.specs import create_model_spec


def save_at(root: Path, state: Any, index: int, counters: int = 1) -> int:
    """Save a trained state as index ``index`` of ``root`` (-1: the next), with ``counters``
    integer counters."""
    model, optimizer, scheduler = state
    return save_checkpoint(
        root,
        models={"main": (model, create_model_spec(Net, width=8))},
        optimizers={"adam": (optimizer, None)},
        schedulers={"sched": (scheduler, None)},
        checkpoint_index=index,
        counters={f"counter{i}": i for i in range(counters)},
    )


def main(mode: str, path: Path, iterations: int) -> None:
    """Run ``iterations`` replacements."""
    states = [trained(1), trained(2)]
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        for i in range(iterations):
            state = states[i % 2]
            if mode == "index":
                save_at(path, state, 0)
            elif mode == "manager":
                manager.save(path, manager_state(state))
            else:
                save_at(path, state, -1)
                prune(path, keep_last=2)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
