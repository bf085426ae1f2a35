"""The kinds of container (issue 23, item 1): one class per kind, chosen in one place.

:func:`fastckpt.container.kinds.open_container` is the only place that tells the kinds apart;
``verify``, ``safe_open`` and the ``verify``, ``inspect``, ``diff``, ``export`` and ``prune``
commands ask the container (a :class:`~fastckpt.container.kinds.KindVisitor`) instead of
comparing ``location.kind`` themselves. These tests pin which class each kind gets, that each
command's answer for each kind (and for a damaged file of each kind) is what it was, and that
no module compares kind names again.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
import fastckpt.dcp
from fastckpt.cli import main as fastckpt_main
from fastckpt.container.kinds import (
    Container,
    IndexContainer,
    KindVisitor,
    ManagerContainer,
    RootContainer,
    SavedContainer,
    ShardedContainer,
    TensorFile,
    container_at,
    open_container,
)
from fastckpt.container.locate import KIND_NAMES, locate
from fastckpt.errors import ChecksumMismatchError

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fastckpt"

#: The modules allowed to name kinds: the one that tells them (locate) and the classes.
KIND_MODULES = {"container/locate.py", "container/kinds.py"}
#: The names :data:`fastckpt.container.locate.Kind` allows.
KINDS = frozenset(KIND_NAMES)


@dataclass
class Kinds:
    """One checkpoint of every kind, in one directory."""

    base: Path
    root: Path
    index: Path
    manager: Path
    sharded: Path
    file: Path

    def all(self) -> dict[str, Path]:
        return {
            "root": self.root,
            "index": self.index,
            "manager": self.manager,
            "sharded": self.sharded,
            "file": self.file,
        }


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> Kinds:
    base = tmp_path_factory.mktemp("kinds")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    fastckpt.save_checkpoint(base / "root", models={"main": model})
    with torch.no_grad():
        model.weight.add_(1)
    fastckpt.save_checkpoint(base / "root", models={"main": model})
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(base / "step_1", {"model": {"w": torch.arange(4.0)}, "step": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "single process"
        dcp.save(
            {"model": {"w": torch.randn(7, 5)}, "step": torch.tensor(3)},
            storage_writer=fastckpt.dcp.Writer(base / "sharded"),
        )
    fastckpt.save_file({"a": torch.arange(6.0)}, base / "lone.safetensors")
    return Kinds(
        base,
        base / "root",
        base / "root" / "1",
        base / "step_1",
        base / "sharded",
        base / "lone.safetensors",
    )


#: The tensor file of each kind that :func:`_damaged` damages (a name found under it).
_TENSOR_FILE = {
    "root": "main.safetensors",
    "index": "main.safetensors",
    "manager": "model.safetensors",
    "sharded": "rank-00000.safetensors",
}


def _damaged(kinds: Kinds, kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the checkpoint of ``kind`` with one bit of a tensor flipped, and the file."""
    tmp_path.mkdir(parents=True)
    if kind == "file":
        target = damaged = tmp_path / kinds.file.name
        shutil.copy(kinds.file, target)
    else:
        shutil.copytree(kinds.root if kind == "index" else kinds.all()[kind], tmp_path / "copy")
        target = tmp_path / "copy" / ("1" if kind == "index" else "")
        # A root: index 1's file (index 0 keeps its own).
        (damaged,) = (p for p in target.rglob(_TENSOR_FILE[kind]) if "0" not in p.parts)
    data = bytearray(damaged.read_bytes())
    data[-2] ^= 0x40  # the last tensor's bytes
    damaged.write_bytes(bytes(data))
    return target, damaged


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = fastckpt_main(list(args))
    return status, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- one class per kind


CLASSES: dict[str, type[Container]] = {
    "root": RootContainer,
    "index": IndexContainer,
    "manager": ManagerContainer,
    "sharded": ShardedContainer,
    "file": TensorFile,
}


