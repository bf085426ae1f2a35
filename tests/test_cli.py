"""The ``fastckpt`` command line against real checkpoints, good and damaged.

Every subcommand runs at least once as a user runs it (``python -m fastckpt ...`` in a
subprocess: output text, exit status, ``--json`` parses, errors are one line without a
traceback). Those subprocesses start torch (~2 s each), so they are launched together, two at
a time, by one fixture; finer behaviour is checked in-process through ``cli.main``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import fastckpt
from cli_support import Run, cli_runner
from fastckpt import cli
from fastckpt.io.progress import IOMeter, ProgressBar, format_bytes, io_progress

# --------------------------------------------------------------------------- checkpoints


def train_step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """A loss for the strategy checkpoint."""
    return model(batch).square().mean()


def flip_byte(path: Path, offset_from_end: int = 3) -> None:
    """Corrupt one byte of tensor data (the data section ends the file)."""
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def save_components(root: Path, steps: int) -> None:
    """``steps`` indices of a Linear + Adam + StepLR, training a little between saves."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=5)
    for step in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        adam.step()
        sched.step()
        fastckpt.save_checkpoint(
            root,
            models={"main": (model, None)},
            optimizers={"adam": (adam, None)},
            schedulers={"sched": (sched, None)},
            counters={"step": step + 1, "epoch": 0},
        )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of checkpoint the CLI reads, written once for the module."""
    base = tmp_path_factory.mktemp("cli")
    save_components(base / "run", 3)

    shutil.copytree(base / "run", base / "bad")
    flip_byte(base / "bad" / "1" / "models" / "main.safetensors")
    (base / "bad" / "2" / "optimizers" / "adam.json").unlink()

    shutil.copytree(base / "run", base / "prune-me")

    torch.manual_seed(0)
    strategy = fastckpt.TrainingStrategy(
        nn.Linear(4, 1),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=train_step,
        hooks=[
            fastckpt.EMAHook(decay=0.9),
            fastckpt.CheckpointHook(base / "strategy", step_interval=2, async_save=False),
        ],
        num_steps=4,
    )
    strategy.run([torch.randn(2, 4) for _ in range(4)])

    fastckpt.save_checkpoint(
        base / "two-models",
        models={"encoder": (nn.Linear(2, 2), None), "decoder": (nn.Linear(2, 2), None)},
    )

    model = nn.Linear(4, 2)
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as manager:
        for step in (10, 20):
            manager.save(base / "mgr" / f"step_{step}", {"model": model.state_dict(), "step": step})

    safetensors.torch.save_file({"x": torch.arange(6.0).reshape(2, 3)}, base / "plain.safetensors")
    (base / "empty").mkdir()
    return base


# --------------------------------------------------------------------------- subprocess runs

COMMANDS: dict[str, list[str]] = {
    "ls": ["ls", "run"],
    "inspect-strategy": ["inspect", "strategy"],
    "inspect-manager-json": ["--json", "inspect", "mgr/step_10"],
    "verify-good": ["verify", "run"],
    "verify-bad": ["verify", "bad"],
    "verify-bad-index": ["verify", "bad", "--index", "2"],
    "verify-tty": ["verify", "run"],  # stderr is a terminal: the progress bar is drawn
    "diff": ["diff", "run/0", "run/2"],
    "prune": ["prune", "prune-me", "--keep-last", "1"],
    "export": ["export", "run", "--index", "1", "--to", "exported.safetensors"],
    "err-missing": ["inspect", "no/such/dir"],
    "err-corrupt": ["export", "bad/1", "--to", "never.safetensors"],
}


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m fastckpt ARGS`` in ``cwd``, stdout and stderr captured."""
    return subprocess.run(
        [sys.executable, "-m", "fastckpt", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_cli_on_terminal(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str] | None:
    """Like :func:`run_cli`, with stderr on a pseudo-terminal (what a user at a shell has);
    None where no pseudo-terminal can be opened."""
    try:
        primary, replica = pty.openpty()
    except OSError:
        return None
    with subprocess.Popen(
        [sys.executable, "-m", "fastckpt", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=replica
    ) as proc:
        os.close(replica)
        drawn = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
    os.close(primary)
    return subprocess.CompletedProcess(args, proc.returncode, out, drawn.decode())


@pytest.fixture(scope="module")
def runs(ckpts: Path) -> dict[str, subprocess.CompletedProcess[str] | None]:
    """Every command of COMMANDS, run two at a time (they touch disjoint files)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(run_cli_on_terminal if "tty" in name else run_cli, args, ckpts)
            for name, args in COMMANDS.items()
        }
        return {name: future.result() for name, future in futures.items()}


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_ls_lists_indices_with_counters_and_marks_the_latest(runs: dict[str, Any]) -> None:
    result = runs["ls"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("run: 3 committed index(es)")
    assert lines[1].split()[:6] == ["INDEX", "CREATED", "(UTC)", "SIZE", "STEP", "EPOCH"]
    rows = [line.split() for line in lines[2:5]]
    assert [row[0] for row in rows] == ["0", "1", "*"]  # only the latest is starred
    assert rows[2][1] == "2"
    assert rows[0][5:7] == ["1", "0"]  # step and epoch counters of index 0
    assert "models: main; optimizers: adam; schedulers: sched" in lines[2]


def test_inspect_strategy_checkpoint(runs: dict[str, Any]) -> None:
    result = runs["inspect-strategy"]
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("strategy/1: index 1 (latest) of save_checkpoint root strategy")
    assert "step_count=4" in out
    assert "main: torch.nn.modules.linear.Linear(in_features=4, out_features=1, bias=True)" in out
    assert "torch.optim.sgd.SGD(lr=0.1" in out
    assert "training_fn=test_cli.train_step" in out
    assert "fastckpt.training.hooks.ema.EMAHook #0" in out
    assert "models/main.safetensors" in out
    assert "weight  F32    [1, 4]  16 B" in out


def test_inspect_manager_json(runs: dict[str, Any]) -> None:
    info = json.loads(runs["inspect-manager-json"].stdout)
    assert info["kind"] == "manager"
    items = {item["name"]: item for item in info["items"]}
    assert items["step"]["values"] == {"step": 10}
    assert items["model"]["tensor_files"] == ["model.safetensors"]
    model_file = next(f for f in info["files"] if f["path"] == "model.safetensors")
    assert {t["name"]: t["shape"] for t in model_file["tensors"]} == {
        "weight": [2, 4],
        "bias": [2],
    }


def test_verify_good_checkpoint_exits_0(runs: dict[str, Any]) -> None:
    result = runs["verify-good"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: run: ")
    assert "of index(es) 0, 1, 2 verified" in result.stdout
    assert result.stderr == ""  # no progress bar when stderr is not a terminal


def test_verify_damaged_checkpoint_names_bad_files_and_exits_1(runs: dict[str, Any]) -> None:
    result = runs["verify-bad"]
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert out.startswith("BAD: bad: 2 problem(s)")
    assert "corrupt" in out and "bad/1/models/main.safetensors" in out and "weight" in out
    assert "missing" in out and "bad/2/optimizers/adam.json" in out
    assert out.rstrip().endswith("damaged index(es): 1, 2; newest intact index: 0")
    # With --index only that index is checked: the root's newest intact index is unknown
    # (before: "newest intact index: none" while index 0 was intact).
    scoped = runs["verify-bad-index"]
    assert scoped.returncode == 1 and "newest intact index" not in scoped.stdout
    assert "only that index was checked" in scoped.stdout


def test_diff_reports_changed_tensors_and_exits_1(runs: dict[str, Any]) -> None:
    result = runs["diff"]
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "a: run/0 (index 0)"
    assert lines[1] == "b: run/2 (index 2, latest)"
    weight = next(line for line in lines if "models/main:weight" in line).split()
    assert weight[:5] == ["changed", "models/main:weight", "F32", "[2,", "4]"]
    assert weight[5] == "8/8"
    assert float(weight[6]) > 0
    assert "0 added, 0 removed" in lines[2]  # the summary comes first
    assert lines[2].endswith("plain value(s) differ")  # the counters: step 1 vs 3
    assert next(line for line in lines if "counters:step " in line).split()[2:] == ["1", "3"]


def test_prune_deletes_old_indices(runs: dict[str, Any], ckpts: Path) -> None:
    result = runs["prune"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("deleted index(es) 0, 1 (")
    assert result.stdout.rstrip().endswith("kept 2")
    assert [c["index"] for c in fastckpt.list_checkpoints(ckpts / "prune-me")] == [2]
    assert not (ckpts / "prune-me" / "0").exists()


def test_export_writes_a_plain_safetensors_file(runs: dict[str, Any], ckpts: Path) -> None:
    result = runs["export"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrote exported.safetensors: 2 tensor(s)")
    exported = safetensors.torch.load_file(ckpts / "exported.safetensors")
    saved = fastckpt.load_file(ckpts / "run" / "1" / "models" / "main.safetensors")
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_user_errors_are_one_line_without_traceback(runs: dict[str, Any], ckpts: Path) -> None:
    assert_one_line_error(runs["err-missing"], "fastckpt inspect: error:", "no/such/dir")
    assert_one_line_error(runs["err-corrupt"], "checksum mismatch", "weight", "bad/1/models")
    assert not (ckpts / "never.safetensors").exists()


def test_progress_bar_is_drawn_on_a_terminal_only(runs: dict[str, Any]) -> None:
    result = runs["verify-tty"]
    if result is None:
        pytest.skip("no pseudo-terminal available")
    assert result.returncode == 0
    assert result.stdout.startswith("ok: run: ")  # the report itself still goes to stdout
    frames = result.stderr.split("\r\x1b[2K")
    assert frames[0] == "" and frames[-1] == ""  # every frame redraws the line; the last erases
    assert frames[1].startswith("verify run [") and "%" in frames[1] and "/s" in frames[1]
    assert runs["verify-good"].stderr == ""  # nothing at all when stderr is not a terminal


# --------------------------------------------------------------------------- in-process


@pytest.fixture()
def fastckpt_cli(
    ckpts: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Run:
    """``cli.main(args)`` in the checkpoint directory: (status, stdout, stderr)."""
    monkeypatch.chdir(ckpts)
    return cli_runner(capsys)


def test_json_of_every_subcommand_parses(fastckpt_cli: Run) -> None:
    status, out, _ = fastckpt_cli("ls", "run", "--json")
    listing = json.loads(out)
    assert listing["kind"] == "root"
    assert [c["index"] for c in listing["checkpoints"]] == [0, 1, 2]
    assert [c["latest"] for c in listing["checkpoints"]] == [False, False, True]
    assert listing["checkpoints"][1]["counters"] == {"step": 2, "epoch": 0}

    status, out, _ = fastckpt_cli("--json", "verify", "bad")
    report = json.loads(out)
    assert status == 1 and report["ok"] is False
    assert report["failed_indices"] == [1, 2]
    statuses = {Path(f["path"]).as_posix(): f["status"] for f in report["files"]}
    assert statuses["bad/1/models/main.safetensors"] == "corrupt"
    assert statuses["bad/2/optimizers/adam.json"] == "missing"
    assert statuses["bad/0/models/main.safetensors"] == "ok"

    status, out, _ = fastckpt_cli("diff", "run/2", "run", "--json")
    diff = json.loads(out)
    assert status == 0 and diff["identical"] is True
    assert diff["compared"] == diff["same"] == 8  # weights 2, Adam state 6 (StepLR: none)

    status, out, _ = fastckpt_cli("export", "mgr/step_20", "--to", "manager.safetensors", "--json")
    summary = json.loads(out)
    assert status == 0 and summary["tensors"] == 2
    assert summary["metadata"]["fastckpt.item"] == "model"

    status, out, _ = fastckpt_cli("prune", "run", "--keep-last", "1", "--dry-run", "--json")
    assert json.loads(out)["deleted"] == [0, 1]

    status, out, _ = fastckpt_cli("ls", "mgr", "--json")
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [10, 20]


def test_inspect_single_file_without_checksums(fastckpt_cli: Run) -> None:
    status, out, _ = fastckpt_cli("inspect", "plain.safetensors")
    assert status == 0
    assert "no checksums (not written by fastckpt)" in out
    assert "x       F32    [2, 3]  24 B" in out
    status, out, _ = fastckpt_cli("inspect", "plain.safetensors", "--json")
    info = json.loads(out)
    assert info["kind"] == "file" and info["checksums"] is False
    assert info["tensors"] == [{"name": "x", "dtype": "F32", "shape": [2, 3], "bytes": 24}]


def test_inspect_index_directory_and_index_option(fastckpt_cli: Run) -> None:
    _, by_dir, _ = fastckpt_cli("inspect", "run/1", "--json")
    _, by_option, _ = fastckpt_cli("inspect", "run", "--index", "1", "--json")
    assert json.loads(by_dir) == json.loads(by_option)
    info = json.loads(by_dir)
    assert info["index"] == 1 and info["latest"] is False
    assert info["counters"] == {"step": 2, "epoch": 0}
    assert info["associations"] == {"optimizers": {"adam": "main"}, "schedulers": {"sched": "adam"}}
    assert info["specs"]["schedulers/sched"]["cls_path"] == "torch.optim.lr_scheduler.StepLR"
    status, _, err = fastckpt_cli("inspect", "run/1", "--index", "2")
    assert status == 2 and "contradicts" in err


def test_inspect_damaged_index_points_to_verify(fastckpt_cli: Run) -> None:
    status, out, err = fastckpt_cli("inspect", "bad", "--index", "2")
    assert status == 2 and out == ""
    assert "adam.json" in err and "fastckpt verify bad" in err


def test_ls_manager_directory_and_wrong_targets(fastckpt_cli: Run) -> None:
    status, out, _ = fastckpt_cli("ls", "mgr")
    assert status == 0
    rows = {row.lstrip("* ").split()[0]: row.lstrip("* ").split() for row in out.splitlines()[2:4]}
    assert rows["step_10"][5:] == ["10", "-", "model,", "step"]  # STEP, EPOCH, ITEMS
    assert out.splitlines()[3].startswith("*  step_20")  # committed last
    status, _, err = fastckpt_cli("ls", "empty")
    assert status == 2 and "holds no checkpoints" in err
    status, _, err = fastckpt_cli("ls", "run/1")
    assert status == 2 and "one index of the root" in err
    status, _, err = fastckpt_cli("ls", "mgr/step_10")
    assert status == 2 and "one CheckpointManager checkpoint" in err


def test_verify_one_index_file_and_manager(fastckpt_cli: Run) -> None:
    status, out, _ = fastckpt_cli("verify", "bad", "--index", "0")
    assert status == 0 and "of index(es) 0 verified" in out
    status, out, _ = fastckpt_cli("verify", "bad/1/models/main.safetensors")
    assert status == 1 and "corrupt" in out
    status, out, _ = fastckpt_cli("verify", "mgr/step_20", "--json")
    assert status == 0 and json.loads(out)["kind"] == "manager"
    status, _, err = fastckpt_cli("verify", "mgr/step_20", "--index", "0")
    assert status == 2 and "--index only applies" in err


def test_diff_added_removed_retyped_and_atol(fastckpt_cli: Run, ckpts: Path) -> None:
    base = {"w": torch.ones(3), "gone": torch.zeros(1), "cast": torch.zeros(2)}
    other = {"w": torch.ones(3) + 1e-3, "new": torch.zeros(1), "cast": torch.zeros(2).double()}
    fastckpt.save_file(base, ckpts / "a.safetensors")
    fastckpt.save_file(other, ckpts / "b.safetensors")
    status, out, _ = fastckpt_cli("diff", "a.safetensors", "b.safetensors", "--json")
    result = json.loads(out)
    assert status == 1
    assert [c["name"] for c in result["changed"]] == ["w"]
    assert result["changed"][0]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert result["mismatched"] == [
        {"name": "cast", "a": {"dtype": "F32", "shape": [2]}, "b": {"dtype": "F64", "shape": [2]}}
    ]
    assert [t["name"] for t in result["added"]] == ["new"]
    assert [t["name"] for t in result["removed"]] == ["gone"]
    _, out, _ = fastckpt_cli("diff", "a.safetensors", "b.safetensors", "--atol", "0.01")
    changes = [line.split()[:2] for line in out.splitlines()[4:]]  # a, b, summary, header
    assert changes == [["retyped", "cast"], ["added", "new"], ["removed", "gone"]]


def test_prune_dry_run_keeps_everything(fastckpt_cli: Run, ckpts: Path) -> None:
    status, out, _ = fastckpt_cli("prune", "run", "--keep-last", "2", "--dry-run")
    assert status == 0 and out.startswith("would delete index(es) 0 (")
    assert len(fastckpt.list_checkpoints(ckpts / "run")) == 3
    status, out, _ = fastckpt_cli("prune", "run", "--keep-last", "5")
    assert out.startswith("nothing to delete")
    status, _, err = fastckpt_cli("prune", "mgr/step_10", "--keep-last", "1")
    assert status == 2 and "prune works on a save_checkpoint root" in err


def test_export_model_choice_and_overwrite(fastckpt_cli: Run, ckpts: Path) -> None:
    status, _, err = fastckpt_cli("export", "two-models", "--to", "m.safetensors")
    assert status == 2 and "several models (decoder, encoder)" in err
    status, out, _ = fastckpt_cli(
        "export", "two-models", "--to", "m.safetensors", "--model", "encoder"
    )
    assert status == 0, out
    exported = safetensors.torch.load_file(ckpts / "m.safetensors")
    assert set(exported) == {"weight", "bias"}
    with safetensors.safe_open(ckpts / "m.safetensors", "pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "pt" and metadata["fastckpt.model"] == "encoder"
    status, _, err = fastckpt_cli(
        "export", "two-models", "--to", "m.safetensors", "--model", "encoder"
    )
    assert status == 2 and "--force" in err
    status, _, _ = fastckpt_cli(
        "export", "two-models", "--to", "m.safetensors", "--model", "decoder", "--force"
    )
    assert status == 0
    status, _, err = fastckpt_cli("export", "two-models", "--to", "m.safetensors", "--model", "x")
    assert status == 2
    status, _, err = fastckpt_cli("export", "plain.safetensors", "--to", "p.safetensors")
    assert status == 2 and "already a single safetensors file" in err
    # An item without tensors is refused, not exported as an empty file.
    status, _, err = fastckpt_cli(
        "export", "mgr/step_10", "--to", "s.safetensors", "--model", "step"
    )
    assert status == 2 and "item step holds no tensors" in err and "--model" in err
    assert not (ckpts / "s.safetensors").exists()


def test_usage_errors_are_one_line(fastckpt_cli: Run) -> None:
    status, _, err = fastckpt_cli("verify", "run", "--index", "9")
    assert status == 2 and "index 9" in err and "available: [0, 1, 2]" in err
    usage_errors: tuple[list[str], ...] = (
        ["verify", "run", "--index", "x"],
        ["nope"],
        [],
        ["diff", "run"],
    )
    for args in (*usage_errors, ["prune", "run"], ["prune", "run", "--keep-last", "0"]):
        status, out, err = fastckpt_cli(*args)
        assert status == 2 and out == ""
        assert len(err.splitlines()) == 1 and "error:" in err, (args, err)


def test_debug_shows_the_traceback(fastckpt_cli: Run) -> None:
    with pytest.raises(cli.UserError, match="no such file"):
        cli.main(["--debug", "inspect", "missing"])


def test_verbose_shows_the_library_log(
    fastckpt_cli: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("fastckpt")
    handlers, level = list(logger.handlers), logger.level
    try:
        status, _, _ = fastckpt_cli("-v", "ls", "run")
        assert status == 0
        logging.getLogger("fastckpt.checkpoint.api").info("saved 3 files")  # as the library does
        assert "fastckpt.checkpoint.api: saved 3 files" in capsys.readouterr().err
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)


def test_bench_forwards_its_arguments(fastckpt_cli: Run) -> None:
    status, out, _ = fastckpt_cli("bench", "--help")
    assert status == 0 and "--size-gib" in out and "--writers" in out


def test_bench_json_prints_the_result_file(fastckpt_cli: Run, ckpts: Path) -> None:
    args = ["--size-gib", "0.002", "--repeats", "1", "--writers", "fastckpt"]
    args += ["--readers", "fastckpt", "--no-plot", "--no-memory", "--no-training"]
    args += ["--out", str(ckpts / "bench-out"), "--dir", str(ckpts)]
    status, out, err = fastckpt_cli("bench", "--json", *args)
    assert status == 0, err
    results = json.loads(out)
    assert results["tag"] == "state-0.002gib"
    assert "wrote" in err  # the harness's own log went to stderr


# --------------------------------------------------------------------------- progress helper


class FakeTerminal(io.StringIO):
    """A stream that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_percent_and_rate_then_erases() -> None:
    now = [0.0]
    stream = FakeTerminal()
    bar = ProgressBar("verify x", 4 << 20, stream=stream, clock=lambda: now[0])
    now[0] = 1.0
    bar.update(1 << 20)
    now[0] = 1.05
    bar.update(2 << 20)  # within min_interval: not redrawn
    now[0] = 2.0
    bar.update(3 << 20)
    bar.close()
    frames = stream.getvalue().split("\r\x1b[2K")
    assert frames[0] == "" and frames[-1] == ""
    assert len(frames) == 4  # two redraws and the final erase
    assert " 25%  1.0 MiB / 4.0 MiB  1.0 MiB/s" in frames[1]
    assert " 75%  3.0 MiB / 4.0 MiB  1.5 MiB/s" in frames[2]
    assert "[" in frames[2] and "#" in frames[2]


@pytest.mark.parametrize("columns", [20, 40, 60, 200])
@pytest.mark.parametrize("total", [None, 3 << 30])
def test_progress_bar_lines_never_reach_the_terminal_width(
    columns: int, total: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A line as wide as the terminal wraps, and each redraw then leaves a stale line behind.
    monkeypatch.setenv("COLUMNS", str(columns))
    now = [0.0]
    for label in ("verify", "verify runs/a-rather-long-checkpoint-directory-name/17"):
        bar = ProgressBar(label, total, stream=FakeTerminal(), clock=lambda: now[0])
        for done in (0, 1 << 20, 1 << 30, 3 << 30):
            now[0] += 1.0
            bar.update(done, force=True)
            line = bar.line()
            assert 0 < len(line) < columns, (columns, line)
            if total is not None and len(label) < columns - 12:
                assert "%" in line  # the percentage is the last detail to go


def test_progress_is_silent_off_a_terminal() -> None:
    stream = io.StringIO()
    with io_progress("export", 100, stream=stream) as bar:
        bar.update(50, force=True)
    assert stream.getvalue() == ""


def test_io_progress_follows_this_process_io(tmp_path: Path) -> None:
    if not IOMeter().available:
        pytest.skip("no /proc/self/io here")
    stream = FakeTerminal()
    payload = tmp_path / "payload"
    with io_progress("read", 8 << 20, stream=stream, enabled=True, interval=0.01) as bar:
        payload.write_bytes(os.urandom(8 << 20))
        payload.read_bytes()
        deadline = 200
        while bar.done < (8 << 20) and deadline:
            deadline -= 1
            time.sleep(0.01)
    assert bar.done >= 8 << 20
    assert "100%" in stream.getvalue()


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 << 30)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "5.0 GiB",
    ]


# --------------------------------------------------------------------------- issue 16


def test_verify_never_calls_unchecked_bytes_verified(fastckpt_cli: Run, ckpts: Path) -> None:
    """A file without checksums (written by safetensors) is read, not verified: exit 3 and the
    text says so, damaged or not."""
    status, out, _ = fastckpt_cli("verify", "plain.safetensors")
    assert status == 3, out
    assert out.startswith("UNCHECKED:") and "not verified" in out and "x" in out
    assert not out.startswith("ok")
    status, out, _ = fastckpt_cli("--json", "verify", "plain.safetensors")
    report = json.loads(out)
    assert status == 3 and report["status"] == "unchecked" and report["ok"] is False
    assert report["unchecked_files"] == ["plain.safetensors"]
    damaged = ckpts / "plain-damaged.safetensors"
    shutil.copy(ckpts / "plain.safetensors", damaged)
    flip_byte(damaged)
    status, out, _ = fastckpt_cli("verify", damaged.name)
    assert status == 3 and "UNCHECKED" in out
    status, out, _ = fastckpt_cli("verify", "run")
    assert status == 0 and out.startswith("ok:")  # every byte under a checksum


def test_exit_statuses_are_documented_in_main_and_the_docs() -> None:
    import importlib

    main_module = importlib.import_module("fastckpt.cli.main")

    assert (main_module.EXIT_OK, main_module.EXIT_BAD, main_module.EXIT_ERROR) == (0, 1, 2)
    assert main_module.EXIT_UNCHECKED == 3
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    for status, word in ((0, "ok"), (1, "damage"), (2, "error"), (3, "unchecked")):
        assert f"| {status} |" in doc and word in doc.lower(), status
    assert "3 verify found bytes without checksums" in cli.build_parser().epilog  # type: ignore[operator]


LIGHT_CLI = """
import sys, types
# The CLI package alone, without fastckpt/__init__.py's eager imports.
package = types.ModuleType("fastckpt")
package.__path__ = [{source!r}]
sys.modules["fastckpt"] = package
from fastckpt.cli.main import main
for args in (["--version"], ["--help"], ["verify", "--help"], ["verify"], ["nope"],
             ["--json", "prune", "x"]):
    try:
        main(args)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "numpy", "safetensors", "fastckpt._native") if m in sys.modules)
print("IMPORTED", heavy)
"""


def test_help_version_and_usage_errors_do_not_import_torch() -> None:
    source = str(Path(fastckpt.__file__).parent)
    result = subprocess.run(
        [sys.executable, "-c", LIGHT_CLI.format(source=source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "IMPORTED []" in result.stdout, result.stdout[-2000:]
    assert f"fastckpt {fastckpt.__version__}" in result.stdout


def test_the_installed_command_does_not_import_torch_for_version() -> None:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fastckpt", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "torch" not in imported


def test_json_errors_are_json(fastckpt_cli: Run) -> None:
    status, out, err = fastckpt_cli("--json", "verify", "no/such/dir")
    document = json.loads(out)
    assert status == 2 and err == ""
    assert document["exit_status"] == 2 and document["command"] == "fastckpt verify"
    assert "no/such/dir" in document["error"]
    status, out, _ = fastckpt_cli("verify", "run", "--index", "x", "--json")
    assert status == 2 and "not an integer index" in json.loads(out)["error"]


def test_every_subcommand_argument_has_help() -> None:
    import argparse

    parser = cli.build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [
        f"{name} {action.dest}"
        for name, sub in commands.choices.items()
        if name != "bench"
        for action in sub._actions
        if not action.help
    ]
    assert missing == []
    assert all(action.help for action in parser._actions)


def test_diff_reports_plain_value_differences(fastckpt_cli: Run) -> None:
    """Two manager checkpoints of the same weights at steps 10 and 20 are not identical."""
    status, out, _ = fastckpt_cli("diff", "mgr/step_10", "mgr/step_20")
    assert status == 1, out
    # The item's own key path, not fastckpt's encoding of it (step.json's "skeleton").
    assert "changed  step   10  20" in out and "skeleton" not in out
    status, out, _ = fastckpt_cli("--json", "diff", "mgr/step_10", "mgr/step_20")
    result = json.loads(out)
    assert result["identical"] is False and result["changed"] == []
    assert result["values_changed"] == [{"name": "step", "a": 10, "b": 20}]
    status, out, _ = fastckpt_cli("--json", "diff", "run/0", "run/2")
    changed = {v["name"]: (v["a"], v["b"]) for v in json.loads(out)["values_changed"]}
    assert changed["counters:step"] == (1, 3)
    status, out, _ = fastckpt_cli("diff", "run/2", "run")
    assert status == 0 and "plain value(s) compared" in out


def test_diff_compares_a_root_with_its_own_export(fastckpt_cli: Run, ckpts: Path) -> None:
    status, _, _ = fastckpt_cli("export", "run", "--to", "run-main.safetensors")
    assert status == 0
    status, out, _ = fastckpt_cli("diff", "run", "run-main.safetensors")
    assert status == 0, out
    assert "[models/main]" in out and "identical: 2 tensor(s)" in out
    status, out, _ = fastckpt_cli("diff", "run/0", "run-main.safetensors")
    assert status == 1 and "models/main:weight" in out  # index 0's weights differ from 2's
    status, out, _ = fastckpt_cli("export", "mgr/step_20", "--to", "mgr-model.safetensors")
    status, out, _ = fastckpt_cli("diff", "mgr-model.safetensors", "mgr/step_20")
    assert status == 0 and "[model]" in out


def test_verify_inspect_and_prune_take_a_directory_of_manager_checkpoints(
    fastckpt_cli: Run, ckpts: Path
) -> None:
    shutil.copytree(ckpts / "mgr", ckpts / "mgr-dir")
    status, out, _ = fastckpt_cli("verify", "mgr-dir")
    assert status == 0 and out.count("ok:") == 2 and "step_10" in out and "step_20" in out
    status, out, _ = fastckpt_cli("inspect", "mgr-dir")
    assert status == 0 and "newest of 2 CheckpointManager checkpoint(s)" in out
    assert "step_20" in out.splitlines()[0]
    status, out, _ = fastckpt_cli("prune", "mgr-dir", "--keep-last", "1", "--dry-run")
    assert status == 0 and out.startswith("would delete step_10")
    status, out, _ = fastckpt_cli("--json", "prune", "mgr-dir", "--keep-last", "1")
    assert status == 0 and json.loads(out)["deleted"] == ["step_10"]
    assert sorted(p.name for p in (ckpts / "mgr-dir").iterdir()) == ["step_20"]
    status, out, _ = fastckpt_cli("--json", "ls", "mgr-dir")
    assert [c["name"] for c in json.loads(out)["checkpoints"]] == ["step_20"]
    flip_byte(ckpts / "mgr-dir" / "step_20" / "model.safetensors")
    status, out, _ = fastckpt_cli("verify", "mgr-dir")
    assert status == 1 and "BAD" in out


@pytest.mark.parametrize("alias", ["aa_latest", "zz_latest"])
def test_prune_of_manager_checkpoints_never_counts_or_strands_an_alias_symlink(
    fastckpt_cli: Run, ckpts: Path, alias: str
) -> None:
    # An alias to the newest checkpoint used to count as the newest (same save date, name
    # last) and verify through its target, which prune then deleted: nothing left.
    folder = ckpts / f"mgr-{alias}"
    shutil.copytree(ckpts / "mgr", folder)
    (folder / alias).symlink_to("step_20")
    (folder / "old").symlink_to("step_10")  # an alias to an older one keeps it
    status, out, _ = fastckpt_cli("--json", "ls", str(folder))
    assert [c["name"] for c in json.loads(out)["checkpoints"]] == ["step_10", "step_20"]
    status, out, _ = fastckpt_cli("--json", "prune", str(folder), "--keep-last", "1")
    assert status == 0 and json.loads(out)["deleted"] == [], out
    (folder / "old").unlink()
    status, out, _ = fastckpt_cli("--json", "prune", str(folder), "--keep-last", "1")
    assert status == 0 and json.loads(out)["deleted"] == ["step_10"], out
    assert sorted(p.name for p in folder.iterdir()) == sorted([alias, "step_20"])
    assert (folder / alias / "commit.json").is_file()
    status, out, _ = fastckpt_cli("verify", str(folder / alias))
    assert status == 0, out
    # A symlink to a checkpoint kept elsewhere is a checkpoint of the folder, not an alias.
    elsewhere = ckpts / f"elsewhere-{alias}"
    shutil.copytree(ckpts / "mgr" / "step_10", elsewhere)
    (folder / "step_05").symlink_to(elsewhere)
    status, out, _ = fastckpt_cli("--json", "ls", str(folder))
    assert "step_05" in [c["name"] for c in json.loads(out)["checkpoints"]], out


def test_a_folder_of_other_files_holding_a_commit_json_is_no_checkpoint(
    fastckpt_cli: Run, ckpts: Path
) -> None:
    """A folder beside manager checkpoints whose ``commit.json`` is someone else's (a run's
    notes: ``{"git_commit": ...}`` and ``notes.txt``) is never listed, counted or deleted by
    ``ls`` or ``prune``, whatever its date. Before, ``prune --keep-last 2`` deleted it (and
    ``notes.txt``) with exit 0, and a newer one took a retention place from a checkpoint."""
    folder = ckpts / "mgr-with-notes"
    shutil.copytree(ckpts / "mgr", folder)
    for name, age in (("run_info", -7200), ("notes", 3600)):
        (folder / name).mkdir()
        (folder / name / "commit.json").write_text('{"git_commit": "3f2a9c"}')
        (folder / name / "notes.txt").write_text("hyperparameters, notes")
        when = time.time() + age
        os.utime(folder / name / "commit.json", (when, when))
    status, out, _ = fastckpt_cli("--json", "ls", str(folder))
    assert [c["name"] for c in json.loads(out)["checkpoints"]] == ["step_10", "step_20"], out
    status, out, _ = fastckpt_cli("--json", "prune", str(folder), "--keep-last", "1")
    assert status == 0 and json.loads(out)["deleted"] == ["step_10"], out
    assert sorted(p.name for p in folder.iterdir()) == ["notes", "run_info", "step_20"]
    assert (folder / "run_info" / "notes.txt").is_file()


HOLD_LOCK = """
import sys, time
from fastckpt.storage.lock import RootLock
lock = RootLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_prune_says_who_holds_the_lock_and_gives_up_after_the_timeout(
    fastckpt_cli: Run, ckpts: Path
) -> None:
    shutil.copytree(ckpts / "run", ckpts / "locked")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(ckpts / "locked")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        status, out, err = fastckpt_cli(
            "prune", "locked", "--keep-last", "1", "--lock-timeout", "0.3"
        )
        assert status == 2 and out == ""
        assert f"locked by pid {holder.pid} (" in err and "waiting (at most 0.3 s" in err
        assert socket.gethostname() in err and f"{sys.executable} -c" in err  # its command
        assert "still locked" in err and "--lock-timeout" in err and len(err.splitlines()) == 2
        assert len(fastckpt.list_checkpoints(ckpts / "locked")) == 3
    finally:
        holder.kill()
        holder.wait()
    status, out, _ = fastckpt_cli("prune", "locked", "--keep-last", "1", "--lock-timeout", "5")
    assert status == 0 and out.startswith("deleted index(es) 0, 1")


def test_export_model_ema_writes_the_averaged_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ema = fastckpt.EMAHook(decay=0.9)
    strategy = fastckpt.TrainingStrategy(
        nn.Linear(4, 2),
        fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.1}),
        training_fn=train_step,
        hooks=[ema, fastckpt.CheckpointHook(tmp_path / "s", step_interval=3, async_save=False)],
        num_steps=3,
    )
    strategy.run([torch.randn(2, 4) for _ in range(3)])
    out = tmp_path / "ema.safetensors"
    assert cli.main(["export", str(tmp_path / "s"), "--model", "ema", "--to", str(out)]) == 0
    exported = fastckpt.load_file(out)
    assert set(exported) == {"weight", "bias"}
    assert all(torch.equal(exported[k], ema.shadow[k]) for k in exported)
    weights = dict(strategy.models["main"].named_parameters())
    assert not torch.equal(exported["weight"], weights["weight"])  # not the raw weights
    metadata = fastckpt.read_metadata(out)["metadata"]
    assert metadata["fastckpt.model"] == "ema" and metadata["fastckpt.ema_of"] == "main"
    assert cli.main(["export", str(tmp_path / "s"), "--model", "ema1", "--to", "x.st"]) == 2


def test_export_progress_counts_the_bytes_the_core_writes(tmp_path: Path) -> None:
    """The bar is fed by the Rust writer's ByteCounter: it reaches the file's tensor bytes
    (100 %), where counting this process's read/write syscalls stopped near half."""
    from fastckpt.cli.render import counted_progress
    from fastckpt.io.files import write_tensors

    tensors = {"a": torch.zeros(4 << 20), "b": torch.ones(1 << 20, dtype=torch.float64)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    stream = io.StringIO()
    with counted_progress("export", nbytes, stream=stream, enabled=True, interval=0.01) as counter:
        write_tensors(tensors, tmp_path / "x.safetensors", progress=counter)
    assert counter.value == nbytes
    drawn = [line for line in stream.getvalue().split("\r\x1b[2K") if line]
    assert drawn[0].startswith("export [") and "  0%" in drawn[0]
    assert "100%" in drawn[-1] and format_bytes(nbytes) in drawn[-1]
    assert stream.getvalue().endswith("\r\x1b[2K")  # erased at the end


def test_mapped_loads_advance_the_active_counter(tmp_path: Path) -> None:
    """diff loads through a file mapping (page faults, not read calls): its bar counts the
    bytes the core verifies, through the counter made active for the command."""
    from fastckpt.cli.render import counted_progress
    from fastckpt.io.progress import counting
    from fastckpt.storage.registry import backend_for

    tensors = {"a": torch.zeros(3 << 20), "b": torch.ones(1 << 20, dtype=torch.float64)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    path = tmp_path / "x.safetensors"
    fastckpt.save_file(tensors, path)
    stream = io.StringIO()
    with (
        counted_progress("diff", 2 * nbytes, stream=stream, enabled=True) as counter,
        counting(counter),
    ):
        for _ in range(2):
            loaded, _ = backend_for(path).open_tensors(path, verify=True)
            assert torch.equal(loaded["b"], tensors["b"])
    assert counter.value == 2 * nbytes
    assert "100%" in [line for line in stream.getvalue().split("\r\x1b[2K") if line][-1]
    backend_for(path).open_tensors(path, verify=True)  # outside the block: not counted
    assert counter.value == 2 * nbytes


def test_verify_of_a_folder_passes_over_a_checkpoint_pruned_meanwhile(
    ckpts: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: ``fastckpt verify DIR`` exited 2 ("no such file or directory") when a prune
    deleted a listed checkpoint before its turn came."""
    import fastckpt.cli.verify as verifying
    from fastckpt.cli.main import main

    folder = ckpts / "mgr-pruned"
    shutil.copytree(ckpts / "mgr", folder)
    check = verifying.verify

    def prune_the_next(path: Any, *args: Any) -> Any:
        shutil.rmtree(folder / "step_20", ignore_errors=True)  # another process's prune
        return check(path, *args)

    monkeypatch.setattr(verifying, "verify", prune_the_next)
    assert main(["verify", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert "step_10" in out and "ok" in out and "step_20" not in out
    assert "step_20: deleted while the folder was verified" in err
    # ... and one deleted right after it was verified, before its sizes were counted (it
    # exited 2: the size count's locate() said "no such file or directory").
    shutil.rmtree(folder)
    shutil.copytree(ckpts / "mgr", folder)

    def prune_after(path: Any, *args: Any) -> Any:
        report = check(path, *args)
        if Path(path).name == "step_10":
            shutil.rmtree(path)  # a retention right after its turn
        return report

    monkeypatch.setattr(verifying, "verify", prune_after)
    assert main(["verify", str(folder)]) == 0
    out, _ = capsys.readouterr()
    assert "step_10" in out and "step_20" in out


@pytest.mark.parametrize(
    ("a", "b", "row"),
    [
        ({"model": {"w": "T"}, "step": 5}, {"model": {"w": "T"}}, "removed  step"),
        ({"m": ["T", "Z"]}, {"m": ("T", "Z")}, '"(list)"  "(tuple)"'),
        ({"m": ["T", "Z"]}, {"m": {"0": "T", "1": "Z"}}, 'removed  m      "(list)"'),
        ({"m": {"a.b": "T"}}, {"m": {"a": {"b": "T"}}}, "m:['a.b']"),
        ({"cfg": [1, 2]}, {"cfg": {"0": 1, "1": 2}}, 'removed  cfg    "(list)"'),
        ({"cfg": {"a.b": 1}}, {"cfg": {"a": {"b": 1}}}, "cfg:['a.b']"),
        ({"v": -0.0}, {"v": 0.0}, "changed  v      -0.0  0.0"),
    ],
    ids=[
        "plain-one-side",
        "list-tuple",
        "list-dict",
        "dotted-tensor",
        "list-dict-plain",
        "dotted-plain",
        "signed-zero",
    ],
)
def test_diff_of_manager_checkpoints_that_load_differently_is_not_identical(
    tmp_path: Path,
    a: dict[str, Any],
    b: dict[str, Any],
    row: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: each pair loads back as different state, but diff said ``identical`` (exit 0):
    plain values on one side only were skipped, containers of tensors were compared by
    tensor names alone, and ``a.b`` collided with ``a`` -> ``b``, ``-0.0`` with ``0.0``."""
    from fastckpt.cli.main import main
    from fastckpt.manager import CheckpointManager

    tensors = {"T": torch.ones(2), "Z": torch.zeros(2)}

    def real(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: real(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(real(v) for v in value)
        return tensors.get(value, value) if isinstance(value, str) else value

    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "a", real(a))
        manager.save(tmp_path / "b", real(b))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert row in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0


def test_stdout_closed_early_never_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``fastckpt verify DAMAGED | head -1`` exited 0 (under ``set -o pipefail``, a
    damaged checkpoint called verified) once the report passed the pipe's buffer."""
    import io

    from fastckpt.cli.main import EXIT_PIPE_CLOSED, main

    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, models={"main": (torch.nn.Linear(2, 2), None)})
    flip_byte(root / "0" / "models" / "main.safetensors")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write fails with EPIPE
    closed = io.TextIOWrapper(io.FileIO(write_end, "w"), write_through=True)
    monkeypatch.setattr(sys, "stdout", closed)
    with pytest.raises(SystemExit) as exited:
        main(["--json", "verify", str(root)])
    assert exited.value.code == EXIT_PIPE_CLOSED == 141
