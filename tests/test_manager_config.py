"""CheckpointManager.Config as a torch_checkpointing user writes it: build(), validation,
strict attributes, finalize callbacks, prewarm_staging, use_mmap, and the fields fastckpt's
threaded design cannot honour (refused with the reason, never silently ignored)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt.format.records import read_commit_record
from fastckpt.manager import (
    AsyncCheckpointSaverConfig,
    CheckpointLoaderConfig,
    CheckpointManager,
    CheckpointStagerConfig,
    CheckpointWriterConfig,
    ItemSpec,
    LocalFileSystemStorageConfig,
    SyncCheckpointSaverConfig,
)


def cpu_async_config() -> Any:
    return CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(
            staging_config=CheckpointStagerConfig(
                use_pinned_memory=False, use_non_blocking_copy=False
            ),
            wait_timeout_secs=30,
        )
    )


def payload() -> dict[str, Any]:
    return {"model": {"w": torch.arange(1000, dtype=torch.float32)}, "step": 10}


# --------------------------------------------------------------------------- build and defaults


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_build_returns_a_manager_that_round_trips(tmp_path: Path, kind: str) -> None:
    config = CheckpointManager.Config.with_sync_save() if kind == "sync" else cpu_async_config()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    manager = config.build()
    assert isinstance(manager, CheckpointManager) and manager.config is config
    with manager:
        result = manager.save(tmp_path / "c", payload())
        if kind == "async":
            assert result is not None
            result.result(timeout=30)
        else:
            assert result is None
        loaded = manager.load(tmp_path / "c", into={"model": {"w": torch.zeros(1000)}, "step": 0})
    assert torch.equal(loaded["model"]["w"], payload()["model"]["w"]) and loaded["step"] == 10


def test_defaults_follow_the_reference_where_they_mean_the_same() -> None:
    config = CheckpointManager.Config()
    assert isinstance(config.save, AsyncCheckpointSaverConfig)
    assert config.save.wait_timeout_secs == 600
    assert config.load.use_mmap is True
    staging = config.save.staging_config
    assert staging.use_pinned_memory == torch.cuda.is_available()
    assert staging.use_non_blocking_copy == torch.cuda.is_available()
    assert staging.use_async_staging and not staging.use_shared_memory
    assert config.save.writer_config.checkpoint_write_barrier_timeout_sec == 600
    assert AsyncCheckpointSaverConfig(wait_timeout_secs=None).wait_timeout_secs is None
    assert isinstance(CheckpointManager.Config.with_sync_save().save, SyncCheckpointSaverConfig)
    assert not isinstance(AsyncCheckpointSaverConfig(), SyncCheckpointSaverConfig)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: AsyncCheckpointSaverConfig(wait_timeout_secs=-1), "wait_timeout_secs"),
        (lambda: SyncCheckpointSaverConfig(wait_timeout_secs=-0.5), "wait_timeout_secs"),
        (lambda: CheckpointWriterConfig(file_write_max_threads=0), "file_write_max_threads"),
        (
            lambda: CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=0),
            "checkpoint_write_barrier_timeout_sec",
        ),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(make: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make()


def test_fields_are_checked_when_assigned_later_too() -> None:
    config = cpu_async_config()
    with pytest.raises(ValueError, match=r"wait_timeout_secs must be a finite .* \(None: no"):
        config.save.wait_timeout_secs = -1
    assert config.save.wait_timeout_secs == 30  # unchanged
    with pytest.raises(ValueError, match="file_write_max_threads"):
        config.save.writer_config.file_write_max_threads = 0
    with pytest.raises(TypeError, match="file_write_max_threads"):
        config.save.writer_config.file_write_max_threads = 2.5
    with pytest.raises(TypeError, match="use_mmap"):
        config.load.use_mmap = "yes"
    with pytest.raises(TypeError, match=r"Config.save"):
        config.save = CheckpointLoaderConfig()
    with pytest.raises(TypeError, match=r"Config.items\['model'\]"):
        config.items = {"model": {"requires_copy": False}}
    with pytest.raises(TypeError, match=r"finalize_callback.*callable"):
        config.finalize_callback = "print"
    with pytest.raises(TypeError, match="takes neither"):  # failed only at the first save
        config.finalize_callback = lambda a, b, c: None
    config.finalize_callback = lambda checkpoint_id, logger, extra=None: None  # two: fine
    with pytest.raises(TypeError, match=r"CheckpointManager.Config"):
        CheckpointManager({"save": None})  # type: ignore[arg-type]


def test_unknown_attributes_are_refused_with_the_closest_field() -> None:
    """A typo must not silently add an attribute nobody reads."""
    config = CheckpointManager.Config()
    with pytest.raises(
        AttributeError,
        match=r"^CheckpointManager\.Config has no field 'finalize_calback'.*'finalize_callback'",
    ):
        config.finalize_calback = print
    with pytest.raises(AttributeError, match="use_pinned_memory"):
        config.save.staging_config.use_pinned_mem = True  # type: ignore[union-attr]
    with pytest.raises(AttributeError, match="requires_copy"):
        ItemSpec().require_copy = False
    with pytest.raises(TypeError, match="unexpected keyword"):
        CheckpointWriterConfig(max_threads=4)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: CheckpointStagerConfig(use_shared_memory=True), "thread.*shared memory"),
        (lambda: AsyncCheckpointSaverConfig(process_config=object()), "no process"),
        (lambda: CheckpointWriterConfig(barrier_config=object()), "gloo"),
        (lambda: CheckpointWriterConfig(temp_dir_prefix=".staging-"), "'.tmp-'.*prune"),
        (lambda: ItemSpec(resharder=object()), "resharded"),
        (lambda: ItemSpec(layout="flat"), "not supported"),
        (lambda: CheckpointManager.Config(subprocess_init_fn=print), "no\\s+subprocess"),
        (lambda: CheckpointManager.Config(subprocess_init_args=(1,)), "no\\s+subprocess"),
    ],
)
def test_fields_fastckpt_cannot_honour_are_refused_with_the_reason(make: Any, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        make()


# --------------------------------------------------------------------------- callbacks


def test_sync_finalize_callback_runs_once_the_checkpoint_is_durable(tmp_path: Path) -> None:
    calls: list[tuple[str, Any, bool, int]] = []
    target = str(tmp_path / "sync")

    def finalize(checkpoint_id: str, logger: Any) -> None:
        # The checkpoint is committed and loads, verified, from inside the callback.
        step = CheckpointManager(CheckpointManager.Config.with_sync_save()).load(checkpoint_id)
        calls.append(
            (checkpoint_id, logger, (Path(checkpoint_id) / "commit.json").is_file(), step["step"])
        )

    config = CheckpointManager.Config.with_sync_save()
    config.finalize_callback = finalize
    with config.build() as manager:
        assert manager.save(target, payload()) is None
        assert len(calls) == 1  # before save returned
    checkpoint_id, logger, committed, step = calls[0]
    assert checkpoint_id == target and committed and step == 10
    assert isinstance(logger, logging.Logger)


def test_pre_finalize_callback_runs_before_the_checkpoint_is_visible(tmp_path: Path) -> None:
    seen: list[bool] = []
    config = CheckpointManager.Config.with_sync_save()
    config.pre_finalize_callback = lambda cid, _: seen.append(Path(cid).exists())
    config.finalize_callback = lambda cid, _: seen.append(Path(cid).exists())
    with config.build() as manager:
        manager.save(tmp_path / "c", payload())
    assert seen == [False, True]


def test_files_a_pre_finalize_callback_writes_belong_to_the_checkpoint(tmp_path: Path) -> None:
    """A file the callback writes into the staging directory was committed but not listed:
    ``verify`` did not check it, and the next save of the id refused it as the user's."""
    from fastckpt.container.verify import verify

    config = CheckpointManager.Config.with_sync_save()
    config.pre_finalize_callback = lambda args: (Path(args.path) / "run.yaml").write_text("lr: 1")
    with config.build() as manager:
        manager.save(tmp_path / "latest", payload())
        assert "run.yaml" in read_commit_record(tmp_path / "latest")["files"]
        manager.save(tmp_path / "latest", payload())  # replaced with the checkpoint
    (tmp_path / "latest" / "run.yaml").write_text("lr: 2")
    report = verify(tmp_path / "latest")
    assert [f.path.name for f in report.failures] == ["run.yaml"]


