"""The release wheels and the sdist: tags, metadata, and that they install and work on every
claimed CPython, from the wheel without Rust and from source with it.

``make test`` builds them once (``make wheel``: one cp311-abi3 manylinux2014 wheel for x86_64
and one for aarch64, both linked by zig, and the sdist) and passes the folder as
``FASTCKPT_DIST``; run alone, this module builds them itself into a temporary directory.

The claimed Pythons are pyproject.toml's ``Programming Language :: Python :: 3.X``
classifiers. Each must have an interpreter on this machine (``python3.X`` on ``PATH`` or
pyenv's ``~/.pyenv/versions/3.X.*``): a missing one fails, it is not skipped.

A clean venv gets the runtime dependencies of this project's venv without downloading torch
for it: distributions whose wheels fit any CPython (``py3-none``, ``abi3``: the CUDA libraries,
sympy, safetensors, ...) are linked in through a ``.pth`` file; the few built for one Python
(torch, numpy, ...) are installed, at the same versions, for the venv's own Python from the
wheelhouse (``FASTCKPT_WHEELHOUSE``, which ``pip download`` fills once per machine). The wheel
itself goes in with ``pip install --no-index --no-deps`` and runs with no Rust toolchain on
``PATH``; ``pip check`` then confirms every requirement it declares is met.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DIST = "fastckpt-io"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: The oldest glibc torch's own wheels need (manylinux_2_28); ours must not need a newer one.
MAX_GLIBC = (2, 28)
RUST_TOOLS = ("cargo", "rustc", "rustup")
#: ELF ``e_machine`` of each architecture a wheel is built for.
ELF_MACHINES = {"x86_64": 62, "aarch64": 183}
CLAIMED_PYTHONS = tuple(
    c.rsplit(" ", 1)[1]
    for c in PROJECT["classifiers"]
    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
)
REFUSED_PYTHON = "3.10"
WHEELHOUSE = Path(
    os.environ.get("FASTCKPT_WHEELHOUSE", Path.home() / ".cache" / "fastckpt-wheelhouse")
)
HOST_ARCH = os.uname().machine
#: Source builds share one cargo target folder (ignored by git), so that the dependencies
#: compiled for the first build are reused by the next ones.
SOURCE_BUILD_TARGET = ROOT / "target" / "pip-source-builds"


# ----------------------------------------------------------------------------- the artifacts


@dataclass(frozen=True)
class Artifacts:
    """What ``make wheel`` puts under dist/: a wheel per architecture, and the sdist."""

    wheels: dict[str, Path]
    sdist: Path


def _build_artifacts(out: Path) -> None:
    """What ``make wheel`` does, into ``out`` (when this module runs alone)."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    maturin = str(bindir / "maturin")
    build = [maturin, "build", "--release", "--zig", "--compatibility", "manylinux2014",
             "-i", sys.executable, "--out", str(out)]  # fmt: skip
    for command in (
        build,
        [*build, "--target", "aarch64-unknown-linux-gnu"],
        [maturin, "sdist", "--out", str(out)],
    ):
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    """The wheels and sdist ``make wheel`` built (``FASTCKPT_DIST``), or ones built here."""
    given = os.environ.get("FASTCKPT_DIST")
    folder = Path(given) if given else tmp_path_factory.mktemp("dist")
    if not given:
        _build_artifacts(folder)
    wheels: dict[str, Path] = {}
    for wheel in sorted(folder.glob("*.whl")):
        arch = next((a for a in ELF_MACHINES if wheel.stem.endswith(a)), None)
        assert arch is not None and arch not in wheels, f"unexpected wheel {wheel.name}"
        wheels[arch] = wheel
    sdists = sorted(folder.glob("*.tar.gz"))
    assert set(wheels) == set(ELF_MACHINES), f"{folder}: wheels for {sorted(wheels)}"
    assert len(sdists) == 1, f"{folder}: sdists {sdists}"
    return Artifacts(wheels, sdists[0])


