"""fastckpt.container.diff: the bitwise tensor comparison behind ``fastckpt diff`` (the command
itself is
tested in test_cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import fastckpt
from fastckpt.container import diff


def test_compare_tensors_is_bitwise_and_reports_nan() -> None:
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert diff.compare_tensors(a, a.clone()) == (0, 0.0)  # NaN equals itself bitwise
    count, biggest = diff.compare_tensors(a, torch.tensor([-0.0, 3.0, float("nan")]))
    assert count == 2 and biggest == 2.0  # -0.0 differs in its bits, by 0 in value
    count, biggest = diff.compare_tensors(torch.tensor([1.0]), torch.tensor([float("nan")]))
    assert count == 1 and biggest != biggest
    flags = torch.tensor([True, False])
    assert diff.compare_tensors(flags, ~flags) == (2, 1.0)


def test_diff_of_two_kinds_shows_user_key_paths_a_summary_first_and_a_limit(
    tmp_path: Path,
) -> None:
    """A root against a manager checkpoint of the same training state: value rows name the
    state's own key paths (no ``__tuple__``/``__dict__``/``skeleton`` encodings, no tensor
    placeholders), the summary is the third line, and ``--limit`` cuts each table."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    fastckpt.save_checkpoint(tmp_path / "root", models={"main": (model, None)}, optimizers={
        "adam": (optimizer, None)})  # fmt: skip
    with fastckpt.CheckpointManager() as manager:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3}
        future = manager.save(tmp_path / "mgr", state)
        if future is not None:
            future.result()

    def diff(*extra: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-m", "fastckpt", "diff", str(tmp_path / "root"),
             str(tmp_path / "mgr"), *extra],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        return done.stdout.splitlines()

    everything = diff("--limit", "0")
    assert everything[2].startswith("0 of 0 common tensor(s) differ, 16 added, 16 removed;")
    values = {line.split()[1] for line in everything if line.startswith(("added", "removed"))}
    assert {"optim:param_groups.0.betas.1", "optim:param_groups.0.lr", "step"} <= values
    assert "optimizers/adam:spec.kwargs.betas.0" in values
    assert not [v for v in values if "__" in v or "skeleton" in v], values
    shown = diff("--limit", "5")
    assert shown[2] == everything[2]
    cuts = [line for line in shown if line.startswith("... and ")]
    assert cuts == ["... and 27 more (--limit 0 shows every row)", cuts[1]] and len(cuts) == 2
    assert len(shown) == 3 + (1 + 5 + 1) * 2
    assert len(diff()) < len(everything)  # 20 rows per table by default
