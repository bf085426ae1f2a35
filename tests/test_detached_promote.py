"""The detached promoter: each promotion runs in a process of its own (a new session) that a
killed trainer leaves running, so the durable tier gets the checkpoint without a next process.

Real processes: the trainer is a subprocess in its own process group, killed with SIGKILL
sent to that whole group (as a scheduler or a Ctrl-C reaches a job); the promoter it started is
never touched by the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support
from fastckpt.container.detached import promoter_from_spec
from fastckpt.container.promote import Promoter
from fastckpt.errors import PromotionError
from fastckpt.format.records import Manifest
from fastckpt.storage.registry import configure_storage
from s3_support import S3Server, s3_server

__all__ = ["s3_server"]  # a fixture used by name below

#: The trainer: saves one index (64 MiB of weights) into FAST, submits its promotion to
#: DURABLE with a detached promoter, prints the promoter's pid as soon as it has its job
#: ("None" if that was never seen: the test fails instead of hanging) and sleeps until
#: killed.
_TRAINER = """
import sys, time, torch, fastckpt
from fastckpt.container.promote import Promoter
fast, durable = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
torch.save(model.state_dict(), sys.argv[3])
fastckpt.save_checkpoint(fast, models={"main": (model, None)})
promoter = Promoter(fast, durable, detached=True)
promoter.submit()  # nothing else runs until the hand-over is seen (a 1 ms poll)
deadline = time.monotonic() + 60
while promoter.detached_pid is None and time.monotonic() < deadline:
    time.sleep(0.001)
