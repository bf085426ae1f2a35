"""Run the peers' own test suites against fastckpt through an import alias, test code untouched.

    python tools/peer_suites.py                      # both suites
    python tools/peer_suites.py torch_checkpointing  # or: safetensors
    python tools/peer_suites.py torch_checkpointing --sdist path/to/torch_checkpointing-0.1.1.tar.gz
    python tools/peer_suites.py --download           # fetch missing sdists into the wheelhouse
    python tools/peer_suites.py safetensors -- -k slice   # arguments after -- go to pytest

Each suite comes from its peer's source distribution (the sdist holds the tests), looked up in
the wheelhouse (``$FASTCKPT_WHEELHOUSE``, default ``~/.cache/fastckpt-wheelhouse``) unless
``--sdist`` names one; ``--download`` fetches a missing one there with ``pip download``.

The sdist is unpacked into a temporary directory (removed afterwards unless ``--keep``) and
pytest runs its test files in a child process with this file loaded as a pytest plugin. Before
collection the plugin puts alias modules into ``sys.modules`` under the peer's module names:

* ``torch_checkpointing`` and every one of its submodules: a copy of the peer's module (its own
  code, from the unpacked sdist, imported under the name ``_upstream_torch_checkpointing``)
  in which every object that fastckpt provides is replaced by fastckpt's (``CheckpointManager``,
  the configuration classes, ``ItemSpec``; ``torch_checkpointing.version`` *is*
  ``fastckpt.version``). Names fastckpt does not have stay the peer's, so a test that uses
  one (a resharder, a metadata reader) runs as far as fastckpt lets it.
* ``safetensors`` and ``safetensors.torch``: copies of the installed safetensors modules with
  ``safe_open``, ``save_file`` and ``load_file`` replaced by fastckpt's; everything else
  (bytes ``save``/``load``, ``save_model``, ``safetensors.numpy``) stays safetensors'.

Nothing is installed. The plugin records, for every test, its outcome and whether it reached
fastckpt (any function of the fastckpt package ran during the test's call phase, on any
thread); a test that did not reach fastckpt tested only the peer. The script prints one line
per test and the counts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: Environment variable through which the script hands the plugin its configuration.
CONFIG_ENV = "FASTCKPT_PEER_SUITE"

#: The name the peer's own torch_checkpointing package is imported under (its modules import
#: each other relatively, so the package works under any name).
UPSTREAM_TC = "_upstream_torch_checkpointing"


@dataclass(frozen=True)
class Suite:
    """One peer's public-API test suite.

    Attributes:
        name: the suite's name on the command line.
        distribution: the PyPI distribution whose sdist holds the tests.
        version: the pinned version.
        root: the directory inside the unpacked sdist that pytest runs in (the tests open
            data files relative to it).
        files: the test files run, relative to ``root``.
    """

    name: str
    distribution: str
    version: str
    root: str
    files: tuple[str, ...]

    @property
    def sdist_name(self) -> str:
        """The sdist's file name."""
        return f"{self.distribution.replace('-', '_')}-{self.version}.tar.gz"


SUITES = {
    "torch_checkpointing": Suite(
        "torch_checkpointing",
        "torch-checkpointing",
        "0.1.1",
        ".",
        # Its public API (``torch_checkpointing.__all__``): CheckpointManager with its
        # configuration and ItemSpec, and the version module. The other test files exercise
        # internals (builder, saver, process, reader, lock, resharder, metadata classes).
        ("tests/test_checkpoint_manager.py", "tests/test_version.py"),
    ),
    "safetensors": Suite(
        "safetensors",
        "safetensors",
        "0.8.0",
        "bindings/python",
        # Every test file that uses safetensors.torch (the others test numpy, flax, mlx,
        # paddle and tensorflow, which fastckpt does not replace).
        (
            "tests/test_pt_comparison.py",
            "tests/test_pt_model.py",
            "tests/test_pread_backend.py",
            "tests/test_simple.py",
            "tests/test_multithreaded.py",
        ),
    ),
}


# ---------------------------------------------------------------------------------------------
# The pytest plugin (runs in the child pytest process)
# ---------------------------------------------------------------------------------------------


