"""The release wheel: its platform tag, and that it installs and works without Rust.

``make test`` builds the wheel once (``make wheel``, maturin with zig from PyPI) and passes it
as ``FASTCKPT_WHEEL``; run alone, this module builds one itself into a temporary directory.

The install check makes a fresh venv, puts only the runtime dependencies' files from this
project's venv on its path (torch is a few GB, so it is linked rather than downloaded again;
fastckpt, matplotlib and the build tools are left out), installs the wheel with
``pip install --no-index --no-deps`` and runs fastckpt with no Rust toolchain on ``PATH``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DIST = "fastckpt-io"
#: The oldest glibc torch's own wheels need (manylinux_2_28); ours must not need a newer one.
MAX_GLIBC = (2, 28)
RUST_TOOLS = ("cargo", "rustc", "rustup")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``make wheel`` built (``FASTCKPT_WHEEL``), or one built here."""
    given = os.environ.get("FASTCKPT_WHEEL")
    if given:
        path = Path(given)
        assert path.is_file() and path.suffix == ".whl", f"FASTCKPT_WHEEL={given!r}"
        return path
    out = tmp_path_factory.mktemp("wheel")
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(
        [str(bindir / "maturin"), "build", "--release", "--zig", "--compatibility",
         "manylinux2014", "-i", sys.executable, "--out", str(out)],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    (path,) = out.glob("*.whl")
    return path


_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def _glibc_of_tag(tag: str) -> tuple[int, int] | None:
    """The glibc version a manylinux platform tag promises to need at most, else None."""
    legacy = re.fullmatch(r"(manylinux\d+)_\w+", tag)
    if legacy and legacy[1] in _LEGACY_MANYLINUX:
        return _LEGACY_MANYLINUX[legacy[1]]
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag)
    return (int(match[1]), int(match[2])) if match else None


def test_wheel_platform_tag_and_metadata(wheel: Path) -> None:
    name, version, python_tag, abi_tag, platforms = wheel.stem.split("-")
    assert name == "fastckpt_io" and python_tag == "cp311" and abi_tag == "cp311", wheel.name
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
        (native,) = [n for n in names if re.fullmatch(r"fastckpt/_native\..*\.so", n)]
        binary = archive.read(native)
        license_text = next((archive.read(n).decode() for n in names if n.endswith("/LICENSE")), "")
    assert tags == [f"cp311-cp311-{p}" for p in platforms.split(".")]
    # What the extension really links against, not only what the tag says.
    needed = {tuple(map(int, v.split(b"."))) for v in re.findall(rb"GLIBC_(\d+\.\d+)", binary)}
    assert max(needed) <= claimed, f"{native} uses glibc {max(needed)} symbols, tag says {claimed}"
    assert "Name: fastckpt-io\n" in meta
    assert "Requires-Python: >=3.11, <3.12" in meta
    assert "License-Expression: Apache-2.0" in meta
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "Provides-Extra: plot" in meta
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert not any("matplotlib" in line and "extra ==" not in line for line in requires)


def _dependency_closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``requirements`` pull in (markers evaluated, no extras)."""
    found: dict[str, metadata.Distribution] = {}
    todo = [Requirement(text) for text in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = canonicalize_name(req.name)
        if key in found:
            continue
        dist = metadata.distribution(req.name)
        found[key] = dist
        todo.extend(Requirement(text) for text in dist.requires or [])
    return found


def _link_runtime_dependencies(target: Path) -> list[str]:
    """Symlink the top-level files of fastckpt-io's runtime dependencies into ``target``."""
    with open(ROOT / "pyproject.toml", "rb") as handle:
        runtime = tomllib.load(handle)["project"]["dependencies"]
    closure = _dependency_closure(runtime)
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    target.mkdir()
    for dist in closure.values():
        for file in dist.files or []:
            top = file.parts[0]
            source = site / top
            if top == ".." or not source.exists() or (target / top).exists():
                continue
            (target / top).symlink_to(source)
    return sorted(closure)


@pytest.fixture(scope="module")
def clean_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel installed (no index, no Rust on PATH)."""
    base = tmp_path_factory.mktemp("clean")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    deps = base / "deps"
    linked = _link_runtime_dependencies(deps)
    assert {"torch", "numpy", "safetensors"} <= set(linked)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "runtime-deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", str(wheel)],
        check=True,
        env=_no_rust_env(venv),
    )
    yield venv


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


SMOKE = """
import importlib.metadata, importlib.util, os, sys, sysconfig
import torch, fastckpt
site = sysconfig.get_paths()["purelib"]
assert fastckpt.__file__.startswith(site + os.sep), (fastckpt.__file__, site)
assert fastckpt._native.__file__.startswith(site + os.sep), fastckpt._native.__file__
assert importlib.metadata.version("fastckpt-io") == "{version}"
assert importlib.util.find_spec("matplotlib") is None
tensors = {{"w": torch.randn(64, 32), "step": torch.tensor(7)}}
fastckpt.save_file(tensors, "one.safetensors")
back = fastckpt.load_file("one.safetensors")
assert all(torch.equal(back[k], v) for k, v in tensors.items())
model = torch.nn.Linear(8, 4)
fastckpt.save_checkpoint("runs", models={{"main": (model, None)}})
loaded = fastckpt.load_checkpoint("runs")["models"]["main"]["model"]
assert torch.equal(loaded.weight, model.weight)
print("smoke ok", fastckpt.__file__)
"""


def test_wheel_installs_and_runs_without_rust(clean_venv: Path, wheel: Path) -> None:
    env = _no_rust_env(clean_venv)
    for tool in RUST_TOOLS:
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is still on PATH"
    version = wheel.stem.split("-")[1]
    work = clean_venv.parent / "work"
    work.mkdir()
    result = subprocess.run(
        [str(clean_venv / "bin" / "python"), "-c", SMOKE.format(version=version)],
        cwd=work, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "smoke ok" in result.stdout and str(clean_venv) in result.stdout


def test_bench_without_matplotlib_exits_zero(clean_venv: Path) -> None:
    """``fastckpt bench`` from the wheel (no 'plot' extra) skips the chart and succeeds."""
    env = _no_rust_env(clean_venv)
    out = clean_venv.parent / "bench-out"
    result = subprocess.run(
        [str(clean_venv / "bin" / "fastckpt"), "bench", "--size-gib", "0.001", "--repeats",
         "1", "--no-memory", "--no-training", "--warm", "--writers", "fastckpt",
         "--readers", "fastckpt", "--out", str(out)],
        cwd=clean_venv.parent, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped state-0.001gib.png" in result.stderr
    assert "fastckpt-io[plot]" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["state-0.001gib.json", "state-0.001gib.md"]


def test_version_comes_from_the_installed_distribution(clean_venv: Path, wheel: Path) -> None:
    result = subprocess.run(
        [str(clean_venv / "bin" / "fastckpt"), "--version"],
        env=_no_rust_env(clean_venv), capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fastckpt", wheel.stem.split("-")[1]]
