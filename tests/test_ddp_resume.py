"""DDP (unsharded models replicated over every rank) under a real 2-rank gloo group: every
rank resumes the same index from node-local fast tiers and a shared durable one, a save by
hand is rank 0's alone, and a hook saving on every rank into one root says that the other
writer may be a rank of the same run."""

from __future__ import annotations

import json
from pathlib import Path

import fastckpt
import training_support as support

TIERS_SCRIPT = """
import json, logging, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
from fastckpt.errors import NotCommittedError
base, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
fast, durable = f"{base}/node{rank}/fast", f"{base}/durable"
lost = f"{base}/node{rank}/lost"  # rank 1's durable tier, unreachable: holds nothing
torch.manual_seed(0)
hook = fastckpt.CheckpointHook(fast, step_interval=1, durable_dir=durable, promote_every=2)
strategy = fastckpt.TrainingStrategy(
    DDP(s.DropoutMLP(p=0.0)), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, num_steps=4, hooks=[hook],
)
strategy.run(s.loader(seed=rank))
hook.close()  # every due promotion done: durable/ holds indices 0 and 2
dist.barrier()
warned = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: warned.append(record.getMessage())
logging.getLogger("fastckpt").addHandler(handler)
load = {"trusted": ["training_support.training_fn"], "hooks": []}
report = {}
restored = fastckpt.TrainingStrategy.load_checkpoint(fast, fallback_dirs=[durable], **load)
copy = restored.restored_from
report["load"] = [copy.index, str(copy.root), restored.step_count, warned]
resumed = fastckpt.TrainingStrategy.resume_or_start(
    fast, lambda: None, fallback_dirs=[durable], **load
)
report["resume_or_start"] = [resumed.restored_from.index, resumed.step_count]
for name, call in (
    ("index_3", lambda: fastckpt.TrainingStrategy.load_checkpoint(
        fast, 3, fallback_dirs=[durable], **load)),
    ("none_common", lambda: fastckpt.TrainingStrategy.load_checkpoint(
        fast, fallback_dirs=[durable if rank == 0 else lost], **load)),
    ("resume_or_start_none", lambda: fastckpt.TrainingStrategy.resume_or_start(
        fast, lambda: None, fallback_dirs=[durable if rank == 0 else lost], **load)),
):
    try:
        result = call()
    except NotCommittedError as err:
        report[name] = str(err)
    else:
        report[name] = None if result is None else ["loaded", result.step_count]
try:  # no fallback_dirs: rank 1's node-local root holds nothing
    result = fastckpt.TrainingStrategy.resume_or_start(fast, lambda: "fresh", **load)
    report["no_fallback"] = "fresh" if result == "fresh" else ["resumed", result.step_count]
except Exception as err:
    report["no_fallback"] = type(err).__name__
print(json.dumps(report))
s.leave_process_group()
"""


def test_ddp_ranks_resume_the_same_index_from_node_local_tiers(tmp_path: Path) -> None:
    """Rank 0 alone writes (rank_zero_only) into its node's fast tier, every second index
    promoted to the shared durable tier: node 0's fast tier holds indices 0-3, node 1's is
    empty, the durable tier 0 and 2. Every rank must resume index 2, the newest all of them
    can load, each from its nearest tier holding it, and rank 0 must say why it passed over
    its index 3. Before, rank 0 resumed index 3 (step 4) and rank 1 index 2 (step 3): their
    step counts, optimizer, RNG and data position differed without a word (and later
    allreduces could hang). With no index every rank holds, or a requested index one rank
    lacks, every rank raised nothing (rank 0 loaded) or a rank alone raised; now every rank
    raises the same NotCommittedError naming the rank that lacks it."""
    outputs = support.run_two_ranks(TIERS_SCRIPT, tmp_path, tmp_path / "pg")
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "durable")] == [0, 2]
    for rank, report in enumerate(reports):
        index, root, step, _ = report["load"]
        assert (index, step) == (2, 3), (rank, report)
        assert report["resume_or_start"] == [2, 3], (rank, report)
        assert root == str(tmp_path / ("node0/fast" if rank == 0 else "durable")), report
        for name in ("index_3", "none_common", "resume_or_start_none"):
            assert report[name] is not None and "rank 1" in report[name], (rank, name, report)
        assert report["index_3"] == reports[0]["index_3"], "every rank: the same error"
        assert report["none_common"] == reports[0]["none_common"]
    # Without fallback_dirs rank 0 still decides, and rank 1 cannot load that index: every
    # rank raises. Before c803a2b rank 1 started afresh beside a resumed rank 0 (another
    # state, no word); after it, rank 1 raised while rank 0 resumed (its next allreduce hung).
    assert reports[0]["no_fallback"] == reports[1]["no_fallback"] == "NotCommittedError"
    rank_0_warned = " ".join(reports[0]["load"][3])
    assert "index 3" in rank_0_warned and "rank 1" in rank_0_warned, reports[0]


