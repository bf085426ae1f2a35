"""Issue 22, "never silently wrong": async saves pending when the interpreter exits, failures
reported exactly once and with their own type, hostile strategy/hooks JSON through
``TrainingStrategy``, and record reads under an address-space limit.

Real processes and real files: each exit test runs a child Python that saves in the background
and ends without ``close()``; the test then reads what is on disk and what the child printed.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
import training_support as support
from fastckpt import CheckpointManager, EMAHook, TrainingStrategy
from fastckpt.errors import CheckpointFormatError, FastCkptError
from fastckpt.format.records import MANIFEST, Manifest, seal_manifest
from fastckpt.storage.s3.errors import AccessDeniedError
from s3_support import S3Server, no_aws_env, s3_root, s3_server

__all__ = ["no_aws_env", "s3_root", "s3_server"]  # fixtures used by name below

TESTS = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- exit without close

# A training loop saving asynchronously at steps 10, 20, 30 and 40, then ending without
# close(). Before the last save the child lengthens the interpreter's thread switch interval,
# so the main thread reaches interpreter shutdown before the writer thread runs again: the
# race an ordinary script loses now and then becomes deterministic.
MANAGER_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    from fastckpt import CheckpointManager

    root, last = sys.argv[1], sys.argv[2]
    config = CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = float(sys.argv[3])
    if sys.argv[4] == "slow":
        def slow(checkpoint_id, logger):
            if checkpoint_id.endswith("step_40"):
                time.sleep(3)
        config.pre_finalize_callback = slow
    model = torch.nn.Linear(64, 64)
    manager = CheckpointManager(config)
    for step in range(10, 41, 10):
        with manager.lock():
            torch.nn.init.constant_(model.weight, float(step))
        path = f"{root}/step_{step}" if step < 40 else last
        if step == 40:
            sys.setswitchinterval(30.0)
        manager.save(path, {"model": model.state_dict(), "step": step})
    print("loop done", flush=True)
    """
)

