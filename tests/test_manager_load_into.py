"""CheckpointManager.load(into=...) reads tensors straight into the templates' memory
(positional reads, crc32c on the same pass): bit-exact, the templates themselves returned,
damage named by file and tensor, and the copy path kept where a template cannot take a direct
read (non-contiguous, mismatched, overlapping, stateful)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt.manager as manager_module
import fastckpt.manager.load as manager_load
from fastckpt import CheckpointMismatchError, ChecksumMismatchError
from fastckpt.io.files import read_metadata
from fastckpt.manager import CheckpointManager


def _sync() -> CheckpointManager:
    return CheckpointManager(CheckpointManager.Config.with_sync_save())


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def _state() -> dict[str, Any]:
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64]
    dtypes += [torch.int8, torch.uint8, torch.bool, torch.complex64]
    model = {f"t_{str(d).split('.')[-1]}": _random((5, 7), d, i) for i, d in enumerate(dtypes)}
    model["scalar"] = torch.tensor(3.5)  # 0-d
    model["empty"] = torch.empty(0, 4)
    # Several 4 MiB read pieces, read by several threads.
    model["big"] = _random((3, 1_500_001), torch.float32, 99)
    optim = {
        "state": {0: {"step": torch.tensor(10.0), "exp_avg": _random((64,), torch.float32, 1)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    return {"model": model, "optim": optim, "step": 7}


def _templates(state: dict[str, Any]) -> dict[str, Any]:
    def blank(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        if isinstance(value, dict):
            return {key: blank(item) for key, item in value.items()}
        if isinstance(value, list):
            return [blank(item) for item in value]
        return value

    return {key: blank(value) for key, value in state.items()}


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """The direct reads made: (file, tensor names) per call. An item holding tensors may not
    take the mapped path (items of plain values, with no tensor to read into, may)."""
    calls: list[tuple[str, list[str]]] = []
    real_read = manager_load._native.read_into
    real_load = manager_module._load_item

    def spy(path: str, tensors: Any, *args: Any, **kwargs: Any) -> int:
        calls.append((path, [entry[0] for entry in tensors]))
        return real_read(path, tensors, *args, **kwargs)

    def mapped(directory: Path, record: Any, key: str, *args: Any) -> Any:
        value = real_load(directory, record, key, *args)
        assert not list(_leaves(value)), f"item {key!r} took the mapped path"
        return value

    monkeypatch.setattr(manager_load._native, "read_into", spy)
    monkeypatch.setattr(manager_module, "_load_item", mapped)
    return calls


def test_round_trip_is_bit_exact_into_the_templates_themselves(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    state = _state()
    templates = _templates(state)
    pointers = {path: tensor.data_ptr() for path, tensor in _leaves(templates)}
    objects = {path: tensor for path, tensor in _leaves(templates)}
    with _sync() as manager:
        manager.save(tmp_path / "c", state)
        loaded = manager.load(tmp_path / "c", into=templates)
    assert loaded["step"] == 7
    saved = dict(_leaves(state))
    for path, tensor in _leaves(loaded):
        assert tensor is objects[path], path
        assert tensor.data_ptr() == pointers[path], path
        assert tensor.dtype == saved[path].dtype and tensor.shape == saved[path].shape
        assert _bytes(tensor) == _bytes(saved[path]), path
    assert sorted(Path(path).name for path, _ in direct_reads) == [
        "model.safetensors",
        "optim.safetensors",
    ]
    model_read = next(names for path, names in direct_reads if path.endswith("model.safetensors"))
    assert "big" in model_read and "scalar" in model_read and "empty" in model_read


def test_a_flipped_byte_is_a_checksum_error_naming_file_and_tensor(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    state = _state()
    with _sync() as manager:
        manager.save(tmp_path / "c", state)
        path = tmp_path / "c" / "model.safetensors"
        header = read_metadata(path)
        begin, _ = header["tensors"]["big"]["data_offsets"]
        with open(path, "r+b") as handle:
            at = header["data_start"] + begin + 7_000_000
            handle.seek(at)
            byte = handle.read(1)
            handle.seek(at)
            handle.write(bytes([byte[0] ^ 0x20]))
        templates = _templates(state)
        with pytest.raises(ChecksumMismatchError) as caught:
            manager.load(tmp_path / "c", into=templates)
    message = str(caught.value)
    assert str(path) in message and "big" in message
    # The error says the templates were read into, and what to do before using them.
    assert "into={'model': ...}" in message and "partial bytes" in message
    assert "latest_intact" not in message and "fastckpt ls" in message


def test_a_file_that_differs_from_the_commit_record_is_refused(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    """A tensor file whose own checksums agree but which is not the recorded file (another
    checkpoint's, of the same size) is refused by the record's crc32c."""
    state = _state()
    other = _state()
    other["model"]["scalar"] = torch.tensor(4.5)
    with _sync() as manager, _sync() as separate:  # d: a full save, not linked to c
        manager.save(tmp_path / "c", state)
        separate.save(tmp_path / "d", other)
        os.replace(tmp_path / "d" / "model.safetensors", tmp_path / "c" / "model.safetensors")
        with pytest.raises(ChecksumMismatchError, match=r"model\.safetensors.*recorded"):
            manager.load(tmp_path / "c", into=_templates(state))


def test_templates_that_cannot_take_a_direct_read_are_copied(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    state = {
        "model": {
            "plain": torch.arange(12.0).reshape(3, 4),
            "strided": torch.arange(12.0).reshape(4, 3).t().contiguous(),
            "tied_a": torch.arange(6.0),
            "tied_b": torch.arange(6.0),
        }
    }
    strided = torch.zeros(4, 3).t()  # non-contiguous (3, 4)
    tied = torch.zeros(6)  # one template for two stored tensors
    plain = torch.zeros(3, 4)
    templates = {"model": {"plain": plain, "strided": strided, "tied_a": tied, "tied_b": tied}}
    with _sync() as manager:
        manager.save(tmp_path / "c", state)
        loaded = manager.load(tmp_path / "c", into=templates)
    assert not strided.is_contiguous()
    assert loaded["model"]["strided"] is strided
    assert torch.equal(strided, state["model"]["strided"])
    assert torch.equal(plain, state["model"]["plain"])
    assert loaded["model"]["tied_a"] is tied and torch.equal(tied, torch.arange(6.0))
    # One read of the file: "plain" into its template, the others into fresh memory.
    assert [sorted(names) for _, names in direct_reads] == [
        ["plain", "strided", "tied_a", "tied_b"]
    ]


def test_overlapping_templates_are_not_read_in_parallel() -> None:
    base = torch.zeros(10)
    direct = {"a": base[:6], "b": base[4:], "c": torch.zeros(3), "d": torch.zeros(0)}
    assert sorted(manager_load._without_overlaps(direct)) == ["c", "d"]


def test_a_dtype_or_shape_mismatch_still_raises(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    state = {"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}}
    with _sync() as manager:
        manager.save(tmp_path / "c", state)
        wrong_dtype = {"model": {"w": torch.empty(2, 3, dtype=torch.float64), "b": torch.empty(3)}}
        with pytest.raises(CheckpointMismatchError, match=r"model\.w.*float64"):
            manager.load(tmp_path / "c", into=wrong_dtype)
        wrong_shape = {"model": {"w": torch.empty(2, 3), "b": torch.empty(1)}}
        with pytest.raises(CheckpointMismatchError, match=r"model\.b"):
            manager.load(tmp_path / "c", into=wrong_shape)


def test_parameters_and_partial_templates(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    state = {"model": {"w": torch.randn(4, 4), "b": torch.randn(4)}}
    weight = torch.nn.Parameter(torch.zeros(4, 4))
    version = weight._version
    with _sync() as manager:
        manager.save(tmp_path / "c", state)
        loaded = manager.load(tmp_path / "c", into={"model": {"w": weight}})
    assert loaded == {"model": {"w": weight}}  # only the template's keys
    assert torch.equal(weight.detach(), state["model"]["w"]) and weight.requires_grad
    # The load counts as an in-place write (incremental saves rely on the version counter).
    assert weight._version > version


def test_a_module_and_a_none_template_are_restored(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": model, "extra": {"x": torch.ones(2)}})
        fresh = torch.nn.Linear(3, 2)
        loaded = manager.load(tmp_path / "c", into={"model": fresh, "extra": None})
    assert loaded["model"] is fresh
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert torch.equal(loaded["extra"]["x"], torch.ones(2))


def test_incremental_checkpoints_read_linked_files_directly(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    frozen = torch.randn(300, 300)
    state = {"model": {"frozen": frozen, "head": torch.randn(8)}}
    with _sync() as manager:
        manager.save(tmp_path / "step_1", state)
        state["model"]["head"] += 1
        manager.save(tmp_path / "step_2", state)
        linked = list((tmp_path / "step_2" / "linked").iterdir())
        assert linked, "the unchanged tensor was not linked"
        templates = {"model": {"frozen": torch.zeros(300, 300), "head": torch.zeros(8)}}
        manager.load(tmp_path / "step_2", into=templates)
        assert torch.equal(templates["model"]["frozen"], frozen)
        assert torch.equal(templates["model"]["head"], state["model"]["head"])
        assert any("linked" in path and "frozen" in names for path, names in direct_reads)
        linked[0].unlink()
        with pytest.raises(FileNotFoundError, match="hard link"):
            manager.load(tmp_path / "step_2", into=templates)


def test_templates_read_during_replacements_hold_one_saved_state(tmp_path: Path) -> None:
    """Another process replaces the checkpoint in a loop while this one loads it into
    templates: a read that raced a replacement is read again whole, so after every load all
    the templates hold one saved state, never a mixture."""
    from checkpoint_support import manager_state, trained

    first, second = manager_state(trained(1)), manager_state(trained(2))
    path = tmp_path / "ckpt"
    with _sync() as manager:
        manager.save(path, first)
    script = Path(__file__).parent / "replace_writer.py"
    writer = subprocess.Popen(
        [sys.executable, str(script), "manager", str(path), "25"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
    )
    templates = {"model": {name: torch.zeros_like(t) for name, t in first["model"].items()}}
    loads = 0
    try:
        with _sync() as manager:
            while writer.poll() is None or loads < 5:
                manager.load(path, into=templates)
                matches = [
                    all(torch.equal(templates["model"][n], t) for n, t in state["model"].items())
                    for state in (first, second)
                ]
                assert any(matches), f"load {loads} left a mixture in the templates"
                loads += 1
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait()
    assert writer.returncode == 0


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 300),
        torch.nn.BatchNorm1d(300),
        torch.nn.ReLU(),
        torch.nn.Linear(300, 8),
    )


def test_a_plain_module_is_read_into_directly_without_load_state_dict(
    tmp_path: Path, direct_reads: list[tuple[str, list[str]]]
) -> None:
    # Every parameter and buffer (num_batches_tracked included) takes its bytes in the one
    # verified read; load_state_dict, which would only copy each onto itself, is not called.
    torch.manual_seed(0)
    model = _net()
    model(torch.randn(16, 64))  # running statistics and num_batches_tracked move
    fresh = _net()
    pointers = {name: t.data_ptr() for name, t in fresh.state_dict(keep_vars=True).items()}
    versions = {name: t._version for name, t in fresh.state_dict(keep_vars=True).items()}

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("load_state_dict was called")

    fresh.load_state_dict = refuse  # type: ignore[assignment,method-assign]
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": model, "step": 3})
        loaded = manager.load(tmp_path / "c", into={"model": fresh, "step": None})
    assert loaded["model"] is fresh and loaded["step"] == 3
    for name, tensor in fresh.state_dict(keep_vars=True).items():
        assert tensor.data_ptr() == pointers[name], name
        assert _bytes(tensor) == _bytes(model.state_dict()[name]), name
        assert tensor._version > versions[name], name  # counted as an in-place write
    assert isinstance(fresh[0].weight, torch.nn.Parameter) and fresh[0].weight.requires_grad
    ((path, names),) = direct_reads
    assert path.endswith("model.safetensors")
    assert sorted(names) == sorted(model.state_dict())


def test_a_module_that_is_not_plain_keeps_its_load_state_dict(tmp_path: Path) -> None:
    # A load hook (it might rename or transform the state) and tied weights (a direct read
    # into both names would race) each keep the module's own load_state_dict.
    calls: list[str] = []
    model = _net()
    hooked = _net()
    hooked.register_load_state_dict_post_hook(lambda module, keys: calls.append("hook"))
    tied = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    tied[1].weight = tied[0].weight
    fresh_tied = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fresh_tied[1].weight = fresh_tied[0].weight
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": model, "tied": tied})
        manager.load(tmp_path / "c", into={"model": hooked, "tied": fresh_tied})
    assert calls == ["hook"]
    assert all(
        torch.equal(a, b)
        for a, b in zip(hooked.state_dict().values(), model.state_dict().values(), strict=True)
    )
    assert fresh_tied[1].weight is fresh_tied[0].weight
    assert torch.equal(fresh_tied[0].weight, tied[0].weight)


def test_a_damaged_module_file_is_refused_naming_the_module(tmp_path: Path) -> None:
    model = _net()
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": model})
        (path,) = (tmp_path / "c").rglob("model*.safetensors")
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatchError, match="partial bytes") as info:
            manager.load(tmp_path / "c", into={"model": _net()})
    assert "model" in str(info.value)


def test_a_template_that_cannot_hold_the_values_is_refused(tmp_path: Path) -> None:
    # A meta tensor came back untouched (no memory) with no error; an expanded one failed
    # with torch's bare RuntimeError.
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(tmp_path / "c", {"m": {"w": torch.arange(6.0)}})
        manager.save(tmp_path / "d", {"m": {"w": torch.arange(6.0).reshape(3, 2)}})
        for name, template, why in (
            ("c", torch.empty(6, device="meta"), "meta tensor"),
            ("c", torch.zeros(1).expand(6), "share memory"),
            # torch cannot tell at once ("too hard"): the offsets are counted. Before, the
            # load succeeded and the template held [[0, 2], [2, 4], [4, 5]].
            ("d", torch.zeros(4).unfold(0, 2, 1), "share memory"),
            # Before: torch's bare "Inplace update to inference tensor" naming no key.
            ("c", _inference_zeros(6), r"m\.w: an inference tensor"),
        ):
            with pytest.raises(TypeError, match=why):
                manager.load(tmp_path / name, into={"m": {"w": template}})
        good = torch.empty(6)
        manager.load(tmp_path / "c", into={"m": {"w": good}})
        assert torch.equal(good, torch.arange(6.0))
        strided = torch.zeros(6, 4)[:, ::2]  # "too hard" for torch, yet no element shared
        manager.load(tmp_path / "d", into={"m": {"w": strided[:3]}})
        assert torch.equal(strided[:3], torch.arange(6.0).reshape(3, 2))


def _inference_zeros(size: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(size)


def _snapshot(template: Any) -> dict[str, bytes]:
    """Every tensor a template holds (a module's parameters and buffers), as bytes."""
    if isinstance(template, torch.nn.Module):
        return {name: _bytes(t) for name, t in template.state_dict().items()}
    return {path: _bytes(t) for path, t in _leaves(template)}


@pytest.mark.parametrize("contiguous", [True, False], ids=["direct-read", "copied"])
def test_a_shape_mismatch_leaves_the_state_dict_template_untouched(
    tmp_path: Path, contiguous: bool
) -> None:
    # 0.weight fits and comes first, 0.bias does not: the header says so before any byte is
    # read, so 0.weight must not be overwritten (read into directly, or copied) either.
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(4, 4))
    weight = torch.randn(4, 4) if contiguous else torch.randn(4, 4).t()
    template = {"model": {"0.weight": weight, "0.bias": torch.zeros(5)}}
    before = _snapshot(template)
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": saved.state_dict()})
        with pytest.raises(CheckpointMismatchError, match=r"model\.0\.bias.*shape \(5,\)"):
            manager.load(tmp_path / "c", into=template)
    assert _snapshot(template) == before


@pytest.mark.parametrize("strict", [False, True])
def test_a_module_with_an_extra_layer_is_refused_untouched(tmp_path: Path, strict: bool) -> None:
    # torch's load_state_dict copies every matching tensor, then raises on the missing keys:
    # the key sets are compared first, so big[0] keeps its own values.
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(4, 4))
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    small = torch.nn.Sequential()
    with _sync() as manager:
        manager.save(tmp_path / "c", {"net": saved})
        for template, why in (
            (big, r"Missing key\(s\): \['1\.weight', '1\.bias'\]"),
            (small, r"Unexpected key\(s\): \['0\.weight', '0\.bias'\]"),
        ):
            before = _snapshot(template)
            with pytest.raises(CheckpointMismatchError) as caught:
                manager.load(tmp_path / "c", into={"net": template}, strict=strict)
            assert _snapshot(template) == before
            # The error names the item, the keys and the fix.
            assert caught.match(rf"^net: .*{why}.*strict=False")


