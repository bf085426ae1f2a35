"""Stagers: buffers allocated once and reused; the CUDA path (pinned, non-blocking) on GPUs."""

from __future__ import annotations

import pytest
import torch

from fastckpt.staging import CpuStager, CudaStager, StagerOptions, make_stager


def test_cpu_stager_reuses_buffers_and_copies() -> None:
    stager = CpuStager()
    live = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.int64)}
    first = stager.stage(live)
    assert first["w"].data_ptr() != live["w"].data_ptr()
    assert torch.equal(first["w"], live["w"])
    live["w"].add_(1)
    second = stager.stage(live)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # same buffer, no new allocation
    assert torch.equal(second["w"], live["w"])
    assert stager.nbytes == 6 * 4 + 3 * 8
    # A changed shape replaces only that buffer; dropped names free theirs.
    third = stager.stage({"w": torch.ones(4)})
    assert third["w"].shape == (4,) and stager.nbytes == 16


def test_stager_is_chosen_by_cuda_availability() -> None:
    stager = make_stager(StagerOptions(pinned=False, non_blocking=False))
    expected = CudaStager if torch.cuda.is_available() else CpuStager
    assert isinstance(stager, expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stager_pinned_non_blocking() -> None:
    stager = CudaStager(StagerOptions(pinned=True, non_blocking=True))
    live = {"w": torch.randn(1 << 20, device="cuda"), "cpu": torch.ones(3)}
    staged = stager.stage(live)
    assert staged["w"].is_pinned() and staged["w"].device.type == "cpu"
    assert torch.equal(staged["w"], live["w"].cpu())
    live["w"].mul_(2)
    again = stager.stage(live)
    assert again["w"].data_ptr() == staged["w"].data_ptr()
    assert torch.equal(again["w"], live["w"].cpu())


def test_background_executor_runs_at_lower_priority() -> None:
    import os
    import threading

    from fastckpt.staging import BACKGROUND_NICE, background_executor

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    executor = background_executor("test")
    try:
        theirs = executor.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        ).result()
    finally:
        executor.shutdown()
    assert theirs == min(19, mine + BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