def _copy_module(name: str, source: types.ModuleType, swaps: dict[int, Any]) -> types.ModuleType:
    """A new module ``name`` holding ``source``'s names, each object in ``swaps`` (by id)
    replaced by its fastckpt counterpart."""
    module = types.ModuleType(name, source.__doc__)
    for key, value in vars(source).items():
        if key in ("__name__", "__spec__", "__loader__", "__package__", "__path__"):
            continue
        setattr(module, key, swaps.get(id(value), value))
    if hasattr(source, "__path__"):
        module.__path__ = []  # a package: its submodules are all in sys.modules already
    module.__package__ = name if hasattr(source, "__path__") else name.rpartition(".")[0]
    return module


def _install(modules: dict[str, types.ModuleType]) -> None:
    """Put ``modules`` into ``sys.modules`` and bind each as an attribute of its parent."""
    sys.modules.update(modules)
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)


def alias_torch_checkpointing() -> dict[str, types.ModuleType]:
    """The ``torch_checkpointing`` alias modules (see the module docstring)."""
    import fastckpt.manager
    import fastckpt.manager.config
    import fastckpt.version

    upstream = importlib.import_module(UPSTREAM_TC)
    names = [UPSTREAM_TC]
    for info in pkgutil.walk_packages(upstream.__path__, UPSTREAM_TC + "."):
        importlib.import_module(info.name)
        names.append(info.name)
    names += [n for n in sys.modules if n.startswith(UPSTREAM_TC + ".") and n not in names]

    def peer(module: str, attr: str) -> Any:
        return getattr(sys.modules[f"{UPSTREAM_TC}.{module}"], attr)

    counterparts: list[tuple[Any, Any]] = [
        (peer("checkpoint_manager", "CheckpointManager"), fastckpt.manager.CheckpointManager),
        (peer("schema", "ItemSpec"), fastckpt.manager.config.ItemSpec),
        (peer("staging", "CheckpointStagerConfig"), fastckpt.manager.config.CheckpointStagerConfig),
        (
            peer("checkpoint_writer", "CheckpointWriterConfig"),
            fastckpt.manager.config.CheckpointWriterConfig,
        ),
        (
            peer("storage.filesystem", "LocalFileSystemStorageConfig"),
            fastckpt.manager.config.LocalFileSystemStorageConfig,
        ),
        (peer("version", "Version"), fastckpt.version.Version),
        (peer("version", "get_version"), fastckpt.version.get_version),
        (sys.modules[f"{UPSTREAM_TC}.version"], fastckpt.version),
    ]
    for config in (
        "AsyncCheckpointSaverConfig",
        "CheckpointLoaderConfig",
        "CheckpointSaverConfig",
        "SyncCheckpointSaverConfig",
    ):
        counterparts.append((peer("config", config), getattr(fastckpt.manager.config, config)))
    swaps = {id(theirs): ours for theirs, ours in counterparts}
    modules: dict[str, types.ModuleType] = {}
    for name in names:
        alias = "torch_checkpointing" + name[len(UPSTREAM_TC) :]
        source = sys.modules[name]
        if id(source) in swaps:  # the version module: fastckpt's own, reloadable as it is
            modules[alias] = swaps[id(source)]
        else:
            modules[alias] = _copy_module(alias, source, swaps)
    vars(modules["torch_checkpointing"])["__version__"] = fastckpt.version.__version__
    return modules


def alias_safetensors() -> dict[str, types.ModuleType]:
    """The ``safetensors`` alias modules (see the module docstring)."""
    import safetensors
    import safetensors.numpy  # stays safetensors' own
    import safetensors.torch

    import fastckpt.container.lazy
    import fastckpt.io.files

    ours = {
        "safe_open": fastckpt.container.lazy.safe_open,
        "save_file": fastckpt.io.files.save_file,
        "load_file": fastckpt.io.files.load_file,
    }
    top = _copy_module("safetensors", safetensors, {id(safetensors.safe_open): ours["safe_open"]})
    top.__path__ = list(safetensors.__path__)  # safetensors.numpy etc. import as they are
    pt = _copy_module(
        "safetensors.torch",
        safetensors.torch,
        {id(getattr(safetensors.torch, name)): value for name, value in ours.items()},
    )
    for name, value in ours.items():
        setattr(pt, name, value)
    return {"safetensors": top, "safetensors.torch": pt}