def test_every_kind_resolves_to_its_container_class(kinds: Kinds) -> None:
    for kind, path in kinds.all().items():
        container = open_container(path)
        assert type(container) is CLASSES[kind], kind
        assert container.kind == kind == locate(path).kind
        assert container.path == path
        assert container.name == KIND_NAMES[kind]
        assert container.takes_index == (kind in ("root", "index"))
        assert container_at(locate(path)) == container
    index = open_container(kinds.index)
    assert isinstance(index, IndexContainer) and isinstance(index, SavedContainer)
    assert (index.root, index.index, index.own_index) == (kinds.root, 1, 1)
    root = open_container(kinds.root)
    assert isinstance(root, RootContainer) and (root.root, root.own_index) == (kinds.root, None)
    # A commit record names its directory's container.
    assert open_container(kinds.root / "manifest.json") == root
    assert open_container(kinds.manager / "commit.json") == ManagerContainer(kinds.manager)
    assert open_container(kinds.sharded / "fastckpt-dcp.json") == ShardedContainer(kinds.sharded)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        open_container(kinds.base / "missing")
    (kinds.base / "empty").mkdir(exist_ok=True)
    with pytest.raises(FileNotFoundError, match="is not a fastckpt checkpoint"):
        open_container(kinds.base / "empty")


def test_every_kind_calls_its_own_visitor_method(kinds: Kinds) -> None:
    class Which(KindVisitor[str]):
        def root(self, container: RootContainer) -> str:
            return "root"

        def index(self, container: IndexContainer) -> str:
            return "index"

        def manager(self, container: ManagerContainer) -> str:
            return "manager"

        def sharded(self, container: ShardedContainer) -> str:
            return "sharded"

        def file(self, container: TensorFile) -> str:
            return "file"

    assert {k: open_container(p).accept(Which()) for k, p in kinds.all().items()} == {
        k: k for k in kinds.all()
    }


def test_a_visitor_that_misses_a_kind_cannot_be_made() -> None:
    class NoSharded(KindVisitor[None]):
        def root(self, container: RootContainer) -> None: ...
        def index(self, container: IndexContainer) -> None: ...
        def manager(self, container: ManagerContainer) -> None: ...
        def file(self, container: TensorFile) -> None: ...

    with pytest.raises(TypeError, match="sharded"):
        NoSharded()  # type: ignore[abstract]
    with pytest.raises(TypeError):
        Container(Path("x"))  # type: ignore[abstract]


# --------------------------------------------------------------------------- each command


def test_verify_reports_each_kind_and_a_damaged_file_of_each(kinds: Kinds, tmp_path: Path) -> None:
    for kind, path in kinds.all().items():
        report = fastckpt.verify(path)
        assert report.ok and report.kind == kind and report.target == path, kind
        status, out, _ = _cli("verify", str(path), "--json")
        result = json.loads(out)
        assert status == 0 and result["kind"] == kind
        # What was verified, as `fastckpt ls` counts it: the records (a lone file: its length;
        # a sharded checkpoint: none to count).
        sizes = {"file": [path.stat().st_size, 0], "sharded": [None, None]}
        if kind in sizes:
            assert [result["size"], result["linked_size"]] == sizes[kind]
        else:
            assert result["size"] > 0
    for kind in kinds.all():
        target, damaged = _damaged(kinds, kind, tmp_path / kind)
        report = fastckpt.verify(target)
        assert report.kind == kind and not report.ok, kind
        (failure,) = report.failures
        assert failure.path.name == damaged.name and failure.status == "corrupt"
        assert "checksum mismatch in tensor" in failure.message
        status, out, _ = _cli("verify", str(target), "--json")
        assert status == 1 and json.loads(out)["files"] == json.loads(
            json.dumps([_asdict(f) for f in report.files])
        )


def _asdict(report: Any) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(report).items()}


