"""Checkpoints written by earlier fastckpt versions promote and load truthfully.

Roots written before every index was self-contained reference unchanged tensors in an
earlier index's own file (``refs.json`` naming that index; built here with
``crash_harness.legacy_references``, which writes what those versions wrote). EMA shadows
of DDP runs written before the shadow was keyed by the unwrapped names carry ``module.``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt
from cli_support import cli_runner
from fastckpt import _native
from fastckpt.container import incremental
from fastckpt.container.promote import Promoter, promote
from fastckpt.errors import CheckpointFormatError, CheckpointMismatchError, PromotionError
from fastckpt.format.records import MANIFEST, Manifest, check_schema_version, seal_manifest
from s3_support import S3Server, s3_env, s3_root, s3_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import crash_harness

__all__ = ["cli_runner", "s3_env", "s3_root", "s3_server"]  # fixtures used by name below

cli_runner = pytest.fixture(cli_runner)


@pytest.fixture(autouse=True)
def _fresh_trackers() -> None:
    incremental.forget()


def _legacy_root(root: Path) -> list[dict[str, torch.Tensor]]:
    """Four indices as an earlier fastckpt wrote them: index ``i`` changes one tensor, so
    index 2 references index 1's file and index 3 references indices 0, 1 and 2 (each
    unchanged tensor in the earlier index that wrote it). Returns each index's weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    changed = [model[0].weight, model[2].weight, model[2].bias]
    states = []
    with crash_harness.legacy_references():
        for i in range(4):
            if i:
                with torch.no_grad():
                    changed[i - 1].add_(1.0)
            fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": i})
            states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _refs_path(root: Path, index: int) -> Path:
    return root / str(index) / "refs.json"


def _referenced(root: Path, index: int) -> set[int]:
    document = json.loads(_refs_path(root, index).read_text())
    return {ref["index"] for names in document["refs"].values() for ref in names.values()}


def _loads_bitwise(root: Path, index: int, expected: dict[str, torch.Tensor]) -> None:
    state = fastckpt.load_checkpoint(root, index)["models"]["main"]["model"].state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), (index, name)


def _reseal(root: Path, index: int, relpath: str, data: bytes) -> None:
    """Write ``data`` as ``relpath`` of ``index`` and update the manifest's record of it (and
    the manifest's own crc32c), so that the parser sees the data."""
    (root / str(index) / relpath).write_bytes(data)
    document = json.loads((root / MANIFEST).read_bytes())
    document["checkpoints"][str(index)]["files"][relpath] = {
        "size": len(data),
        "crc32c": _native.crc32c(data),
    }
    (root / MANIFEST).write_text(json.dumps(seal_manifest(document)))


# 1. promotion of a root of an earlier version --------------------------------------------


def test_fastckpt_promote_every_2_of_an_earlier_versions_root_loads_in_the_target(
    tmp_path: Path, cli_runner: Any
) -> None:
    """Before: ``promote --every 2`` copied indices 0, 2 and 3, reported success, and 2 and 3
    failed to load in the target (index 1, which they reference, was never copied) with a
    FileNotFoundError blaming "deleting that index by hand"; verify found them damaged."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    states = _legacy_root(fast)
    assert _referenced(fast, 2) == {0, 1} and _referenced(fast, 3) == {0, 1, 2}
    status, out, err = cli_runner("promote", fast, durable, "--every", "2")
    assert status == 0, (out, err)
    assert sorted(Manifest.load(durable).entries) == [0, 2, 3]
    report = fastckpt.verify(durable)
    assert report.ok, report
    for index in (0, 2, 3):
        _loads_bitwise(durable, index, states[index])
    # The promoted entries are the source's (same files): promoting again commits nothing.
    committed = (durable / MANIFEST).read_bytes()
    status, out, err = cli_runner("promote", fast, durable, "--every", "2")
    assert status == 0 and "already holds the newest index" in out, (out, err)
    assert (durable / MANIFEST).read_bytes() == committed
    # The target's own retention keeps the bytes its kept indices reference.
    fastckpt.prune(durable, keep_last=1)
    _loads_bitwise(durable, 3, states[3])
    assert fastckpt.verify(durable).ok


def test_a_background_promoter_every_2_of_an_earlier_versions_root_loads_in_the_target(
    tmp_path: Path,
) -> None:
    """The hooks' and manager's background promotion goes through the same code: before,
    its copy of index 2 did not load (index 1 missing in the target), reported healthy."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    states = _legacy_root(fast)
    promoter = Promoter(fast, durable, every=2, keep_last=1)
    promoter.submit()
    promoter.close()
    assert promoter.healthy and promoter.promoted == [0, 2]
    assert sorted(Manifest.load(durable).entries) == [2]
    assert fastckpt.verify(durable).ok
    _loads_bitwise(durable, 2, states[2])