@pytest.fixture(scope="module")
def wheel(artifacts: Artifacts) -> Path:
    """The wheel for this machine's architecture."""
    return artifacts.wheels[HOST_ARCH]


_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def _glibc_of_tag(tag: str) -> tuple[int, int] | None:
    """The glibc version a manylinux platform tag promises to need at most, else None."""
    legacy = re.fullmatch(r"(manylinux\d+)_\w+", tag)
    if legacy and legacy[1] in _LEGACY_MANYLINUX:
        return _LEGACY_MANYLINUX[legacy[1]]
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag)
    return (int(match[1]), int(match[2])) if match else None


@pytest.mark.parametrize("arch", sorted(ELF_MACHINES))
def test_wheel_tags_binary_and_metadata(artifacts: Artifacts, arch: str) -> None:
    """One cp311-abi3 manylinux wheel per architecture: its tags, the extension's machine
    and glibc symbols, and the metadata pip reads (Requires-Python, classifiers, bounds)."""
    wheel = artifacts.wheels[arch]
    name, version, python_tag, abi_tag, platforms = wheel.stem.split("-")
    assert name == "fastckpt_io" and python_tag == "cp311" and abi_tag == "abi3", wheel.name
    assert all(p.endswith(f"_{arch}") for p in platforms.split(".")), wheel.name
    glibcs = [_glibc_of_tag(tag) for tag in platforms.split(".")]
    assert glibcs and None not in glibcs, f"not a manylinux wheel: {wheel.name}"
    claimed = max(g for g in glibcs if g is not None)
    assert claimed <= MAX_GLIBC, f"{wheel.name} needs glibc {claimed}, torch needs {MAX_GLIBC}"

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = f"fastckpt_io-{version}.dist-info"
        tags = [
            line.split(": ", 1)[1]
            for line in archive.read(f"{info}/WHEEL").decode().splitlines()
            if line.startswith("Tag: ")
        ]
        meta = archive.read(f"{info}/METADATA").decode()
        natives = [n for n in names if re.fullmatch(r"fastckpt/_native\..*so", n)]
        binary = archive.read(natives[0]) if natives else b""
        license_text = next((archive.read(n).decode() for n in names if n.endswith("/LICENSE")), "")
    assert natives == ["fastckpt/_native.abi3.so"], natives  # the stable-ABI name, only one
    assert tags == [f"cp311-abi3-{p}" for p in platforms.split(".")]
    assert (
        binary[:4] == b"\x7fELF" and int.from_bytes(binary[18:20], "little") == (ELF_MACHINES[arch])
    ), f"{natives[0]} is not an {arch} ELF file"
    # What the extension really links against, not only what the tag says.
    needed = {tuple(map(int, v.split(b"."))) for v in re.findall(rb"GLIBC_(\d+\.\d+)", binary)}
    assert needed and max(needed) <= claimed, f"uses glibc {max(needed)} symbols, tag {claimed}"
    assert "Name: fastckpt-io\n" in meta
    assert f"Requires-Python: {PROJECT['requires-python']}\n" in meta
    for python in CLAIMED_PYTHONS:
        assert f"Classifier: Programming Language :: Python :: {python}\n" in meta
    assert "License-Expression: Apache-2.0" in meta
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "Provides-Extra: plot" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    runtime = [line.split(": ", 1)[1] for line in requires if "extra ==" not in line]
    assert sorted(map(str, map(Requirement, runtime))) == sorted(
        map(str, map(Requirement, PROJECT["dependencies"]))
    )
    assert not any("matplotlib" in line for line in runtime)


