"""A commit record's put whose answer is lost: the store may have applied it.

fastckpt reads the record back to decide. Applied (it holds this save's bytes): the save
committed, nothing it wrote is deleted. Not applied: the save fails and cleans up. Unreadable:
the save fails with ``CommitOutcomeUnknownError`` and deletes nothing the record may name.
Every byte goes through a fault-injecting proxy (tests/s3_fault_proxy.py) to a real moto
server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt.manager import LocalFileSystemStorageConfig
from fastckpt.storage.s3.errors import CommitOutcomeUnknownError, EndpointUnreachableError
from s3_fault_proxy import Fault, FaultProxy
from s3_support import S3Server, s3_root, s3_server

__all__ = ["s3_root", "s3_server"]


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.endpoint)
    yield proxy
    proxy.close()


def _options(server: S3Server, proxy: FaultProxy) -> dict[str, Any]:
    # Few, quick retries: a read-back that cannot get through fails within seconds.
    return server.options(
        endpoint_url=proxy.endpoint, max_retries=1, retry_timeout_s=2, read_timeout_s=2
    )


def _manager(options: dict[str, Any]) -> fastckpt.CheckpointManager:
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(storage_options=options)
    return fastckpt.CheckpointManager(config)


def _save_root(root: str, model: torch.nn.Module, step: int, options: dict[str, Any]) -> int:
    return fastckpt.save_checkpoint(
        root, models={"m": model}, counters={"step": step}, storage_options=options
    )


def _assert_manager_holds(path: str, options: dict[str, Any], step: int) -> None:
    """The manager checkpoint ``path`` loads ``{"x": full(1000, step), "step": step}`` and
    verifies."""
    with _manager(options) as manager:
        state = manager.load(path)
    assert state["step"] == step and torch.equal(state["x"], torch.full((1000,), float(step)))
    assert fastckpt.verify(path, storage_options=options).ok


def _fault(proxy: FaultProxy, fault: Fault) -> Fault:
    with proxy.lock:
        proxy.faults.append(fault)
    return fault


def test_a_root_manifest_applied_without_an_answer_is_a_committed_save(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    options = _options(s3_server, proxy)
    model = torch.nn.Linear(8, 8)
    _save_root(s3_root, model, 1, options)
    with torch.no_grad():
        model.weight.add_(1.0)
    lost = _fault(proxy, Fault("PUT", "/manifest.json", "lose_reply"))
    # Was: EndpointUnreachableError, and the objects the applied manifest names deleted
    # (index 1 listed, FileNotFoundError at load).
    assert _save_root(s3_root, model, 2, options) == 1
    assert lost.hits == 1
    assert fastckpt.verify(s3_root, storage_options=options).ok
    loaded = fastckpt.load_checkpoint(s3_root, storage_options=options)
    assert loaded["manifest"]["counters"] == {"step": 2}
    assert torch.equal(loaded["models"]["m"]["model"].weight, model.weight)


def test_a_manager_record_applied_without_an_answer_is_a_committed_save(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    options = _options(s3_server, proxy)
    path = f"{s3_root}/step"
    with _manager(options) as manager:
        manager.save(path, {"x": torch.full((1000,), 1.0), "step": 1})
        lost = _fault(proxy, Fault("PUT", "/step/commit.json", "lose_reply"))
        # Was: EndpointUnreachableError with the new generation deleted under the applied
        # record and the old one unnamed: neither step loaded.
        manager.save(path, {"x": torch.full((1000,), 2.0), "step": 2})
        assert lost.hits == 1
    _assert_manager_holds(path, options, 2)


def test_a_record_whose_put_and_read_back_both_fail_keeps_what_it_may_name(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    options = _options(s3_server, proxy)
    path = f"{s3_root}/step"
    with _manager(options) as manager:
        manager.save(path, {"x": torch.full((1000,), 1.0), "step": 1})
        lost = _fault(proxy, Fault("PUT", "/step/commit.json", "lose_reply"))
        unreadable = _fault(proxy, Fault("GET", "/step/commit.json", "cut", times=None, after=lost))
        with pytest.raises(CommitOutcomeUnknownError, match=r"commit\.json") as raised:
            manager.save(path, {"x": torch.full((1000,), 2.0), "step": 2})
        assert "nothing it wrote is deleted" in str(raised.value)
        assert unreadable.hits >= 1
        with proxy.lock:
            proxy.faults.clear()
    # The store did apply it: the checkpoint it names is whole.
    _assert_manager_holds(path, options, 2)


def test_a_record_put_cut_before_the_store_saw_it_is_put_once_more_and_commits(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    # The record is read back (the old one) and put again on the same condition: a first put
    # still in flight could then no longer land unnoticed; this one never reached the store.
    options = _options(s3_server, proxy)
    model = torch.nn.Linear(8, 8)
    _save_root(s3_root, model, 1, options)
    cut = _fault(proxy, Fault("PUT", "/manifest.json", "cut"))
    assert _save_root(s3_root, model, 2, options) == 1
    assert cut.hits == 1
    assert fastckpt.load_checkpoint(s3_root, storage_options=options)["manifest"]["counters"] == {
        "step": 2
    }
    assert fastckpt.verify(s3_root, storage_options=options).ok


def test_a_record_put_that_never_gets_through_fails_keeping_the_last_checkpoint(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    options = _options(s3_server, proxy)
    model = torch.nn.Linear(8, 8)
    _save_root(s3_root, model, 1, options)
    _fault(proxy, Fault("PUT", "/manifest.json", "cut", times=None))
    with pytest.raises(CommitOutcomeUnknownError, match="failed twice"):
        _save_root(s3_root, model, 2, options)
    with proxy.lock:
        proxy.faults.clear()
    rows = fastckpt.list_checkpoints(s3_root, storage_options=options)
    assert [row["index"] for row in rows] == [0]
    assert fastckpt.verify(s3_root, storage_options=options).ok
    prefix = s3_root.split("/", 3)[3]
    client = s3_server.client()
    kept = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/1/")
    assert kept.get("KeyCount", 0) > 0  # the outcome was unknown: nothing it wrote deleted
    # The next save commits past the index in doubt (a late put must not name another
    # save's objects there); the save after it clears them, no record naming them.
    assert fastckpt.save_checkpoint(s3_root, models={"m": model}, storage_options=options) == 2
    assert fastckpt.save_checkpoint(s3_root, models={"m": model}, storage_options=options) == 3
    assert fastckpt.verify(s3_root, storage_options=options).ok
    left = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/1/")
    assert left.get("KeyCount", 0) == 0


def test_a_failure_removing_what_a_committed_record_replaced_keeps_the_save(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    # Before: the sweep of the replaced generation (after commit.json was put) failed, the
    # save's clean-up deleted the new generation the record names, and the id loaded
    # neither checkpoint (also for a promotion to an s3:// durable tier).
    options = _options(s3_server, proxy)
    path = f"{s3_root}/step"
    with _manager(options) as manager:
        manager.save(path, {"x": torch.full((1000,), 1.0), "step": 1})
        committed = _fault(proxy, Fault("PUT", "/step/commit.json", "pass"))
        _fault(proxy, Fault("GET", f"/{s3_server.bucket}", "cut", times=None, after=committed))
        manager.save(path, {"x": torch.full((1000,), 2.0), "step": 2})
        with proxy.lock:
            proxy.faults.clear()
    _assert_manager_holds(path, options, 2)


def test_a_dropped_connection_of_a_multipart_listing_is_a_typed_error(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    # Before: AttributeError ('NoneType' object has no attribute 'get') from the error
    # translation of botocore's connection errors, which carry response=None.
    options = _options(s3_server, proxy)
    _fault(proxy, Fault("GET", f"/{s3_server.bucket}", "cut", times=None, query="uploads"))
    with _manager(options) as manager, pytest.raises(EndpointUnreachableError):
        manager.save(f"{s3_root}/step", {"x": torch.zeros(10)})


def test_a_record_put_again_is_put_only_while_the_lease_holds(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy
) -> None:
    # The second put of a record (after a failed first one) came without a lease check: a
    # writer whose first attempt outlasted its lease, which another writer took over
    # meanwhile, committed over that writer's root. Here the lease is taken over while the
    # first put fails (another client writes the lock object).
    from fastckpt.storage.s3.errors import LeaseLostError

    options = _options(s3_server, proxy)
    model = torch.nn.Linear(8, 8)
    _save_root(s3_root, model, 1, options)
    prefix = s3_root.split("/", 3)[3]
    client = s3_server.client()

    def another_writer_takes_the_lease() -> None:
        client.put_object(
            Bucket=s3_server.bucket, Key=f"{prefix}/.fastckpt.lock", Body=b'{"owner": "other"}'
        )

    cut = _fault(proxy, Fault("PUT", "/manifest.json", "cut"))
    _fault(proxy, Fault("GET", "/manifest.json", another_writer_takes_the_lease, after=cut))
    with pytest.raises(LeaseLostError):
        _save_root(s3_root, model, 2, options)
    with proxy.lock:
        proxy.faults.clear()
    client.delete_object(Bucket=s3_server.bucket, Key=f"{prefix}/.fastckpt.lock")
    rows = fastckpt.list_checkpoints(s3_root, storage_options=options)
    assert [row["index"] for row in rows] == [0]


@pytest.mark.parametrize("index", [None, 1], ids=["next", "explicit"])
def test_a_manifest_put_delivered_late_never_names_another_saves_objects(
    s3_server: S3Server, s3_root: str, proxy: FaultProxy, index: int | None
) -> None:
    """Save 1's manifest put is held in the network past the timeouts (its outcome unknown)
    and delivered later; save 2, slower, took index 1 again, deleted and rewrote save 1's
    objects there, and the late put then committed index 1 naming save 1's checksums over
    save 2's bytes: the newest index never verified again. Now save 2 takes index 2: the late
    put names save 1's intact objects (and save 2 meets the changed manifest), or save 2
    commits first and the late put is refused; either way every committed index verifies.
    A save naming the index in doubt (``checkpoint_index=1``) first puts the manifest, which
    voids the late put's condition, then rewrites it."""
    import time

    stall = 4.0
    options = s3_server.options(
        endpoint_url=proxy.endpoint, max_retries=1, retry_timeout_s=2, read_timeout_s=1
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    assert _save_root(s3_root, model, 0, options) == 0
    with torch.no_grad():
        model.weight.add_(1)
    saved = {1: model.weight.detach().clone()}
    proxy.faults.append(Fault("PUT", "/manifest.json", lambda: time.sleep(stall), times=None))
    with pytest.raises(CommitOutcomeUnknownError):
        _save_root(s3_root, model, 1, options)
    proxy.faults.clear()
    # Save 2's tensor upload outlasts the held put, which lands first.
    proxy.faults.append(Fault("PUT", "/models/m.safetensors", lambda: time.sleep(stall + 2)))
    with torch.no_grad():
        model.weight.add_(1)
    saved[2] = model.weight.detach().clone()
    try:
        saved_at: int | None = fastckpt.save_checkpoint(
            s3_root,
            models={"m": model},
            counters={"step": 2},
            checkpoint_index=index,
            storage_options=options,
        )
    except FileExistsError:  # the manifest changed under it: save 1's put landed first
        saved_at = None
    # The next index is never 1 again (before: 1, over save 1's objects).
    assert saved_at in ((None, 2) if index is None else (None, 1))
    time.sleep(2 * stall)  # every held request has been delivered
    plain = s3_server.options()
    report = fastckpt.verify(s3_root, storage_options=plain)
    assert report.ok, report
    rows = fastckpt.list_checkpoints(s3_root, storage_options=plain)
    step = rows[-1]["counters"]["step"]
    assert (rows[-1]["index"], step) in ((1, 1), (2, 2), (1, 2))
    restored = fastckpt.load_checkpoint(s3_root, storage_options=plain)
    assert restored["manifest"]["counters"]["step"] == step
    assert torch.equal(restored["models"]["m"]["model"].weight, saved[step])
