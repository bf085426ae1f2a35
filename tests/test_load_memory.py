"""How a load fills memory: fresh host tensors advised to use transparent huge pages (one page
fault per 2 MiB instead of per 4 KiB), and reader threads that follow the CPUs a load may use.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import _native
from fastckpt.io import headers
from fastckpt.io.files import empty_tensor

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_on() -> bool:
    try:
        mode = THP.read_text()
    except OSError:
        return False
    return "[madvise]" in mode or "[always]" in mode


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _huge_page_inside(tensor: torch.Tensor) -> int:
    """An address of a whole 2 MiB page inside ``tensor``'s bytes."""
    huge = 2 << 20
    return (tensor.data_ptr() + huge - 1) // huge * huge


needs_thp = pytest.mark.skipif(
    not (_thp_on() and Path("/proc/self/smaps").exists()),
    reason="transparent huge pages are off (or no /proc): the advice is refused by design",
)


@needs_thp
def test_a_fresh_host_tensor_of_a_few_mib_is_advised_to_use_huge_pages() -> None:
    tensor = empty_tensor([3 << 20], torch.float32)  # 12 MiB
    assert "hg" in _vm_flags(_huge_page_inside(tensor))
    tensor.fill_(2.5)
    assert bool((tensor == 2.5).all())


def test_the_advice_refuses_read_only_memory_and_skips_small_buffers() -> None:
    with pytest.raises(ValueError, match="read-only"):
        _native.advise_huge_pages(bytes(8 << 20))
    assert _native.advise_huge_pages(bytearray(_native.HUGE_ADVICE_MIN_BYTES - 1)) is False


@needs_thp
def test_load_checkpoint_reads_large_tensors_into_advised_memory_bitwise(tmp_path: Path) -> None:
    model = torch.nn.Linear(2048, 1024)  # an 8 MiB weight and a 4 KiB bias
    fastckpt.save_checkpoint(tmp_path / "root", models={"main": (model, None)})
    loaded = fastckpt.load_checkpoint(tmp_path / "root")["models"]["main"]["model"]
    assert torch.equal(loaded.weight, model.weight) and torch.equal(loaded.bias, model.bias)
    assert "hg" in _vm_flags(_huge_page_inside(loaded.weight))


@pytest.mark.parametrize(("cpus", "threads"), [(1, 4), (2, 4), (6, 6), (8, 8), (64, 8)])
def test_load_threads_follow_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch, cpus: int, threads: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert headers.load_threads() == threads


def test_a_load_reads_with_load_threads_when_none_are_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Linear(3, 2)
    fastckpt.save_checkpoint(tmp_path / "root", models={"main": (model, None)})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(7)))
    used: list[int] = []
    real = _native.read_into

    def spy(path: str, tensors: object, threads: int, **kwargs: object) -> int:
        used.append(threads)
        return real(path, tensors, threads, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_native, "read_into", spy)
    loaded = fastckpt.load_checkpoint(tmp_path / "root")["models"]["main"]["model"]
    assert torch.equal(loaded.weight, model.weight)
    assert used and set(used) == {7}
