"""An ``s3://`` save whose local scratch folder (``TMPDIR``) is full.

An incremental save reads the previous index's headers through a sparse scratch file in the
local temporary folder. Before, that folder being full gave "No space left on device while
saving s3:/bucket/..." (the URL mangled into a local path), blamed the checkpoint and advised
``fastckpt prune``, which deletes checkpoints from the bucket and frees nothing locally. Now it
is a ``ScratchSpaceError`` naming the local folder and the fix; the bucket is untouched and
the save succeeds once the folder has room.
"""

from __future__ import annotations

import errno
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.storage.access import ScratchSpaceError
from s3_support import S3Server, s3_root, s3_server

__all__ = ["s3_root", "s3_server"]  # fixtures used by name below


@pytest.fixture
def small_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 1 MiB tmpfs as the process's temporary folder (skipped where mounts are refused)."""
    mount = tmp_path / "scratch"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    monkeypatch.setenv("TMPDIR", str(mount))
    monkeypatch.setattr(tempfile, "tempdir", None)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_local_scratch_folder_is_named_not_blamed_on_the_bucket(
    s3_server: S3Server, s3_root: str, small_tmpdir: Path
) -> None:
    options = s3_server.options()
    model = torch.nn.Linear(64, 64)
    fastckpt.save_checkpoint(s3_root, models={"m": (model, None)}, storage_options=options)
    filler = small_tmpdir / "fill"
    subprocess.run(["fallocate", "-l", "1m", str(filler)], check=True)

    with pytest.raises(ScratchSpaceError) as caught:
        fastckpt.save_checkpoint(s3_root, models={"m": (model, None)}, storage_options=options)
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC
    assert str(small_tmpdir) in message and "TMPDIR" in message
    assert "prune" not in message and "s3:/" + s3_root[len("s3://") :] not in message

    filler.unlink()
    assert (
        fastckpt.save_checkpoint(s3_root, models={"m": (model, None)}, storage_options=options) == 1
    )
    assert fastckpt.verify(s3_root, storage_options=options).ok