def test_a_key_missing_under_strict_leaves_the_template_untouched(tmp_path: Path) -> None:
    template = {"model": {"w": torch.zeros(3), "extra": torch.zeros(2)}}
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": {"w": torch.ones(3)}})
        with pytest.raises(CheckpointMismatchError, match=r"model\.extra: missing"):
            manager.load(tmp_path / "c", into=template, strict=True)
        assert torch.equal(template["model"]["w"], torch.zeros(3))
        manager.load(tmp_path / "c", into=template)  # not strict: the rest is loaded
    assert torch.equal(template["model"]["w"], torch.ones(3))


def test_strict_refuses_a_template_that_leaves_saved_entries_out(tmp_path: Path) -> None:
    # Before: strict=True only checked template keys the checkpoint lacks; the natural resume
    # template of a fresh optimizer (its state_dict(): empty "state") loaded no moments and
    # no step, silently. Now strict also refuses saved tensors the template leaves out (as
    # torch's load_state_dict); not strict, an empty template where the checkpoint holds
    # tensors is warned of.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    fresh = torch.nn.Linear(4, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": model.state_dict(), "opt": optimizer.state_dict()})
        template = {"model": fresh.state_dict(), "opt": fresh_optimizer.state_dict()}
        with pytest.raises(
            CheckpointMismatchError,
            match=r"opt\.state: .*2 entries with tensors the template lacks \(0, 1\).*None",
        ):
            manager.load(tmp_path / "c", into=template, strict=True)
        manager.save(tmp_path / "l", {"lst": [torch.ones(1), 2, torch.ones(2)], "n": {"a": 1}})
        with pytest.raises(CheckpointMismatchError, match=r"lst: .*1 entry with tensors .*\(2\)"):
            manager.load(tmp_path / "l", into={"lst": [torch.zeros(1), 0]}, strict=True)
        # Plain values may be left out (a scheduler's initial_lr in a fresh optimizer's groups).
        loaded = manager.load(tmp_path / "l", into={"lst": [None, 0, None], "n": {}}, strict=True)
        assert loaded["n"] == {} and loaded["lst"][1] == 2
        with pytest.warns(UserWarning, match=r"opt\.state: the template is empty"):
            manager.load(tmp_path / "c", into=template)
        # What strict accepts: the optimizer itself, or None where the state loads as saved.
        manager.load(tmp_path / "c", into={"model": fresh, "opt": fresh_optimizer}, strict=True)
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["step"], torch.tensor(3.0))
    assert torch.equal(fresh.weight, model.weight)