SAVE_ON_EVERY_RANK_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
from fastckpt.errors import InvalidInputError
root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
torch.manual_seed(0)
model = DDP(s.DropoutMLP(p=0.5))
torch.manual_seed(100 + rank)  # seeded apart: each rank its own dropout stream
strategy = fastckpt.TrainingStrategy(
    model, fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, num_steps=2,
)
strategy.run(s.loader())
report = {}
for name, save in (
    ("strategy", lambda to, **kw: strategy.save_checkpoint(to, **kw)),
    ("components", lambda to, **kw: fastckpt.save_checkpoint(
        to, models={"main": (model, None)}, **kw)),
):
    try:
        report[name] = save(f"{root}/{name}")
    except InvalidInputError as err:
        report[name] = str(err)
    try:  # each rank its own root, saying so: saved on every rank
        report[name + "_per_rank"] = save(f"{root}/{name}-{rank}", per_rank=True)
    except TypeError as err:
        report[name + "_per_rank"] = f"TypeError: {err}"
compiled = torch.compile(model, backend="eager")  # torch.compile(DDP(module))
try:
    report["compiled"] = fastckpt.save_checkpoint(
        f"{root}/compiled", models={"main": (compiled, None)}
    )
except InvalidInputError as err:
    report["compiled"] = str(err)
print(json.dumps(report))
s.leave_process_group()
"""


def test_a_save_by_hand_of_ddp_replicas_is_refused_on_other_ranks(tmp_path: Path) -> None:
    """``strategy.save_checkpoint(root)`` and ``fastckpt.save_checkpoint(root, ...)`` of a
    DDP model called on every rank: rank 1's call is refused (InvalidInputError naming the
    rank, the world and the fix) and only rank 0's index is committed. Before, each rank
    committed an index of the same step, and a resume took whichever rank wrote last (rank 0
    resumed on rank 1's RNG streams) without a word. ``per_rank=True`` (models of a rank's
    own, each rank its own root) saves on any rank."""
    outputs = support.run_two_ranks(SAVE_ON_EVERY_RANK_SCRIPT, tmp_path, tmp_path / "pg")
    rank_0, rank_1 = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    assert rank_0 == dict.fromkeys(
        ["strategy", "strategy_per_rank", "components", "components_per_rank", "compiled"], 0
    )
    # torch.compile(DDP(module)) too (review of round 16: the compile wrapper hid the DDP one)
    assert "rank 1 of a process group of 2 ranks" in rank_1["compiled"], rank_1
    assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / "compiled")] == [0]
    for name in ("strategy", "components"):
        refusal = rank_1[name]
        assert isinstance(refusal, str), rank_1
        assert "rank 1 of a process group of 2 ranks" in refusal, refusal
        assert "torch.distributed.get_rank() == 0" in refusal and "CheckpointHook" in refusal
        assert [c["index"] for c in fastckpt.list_checkpoints(tmp_path / name)] == [0]
        assert rank_1[f"{name}_per_rank"] == 0, rank_1
        assert fastckpt.list_checkpoints(tmp_path / f"{name}-1"), name


HOOK_ON_EVERY_RANK_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
from datetime import timedelta
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group(
    "gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2,
    timeout=timedelta(seconds=30),
)
torch.manual_seed(0)
hook = fastckpt.CheckpointHook(root, step_interval=2, rank_zero_only=False, async_save=False)
strategy = fastckpt.TrainingStrategy(
    DDP(s.DropoutMLP()), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, num_steps=2, hooks=[hook],
)
try:
    strategy.run(s.loader())
    outcome = ["ok"]
except Exception as err:  # the rank that commits second; the other may lose its peer
    outcome = [type(err).__name__, str(err)]
print(json.dumps(outcome), flush=True)
os._exit(0)  # no teardown: the other rank may be waiting for this one
"""


