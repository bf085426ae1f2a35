"""fastckpt.container.diff: the bitwise tensor comparison behind ``fastckpt diff`` (the command
itself is
tested in test_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt
from fastckpt import cli
from fastckpt.container import diff


def test_compare_tensors_is_bitwise_and_reports_nan() -> None:
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert diff.compare_tensors(a, a.clone()) == (0, 0.0)  # NaN equals itself bitwise
    count, biggest = diff.compare_tensors(a, torch.tensor([-0.0, 3.0, float("nan")]))
    assert count == 2 and biggest == 2.0  # -0.0 differs in its bits, by 0 in value
    count, biggest = diff.compare_tensors(torch.tensor([1.0]), torch.tensor([float("nan")]))
    assert count == 1 and biggest != biggest
    flags = torch.tensor([True, False])
    assert diff.compare_tensors(flags, ~flags) == (2, 1.0)


def test_diff_of_two_kinds_shows_user_key_paths_a_summary_first_and_a_limit(
    tmp_path: Path,
) -> None:
    """A root against a manager checkpoint of the same training state: value rows name the
    state's own key paths (no ``__tuple__``/``__dict__``/``skeleton`` encodings, no tensor
    placeholders), the summary is the third line, and ``--limit`` cuts each table."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    fastckpt.save_checkpoint(tmp_path / "root", models={"main": (model, None)}, optimizers={
        "adam": (optimizer, None)})  # fmt: skip
    with fastckpt.CheckpointManager() as manager:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3}
        future = manager.save(tmp_path / "mgr", state)
        if future is not None:
            future.result()

    def diff(*extra: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-m", "fastckpt", "diff", str(tmp_path / "root"),
             str(tmp_path / "mgr"), *extra],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        return done.stdout.splitlines()

    everything = diff("--limit", "0")
    assert everything[2].startswith("0 of 0 common tensor(s) differ, 16 added, 16 removed;")
    values = {line.split()[1] for line in everything if line.startswith(("added", "removed"))}
    assert {"optim:param_groups.0.betas.1", "optim:param_groups.0.lr", "step"} <= values
    assert "optimizers/adam:spec.kwargs.betas.0" in values
    assert not [v for v in values if "__" in v or "skeleton" in v], values
    shown = diff("--limit", "5")
    assert shown[2] == everything[2]
    cuts = [line for line in shown if line.startswith("... and ")]
    assert cuts == ["... and 27 more (--limit 0 shows every row)", cuts[1]] and len(cuts) == 2
    assert len(shown) == 3 + (1 + 5 + 1) * 2
    assert len(diff()) < len(everything)  # 20 rows per table by default


def _cli_diff(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    """``fastckpt --json diff ARGS`` in this process: (exit status, the JSON result)."""
    status = cli.main(["--json", "diff", *args])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("a", "b", "biggest"),
    [
        ([2**53, 7], [2**53 + 1, 7], 1),  # float64 rounds both to 2**53
        ([1234567890123456789], [1234567890123456790], 1),
        ([-(2**63)], [2**63 - 1], 2**64 - 1),  # the difference overflows int64
        ([0.0, 1.0], [-0.0, 1.0], 0.0),  # bits differ, values are equal
    ],
    ids=["int64-2**53", "int64-seed", "int64-extremes", "signed-zero"],
)
def test_any_differing_bit_is_a_change_and_integer_differences_are_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], a: list[Any], b: list[Any], biggest: Any
) -> None:
    """With the default atol 0, tensors whose bits differ are never ``identical`` (before:
    int64 values float64 cannot tell apart and +0.0/-0.0 were, exit 0), and an integer
    tensor's MAX |A-B| is exact."""
    fastckpt.save_file({"x": torch.tensor(a)}, tmp_path / "a.safetensors")
    fastckpt.save_file({"x": torch.tensor(b)}, tmp_path / "b.safetensors")
    status, result = _cli_diff(
        capsys, str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    )
    assert status == 1 and result["identical"] is False
    (changed,) = result["changed"]
    assert changed["differing"] == 1 and changed["max_abs_diff"] == biggest
    assert type(changed["max_abs_diff"]) is type(biggest)


