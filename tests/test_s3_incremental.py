"""Incremental saves on ``s3://``: unchanged tensors are copied by the store (UploadPartCopy)
from the previous index's objects instead of being uploaded, every object stays a complete
safetensors file, and a load, a verify or a prune sees nothing different. Against a real moto
server; the part planner is checked exhaustively on small sizes."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastckpt
from fastckpt.container.verify import verify
from fastckpt.errors import ChecksumMismatchError
from fastckpt.storage.registry import backend_for
from fastckpt.storage.s3.client import CopyPart, DataPart, S3Client
from fastckpt.storage.s3.copy import CopiedTensor, _upload_all, plan_parts, put_tensors_copying
from fastckpt.storage.s3.tensors import put_tensors
from s3_support import S3Server, s3_env, s3_root, s3_server

__all__ = ["s3_env", "s3_root", "s3_server"]  # fixtures used by name below


# ------------------------------------------------------------------------------ part planner


def _source_bytes(key: str, start: int, end: int) -> bytes:
    """The (made-up) content of source object ``key``: each byte a function of its offset."""
    salt = 7 if key == "a" else 13
    return bytes((i * salt + (i >> 8) * 3 + salt) % 251 for i in range(start, end))


def _stream(items: list[Any]) -> bytes:
    out = bytearray()
    for item in items:
        if isinstance(item, CopyPart):
            out += _source_bytes(item.source_key, item.start, item.end)
        elif isinstance(item, tuple):
            out += _source_bytes(*item)
        elif isinstance(item, DataPart):
            out += _stream(list(item.pieces))
        else:
            out += bytes(item)
    return bytes(out)


def test_planned_parts_hold_exactly_the_segments_and_respect_the_part_sizes() -> None:
    rng = random.Random(0)
    for _ in range(500):
        segments: list[Any] = []
        for _ in range(rng.randint(1, 7)):
            n = rng.randint(0, 60)
            if rng.random() < 0.5:
                start = rng.randint(0, 100)
                segments.append(CopyPart(rng.choice("ab"), start, start + n))
            else:
                segments.append(np.frombuffer(rng.randbytes(n), dtype=np.uint8))
        parts = plan_parts(segments, data_part=16, min_part=10, max_part=40)
        assert _stream(parts) == _stream(segments)
        sizes = [part.nbytes for part in parts]
        assert all(size >= 10 for size in sizes[:-1]), sizes
        assert all(0 < size <= 40 for size in sizes), sizes


def test_a_run_of_copies_too_short_for_a_part_is_fetched_and_a_long_one_is_copied() -> None:
    header = np.zeros(100, dtype=np.uint8)
    parts = plan_parts(
        [header, CopyPart("old", 1000, 1030), np.ones(10, np.uint8), CopyPart("old", 5000, 5500)],
        data_part=200,
        min_part=150,
        max_part=10_000,
    )
    # The header, the short copy (fetched) and the small buffer, topped up to 150 bytes with
    # the first bytes of the long copy; the rest of the long copy is copied.
    assert isinstance(parts[0], DataPart) and parts[0].nbytes == 150
    assert parts[0].pieces[1] == ("old", 1000, 1030)
    assert parts[0].pieces[-1] == ("old", 5000, 5010)
    assert parts[1] == CopyPart("old", 5010, 5500)
    assert len(parts) == 2


# ------------------------------------------------------------------------------ one object


def _client(root: str) -> tuple[S3Client, str]:
    backend: Any = backend_for(root)
    return backend.client, root.split("/", 3)[3]


def test_a_composed_object_is_byte_for_byte_the_uploaded_one(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str]
) -> None:
    client, prefix = _client(s3_root)
    gen = torch.Generator().manual_seed(0)
    state = {
        "frozen": torch.randn(3 << 20, generator=gen),  # 12 MiB
        "also_frozen": torch.randn(6 << 18, generator=gen).half(),  # 3 MiB
        "trained": torch.randn(1000, generator=gen),
        "step": torch.tensor(3),
    }
    first = put_tensors(client, f"{prefix}/old.safetensors", state)
    header = client.get_range(f"{prefix}/old.safetensors", 0, 8)
    data_start = 8 + int.from_bytes(header, "little")
    info = backend_for(s3_root).read_header(Path(f"{s3_root}/old.safetensors"))
    copies = {}
    for name in ("frozen", "also_frozen"):
        begin, end = info["tensors"][name]["data_offsets"]
        entry = info["tensors"][name]
        copies[name] = CopiedTensor(
            f"{prefix}/old.safetensors",
            data_start + begin,
            data_start + end,
            entry["dtype"],
            entry["shape"],
            entry["crc32c"],
        )
    changed = {"trained": state["trained"] + 1, "step": torch.tensor(4)}
    report = put_tensors_copying(client, f"{prefix}/new.safetensors", changed, copies)
    expected = put_tensors(client, f"{prefix}/expected.safetensors", {**state, **changed})
    # The header's part is filled up to 5 MiB with the start of "frozen" (fetched); the store
    # copies the rest (7 MiB plus the header's length). "also_frozen" (3 MiB, after the small
    # "trained") is fetched to fill the part "trained" starts.
    assert (7 << 20) < report["copied_bytes"] <= (7 << 20) + 4096
    assert (report["size"], report["crc32c"]) == (expected["size"], expected["crc32c"])
    new = client.get_range(f"{prefix}/new.safetensors", 0, report["size"])
    assert new == client.get_range(f"{prefix}/expected.safetensors", 0, expected["size"])
    assert first["checksums"]["frozen"] == report["checksums"]["frozen"]

    # A store without UploadPartCopy gets the same object uploaded whole (copies fetched).
    parts = plan_parts(
        [
            client.get_range(f"{prefix}/new.safetensors", 0, data_start),
            CopyPart(f"{prefix}/new.safetensors", data_start, report["size"]),
        ],
        data_part=client.options.part_size,
    )
    _upload_all(client, f"{prefix}/whole.safetensors", parts, report["size"])
    assert client.get_range(f"{prefix}/whole.safetensors", 0, report["size"]) == new


# ------------------------------------------------------------------------------ front doors


class Backbone(nn.Module):
    """A frozen 16 MiB embedding and a small trained head (the header's part takes the first
    5 MiB of the embedding, fetched: the store copies the other 11)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 1024)
        self.embed.weight.requires_grad_(False)
        self.head = nn.Linear(1024, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))