class _Reach:
    """Whether any function of the fastckpt package ran while armed, on any thread."""

    def __init__(self) -> None:
        import fastckpt

        self.prefix = os.path.dirname(os.path.abspath(fastckpt.__file__)) + os.sep
        self.reached = False

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        """A ``sys.setprofile`` function: notes a call into fastckpt, then stops profiling."""
        if event == "call" and frame.f_code.co_filename.startswith(self.prefix):
            self.reached = True
        if self.reached:
            sys.setprofile(None)

    def arm(self) -> None:
        """Start watching (this thread and threads started from now on)."""
        self.reached = False
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)

    def disarm(self) -> None:
        """Stop watching."""
        sys.setprofile(None)
        threading.setprofile(None)


_PLUGIN: dict[str, Any] = {}


def pytest_configure(config: Any) -> None:
    """Install the suite's aliases before any test module is imported."""
    settings = os.environ.get(CONFIG_ENV)
    if not settings:
        return
    _PLUGIN.update(json.loads(settings), results={}, reach=_Reach())
    suite = _PLUGIN["suite"]
    modules = alias_torch_checkpointing() if suite == "torch_checkpointing" else alias_safetensors()
    _install(modules)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Iterator[None]:
    """Watch for calls into fastckpt while the test body runs."""
    reach: _Reach | None = _PLUGIN.get("reach")
    if reach is None:
        yield
        return
    reach.arm()
    try:
        yield
    finally:
        reach.disarm()
        if reach.reached:
            _PLUGIN.setdefault("reached", set()).add(item.nodeid)


def pytest_runtest_logreport(report: Any) -> None:
    """Record each test's outcome (the first failing phase wins) and its first error line."""
    if "results" not in _PLUGIN:
        return
    results: dict[str, Any] = _PLUGIN["results"]
    entry = results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.failed:
        outcome = "failed" if report.when == "call" else "error"
        if entry["outcome"] == "passed":
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
            message = message.strip().splitlines()[0][:300]
            if crash is not None:  # where: the test file's line, or the deepest frame's
                message += f" [{_failing_line(report.longrepr, crash)}]"
            entry.update(outcome=outcome, message=message)
    elif report.skipped and entry["outcome"] == "passed":
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        entry.update(outcome="skipped", message=str(reason)[:300])


def _failing_line(longrepr: Any, crash: Any) -> str:
    """``file:line`` of the last traceback entry inside the test file (else the crash's)."""
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", [])
    for entry in reversed(entries):
        location = getattr(entry, "reprfileloc", None)
        if location is not None and Path(location.path).name.startswith("test_"):
            return f"{Path(location.path).name}:{location.lineno}"
    return f"{Path(crash.path).name}:{crash.lineno}"


def pytest_unconfigure(config: Any) -> None:
    """Write the per-test record for the parent process."""
    if "results" not in _PLUGIN:
        return
    reached = _PLUGIN.get("reached", set())
    for nodeid, entry in _PLUGIN["results"].items():
        entry["reached_fastckpt"] = nodeid in reached
    Path(_PLUGIN["report"]).write_text(json.dumps(_PLUGIN["results"], indent=1))


# ---------------------------------------------------------------------------------------------
# The command line (the parent process)
# ---------------------------------------------------------------------------------------------


def wheelhouse() -> Path:
    """``$FASTCKPT_WHEELHOUSE``, or ``~/.cache/fastckpt-wheelhouse``."""
    configured = os.environ.get("FASTCKPT_WHEELHOUSE")
    return Path(configured) if configured else Path.home() / ".cache" / "fastckpt-wheelhouse"


def find_sdist(suite: Suite, given: Path | None, download: bool) -> Path | None:
    """The suite's sdist: ``given``, else the wheelhouse's (downloaded there if asked)."""
    if given is not None:
        return given
    path = wheelhouse() / suite.sdist_name
    if not path.is_file() and download:
        path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        # safetensors' sdist builds its metadata with maturin, which this venv has.
        command += ["--no-build-isolation", "-d", str(path.parent)]
        subprocess.run([*command, f"{suite.distribution}=={suite.version}"], check=True)
    return path if path.is_file() else None


