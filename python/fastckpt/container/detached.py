"""The detached promoter: promotion runs in a process of its own, which outlives the trainer.

A :class:`~fastckpt.container.promote.Promoter` made with ``detached=True`` (the
``CheckpointHook``'s ``detached_promotion=True``, ``TiersConfig(detached=True)``) starts a Python
process running this module as ``__main__`` at its first promotion run, in a new session and
with the trainer's ``sys.path`` (so it imports the same fastckpt), and keeps it until the
promoter closes. Each run is handed over as one line of JSON on its standard input, the
promoter's :meth:`~fastckpt.container.promote.Promoter.spec`; the process makes the promoter
again (:func:`promoter_from_spec`), runs it once
(:meth:`~fastckpt.container.promote.Promoter.run_here`: the same protocol, the same checks as in
the trainer) and answers with one line of JSON, the outcome (``{"error": "..."}`` on
failure). One process for the whole run: its start (and an ``s3://`` client's imports) is
paid once, and files it promoted are reused by its next promotions as in the trainer.

Being in a session of its own, it is not stopped by what stops the trainer: a SIGKILL of the
trainer, or a Ctrl-C (SIGINT) sent to the trainer's process group. It finishes the run it is
in, then sees its standard input closed and exits: the durable tier gets the checkpoint
without waiting for a next process. Killed itself, it leaves what any killed promotion leaves
(nothing committed, leftovers the next promotion removes).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from fastckpt.container.promote import Promoter, RankPromoter
from fastckpt.container.promote_checkpoints import CheckpointPromoter
from fastckpt.storage.registry import configure_storage

__all__ = ["main", "promoter_from_spec"]


def promoter_from_spec(spec: Mapping[str, Any]) -> Promoter:
    """The promoter :meth:`~fastckpt.container.promote.Promoter.spec` describes, run in this
    process (not detached); registers the object-store options the spec carries."""
    for root, options in (spec.get("storage_options") or {}).items():
        configure_storage(root, options)
    promoter: Promoter
    if spec.get("queue") is not None:  # tier roots of CheckpointManager checkpoints
        tiers = CheckpointPromoter(spec["source"], spec["target"], keep_last=spec["keep_last"])
        for name in spec["queue"]:
            tiers.enqueue(name)
        promoter = tiers
    elif spec.get("rank") is not None:
        promoter = RankPromoter(spec["source"], spec["target"], spec["rank"], every=spec["every"])
        promoter.uploaded.update(spec.get("uploaded") or ())
    else:
        promoter = Promoter(
            spec["source"], spec["target"], every=spec["every"], keep_last=spec["keep_last"]
        )
    promoter.node_local = bool(spec.get("node_local"))
    promoter.wait_s = spec.get("wait_s")
    if spec.get("within") is not None:  # what the trainer's retention spares for this run
        promoter._in_flight = frozenset(spec["within"])
    return promoter


def main() -> int:
    """Run each spec read from standard input (one JSON line each) and print its outcome as
    one JSON line, until standard input closes (module docstring)."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            outcome = promoter_from_spec(json.loads(line)).run_here()
        except Exception as err:
            outcome = {"error": f"{type(err).__name__}: {err}"}
        try:
            print(json.dumps(outcome), flush=True)
        except BrokenPipeError:  # the trainer is gone; the run is done
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
