"""An ``s3://`` save whose local scratch folder (``TMPDIR``) is full.

An incremental save reads the previous index's headers through a sparse scratch file in the
local temporary folder. Before, that folder being full gave "No space left on device while
saving s3:/bucket/..." (the URL mangled into a local path), blamed the checkpoint and advised
``fastckpt prune``, which deletes checkpoints from the bucket and frees nothing locally. Now it
is a ``ScratchSpaceError`` naming the local folder and the fix; the bucket is untouched and
the save succeeds once the folder has room.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import fastckpt
from fastckpt.storage.access import ScratchSpaceError
from fastckpt.storage.s3.backend import parse_header
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


def test_a_header_written_in_part_to_a_nearly_full_scratch_folder_is_no_damage(
    small_tmpdir: Path, tmp_path: Path
) -> None:
    """Review of the first version: the unbuffered scratch file stored part of a large
    header (32 KiB free), the rest was left as the sparse file's zeros, and a healthy object
    was reported as damaged ("malformed header ... invalid JSON"). Every byte is written now,
    or the folder's refusal raised."""
    source = tmp_path / "big.safetensors"
    save_file({f"layer{i}.weight_with_a_long_name": torch.zeros(2) for i in range(3000)}, source)
    data = source.read_bytes()
    header = data[: 8 + int.from_bytes(data[:8], "little")]
    assert len(header) > 100_000
    filler = small_tmpdir / "fill"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):
        while True:
            os.write(descriptor, b"\1" * 4096)
    os.close(descriptor)
    os.truncate(filler, filler.stat().st_size - 32768)
    with pytest.raises(ScratchSpaceError, match="scratch folder"):
        parse_header(header, len(data), "s3://bucket/ckpt/0/models/m.safetensors")
    filler.unlink()
    parsed = parse_header(header, len(data), "s3://bucket/ckpt/0/models/m.safetensors")
    assert len(parsed["tensors"]) == 3000