def test_sdist_holds_what_a_source_build_needs(artifacts: Artifacts) -> None:
    with tarfile.open(artifacts.sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        top = artifacts.sdist.name.removesuffix(".tar.gz")
        pkg_info = archive.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        meta = pkg_info.read().decode()
    for needed in ("pyproject.toml", "Cargo.toml", "Cargo.lock", "rust/lib.rs",
                   "rust/py_api.rs", "python/fastckpt/__init__.py",
                   "python/fastckpt/_native.pyi", "tools/fastckpt_build_backend.py",
                   "LICENSE", "README.md"):  # fmt: skip
        assert needed in names, f"{artifacts.sdist.name} lacks {needed}"
    assert not any(re.search(r"_native\..*so$", n) for n in names), "a built extension"
    assert f"Requires-Python: {PROJECT['requires-python']}\n" in meta


# ------------------------------------------------------------------- interpreters and venvs


def _version_of(python: str) -> str | None:
    """``"3.12"`` for a working CPython interpreter at ``python``, else None."""
    try:
        done = subprocess.run(
            [python, "-c", "import sys, platform; print(platform.python_implementation(), "
             "'%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = done.stdout.split()
    return words[1] if done.returncode == 0 and words[:1] == ["CPython"] else None


def find_python(version: str) -> tuple[str | None, list[str]]:
    """A CPython ``version`` interpreter (``python3.X`` on PATH, then pyenv's), and where
    this looked."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [
        shutil.which(f"python{version}") or f"python{version} (not on PATH)",
        *sorted(
            (str(p / "bin" / "python") for p in pyenv.glob(f"{version}.*")),
            key=lambda path: [int(x) for x in re.findall(r"\d+", Path(path).parts[-3])],
            reverse=True,
        ),
        f"/usr/bin/python{version}",
        f"/usr/local/bin/python{version}",
    ]
    for candidate in candidates:
        if Path(candidate).is_file() and _version_of(candidate) == version:
            return candidate, candidates
    return None, candidates


def claimed_python(version: str) -> str:
    """The interpreter for a claimed ``version``; fails (not skips) when there is none."""
    python, looked = find_python(version)
    if python is None:
        pytest.fail(
            f"CPython {version} is claimed (pyproject.toml classifiers) but no interpreter "
            f"was found; looked at: {', '.join(looked)}. Install it (e.g. `pyenv install "
            f"{version}`) or put python{version} on PATH."
        )
    return python


def _dependency_closure(requirements: list[str], python: str) -> dict[str, metadata.Distribution]:
    """The installed distributions ``requirements`` pull in (no extras), markers evaluated
    for CPython ``python`` (``"3.12"``) on this machine."""
    target = {"extra": "", "python_version": python, "python_full_version": f"{python}.0"}
    found: dict[str, metadata.Distribution] = {}
    todo = [Requirement(text) for text in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(target):
            continue
        key = canonicalize_name(req.name)
        if key in found:
            continue
        dist = metadata.distribution(req.name)
        found[key] = dist
        todo.extend(Requirement(text) for text in dist.requires or [])
    return found


def _fits_any_python(dist: metadata.Distribution) -> bool:
    """Whether ``dist``'s wheel serves every CPython 3 (``py3-none``, ``abi3`` tags)."""
    wheel = dist.read_text("WHEEL") or ""
    tags = [line.split(": ", 1)[1] for line in wheel.splitlines() if line.startswith("Tag: ")]
    if tags:
        return all(tag.split("-")[1] in ("none", "abi3") for tag in tags)
    return not any(str(f).endswith(".so") for f in dist.files or [])


def _provide_runtime_dependencies(
    venv: Path, version: str, deps: Path, own_root: Path
) -> list[str]:
    """Make fastckpt-io's runtime dependencies importable in ``venv`` (CPython ``version``):
    link what fits any Python into ``deps``, install the rest (torch, numpy: built per
    Python) from the wheelhouse at the versions this project's venv has into
    ``own_root/<version>``, once per version for the whole session, and put both folders on
    the venv's path with a ``.pth`` file. Sharing that install keeps one torch per Python on
    disk (each is over 2 GB) instead of one per venv."""
    closure = _dependency_closure(PROJECT["dependencies"], version)
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    own = sorted(
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in closure.values()
        if version != running and not _fits_any_python(dist)
    )
    deps.mkdir()
    for dist in closure.values():
        if f"{dist.metadata['Name']}=={dist.version}" in own:
            continue
        for file in dist.files or []:
            top = file.parts[0]
            source = site / top
            if top == ".." or not source.exists() or (deps / top).exists():
                continue
            (deps / top).symlink_to(source)
    folders = [deps]
    if own:
        target = own_root / version
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            WHEELHOUSE.mkdir(parents=True, exist_ok=True)
            download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "--python-version", version,
                        "--dest", str(WHEELHOUSE), *own]  # fmt: skip
            subprocess.run(download, check=True, timeout=1800)
            install = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                       "--no-compile", "--no-index", "--no-deps", "--find-links",
                       str(WHEELHOUSE), "--target", str(target), *own]  # fmt: skip
            subprocess.run(install, check=True, timeout=1800)
            (target / ".complete").touch()
        folders.append(target)
    purelib = venv / "lib" / f"python{version}" / "site-packages"
    (purelib / "runtime-deps.pth").write_text("".join(f"{folder}\n" for folder in folders))
    return sorted(closure)


def _no_rust_env(venv: Path) -> dict[str, str]:
    """The environment with the venv first on PATH and every Rust toolchain dir removed."""
    dirs = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not any((Path(d) / tool).exists() for tool in RUST_TOOLS)
        and Path(d).resolve() != Path(sys.executable).parent.resolve()
    ]  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CARGO", "RUSTUP", "PYTHON", "VIRTUAL_ENV"))
    }
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *dirs])
    return env