def test_async_finalize_callback_runs_on_the_writer_thread_before_the_future(
    tmp_path: Path,
) -> None:
    seen: list[tuple[str, bool]] = []

    def finalize(checkpoint_id: str, _logger: Any) -> None:
        seen.append(
            (threading.current_thread().name, (Path(checkpoint_id) / "commit.json").is_file())
        )

    config = cpu_async_config()
    config.finalize_callback = finalize
    with config.build() as manager:
        future = manager.save(tmp_path / "a", payload())
        assert future is not None
        future.result(timeout=30)
        assert len(seen) == 1  # the Future resolves after the callback
    thread, committed = seen[0]
    assert thread != threading.current_thread().name and committed


def test_a_failing_async_finalize_callback_is_reported_like_a_write_failure(
    tmp_path: Path,
) -> None:
    def finalize(checkpoint_id: str, _logger: Any) -> None:
        raise OSError(f"could not upload {checkpoint_id}")

    config = cpu_async_config()
    config.finalize_callback = finalize
    manager = config.build()
    future = manager.save(tmp_path / "a", payload())
    assert future is not None
    with pytest.raises(OSError, match="could not upload"):
        future.result(timeout=30)
    # Raised once: the future delivered it, so the next save does not raise it again.
    config.finalize_callback = None
    future = manager.save(tmp_path / "b", payload())  # the manager stays usable
    assert future is not None
    future.result(timeout=30)
    manager.close()


