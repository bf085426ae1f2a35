"""The package face: every public name resolves, and ``import fastckpt`` imports no torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import fastckpt


def test_every_public_name_resolves_to_the_object_of_its_module() -> None:
    import fastckpt.verify  # binding the submodule must not replace the function verify

    public = set(fastckpt.__all__) - {"__version__"}
    assert public == set(fastckpt._MODULE_OF)  # one list of names, nothing missing
    for name in sorted(public):
        value = getattr(fastckpt, name)
        module = sys.modules[fastckpt._MODULE_OF[name]]
        assert value is getattr(module, name), name
    assert set(dir(fastckpt)) >= public | {"dcp", "integrations"}
    assert callable(fastckpt.verify) and fastckpt.verify.__name__ == "verify"


def test_import_fastckpt_is_light_until_a_name_is_used() -> None:
    code = (
        "import sys, fastckpt; assert 'torch' not in sys.modules, 'torch at import'; "
        "fastckpt.save_file; assert 'torch' in sys.modules; "
        "assert 'torch.distributed.checkpoint' not in sys.modules; "
        "fastckpt.dcp.Writer; assert 'torch.distributed.checkpoint' in sys.modules; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_unknown_names_raise_attribute_error() -> None:
    try:
        fastckpt.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("fastckpt.no_such_name resolved")


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "fastckpt"
#: ``fastckpt.<dotted name>`` as the README and docs write it, not as part of a longer name
#: (``.fastckpt.lock`` is a file name) or of a path.
DOC_NAME = re.compile(r"(?<![\w./-])fastckpt(?:\.[A-Za-z_]\w*)+")


def _documented_names() -> dict[str, str]:
    """Every ``fastckpt.x.y`` the README and docs/*.md write -> the first file naming it."""
    found: dict[str, str] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in DOC_NAME.finditer(path.read_text()):
            found.setdefault(match[0], path.name)
    return found


def _is_a_metadata_key(name: str) -> bool:
    """``fastckpt.crc32c`` and the like: a string the package writes into files, not a name."""
    literal = f'"{name}"'
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "rust").glob("*.rs")]
    return any(literal in path.read_text() for path in sources)


WALK = """
import importlib, json, sys
import fastckpt
bound_at_import = sorted(n for n in {submodules!r} if n in vars(fastckpt))
# The issue's example, from a bare import: the error one means to catch is reachable.
assert issubclass(fastckpt.errors.ChecksumMismatchError, fastckpt.errors.FastCkptError)
failures = {{}}
for dotted in {names!r}:
    parts = dotted.split(".")[1:]
    try:
        value = getattr(fastckpt, parts[0])  # the first step must be an attribute
        for depth in range(1, len(parts)):
            # Deeper steps: an attribute, or a submodule that a `from ... import` would load.
            prefix = ".".join(["fastckpt", *parts[:depth]])
            # (``fastckpt.verify.verify``: the module, which the function of its name hides)
            candidates = [value, sys.modules.get(prefix)]
            found = [getattr(c, parts[depth]) for c in candidates if hasattr(c, parts[depth])]
            if found:
                value = found[0]
            else:
                value = importlib.import_module(prefix + "." + parts[depth])
    except Exception as error:
        failures[dotted] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps({{"bound_at_import": bound_at_import, "failures": failures}}))
"""


def test_every_name_the_docs_write_resolves_from_a_bare_import() -> None:
    """``import fastckpt`` and then ``fastckpt.errors.FastCkptError``,
    ``fastckpt.checkpoint.trust.register_trusted``, ``fastckpt.storage.registry``,
    ``fastckpt.dcp.save_state``
    ... : every dotted name in the README and docs/ resolves through attribute access (the
    first step always; deeper ones as attribute or submodule), except the metadata keys the
    package writes into files, which are strings, not names."""
    documented = _documented_names()
    names = sorted(n for n in documented if not _is_a_metadata_key(n))
    first_steps = {n.split(".")[1] for n in names}
    assert {"errors", "checkpoint", "storage", "dcp", "io", "integrations"} <= first_steps
    code = WALK.format(submodules=fastckpt._SUBMODULES, names=names)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bound_at_import"] == [], "import fastckpt imported submodules eagerly"
    failures = {f"{name} ({documented[name]})": why for name, why in report["failures"].items()}
    assert failures == {}


def test_submodules_are_the_package_directory_and_dir_lists_them() -> None:
    on_disk = sorted(
        path.stem if path.suffix == ".py" else path.name
        for path in PACKAGE.iterdir()
        if not path.name.startswith("_")
        and (path.suffix == ".py" or (path / "__init__.py").is_file())
    )
    assert list(fastckpt._SUBMODULES) == on_disk
    listed = set(dir(fastckpt))
    assert set(on_disk) <= listed and set(fastckpt.__all__) <= listed
    assert "_native" in fastckpt._LAZY_SUBMODULES  # the extension too, though not listed


def test_a_public_name_wins_over_the_submodule_of_the_same_name() -> None:
    code = (
        "import fastckpt, types; "
        "assert callable(fastckpt.verify), fastckpt.verify; "
        "import fastckpt.verify, sys; module = sys.modules['fastckpt.verify']; "
        "assert isinstance(module, types.ModuleType); "
        "assert fastckpt.verify is module.verify; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


HELP_THROUGH_THE_FACE = """
import runpy, sys
sys.argv = ["fastckpt", "--help"]
try:
    runpy.run_module("fastckpt", run_name="__main__")
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
heavy = sorted(m for m in ("torch", "numpy", "fastckpt._native") if m in sys.modules)
print("IMPORTED", heavy)
"""


def test_help_through_the_real_package_face_imports_no_torch() -> None:
    """``python -m fastckpt --help`` (the real ``__init__``, submodules lazy) stays light."""
    result = subprocess.run(
        [sys.executable, "-c", HELP_THROUGH_THE_FACE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: fastckpt" in result.stdout
    assert "IMPORTED []" in result.stdout, result.stdout[-2000:]


def test_every_earlier_module_path_is_the_moved_module() -> None:
    """The layered layout moved modules (docs/architecture.md); every earlier path still
    imports, and gives the module itself (so a monkeypatch through either path is seen by
    both), in a fresh process so that nothing was imported before."""
    from fastckpt._moved import MOVED

    code = f"""
import importlib, json
failures = []
for old, new in {sorted(MOVED.items())!r}:
    try:
        if importlib.import_module(old) is not importlib.import_module(new):
            failures.append((old, "a different module"))
    except Exception as err:  # report every path, not only the first
        failures.append((old, repr(err)))
from fastckpt.files import save_file
from fastckpt.store.commit import DirectoryWriter
from fastckpt.hooks.checkpoint import CheckpointHook
from fastckpt.dcp.errors import NotCommittedError
import fastckpt, fastckpt.specs
# specs.py was split (specs, trust, values, build): the old path finds every name, and
# setting one through it sets it where it lives.
build = importlib.import_module("fastckpt.checkpoint.build")
trust = importlib.import_module("fastckpt.checkpoint.trust")
assert fastckpt.specs.register_trusted is trust.register_trusted
assert fastckpt.specs.build_model is build.build_model
assert fastckpt.specs.BaseSpec is importlib.import_module("fastckpt.checkpoint.specs").BaseSpec
from fastckpt.specs import check_recordable, register_type_serializer
fastckpt.specs._TRUSTED_PATHS = {{"probe"}}
assert trust._TRUSTED_PATHS == {{"probe"}}
assert callable(fastckpt.verify)  # the function, though also an old module path
print(json.dumps(failures))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == []
