"""The command line on paths users type: a symbolic link to an index directory, and
``export --to`` into a folder that does not exist. Run in-process through ``cli.main`` on
real checkpoints.

Before: ``verify LINK`` (LINK -> ROOT/1) said "not a fastckpt checkpoint" (the index was
recognized by its own name and its parent's manifest, neither of which a link has), and
``export --to missing/x.safetensors`` failed with the Rust core's bare "No such file or
directory" after reading the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fastckpt
from cli_support import Run, cli_runner


@pytest.fixture()
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli.main(args)``: (status, stdout, stderr)."""
    return cli_runner(capsys)


def _root_with_two_indices(tmp_path: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    root = tmp_path / "root"
    fastckpt.save_checkpoint(root, {"main": (model, None)})
    with torch.no_grad():
        model.weight.add_(1.0)
    fastckpt.save_checkpoint(root, {"main": (model, None)})
    return root, model


def test_a_link_to_an_index_directory_is_that_index(run: Run, tmp_path: Path) -> None:
    root, model = _root_with_two_indices(tmp_path)
    link = tmp_path / "newest"
    link.symlink_to(root / "1", target_is_directory=True)

    status, out, err = run("verify", link)
    assert status == 0, err
    assert f"{root / '1'}:" in out and "index(es) 1 verified" in out

    status, out, err = run("inspect", link)
    assert status == 0, err
    assert "index 1 (latest)" in out

    exported = tmp_path / "weights.safetensors"
    status, _, err = run("export", link, "--to", exported)
    assert status == 0, err
    from safetensors.torch import load_file

    assert torch.equal(load_file(exported)["weight"], model.weight.detach())


def test_a_link_to_a_folder_that_is_no_index_is_still_refused(run: Run, tmp_path: Path) -> None:
    root, _ = _root_with_two_indices(tmp_path)
    (root / "notes").mkdir()
    link = tmp_path / "notes-link"
    link.symlink_to(root / "notes", target_is_directory=True)
    status, _, err = run("verify", link)
    assert status == 2
    assert "is not a fastckpt checkpoint" in err


def test_export_into_a_missing_folder_names_the_folder_and_the_fix(
    run: Run, tmp_path: Path
) -> None:
    root, _ = _root_with_two_indices(tmp_path)
    out = tmp_path / "missing" / "weights.safetensors"
    status, _, err = run("export", root, "--to", out)
    assert status == 2
    assert f"its folder {out.parent} does not exist" in err
    assert "create it first" in err
    assert not out.parent.exists()
    # A file where the folder should be is named the same way.
    (tmp_path / "file").write_text("x")
    status, _, err = run("export", root, "--to", tmp_path / "file" / "weights.safetensors")
    assert status == 2
    assert "does not exist (or is not a folder)" in err
