"""``fastckpt promote SOURCE TARGET``: copy a root's committed indices to another root, or a
tier's newest CheckpointManager checkpoint to another tier."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fastckpt.cli.common import enclosing_checkpoint
from fastckpt.cli.render import print_json
from fastckpt.cli.status import EXIT_BAD, EXIT_OK, UserError
from fastckpt.cli.text import printable
from fastckpt.container.promote import promote
from fastckpt.container.promote_checkpoints import (
    checkpoint_problem,
    committed_checkpoints,
    date_text,
    promote_checkpoint,
    same_files,
    saved_later,
    tier_dates,
    tier_left_behind,
)
from fastckpt.container.sharded.promote import node_local_root, upload_rank_files
from fastckpt.format.records import COMMIT_RECORD, MANIFEST, SHARDED_RECORD, Manifest
from fastckpt.io.progress import format_bytes
from fastckpt.storage.backend import explain_full_disk
from fastckpt.storage.registry import backend_for, display_path, is_local


def cmd_promote(args: argparse.Namespace) -> int:
    """A save_checkpoint root: promote every committed index of ``args.source`` (each
    ``args.every``-th and the newest) that ``args.target`` does not hold yet, oldest first.
    A tier root of CheckpointManager checkpoints: promote its newest checkpoint unless the
    target holds it already. Either finishes a promotion a killed process left half done.
    One node's fast root of a sharded run on node-local tiers: this node's shards are
    uploaded, and on rank 0's node the newest due index is committed once every rank's
    shards are in the target (waited for up to ``args.wait`` seconds)."""
    source, target = Path(args.source), Path(args.target)
    local = is_local(backend_for(source))
    if local and not source.is_dir():
        raise _not_promotable(source)
    _refuse_inside_a_checkpoint(target)
    committed = backend_for(source).exists(source / MANIFEST)
    if not committed:
        names = committed_checkpoints(source)
        if names:
            _refuse_mixing(source, target, manager_source=True)
            return _promote_newest_checkpoint(source, target, names[-1], args)
    node_local = local and node_local_root(source)
    if not (committed or node_local):
        raise _not_promotable(source)
    _refuse_mixing(source, target, manager_source=False)
    if node_local:
        # One node's fast root of a sharded run on node-local tiers: this node's shards of
        # ranks other than 0 go up first; rank 0's node then commits once every rank's are
        # there (run this command on every node).
        uploaded = upload_rank_files(source, target, args.every, None, set())
        if not committed:
            return _report_node_upload(source, target, uploaded, args)
    try:
        # A full disk: the target named, not a hidden temporary path in it (before: the
        # bare "No space left on device (os error 28)" naming ``TARGET/.tmp-0~...``).
        with explain_full_disk(
            display_path(target),
            doing=f"promoting {display_path(source)} to",
            kept="nothing more was promoted (the indices promoted before stay committed) and "
            "what it held is intact",
            again="promote",
            filename=display_path(target),
        ):
            report = promote(
                source,
                target,
                every=args.every,
                node_local=node_local,
                wait_s=args.wait,
                verify_held=True,  # a repair: a damaged copy there is replaced
            )
    except ValueError as err:  # the root itself as the target, a pre-parts sharded index
        raise UserError(str(err)) from None
    if args.json:
        print_json(
            {
                "source": display_path(source),
                "target": display_path(target),
                "promoted": report.promoted,
                "skipped": report.skipped,
                "bytes_copied": report.bytes_copied,
                "bytes_reused": report.bytes_reused,
                "damaged": [{"index": index, "error": why} for index, why in report.damaged],
                "conflicting": report.conflicting,
            }
        )
        return EXIT_BAD if report.damaged or report.conflicting else EXIT_OK
    for index, why in report.damaged:
        print(
            f"fastckpt promote: index {index} of {display_path(source)} does not verify, not "
            f"promoted ({printable(why)})",
            file=sys.stderr,
        )
    for index in report.conflicting:
        print(
            f"fastckpt promote: {display_path(target)} holds another checkpoint as its index "
            f"{index} (it verifies, its files differ from {display_path(source)}'s): kept, not "
            f"replaced; delete that index there first to promote this one",
            file=sys.stderr,
        )
    if report.promoted:
        indices = ", ".join(str(index) for index in report.promoted)
        print(
            f"promoted index(es) {indices} of {display_path(source)} to {display_path(target)} "
            f"({format_bytes(report.bytes_copied)})"
        )
    elif not report.conflicting and not report.damaged:  # those were named above
        print(_nothing_promoted(source, target, report.newest, report.vanished))
    return EXIT_BAD if report.damaged or report.conflicting else EXIT_OK


def _nothing_promoted(
    source: Path, target: Path, target_newest: int | None, vanished: Sequence[int] = ()
) -> str:
    """What ``fastckpt promote`` says when it copied nothing: the source moved on while it
    ran (a trainer saving, pruning, promoting beside it), the target holds the source's
    newest index already, or an index newer than it (another run's, or this one's from
    later: indices older than the target's newest are never promoted)."""
    source_indices = set(Manifest.load(source).entries)
    newest = max(source_indices, default=None)
    target_manifest = Manifest.load(target)
    target_indices = set(target_manifest.entries)
    held = newest is not None and newest in target_indices
    moved = (
        f" ({display_path(source)} pruned {', '.join(str(i) for i in vanished)} while this ran)"
        if vanished
        else ""
    )
    if (
        newest is not None
        and newest not in target_indices
        and (target_manifest.latest is None or target_manifest.latest < newest)
    ):
        # The source's newest came, or the target changed, after this promotion looked.
        return (
            f"nothing promoted{moved}: {display_path(source)}'s newest index is now {newest}, "
            f"saved after this promotion looked, or {display_path(target)} changed meanwhile "
            "(another promoter beside it); run it again to promote it"
        )
    if newest is None or target_newest is None or held:
        missing = sorted(source_indices - target_indices)
        if not missing:
            return f"{display_path(target)} already holds every index of {display_path(source)}"
        shown = ", ".join(str(i) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        return (
            f"{display_path(target)} already holds the newest index of {display_path(source)}, "
            f"{newest}; it lacks {shown}, which are not promoted (only indices newer than the "
            "target's newest are)"
        )
    return (
        f"nothing promoted: {display_path(target)}'s newest index {target_newest} is newer "
        f"than {display_path(source)}'s newest, {newest}, which it does not hold (indices "
        "older than the target's newest are never promoted; is the target another run's?)"
    )


def _refuse_inside_a_checkpoint(target: Path) -> None:
    """Refuse a local TARGET that is a checkpoint or inside one (``durable/3``,
    ``durable/step_3``): promoting there would write a root or checkpoints into it."""
    if not is_local(backend_for(target)):
        return
    if os.path.lexists(target) and not os.path.isdir(target):
        raise UserError(
            f"{display_path(target)} is a file, not a folder: promote into a folder (a "
            "save_checkpoint root or a folder of CheckpointManager checkpoints)"
        )
    found = enclosing_checkpoint(target)
    if found is None:
        held = [r for r in (COMMIT_RECORD, SHARDED_RECORD) if os.path.lexists(target / r)]
        found = (target, held[0]) if held else None
    if found is not None:
        directory, record = found
        raise UserError(
            f"{display_path(target)} is inside the checkpoint {directory} (it holds {record}); "
            "promote into a root or a directory of checkpoints, never into a checkpoint"
        )


def _not_promotable(source: Path) -> UserError:
    """The error for a SOURCE that is neither kind promote copies (a missing path, a file, an
    index directory, a single checkpoint, an empty directory)."""
    missing = is_local(backend_for(source)) and not os.path.lexists(source)
    what = "does not exist" if missing else "is not a folder of checkpoints"
    return UserError(
        f"{display_path(source)} {what}: promote copies a save_checkpoint root (a directory "
        f"holding {MANIFEST}, not one of its index directories) or a directory of "
        f"CheckpointManager checkpoints (each holding {COMMIT_RECORD})"
    )


def _refuse_mixing(source: Path, target: Path, *, manager_source: bool) -> None:
    """Refuse to promote into a TARGET that holds the other kind of checkpoints (a
    save_checkpoint root's indices and CheckpointManager checkpoints never share a folder:
    each kind's retention and listing would trip over the other's)."""
    if manager_source:
        if backend_for(target).exists(target / MANIFEST):
            raise UserError(
                f"{display_path(target)} is a save_checkpoint root (it holds {MANIFEST}); "
                f"{display_path(source)} holds CheckpointManager checkpoints: promote them to "
                "a directory of CheckpointManager checkpoints (or a new one), never into a root"
            )
        return
    if backend_for(target).exists(target / MANIFEST):
        return  # a root already: the same kind
    held = committed_checkpoints(target)
    if held:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UserError(
            f"{display_path(target)} holds CheckpointManager checkpoints ({shown}); "
            f"{display_path(source)} is a save_checkpoint root: promote it to another root (or "
            "a new directory), never into a directory of CheckpointManager checkpoints"
        )


def _report_node_upload(
    source: Path, target: Path, uploaded: list[int], args: argparse.Namespace
) -> int:
    """A node other than rank 0's: what it uploaded (rank 0's node commits it)."""
    if args.json:
        print_json(
            {
                "source": display_path(source),
                "target": display_path(target),
                "uploaded": uploaded,
            }
        )
    elif uploaded:
        print(
            f"uploaded this node's shards of index {uploaded[-1]} of {display_path(source)} to "
            f"{display_path(target)}; `fastckpt promote` on rank 0's node commits it"
        )
    else:
        print(f"{display_path(source)}: no shards to upload to {display_path(target)}")
    return EXIT_OK


def _refuse_older(source: Path, target: Path, name: str) -> None:
    """Refuse what the background promoter passes over: a newest checkpoint of ``source``
    whose name ``target`` holds from a later save (a run that went on elsewhere), or a
    ``source`` tier left from an earlier run (``target`` holds a checkpoint saved after all
    of its). Either promotion would replace or bury the run's newer checkpoints.

    Raises:
        UserError: names the later checkpoint and its date.
    """
    later = saved_later(source / name, target / name)
    if later is not None:
        raise UserError(
            f"{display_path(target / name)} was saved later ({date_text(later)}) than "
            f"{display_path(source / name)}, by a run that went on elsewhere: the older copy "
            "would replace it, so it is not promoted"
        )
    ahead, _ = tier_left_behind([tier_dates(source)], tier_dates(target))
    if ahead is not None:
        raise UserError(
            f"{display_path(source)} is a tier left from an earlier run: "
            f"{display_path(target / ahead)} was saved after all of its checkpoints; nothing "
            "is promoted (remove the stale tier, or promote into another target)"
        )


def _promote_newest_checkpoint(
    source: Path, target: Path, name: str, args: argparse.Namespace
) -> int:
    if args.every != 1:
        raise UserError(
            f"{display_path(source)}: a tier of CheckpointManager checkpoints; --every applies "
            "to save_checkpoint roots (the manager decides which saves it promotes)"
        )
    _refuse_older(source, target, name)
    held = same_files(source / name, target / name)
    if held:
        # A repair: the target's copy is read back, and promoted again when it is damaged.
        problem = checkpoint_problem(target / name)
        if problem is not None:
            print(
                f"fastckpt promote: {printable(display_path(target / name))} does not verify "
                f"({printable(problem)}); "
                "promoting it again",
                file=sys.stderr,
            )
            held = False
    copied = reused = 0
    if not held:
        try:
            done = promote_checkpoint(source / name, target / name)
        except ValueError as err:  # the tier itself as the target, a file without a crc32c
            raise UserError(str(err)) from None
        copied, reused = done.copied, done.reused
    if args.json:
        print_json(
            {
                "source": display_path(source),
                "target": display_path(target),
                "promoted": [] if held else [name],
                "skipped": [name] if held else [],
                "bytes_copied": copied,
                "bytes_reused": reused,
            }
        )
    elif held:
        print(
            f"{display_path(target)} already holds {printable(name)}, the newest of "
            f"{display_path(source)}"
        )
    else:
        print(
            f"promoted {printable(name)} of {display_path(source)} to {display_path(target)} "
            f"({format_bytes(copied)})"
        )
    return EXIT_OK