def test_verify_refuses_an_index_for_what_has_none(kinds: Kinds) -> None:
    messages = {
        "index": "is index 1; index=0 does not apply to it",
        "manager": "is a CheckpointManager checkpoint; index= only applies",
        "sharded": "is a sharded checkpoint; index= only applies",
        "file": "is a single file; index= only applies",
    }
    for kind, message in messages.items():
        with pytest.raises(ValueError, match=message):
            fastckpt.verify(kinds.all()[kind], 0)
    for kind in ("manager", "sharded", "file"):
        status, _, err = _cli("verify", str(kinds.all()[kind]), "--index", "0")
        assert status == 2
        assert f"is a {KIND_NAMES[kind]}; --index only applies to a save_checkpoint root" in err


def test_safe_open_reads_each_kind_and_raises_on_a_damaged_tensor(
    kinds: Kinds, tmp_path: Path
) -> None:
    expected = {
        "root": {"models/main/weight", "models/main/bias"},
        "index": {"models/main/weight", "models/main/bias"},
        "manager": {"model/w"},
        "file": {"a"},
    }
    for kind, names in expected.items():
        with fastckpt.safe_open(kinds.all()[kind]) as handle:
            assert set(handle.keys()) == names, kind
            for key in names:
                handle.get_tensor(key)
    # A sharded checkpoint is chunks of several files: a clear ValueError, not an assertion.
    with pytest.raises(ValueError, match=r"sharded \(DCP\) checkpoint.*fastckpt export"):
        fastckpt.safe_open(kinds.sharded)
    with pytest.raises(ValueError, match="is a single file; index= and part= apply"):
        fastckpt.safe_open(kinds.file, index=0)
    with pytest.raises(ValueError, match="is a CheckpointManager checkpoint; index= applies"):
        fastckpt.safe_open(kinds.manager, index=0)
    with pytest.raises(ValueError, match="is index 1; index=0 does not apply"):
        fastckpt.safe_open(kinds.index, index=0)
    for kind in expected:
        target, _ = _damaged(kinds, kind, tmp_path / kind)
        with fastckpt.safe_open(target) as handle, pytest.raises(ChecksumMismatchError):
            for key in list(handle.keys()):
                handle.get_tensor(key)


def test_inspect_describes_each_kind(kinds: Kinds) -> None:
    described = {"root": "index", "index": "index", "manager": "manager"}
    for kind, path in kinds.all().items():
        status, out, _ = _cli("inspect", str(path), "--json")
        assert status == 0, kind
        assert json.loads(out)["kind"] == described.get(kind, kind)
    status, out, _ = _cli("inspect", str(kinds.root), "--index", "0", "--json")
    assert status == 0 and json.loads(out)["index"] == 0


def test_diff_takes_every_kind_but_a_sharded_checkpoint(kinds: Kinds) -> None:
    status, out, _ = _cli("diff", str(kinds.root), str(kinds.index), "--json")
    assert status == 0 and json.loads(out)["identical"]
    status, out, _ = _cli("diff", str(kinds.root / "0"), str(kinds.root), "--json")
    result = json.loads(out)
    assert status == 1 and [c["name"] for c in result["changed"]] == ["models/main:weight"]
    status, out, _ = _cli("diff", str(kinds.manager), str(kinds.manager), "--json")
    assert status == 0 and json.loads(out)["compared"] == 1
    status, out, _ = _cli("diff", str(kinds.file), str(kinds.file), "--json")
    assert status == 0 and json.loads(out)["compared"] == 1
    status, _, err = _cli("diff", str(kinds.sharded), str(kinds.root))
    assert status == 2 and f"{kinds.sharded} is a sharded (DCP) checkpoint" in err
    assert "diff the exported files" in err


def test_export_writes_each_kind_or_says_why_not(kinds: Kinds, tmp_path: Path) -> None:
    tensors = {
        "root": {"weight", "bias"},
        "index": {"weight", "bias"},
        "manager": {"w"},
        "sharded": {"model.w", "step"},
    }
    for kind, names in tensors.items():
        out = tmp_path / f"{kind}.safetensors"
        status, text, err = _cli("export", str(kinds.all()[kind]), "--to", str(out), "--json")
        assert status == 0, (kind, err)
        assert json.loads(text)["source"] == str(kinds.all()[kind])
        assert set(fastckpt.load_file(out)) == names, kind
    status, _, err = _cli("export", str(kinds.file), "--to", str(tmp_path / "f.safetensors"))
    assert status == 2 and f"{kinds.file} is already a single safetensors file" in err