def test_a_failing_sync_finalize_callback_raises_from_save(tmp_path: Path) -> None:
    config = CheckpointManager.Config.with_sync_save()

    def finalize(checkpoint_id: str, _logger: Any) -> None:
        raise ValueError("rejected")

    config.finalize_callback = finalize
    with config.build() as manager, pytest.raises(ValueError, match="rejected"):
        manager.save(tmp_path / "s", payload())


# --------------------------------------------------------------------------- prewarm_staging


def test_prewarm_staging_allocates_the_buffers_the_first_save_reuses(tmp_path: Path) -> None:
    config = cpu_async_config()
    config.items = {"frozen": ItemSpec(requires_copy=False)}
    state: dict[str, Any] = {
        "model": {"w": torch.randn(256, 256)},
        "frozen": {"e": torch.randn(512)},
        "step": 1,
    }
    with config.build() as manager:
        stager: Any = manager._stager
        images: Any = manager._images
        assert stager.nbytes == 0 and images.nbytes == 0
        manager.prewarm_staging(state)
        # Only the requires_copy item is staged: 256 KiB, so into a file image (its header
        # region and alignment padding on top), not into per-tensor buffers.
        assert set(images.images) == {"model"} and stager.nbytes == 0
        assert images.nbytes == 4096 + 256 * 256 * 4
        buffer = images.images["model"].buffer.data_ptr()
        future = manager.save(tmp_path / "c", state)
        assert future is not None
        future.result(timeout=30)
        # No allocation at the first save.
        assert images.allocations == 1 and images.images["model"].buffer.data_ptr() == buffer
        assert stager.allocations == 0
        loaded = manager.load(tmp_path / "c")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])


def test_prewarm_staging_checks_keys_like_save_and_is_nothing_for_sync(tmp_path: Path) -> None:
    config = cpu_async_config()
    config.default = None
    with config.build() as manager, pytest.raises(KeyError, match="strict mode"):
        manager.prewarm_staging({"model": torch.zeros(2)})
    with CheckpointManager.Config.with_sync_save().build() as manager:
        manager.prewarm_staging(payload())  # sync saves write the live tensors: no buffers
        assert manager._stager.nbytes == 0
    closed = cpu_async_config().build()
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.prewarm_staging(payload())


