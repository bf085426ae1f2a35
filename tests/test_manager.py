"""CheckpointManager: the tutorial workflow, snapshot consistency, into= semantics, failures,
memory, distributed."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt import CheckpointMismatchError, InvalidInputError
from fastckpt.manager import CheckpointManager, CheckpointStagerConfig, ItemSpec
from training_support import run_two_ranks

REPO = Path(__file__).resolve().parents[1]

# The tutorial's complete example with the import changed. Two lines had to change too, because
# they are CUDA-only by construction: the CUDA check and the device (this test runs on CPU).
TUTORIAL = textwrap.dedent(
    """
    import re
    from pathlib import Path

    import torch
    from fastckpt import CheckpointManager


    STEP_DIRECTORY = re.compile(r"step_(\\d+)")


    def latest_checkpoint(root: Path) -> str | None:
        if not root.is_dir():
            return None

        latest_step = -1
        latest_path: Path | None = None
        for candidate in root.iterdir():
            match = STEP_DIRECTORY.fullmatch(candidate.name)
            if not candidate.is_dir() or match is None:
                continue
            step = int(match.group(1))
            if step > latest_step:
                latest_step = step
                latest_path = candidate
        return str(latest_path) if latest_path is not None else None


    def main() -> None:
        device = torch.device("cpu")
        model = torch.nn.Linear(8, 1).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        checkpoint_root = Path(ROOT)

        manager = CheckpointManager(CheckpointManager.Config.with_async_save())
        try:
            start_step = 0
            resume_from = latest_checkpoint(checkpoint_root)
            if resume_from is not None:
                restored = manager.load(
                    resume_from,
                    into={
                        "model": model.state_dict(),
                        "optimizer": None,
                        "step": 0,
                    },
                )
                optimizer.load_state_dict(restored["optimizer"])
                start_step = int(restored["step"]) + 1
            print("START", start_step)

            for step in range(start_step, 1_000):
                inputs = torch.randn(32, 8, device=device)
                loss = model(inputs).square().mean()
                loss.backward()

                with manager.lock():
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)

                if step % 100 == 0:
                    manager.save(
                        str(checkpoint_root / f"step_{step}"),
                        {
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "step": step,
                        },
                    )
                    if step == 900:
                        print("WEIGHT900", model.weight.sum().item())
        finally:
            manager.close()


    main()  # no __name__ guard: the writer is a thread, not a spawned process
    """
)


def test_tutorial_example_runs_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "tutorial.py"
    script.write_text(TUTORIAL.replace("ROOT", repr(str(tmp_path / "ckpts"))))
    first = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=300
    )
    assert "START 0" in first.stdout
    saved_sum = float(first.stdout.split("WEIGHT900")[1].split()[0])
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == sorted(
        f"step_{s}" for s in range(0, 1000, 100)
    )
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        restored = manager.load(str(tmp_path / "ckpts" / "step_900"))
    assert restored["step"] == 900
    assert restored["model"]["weight"].sum().item() == pytest.approx(saved_sum, abs=0)
    assert restored["optimizer"]["state"][0]["step"].item() == 901
    second = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, timeout=300
    )
    assert "START 901" in second.stdout


@pytest.mark.parametrize("async_staging", [True, False])
def test_snapshot_holds_pre_mutation_values(tmp_path: Path, async_staging: bool) -> None:
    config = CheckpointManager.Config.with_async_save()
    config.save.staging_config = CheckpointStagerConfig(  # type: ignore[union-attr]
        use_pinned_memory=False, use_async_staging=async_staging, use_non_blocking_copy=False
    )
    weights = torch.arange(4 << 20, dtype=torch.float32)
    original = weights.clone()
    with CheckpointManager(config) as manager:
        future = manager.save(tmp_path / "ckpt", {"model": {"w": weights}})
        with manager.lock():
            weights.add_(1.0)  # the optimizer step, right after save() returned
        assert future is not None
        future.result()
        loaded = manager.load(tmp_path / "ckpt")
    assert torch.equal(loaded["model"]["w"], original)


def test_into_semantics(tmp_path: Path) -> None:
    state = {
        "model": {"w": torch.ones(2, 3), "b": torch.zeros(3)},
        "nested": {"list": [torch.full((2,), 5.0), {"x": 1}], "name": "run"},
        "step": 7,
    }
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        assert manager.save(tmp_path / "c", state) is None
        live_w = torch.empty(2, 3)
        template = {"model": {"w": live_w}, "nested": {"list": [torch.empty(2)]}, "step": 0}
        restored = manager.load(tmp_path / "c", into=template)
        assert restored["model"]["w"] is live_w and torch.equal(live_w, torch.ones(2, 3))
        assert "b" not in restored["model"]  # only the template's keys are loaded
        assert torch.equal(restored["nested"]["list"][0], torch.full((2,), 5.0))
        assert restored["step"] == 7
        whole = manager.load(tmp_path / "c", into={"nested": None})
        assert whole == {"nested": {"list": [whole["nested"]["list"][0], {"x": 1}], "name": "run"}}
        # Missing keys: kept from the template unless strict.
        lenient = manager.load(tmp_path / "c", into={"model": {"missing": 3}, "absent": 1})
        assert lenient == {"model": {"missing": 3}, "absent": 1}
        with pytest.raises(CheckpointMismatchError, match=r"model\.missing"):
            manager.load(tmp_path / "c", into={"model": {"missing": 3}}, strict=True)
        with pytest.raises(CheckpointMismatchError, match=r"model\.w.*float64"):
            manager.load(
                tmp_path / "c", into={"model": {"w": torch.empty(2, 3, dtype=torch.float64)}}
            )
        with pytest.raises(CheckpointMismatchError, match=r"model\.b.*\(3,\).*\(1,\)|model\.b"):
            manager.load(tmp_path / "c", into={"model": {"b": torch.empty(1)}})


def test_optimizer_state_reapplied(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "c", {"optimizer": optimizer.state_dict()})
        restored = manager.load(tmp_path / "c", into={"optimizer": None})
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(restored["optimizer"])
    assert fresh.param_groups[0]["betas"] == (0.8, 0.9)
    assert torch.equal(
        fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_a_reserved_tensor_name_is_refused_by_save_itself(tmp_path: Path) -> None:
    # Before: an async save() accepted it; the writer failed later and the next, valid
    # save raised a RuntimeError naming no key path.
    manager = CheckpointManager()
    with pytest.raises(InvalidInputError, match=r"^model\.__metadata__: .*reserved"):
        manager.save(tmp_path / "a", {"model": {"__metadata__": torch.ones(1), "w": torch.ones(2)}})
    assert not (tmp_path / "a").exists()
    future = manager.save(tmp_path / "b", {"model": {"w": torch.ones(2)}})
    assert future is not None
    future.result()
    manager.close()
    with CheckpointManager() as reader:
        assert torch.equal(reader.load(tmp_path / "b")["model"]["w"], torch.ones(2))


def test_a_checkpoint_inside_another_checkpoint_is_refused(tmp_path: Path) -> None:
    # Before: a forgotten /step_N made runs/ a checkpoint, and later saves nested inside it
    # (even as its reserved "linked" folder), where its next save would delete them.
    from fastckpt.errors import NotACheckpointError

    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "runs", {"model": torch.ones(2)})
        for inner in ("step_1", "linked", "a/b"):
            with pytest.raises(NotACheckpointError, match=r"is inside the checkpoint .*runs"):
                manager.save(tmp_path / "runs" / inner, {"model": torch.ones(2)})
        assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
            "commit.json", "model.json", "model.safetensors"
        ]  # fmt: skip
        manager.save(tmp_path / "runs", {"model": torch.zeros(2)})  # replacing it still works
        # A project's own manifest.json / commit.json above a save path is not a checkpoint.
        (tmp_path / "project").mkdir()
        (tmp_path / "project" / "manifest.json").write_text('{"name": "my-project"}')
        (tmp_path / "project" / "commit.json").write_text('{"sha": "abc"}')
        manager.save(tmp_path / "project" / "runs" / "step_1", {"model": torch.ones(2)})
        fastckpt_root = tmp_path / "root"
        import fastckpt

        fastckpt.save_checkpoint(fastckpt_root, models={"m": torch.nn.Linear(1, 1)})
        with pytest.raises(NotACheckpointError, match=r"manifest\.json"):
            manager.save(fastckpt_root / "0" / "mgr", {"model": torch.ones(2)})


def test_replacing_a_checkpoint_is_atomic_and_keys_are_checked(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "c", {"a": torch.zeros(2)})
        manager.save(tmp_path / "c", {"b": torch.ones(2)})
        assert list(manager.load(tmp_path / "c")) == ["b"]
        with pytest.raises(ValueError, match="not a valid name"):
            manager.save(tmp_path / "d", {"../evil": torch.zeros(1)})
        assert not (tmp_path / "d").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    strict = CheckpointManager.Config.with_sync_save()
    strict.default = None
    strict.items = {"model": ItemSpec()}
    with CheckpointManager(strict) as manager, pytest.raises(KeyError, match="strict"):
        manager.save(tmp_path / "e", {"model": {}, "other": 1})


def test_closed_manager_refuses_and_close_is_idempotent(tmp_path: Path) -> None:
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    manager.save(tmp_path / "c", {"x": torch.ones(1)})
    manager.close()
    manager.close()
    assert (tmp_path / "c" / "commit.json").exists()  # close waited for durability
    with pytest.raises(RuntimeError, match="closed"):
        manager.save(tmp_path / "d", {"x": torch.ones(1)})
    with pytest.raises(RuntimeError, match="closed"):
        manager.load(tmp_path / "c")
    assert not (tmp_path / "d").exists()


def test_close_on_another_thread_waits_for_a_save_being_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save on thread B reaching its background writer while thread A closes the manager:
    before, close() shut the writer down under it (``cannot schedule new futures after
    shutdown``), or the save restarted a writer close() had released and ran uncollected
    after close. Now close() waits for the hand-over, then for the write."""
    import threading
    import time

    import fastckpt
    from fastckpt.container.background import BackgroundWriter

    handing_over = threading.Event()
    submit = BackgroundWriter.submit

    def slow_submit(self: Any, *args: Any, **kwargs: Any) -> Any:
        handing_over.set()
        time.sleep(0.3)
        return submit(self, *args, **kwargs)

    def writers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("fastckpt-writer")}

    before = writers()
    monkeypatch.setattr(BackgroundWriter, "submit", slow_submit)
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    failures: list[BaseException] = []

    def save() -> None:
        try:
            future = manager.save(tmp_path / "c", {"x": torch.arange(4.0)})
            assert future is not None
            future.result()
        except BaseException as err:
            failures.append(err)

    saver = threading.Thread(target=save)
    saver.start()
    assert handing_over.wait(60)
    manager.close()
    saver.join(60)
    assert not failures, failures
    assert fastckpt.verify(tmp_path / "c").ok  # committed before close() returned
    assert writers() <= before  # no writer thread left running after close()