def test_templates_sharing_part_of_their_memory_are_refused(tmp_path: Path) -> None:
    # Before: two slots over overlapping memory were filled one after the other and the
    # first came back holding the second's bytes ([9, 7, 7, 7] for a saved [7, 7, 7, 7]).
    with _sync() as manager:
        manager.save(
            tmp_path / "c",
            {"x": {"b": torch.full((4,), 7.0), "z": torch.tensor([9.0])}, "y": torch.ones(2, 2)},
        )
        shared = torch.zeros(4)
        with pytest.raises(TypeError, match=r"x\.[bz] and x\.[bz]: the templates share part"):
            manager.load(tmp_path / "c", into={"x": {"b": shared, "z": shared[:1]}})
        assert torch.equal(shared, torch.zeros(4))
        with pytest.raises(TypeError, match="share part"):  # across items too
            manager.load(tmp_path / "c", into={"x": {"b": shared}, "y": shared.view(2, 2)})
        # Interleaved views that share no element, and one tensor in two places, still load.
        columns = torch.zeros(2, 4)
        manager.save(tmp_path / "d", {"a": torch.ones(2, 2), "b": torch.full((2, 2), 2.0)})
        manager.load(tmp_path / "d", into={"a": columns[:, 0::2], "b": columns[:, 1::2]})
        assert columns.tolist() == [[1.0, 2.0, 1.0, 2.0]] * 2
        # Every pair is compared, not only neighbours in address order (before: A and C
        # sharing t[1, 1] went unnoticed behind B), and large column blocks of one fused
        # matrix (GPT-2's c_attn split) are told apart exactly.
        t = torch.zeros(2, 4)
        manager.save(
            tmp_path / "e", {"a": torch.ones(2, 3), "b": torch.ones(2), "c": torch.ones(1, 1)}
        )
        with pytest.raises(TypeError, match=r"a and c: the templates share part"):
            manager.load(tmp_path / "e", into={"a": t[:, 0:3], "b": t[:, 3], "c": t[1:2, 1:2]})
        fused = torch.zeros(1600, 4800)
        manager.save(
            tmp_path / "f", {"q": torch.ones(1600, 1600), "k": torch.full((1600, 1600), 2.0)}
        )
        manager.load(tmp_path / "f", into={"q": fused[:, :1600], "k": fused[:, 1600:3200]})
        assert fused[:, :1600].eq(1).all() and fused[:, 1600:3200].eq(2).all()