def _unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    (root,) = [p for p in into.iterdir() if p.is_dir()]
    return root


def run_suite(suite: Suite, sdist: Path, keep: bool, pytest_args: list[str]) -> dict[str, Any]:
    """Unpack ``sdist``, run the suite's files through the alias; returns the per-test record."""
    work = Path(tempfile.mkdtemp(prefix=f"fastckpt-peer-{suite.name}-"))
    try:
        source = _unpack(sdist, work / "sdist")
        path = [str(Path(__file__).resolve().parent)]
        if suite.name == "torch_checkpointing":
            shutil.copytree(source / "torch_checkpointing", work / "upstream" / UPSTREAM_TC)
            path.append(str(work / "upstream"))
        tests = source / suite.root
        report = work / "report.json"
        (work / "pytest.ini").write_text("[pytest]\n")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env[CONFIG_ENV] = json.dumps({"suite": suite.name, "report": str(report)})
        command = [sys.executable, "-m", "pytest", "-p", Path(__file__).stem, "-p"]
        command += ["no:cacheprovider", "-c", str(work / "pytest.ini"), "--rootdir", str(tests)]
        command += ["-q", *pytest_args, *suite.files]
        completed = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True)
        if not report.is_file():
            sys.stdout.write(completed.stdout[-4000:] + completed.stderr[-4000:])
            raise RuntimeError(
                f"{suite.name}: pytest wrote no report (exit {completed.returncode})"
            )
        results: dict[str, Any] = json.loads(report.read_text())
        return results
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def summarize(results: dict[str, Any]) -> dict[str, int]:
    """Counts per outcome, overall and among the tests that reached fastckpt."""
    counts: dict[str, int] = {"total": len(results), "reached": 0}
    for entry in results.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
        if entry["reached_fastckpt"]:
            counts["reached"] += 1
            key = f"reached_{entry['outcome']}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def print_results(suite: Suite, results: dict[str, Any]) -> None:
    """One line per test, then the counts."""
    print(f"== {suite.name} {suite.version}: {', '.join(suite.files)}")
    for nodeid, entry in results.items():
        reach = "fastckpt" if entry["reached_fastckpt"] else "peer-only"
        line = f"{entry['outcome'].upper():8s} {reach:9s} {nodeid}"
        if entry["message"] and entry["outcome"] != "passed":
            line += f"  -- {entry['message']}"
        print(line)
    c = summarize(results)
    print(
        f"== {suite.name}: {c['total']} tests: {c.get('passed', 0)} passed, "
        f"{c.get('failed', 0)} failed, {c.get('error', 0)} errors, {c.get('skipped', 0)} skipped; "
        f"{c['reached']} reached fastckpt: {c.get('reached_passed', 0)} passed, "
        f"{c.get('reached_failed', 0)} failed, {c.get('reached_error', 0)} errors"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the chosen suites; exit status 0 when every suite ran (failures are expected and
    listed), 2 when a suite's sdist is missing."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", help=f"of {', '.join(SUITES)} (default: all)")
    parser.add_argument("--sdist", type=Path, help="the sdist to use (one suite only)")
    parser.add_argument("--download", action="store_true", help="pip download missing sdists")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--json", type=Path, help="also write every suite's record here")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = parser.parse_args(argv)
    names = args.suites or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    if args.sdist is not None and len(names) != 1:
        parser.error("--sdist needs exactly one suite")
    record: dict[str, Any] = {}
    for name in names:
        suite = SUITES[name]
        sdist = find_sdist(suite, args.sdist, args.download)
        if sdist is None:
            print(
                f"{name}: {suite.sdist_name} is not in {wheelhouse()}; pass --sdist PATH or "
                "--download",
                file=sys.stderr,
            )
            return 2
        results = run_suite(suite, sdist, args.keep, extra)
        print_results(suite, results)
        record[name] = {"version": suite.version, "counts": summarize(results), "tests": results}
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
