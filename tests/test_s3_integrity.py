"""``s3://`` roots never turn damaged bytes into new checkpoints, and ``keep_last`` never
deletes the newest checkpoint that verifies. Against the real moto server of
``tests/s3_support.py``; objects are damaged through boto3, as any other client could."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt
from fastckpt.container.verify import verify
from fastckpt.errors import CheckpointFormatError, ChecksumMismatchError
from fastckpt.format.records import Manifest
from s3_support import S3Server, s3_env, s3_root, s3_server

__all__ = ["s3_env", "s3_root", "s3_server"]  # fixtures used by name below


class Backbone(nn.Module):
    """A frozen 16 MiB embedding (copied by the store in incremental saves: the header's part
    takes its first 5 MiB, fetched, the store copies the other 11) and a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 1024)
        self.embed.weight.requires_grad_(False)
        self.head = nn.Linear(1024, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))


def _key(root: str, index: int) -> str:
    return root.split("/", 3)[3] + f"/{index}/models/main.safetensors"


def _flip_bit(server: S3Server, key: str, tensor: str, where: float = 0.9) -> None:
    """Rewrite object ``key`` with one bit of ``tensor``'s bytes flipped (at fraction
    ``where`` of the tensor: 0.9 is inside the range the store copies)."""
    client = server.client()
    data = bytearray(client.get_object(Bucket=server.bucket, Key=key)["Body"].read())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    begin, end = header[tensor]["data_offsets"]
    data[8 + length + begin + int((end - begin) * where)] ^= 0x04
    client.put_object(Bucket=server.bucket, Key=key, Body=bytes(data))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _loaded(root: str, index: int = -1) -> dict[str, torch.Tensor]:
    result: Any = fastckpt.load_checkpoint(root, index, trusted=[Backbone])
    return dict(result["models"]["main"]["model"].state_dict())


def _step(model: Backbone, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randint(0, 4096, (4, 8))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_incremental_saves_to_s3_never_copy_rotten_bytes_forward(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    """One bit of index 0's frozen embedding changes in the store. The next incremental save
    would have the store copy that range: it proves the range first and, finding it rotten,
    fails typed (naming the object and the tensor) without committing; the saves after it
    write in full, then copy again from their own intact objects. Every kept index verifies
    and the latest loads bitwise."""
    torch.manual_seed(0)
    model = Backbone()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    _flip_bit(s3_server, _key(s3_root, 0), "embed.weight")
    failures: list[BaseException] = []
    for _ in range(3):
        _step(model, optimizer)
        try:
            fastckpt.save_checkpoint(s3_root, models={"main": model})
        except ChecksumMismatchError as err:
            failures.append(err)
        fastckpt.prune(s3_root, keep_last=2)
    assert len(failures) == 1, failures
    assert "0/models/main.safetensors" in str(failures[0]) and "embed.weight" in str(failures[0])
    report = verify(s3_root)
    assert report.ok, report.summary()
    assert sorted(Manifest.load(s3_root).entries) == [1, 2]
    got = _loaded(s3_root)
    assert all(torch.equal(got[k], v) for k, v in _state(model).items())


def test_keep_last_on_s3_never_deletes_the_newest_index_that_verifies(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(1)
    model = Backbone()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    saved = []
    for _ in range(3):
        _step(model, optimizer)
        fastckpt.save_checkpoint(s3_root, models={"main": model}, incremental=False)
        saved.append(_state(model))
    for index in (1, 2):  # rotten after they were committed
        _flip_bit(s3_server, _key(s3_root, index), "head.weight", where=0.5)
    with caplog.at_level(logging.WARNING, logger="fastckpt.container.commit"):
        assert fastckpt.prune(s3_root, keep_last=1) == [1]
    assert "keeping index 0, the newest that verifies" in caplog.text
    assert sorted(Manifest.load(s3_root).entries) == [0, 2]
    got = _loaded(s3_root, 0)
    assert all(torch.equal(got[k], v) for k, v in saved[0].items())


def test_copies_from_objects_this_process_wrote_are_not_read_back(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proof costs nothing in the normal case: an object this process wrote is pinned by
    the etag its write returned, so copying from it needs no read-back (only a source whose
    version is unknown, or was replaced, is read back and checked)."""
    from fastckpt.storage.s3 import backend as s3backend

    proofs: list[list[str]] = []
    real = s3backend.prove_copied_tensors

    def spy(client: Any, copies: Any) -> None:
        proofs.append(sorted(copies))
        real(client, copies)

    monkeypatch.setattr(s3backend, "prove_copied_tensors", spy)
    torch.manual_seed(2)
    model = Backbone()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    for _ in range(3):
        _step(model, optimizer)
        fastckpt.save_checkpoint(s3_root, models={"main": model})
    assert proofs == []
    # A source replaced by an identical object (a new etag, the same bytes) is read back,
    # proven intact, and copied from.
    client = s3_server.client()
    key = _key(s3_root, 2)
    body = client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_server.bucket, Key=key, Body=body)
    _step(model, optimizer)
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    assert proofs == [["embed.weight"]]
    report = verify(s3_root)
    assert report.ok, report.summary()
    got = _loaded(s3_root)
    assert all(torch.equal(got[k], v) for k, v in _state(model).items())


@pytest.mark.parametrize("fault", ["lost", "replaced"])
@pytest.mark.parametrize("door", ["save_checkpoint", "manager"])
def test_an_object_the_store_did_not_keep_is_never_committed(
    s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, door: str, fault: str
) -> None:
    """The store acknowledged an upload and then did not hold the object (lost, or removed
    by another process): before, ``save_checkpoint`` committed the index (an incremental save
    failing after its commit, a full one returning) and the root's newest index did not load,
    and a manager save committed a generation missing it. Now every object is looked up
    before the commit record names it: the save fails naming it, and what was committed
    before still loads. An object the store holds with another size (another process wrote
    that name, damage) is refused the same way, typed as a format error (before:
    ``FileNotFoundError``, as if it were missing)."""
    from fastckpt.storage.s3.backend import S3Staging

    model = nn.Linear(16, 16)
    manager = fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save())
    url = f"{s3_root}/{door}"

    def save(value: float) -> None:
        with torch.no_grad():
            model.weight.fill_(value)
        if door == "save_checkpoint":
            fastckpt.save_checkpoint(url, models={"main": (model, None)}, incremental=False)
        else:
            manager.save(url, {"model": model.state_dict()})

    save(1.0)
    real = S3Staging.put_tensors

    def lost(self: S3Staging, relpath: str, *args: Any, **kwargs: Any) -> Any:
        record = real(self, relpath, *args, **kwargs)
        key = self.url.key(relpath)
        if fault == "lost":
            self.backend.client.delete([key])  # acknowledged, then gone
        else:
            self.backend.client.put(key, b"another writer's bytes")
        return record

    expected = (
        pytest.raises(FileNotFoundError, match="missing after the store acknowledged its upload")
        if fault == "lost"
        else pytest.raises(
            CheckpointFormatError, match=r"22 bytes, not the \d+ this save wrote, after the store"
        )
    )
    with monkeypatch.context() as patched:
        patched.setattr(S3Staging, "put_tensors", lost)
        with expected:
            save(2.0)
    if door == "save_checkpoint":
        assert [row["index"] for row in fastckpt.list_checkpoints(url)] == [0]
        loaded = fastckpt.load_checkpoint(url)["models"]["main"]["model"].weight
    else:
        loaded = manager.load(url)["model"]["weight"]
    assert torch.equal(loaded, torch.full((16, 16), 1.0))
    assert verify(url).ok
    manager.close()