def test_prune_names_the_kind_it_refuses(kinds: Kinds) -> None:
    for kind in ("index", "manager", "sharded", "file"):
        status, _, err = _cli("prune", str(kinds.all()[kind]), "--keep-last", "1", "--dry-run")
        assert status == 2 and f"is a {KIND_NAMES[kind]}; prune works on a" in err, kind


def test_the_root_functions_name_the_kind_they_find_instead_of_finding_nothing(
    kinds: Kinds, tmp_path: Path
) -> None:
    """``prune`` and ``list_checkpoints`` on a folder of CheckpointManager checkpoints (which
    ``fastckpt prune`` prunes) returned [] without a word, and ``load_checkpoint`` of a
    manager or sharded checkpoint said "no committed checkpoint here"."""
    calls = {
        "load_checkpoint": fastckpt.load_checkpoint,
        "list_checkpoints": fastckpt.list_checkpoints,
        "prune": lambda path: fastckpt.prune(path, keep_last=1),
    }
    for kind, what in (
        ("manager", "a CheckpointManager checkpoint: load it with CheckpointManager"),
        ("sharded", "a sharded checkpoint: load it with fastckpt.dcp.load_state"),
    ):
        for name, call in calls.items():
            reads = "this call" if name == "load_checkpoint" else name
            with pytest.raises(FileNotFoundError, match=f"which {reads} reads\\); it is {what}"):
                call(kinds.all()[kind])
    folder = tmp_path / "runs"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        for step in (1, 2):
            m.save(folder / f"step_{step}", {"w": torch.full((2,), float(step))})
    for call in calls.values():
        with pytest.raises(FileNotFoundError, match=r"folder of 2 CheckpointManager checkpoint"):
            call(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["step_1", "step_2"]
    (tmp_path / "new").mkdir()  # an empty folder is a root not saved into yet
    assert fastckpt.list_checkpoints(tmp_path / "new") == []
    assert fastckpt.prune(tmp_path / "new", keep_last=1) == []


# --------------------------------------------------------------------------- the switch stays gone


def _is_kind_name(node: ast.expr) -> bool:
    """``x.kind`` or a variable ``kind``."""
    return (isinstance(node, ast.Attribute) and node.attr == "kind") or (
        isinstance(node, ast.Name) and node.id == "kind"
    )


def _kind_literals(node: ast.expr) -> set[str]:
    """The kind names a comparison operand spells out (``"root"``, ``("root", "index")``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_kind_literals(element) for element in node.elts))
    return set()


def kind_switches(source: str) -> list[int]:
    """The lines of ``source`` that compare a kind with a kind name, or ``match`` on one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_kind_name(o) for o in operands) and any(_kind_literals(o) for o in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match) and _is_kind_name(node.subject):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_switches_on_kind_names_outside_the_kinds_module() -> None:
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in KIND_MODULES
        and (lines := kind_switches(path.read_text()))
    }
    assert found == {}, (
        "compare kinds through fastckpt.container.kinds (open_container(...).accept(visitor)), "
        f"not by name: {found}"
    )


def test_the_switch_check_sees_a_switch() -> None:
    """The check is not vacuous: the forms the commands used are all seen."""
    source = (
        'if location.kind == "root":\n    pass\n'
        'if location.kind in ("root", "index"):\n    pass\n'
        'if "manager" != loc.kind:\n    pass\n'
        'x = root if kind == "root" else None\n'
        "match location.kind:\n    case _:\n        pass\n"
        'if chunk.kind == "tensor":\n    pass\n'  # not a container kind: not a switch
    )
    assert kind_switches(source) == [1, 3, 5, 7, 8]