def test_failed_background_write_is_raised_once_then_usable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
        good = manager.save(tmp_path / "good", {"x": torch.ones(3)})
        assert good is not None
        good.result()
        bad = manager.save(blocker / "ckpt", {"x": torch.ones(3)})
        assert bad is not None
        while not bad.done():  # the Future is not asked: the next save reports the failure
            pass
        with pytest.raises(
            RuntimeError, match="previous background checkpoint write failed"
        ) as info:
            manager.save(tmp_path / "next", {"x": torch.ones(3)})
        assert isinstance(info.value.__cause__, NotADirectoryError)
        again = manager.save(tmp_path / "next", {"x": torch.full((3,), 2.0)})
        assert again is not None
        again.result()
        assert torch.equal(manager.load(tmp_path / "good")["x"], torch.ones(3))
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_timed_out_write_stays_tracked_and_its_failure_is_raised_once(
    tmp_path: Path,
) -> None:
    """A save that outwaits ``wait_timeout_secs`` names the write still in flight; that write
    is not forgotten: its failure is raised by the next save, once."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = 0.2
    manager = CheckpointManager(config)
    # another thread holds the capture lock: the background write cannot go on
    with support.held_by_another_thread(manager.lock):
        manager.save(blocker / "stuck", {"x": torch.ones(3)})
        with pytest.raises(TimeoutError, match=r"stuck.*still running") as timeout:
            manager.save(tmp_path / "next", {"x": torch.ones(3)})
        assert timeout.value.errno == errno.ETIMEDOUT
    assert not (tmp_path / "next").exists()  # nothing new was started
    with pytest.raises(RuntimeError, match="previous background checkpoint write failed") as info:
        manager.save(tmp_path / "next", {"x": torch.ones(3)})
    assert isinstance(info.value.__cause__, NotADirectoryError)
    assert "stuck" in str(info.value)
    later = manager.save(tmp_path / "next", {"x": torch.full((3,), 2.0)})
    assert later is not None
    later.result()
    manager.close()
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        assert torch.equal(reader.load(tmp_path / "next")["x"], torch.full((3,), 2.0))


def test_close_reports_the_failure_of_a_write_that_timed_out(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = 0.2
    manager = CheckpointManager(config)
    with support.held_by_another_thread(manager.lock):
        manager.save(blocker / "stuck", {"x": torch.ones(3)})
        with pytest.raises(TimeoutError, match="stuck"):
            manager.save(tmp_path / "next", {"x": torch.ones(3)})
    with pytest.raises(RuntimeError, match="previous background checkpoint write failed") as info:
        manager.close()
    assert isinstance(info.value.__cause__, NotADirectoryError)
    manager.close()  # reported once: closing again is quiet


def mount_small_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return result.returncode == 0


def test_disk_full_during_async_save(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    if not mount_small_tmpfs(disk, "8m"):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root and mount rights)")
    try:
        with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
            first = manager.save(disk / "ok", {"x": torch.ones(1 << 18)})  # 1 MiB
            assert first is not None
            first.result()
            full = manager.save(disk / "full", {"x": torch.ones(4 << 20)})  # 16 MiB
            assert full is not None
            error = full.exception()
            assert isinstance(error, OSError) and error.errno == errno.ENOSPC
            assert f"while saving {disk / 'full'}" in str(error) and "free space" in str(error)
            # Its Future delivered the failure: the next save does not raise it again.
            assert torch.equal(manager.load(disk / "ok")["x"], torch.ones(1 << 18))
            retry = manager.save(disk / "after", {"x": torch.ones(1)})
            assert retry is not None
            retry.result()
        assert sorted(p.name for p in disk.iterdir()) == ["after", "ok"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_save_retried_after_a_full_disk_is_still_incremental(tmp_path: Path) -> None:
    """A save that failed on a full disk made the manager forget its incremental base: the
    retry, once the space the failed save needed was freed, wrote every tensor again and ran
    out of space once more. A full disk says nothing about the base: the retry links the
    unchanged tensor as a save without a failure before it does."""
    disk = tmp_path / "disk"
    if not mount_small_tmpfs(disk, "3m"):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root and mount rights)")
    try:
        torch.manual_seed(0)
        state = {"a": torch.randn(256, 256), "b": torch.randn(256, 256)}  # 256 KiB each
        with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
            manager.save(disk / "step_1", state)
            changed = {"a": state["a"], "b": state["b"] + 1}
            filler = disk / "filler"
            with open(filler, "wb") as handle:  # no room at all
                info = os.statvfs(disk)
                os.posix_fallocate(handle.fileno(), 0, info.f_bavail * info.f_frsize)
            with pytest.raises(OSError) as full:
                manager.save(disk / "step_2", changed)
            assert full.value.errno == errno.ENOSPC
            filler.unlink()
            with open(filler, "wb") as handle:  # room for b (and records), not a and b
                info = os.statvfs(disk)
                os.posix_fallocate(handle.fileno(), 0, info.f_bavail * info.f_frsize - (400 << 10))
            manager.save(disk / "step_2", changed)
            assert (disk / "step_2" / "linked").is_dir()  # a linked, only b written
            loaded = manager.load(disk / "step_2")
        assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], changed["b"])
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)  # even with files open


RSS_SCRIPT = """
import gc, sys, torch
from fastckpt import CheckpointManager
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) * 1024
state = {"model": {f"w{i}": torch.randn(1 << 20) for i in range(32)}}  # 128 MiB
readings = []
with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
    for i in range(10):
        manager.save(sys.argv[1], state).result()
        gc.collect()
        readings.append(rss())