@pytest.fixture
def copy_spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes each composed upload had the store copy (the real call still runs)."""
    copied: list[int] = []
    real = S3Client.compose

    def compose(self: S3Client, key: str, parts: Any) -> None:
        copied.append(sum(p.nbytes for p in parts if isinstance(p, CopyPart)))
        real(self, key, parts)

    monkeypatch.setattr(S3Client, "compose", compose)
    yield copied


def test_save_checkpoint_on_s3_copies_the_frozen_bytes_and_prunes_safely(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], copy_spy: list[int]
) -> None:
    torch.manual_seed(0)
    model = Backbone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    expected = []
    for _ in range(3):
        model(torch.randint(0, 4096, (4, 8))).sum().backward()
        optimizer.step()
        fastckpt.save_checkpoint(s3_root, models={"main": model}, optimizers={"sgd": optimizer})
        expected.append({k: v.clone() for k, v in model.state_dict().items()})
    # The first save uploads everything; the next two have the store copy the embedding.
    assert len(copy_spy) == 2 and all(n >= 8 << 20 for n in copy_spy), copy_spy
    for index, state in enumerate(expected):
        loaded = fastckpt.load_checkpoint(s3_root, index, trusted=[Backbone])
        got = loaded["models"]["main"]["model"].state_dict()
        assert all(torch.equal(got[k], v) for k, v in state.items()), index
    assert verify(s3_root).ok
    # Every object is complete: deleting the older indices leaves the newest loadable.
    fastckpt.prune(s3_root, keep_last=1)
    loaded = fastckpt.load_checkpoint(s3_root, trusted=[Backbone])
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected[-1].items())
    assert verify(s3_root).ok


def test_an_incremental_save_on_s3_whose_source_was_replaced_fails_typed_then_saves_in_full(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], copy_spy: list[int]
) -> None:
    torch.manual_seed(1)
    model = Backbone()
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    # Someone rewrites the committed object behind fastckpt's back: the embedding's checksum
    # in its header no longer is the one the tracker knows.
    key = s3_root.split("/", 3)[3] + "/0/models/main.safetensors"
    client = s3_server.client()
    with torch.no_grad():
        model.head.weight.add_(1)
    tampered = dict(model.state_dict())
    tampered["embed.weight"] = torch.zeros_like(tampered["embed.weight"])
    fastckpt.save_file(tampered, "tampered.safetensors")
    client.put_object(
        Bucket=s3_server.bucket, Key=key, Body=Path("tampered.safetensors").read_bytes()
    )
    with pytest.raises(ChecksumMismatchError, match="replaced"):
        fastckpt.save_checkpoint(s3_root, models={"main": model})
    # The failed save made the next one full: nothing copied, and it loads.
    copy_spy.clear()
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    assert copy_spy == []
    loaded = fastckpt.load_checkpoint(s3_root, trusted=[Backbone])
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def test_a_source_replaced_during_the_stores_copy_fails_the_save(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source object is replaced after its version was proven and before the store copies
    from it. moto ignores the copy's If-Match (as some stores do) and copies the new bytes;
    the save checked nothing after the copy and committed an object whose recorded crc32c
    did not describe its bytes. Now the sources' versions are read again after the copy."""
    torch.manual_seed(2)
    model = Backbone()
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    key = s3_root.split("/", 3)[3] + "/0/models/main.safetensors"
    client = s3_server.client()
    real = S3Client._control
    replaced: list[str] = []

    class Replacing:
        """The boto3 client, replacing the source before the first part the store copies."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def upload_part_copy(self, **kwargs: Any) -> Any:
            if not replaced:
                obj = client.get_object(Bucket=s3_server.bucket, Key=key)
                body = bytearray(obj["Body"].read())
                body[12 << 20] ^= 1  # inside the embedding's copied (not fetched) range
                client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(body))
                replaced.append(kwargs["CopySourceRange"])
            return self.inner.upload_part_copy(**kwargs)

    def control(self: S3Client, **kwargs: Any) -> Any:
        return Replacing(real(self, **kwargs))

    monkeypatch.setattr(S3Client, "_control", control)
    with torch.no_grad():
        model.head.weight.add_(1)
    with pytest.raises(ChecksumMismatchError, match="replaced while an incremental save"):
        fastckpt.save_checkpoint(s3_root, models={"main": model})
    assert replaced and [c["index"] for c in fastckpt.list_checkpoints(s3_root)] == [0]
    monkeypatch.setattr(S3Client, "_control", real)
    fastckpt.save_checkpoint(s3_root, models={"main": model})  # full: nothing to copy from
    loaded = fastckpt.load_checkpoint(s3_root, trusted=[Backbone])
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def test_hook_async_saves_to_s3_copy_the_frozen_backbone_and_resume_exactly(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], copy_spy: list[int]
) -> None:
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        (ids,) = batch
        return model(ids).square().mean()

    def job(hooks: list[Any], steps: int) -> fastckpt.TrainingStrategy:
        torch.manual_seed(2)
        return fastckpt.TrainingStrategy(
            Backbone(),
            fastckpt.OptimizerConfig(torch.optim.AdamW, {"lr": 1e-2}),
            training_fn=loss,
            hooks=hooks,
            num_steps=steps,
        )

    ids = torch.randint(0, 4096, (24, 8), generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(ids), batch_size=4)
    hook = fastckpt.CheckpointHook(s3_root, step_interval=2, async_save=True)
    strategy = job([hook], 6)
    strategy.run(loader)
    assert len(copy_spy) >= 2 and all(n >= 8 << 20 for n in copy_spy), copy_spy
    resumed = fastckpt.TrainingStrategy.load_checkpoint(s3_root, training_fn=loss)
    assert resumed.step_count == 6
    final = strategy.models["main"].state_dict()
    got = resumed.models["main"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in final.items())
    assert verify(s3_root).ok


def test_manager_async_saves_to_sibling_s3_ids_copy_unchanged_tensors(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], copy_spy: list[int]
) -> None:
    frozen = torch.randn(3 << 20, generator=torch.Generator().manual_seed(4))  # 12 MiB
    trained = torch.zeros(1000)
    config = fastckpt.CheckpointManager.Config.with_async_save()
    expected = []
    with fastckpt.CheckpointManager(config) as manager:
        for step in range(3):
            with manager.lock():
                trained.add_(1.0)
            expected.append(trained.clone())
            state = {"model": {"frozen": frozen, "trained": trained}, "step": step}
            future = manager.save(f"{s3_root}/step{step}", state)
            assert future is not None
            future.result()
        # 12 MiB unchanged: 5 MiB fetched to fill the header's part, 7 copied by the store.
        assert len(copy_spy) == 2 and all(n >= 7 << 20 for n in copy_spy), copy_spy
        # Every id is complete on its own: drop the first two, the last still loads whole.
        client = s3_server.client()
        prefix = s3_root.split("/", 3)[3]
        for step in range(2):
            listing = client.list_objects_v2(
                Bucket=s3_server.bucket, Prefix=f"{prefix}/step{step}/"
            )
            for item in listing.get("Contents", []):
                client.delete_object(Bucket=s3_server.bucket, Key=item["Key"])
        loaded = manager.load(f"{s3_root}/step2")
    assert torch.equal(loaded["model"]["frozen"], frozen)
    assert torch.equal(loaded["model"]["trained"], expected[2])
    assert verify(f"{s3_root}/step2").ok


def test_a_manager_save_whose_base_id_is_deleted_in_flight_writes_in_full(
    s3_server: S3Server,
    s3_root: str,
    s3_env: dict[str, str],
    copy_spy: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The previous id is deleted (``aws s3 rm --recursive``) after this save proved its
    tensors unchanged and before the store copies them: the save failed with
    ``ObjectNotFoundError`` naming the deleted object. It writes those tensors now, from the
    bytes whose digest was compared, and the new id loads whole."""
    from fastckpt.manager.incremental import LinkPlan

    frozen = torch.randn(3 << 20, generator=torch.Generator().manual_seed(6))  # 12 MiB
    client = s3_server.client()
    prefix = s3_root.split("/", 3)[3]
    real = LinkPlan.link

    def link(self: LinkPlan, writer: Any, key: str, tensors: Any, stem: str) -> Any:
        listing = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/step0/")
        for item in listing.get("Contents", []):
            client.delete_object(Bucket=s3_server.bucket, Key=item["Key"])
        return real(self, writer, key, tensors, stem)

    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(f"{s3_root}/step0", {"model": {"frozen": frozen}, "step": 0})
        monkeypatch.setattr(LinkPlan, "link", link)
        m.save(f"{s3_root}/step1", {"model": {"frozen": frozen}, "step": 1})
        assert copy_spy == []  # nothing left to copy from
        loaded = m.load(f"{s3_root}/step1")
    assert torch.equal(loaded["model"]["frozen"], frozen) and loaded["step"] == 1
    assert verify(f"{s3_root}/step1").ok