@pytest.mark.parametrize("layout", ["one item", "one item read directly", "two items"])
def test_one_template_for_two_saved_tensors_loads_only_when_they_are_equal(
    tmp_path: Path, layout: str
) -> None:
    """Before, one tensor given for two saved tensors holding different values loaded
    whichever was copied last (ones or twos, by key order), without a word. Tied weights
    saved as one value still load. Judged by the headers when the items are read directly
    (an item with another tensor: a first version compared one saved tensor with itself
    there), by the bytes when they are loaded first."""
    other = torch.ones(5)

    def state(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
        if layout == "one item":
            return {"s": {"a": a, "b": b}}
        if layout == "one item read directly":
            return {"s": {"a": a, "b": b, "c": other}}
        return {"p": a, "q": {"b": b}}

    def into(t: torch.Tensor) -> dict[str, Any]:
        if layout == "one item":
            return {"s": {"a": t, "b": t}}
        if layout == "one item read directly":
            return {"s": {"a": t, "b": t, "c": torch.zeros(5)}}
        return {"p": t, "q": {"b": t}}

    weight = torch.randn(3, 4)
    with _sync() as manager:
        manager.save(tmp_path / "differ", state(weight, weight + 1))
        manager.save(tmp_path / "tied", state(weight, weight.clone()))
        tied = torch.zeros(3, 4)
        with pytest.raises(CheckpointMismatchError, match="does not hold the same values"):
            manager.load(tmp_path / "differ", into=into(tied))
        assert torch.equal(tied, torch.zeros(3, 4))
        loaded = manager.load(tmp_path / "tied", into=into(tied))
        assert _bytes(tied) == _bytes(weight)
        first = loaded["p"] if layout == "two items" else loaded["s"]["a"]
        assert first is tied
        # A path the checkpoint lacks loads nothing (non-strict): nothing to compare there.
        if layout == "two items":
            manager.save(tmp_path / "one", {"p": weight})
            tied.zero_()
            manager.load(tmp_path / "one", into={"p": tied, "q": {"b": tied}})
            assert _bytes(tied) == _bytes(weight)


def test_an_optimizer_with_other_parameter_groups_is_refused_before_the_model_is_read(
    tmp_path: Path,
) -> None:
    """Before, the model (read into directly) was overwritten, then Adam.load_state_dict
    refused the groups: the error named only the optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    live = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    params = list(live.parameters())
    live_optimizer = torch.optim.Adam(
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.1}], lr=1e-2
    )
    before = {key: value.clone() for key, value in live.state_dict().items()}
    with _sync() as manager:
        manager.save(tmp_path / "c", {"model": model, "optim": optimizer})
        with pytest.raises(
            CheckpointMismatchError,
            match=r"optim: .*1 parameter group\(s\) of \[4\].*2 of \[2, 2\]",
        ):
            manager.load(tmp_path / "c", into={"model": live, "optim": live_optimizer})
    assert all(torch.equal(value, before[key]) for key, value in live.state_dict().items())
    assert live_optimizer.state_dict()["state"] == {}


def test_a_batch_norm_state_without_num_batches_tracked_still_loads(tmp_path: Path) -> None:
    # torch supplies a missing num_batches_tracked: the key check must not refuse it.
    saved = torch.nn.BatchNorm1d(3)
    saved.running_mean += 2.0
    state = {k: v for k, v in saved.state_dict().items() if k != "num_batches_tracked"}
    fresh = torch.nn.BatchNorm1d(3)
    with _sync() as manager:
        manager.save(tmp_path / "c", {"bn": state})
        manager.load(tmp_path / "c", into={"bn": fresh})
    assert torch.equal(fresh.running_mean, saved.running_mean)


@pytest.mark.parametrize("direct", [True, False], ids=["direct-read", "copied"])
def test_a_later_items_mismatch_leaves_every_items_template_untouched(
    tmp_path: Path, direct: bool
) -> None:
    """Every item's template is checked before any is written into: with ``into={"a": fits,
    "b": mismatched}`` the error names ``b`` and ``a``'s template keeps its own values too,
    whether it would be read into directly or copied into. Before, ``a`` was loaded before
    ``b``'s mismatch was found; so was every item before a key missing under ``strict``."""
    torch.manual_seed(0)
    with _sync() as manager:
        manager.save(tmp_path / "c", {"a": {"w": torch.randn(8)}, "b": {"w": torch.randn(4)}})
        fits = {"w": torch.zeros(8) if direct else torch.zeros(16)[::2]}  # strided: copied
        for into, strict, why in (
            ({"a": fits, "b": {"w": torch.zeros(5)}}, False, r"^b\.w: "),
            ({"a": fits, "zz": {"w": torch.zeros(1)}}, True, r"^zz: not in checkpoint"),
        ):
            before = _snapshot(fits)
            with pytest.raises(CheckpointMismatchError, match=why):
                manager.load(tmp_path / "c", into=into, strict=strict)
            assert _snapshot(fits) == before
        loaded = manager.load(tmp_path / "c", into={"a": fits})
        assert torch.equal(loaded["a"]["w"], fits["w"]) and fits["w"].abs().sum() > 0