print(" ".join(map(str, readings)))
"""


def test_rss_is_flat_across_async_saves(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    readings = [int(x) for x in result.stdout.split()]
    assert len(readings) == 10
    assert max(readings[1:]) - readings[1] < 64 << 20, readings


DIST_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from fastckpt import CheckpointManager
from training_support import leave_process_group
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
    manager.save(sys.argv[1], {"model": {"w": torch.full((4,), float(rank))}, "step": 3}).result()
    dist.barrier()
    loaded = manager.load(sys.argv[1])
    assert torch.equal(loaded["model"]["w"], torch.full((4,), float(rank))), loaded
    assert loaded["step"] == 3
print("ok", rank)
leave_process_group()
"""


def test_two_ranks_write_their_own_files(tmp_path: Path) -> None:
    run_two_ranks(DIST_SCRIPT, tmp_path / "c", tmp_path / "pg")
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert "model.rank0.safetensors" in files and "model.rank1.safetensors" in files
    assert "commit.json" in files
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


PER_RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from fastckpt import CheckpointManager
from training_support import leave_process_group
path, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
    state = {"w": torch.full((2,), float(rank)), "loader": {"seen": 1000 * (rank + 1)}}
    manager.save(path, state)
    loaded = manager.load(path)
    assert loaded["loader"] == {"seen": 1000 * (rank + 1)}, loaded
    assert torch.equal(loaded["w"], state["w"])
    for other, needle in ((f"{path}-{rank}", "same checkpoint_id"), (path, "same items")):
        mine = state if other != path else {**state, **({"step": 3} if rank else {})}
        try:
            manager.save(other, mine)
        except ValueError as err:
            assert needle in str(err) and "nothing was committed" in str(err), err
        else:
            raise AssertionError(f"rank {rank}: saved {other}")
    assert manager.load(path)["loader"] == {"seen": 1000 * (rank + 1)}
    manager.save(path + "-ddp", {"w": torch.ones(2), "step": 5})  # replicated, as DDP's
