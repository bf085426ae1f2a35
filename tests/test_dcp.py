"""fastckpt as the storage layer of torch.distributed.checkpoint (issue 12, part 1 and tools).

Real gloo process groups (2 and 3 ranks, spawned here), real FSDP2, real DCP planners, real
safetensors and torch's own safetensors consolidation; single-process checks use DCP's
no-process-group mode.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fastckpt
import fastckpt.dcp
from dcp_support import build_model, check_ok, compare, full_state, launch, train_step
from fastckpt.container.sharded.commit import RECORD_NAME, generation_dirs, read_record
from fastckpt.format.records import seal_manifest
from training_support import run_two_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """ROOT/sync (dcp.save) and ROOT/async (dcp.async_save) from a 2-rank FSDP2 run."""
    root = tmp_path_factory.mktemp("dcp")
    outputs = run_two_ranks(
        "import dcp_ranks; dcp_ranks.save_fsdp()", root, root / "rendezvous-save"
    )
    losses = json.loads(outputs[0])["losses"]
    return root, losses


@pytest.fixture(scope="module")
def loaded_on_3(saved: tuple[Path, list[float]]) -> list[dict[str, Any]]:
    """Each rank's report from loading ROOT/sync on 3 FSDP2 ranks."""
    root, _ = saved
    outputs = check_ok(launch("load_fsdp", root, 3))
    return [json.loads(out) for out in outputs]


def _generation(checkpoint: Path) -> Path:
    record = json.loads((checkpoint / RECORD_NAME).read_text())
    return checkpoint / record["generation"]


def _plain_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optimizer)
    extra = {"step": 0, "tag": "", "loss": 0.0, "blob": io.BytesIO()}
    return {"model": msd, "optim": osd, "tp": {"weight": torch.zeros(13, 29)}, "extra": extra}


def _load_on_one_rank(checkpoint: Path) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = _plain_state(model, optimizer)
    dcp.load(state, storage_reader=fastckpt.dcp.Reader(checkpoint))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return model, optimizer, state


# ------------------------------------------------------------------------- FSDP2 round trips


def test_fsdp2_saved_on_2_ranks_loads_on_3_bitwise_and_trains_on(
    saved: tuple[Path, list[float]], loaded_on_3: list[dict[str, Any]]
) -> None:
    _, losses = saved
    rank0 = loaded_on_3[0]
    assert rank0["n_tensors"] == 24  # 6 parameters + AdamW step/exp_avg/exp_avg_sq each
    assert rank0["bad"] == []
    assert all(report["tp_ok"] for report in loaded_on_3)  # Shard(1) TP weight, resharded
    assert rank0["extra"] == {"step": 2, "tag": "run-1", "loss": losses[1]}
    assert rank0["blob"] == "\x00raw\xff"
    # the next step on 3 ranks continues the 2-rank run
    assert rank0["loss"] == pytest.approx(losses[2], rel=1e-5)
    assert rank0["resumed_close"]
    # fastckpt.dcp.async_save_state on 2 ranks -> load_state(strict=True) on 3
    assert rank0["manager_bad"] == []
    assert all(report["manager_step"] == 3 for report in loaded_on_3)


def test_resharded_load_reads_only_the_rows_each_rank_needs(
    saved: tuple[Path, list[float]], loaded_on_3: list[dict[str, Any]]
) -> None:
    root, _ = saved
    stored = sum(f.stat().st_size for f in _generation(root / "sync").iterdir())
    for report in loaded_on_3:
        assert 0 < report["bytes_read"] < 0.5 * stored, report
    assert sum(r["bytes_read"] for r in loaded_on_3) < 1.2 * stored


def test_fsdp2_checkpoints_load_on_one_rank_bitwise(saved: tuple[Path, list[float]]) -> None:
    root, losses = saved
    model, optimizer, state = _load_on_one_rank(root / "sync")
    reference = safetensors.torch.load_file(root / "reference-sync.safetensors")
    assert compare(reference, full_state(model, optimizer)) == []
    assert torch.equal(state["tp"]["weight"], torch.arange(13 * 29).reshape(13, 29) / 7)
    assert state["extra"]["step"] == 2 and state["extra"]["blob"].getvalue() == b"\x00raw\xff"
    assert train_step(model, optimizer, 2) == pytest.approx(losses[2], rel=1e-5)

    # async_save: the snapshot taken at staging, although training changed every tensor after
    model, optimizer, state = _load_on_one_rank(root / "async")
    reference = safetensors.torch.load_file(root / "reference-async.safetensors")
    assert compare(reference, full_state(model, optimizer)) == []
    assert state["extra"]["step"] == 3 and state["extra"]["blob"].getvalue() == b"three"
    assert train_step(model, optimizer, 3) == pytest.approx(losses[3], rel=1e-5)