def test_a_hook_saving_ddp_replicas_on_every_rank_names_the_other_ranks(tmp_path: Path) -> None:
    """A CheckpointHook with rank_zero_only=False on every rank of a DDP run, one root: the
    rank committing second raises MixedRunError, which must say that the other writer may be
    another rank of this same run and that rank_zero_only=True (the default) makes rank 0
    the only writer. Before, it said that two runs save into one root and to stop one."""
    outputs = support.run_two_ranks(HOOK_ON_EVERY_RANK_SCRIPT, tmp_path / "c", tmp_path / "pg")
    outcomes = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    refused = [o[1] for o in outcomes if o[0] == "MixedRunError"]
    assert len(refused) == 1, outcomes
    assert "another rank of this same run" in refused[0], refused[0]
    assert "rank_zero_only=True" in refused[0], refused[0]


AGREEMENT_SCRIPT = """
import json, os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
base, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group(  # short: a rank left waiting fails instead of stalling the test
    "gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2,
    timeout=timedelta(seconds=10),
)
fast, durable = f"{base}/node{rank}/fast", f"{base}/durable"
torch.manual_seed(0)
hook = fastckpt.CheckpointHook(fast, step_interval=1, durable_dir=durable, promote_every=2)
strategy = fastckpt.TrainingStrategy(
    DDP(s.DropoutMLP(p=0.0)), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, num_steps=4, hooks=[hook],
)
strategy.run(s.loader(seed=rank))
hook.close()  # node 0's fast tier: 0-3, node 1's: empty, durable: 0 and 2
dist.barrier()
load = {"trusted": ["training_support.training_fn"], "hooks": []}
Strategy = fastckpt.TrainingStrategy

def outcome(call):
    start = time.monotonic()
    try:
        result = call()
    except Exception as err:
        return [type(err).__name__, str(err), time.monotonic() - start]
    if result is None:
        return ["fresh"]
    copy = result.restored_from
    return ["loaded", None if copy is None else copy.index, result.step_count]

report = {}
report["mixed_tiers"] = outcome(lambda: Strategy.load_checkpoint(
    fast, fallback_dirs=[durable] if rank == 0 else None, **load))
report["resume_no_fallback"] = outcome(lambda: Strategy.resume_or_start(
    fast, lambda: None, **load))
report["index_1_no_fallback"] = outcome(lambda: Strategy.load_checkpoint(fast, 1, **load))
dist.barrier()
if rank == 0:  # evaluation on rank 0 alone; rank 1 calls nothing
    report["eval_per_rank"] = outcome(lambda: Strategy.load_checkpoint(
        fast, fallback_dirs=[durable], per_rank=True, **load))
    report["per_rank_not_bool"] = outcome(lambda: Strategy.load_checkpoint(
        fast, per_rank=1, **load))
    report["per_rank_parallelize"] = outcome(lambda: Strategy.load_checkpoint(
        fast, per_rank=True, parallelize=lambda model: model, **load))
    report["eval_collective"] = outcome(lambda: Strategy.load_checkpoint(
        fast, fallback_dirs=[durable], **load))
    open(f"{base}/rank-0-done", "w").close()
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{base}/rank-0-done") and time.monotonic() < deadline:
        time.sleep(0.1)
print(json.dumps(report), flush=True)
os._exit(0)  # no teardown: rank 0's group timed out
"""