def _with_rust_env(venv: Path) -> dict[str, str]:
    """The environment with the venv first on PATH, the Rust toolchain kept, and the
    source builds' shared cargo target folder."""
    dirs = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and Path(d).resolve() != Path(sys.executable).parent.resolve()
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *dirs])
    env["CARGO_TARGET_DIR"] = str(SOURCE_BUILD_TARGET)
    return env


def _make_venv(base: Path, version: str, own_root: Path) -> Path:
    """A fresh venv of the claimed CPython ``version`` under ``base``, with the runtime
    dependencies provided (see :func:`_provide_runtime_dependencies`)."""
    python = claimed_python(version)
    venv = base / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    # A 3.11 venv comes with an old setuptools of its own, which would shadow the linked one
    # (torch 2.15 needs setuptools >= 77); a newer venv has none, so this is a no-op there.
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "--yes", "--quiet",
         "setuptools"],
        check=True, capture_output=True,
    )  # fmt: skip
    linked = _provide_runtime_dependencies(venv, version, base / "deps", own_root)
    assert {"torch", "numpy", "safetensors"} <= set(linked)
    return venv


@pytest.fixture(scope="session")
def per_python_deps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where each claimed Python's own torch and numpy are installed once for all venvs of
    this session (see :func:`_provide_runtime_dependencies`); removed at the end."""
    root = tmp_path_factory.mktemp("per-python-deps")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=CLAIMED_PYTHONS)
def clean_venv(
    request: pytest.FixtureRequest,
    wheel: Path,
    tmp_path_factory: pytest.TempPathFactory,
    per_python_deps: Path,
) -> Iterator[Path]:
    """A fresh venv of each claimed CPython with the wheel installed (no index, no Rust);
    removed when its tests are done, so that venvs do not pile up on the disk."""
    version = request.param
    base = tmp_path_factory.mktemp(f"clean-{version}")
    venv = _make_venv(base, version, per_python_deps)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--no-deps",
         "--quiet", str(wheel)],
        check=True, env=_no_rust_env(venv),
    )  # fmt: skip
    yield venv
    shutil.rmtree(base, ignore_errors=True)


SMOKE = """
import importlib.metadata, importlib.util, os, sys, sysconfig
assert "%d.%d" % sys.version_info[:2] == "{python}", sys.version
import torch, fastckpt
site = sysconfig.get_paths()["purelib"]
assert fastckpt.__file__.startswith(site + os.sep), (fastckpt.__file__, site)
assert fastckpt._native.__file__.startswith(site + os.sep), fastckpt._native.__file__
assert fastckpt._native.__file__.endswith("_native.abi3.so"), fastckpt._native.__file__
assert importlib.metadata.version("fastckpt-io") == "{version}"
assert issubclass(fastckpt.errors.ChecksumMismatchError, fastckpt.errors.FastCkptError)
tensors = {{"w": torch.randn(64, 32), "h": torch.randn(8).to(torch.bfloat16),
           "step": torch.tensor(7)}}