def test_fp4_and_infinite_differences_are_reported_as_strict_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``float4_e2m1fn_x2`` bytes are compared and their largest difference decoded (before:
    a traceback and exit 1, nothing on stdout); an infinite difference is ``"inf"`` in the
    JSON, which strict parsers read (before: the bare token ``Infinity``)."""
    bits = torch.zeros(3, 4, dtype=torch.uint8)
    changed = bits.clone()
    changed[1, 2] = 0x71  # the pair (0.5, 6.0) where (0.0, 0.0) was
    for name, a, b in (
        ("f4", bits.view(torch.float4_e2m1fn_x2), changed.view(torch.float4_e2m1fn_x2)),
        ("inf", torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("inf")])),
    ):
        fastckpt.save_file({"x": a}, tmp_path / f"{name}-a.safetensors")
        fastckpt.save_file({"x": b}, tmp_path / f"{name}-b.safetensors")
        status = cli.main(
            [
                "--json",
                "diff",
                str(tmp_path / f"{name}-a.safetensors"),
                str(tmp_path / f"{name}-b.safetensors"),
            ]
        )
        text = capsys.readouterr().out
        result = json.loads(text, parse_constant=lambda token: pytest.fail(f"not JSON: {token}"))
        assert status == 1 and result["identical"] is False, name
        (entry,) = result["changed"]
        # f4: both 4-bit values of the changed byte differ, of 24 (the header's count; before:
        # 1 of 12, bytes against a shape in 4-bit values)
        assert (entry["differing"], entry["elements"], entry["max_abs_diff"]) == (
            (2, 24, 6.0) if name == "f4" else (1, 2, "inf")
        )


def test_integer_differences_are_exact_for_every_integer_dtype() -> None:
    """compare_tensors widens integers to int64 without loss (uint64 included)."""
    cases = [
        (torch.uint64, [0, 2**64 - 1], [2**64 - 1, 2**64 - 1], 2**64 - 1),
        (torch.uint64, [2**63], [2**63 - 1], 1),
        (torch.uint32, [2**32 - 1], [0], 2**32 - 1),
        (torch.int8, [-128], [127], 255),
        (torch.int32, [-(2**31)], [2**31 - 1], 2**32 - 1),
    ]
    for dtype, left, right, biggest in cases:
        a, b = torch.tensor(left, dtype=dtype), torch.tensor(right, dtype=dtype)
        assert diff.compare_tensors(a, b) == (1, biggest), dtype
        assert diff.compare_tensors(b, a) == (1, biggest), dtype


def test_complex128_tensors_are_compared_element_by_element() -> None:
    """16-byte elements (complex128) are compared as two 8-byte words each and counted once
    per element. Before, comparing them raised KeyError: 16."""
    a = torch.tensor([1 + 2j, 3 + 4j, 0j], dtype=torch.complex128)
    b = a.clone()
    b[1] = 3 + 5j
    assert diff.compare_tensors(a, b) == (1, 1.0)
    zero = torch.zeros(2, dtype=torch.float64)
    signed = torch.complex(zero, torch.tensor([0.0, -0.0], dtype=torch.float64))
    assert diff.compare_tensors(torch.complex(zero, zero), signed) == (1, 0.0)  # one sign bit
    assert diff.compare_tensors(a, a.clone()) == (0, 0.0)


def test_atol_tolerates_differences_up_to_it_but_never_a_nan(tmp_path: Path) -> None:
    """``atol`` > 0 counts a tensor whose largest difference is at most atol as equal (a
    signed zero, an int64 off by one); a NaN against a number is always a change."""
    a = {"zero": [0.0], "big": [2**53], "nan": [1.0]}
    b = {"zero": [-0.0], "big": [2**53 + 1], "nan": [float("nan")]}
    fastckpt.save_file({k: torch.tensor(v) for k, v in a.items()}, tmp_path / "a.safetensors")
    fastckpt.save_file({k: torch.tensor(v) for k, v in b.items()}, tmp_path / "b.safetensors")
    side_a = diff.TensorFiles("a", {"": tmp_path / "a.safetensors"})
    side_b = diff.TensorFiles("b", {"": tmp_path / "b.safetensors"})
    strict = diff.diff_checkpoints(side_a, side_b)
    assert sorted(c["name"] for c in strict["changed"]) == ["big", "nan", "zero"]
    loose = diff.diff_checkpoints(side_a, side_b, atol=1.0)
    assert [c["name"] for c in loose["changed"]] == ["nan"] and loose["same"] == 2
    assert loose["changed"][0]["max_abs_diff"] is None
    assert [c["name"] for c in diff.diff_checkpoints(side_a, side_b, atol=0.5)["changed"]] == [
        "big",
        "nan",
    ]


def test_a_parameter_frozen_on_one_side_only_is_a_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest's record of frozen parameters (which load_checkpoint restores) is compared:
    same weights, one side with ``weight`` frozen, is not identical (before: exit 0)."""
    torch.manual_seed(0)
    trained, frozen = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    frozen.load_state_dict(trained.state_dict())
    frozen.weight.requires_grad_(False)
    fastckpt.save_checkpoint(tmp_path / "a", models={"main": (trained, None)})
    fastckpt.save_checkpoint(tmp_path / "b", models={"main": (frozen, None)})
    status, result = _cli_diff(capsys, str(tmp_path / "a"), str(tmp_path / "b"))
    assert status == 1 and result["identical"] is False and result["changed"] == []
    assert result["values_added"] == [{"name": "frozen:main.weight", "b": True}]
    status, result = _cli_diff(capsys, str(tmp_path / "b"), str(tmp_path / "a"))
    assert status == 1 and result["values_removed"] == [{"name": "frozen:main.weight", "a": True}]
    status, result = _cli_diff(capsys, str(tmp_path / "b"), str(tmp_path / "b"))
    assert status == 0 and result["identical"] is True
    assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["added", "frozen:main.weight", "-", "true"] in rows


