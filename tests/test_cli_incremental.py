"""The CLI on roots holding incremental saves: ``prune`` reports the bytes it keeps for kept
checkpoints' references as kept, not freed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt import cli, incremental


@pytest.fixture(autouse=True)
def _fresh_trackers() -> None:
    incremental.forget()


def _save_four(root: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 2))
    model[0].requires_grad_(False)  # the frozen part: index 0 holds its bytes
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        fastckpt.save_checkpoint(root, models={"m": (model, None)})


def test_prune_counts_retained_bytes_as_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    _save_four(root)
    sizes = {row["index"]: row["size"] for row in fastckpt.list_checkpoints(root)}
    assert cli.main(["prune", str(root), "--keep-last", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["deleted"] == [0, 1, 2]
    # Index 3 references the frozen layer's bytes in index 0: they are retained, not freed.
    assert report["retained_for_references"] == [0]
    assert report["freed_bytes"] == sizes[1] + sizes[2]
    assert ".ref-0" in os.listdir(root)
    assert fastckpt.verify(root).ok


def test_prune_text_names_the_retained_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    _save_four(root)
    assert cli.main(["prune", str(root), "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would delete index(es) 0, 1, 2 (")
    assert "index(es) 0 stay as references of kept incremental saves" in out