# The same with a CheckpointHook driven by hand (entered, never exited).
HOOK_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, TESTS)
    import training_support as support
    from fastckpt import CheckpointHook

    root, last = sys.argv[1], sys.argv[2]
    hook = CheckpointHook(root, step_interval=10, async_save=True)
    strategy = support.new_strategy([hook], num_steps=40)
    hook.__enter__()  # the background writer starts; nobody calls close()
    for step in range(10, 41, 10):
        with hook.guard():
            for parameter in strategy.models["main"].parameters():
                torch.nn.init.constant_(parameter, float(step))
        strategy.step_count = step
        strategy.context.step_count = step
        if step == 40:
            hook.checkpoint_dir = type(hook.checkpoint_dir)(last)
            sys.setswitchinterval(30.0)
        hook.save(strategy.context)
    print("loop done", flush=True)
    """
).replace("TESTS", repr(str(TESTS)))


def run_child(
    tmp_path: Path, script: str, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as a child Python with ``args``; it must end by itself."""
    path = tmp_path / "child.py"
    path.write_text(script)
    result = subprocess.run(
        [sys.executable, str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert "loop done" in result.stdout, result.stderr
    return result


FORK_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from fastckpt import CheckpointManager

    torch.set_num_threads(1)  # torch's own pool does not survive a fork either
    root = sys.argv[1]
    config = CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = 60
    manager = CheckpointManager(config)
    manager.save(f"{root}/parent-1", {"w": torch.full((8,), 1.0)}).result()
    in_flight = manager.save(f"{root}/parent-2", {"w": torch.full((8,), 2.0)})
    pid = os.fork()
    if pid == 0:
        # The inherited async manager: the parent's writer thread does not exist here.
        manager.save(f"{root}/child-1", {"w": torch.full((8,), 3.0)}).result(timeout=60)
        manager.save(f"{root}/child-2", {"w": torch.full((8,), 4.0)})
        sys.exit(0)  # no close(): the exit hook finishes child-2
    in_flight.result()
    _, status = os.waitpid(pid, 0)
    manager.close()
    print("child status", os.waitstatus_to_exitcode(status))
    print("loop done")
    """
)


def test_a_forked_child_saves_with_the_async_manager_it_inherited(tmp_path: Path) -> None:
    """Before, the child of ``os.fork()`` sent its saves to the parent's writer thread, which
    does not exist in the child: ``result()`` and ``close()`` waited forever, and so did its
    exit. The child now starts its own threads; the parent's write in flight at the fork is
    the parent's, finished by the parent."""
    root = tmp_path / "runs"
    result = run_child(tmp_path, FORK_CHILD, str(root), timeout=240)
    assert "child status 0" in result.stdout, result.stderr
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        for name, value in (("parent-1", 1), ("parent-2", 2), ("child-1", 3), ("child-2", 4)):
            assert torch.equal(manager.load(root / name)["w"], torch.full((8,), float(value)))


TIERED_CHILD = textwrap.dedent(
    """
    import os, sys, torch, fastckpt

    torch.set_num_threads(1)
    fast, durable, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    config = fastckpt.CheckpointManager.Config()
    config.tiers = fastckpt.TiersConfig(fast=fast, durable=durable)
    manager = fastckpt.CheckpointManager(config)
    model = torch.nn.Linear(512, 512)
    if mode == "fork":
        manager.save("step_1", {"model": model, "step": 1}).result()
        manager._promoter.wait()
        pid = os.fork()
        if pid == 0:
            # The inherited promoter: the parent's promotion thread does not exist here.
            manager.save("step_2", {"model": model, "step": 2}).result(timeout=60)
            manager.close()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        manager.close()
        print("child status", os.waitstatus_to_exitcode(status))
    else:
        for step in (10, 20, 30):
            with manager.lock(), torch.no_grad():
                model.weight.fill_(float(step))
            manager.save(f"step_{step}", {"model": model, "step": step})
        # no close(): the exit hook finishes the writes, then the promotions
    print("loop done")
    """
)


def test_a_tiered_manager_that_exits_without_close_promotes_every_save(tmp_path: Path) -> None:
    """Promotions run on a daemon thread, which the interpreter stopped at exit: the durable
    tier kept the first checkpoint and a staging folder, the process exited 0 without a word,
    and a restore on a new node (the fast tier gone) went back to step 10. The exit hook now
    finishes the queued promotion after the writes, and says so."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    result = run_child(tmp_path, TIERED_CHILD, str(fast), str(durable), "exit")
    assert result.returncode == 0, result.stderr
    assert "finishing it" in result.stderr and "is done" in result.stderr, result.stderr
    assert sorted(p.name for p in durable.iterdir()) == ["step_10", "step_20", "step_30"]
    shutil.rmtree(fast)  # a new node
    config = CheckpointManager.Config()
    config.tiers = fastckpt.TiersConfig(fast=fast, durable=durable)
    with CheckpointManager(config) as manager:
        loaded = manager.load_latest()
    assert loaded["step"] == 30
    assert torch.equal(loaded["model"]["weight"], torch.full((512, 512), 30.0))


def test_a_forked_child_promotes_with_the_tiered_manager_it_inherited(tmp_path: Path) -> None:
    """Before, the child's promotion went to the parent's thread, which does not exist in
    the child: its ``close()`` waited forever."""
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    result = run_child(tmp_path, TIERED_CHILD, str(fast), str(durable), "fork", timeout=180)
    assert "child status 0" in result.stdout, result.stderr
    assert sorted(p.name for p in durable.iterdir()) == ["step_1", "step_2"]


FINALIZE_CHILD = textwrap.dedent(
    """
    import sys, threading, time, torch, fastckpt

    root, mode = sys.argv[1], sys.argv[2]
    if mode == "callback":
        def notify(checkpoint_id, logger):
            raise ValueError("notify service down")
        config = fastckpt.CheckpointManager.Config(finalize_callback=notify)
        manager = fastckpt.CheckpointManager(config)
        manager.save(f"{root}/step_1", {"w": torch.ones(4)})
        try:
            manager.save(f"{root}/step_2", {"w": torch.ones(4)})  # reports step_1's failure
        except RuntimeError as err:
            print("next save:", err)
        manager.save(f"{root}/step_2", {"w": torch.ones(4)})
        # no close(): step_2's callback failure is reported at exit
    else:
        manager = fastckpt.CheckpointManager()
        def late() -> None:
            time.sleep(1.0)  # the main thread has returned by then
            try:
                manager.save(f"{root}/late", {"w": torch.ones(4)})
            except RuntimeError as err:
                print("late save:", err, flush=True)
            manager.close()
        threading.Thread(target=late).start()
    print("loop done")
    """
)


def test_a_callback_failing_after_the_commit_says_the_checkpoint_is_saved(
    tmp_path: Path,
) -> None:
    """A ``finalize_callback`` that raised after the commit was reported as "was NOT saved"
    at exit, and as "the previous background checkpoint write failed" by the next save,
    while the checkpoint was committed and loaded: a user could delete or redo a good one."""
    root = tmp_path / "fin"
    result = run_child(tmp_path, FINALIZE_CHILD, str(root), "callback")
    assert result.returncode == 0, result.stderr
    assert "step_1 is saved (committed), but what ran after its commit" in result.stdout
    assert "notify service down" in result.stdout
    assert "step_2 is saved (committed)" in result.stderr and "NOT saved" not in result.stderr
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        for name in ("step_1", "step_2"):
            assert torch.equal(manager.load(root / name)["w"], torch.ones(4))


def test_a_save_from_a_thread_after_the_main_thread_returned_says_why_it_cannot(
    tmp_path: Path,
) -> None:
    """Before: a bare ``cannot schedule new futures after shutdown`` from concurrent.futures,
    naming neither fastckpt, the checkpoint nor the cause."""
    root = tmp_path / "late"
    result = run_child(tmp_path, FINALIZE_CHILD, str(root), "thread")
    assert "late save: cannot save" in result.stdout, result.stdout + result.stderr
    assert "the interpreter is exiting (the main thread returned)" in result.stdout
    assert not (root / "late").exists()


def manager_steps(root: Path) -> dict[str, int]:
    """Every committed manager checkpoint under ``root``: its name and the step it loads."""
    found: dict[str, int] = {}
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        for directory in sorted(root.iterdir()):
            if (directory / "commit.json").is_file():
                loaded = manager.load(directory)
                assert torch.equal(
                    loaded["model"]["weight"], torch.full((64, 64), float(loaded["step"]))
                )
                found[directory.name] = loaded["step"]
    return found


def test_a_manager_loop_that_exits_without_close_keeps_every_save(tmp_path: Path) -> None:
    """Issue 22.10: the save pending at interpreter exit is finished, not dropped."""
    root = tmp_path / "ckpt"
    result = run_child(tmp_path, MANAGER_CHILD, str(root), str(root / "step_40"), "600", "-")
    assert result.returncode == 0, result.stderr
    assert manager_steps(root) == {f"step_{s}": s for s in (10, 20, 30, 40)}
    assert "fastckpt" not in result.stderr, result.stderr  # nothing to warn about
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_a_hook_that_exits_without_close_keeps_every_save(tmp_path: Path) -> None:
    """Issue 22.10: the same for ``CheckpointHook(async_save=True)`` driving a strategy."""
    root = tmp_path / "ckpt"
    result = run_child(tmp_path, HOOK_CHILD, str(root), str(root))
    assert result.returncode == 0, result.stderr
    assert "fastckpt" not in result.stderr, result.stderr
    entries = fastckpt.list_checkpoints(root)
    assert [entry["counters"]["step_count"] for entry in entries] == [10, 20, 30, 40]
    for entry in entries:
        step = entry["counters"]["step_count"]
        restored = TrainingStrategy.load_checkpoint(
            root, entry["index"], training_fn=support.training_fn
        )
        assert restored.step_count == step
        for parameter in restored.models["main"].parameters():
            assert torch.equal(parameter, torch.full_like(parameter, float(step)))


@pytest.mark.parametrize("writer", ["manager", "hook"])
def test_a_save_that_fails_at_exit_is_named_on_stderr(tmp_path: Path, writer: str) -> None:
    """Issue 22.10: a pending save that cannot be finished at exit (its write fails: the last
    checkpoint goes below a regular file) is named on stderr as not saved; the earlier ones
    are intact."""
    root = tmp_path / "ckpt"
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where a directory must go")
    if writer == "manager":
        last = blocker / "step_40"
        result = run_child(tmp_path, MANAGER_CHILD, str(root), str(last), "600", "-")
        assert manager_steps(root) == {f"step_{s}": s for s in (10, 20, 30)}
    else:
        last = blocker / "ckpt"
        result = run_child(tmp_path, HOOK_CHILD, str(root), str(last))
        steps = [e["counters"]["step_count"] for e in fastckpt.list_checkpoints(root)]
        assert steps == [10, 20, 30]
    lines = [line for line in result.stderr.splitlines() if "fastckpt" in line]
    assert any(str(last) in line and "NOT saved" in line for line in lines), result.stderr
    if writer == "hook":
        assert any("step 40" in line for line in lines), result.stderr


# A manager created inside a function and dropped there, its last save failing: nothing
# references the manager (or its writer) any more when the interpreter exits.
DROPPED_MANAGER_CHILD = textwrap.dedent(
    """
    import gc, sys, time
    import torch
    from fastckpt import CheckpointManager

    def train(root, last):
        manager = CheckpointManager(CheckpointManager.Config.with_async_save())
        model = torch.nn.Linear(8, 8)
        manager.save(f"{root}/step_10", {"model": model.state_dict()}).result()
        manager.save(last, {"model": model.state_dict()})

    train(sys.argv[1], sys.argv[2])
    time.sleep(2)  # the last write fails meanwhile
    gc.collect()  # and the dropped manager, its writer included, is collected
    print("loop done", flush=True)
    """
)


def test_a_failed_save_of_a_dropped_manager_is_named_at_exit(tmp_path: Path) -> None:
    """Issue 22.10, the usual shape of a training script: the manager lives in ``train()``
    and is garbage collected before exit; its failed last save must still be named."""
    root = tmp_path / "ckpt"
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where a directory must go")
    last = blocker / "step_20"
    result = run_child(tmp_path, DROPPED_MANAGER_CHILD, str(root), str(last))
    lines = [line for line in result.stderr.splitlines() if "fastckpt" in line]
    assert any(str(last) in line and "NOT saved" in line for line in lines), result.stderr


def test_a_save_still_running_at_exit_is_named_then_finished(tmp_path: Path) -> None:
    """Issue 22.10: a pending save that outlasts the writer's wait timeout at exit is named
    on stderr (a kill now would lose it); the interpreter then waits for it, and it is saved."""
    root = tmp_path / "ckpt"
    result = run_child(tmp_path, MANAGER_CHILD, str(root), str(root / "step_40"), "0.5", "slow")
    assert result.returncode == 0, result.stderr
    assert any(
        str(root / "step_40") in line and "still running" in line
        for line in result.stderr.splitlines()
    ), result.stderr
    assert manager_steps(root) == {f"step_{s}": s for s in (10, 20, 30, 40)}


# --------------------------------------------------------------------------- raised exactly once


@pytest.mark.parametrize("seen_by", ["result", "exception"])
@pytest.mark.parametrize("next_call", ["save", "close"])
def test_a_failure_seen_through_its_future_is_not_raised_again(
    tmp_path: Path, seen_by: str, next_call: str
) -> None:
    """Issue 22.13: the failure of a background save is raised once: the Future that
    delivered it to the caller is enough, the next save / close does not raise it again."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    bad = manager.save(blocker / "ckpt", {"x": torch.ones(3)})
    assert bad is not None
    if seen_by == "result":
        with pytest.raises(NotADirectoryError):
            bad.result()
    else:
        assert isinstance(bad.exception(), NotADirectoryError)
    if next_call == "save":
        good = manager.save(tmp_path / "good", {"x": torch.ones(3)})
        assert good is not None
        good.result()
    manager.close()
    if next_call == "save":
        with CheckpointManager(CheckpointManager.Config.with_sync_save()) as reader:
            assert torch.equal(reader.load(tmp_path / "good")["x"], torch.ones(3))


def test_a_failure_nobody_looked_at_is_raised_by_the_next_call(tmp_path: Path) -> None:
    """The other half of "exactly once": a Future nobody asked leaves the failure to the next
    save (then that save works) or to close."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    manager = CheckpointManager(CheckpointManager.Config.with_async_save())
    bad = manager.save(blocker / "one", {"x": torch.ones(3)})
    assert bad is not None
    while not bad.done():  # done() does not deliver the failure
        pass
    with pytest.raises(RuntimeError, match="previous background checkpoint write failed") as info:
        manager.save(tmp_path / "good", {"x": torch.ones(3)})
    assert isinstance(info.value.__cause__, NotADirectoryError)
    manager.save(blocker / "two", {"x": torch.ones(3)})
    with pytest.raises(RuntimeError, match="two") as closing:
        manager.close()
    assert isinstance(closing.value.__cause__, NotADirectoryError)
    manager.close()


# --------------------------------------------------------------------------- the hook's error type


def test_a_hook_raises_the_typed_error_of_its_background_write(tmp_path: Path) -> None:
    """Issue 22.13: an async hook's failed write is raised with its own type (as a sync hook
    raises it), not as a RuntimeError; the message says which save it was."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    hook = fastckpt.CheckpointHook(blocker / "ckpt", step_interval=1, async_save=True)
    strategy = support.new_strategy([hook], num_steps=3)
    with pytest.raises(NotADirectoryError) as info:
        strategy.run(support.loader())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "background checkpoint write" in notes and str(blocker / "ckpt") in notes
    hook.close()  # raised once: closing again is quiet


def test_a_hook_with_a_wrong_key_raises_access_denied(
    s3_server: S3Server, s3_root: str, no_aws_env: None
) -> None:
    """Issue 22.13, the real case: a CheckpointHook on a real (moto) S3 server with a wrong
    secret raises AccessDeniedError (a PermissionError) naming the URL, not RuntimeError."""
    wrong = s3_server.options(secret_access_key="wrong", max_retries=0)
    url = f"{s3_root}/hook"
    hook = fastckpt.CheckpointHook(url, step_interval=1, async_save=True, storage_options=wrong)
    strategy = support.new_strategy([hook], num_steps=3)
    try:
        with pytest.raises(AccessDeniedError, match=url) as info:
            strategy.run(support.loader())
        assert isinstance(info.value, PermissionError)
        hook.close()  # raised once
    finally:
        fastckpt.configure_storage(url)


# --------------------------------------------------------------------------- re-sealed JSON

#: Values a mutation puts in place of a node: other types, nulls, huge and odd numbers.
REPLACEMENTS: list[Any] = [
    None,
    True,
    0,
    -1,
    2**64,
    -(2**63),
    10**30,
    1.5,
    -0.0,
    "",
    "x",
    "step_count",
    "fastckpt.training.hooks.ema.EMAHook",
    [],
    [None],
    [1, 2],
    {},
    {"__tensor__": "missing"},
    {"__tensor__": 5},
    {"__tuple__": None},
]


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every node of a JSON document (the root is ``()``)."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _nodes(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _nodes(item, (*path, i))
    return found


def _mutated(rng: random.Random, document: Any) -> Any:
    """``document`` with one node changed: deleted, replaced (another type, null, a huge
    number), wrapped in a list or an object, or replaced by one of its children."""
    document = json.loads(json.dumps(document))
    path = rng.choice(_nodes(document))
    parent: Any = None
    node = document
    for part in path:
        parent, node = node, node[part]
    action = rng.random()
    if action < 0.5:
        new: Any = rng.choice(REPLACEMENTS)
    elif action < 0.6:
        new = [node]
    elif action < 0.7:
        new = {"value": node}
    elif action < 0.8 and isinstance(node, (dict, list)) and node:
        new = rng.choice(list(node.values()) if isinstance(node, dict) else node)
    elif isinstance(node, int) and not isinstance(node, bool):
        new = rng.choice([node + 1, -node - 1, node * 2**40, str(node), float(node)])
    else:
        new = rng.choice(REPLACEMENTS)
    if not path:
        return new
    if rng.random() < 0.15:  # delete the node instead
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return document


def _reseal(root: Path, index: int, relpath: str, data: bytes) -> None:
    """Write ``data`` as ``relpath`` of ``index`` and update the manifest's record of it (and
    the manifest's own crc32c) like an attacker would, so that the parser sees the data."""
    (root / str(index) / relpath).write_bytes(data)
    document = json.loads((root / MANIFEST).read_bytes())
    document["checkpoints"][str(index)]["files"][relpath] = {
        "size": len(data),
        "crc32c": fastckpt._native.crc32c(data),
    }
    (root / MANIFEST).write_text(json.dumps(seal_manifest(document)))


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_number_in_a_checkpoint_json_is_a_format_error(
    tmp_path: Path, number: str
) -> None:
    """fastckpt never writes NaN/Infinity into JSON (non-finite floats are markers): before,
    a re-sealed spec with ``"eps": NaN`` built a ``LayerNorm(eps=nan)`` and an optimizer
    ``"lr": NaN`` loaded as ``lr=nan``, without a word."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fastckpt.save_checkpoint(
        tmp_path, models={"m": (model, None)}, optimizers={"sgd": (optimizer, None)}
    )
    for relpath, old in (("models/m.spec.json", b"1e-05"), ("optimizers/sgd.json", b"0.1")):
        work = tmp_path.parent / f"{tmp_path.name}-{relpath.replace('/', '-')}"
        shutil.copytree(tmp_path, work)
        original = (work / "0" / relpath).read_bytes()
        assert old in original
        _reseal(work, 0, relpath, original.replace(old, number.encode(), 1))
        with pytest.raises(CheckpointFormatError, match=rf"{relpath}: holds"):
            fastckpt.load_checkpoint(work)


@pytest.mark.parametrize("key", ["optimizer", "step", "__class__"])
def test_an_edited_scheduler_state_that_would_replace_its_attributes_is_refused(
    tmp_path: Path, key: str
) -> None:
    """torch's ``load_state_dict`` puts whatever it is given into the scheduler's
    ``__dict__``: before, a re-sealed ``schedulers/<name>.json`` holding ``"optimizer"``
    loaded without a word and the first ``step()`` raised a bare AttributeError from inside
    torch. Every load path refuses it, naming the file and the key."""
    strategy = support.new_strategy([], num_steps=2)
    strategy.run(support.loader())
    strategy.save_checkpoint(tmp_path)
    (index,) = Manifest.load(tmp_path).entries
    relpath = "schedulers/main.json"
    document = json.loads((tmp_path / str(index) / relpath).read_bytes())
    document["state"][key] = "hijacked"
    _reseal(tmp_path, index, relpath, json.dumps(document).encode())
    refused = rf"{relpath}.*{key!r}, which would replace the StepLR's own attributes"
    with pytest.raises(CheckpointFormatError, match=refused):
        fastckpt.load_checkpoint(tmp_path)
    with pytest.raises(CheckpointFormatError, match=refused):
        TrainingStrategy.load_checkpoint(tmp_path, training_fn=support.training_fn)
    live = support.new_strategy([], num_steps=2)
    with pytest.raises(CheckpointFormatError, match=refused):
        live.restore_checkpoint(tmp_path)
    live.schedulers["main"].step()  # still a working scheduler


def test_resealed_strategy_and_hooks_json_raise_only_typed_errors_through_the_strategy(
    tmp_path: Path,
) -> None:
    """Issue 22.12: 600 seeded mutations (type changes, deleted keys, wrong nesting, nulls,
    huge numbers, bytes) of an index's ``strategy.json`` and ``hooks.json``, re-sealed in the
    manifest: ``TrainingStrategy.load_checkpoint`` and ``restore_checkpoint`` either succeed
    or raise a fastckpt error naming the file, never a bare AttributeError / KeyError /
    TypeError / ValueError / IndexError."""
    strategy = support.new_strategy([EMAHook(model_key="main", decay=0.9)], num_steps=2)
    strategy.run(support.loader())
    source = tmp_path / "source"
    strategy.save_checkpoint(source)
    (index,) = Manifest.load(source).entries
    rng = random.Random(22)
    work = tmp_path / "work"
    outcomes: dict[str, int] = {}
    problems: list[str] = []
    live = support.new_strategy([EMAHook(model_key="main", decay=0.9)], num_steps=2)
    for iteration in range(600):
        target = ("strategy.json", "hooks.json")[iteration % 2]
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(source, work)
        original = (work / str(index) / target).read_bytes()
        if rng.random() < 0.9:
            data = json.dumps(_mutated(rng, json.loads(original))).encode()
        else:  # a few bytes changed, inserted or cut
            changed = bytearray(original)
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(changed))
                changed[at : at + rng.randint(0, 3)] = bytes(rng.choice([b"", b"{", b"]", b"9"]))
            data = bytes(changed)
        _reseal(work, index, target, data)
        for door in ("load_checkpoint", "restore_checkpoint"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # unmatched hook states
                    if door == "load_checkpoint":
                        TrainingStrategy.load_checkpoint(
                            work,
                            hooks=[EMAHook(model_key="main", decay=0.9)],
                            training_fn=support.training_fn,
                        )
                    else:
                        live.restore_checkpoint(work)
                outcome = "ok"
            except FastCkptError as err:
                outcome = type(err).__name__
                if target not in str(err):
                    problems.append(f"{iteration} {door} ({target}): file not named: {err}")
            except Exception as err:  # an untyped error is a bug
                outcome = "BUG"
                problems.append(f"{iteration} {door} ({target}): {type(err).__name__}: {err}")
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert problems == [], f"{len(problems)} problems, {outcomes}:\n" + "\n".join(problems[:40])
    assert outcomes.get("ok", 0) < sum(outcomes.values()) / 2, outcomes


# --------------------------------------------------------------------------- address-space limit

# Saves a root and a manager checkpoint, then limits the address space to what the process
# uses plus 256 MiB and reads them: the records only (argv[2] == "records") or whole loads.
# Each record read used to ask for 1 GiB + 1 bytes up front (the cap), which fails under such a
# limit however small the record is.
RLIMIT_CHILD = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    import torch
    import fastckpt
    from fastckpt.format.records import Manifest, read_commit_record

    out, what = Path(sys.argv[1]), sys.argv[2]
    model = torch.nn.Linear(32, 32)
    fastckpt.save_checkpoint(out / "root", models={"main": model})
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(out / "mgr", {"model": model.state_dict(), "step": 7})

    def vm_bytes():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmSize")

    limit = vm_bytes() + (256 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        bytearray(512 << 20)
    except MemoryError:
        print("limit in force")
    if what == "records":
        assert list(Manifest.load(out / "root", verify_checksum=True).entries) == [0]
        assert [c["index"] for c in fastckpt.list_checkpoints(out / "root")] == [0]
        assert read_commit_record(out / "mgr")["items"] == ["model", "step"]
    else:
        loaded = fastckpt.load_checkpoint(out / "root")["models"]["main"]["model"]
        assert torch.equal(loaded.weight, model.weight)
        with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
            assert torch.equal(m.load(out / "mgr")["model"]["weight"], model.weight)
    print("read")
    """
)


def run_limited(tmp_path: Path, what: str) -> None:
    """Run :data:`RLIMIT_CHILD`; it must read what it saved under the limit."""
    script = tmp_path / "child.py"
    script.write_text(RLIMIT_CHILD)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), what],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "limit in force" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0 and "read" in result.stdout, result.stderr[-3000:]


def test_records_are_read_by_their_size_under_an_address_space_limit(tmp_path: Path) -> None:
    """Issue 22.12: under ``RLIMIT_AS`` = current + 256 MiB, ``manifest.json`` and
    ``commit.json`` (a few KiB) are read: a record is read by its ``fstat`` size (still capped
    at 1 GiB), not by asking for the cap up front."""
    run_limited(tmp_path, "records")


def test_a_checkpoint_loads_under_an_address_space_limit(tmp_path: Path) -> None:
    """Issue 22.12: the same limit, whole loads (``load_checkpoint``, ``CheckpointManager
    .load``): every JSON file of a checkpoint is read by its size."""
    run_limited(tmp_path, "load")


def test_a_frozen_record_naming_a_missing_parameter_is_a_format_error(tmp_path: Path) -> None:
    """The manifest entry's ``frozen`` record is checked against the rebuilt model: a name it
    lacks is a format error naming the field, not ignored; a record that is no object of
    model names is refused when the manifest is read."""
    strategy = support.new_strategy([], num_steps=1)
    strategy.models["main"].net[0].requires_grad_(False)
    strategy.save_checkpoint(tmp_path / "run")
    document = json.loads((tmp_path / "run" / MANIFEST).read_bytes())
    entry = document["checkpoints"]["0"]
    assert entry["frozen"] == {"main": ["net.0.bias", "net.0.weight"]}
    entry["frozen"] = {"main": ["net.9.weight"]}
    (tmp_path / "run" / MANIFEST).write_text(json.dumps(seal_manifest(document)))
    with pytest.raises(CheckpointFormatError, match=r"frozen\.main: names \['net\.9\.weight'\]"):
        fastckpt.TrainingStrategy.load_checkpoint(tmp_path / "run", training_fn=support.training_fn)
    entry["frozen"] = {"other": []}
    (tmp_path / "run" / MANIFEST).write_text(json.dumps(seal_manifest(document)))
    with pytest.raises(CheckpointFormatError, match=r"frozen must be an object keyed by names"):
        fastckpt.load_checkpoint(tmp_path / "run")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("scheduler_cls", 5, "must be a dotted path or null, got 5"),
        ("optimizer_cls", "torch.optim.sgd.SGD", "names torch.optim.sgd.SGD, but .*adam.Adam"),
        ("optimizer_cls", "os.system", "names os.system, but .*adam.Adam"),
        ("scheduler_cls", "torch.optim.lr_scheduler.ExponentialLR", "ExponentialLR, but .*StepLR"),
    ],
)
def test_an_edited_optimizer_recipe_is_refused_or_named_at_load(
    tmp_path: Path, field: str, value: Any, message: str
) -> None:
    """``strategy.json``'s optimizer recipe is recorded again by the next save and builds a
    fine-tuning run's optimizer. Before, a recipe that is no path (``5``) loaded and the run
    failed at its first save after training; one naming another class than the checkpoint's
    optimizer loaded without a word. Now the first is refused, the second named in a warning
    (an optimizer swapped by hand during a run saves such a recipe: a review finding)."""
    strategy = support.new_strategy([], num_steps=2)
    strategy.run(support.loader())
    strategy.save_checkpoint(tmp_path)
    (index,) = Manifest.load(tmp_path).entries
    recipe = json.loads((tmp_path / str(index) / "strategy.json").read_text())
    (config,) = recipe["optimizer_configs"].values()
    config[field] = value
    _reseal(tmp_path, index, "strategy.json", json.dumps(recipe).encode())
    if value == 5:
        with pytest.raises(fastckpt.CheckpointFormatError, match=rf"strategy\.json.*{message}"):
            TrainingStrategy.load_checkpoint(tmp_path, training_fn=support.training_fn)
        return
    with pytest.warns(UserWarning, match=rf"strategy\.json.*{message}"):
        TrainingStrategy.load_checkpoint(tmp_path, training_fn=support.training_fn)