fastckpt.save_file(tensors, "one.safetensors")
back = fastckpt.load_file("one.safetensors")
assert all(torch.equal(back[k], v) for k, v in tensors.items())
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8)).sum().backward()
optimizer.step()
fastckpt.save_checkpoint("runs", models={{"main": (model, None)}},
                         optimizers={{"adamw": (optimizer, None)}},
                         associations={{"adamw": "main"}})
loaded = fastckpt.load_checkpoint("runs")["models"]["main"]
assert torch.equal(loaded["model"].weight, model.weight)
assert loaded["optimizers"]["adamw"]["optimizer"].state_dict()["state"][0]["step"] == 1
print("smoke ok", fastckpt.__file__)
"""
SMOKE_WITHOUT_MATPLOTLIB = 'assert importlib.util.find_spec("matplotlib") is None\n'


def _python_of(venv: Path) -> str:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


def _smoke(venv: Path, version: str, env: dict[str, str], work: Path) -> None:
    """Import fastckpt in ``venv``, round-trip a file and a checkpoint, run the CLI on it."""
    work.mkdir()
    python = _python_of(venv)
    code = SMOKE.format(version=version, python=python) + SMOKE_WITHOUT_MATPLOTLIB
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], cwd=work, env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert "smoke ok" in result.stdout and str(venv) in result.stdout
    for args, expected in ((["ls", "runs"], "models: main"), (["verify", "runs"], "ok: runs")):
        cli = subprocess.run(
            [str(venv / "bin" / "fastckpt"), *args], cwd=work, env=env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert cli.returncode == 0, (args, cli.stdout[-2000:], cli.stderr[-2000:])
        assert expected in cli.stdout, (args, cli.stdout[-2000:])


def test_wheel_installs_and_runs_without_rust(clean_venv: Path, wheel: Path) -> None:
    """On each claimed CPython: import, a file and a checkpoint round trip, ``fastckpt ls``
    and ``fastckpt verify``, with no Rust toolchain on PATH; pip finds every declared
    requirement met."""
    env = _no_rust_env(clean_venv)
    for tool in RUST_TOOLS:
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is still on PATH"
    _smoke(clean_venv, wheel.stem.split("-")[1], env, clean_venv.parent / "work")
    check = subprocess.run(
        [str(clean_venv / "bin" / "python"), "-m", "pip", "check"], env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_an_s3_path_without_the_s3_extra_names_the_extra(clean_venv: Path) -> None:
    """The wheel without its ``s3`` extra (no obstore, no boto3): an ``s3://`` path is refused
    with a typed error naming the path and ``pip install 'fastckpt-io[s3]'``, and the CLI
    exits 2 (a user error). Before, a bare ``ModuleNotFoundError: No module named
    'obstore'`` came from deep inside, and the CLI exited 1, which ``verify`` documents as
    "damage found"."""
    if _python_of(clean_venv) != CLAIMED_PYTHONS[0]:
        pytest.skip(f"runs on CPython {CLAIMED_PYTHONS[0]} only: no line differs by Python")
    env = _no_rust_env(clean_venv)
    python = str(clean_venv / "bin" / "python")
    code = (
        "import torch, fastckpt\n"
        "from fastckpt.errors import MissingDependencyError\n"
        "try:\n"
        "    fastckpt.save_checkpoint('s3://bucket/run', {'main': (torch.nn.Linear(2, 2), None)})\n"
        "except MissingDependencyError as err:\n"
        "    assert isinstance(err, ImportError), type(err).__mro__\n"
        "    print('refused:', err)\n"
    )
    result = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: s3://bucket/run: s3:// paths need obstore and boto3" in result.stdout
    assert "pip install 'fastckpt-io[s3]'" in result.stdout
    for args in (["verify", "s3://bucket/run"], ["ls", "s3://bucket/run"]):
        cli = subprocess.run(
            [str(clean_venv / "bin" / "fastckpt"), *args], env=env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert cli.returncode == 2, (args, cli.stdout[-2000:], cli.stderr[-2000:])
        assert "fastckpt-io[s3]" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr


def test_the_readme_install_line_finds_the_wheel_make_wheel_builds(artifacts: Artifacts) -> None:
    """The README's and getting-started's ``pip install dist/...whl`` glob matches the wheel
    ``make wheel`` builds for each architecture, and only it. Before, it ended in
    ``manylinux2014_$(uname -m).whl`` while maturin names the wheel
    ``...manylinux2014_x86_64.manylinux_2_17_x86_64.whl``: pip said "not a valid wheel
    filename"."""
    for doc in ("README.md", "docs/getting-started.md"):
        lines = [
            line for line in (ROOT / doc).read_text().splitlines()
            if line.startswith("$ pip install dist/")
        ]  # fmt: skip
        assert len(lines) == 1, (doc, lines)
        pattern = lines[0].partition("dist/")[2].partition(".whl")[0] + ".whl"
        folder = next(iter(artifacts.wheels.values())).parent
        for arch, wheel in artifacts.wheels.items():
            found = sorted(folder.glob(pattern.replace("$(uname -m)", arch)))
            assert found == [wheel], (doc, pattern, arch, [p.name for p in found])


