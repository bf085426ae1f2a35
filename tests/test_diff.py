"""fastckpt.diff: the bitwise tensor comparison behind ``fastckpt diff`` (the command itself is
tested in test_cli.py)."""

from __future__ import annotations

import torch

from fastckpt import diff


def test_compare_tensors_is_bitwise_and_reports_nan() -> None:
    a = torch.tensor([0.0, 1.0, float("nan")])
    assert diff.compare_tensors(a, a.clone()) == (0, 0.0)  # NaN equals itself bitwise
    count, biggest = diff.compare_tensors(a, torch.tensor([-0.0, 3.0, float("nan")]))
    assert count == 2 and biggest == 2.0  # -0.0 differs in its bits, by 0 in value
    count, biggest = diff.compare_tensors(torch.tensor([1.0]), torch.tensor([float("nan")]))
    assert count == 1 and biggest != biggest
    flags = torch.tensor([True, False])
    assert diff.compare_tensors(flags, ~flags) == (2, 1.0)