print("ok", rank)
leave_process_group()
"""


def test_each_rank_gets_its_own_plain_values_and_ranks_must_agree(tmp_path: Path) -> None:
    """Under a process group only rank 0 wrote an item's plain values: rank 1 loaded rank 0's
    (a data loader's position, RNG states) without a word. Ranks naming different ids or
    items had their files committed under rank 0's id. A 2-rank checkpoint loaded in one
    process gave rank 0's state."""
    from fastckpt.errors import CheckpointMismatchError

    outputs = run_two_ranks(PER_RANK_SCRIPT, tmp_path / "c", tmp_path / "pg")
    assert [out.split() for out in outputs] == [["ok", "0"], ["ok", "1"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "c-ddp", "pg"]
    manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
    with manager:
        with pytest.raises(CheckpointMismatchError, match=r"items \['w', 'loader'\] differ"):
            manager.load(tmp_path / "c")
        # Items every rank saved alike load on another number of ranks (DDP state for eval).
        replicated = manager.load(tmp_path / "c-ddp")
        assert replicated["step"] == 5 and torch.equal(replicated["w"], torch.ones(2))


def test_sync_save_writes_cpu_tensors_without_staging_copies(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "c", {"model": model.state_dict()})
        assert manager._stager.nbytes == 0  # only device tensors are staged
        loaded = manager.load(tmp_path / "c")
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sync_save_stages_device_tensors_through_the_pinned_pool(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64).cuda()
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "c", {"model": model.state_dict()})
        assert manager._stager.nbytes == state_bytes
        loaded = manager.load(tmp_path / "c")
    assert torch.equal(loaded["model"]["weight"], model.weight.detach().cpu())


def test_loading_an_unsharded_checkpoint_does_not_import_torch_distributed_checkpoint(
    tmp_path: Path,
) -> None:
    """``load`` tells a sharded checkpoint by its record's name alone: a plain resume pays no
    ``torch.distributed.checkpoint`` import (about a second on a small machine)."""
    code = f"""
import sys, torch, fastckpt
with fastckpt.CheckpointManager() as manager:
    future = manager.save({str(tmp_path / "a")!r}, {{"x": torch.ones(3)}})
    if future is not None:
        future.result()
    assert "torch.distributed.checkpoint" not in sys.modules
    assert torch.equal(manager.load({str(tmp_path / "a")!r})["x"], torch.ones(3))
print("imported" if "torch.distributed.checkpoint" in sys.modules else "not imported")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "not imported"


def test_a_save_never_replaces_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    # save("runs/mgr") (a missing /step_N) swapped the folder of committed checkpoints for the
    # new one and deleted them; a file or a folder of data there was deleted the same way.
    from fastckpt.container.verify import verify
    from fastckpt.errors import NotACheckpointError

    mgr_dir = tmp_path / "runs" / "mgr"
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("1,2")
    (tmp_path / "empty").mkdir()
    state = {"m": {"t": torch.arange(4.0)}, "step": 1}
    for config in (
        CheckpointManager.Config.with_sync_save(),
        CheckpointManager.Config.with_async_save(),
    ):
        with CheckpointManager(config) as manager:
            for step in (10, 20):
                future = manager.save(mgr_dir / f"step_{step}", state)
                if future is not None:
                    future.result()
            for target in (mgr_dir, tmp_path / "notes.txt", tmp_path / "data"):
                with pytest.raises(NotACheckpointError, match="not a checkpoint"):
                    manager.save(target, state)
            future = manager.save(tmp_path / "empty", state)  # an empty folder is fine
            if future is not None:
                future.result()
        assert sorted(p.name for p in mgr_dir.iterdir()) == ["step_10", "step_20"]
        assert (tmp_path / "notes.txt").read_text() == "mine"
        assert (tmp_path / "data" / "train.csv").read_text() == "1,2"
        assert verify(mgr_dir / "step_20").ok and verify(tmp_path / "empty").ok


def test_a_resave_never_deletes_what_its_record_does_not_name(tmp_path: Path) -> None:
    # A re-save of a checkpoint name replaced the whole folder as soon as it held a
    # commit.json: a user's file put there, and a checkpoint saved inside it, were deleted.
    from fastckpt.errors import NotACheckpointError

    latest = tmp_path / "runs" / "latest"
    state = {"m": {"t": torch.arange(4.0)}, "step": 1}
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(latest, state)
        manager.save(latest, {**state, "step": 2})  # a checkpoint alone is replaced
        (latest / "eval_results.json").write_text('{"acc": 0.9}')
        with pytest.raises(NotACheckpointError, match="is inside the checkpoint"):
            manager.save(latest / "step_5", state)  # refused now; one copied there by hand:
        manager.save(tmp_path / "elsewhere", state)
        shutil.copytree(tmp_path / "elsewhere", latest / "step_5")
        with pytest.raises(NotACheckpointError, match=r"eval_results\.json, step_5"):
            manager.save(latest, {**state, "step": 3})
        assert (latest / "eval_results.json").read_text() == '{"acc": 0.9}'
        assert manager.load(latest / "step_5")["step"] == 1
        assert manager.load(latest)["step"] == 2
        # A damaged record leaves only names a checkpoint writes to be replaced with it.
        (latest / "commit.json").write_text("{")
        with pytest.raises(NotACheckpointError, match=r"eval_results\.json, step_5"):
            manager.save(latest, {**state, "step": 3})
        (latest / "eval_results.json").unlink()
        shutil.rmtree(latest / "step_5")
        manager.save(latest, {**state, "step": 3})
        assert manager.load(latest)["step"] == 3


@pytest.mark.timeout(60)
def test_locks_nest_and_are_shared_between_threads(tmp_path: Path) -> None:
    """``lock()`` is shared: a helper that guards its own update may run inside the caller's
    lock, and two threads hold it at once. Before, a nested ``lock()`` deadlocked forever, even
    with no save. A save started inside it on the same thread is refused: its tensors were
    copied when the lock was released (after the changes it guards), its plain values at the
    call, a checkpoint of two moments."""
    import threading

    x = torch.zeros(3)
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    try:
        with manager.lock(), manager.lock():
            x.add_(1)
        with manager.lock(), pytest.raises(RuntimeError, match="two moments"):
            # Its tensors would be copied at the release, after this add_, its values now.
            manager.save(tmp_path / "step_1", {"m": {"x": x}, "step": 1})
        x.add_(1)
        manager.save(tmp_path / "step_1", {"m": {"x": x}, "step": 2}).result(timeout=30)
        inside = threading.Barrier(2, timeout=10)

        def hold() -> None:
            with manager.lock():
                inside.wait()  # both threads inside at once, or the barrier times out

        other = threading.Thread(target=hold)
        other.start()
        hold()
        other.join()
    finally:
        manager.close()
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
        assert reader.load(tmp_path / "step_1")["m"]["x"].tolist() == [2.0] * 3


@pytest.mark.timeout(60)
def test_a_synchronous_snapshot_inside_the_lock_is_refused_not_hung(tmp_path: Path) -> None:
    """With ``use_async_staging=False`` the snapshot runs on the caller's thread, which waits
    for every lock to be released: inside its own ``lock()`` that was a deadlock forever; it
    is a RuntimeError saying to save outside the lock now, and nothing is saved."""
    config = CheckpointManager.Config.with_async_save()
    config.save.staging_config.use_async_staging = False
    x = torch.zeros(3)
    with CheckpointManager(config) as manager:
        with manager.lock(), pytest.raises(RuntimeError, match="inside its lock"):
            manager.save(tmp_path / "step_1", {"m": {"x": x}})
        manager.save(tmp_path / "step_2", {"m": {"x": x}}).result(timeout=30)
    assert not (tmp_path / "step_1").exists()
    assert (tmp_path / "step_2").is_dir()


def test_a_state_or_template_that_is_no_mapping_is_a_type_error(tmp_path: Path) -> None:
    """``save(id, [tensor])`` / ``load(id, into=[...])`` raised ``AttributeError: 'list'
    object has no attribute 'items'``: a TypeError saying what a state is, nothing written."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        with pytest.raises(TypeError, match="must be a mapping of item names"):
            manager.save(tmp_path / "step_1", [torch.zeros(2)])  # type: ignore[arg-type]
        assert not (tmp_path / "step_1").exists()
        manager.save(tmp_path / "step_2", {"x": torch.zeros(2)})
        with pytest.raises(TypeError, match="into must be a mapping"):
            manager.load(tmp_path / "step_2", into=[torch.zeros(2)])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="prewarm_staging state must be a mapping"):
            manager.prewarm_staging([torch.zeros(2)])  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_second_save_inside_the_lock_is_refused_at_once(tmp_path: Path) -> None:
    """A save another thread started waits for the lock this thread holds, so a save inside
    it would wait for that one, which waits for itself: a RuntimeError at once (before: a
    wait of the whole ``wait_timeout_secs``, then a TimeoutError advising a longer timeout).
    The first save completes when the lock is released. ``close()`` there is refused the
    same way, and the manager stays usable."""
    import threading

    x = torch.zeros(3)
    futures: list[Any] = []
    with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
        with manager.lock():
            other = threading.Thread(
                target=lambda: futures.append(manager.save(tmp_path / "step_1", {"m": {"x": x}}))
            )
            other.start()
            other.join(timeout=30)
            with pytest.raises(RuntimeError, match="wait for the previous save"):
                manager.save(tmp_path / "step_2", {"m": {"x": x}})
            # close() would wait for that save, which waits for this lock (a deadlock
            # forever before): refused, the manager still open.
            with pytest.raises(RuntimeError, match="cannot close"):
                manager.close()
        futures[0].result(timeout=30)
        manager.save(tmp_path / "step_3", {"m": {"x": x}}).result(timeout=30)
    assert (tmp_path / "step_1").is_dir() and not (tmp_path / "step_2").exists()


