"""Hostile checkpoints of the fourteenth adversarial round: a library's factory that lives
outside site-packages, plain values of a sharded checkpoint that are not JSON as fastckpt
writes it, and ``fastckpt promote`` of sources whose files are symlinked out of them.

Real files, real subprocesses (a fresh interpreter with a library directory on ``sys.path``,
the ``fastckpt`` CLI), real DCP saves.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import fastckpt.dcp as dcp
from fastckpt import _native
from fastckpt.checkpoint import trust
from fastckpt.container.promote import promote_index
from fastckpt.container.sharded.nodes import node_holdings
from fastckpt.errors import CheckpointFormatError, UnsupportedValueError
from fastckpt.format.records import SHARDED_DIR, SHARDED_RECORD, seal_manifest


def _cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


# --------------------------------------------------------------------------------------------
# 1. A library installed outside site-packages is a library, not the user's code
# --------------------------------------------------------------------------------------------

_LIBRARY = """
import pickle, torch

class Model(torch.nn.Module):
    def __init__(self, width=4, device=None):
        super().__init__()
        self.width = width
        self.lin = torch.nn.Linear(width, width, device=device)

    @classmethod
    def from_pretrained(cls, path, device=None):
        # as LightningModule.load_from_checkpoint / from_pretrained do: read the file given
        with open(path, "rb") as f:
            return pickle.load(f)

def train_step(model, batch):
    return batch
"""


def _library(directory: Path) -> Path:
    """A package ``hublib`` with a dist-info (importlib.metadata knows it as a distribution)
    in ``directory``, outside site-packages: what ``pip install -e``, ``--target`` or an
    HPC module on PYTHONPATH give."""
    (directory / "hublib").mkdir(parents=True)
    (directory / "hublib" / "__init__.py").write_text(_LIBRARY)
    info = directory / "hublib-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hublib\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("hublib\n")
    return directory


class _WritesMarker:
    """Unpickling it creates the file ``marker``: proof that the checkpoint's code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def test_a_factory_of_a_library_outside_site_packages_needs_trust(tmp_path: Path) -> None:
    """A library outside site-packages but installed as a distribution (a dist-info names its
    package) is a library: its ``nn.Module`` classmethod factory needs ``trusted=``. Before,
    only the file's place decided, so ``hublib.Model.from_pretrained`` counted as the user's
    code: the meta-device probe called it with the path the re-sealed spec named, which
    unpickled it (the marker was written), and only then did the load fail."""
    library = _library(tmp_path / "libsrc")
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(_WritesMarker(str(marker))))
    root = tmp_path / "root"
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(library)!r})
        import fastckpt, hublib
        from fastckpt import _native
        from fastckpt.errors import UntrustedTargetError
        from fastckpt.format.records import seal_manifest
        root = {str(root)!r}
        fastckpt.save_checkpoint(root, models={{"main": (hublib.Model(4), None)}})
        spec_path = root + "/0/models/main.spec.json"
        spec = json.load(open(spec_path))
        spec["cls_path"] = "hublib.Model.from_pretrained"
        spec["kwargs"] = {{"path": {str(evil)!r}}}
        data = json.dumps(spec).encode()
        open(spec_path, "wb").write(data)
        manifest = json.load(open(root + "/manifest.json"))
        files = manifest["checkpoints"]["0"]["files"]
        files["models/main.spec.json"] = {{"size": len(data), "crc32c": _native.crc32c(data)}}
        seal_manifest(manifest)
        json.dump(manifest, open(root + "/manifest.json", "w"))
        try:
            fastckpt.load_checkpoint(root)
        except UntrustedTargetError as err:
            print("REFUSED", err)
        # the training function of a library the checkpoint's models do not come from
        from fastckpt.checkpoint.trust import resolve_training_fn
        try:
            resolve_training_fn("hublib.train_step")
        except UntrustedTargetError as err:
            print("FN REFUSED", err)
        # ... and of the package a saved model comes from: the user's library
        fn = resolve_training_fn("hublib.train_step", models=[hublib.Model])
        print("FN OF THE MODEL'S PACKAGE", fn is hublib.train_step)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not marker.exists(), "the checkpoint's pickle ran"
    lines = out.stdout.splitlines()
    refused = next(line for line in lines if line.startswith("REFUSED"))
    assert "installed library" in refused
    assert "trusted=['hublib.Model.from_pretrained']" in refused
    assert "register_trusted('hublib.Model.from_pretrained')" in refused
    refused_fn = next(line for line in lines if line.startswith("FN REFUSED"))
    assert "trusted=['hublib.train_step']" in refused_fn
    assert "FN OF THE MODEL'S PACKAGE True" in lines