def test_version_comes_from_the_installed_distribution(clean_venv: Path, wheel: Path) -> None:
    result = subprocess.run(
        [str(clean_venv / "bin" / "fastckpt"), "--version"],
        env=_no_rust_env(clean_venv), capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fastckpt", wheel.stem.split("-")[1]]


def test_bench_without_matplotlib_exits_zero(clean_venv: Path) -> None:
    """``fastckpt bench`` from the wheel (no 'plot' extra) skips the chart and succeeds
    (run on the oldest claimed Python only: the others share every line it runs)."""
    if _python_of(clean_venv) != CLAIMED_PYTHONS[0]:
        pytest.skip(f"bench runs on CPython {CLAIMED_PYTHONS[0]} only")
    env = _no_rust_env(clean_venv)
    out = clean_venv.parent / "bench-out"
    result = subprocess.run(
        [str(clean_venv / "bin" / "fastckpt"), "bench", "--size-gib", "0.001", "--repeats",
         "1", "--no-memory", "--no-training", "--writers", "fastckpt",
         "--readers", "fastckpt", "--out", str(out)],
        cwd=clean_venv.parent, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped state-0.001gib.png" in result.stderr
    assert "fastckpt-io[plot]" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["state-0.001gib.json", "state-0.001gib.md"]


# ------------------------------------------------------------------------------ from source


@pytest.fixture(scope="module")
def build_requirements() -> Path:
    """The wheelhouse, holding what a source build installs into its isolated environment
    (maturin, and puccinialin, maturin's toolchain downloader, with their dependencies) for
    every Python these tests build with, so that the builds below need no index."""
    versions = sorted({*CLAIMED_PYTHONS, REFUSED_PYTHON})
    # tomli: maturin needs it below 3.11, and `pip download --python-version 3.10` does not
    # see that (it evaluates python_full_version markers for the running interpreter).
    requirements = [f"maturin=={metadata.version('maturin')}", "puccinialin", "tomli"]
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    for version in versions:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:",
             "--python-version", version, "--dest", str(WHEELHOUSE), *requirements],
            check=True, timeout=600,
        )  # fmt: skip
    return WHEELHOUSE