@pytest.mark.parametrize("front_door", ["sync", "async", "dcp"])
def test_a_template_and_its_lazy_conj_or_neg_view_are_not_taken_for_tied_weights(
    tmp_path: Path, front_door: str
) -> None:
    """``t`` and ``t.conj()`` (or ``torch._neg_view(t)``) share memory but see other values.
    Before, the tied-template check compared memory, dtype, shape and strides only: the two
    were taken for one tensor given twice, the checkpoint held equal bytes at both keys, and
    the load filled both through the one memory: ``a`` came back conjugated, ``x`` negated,
    without a word (manager sync and async, ``fastckpt.dcp.load_state``)."""
    import fastckpt.dcp

    value = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    real = torch.tensor([1.5, -2.0, 0.0])
    state = {"s": {"a": value, "b": value.clone(), "x": real, "y": real.clone()}}
    for pair, (first, second) in {"ab": ("a", "b"), "xy": ("x", "y")}.items():
        template = torch.zeros(2, dtype=torch.complex64) if pair == "ab" else torch.zeros(3)
        view = template.conj() if pair == "ab" else torch._neg_view(template)
        into = {"s": {first: template, second: view}}
        with pytest.raises(TypeError, match=f"s.{first} and s.{second}: the templates share"):
            if front_door == "dcp":
                fastckpt.dcp.save_state(tmp_path / "sharded", state)
                fastckpt.dcp.load_state(tmp_path / "sharded", into=into)
            else:
                config = (
                    CheckpointManager.Config.with_async_save()
                    if front_door == "async"
                    else CheckpointManager.Config.with_sync_save()
                )
                with CheckpointManager(config) as manager:
                    future = manager.save(tmp_path / front_door, state)
                    if future is not None:
                        future.result()
                    manager.load(tmp_path / front_door, into=into)
        assert not template.any()  # nothing was filled