def test_a_name_too_long_for_the_temporary_sibling_says_what_fits(tmp_path: Path) -> None:
    """A 235-byte name (which mkdir accepts) failed with a raw ENAMETOOLONG about a hidden
    ``.tmp-...`` folder: the error names the checkpoint, its length and the longest that fits."""
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        with pytest.raises(OSError, match=r"is 235 bytes; .* names of at most \d+ bytes fit"):
            manager.save(tmp_path / ("a" * 235), {"x": torch.ones(1)})
        assert list(tmp_path.iterdir()) == []


def test_threads_sharing_an_async_manager_take_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: two threads' saves raced past the "one write tracked" check, and one failed
    # with "still tracked; collect it before starting another" (an internal method). The
    # race is widened here: each save dwells after waiting for the previous write.
    import threading
    import time

    from fastckpt.container.background import BackgroundWriter

    collect = BackgroundWriter.collect

    def slow_collect(self: BackgroundWriter[Any]) -> Any:
        result = collect(self)
        time.sleep(0.05)
        return result

    monkeypatch.setattr(BackgroundWriter, "collect", slow_collect)

    errors: list[BaseException] = []
    saved: dict[str, torch.Tensor] = {}

    def saves(thread: int) -> None:
        futures = []
        for i in range(5):
            value = torch.full((256,), float(thread * 100 + i))
            try:
                futures.append(
                    (
                        f"t{thread}_{i}",
                        value,
                        manager.save(tmp_path / f"t{thread}_{i}", {"x": value}),
                    )
                )
            except BaseException as err:
                errors.append(err)
        for name, value, future in futures:
            future.result(timeout=60)
            saved[name] = value

    with CheckpointManager(CheckpointManager.Config.with_async_save()) as manager:
        threads = [threading.Thread(target=saves, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert errors == []
        for name, value in saved.items():
            assert torch.equal(manager.load(tmp_path / name)["x"], value)
    assert len(saved) == 10


def test_a_load_of_the_id_an_async_save_is_writing_waits_for_that_write(tmp_path: Path) -> None:
    """``load(id)`` right after an async ``save(id, ...)`` read what ``id`` held before the
    write committed: the previous checkpoint's step (silently stale), or "not a committed
    fastckpt checkpoint" for a new id. Now a load of the id this manager is writing waits for
    the write; a load of another id does not wait. (The write is held in its
    ``pre_finalize_callback`` so that it is still running when ``load`` is called.)"""
    holding = threading.Event()
    release = threading.Event()

    def slow_commit(args: object) -> None:
        holding.set()
        release.wait(30)

    config = fastckpt.CheckpointManager.Config.with_async_save()
    config.pre_finalize_callback = slow_commit
    target, other = tmp_path / "ckpt", tmp_path / "other"
    with config.build() as manager:
        release.set()
        manager.save(other, {"step": 0}).result()
        manager.save(target, {"step": 1}).result()
        release.clear()
        holding.clear()
        manager.save(target, {"step": 2})
        assert holding.wait(30)
        # Another id loads at once, while the write of ``target`` is held.
        assert manager.load(other)["step"] == 0
        timer = threading.Timer(0.3, release.set)
        timer.start()
        assert manager.load(target)["step"] == 2
        timer.join()
        fresh = tmp_path / "fresh"
        release.clear()
        holding.clear()
        manager.save(fresh, {"step": 3})
        assert holding.wait(30)
        threading.Timer(0.3, release.set).start()
        assert manager.load(fresh)["step"] == 3