def test_a_layout_changed_between_two_checkpoints_is_a_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest's record of memory layouts (which load_checkpoint gives back) is compared:
    the same weights, one side channels_last, is not identical (round 19)."""
    torch.manual_seed(0)
    plain = torch.nn.Conv2d(3, 4, 3)
    fastckpt.save_checkpoint(tmp_path / "a", models={"main": (plain, None)})
    plain.to(memory_format=torch.channels_last)
    fastckpt.save_checkpoint(tmp_path / "b", models={"main": (plain, None)})
    status, result = _cli_diff(capsys, str(tmp_path / "a"), str(tmp_path / "b"))
    assert status == 1 and result["changed"] == []
    assert result["values_added"] == [{"name": "strides:main.weight", "b": [27, 1, 9, 3]}]


@pytest.mark.parametrize(
    ("a", "b"),
    [("inf", float("inf")), (True, 1), (1, 1.0), ({0: "x"}, {"0": "x"}), ((1, 2), [1, 2])],
    ids=["str-float", "bool-int", "int-float", "int-str-key", "tuple-list"],
)
def test_plain_values_that_load_differently_are_never_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], a: Any, b: Any
) -> None:
    """Two manager checkpoints whose plain values load as different values (of another type,
    under another key type, a tuple against a list) differ, exit 1. Before, each pair was
    ``identical`` (exit 0): values were compared with ``==`` at paths that forgot key types."""
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tmp_path / "a", {"v": a})
        m.save(tmp_path / "b", {"v": b})
        assert m.load(tmp_path / "a")["v"] == a and m.load(tmp_path / "b")["v"] == b
    status, result = _cli_diff(capsys, str(tmp_path / "a"), str(tmp_path / "b"))
    assert status == 1 and result["identical"] is False, result
    status, result = _cli_diff(capsys, str(tmp_path / "a"), str(tmp_path / "a"))
    assert status == 0 and result["identical"] is True, result
    assert cli.main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "nan"]) == 2
    assert "--atol must be a number >= 0" in capsys.readouterr().err