# --------------------------------------------------------------------------- use_mmap


def mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("use_mmap", [True, False])
def test_use_mmap_decides_whether_loaded_tensors_map_the_file(
    tmp_path: Path, use_mmap: bool
) -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.load = CheckpointLoaderConfig(use_mmap=use_mmap)
    with config.build() as manager:
        manager.save(tmp_path / "c", payload())
        loaded = manager.load(tmp_path / "c")
        assert torch.equal(loaded["model"]["w"], payload()["model"]["w"])
        assert mapped(tmp_path / "c" / "model.safetensors") == use_mmap


# --------------------------------------------------------------------------- barrier timeout

BARRIER_SCRIPT = """
import os, sys, time, torch, torch.distributed as dist
from pathlib import Path
from fastckpt import CheckpointManager
from fastckpt.manager import CheckpointWriterConfig
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
config = CheckpointManager.Config.with_sync_save()
config.save.writer_config = CheckpointWriterConfig(checkpoint_write_barrier_timeout_sec=1)
manager = config.build()  # the manager's gloo group is made at the first save, collectively
done = Path(sys.argv[1] + ".rank0-done")
if rank == 0:
    try:
        manager.save(sys.argv[1], {"w": torch.zeros(2)})
        print("saved")
    except RuntimeError as err:
        print("failed:", str(err))
    done.write_text("x")
else:
    while not done.exists():  # rank 1 never joins the save
        time.sleep(0.05)
    print("skipped")
sys.stdout.flush()
os._exit(0)
"""


def test_the_barrier_timeout_bounds_how_long_ranks_wait_for_each_other(tmp_path: Path) -> None:
    """Rank 1 never takes part in the save: rank 0 gives up after the configured 1 s instead of
    the default 600 s (with the default, this test would hang until run_two_ranks' limit)."""
    from training_support import run_two_ranks

    rank0, rank1 = run_two_ranks(BARRIER_SCRIPT, tmp_path / "c", tmp_path / "pg")
    assert rank0.startswith("failed:"), rank0
    assert "checkpoint_write_barrier_timeout_sec (1 s)" in rank0, rank0
    assert "was not committed" in rank0
    assert rank1.strip() == "skipped"
    assert not (tmp_path / "c" / "commit.json").exists()


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_a_timeout_must_be_a_finite_number_of_seconds(value: float) -> None:
    """``inf`` and ``nan`` passed validation and broke the next save (an OverflowError from
    the clock, or an immediate "still running after nan s"); None is the way to say no limit."""
    config = CheckpointManager.Config.with_async_save()
    with pytest.raises(ValueError, match="finite number of seconds"):
        config.save.wait_timeout_secs = value
    with pytest.raises(ValueError, match="finite number of seconds"):
        AsyncCheckpointSaverConfig(wait_timeout_secs=value)