def test_a_prune_of_an_object_store_root_keeps_the_indices_old_references_read(
    s3_server: S3Server,
    s3_root: str,
    s3_env: dict[str, str],
    tmp_path: Path,
    cli_runner: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``fastckpt promote --every 1`` copies an earlier version's indices with their
    ``refs.json`` to an ``s3://`` root. Before, a prune there (``keep_last=1``) deleted
    indices 0-2, which index 3 reads tensors from (an object store keeps no ``.ref-<i>``
    copy): the newest index failed verify and its load raised FileNotFoundError. Now the
    referenced indices are kept, each warned of with the fix, and index 3 loads bitwise."""
    fast = tmp_path / "fast"
    states = _legacy_root(fast)
    status, out, err = cli_runner("promote", fast, s3_root, "--every", "1")
    assert status == 0, (out, err)
    with caplog.at_level("WARNING", logger="fastckpt.container.commit"):
        assert fastckpt.prune(s3_root, keep_last=1) == []
    assert sorted(Manifest.load(s3_root).entries) == [0, 1, 2, 3]
    spared = [r.getMessage() for r in caplog.records if "not deleting index" in r.getMessage()]
    assert len(spared) == 3 and all("save it again" in m for m in spared), spared
    assert fastckpt.verify(s3_root).ok
    _loads_bitwise(s3_root, 3, states[3])
    # The fix the warning names: index 3 saved again by this fastckpt is self-contained,
    # and the next prune frees the earlier indices.
    model = fastckpt.load_checkpoint(s3_root, 3)["models"]["main"]["model"]
    fastckpt.save_checkpoint(s3_root, models={"main": (model, None)})
    assert fastckpt.prune(s3_root, keep_last=1) == [0, 1, 2, 3]
    _loads_bitwise(s3_root, 4, states[3])
    assert fastckpt.verify(s3_root).ok


def test_a_reference_the_target_cannot_hold_is_refused_before_anything_is_committed(
    tmp_path: Path, cli_runner: Any
) -> None:
    """The target's index 1 is another run's checkpoint: the bytes index 2 of the source
    references (its index 1's file) can be neither found there nor kept beside it (a
    retained copy of a committed index is swept). Before, index 2 was committed and failed
    to load; now the promotion is refused, typed, naming the index, the layout and the fix."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    _legacy_root(fast)
    other = nn.Linear(2, 2)
    for _ in range(2):
        fastckpt.save_checkpoint(durable, models={"main": (other, None)}, incremental=False)
    before = (durable / MANIFEST).read_bytes()
    with pytest.raises(PromotionError) as caught:
        promote(fast, durable, every=2, newest=False)
    message = str(caught.value)
    assert "index 2" in message and "earlier fastckpt" in message
    assert "refs.json" in message and "--every 1" in message and "save" in message
    assert (durable / MANIFEST).read_bytes() == before
    assert not (durable / "2").exists()
    status, _, err = cli_runner("promote", fast, durable, "--every", "2")
    assert status == 2 and "index 2" in err
    assert (durable / MANIFEST).read_bytes() == before


# 3. refs.json's schema_version ----------------------------------------------------------


def _incremental_root(root: Path) -> None:
    model = nn.Linear(4, 4)
    fastckpt.save_checkpoint(root, models={"main": (model, None)})
    with torch.no_grad():
        model.bias.add_(1)
    fastckpt.save_checkpoint(root, models={"main": (model, None)})
    assert _refs_path(root, 1).exists()


@pytest.mark.parametrize("version", [2, 99])
def test_a_refs_json_of_a_newer_schema_is_refused_naming_the_upgrade(
    tmp_path: Path, version: int
) -> None:
    """Before: refs.json's schema_version was never read; a newer one loaded as schema 1."""
    _incremental_root(tmp_path)
    document = json.loads(_refs_path(tmp_path, 1).read_text())
    document["schema_version"] = version
    _reseal(tmp_path, 1, "refs.json", json.dumps(document).encode())
    with pytest.raises(CheckpointFormatError, match=r"1/refs\.json.*newer fastckpt.*upgrade"):
        fastckpt.load_checkpoint(tmp_path, 1)


@pytest.mark.parametrize("version", [None, "banana", True, 0, "missing"])
def test_a_refs_json_without_an_int_schema_version_is_a_format_error(
    tmp_path: Path, version: Any
) -> None:
    """Before: loaded as schema 1 without a word."""
    _incremental_root(tmp_path)
    document = json.loads(_refs_path(tmp_path, 1).read_text())
    if version == "missing":
        del document["schema_version"]
    else:
        document["schema_version"] = version
    _reseal(tmp_path, 1, "refs.json", json.dumps(document).encode())
    with pytest.raises(CheckpointFormatError, match=r"1/refs\.json.*schema_version"):
        fastckpt.load_checkpoint(tmp_path, 1)


# 4. references that cannot be what an earlier version wrote ------------------------------


def _edit_reference(root: Path, of: int, fields: dict[str, Any]) -> None:
    """Set ``fields`` of index ``of``'s reference to ``0.weight`` (re-sealed)."""
    document = json.loads(_refs_path(root, of).read_text())
    document["refs"]["models/main.safetensors"]["0.weight"].update(fields)
    _reseal(root, of, "refs.json", json.dumps(document).encode())


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"index": 3}, "not older than"),
        ({"index": 5}, "not older than"),
        ({"file_size": 12345}, "size"),
        ({"file_crc32c": 7}, "crc32c"),
    ],
    ids=["own-index", "newer-index", "file-size", "file-crc32c"],
)
def test_a_reference_that_cannot_resolve_is_a_format_error_naming_it(
    tmp_path: Path, fields: dict[str, Any], why: str
) -> None:
    """Before: "<root>/<i>/models/main.safetensors: missing ... deleting that index by hand
    broke it. Put index <i> back from a backup" (FileNotFoundError), while that file is
    there: the reference is at fault, and was not named."""
    _legacy_root(tmp_path)
    assert _referenced(tmp_path, 3) == {0, 1, 2}
    _edit_reference(tmp_path, 3, fields)
    with pytest.raises(CheckpointFormatError) as caught:
        fastckpt.load_checkpoint(tmp_path, 3)
    message = str(caught.value)
    assert "3/refs.json" in message and "'0.weight'" in message, message
    assert "models/main.safetensors" in message and why in message, message
    assert "by hand" not in message
    assert not fastckpt.verify(tmp_path, 3).ok