def _pip_install_source(
    venv: Path, source: Path, env: dict[str, str], wheelhouse: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``pip install --no-deps SOURCE`` in ``venv``, build requirements from ``wheelhouse``."""
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
         "--find-links", str(wheelhouse), str(source)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("python", CLAIMED_PYTHONS)
def test_source_install_builds_and_runs(
    python: str,
    artifacts: Artifacts,
    build_requirements: Path,
    tmp_path: Path,
    per_python_deps: Path,
) -> None:
    """``pip install`` from source on each claimed CPython: the sdist (the oldest Python
    builds from the checkout instead), compiled by the installed Rust toolchain, then the
    same smoke run as the wheel's."""
    venv = _make_venv(tmp_path, python, per_python_deps)
    source = ROOT if python == CLAIMED_PYTHONS[0] else artifacts.sdist
    env = _with_rust_env(venv)
    done = _pip_install_source(venv, source, env, build_requirements, timeout=1500)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    version = artifacts.wheels[HOST_ARCH].stem.split("-")[1]
    _smoke(venv, version, _no_rust_env(venv), tmp_path / "work")


def test_python_3_10_is_refused_by_the_wheel_and_by_requires_python(
    wheel: Path, artifacts: Artifacts, build_requirements: Path, tmp_path: Path
) -> None:
    """3.10 is not supported (pyproject.toml says why): pip refuses the abi3 wheel by its
    tag, and a source install stops at Requires-Python before compiling anything."""
    python, looked = find_python(REFUSED_PYTHON)
    if python is None:
        pytest.skip(f"no CPython {REFUSED_PYTHON} here (looked at {', '.join(looked)})")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index"]
    by_tag = subprocess.run([*pip, str(wheel)], capture_output=True, text=True)
    assert by_tag.returncode != 0
    assert "is not a supported wheel on this platform" in by_tag.stderr, by_tag.stderr
    started = time.monotonic()
    by_metadata = _pip_install_source(
        venv, artifacts.sdist, _with_rust_env(venv), build_requirements, timeout=600
    )
    assert by_metadata.returncode != 0
    assert (
        f"requires a different Python: {_python_of_full(python)} not in "
        f"'{PROJECT['requires-python']}'" in by_metadata.stderr
    ), by_metadata.stderr[-3000:]
    assert "Compiling" not in by_metadata.stdout + by_metadata.stderr
    assert time.monotonic() - started < 300


def _python_of_full(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


@pytest.mark.parametrize("case", ["download-forbidden", "download-fails"])
def test_source_build_without_rust_stops_at_once_naming_the_fix(
    case: str, artifacts: Artifacts, build_requirements: Path, tmp_path: Path
) -> None:
    """No cargo on PATH and no toolchain to be had (fetching forbidden by
    MATURIN_NO_INSTALL_RUST, or the download refused: rustup's server is pointed at a closed
    port on loopback): the build fails within seconds, saying what to install or to use the
    wheel, instead of hanging or ending in the downloader's traceback."""
    version = CLAIMED_PYTHONS[-1]
    venv = tmp_path / "venv"
    subprocess.run([claimed_python(version), "-m", "venv", str(venv)], check=True)
    env = _no_rust_env(venv)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # no toolchain a previous fetch left
    if case == "download-forbidden":
        env["MATURIN_NO_INSTALL_RUST"] = "1"
    else:
        env["RUSTUP_UPDATE_ROOT"] = "http://127.0.0.1:9/rustup"
    started = time.monotonic()
    done = _pip_install_source(venv, artifacts.sdist, env, build_requirements, timeout=600)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "no Rust toolchain (cargo) is on PATH" in output, output[-3000:]
    assert "https://rustup.rs" in output and "make wheel" in output
    if case == "download-fails":
        assert "Fetching a Rust toolchain failed" in output, output[-3000:]
    assert "Compiling" not in output and elapsed < 120, elapsed