def test_deleting_an_earlier_s3_index_object_by_object_leaves_the_newest_loading(
    s3_server: S3Server, s3_root: str, s3_env: dict[str, str], copy_spy: list[int]
) -> None:
    """What `aws s3 rm --recursive ROOT/0/` does, behind fastckpt's back: the newer index
    holds its own copy of every unchanged byte (copied by the store, not uploaded), so it
    loads bitwise and verifies."""
    torch.manual_seed(5)
    model = Backbone()
    fastckpt.save_checkpoint(s3_root, models={"main": model})
    fastckpt.save_checkpoint(s3_root, models={"main": model})  # nothing changed
    client = s3_server.client()
    prefix = s3_root.split("/", 3)[3]
    key = f"{prefix}/1/models/main.safetensors"
    size = client.head_object(Bucket=s3_server.bucket, Key=key)["ContentLength"]
    # Less than half of the second save's bytes were uploaded: the store copied the rest.
    assert len(copy_spy) == 1 and copy_spy[0] > size / 2, (copy_spy, size)
    listing = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/0/")
    assert listing.get("Contents")
    for item in listing["Contents"]:
        client.delete_object(Bucket=s3_server.bucket, Key=item["Key"])
    loaded = fastckpt.load_checkpoint(s3_root, 1, trusted=[Backbone])
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    assert verify(s3_root, 1).ok
    # The newest index deleted the same way: the next save writes what it would have had the
    # store copy from it (before: ObjectNotFoundError naming the deleted object, no save).
    for item in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/1/")["Contents"]:
        client.delete_object(Bucket=s3_server.bucket, Key=item["Key"])
    with torch.no_grad():
        model.head.weight.add_(1)
    assert fastckpt.save_checkpoint(s3_root, models={"main": model}) == 2
    loaded = fastckpt.load_checkpoint(s3_root, 2, trusted=[Backbone])
    got = loaded["models"]["main"]["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    assert verify(s3_root, 2).ok