print(promoter.detached_pid, flush=True)
time.sleep(600)
"""


def _files(root: str | Path, index: int) -> dict[str, tuple[int, int]]:
    entry = Manifest.load(root).entries[index]
    return {name: (r["size"], r["crc32c"]) for name, r in entry["files"].items()}


def _committed(root: Path) -> list[int]:
    try:
        return sorted(Manifest.load(root).entries)
    except FileNotFoundError:
        return []


def _kill_trainer_mid_promotion(
    script: str, tmp_path: Path, committed: Callable[[], list[Any]]
) -> Path:
    """Run the trainer ``script`` (FAST DURABLE WANT) in its own process group; once it
    printed its detached promoter's pid, SIGKILL the whole group. Checks that nothing was
    committed yet and that the promoter lived on, then waits (up to 2 minutes) until
    ``committed()`` lists something; returns WANT (the trainer's saved weights)."""
    fast, durable, want = tmp_path / "fast", tmp_path / "durable", tmp_path / "want.pt"
    trainer = subprocess.Popen(
        [sys.executable, "-c", script, str(fast), str(durable), str(want)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, killed whole below
    )
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline().strip()
        assert line.isdigit(), f"the trainer never saw its promoter's hand-over: {line!r}"
        promoter_pid = int(line)
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait()
    # Killed before the promotion committed anything; the promoter lives on.
    assert committed() == []
    os.kill(promoter_pid, 0)  # raises ProcessLookupError if it had died with the trainer
    deadline = time.monotonic() + 120
    while not committed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert committed(), "the detached promoter did not finish"
    return want


def test_a_killed_trainer_leaves_its_detached_promoter_to_finish(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    want_path = _kill_trainer_mid_promotion(_TRAINER, tmp_path, lambda: _committed(durable))
    assert _committed(durable) == [0]
    assert _files(durable, 0) == _files(fast, 0)
    assert fastckpt.verify(durable).ok
    want = torch.load(want_path)
    got = fastckpt.load_checkpoint(durable)["models"]["main"]["model"].state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_a_hook_with_detached_promotion_promotes_and_is_rebuilt_with_it(tmp_path: Path) -> None:
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    hook = fastckpt.CheckpointHook(
        fast,
        step_interval=1,
        durable_dir=durable,
        promote_every=2,
        durable_keep_last=2,
        detached_promotion=True,
    )
    strategy = training_support.new_strategy([hook], num_steps=6)
    strategy.run(training_support.loader())
    assert hook.promotion_healthy and hook.promoter is not None
    assert hook.promoter.detached_pid is None  # none left running after close
    assert [c["index"] for c in fastckpt.list_checkpoints(durable)] == [2, 4]
    assert hook.promoter.target_newest == 4
    for index in (2, 4):
        assert _files(durable, index) == _files(fast, index)
    assert fastckpt.verify(durable).ok
    assert hook.hook_config()["detached_promotion"] is True
    resumed = fastckpt.TrainingStrategy.load_checkpoint(
        durable, training_fn=training_support.training_fn
    )
    (rebuilt,) = [h for h in resumed.hooks if isinstance(h, fastckpt.CheckpointHook)]
    assert rebuilt.promoter is not None and rebuilt.promoter.detached


def test_a_failing_detached_promotion_is_reported_with_its_cause(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    (tmp_path / "file").write_text("not a directory")
    durable = tmp_path / "file" / "durable"  # every promotion fails: its parent is a file
    fastckpt.save_checkpoint(fast, models={"main": (torch.nn.Linear(4, 4), None)})
    errors: list[PromotionError] = []
    promoter = Promoter(fast, durable, detached=True, on_error=errors.append)
    with pytest.warns(RuntimeWarning, match="training goes on"):
        promoter.submit()
        promoter.wait()
    assert not promoter.healthy and len(errors) == 1
    assert "detached promoter" in str(errors[0]) and "NotADirectoryError" in str(errors[0])
    with pytest.raises(PromotionError, match="durable"):
        promoter.close()
    assert _committed(fast) == [0]


def test_the_detached_process_gets_the_object_store_options(
    s3_server: S3Server, tmp_path: Path
) -> None:
    # The durable tier's endpoint and credentials exist only in this process's registry
    # (configure_storage): the detached process is handed them, and promotes to the server.
    fast, durable = tmp_path / "fast", f"s3://{s3_server.bucket}/detached"
    fastckpt.save_checkpoint(fast, models={"main": (torch.nn.Linear(64, 64), None)})
    configure_storage(durable, s3_server.options())
    try:
        promoter = Promoter(fast, durable, detached=True)
        spec = promoter.spec()
        assert [o["endpoint_url"] for o in spec["storage_options"].values()] == [s3_server.endpoint]
        promoter.submit()
        promoter.close()
        assert promoter.promoted == [0] and promoter.target_newest == 0
        assert _files(durable, 0) == _files(fast, 0)
        assert fastckpt.verify(durable).ok
    finally:
        configure_storage(durable)  # this test's registration only
    # The spec makes the same promoter again (the detached process's side of it).
    again = promoter_from_spec(json.loads(json.dumps(spec)))
    assert (again.source, again.target, again.every) == (promoter.source, promoter.target, 1)
    configure_storage(durable)


#: A CheckpointManager trainer with detached tiers: saves step_0 to FAST (TiersConfig
#: promoting to DURABLE), prints the detached promoter's pid and sleeps until killed.
_MANAGER_TRAINER = """
import sys, time, torch, fastckpt
from fastckpt.manager import CheckpointManager, TiersConfig
fast, durable = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
config = CheckpointManager.Config.with_sync_save()
config.tiers = TiersConfig(fast=fast, durable=durable, detached=True)
manager = CheckpointManager(config)
torch.save(model.state_dict(), sys.argv[3])
manager.save("step_0", {"model": model})  # then nothing else until the hand-over is seen
deadline = time.monotonic() + 60
while manager.promoter.detached_pid is None and time.monotonic() < deadline:
    time.sleep(0.001)
print(manager.promoter.detached_pid, flush=True)
time.sleep(600)
"""


def test_a_killed_manager_leaves_its_detached_tier_promotion_to_finish(tmp_path: Path) -> None:
    from fastckpt.container.promote_checkpoints import committed_checkpoints

    durable = tmp_path / "durable"
    want_path = _kill_trainer_mid_promotion(
        _MANAGER_TRAINER, tmp_path, lambda: committed_checkpoints(durable)
    )
    assert committed_checkpoints(durable) == ["step_0"]
    assert fastckpt.verify(durable / "step_0").ok
    want = torch.load(want_path)
    with fastckpt.CheckpointManager() as manager:
        got = manager.load(str(durable / "step_0"))["model"]
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_manager_tiers_promote_detached_every_nth_save(tmp_path: Path) -> None:
    from fastckpt.container.promote_checkpoints import committed_checkpoints
    from fastckpt.manager import CheckpointManager, TiersConfig

    fast, durable = tmp_path / "fast", tmp_path / "durable"
    config = CheckpointManager.Config.with_async_save()
    config.tiers = TiersConfig(
        fast=fast, durable=durable, promote_every=2, durable_keep_last=2, detached=True
    )
    model = torch.nn.Linear(32, 32)
    with CheckpointManager(config) as manager:
        for step in range(6):
            with torch.no_grad():
                model.weight.add_(1.0)
            future = manager.save(f"step_{step}", {"model": model, "step": step})
            if future is not None:
                future.result()
        assert manager.promoter is not None and manager.promoter.detached
    assert manager.promotion_healthy
    assert committed_checkpoints(durable) == ["step_2", "step_4"]
    assert manager.promoter.promoted == ["step_0", "step_2", "step_4"]
    assert manager.promoter.queued() == []
    for name in ("step_2", "step_4"):
        assert fastckpt.verify(durable / name).ok


def test_the_detached_benchmark_runs(tmp_path: Path) -> None:
    # The harness at a toy size (its figures come from `python -m fastckpt.bench.detached`).
    from fastckpt.bench import detached

    assert detached.main(["--size-mib", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "detached-2mib.json").read_text())
    cases = [(row["what"], row["promoter"]) for row in document["rows"]]
    assert cases == [
        ("promotion", "trainer thread"),
        ("promotion", "detached process"),
        ("after a kill", "trainer thread"),
        ("after a kill", "detached process"),
    ]
    assert all(row["seconds"]["median"] > 0 for row in document["rows"])
    assert "after a kill | detached process" in (tmp_path / "detached-2mib.md").read_text()


@pytest.mark.parametrize("durable_kind", ["local", "s3"])
def test_a_detached_promotion_of_plain_indices_does_not_import_torch(
    durable_kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # What a detached promotion costs is mostly its process start: importing torch would
    # add seconds to every promotion (it did, through the sharded-record decoder, and for
    # s3:// through the object-store backend's tensor modules).
    fast = tmp_path / "fast"
    fastckpt.save_checkpoint(fast, models={"main": (torch.nn.Linear(8, 8), None)})
    durable: str | Path = tmp_path / "durable"
    if durable_kind == "s3":
        server: S3Server = request.getfixturevalue("s3_server")
        durable = server.url("no-torch")
        configure_storage(durable, server.options())
    spec = Promoter(fast, durable, keep_last=1).spec()
    script = (
        "import json, sys\n"
        "from fastckpt.container.detached import promoter_from_spec\n"
        "outcome = promoter_from_spec(json.loads(sys.argv[1])).run_here()\n"
        "print(json.dumps([outcome, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(spec)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    outcome, imported_torch = json.loads(done.stdout)
    assert outcome == {"promoted": [0], "target_newest": 0, "damaged": []} and not imported_torch


@pytest.mark.parametrize(
    "setting",
    [
        {"detached_promotion": True},
        {"promote_every": 5},
        {"durable_keep_last": 2},
        {"strict_promotion": True},
    ],
)
def test_promotion_settings_without_a_durable_tier_are_refused(
    tmp_path: Path, setting: dict[str, Any]
) -> None:
    # They would configure nothing: a hook that was meant to promote and does not is
    # refused at construction, naming the setting.
    (name,) = setting
    with pytest.raises(ValueError, match=f"{name}.*durable_dir"):
        fastckpt.CheckpointHook(tmp_path / "fast", step_interval=1, **setting)