# ------------------------------------------------------------------------- files and tools


def test_rank_files_open_with_safetensors_and_torch_consolidation(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    root, _ = saved
    generation = _generation(root / "sync")
    files = sorted(generation.glob("*.safetensors"))
    assert [f.name for f in files] == ["rank-00000.safetensors", "rank-00001.safetensors"]
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            sharding = json.loads(handle.metadata()["DCP_SHARDING_INFO"])
            keys = handle.keys()
            assert set(sharding) == set(keys)
            for key in keys:
                assert len(sharding[key]["saved_offsets"]) == len(handle.get_slice(key).get_shape())
    reference = safetensors.torch.load_file(root / "reference-sync.safetensors")
    model_keys = [k for k in reference if k.startswith("model.")]
    consolidate_safetensors_files(str(generation), str(tmp_path), dict.fromkeys(model_keys, 1))
    (output,) = tmp_path.glob("*.safetensors")
    consolidated = safetensors.torch.load_file(output)
    assert compare({k: reference[k] for k in model_keys}, consolidated) == []
    # torch's safetensors reader resharding the same files (into one process)
    target = {
        "model": {k.removeprefix("model."): torch.zeros_like(reference[k]) for k in model_keys}
    }
    dcp.load(target, storage_reader=HuggingFaceStorageReader(str(generation)))
    assert (
        compare(
            {k: reference[k] for k in model_keys},
            {f"model.{k}": v for k, v in target["model"].items()},
        )
        == []
    )


def test_consolidate_writes_full_tensors_without_a_process_group(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    root, _ = saved
    summary = fastckpt.dcp.consolidate(root / "sync", tmp_path / "full.safetensors")
    full = fastckpt.load_file(tmp_path / "full.safetensors")
    reference = safetensors.torch.load_file(root / "reference-sync.safetensors")
    renamed = {k.replace("optim.state.", "optim.", 1): v for k, v in full.items()}
    assert compare(reference, {k: renamed[k] for k in reference}) == []
    assert torch.equal(full["tp.weight"], torch.arange(13 * 29).reshape(13, 29) / 7)
    assert summary["tensors"] == len(full) == 25
    values = json.loads(
        fastckpt.read_metadata(tmp_path / "full.safetensors")["metadata"][
            "fastckpt.container.sharded.values"
        ]
    )
    assert values["extra.step"] == {"json": 2}
    assert values["optim.param_groups.0.lr"] == {"json": 0.01}


def test_no_file_in_the_checkpoint_is_a_pickle(saved: tuple[Path, list[float]]) -> None:
    root, _ = saved
    checkpoint = root / "sync"
    files = [p for p in checkpoint.rglob("*") if p.is_file()]
    assert len(files) == 4
    for path in files:
        raw = path.read_bytes()
        assert not raw.startswith((b"\x80", b"PK")), path  # pickle protocol >= 2, torch.save
        if path.name == RECORD_NAME:
            json.loads(raw)
        elif path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt"):
                pass
        else:
            assert path.suffix == ".values"
            with pytest.raises(pickle.UnpicklingError):
                pickle.loads(raw)


class _Payload:
    """Unpickling this creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _load_failure(checkpoint: Path) -> BaseException:
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(CheckpointException) as caught:
        dcp.load(_plain_state(model, optimizer), storage_reader=fastckpt.dcp.Reader(checkpoint))
    return caught.value


def test_pickle_payload_in_any_non_tensor_file_runs_nothing(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    root, _ = saved
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(root / "sync", checkpoint)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    record_path = checkpoint / RECORD_NAME
    record = record_path.read_bytes()
    (values_path,) = _generation(checkpoint).glob("*.values")

    record_path.write_bytes(payload)
    with pytest.raises(fastckpt.CheckpointFormatError, match=RECORD_NAME):
        read_record(checkpoint)
    (error, _), *_ = _load_failure(checkpoint).failures.values()  # type: ignore[attr-defined]
    assert isinstance(error, fastckpt.CheckpointFormatError) and RECORD_NAME in str(error)
    record_path.write_bytes(record)

    values_path.write_bytes(payload.ljust(values_path.stat().st_size))  # same size, other bytes
    failure = _load_failure(checkpoint)
    (error, _), *_ = failure.failures.values()  # type: ignore[attr-defined]
    assert isinstance(error, fastckpt.ChecksumMismatchError)
    assert values_path.name in str(error)

    # a consistent forgery (payload plus matching checksums in the record) is still refused
    values_path.write_bytes(payload)
    data = json.loads(record)
    for item in data["dcp"]["storage_data"]:
        if item["file"] == values_path.name:
            item.update(byte_offset=0, length=len(payload), crc32c=fastckpt._native.crc32c(payload))
    data["files"][values_path.name] = {"size": len(payload), "crc32c": None}
    record_path.write_text(json.dumps(seal_manifest(data)))  # the record's checksum, too
    failure = _load_failure(checkpoint)
    (error, _), *_ = failure.failures.values()  # type: ignore[attr-defined]
    assert isinstance(error, fastckpt.CheckpointFormatError)
    assert "not JSON" in str(error)
    assert not marker.exists()


def test_flipped_byte_raises_checksum_mismatch_naming_file_and_tensor(
    saved: tuple[Path, list[float]], tmp_path: Path
) -> None:
    root, _ = saved
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(root / "sync", checkpoint)
    file = _generation(checkpoint) / "rank-00001.safetensors"
    header = fastckpt.read_metadata(file)
    begin, _ = header["tensors"]["model.0.weight"]["data_offsets"]
    with open(file, "r+b") as handle:
        handle.seek(header["data_start"] + begin + 5)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    failure = _load_failure(checkpoint)
    (error, _), *_ = failure.failures.values()  # type: ignore[attr-defined]
    assert isinstance(error, fastckpt.ChecksumMismatchError)
    assert "rank-00001.safetensors" in str(error) and "model.0.weight" in str(error)
    report = fastckpt.dcp.verify_sharded(checkpoint)
    assert not report.ok
    assert [f.path.name for f in report.failures] == ["rank-00001.safetensors"]
    assert fastckpt.dcp.verify_sharded(root / "sync").ok


# ------------------------------------------------------------------------- commit protocol


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    results = launch("torn_save", checkpoint, 2)
    assert results[1][0] == -9, results[1][2][-2000:]
    assert results[0][0] == 0 and results[0][1].startswith("failed"), results[0]
    described = fastckpt.dcp.describe_sharded(checkpoint)
    (torn,) = described["uncommitted"]
    assert (checkpoint / torn / "rank-00001.safetensors").exists()  # written, never committed
    state = {"r0": torch.zeros(64, 3), "r1": torch.zeros(64, 3)}
    dcp.load(state, storage_reader=fastckpt.dcp.Reader(checkpoint))
    assert torch.equal(state["r0"], torch.ones(64, 3)) and torch.equal(state["r1"], state["r0"])
    assert fastckpt.dcp.verify_sharded(checkpoint).ok

    dcp.save({"r0": torch.full((2,), 3.0)}, storage_writer=fastckpt.dcp.Writer(checkpoint))
    assert [d.name for d in generation_dirs(checkpoint)] == [_generation(checkpoint).name]


def test_a_rank_killed_mid_save_state_is_a_failure_saying_nothing_was_committed(
    tmp_path: Path,
) -> None:
    # Before: gloo's bare RuntimeError ("Connection closed by peer"), naming neither the
    # checkpoint nor whether the save had been committed.
    checkpoint = tmp_path / "ckpt"
    results = launch("torn_save_state", checkpoint, 2)
    assert results[1][0] == -9, results[1][2][-2000:]
    assert results[0][0] == 0, results[0]
    kind, message = results[0][1].split("\n", 1)
    assert kind == "RuntimeError", results[0][1]
    assert str(checkpoint) in message and "collective of torch.distributed" in message
    assert "was not committed" in message and "the previous one stands" in message
    state = {"r0": torch.zeros(64, 3), "r1": torch.zeros(64, 3)}
    dcp.load(state, storage_reader=fastckpt.dcp.Reader(checkpoint))
    assert torch.equal(state["r0"], torch.ones(64, 3)) and torch.equal(state["r1"], state["r0"])


def test_a_runtime_error_of_a_single_process_save_is_not_called_a_collective_failure(
    tmp_path: Path,
) -> None:
    # Only a save with peers can lose one: a Stateful's own RuntimeError passes unchanged.
    class Failing:
        def state_dict(self) -> dict[str, Any]:
            raise RuntimeError("the user's own failure")

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(RuntimeError, match=r"^the user's own failure$"):
        fastckpt.dcp.save_state(tmp_path / "ckpt", {"s": Failing(), "w": torch.ones(2)})


def test_never_committed_directory_raises_not_committed(tmp_path: Path) -> None:
    (tmp_path / "g0000000000001-0123abcd").mkdir()
    with pytest.raises(fastckpt.dcp.NotCommittedError, match="interrupted save"):
        read_record(tmp_path)
    with pytest.raises(CheckpointException) as caught:  # dcp.load: the typed error inside
        dcp.load({"w": torch.zeros(1)}, storage_reader=fastckpt.dcp.Reader(tmp_path))
    (error, _), *_ = caught.value.failures.values()
    assert isinstance(error, fastckpt.dcp.NotCommittedError)
    with pytest.raises(fastckpt.dcp.NotCommittedError, match="interrupted save"):
        fastckpt.dcp.load_state(tmp_path)
    assert not fastckpt.dcp.verify_sharded(tmp_path).ok


def test_overwriting_a_checkpoint_id_switches_atomically(tmp_path: Path) -> None:
    writer = fastckpt.dcp.Writer(tmp_path, block_bytes=64)
    dcp.save({"w": torch.zeros(40, 3), "n": 1}, storage_writer=writer)
    first = _generation(tmp_path)
    dcp.save({"w": torch.arange(120.0).reshape(40, 3), "n": 2}, storage_writer=writer)
    assert not first.exists() and len(generation_dirs(tmp_path)) == 1
    state: dict[str, Any] = {"w": torch.zeros(40, 3), "n": 0}
    reader = fastckpt.dcp.Reader(tmp_path)
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"], torch.arange(120.0).reshape(40, 3)) and state["n"] == 2


# ------------------------------------------------------------------------- values and edge cases


def test_values_edge_tensors_and_partial_reads_round_trip(tmp_path: Path) -> None:
    state = {
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "ints": torch.arange(10, dtype=torch.int64),
        "bf16": torch.randn(33, 5).to(torch.bfloat16),
        "meta": {"t": (1, 2.0, "x"), "nan": math.nan, "none": None, "flags": [True, False]},
        "raw": b"\x00\x01",
        "stream": io.BytesIO(b"stream bytes"),
    }
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(tmp_path, block_bytes=16))
    target: dict[str, Any] = {
        "scalar": torch.tensor(0.0, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "ints": torch.zeros(10, dtype=torch.int64),
        "bf16": torch.zeros(33, 5, dtype=torch.bfloat16),
        "meta": {"t": None, "nan": 0.0, "none": 1, "flags": None},
        "raw": None,
        "stream": None,
    }
    dcp.load(target, storage_reader=fastckpt.dcp.Reader(tmp_path))
    for key in ("scalar", "empty", "ints", "bf16"):
        assert compare({key: state[key]}, {key: target[key]}) == []
    assert target["meta"]["t"] == (1, 2.0, "x") and math.isnan(target["meta"]["nan"])
    assert target["meta"]["none"] is None and target["meta"]["flags"] == [True, False]
    assert target["raw"] == b"\x00\x01" and target["stream"].getvalue() == b"stream bytes"


def test_value_that_needs_pickle_is_refused_before_anything_commits(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2), "bad": {1, 2}}, storage_writer=fastckpt.dcp.Writer(tmp_path))
    (error, _), *_ = caught.value.failures.values()  # type: ignore[attr-defined]
    assert isinstance(error, fastckpt.dcp.UnsupportedValueError)
    assert "bad" in str(error)
    assert not (tmp_path / RECORD_NAME).exists()


def test_stager_reuses_buffers_only_after_release() -> None:
    stager = fastckpt.dcp.DcpStager()
    live = {"a": torch.ones(4), "nested": {"b": torch.zeros(3)}, "v": io.BytesIO(b"x")}
    first = stager.stage(live)
    live["a"].add_(1)
    assert torch.equal(first["a"], torch.ones(4))  # a snapshot, not a view
    second = stager.stage(live)  # first not released: fresh buffers
    assert second["a"].data_ptr() != first["a"].data_ptr()
    stager.release()
    third = stager.stage(live)
    assert third["a"].data_ptr() == second["a"].data_ptr()
    assert torch.equal(third["a"], torch.full((4,), 2.0)) and third["v"].getvalue() == b"x"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert isinstance(fastckpt.dcp.Writer(Path("x")), dcp.staging.AsyncStager)


def test_sharded_benchmark_compares_all_backends(tmp_path: Path) -> None:
    from fastckpt.bench.sharded import BACKENDS, ShardedConfig, format_report, run_sharded

    report = run_sharded(ShardedConfig(size_mib=2, repeats=1, work_dir=tmp_path, cold=False))
    assert list(report["rows"]) == list(BACKENDS)
    for row in report["rows"].values():
        assert all(row[op]["median"] > 0 for op in ("save_s", "load_s", "stall_s")), row
    assert report["cache"] == "warm"
    assert "save_speedup_vs_dcp-1t" in format_report(report)
    assert list(tmp_path.iterdir()) == []  # the run cleans up after itself


def test_overlapping_async_saves_with_one_writer_commit_one_whole_state(tmp_path: Path) -> None:
    writer = fastckpt.dcp.Writer(tmp_path)
    states = [{"w": torch.full((256, 64), float(i)), "i": i} for i in range(3)]
    futures = [dcp.async_save(state, storage_writer=writer) for state in states]
    outcomes = []
    for future in futures:
        try:
            future.result()  # type: ignore[union-attr]
            outcomes.append("ok")
        except BaseException as err:  # an older save whose generation a newer commit removed
            assert "nothing was committed" in str(err) or isinstance(err, CheckpointException)
            outcomes.append("failed")
    assert "ok" in outcomes
    target: dict[str, Any] = {"w": torch.zeros(256, 64), "i": -1}
    dcp.load(target, storage_reader=fastckpt.dcp.Reader(tmp_path))
    assert torch.equal(target["w"], states[target["i"]]["w"])
    assert fastckpt.dcp.verify_sharded(tmp_path).ok


def test_load_state_full_tensors_and_typed_mismatches(saved: tuple[Path, list[float]]) -> None:
    root, _ = saved
    checkpoint = root / "manager-sync"
    assert fastckpt.dcp.is_sharded_checkpoint(checkpoint)
    assert not fastckpt.dcp.is_sharded_checkpoint(root)
    everything = fastckpt.dcp.load_state(checkpoint)  # no templates: full, unsharded tensors
    reference = safetensors.torch.load_file(root / "reference-sync.safetensors")
    assert sorted(everything) == ["extra", "model", "optim", "tp"]
    assert (
        compare(
            {k: v for k, v in reference.items() if k.startswith("model.")},
            {f"model.{k}": v for k, v in everything["model"].items()},
        )
        == []
    )
    assert everything["extra"]["step"] == 2
    assert everything["extra"]["blob"].getvalue() == b"\x00raw\xff"

    with pytest.raises(fastckpt.CheckpointMismatchError, match=r"model\.0\.weight.*\[301, 37\]"):
        fastckpt.dcp.load_state(checkpoint, into={"model": {"0.weight": torch.zeros(3, 3)}})
    with pytest.raises(fastckpt.CheckpointMismatchError, match=r"model\.9\.weight"):
        fastckpt.dcp.load_state(
            checkpoint, into={"model": {"9.weight": torch.zeros(1)}}, strict=True
        )
    with pytest.raises(fastckpt.CheckpointMismatchError, match="nope"):
        fastckpt.dcp.load_state(checkpoint, into={"nope": {}}, strict=True)
    kept = fastckpt.dcp.load_state(
        checkpoint, into={"nope": "as is", "extra": {"step": 0, "tag": None}}
    )
    assert kept == {"nope": "as is", "extra": {"step": 2, "tag": "run-1"}}
    # strict is two-way for tensors: a template leaving saved tensors of its key out is
    # refused (before: left unloaded, e.g. a fresh optimizer's empty state); plain values
    # (the step, tag, loss and BytesIO blob of "extra") may be left out.
    partial = {"model": {"0.weight": torch.zeros(301, 37)}}
    with pytest.raises(
        fastckpt.CheckpointMismatchError, match=r"\d+ tensors the templates lack \('model\.0\.bias'"
    ):
        fastckpt.dcp.load_state(checkpoint, into=partial, strict=True)
    fastckpt.dcp.load_state(checkpoint, into=partial)  # not strict: a partial load
    assert fastckpt.dcp.load_state(checkpoint, into={"extra": {"step": 0}}, strict=True) == {
        "extra": {"step": 2}
    }
    assert fastckpt.dcp.contains_dtensors({"a": [1, {"b": torch.ones(1)}]}) is False


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_templates_that_cannot_hold_the_state_are_refused_before_any_is_filled(
    tmp_path: Path,
) -> None:
    """Before: an expanded template made DCP's copy fail with a bare RuntimeError after the
    templates before it were filled (a half-filled state), a meta template raised DCP's
    "default process group has not been initialized", and two templates sharing memory
    came back holding each other's values."""
    checkpoint = tmp_path / "c"
    saved = {"a": torch.ones(3, 4), "z": torch.arange(12.0).reshape(3, 4)}
    fastckpt.dcp.save_state(checkpoint, {"m": saved, "step": 10})
    buffer = torch.full((24,), -1.0)
    for bad, message in (
        (torch.full((1, 4), -1.0).expand(3, 4), r"m\.z: the template's elements share memory"),
        (torch.empty(3, 4, device="meta"), r"m\.z: a meta tensor holds no memory"),
        (buffer[6:18].view(3, 4), r"m\.a and m\.z: the templates share part of their memory"),
    ):
        into = {"m": {"a": buffer[:12].view(3, 4), "z": bad}, "step": 0}
        with pytest.raises(TypeError, match=message):
            fastckpt.dcp.load_state(checkpoint, into=into)
        assert bool((buffer == -1).all()) and into["step"] == 0  # nothing filled
    into = {"m": {"a": buffer[:12].view(3, 4), "z": buffer[12:].view(3, 4)}, "step": 0}
    assert fastckpt.dcp.load_state(checkpoint, into=into)["step"] == 10
    assert torch.equal(buffer, torch.cat([saved["a"].flatten(), saved["z"].flatten()]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_one_directory_never_holds_a_torch_and_a_fastckpt_checkpoint(tmp_path: Path) -> None:
    """Before: a fastckpt save into a FileSystemWriter checkpoint's directory left both, and
    ``dcp.load(checkpoint_id=)`` kept loading the older torch state; a torch save into a
    fastckpt directory made fastckpt's Reader load its older generation, without a word."""
    torch_dir, ours = tmp_path / "torch", tmp_path / "ours"
    dcp.save({"w": torch.zeros(2), "step": 1}, checkpoint_id=torch_dir)
    before = sorted(os.listdir(torch_dir))
    with pytest.raises(CheckpointException, match=r"FileSystemWriter \(\.metadata\).*new"):
        dcp.save({"w": torch.ones(2), "step": 2}, storage_writer=fastckpt.dcp.Writer(torch_dir))
    assert sorted(os.listdir(torch_dir)) == before  # nothing written beside it
    fastckpt.dcp.save_state(ours, {"w": torch.ones(2), "step": 2})
    dcp.save({"w": torch.full((2,), 3.0), "step": 3}, checkpoint_id=ours)
    template = {"w": torch.zeros(2), "step": 0}
    with pytest.raises(fastckpt.CheckpointFormatError, match=r"cannot load it.*FileSystemWriter"):
        fastckpt.dcp.load_state(ours, into=template)
    with pytest.raises(CheckpointException, match="cannot load it"):
        dcp.load(template, storage_reader=fastckpt.dcp.Reader(ours))
    assert torch.equal(template["w"], torch.zeros(2))


def test_dcp_stream_transforms_are_refused_naming_the_alternative(tmp_path: Path) -> None:
    """DCP's ``_extensions`` (ZStandard compression...) are refused at construction, typed and
    named, instead of an unexpected-keyword ``TypeError``; nothing is written."""
    extension = pytest.importorskip("torch.distributed.checkpoint._extension")
    # Made without its constructor, which needs the optional zstandard package.
    zstd = object.__new__(extension.ZStandard)
    with pytest.raises(ValueError, match=r"ZStandard.*FileSystemWriter\(path, _extensions"):
        fastckpt.dcp.Writer(tmp_path / "c", _extensions=[zstd])
    assert not (tmp_path / "c").exists()
    fastckpt.dcp.Writer(tmp_path / "c", _extensions=[])  # none given: the plain writer


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_two_dimensional_float4_tensor_round_trips(tmp_path: Path) -> None:
    """An ``F4`` chunk's record holds the safetensors header's shape, which counts 4-bit
    values where torch's ``float4_e2m1fn_x2`` holds pairs: reads use the torch shape. Before,
    a 2-D one saved without error and every load and ``consolidate`` refused it as damaged
    ("range 0-24 outside 'w'")."""
    raw = torch.arange(12, dtype=torch.uint8).reshape(3, 4)

    def template() -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(3, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)}

    checkpoint = tmp_path / "ckpt"
    dcp.save(
        {"w": raw.view(torch.float4_e2m1fn_x2)}, storage_writer=fastckpt.dcp.Writer(checkpoint)
    )
    out = template()
    dcp.load(out, storage_reader=fastckpt.dcp.Reader(checkpoint))
    assert torch.equal(out["w"].view(torch.uint8), raw)
    loaded = fastckpt.dcp.load_state(checkpoint, template())
    assert torch.equal(loaded["w"].view(torch.uint8), raw)
    fastckpt.dcp.consolidate(checkpoint, tmp_path / "full.safetensors")
    assert torch.equal(
        fastckpt.load_file(tmp_path / "full.safetensors")["w"].view(torch.uint8), raw
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_async_save_stages_keys_whose_dotted_paths_collide_apart(tmp_path: Path) -> None:
    """``{"": {"x": a}, "x": b}``: DCP names them ``.x`` and ``x``; the async stager named
    both buffers ``x`` and saved ``b`` twice, without an error. Buffers are named by key
    tuples now."""
    checkpoint = tmp_path / "ckpt"
    state = {"": {"x": torch.full((3,), 1.0)}, "x": torch.full((3,), 2.0)}
    dcp.async_save(state, storage_writer=fastckpt.dcp.Writer(checkpoint)).result()
    out = {"": {"x": torch.zeros(3)}, "x": torch.zeros(3)}
    dcp.load(out, storage_reader=fastckpt.dcp.Reader(checkpoint))
    assert out[""]["x"].tolist() == [1.0] * 3 and out["x"].tolist() == [2.0] * 3


def test_a_plain_value_template_for_a_saved_tensor_is_a_mismatch(tmp_path: Path) -> None:
    """``load_state`` with a plain value where the checkpoint holds a tensor raises the
    documented ``CheckpointMismatchError`` naming the key (before: DCP's bare ValueError)."""
    fastckpt.dcp.save_state(tmp_path / "c", {"model": {"w": torch.arange(3.0)}})
    with pytest.raises(
        fastckpt.CheckpointMismatchError, match=r"model\.w: the checkpoint has a tensor"
    ):
        fastckpt.dcp.load_state(tmp_path / "c", {"model": {"w": 0}})


def test_a_key_that_is_no_str_is_warned_of_at_save(tmp_path: Path) -> None:
    """DCP names entries by their key path as text: a plain ``optimizer.state_dict()`` saved
    sharded came back from a load without templates with ``'0'`` for ``0``, and
    ``optimizer.load_state_dict`` dropped that state without a word. The save warns now,
    naming the key; a load into the optimizer's own state dict is exact."""
    from fastckpt.dcp.state import load_state, save_state

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with pytest.warns(UserWarning, match=r"'optim\.state\.0' is not a str"):
        save_state(tmp_path / "c", {"optim": optimizer.state_dict()})
    assert sorted(load_state(tmp_path / "c")["optim"]["state"]) == ["0", "1"]
    fresh = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    fresh.step()
    template = fresh.state_dict()
    loaded = load_state(tmp_path / "c", into={"optim": template})["optim"]
    assert sorted(loaded["state"]) == [0, 1]
    for index in (0, 1):
        saved = optimizer.state_dict()["state"][index]["exp_avg"]
        assert torch.equal(loaded["state"][index]["exp_avg"], saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*single process.*")
        save_state(tmp_path / "d", {"model": model.state_dict()})  # str keys: no warning