def test_an_editable_library_is_a_library_and_a_users_package_of_the_same_name_is_not(
    tmp_path: Path,
) -> None:
    """A distribution is judged by its own files: an editable install (its dist-info in one
    place, ``direct_url.json`` naming the source directory elsewhere) is a library; a user's
    own ``tests`` package stays the user's code although some installed distribution lists a
    top-level ``tests`` too (a first version went by the top-level name alone and refused
    the user's own training function)."""
    site_dir, source, project = tmp_path / "site", tmp_path / "src", tmp_path / "project"
    _library(source)
    shutil.rmtree(source / "hublib-1.0.dist-info")
    info = site_dir / "hublib-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hublib\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("hublib\n")
    url = {"url": source.as_uri(), "dir_info": {"editable": True}}
    (info / "direct_url.json").write_text(json.dumps(url))
    stray = site_dir / "careless-1.0.dist-info"  # ships a top-level "tests" package
    stray.mkdir()
    (stray / "METADATA").write_text("Metadata-Version: 2.1\nName: careless\nVersion: 1.0\n")
    (stray / "top_level.txt").write_text("tests\n")
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "__init__.py").write_text("")
    (project / "tests" / "helpers.py").write_text("def train(model, batch):\n    return batch\n")
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(site_dir)!r}, {str(source)!r}, {str(project)!r}]
        from fastckpt.checkpoint import trust
        from fastckpt.errors import UntrustedTargetError
        import hublib, tests.helpers
        print("USER", trust.resolve_training_fn("tests.helpers.train") is tests.helpers.train)
        try:
            trust.resolve_target("hublib.Model.from_pretrained", "model")
        except UntrustedTargetError as err:
            print("REFUSED", "installed library" in str(err))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["USER", "True", "REFUSED", "True"], out.stdout


class _UserNet(torch.nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(n, n)

    @classmethod
    def build(cls, n: int = 2) -> _UserNet:
        return cls(n)


def user_step(model: Any, batch: Any) -> Any:
    """A training function of this (test helper) module: the user's code."""
    return batch


def test_the_users_own_modules_stay_the_users_code() -> None:
    """This test module (not a distribution's package) keeps its factories and training
    functions admitted by default; so does a script's ``__main__`` (pinned in
    ``test_specs.test_a_librarys_module_factory_needs_trust``)."""
    path = f"{__name__}._UserNet.build"
    assert trust.resolve_target(path, "model") == _UserNet.build
    assert trust.resolve_training_fn(f"{__name__}.user_step") is user_step


# --------------------------------------------------------------------------------------------
# 2. Plain values of a sharded checkpoint are read as strictly as every checkpoint document
# --------------------------------------------------------------------------------------------


def _sharded_with_value(path: Path, payload: bytes) -> Path:
    """A fastckpt.dcp checkpoint whose stored value ``extra.lr`` is ``payload``, re-sealed
    (file entry, chunk entry and record all agree with the new bytes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming a single process"
        dcp.save_state(path, {"model": {"w": torch.ones(2, 2)}, "extra": {"lr": 0.1}})
    record_path = path / "fastckpt-dcp.json"
    record = json.loads(record_path.read_text())
    values = path / record["generation"] / "rank-00000.values"
    values.write_bytes(payload)
    crc = _native.crc32c(payload)
    for entry in record["dcp"]["storage_data"]:
        if entry["fqn"] == "extra.lr":
            entry.update(byte_offset=0, length=len(payload), crc32c=crc)
    record["files"]["rank-00000.values"] = {"size": len(payload), "crc32c": crc}
    seal_manifest(record)
    record_path.write_text(json.dumps(record))
    return values


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"NaN", "NaN"),
        (b"-Infinity", "-Infinity"),
        (b"1e999", "1e999"),
        (b'{"lr": 1, "lr": 2}', "duplicate key 'lr'"),
        (b"[" * 100_000 + b"]" * 100_000, "not valid JSON|nested more than"),
        (b"[" * 300 + b"]" * 300, "nested more than 200 levels"),
    ],
    ids=["nan", "minus-infinity", "overflow", "duplicate-key", "deep-100000", "deep-300"],
)
def test_a_sharded_value_that_is_not_our_json_is_a_format_error(
    tmp_path: Path, payload: bytes, reason: str
) -> None:
    """A stored value that fastckpt never writes (NaN/Infinity, a number no float holds,
    duplicate keys, nesting past the limit) is a CheckpointFormatError naming the values file
    and the key, for ``load_state`` and ``fastckpt export``. Before, it was decoded by a plain
    ``json.loads``: NaN, inf and the last duplicate came back as values; 100000 levels raised
    a bare RecursionError (export: exit 1 with a traceback)."""
    values = _sharded_with_value(tmp_path / "ckpt", payload)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(CheckpointFormatError, match=reason) as info:
            dcp.load_state(tmp_path / "ckpt")
    assert str(values) in str(info.value) and "'extra.lr'" in str(info.value)
    out = _cli("export", tmp_path / "ckpt", "--to", tmp_path / "out.safetensors", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert "CheckpointFormatError" in out.stderr or "error:" in out.stderr
    assert str(values) in out.stderr and "'extra.lr'" in out.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_sharded_values_fastckpt_writes_still_load(tmp_path: Path) -> None:
    """The strict reader takes every value fastckpt writes: non-finite floats (as markers),
    tuples, and a nest as deep as a save allows."""
    deep: Any = 1
    for _ in range(190):
        deep = [deep]
    state = {
        "model": {"w": torch.ones(2, 2)},
        "extra": {"nan": float("nan"), "inf": float("-inf"), "pair": (1, 2)},
        "deep": deep,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save_state(tmp_path / "ckpt", state)
        loaded = dcp.load_state(tmp_path / "ckpt")
    assert torch.equal(loaded["model"]["w"], torch.ones(2, 2))
    extra = loaded["extra"]
    assert extra["pair"] == (1, 2) and extra["inf"] == float("-inf")
    assert extra["nan"] != extra["nan"]
    assert loaded["deep"] == deep
    out = _cli("export", tmp_path / "ckpt", "--to", tmp_path / "out.safetensors", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_sharded_value_nested_past_what_loads_read_is_refused_at_save(tmp_path: Path) -> None:
    """A value nested deeper than a load reads is refused when saved, naming it, instead of
    being written as a checkpoint that could never load."""
    deep: Any = 1
    for _ in range(250):
        deep = [deep]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(
            UnsupportedValueError, match=r"deep: its lists, tuples and dicts nest too deeply"
        ):
            dcp.save_state(tmp_path / "ckpt", {"model": {"w": torch.ones(2)}, "deep": deep})


# --------------------------------------------------------------------------------------------
# 3. promote reads a source's files only inside it, as the loaders do
# --------------------------------------------------------------------------------------------


def _linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


def _move_out(path: Path, outside: Path) -> None:
    """Replace ``path`` by a symlink to a copy of it outside the checkpoint."""
    shutil.move(path, outside)
    os.symlink(outside, path)


@pytest.mark.parametrize("outside", ["outside", "root_other"])
@pytest.mark.parametrize("linked", ["file", "index-directory"])
def test_promote_refuses_a_root_whose_files_resolve_outside_it(
    tmp_path: Path, linked: str, outside: str
) -> None:
    """A root index file (or the whole index directory) replaced by a symlink out of the
    root: verify and every loader refuse it, and so does ``fastckpt promote`` now, with the
    loaders' CheckpointFormatError, committing nothing. Before, promote read the outside
    bytes, committed them in the durable tier and exited 0. ``root_other`` (added in round
    20) is a sibling whose name starts with the root's: a containment check by string
    prefix without the trailing separator took it for inside and still passed this test."""
    (tmp_path / outside).mkdir()
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"m": (_linear(), None)})
    if linked == "file":
        _move_out(root / "0" / "models" / "m.safetensors", tmp_path / outside / "m")
    else:
        _move_out(root / "0", tmp_path / outside / "idx0")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint directory"):
        fastckpt.load_checkpoint(root)
    out = _cli("promote", root, tmp_path / "durable", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "outside the checkpoint directory" in out.stderr
    assert not (tmp_path / "durable" / "0").exists()
    assert not (tmp_path / "durable" / "manifest.json").exists()
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint directory"):
        promote_index(root, tmp_path / "durable2", 0)
    assert not (tmp_path / "durable2" / "manifest.json").exists()


def test_promote_refuses_a_manager_checkpoint_whose_file_resolves_outside_it(
    tmp_path: Path,
) -> None:
    """A CheckpointManager item file replaced by a symlink out of its checkpoint: refused by
    the load and by ``fastckpt promote`` alike, the durable copy left unchanged. Before,
    promote committed the outside bytes as the durable checkpoint (exit 0)."""
    (tmp_path / "outside").mkdir()
    model = _linear()
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as manager:
        manager.save(tmp_path / "mgr" / "step_10", {"model": model.state_dict(), "step": 10})
    item = tmp_path / "mgr" / "step_10" / "model.safetensors"
    _move_out(item, tmp_path / "outside" / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match="outside the checkpoint directory"):
        fastckpt.CheckpointManager().load(tmp_path / "mgr" / "step_10")
    out = _cli("promote", tmp_path / "mgr", tmp_path / "mgr_durable", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "outside the checkpoint directory" in out.stderr
    assert not (tmp_path / "mgr_durable" / "step_10").exists()


def test_promote_refuses_a_sharded_checkpoint_whose_shard_resolves_outside_it(
    tmp_path: Path,
) -> None:
    """A sharded checkpoint's shard file replaced by a symlink out of it: ``fastckpt
    promote`` refuses it as the loaders do, and creates nothing in the durable tier. Before,
    the sharded record's files were joined without the check, and the outside bytes were
    promoted."""
    (tmp_path / "outside").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save_state(tmp_path / "mgr" / "step_1", {"w": torch.ones(8), "step": 1})
    (generation,) = (p for p in (tmp_path / "mgr" / "step_1").iterdir() if p.name.startswith("g-"))
    for shard in list(generation.glob("*.safetensors")):
        _move_out(shard, tmp_path / "outside" / shard.name)
    out = _cli("promote", tmp_path / "mgr", tmp_path / "durable", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "outside the checkpoint directory" in out.stderr
    assert not (tmp_path / "durable" / "step_1").exists()


def test_node_holdings_ignore_a_part_record_naming_a_generation_outside_it(
    tmp_path: Path,
) -> None:
    """A part's record whose ``generation`` is ``..`` (or a path) is no readable record: the
    node holds nothing of it. Before, the name was joined unchecked and the directory above
    the part was listed as its files."""
    for generation in ("..", "../..", "/etc"):
        part = tmp_path / SHARDED_DIR / "0" / "p0"
        part.mkdir(parents=True, exist_ok=True)
        (part / SHARDED_RECORD).write_text(json.dumps({"generation": generation}))
        assert node_holdings([tmp_path], [(0, 0, "p0")]) == {}