def test_a_load_by_one_rank_alone_says_per_rank_and_mismatched_ranks_raise_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 0 alone loading for evaluation passes ``per_rank=True`` and loads its newest
    index (3) with no other rank; without it the load, collective under the group, fails
    after the group's timeout with a RuntimeError saying that it is collective and that
    ``per_rank=True`` loads on one rank alone. Before, ``per_rank`` was unknown and the
    collective load failed after the timeout with gloo's bare "Timed out waiting" message.
    ``fallback_dirs`` given on rank 0 alone: every rank raises InvalidInputError at once
    (before, rank 1 loaded alone while rank 0 waited for it). ``resume_or_start`` without
    ``fallback_dirs`` where rank 1's node-local root holds nothing, and an explicit index
    rank 1 lacks: every rank raises the same NotCommittedError naming rank 1 (before,
    rank 1 raised while rank 0 resumed and went on alone, to hang at DDP's first
    allreduce)."""
    outputs = support.run_two_ranks(AGREEMENT_SCRIPT, tmp_path, tmp_path / "pg")
    rank_0, rank_1 = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    for report in (rank_0, rank_1):
        kind, message, seconds = report["mixed_tiers"]
        assert kind == "InvalidInputError", report
        assert "fallback_dirs" in message and "rank 0" in message and "rank 1" in message
        assert seconds < 5, "told at once, not after the group's timeout"
        for name in ("resume_no_fallback", "index_1_no_fallback"):
            assert report[name][0] == "NotCommittedError", (name, report)
            assert "rank 1" in report[name][1], (name, report)
            assert report[name][1] == rank_0[name][1], "every rank: the same error"
    assert rank_0["eval_per_rank"] == ["loaded", 3, 4], rank_0
    assert rank_0["per_rank_not_bool"][0] == "TypeError", rank_0
    assert "per_rank" in rank_0["per_rank_not_bool"][1], rank_0
    assert rank_0["per_rank_parallelize"][0] == "InvalidInputError", rank_0
    assert "parallelize" in rank_0["per_rank_parallelize"][1], rank_0
    kind, message, seconds = rank_0["eval_collective"]
    assert kind == "RuntimeError", rank_0
    assert "collective under a process group of 2 ranks" in message, message
    assert "per_rank=True" in message and "fallback_dirs" in message, message
    assert seconds < 60, seconds


SWEEP_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from datetime import timedelta
import fastckpt, training_support as s
base, rank = sys.argv[1], int(sys.argv[2])
root = f"{base}/run{rank}"

def run(steps):  # each rank its own run of a sweep: its own model and root
    torch.manual_seed(rank)
    hook = fastckpt.CheckpointHook(root, step_interval=1, rank_zero_only=False, async_save=False)
    return fastckpt.TrainingStrategy(
        s.DropoutMLP(p=0.0), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        training_fn=s.training_fn, num_steps=steps, hooks=[hook],
    )

if rank == 1:  # an earlier session of run 1, before the group existed
    run(3).run(s.loader(seed=1))
dist.init_process_group(
    "gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2,
    timeout=timedelta(seconds=10),
)
report = {}
try:
    strategy = fastckpt.TrainingStrategy.resume_or_start(
        root, lambda: run(5), per_rank=True, trusted=["training_support.training_fn"]
    )
    report["start_step"] = strategy.step_count
except Exception as err:
    report["start_step"] = f"{type(err).__name__}: {err}"
try:  # a plain model of this rank's own, saved by hand on every rank without per_rank
    report["plain_save"] = fastckpt.save_checkpoint(
        f"{base}/plain{rank}", models={"main": (s.DropoutMLP(), None)})
except Exception as err:
    report["plain_save"] = f"{type(err).__name__}: {err}"
print(json.dumps(report), flush=True)
s.leave_process_group()
"""


def test_independent_runs_of_a_sweep_resume_each_its_own_index_with_per_rank(
    tmp_path: Path,
) -> None:
    """Two runs of a sweep share a process group, each rank its own model and root: rank 1's
    run was trained to step 3 earlier, rank 0's is new. ``resume_or_start(...,
    per_rank=True)`` decides on each rank alone: rank 0 starts afresh, rank 1 resumes at
    step 3. Before, ``per_rank`` was unknown and rank 0 decided for both ("fresh"): rank 1's
    run was started over. A plain (not DDP) model saved by hand on rank 1 is saved: it may
    be the rank's own (before, any unsharded save off rank 0 was refused)."""
    outputs = support.run_two_ranks(SWEEP_SCRIPT, tmp_path, tmp_path / "pg")
    rank_0, rank_1 = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    assert rank_0 == {"start_step": 0, "plain_save": 0}, rank_0
    assert rank_1 == {"start_step": 3, "plain_save": 0}, rank_1


DAMAGED_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
base, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
root = f"{base}/node{rank}"  # each node's own disk
torch.manual_seed(0)
strategy = fastckpt.TrainingStrategy(
    DDP(s.DropoutMLP(p=0.0)), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
    training_fn=s.training_fn, num_steps=2,
)
strategy.run(s.loader())
strategy.save_checkpoint(root, per_rank=True)  # a copy of the replicas on each node
if rank == 1:  # rank 1's copy rots after it was written: its manifest still lists it
    tensors = f"{root}/0/models/main.safetensors"
    data = bytearray(open(tensors, "rb").read())
    data[-3] ^= 0xFF
    open(tensors, "wb").write(bytes(data))
dist.barrier()
try:
    restored = fastckpt.TrainingStrategy.load_checkpoint(
        root, trusted=["training_support.training_fn"], hooks=[])
    report = ["loaded", restored.step_count]
except Exception as err:
    report = [type(err).__name__, str(err)]
print(json.dumps(report))
s.leave_process_group()
"""


def test_a_copy_one_replica_finds_damaged_as_it_reads_raises_on_every_rank(
    tmp_path: Path,
) -> None:
    """Both nodes list index 0, so the ranks agree on it; rank 1's copy then fails its
    checksum as it is read. Before, rank 1 raised alone and rank 0 returned the loaded
    strategy, to train on and wait in DDP's first allreduce until the group's timeout (30
    minutes by default). Now rank 0 raises too, naming rank 1 and its error."""
    outputs = support.run_two_ranks(DAMAGED_SCRIPT, tmp_path, tmp_path / "pg")
    rank_0, rank_1 = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    assert rank_1[0] == "ChecksumMismatchError", rank_1
    assert rank_0[0] == "RuntimeError", rank_0
    assert "failed on rank 1: ChecksumMismatchError" in rank_0[1], rank_0
    assert "none trains alone" in rank_0[1], rank_0


NEVER_SAVED_SCRIPT = """
import json, sys, warnings, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fastckpt, training_support as s
base, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
report = {}
for name, wrap in (("own", lambda m: m), ("ddp", DDP)):
    torch.manual_seed(rank)
    hook = fastckpt.CheckpointHook(f"{base}/{name}{rank}", step_interval=2)
    strategy = fastckpt.TrainingStrategy(
        wrap(s.DropoutMLP(p=0.0)), fastckpt.OptimizerConfig(torch.optim.SGD, {"lr": 0.05}),
        training_fn=s.training_fn, num_steps=2, hooks=[hook],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.run(s.loader(seed=rank))
    hook.close()
    report[name] = [str(w.message) for w in caught if "never saved" in str(w.message)]
print(json.dumps(report))
s.leave_process_group()
"""


def test_a_hook_that_never_saves_a_ranks_own_models_says_so(tmp_path: Path) -> None:
    """``CheckpointHook`` keeps ranks other than 0 from saving by default
    (``rank_zero_only=True``). For DDP replicas that is right (rank 0's checkpoints hold
    them); for a rank's own models (a run of a sweep) no checkpoint of them is ever written,
    and before, nothing said so. Now rank 1 is warned, naming ``rank_zero_only=False``; DDP
    replicas and rank 0 are not."""
    outputs = support.run_two_ranks(NEVER_SAVED_SCRIPT, tmp_path, tmp_path / "pg")
    rank_0, rank_1 = (json.loads(out.strip().splitlines()[-1]) for out in outputs)
    assert rank_0 == {"own": [], "ddp": []}, rank_0
    assert rank_1["ddp"] == [], rank_1
    assert len(rank_1["own"]) == 1, rank_1
    assert "on rank 1 of 2" in rank_1["own"][0] and "rank_zero_only=False" in rank_1["own"][0]
    assert not (tmp_path / "own1").exists()


LOAD_LATEST_ALONE_SCRIPT = """
import json, os, sys, time, torch, torch.distributed as dist
import fastckpt, training_support as s
base, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[3]}", rank=rank, world_size=2)
done = f"{base}/rank0-done"
config = fastckpt.CheckpointManager.Config.with_sync_save()
config.save.writer_config.checkpoint_write_barrier_timeout_sec = 5
config.tiers = fastckpt.TiersConfig(fast=f"{base}/fast", durable=f"{base}/durable")
manager = config.build()
manager.save(f"{base}/fast/step_1", {"x": torch.ones(2)})  # collective: every rank
if rank == 0:  # then an evaluation on rank 0 alone forgets that load_latest is collective
    started = time.monotonic()
    try:
        manager.load_latest()
        report = ["loaded"]
    except Exception as err:
        report = [type(err).__name__, str(err), time.monotonic() - started]
    open(done, "w").close()
    print(json.dumps(report))
else:
    while not os.path.exists(done):
        time.sleep(0.1)
    print(json.dumps(["waited"]))
os._exit(0)
"""


def test_load_latest_on_one_rank_alone_explains_its_collective(tmp_path: Path) -> None:
    """Rank 0 evaluating alone with a collective manager: ``load_latest`` is collective and
    waited for rank 1 until the group's timeout, then raised gloo's bare error. Now the
    error says the load is collective, nothing was loaded, and how to load on one rank."""
    outputs = support.run_two_ranks(LOAD_LATEST_ALONE_SCRIPT, tmp_path, tmp_path / "pg")
    rank_0 = json.loads(outputs[0].strip().splitlines()[-1])
    assert rank_0[0] == "RuntimeError", rank_0
    assert "load_latest under a process group of 2 ranks is collective" in rank_0[1], rank_0
    assert "Nothing was loaded" in rank_0[1] and "Config.collective=False" in rank_0[1]
    assert rank_0[2] < 60, rank_0