def test_a_referenced_index_deleted_by_hand_still_says_so(tmp_path: Path) -> None:
    """The genuinely missing case keeps its message (it names the backup and prune)."""
    _legacy_root(tmp_path)
    os.rename(tmp_path / "1", tmp_path / "gone")
    document = json.loads((tmp_path / MANIFEST).read_bytes())
    del document["checkpoints"]["1"]
    (tmp_path / MANIFEST).write_text(json.dumps(seal_manifest(document)))
    with pytest.raises(FileNotFoundError, match=r"1/models/main\.safetensors: missing.*by hand"):
        fastckpt.load_checkpoint(tmp_path, 2)


# 2. EMA shadows of DDP runs of earlier versions -----------------------------------------


class _Scaled(nn.Module):
    """A wrapper-style model: an output scale ``weight`` around a submodule ``module``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, 4))
        self.module = nn.Linear(4, 4)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_an_old_ddp_shadow_of_a_model_with_a_submodule_named_module_fits(prefix: str) -> None:
    """The shadow an earlier fastckpt saved from ``DDP(_Scaled())`` is keyed ``module.weight``,
    ``module.module.weight``, ``module.module.bias``. Before, exact names came first: its
    ``module.weight`` (the DDP-wrapped ``weight``) was taken as the submodule's weight, and
    the shadow was refused as not fitting (``missing ['weight']``, ``other shapes``)."""
    torch.manual_seed(0)
    model = _Scaled()
    saved = {prefix + name: torch.randn_like(p) for name, p in model.named_parameters()}
    hook = fastckpt.EMAHook(decay=0.9)
    hook.load_state_dict(
        {"model_key": "main", "decay": 0.9, "update_every": 1, "num_updates": 3, "shadow": saved}
    )
    hook.copy_to(model)
    for name, param in model.named_parameters():
        assert torch.equal(param, saved[prefix + name]), name
    assert sorted(hook.shadow) == sorted(name for name, _ in model.named_parameters())


def test_a_shadow_that_fits_only_partly_after_the_prefix_is_still_refused() -> None:
    """Stripping the common prefix is taken only when it gives exactly the model's names:
    otherwise the per-key mapping decides, and a shadow that does not fit is refused."""
    model = _Scaled()
    saved = {"module.weight": torch.zeros(1, 4), "module.module.weight": torch.zeros(4, 4)}
    hook = fastckpt.EMAHook(decay=0.9)
    hook.load_state_dict(
        {"model_key": "main", "decay": 0.9, "update_every": 1, "num_updates": 1, "shadow": saved}
    )
    with pytest.raises(CheckpointMismatchError, match="missing"):
        hook.copy_to(model)


def test_a_prune_keeps_the_files_a_promotions_partial_retained_copy_lacks(
    tmp_path: Path,
) -> None:
    """A promotion's retained copy ``.ref-<i>`` holds only the files one promoted index
    referenced; when index ``i`` itself is later pruned where no hard link can be made, its
    other files are moved into that copy instead of being deleted with ``ROOT/<i>``. Before
    the review of round 16, an existing ``.ref-<i>`` was taken as complete: ``ROOT/<i>`` was
    removed, and kept indices referencing its other files lost their bytes."""
    from fastckpt.container.refs import retain_for_references

    index_dir = tmp_path / "3" / "models"
    index_dir.mkdir(parents=True)
    (index_dir / "main.safetensors").write_bytes(b"main")
    (index_dir / "head.safetensors").write_bytes(b"head")
    partial = tmp_path / ".ref-3" / "models"
    partial.mkdir(parents=True)
    (partial / "main.safetensors").write_bytes(b"main")
    retain_for_references(tmp_path, 3)
    assert not (tmp_path / "3").exists()
    assert (partial / "main.safetensors").read_bytes() == b"main"
    assert (partial / "head.safetensors").read_bytes() == b"head"


def _step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def _run_recorded_under_old_paths(
    root: Path, monkeypatch: pytest.MonkeyPatch, *, configs: bool
) -> fastckpt.EMAHook:
    """Train 4 steps with a CheckpointHook and an EMAHook, recording every fastckpt class
    under the module path an earlier release had (``fastckpt.hooks.ema.EMAHook``), and with
    ``configs`` the hooks' configurations under those paths too; returns the EMA hook."""
    from fastckpt._moved_paths import MOVED
    from fastckpt.checkpoint import trust
    from fastckpt.training.hooks import rebuild

    earlier = {new: old for old, new in MOVED.items()}
    current = trust.dotted_path

    def as_earlier_versions_wrote(obj: Any) -> str:
        path = current(obj)
        module, _, name = path.rpartition(".")
        return f"{earlier[module]}.{name}" if module in earlier else path

    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ema = fastckpt.EMAHook(decay=0.5)
    hook = fastckpt.CheckpointHook(root, step_interval=4, async_save=False)
    strategy = fastckpt.TrainingStrategy(
        nn.Linear(4, 1),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=_step,
        hooks=[hook, ema],
        num_epochs=1,
    )
    with monkeypatch.context() as patch:
        patch.setattr(trust, "dotted_path", as_earlier_versions_wrote)
        if configs:
            old = {as_earlier_versions_wrote(cls): cls for cls in rebuild.REBUILDABLE.values()}
            patch.setattr(rebuild, "REBUILDABLE", old)
        strategy.run(batches)
    return ema


def test_an_ema_saved_under_the_old_module_path_is_restored_and_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_runner: Any
) -> None:
    """Strategy checkpoints written before the layered layout (2026-12-02) record the hook as
    ``fastckpt.hooks.ema.EMAHook``. Before: a resume with an EMAHook warned "no matching hook
    was passed" and started the average over (0 updates), and ``fastckpt export --model ema``
    found "0 EMAHook state(s)"; now the old path names the same hook."""
    ema = _run_recorded_under_old_paths(tmp_path / "root", monkeypatch, configs=False)
    hooks_json = json.loads((tmp_path / "root" / "0" / "hooks.json").read_text())
    assert [h["class"] for h in hooks_json["hooks"]] == ["fastckpt.hooks.ema.EMAHook"]  # then
    saved = {k: v.clone() for k, v in ema.shadow.items()}

    restored = fastckpt.EMAHook(decay=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no matching hook was passed" would fail here
        fastckpt.TrainingStrategy.load_checkpoint(
            tmp_path / "root", training_fn=_step, hooks=[restored]
        )
    assert restored.num_updates == 4
    assert saved.keys() == restored.shadow.keys()
    assert all(torch.equal(saved[k], restored.shadow[k]) for k in saved)

    status, _, err = cli_runner(
        "export", tmp_path / "root", "--to", tmp_path / "ema.safetensors", "--model", "ema"
    )
    assert status == 0, err
    exported = fastckpt.load_file(tmp_path / "ema.safetensors")
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_hooks_recorded_under_the_old_module_paths_are_rebuilt_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume without ``hooks=`` rebuilds the run's hooks from their recorded
    configurations; those an earlier release recorded name the old modules. Before the old
    paths were mapped: "cannot rebuild" twice and no hooks (the EMA restarted)."""
    ema = _run_recorded_under_old_paths(tmp_path / "root", monkeypatch, configs=True)
    configs = json.loads((tmp_path / "root" / "0" / "hooks.json").read_text())["configs"]
    assert [c["class"] for c in configs][:2] == [
        "fastckpt.hooks.checkpoint.CheckpointHook",
        "fastckpt.hooks.ema.EMAHook",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed = fastckpt.TrainingStrategy.load_checkpoint(tmp_path / "root", training_fn=_step)
    kinds = [type(h).__name__ for h in resumed.hooks]
    assert "CheckpointHook" in kinds and "EMAHook" in kinds, kinds
    (restored,) = [h for h in resumed.hooks if isinstance(h, fastckpt.EMAHook)]
    assert restored.num_updates == 4
    assert all(torch.equal(ema.shadow[k], restored.shadow[k]) for k in ema.shadow)


# 5. Manifest schema 2: fields an earlier fastckpt would skip ---------------------------


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))


def _schema(root: Path) -> int:
    return int(json.loads((root / MANIFEST).read_bytes())["schema_version"])


@pytest.mark.parametrize("change", ["eval_submodule", "channels_last", "frozen"])
def test_a_manifest_an_earlier_fastckpt_would_load_wrong_is_refused_by_it(
    tmp_path: Path, change: str
) -> None:
    """Round 21, cross-version finding 1: entries recording train/eval modes, memory layouts
    or frozen parameters were written under schema 1, which earlier fastckpt versions read
    while skipping entry fields they do not know: a rolled-back fastckpt loaded a frozen
    BatchNorm back in training mode, a ``channels_last`` model contiguous, a frozen
    parameter trainable, without a word, and a resumed run drifted. Such a manifest is now
    schema 2, which every earlier version refuses ("written by a newer fastckpt; upgrade"),
    and this one loads it with the recorded state."""
    model = _bn_model()
    if change == "eval_submodule":
        model[1].eval()
    elif change == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    else:
        model[0].weight.requires_grad_(False)
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": 1})
    assert _schema(root) == 2
    earlier = int(json.loads((root / MANIFEST).read_bytes())["schema_version"])
    with pytest.raises(CheckpointFormatError, match=r"written by a newer fastckpt.*upgrade"):
        # what every earlier version runs on a manifest (it reads schema 1 only)
        check_schema_version(earlier, 1, str(root / MANIFEST))
    loaded = fastckpt.load_checkpoint(root)
    rebuilt = loaded["models"]["main"]["model"]
    if change == "eval_submodule":
        assert rebuilt.training and not rebuilt[1].training
    elif change == "channels_last":
        assert rebuilt[0].weight.is_contiguous(memory_format=torch.channels_last)
    else:
        assert not rebuilt[0].weight.requires_grad and rebuilt[3].weight.requires_grad


def test_a_manifest_without_such_fields_stays_schema_1(tmp_path: Path) -> None:
    """Written as 1 whenever it can be: an earlier fastckpt still reads a plain root whole
    (and a root whose recorded index was pruned goes back to 1)."""
    root = tmp_path / "root"
    model = _bn_model()
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": 0})
    assert _schema(root) == 1
    model[1].eval()
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": 1})
    assert _schema(root) == 2
    model[1].train()
    fastckpt.save_checkpoint(root, models={"main": (model, None)}, counters={"step": 2})
    fastckpt.prune(root, keep_last=1)
    assert _schema(root) == 1
    assert fastckpt.load_checkpoint(root)["models"]["main"]["model"][1].training


def _with_new_field(path: Path) -> None:
    """Add a field a newer fastckpt might write, sealed as it would seal it."""
    document = json.loads(path.read_bytes())
    document["written_by_a_later_version"] = 1
    if "crc32c" in document:
        seal_manifest(document)
    path.write_text(json.dumps(document))


def test_a_record_with_a_field_from_a_newer_fastckpt_says_upgrade_not_only_damaged(
    tmp_path: Path,
) -> None:
    """Round 21, cross-version finding 2: a field this fastckpt does not know was refused as
    "unexpected field(s)" alone (a rolled-back install called a newer version's manager
    checkpoints corrupt, with nothing saying why). The manifest and a manager's commit record
    (and a model spec, a sharded record) now say a newer fastckpt may have written it, and
    the fix."""
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": (_bn_model(), None)}, counters={"step": 0})
    manager_id = tmp_path / "ids" / "step_0"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(manager_id, {"m": {"w": torch.ones(2)}})
    for record, load in (
        (root / MANIFEST, lambda: fastckpt.load_checkpoint(root)),
        (manager_id / "commit.json", lambda: fastckpt.CheckpointManager().load(manager_id)),
    ):
        _with_new_field(record)
        with pytest.raises(CheckpointFormatError) as caught:
            load()
        message = str(caught.value)
        assert "unexpected field(s) ['written_by_a_later_version']" in message, message
        assert "written by a newer fastckpt (upgrade fastckpt" in message, message
