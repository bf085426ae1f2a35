"""The commands that only read records and headers start without torch.

``fastckpt ls``, ``inspect`` and ``verify`` (and ``--version``/``--help``) read JSON records and
safetensors headers and check crc32c in the Rust core: each test runs a command in a new
process and checks, after it finished, that neither torch nor numpy was imported, and that its
output is the real answer (not an early exit). The times are measured by
``python -m fastckpt.bench.startup``, never asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.bench import startup

#: Runs the CLI in-process with argv, then prints which heavy modules were imported.
_PROBE = """
import json, runpy, sys
sys.argv = ["fastckpt", *json.loads(sys.argv[1])]
try:
    runpy.run_module("fastckpt", run_name="__main__")
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status, "torch": "torch" in sys.modules,
                  "numpy": "numpy" in sys.modules}), file=sys.stderr)
"""


def _run(*args: str) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(list(args))],
        capture_output=True,
        text=True,
        check=False,
    )
    probe = json.loads(done.stderr.strip().splitlines()[-1])
    return probe, done.stdout


@pytest.fixture(scope="module")
def fixture(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return startup.build_fixture(tmp_path_factory.mktemp("startup"))


@pytest.mark.parametrize(
    "args",
    [
        ["ls", "{root}"],
        ["ls", "--json", "{root}"],
        ["inspect", "{root}"],
        ["inspect", "{root}/1"],
        ["verify", "{root}"],
        ["ls", "{managers}"],
        ["inspect", "{managers}/step_2"],
        ["verify", "{managers}"],
        ["verify", "{root}/0/models/net.safetensors"],
        ["--version"],
        ["--help"],
    ],
)
def test_reading_commands_never_import_torch_or_numpy(
    fixture: dict[str, Path], args: list[str]
) -> None:
    argv = [arg.format(**{name: str(path) for name, path in fixture.items()}) for arg in args]
    probe, out = _run(*argv)
    assert probe["status"] in (0, None), out
    assert probe == {"status": probe["status"], "torch": False, "numpy": False}
    assert out.strip()


def test_the_torch_free_listing_is_the_listing(fixture: dict[str, Path]) -> None:
    probe, out = _run("ls", "--json", str(fixture["root"]))
    assert probe["status"] in (0, None)
    rows = json.loads(out)["checkpoints"]
    assert rows == json.loads(json.dumps(fastckpt.list_checkpoints(fixture["root"])))
    assert [row["index"] for row in rows] == [0, 1] and rows[1]["latest"]


def test_inspect_renders_spec_arguments_from_the_stored_json(tmp_path: Path) -> None:
    """Specs are shown as stored (no class imported, no torch): tuples, nested specs, dtypes,
    devices and tensors as the user passed them."""
    model = torch.nn.Conv2d(1, 2, (3, 3))
    spec = fastckpt.create_model_spec(
        torch.nn.Conv2d,
        in_channels=1,
        out_channels=2,
        kernel_size=(3, 3),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    fastckpt.checkpoint.specs.attach_spec(model, spec)
    fastckpt.save_checkpoint(tmp_path / "root", models={"m": model})
    probe, out = _run("inspect", str(tmp_path / "root"))
    assert probe["torch"] is False
    assert (
        "m: torch.nn.modules.conv.Conv2d(in_channels=1, out_channels=2, kernel_size=(3, 3), "
        "dtype=torch.float32, device=device('cpu'))"
    ) in out, out


def test_the_startup_benchmark_runs(fixture: dict[str, Path], tmp_path: Path) -> None:
    rows = startup.measure(fixture, repeats=1)
    assert [row["command"] for row in rows] == [name for name, _ in startup.COMMANDS]
    assert all(row["seconds"]["median"] > 0 for row in rows)
    assert "| `fastckpt ls ROOT` |" in startup.render(rows)