def test_declared_items_are_enforced_at_load_as_at_save(tmp_path: Path) -> None:
    """``ItemSpec.required`` and strict mode (``Config.default = None``) did nothing at load:
    a required item absent from the checkpoint left its template as it was (a resume with an
    uninitialised EMA), and ``into=`` could name undeclared items."""
    from fastckpt.errors import CheckpointMismatchError

    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as writer:
        writer.save(tmp_path / "s1", {"model": {"w": torch.ones(3)}})
    config = CheckpointManager.Config.with_sync_save()
    config.items = {"model": ItemSpec(), "ema": ItemSpec()}
    config.default = None
    ema = torch.full((3,), 7.0)
    with CheckpointManager(config) as manager:
        with pytest.raises(CheckpointMismatchError, match=r"required item\(s\) \['ema'\]"):
            manager.load(tmp_path / "s1", into={"model": {"w": torch.zeros(3)}, "ema": ema})
        with pytest.raises(CheckpointMismatchError, match="not in the checkpoint"):
            manager.load(tmp_path / "s1")
        with pytest.raises(KeyError, match="strict mode"):
            manager.load(tmp_path / "s1", into={"model": None, "ema": ema, "other": 1})
        # A subset of the items is still loaded (a weights-only or evaluation load).
        assert list(manager.load(tmp_path / "s1", into={"model": None})) == ["model"]
    assert torch.equal(ema, torch.full((3,), 7.0))
    # A sharded checkpoint (here one process's DCP save through fastckpt's writer) alike.
    import warnings

    import torch.distributed.checkpoint as dcp

    import fastckpt.dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "single process"
        dcp.save(
            {"model": {"w": torch.ones(3)}}, storage_writer=fastckpt.dcp.Writer(tmp_path / "d")
        )
    sharded = CheckpointManager(config)
    with sharded, pytest.raises(CheckpointMismatchError, match=r"required item\(s\) \['ema'\]"):
        sharded.load(tmp_path / "d", into={"model": {"w": torch.zeros(3)}, "ema": ema})
    config.items = {"model": ItemSpec(), "ema": ItemSpec(required=False)}
    with CheckpointManager(config) as manager:
        loaded = manager.load(tmp_path / "s1", into={"model": {"w": torch.zeros(3)}, "ema": ema})
        assert torch.equal(loaded["model"]["w"], torch.ones(3)) and loaded["ema"] is ema
    # A plain load() refuses undeclared items too (before: returned them; only into= refused).
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as writer:
        writer.save(tmp_path / "s2", {"model": {"w": torch.ones(3)}, "lr": 0.1})
    with CheckpointManager(config) as manager:
        with pytest.raises(KeyError, match=r"\['lr'\] have no ItemSpec .*strict mode"):
            manager.load(tmp_path / "s2")
        assert list(manager.load(tmp_path / "s2", into={"model": None})) == ["model"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": {"w": torch.ones(3)}, "lr": 0.1},
            storage_writer=fastckpt.dcp.Writer(tmp_path / "d2"),
        )
    with CheckpointManager(config) as manager, pytest.raises(KeyError, match=r"\['lr'\]"):
        manager.load(tmp_path / "d2")


def test_an_item_spec_put_into_items_in_place_is_checked_at_save(tmp_path: Path) -> None:
    """``config.items["model"] = {...}`` changes the dict in place, past the assignment check:
    the save raised a bare AttributeError from inside fastckpt."""
    config = CheckpointManager.Config.with_sync_save()
    config.items["model"] = {"requires_copy": False}  # type: ignore[assignment]
    with config.build() as manager, pytest.raises(TypeError, match=r"items\['model'\] must"):
        manager.save(tmp_path / "c", payload())
    assert not (tmp_path / "c").exists()


def test_fields_read_at_build_refuse_changes_and_the_wait_timeout_is_read_live(
    tmp_path: Path,
) -> None:
    """A field the manager read when it was built (the saver, staging, writer threads,
    storage, tiers) took a later assignment and ignored it (``save`` kept returning Futures
    after a switch to a sync saver); ``wait_timeout_secs`` set to 0 still waited."""
    import time

    config = cpu_async_config()
    config.pre_finalize_callback = lambda args: time.sleep(1.0)
    with config.build() as manager:
        for change in (
            lambda: setattr(config, "save", SyncCheckpointSaverConfig()),
            lambda: setattr(config.save.staging_config, "use_async_staging", False),
            lambda: setattr(config.save.writer_config, "file_write_max_threads", 1),
            lambda: setattr(config, "storage_config", LocalFileSystemStorageConfig()),
        ):
            with pytest.raises(AttributeError, match="read when a CheckpointManager was built"):
                change()
        config.items = {"model": ItemSpec(), "step": ItemSpec()}  # read at each save: fine
        first = manager.save(tmp_path / "a", payload())
        config.save.wait_timeout_secs = 0
        with pytest.raises(TimeoutError):
            manager.save(tmp_path / "b", payload())
        first.result(timeout=30)
    assert not (tmp_path / "b").exists()
    config.save = SyncCheckpointSaverConfig()  # its manager is closed: the next one reads it
    with config.build() as manager:
        assert manager.save(tmp_path / "c", payload()) is None
