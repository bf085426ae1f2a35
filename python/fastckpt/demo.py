"""``python -m fastckpt.demo``: a short tour on a small embedded example.

Builds a small transformer-like state, saves it with fastckpt and with ``torch.save`` (both
made durable with fsync), reloads and verifies it bit for bit, shows that a flipped byte is
caught, and prints the write throughput of both on this machine's disk.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

import fastckpt


def demo_state(megabytes: int) -> dict[str, torch.Tensor]:
    """Weights plus two Adam-moment-like copies, transformer-ish shapes, ~``megabytes`` MiB."""
    gen = torch.Generator().manual_seed(0)
    hidden = 512
    per_layer = 4 * hidden * hidden * 4 * 3  # qkv+o weights, 3 copies (param, exp_avg, exp_avg_sq)
    layers = max(1, (megabytes << 20) // per_layer)
    state: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for part in ("q", "k", "v", "o"):
            weight = torch.randn(hidden, hidden, generator=gen)
            state[f"layers.{layer}.{part}.weight"] = weight
            state[f"optim.{layer}.{part}.exp_avg"] = weight * 0.1
            state[f"optim.{layer}.{part}.exp_avg_sq"] = weight.square()
    return state


def fsynced_torch_save(state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save made durable the same way fastckpt's writes are."""
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def timed(action: object, *args: object) -> float:
    start = time.perf_counter()
    action(*args)  # type: ignore[operator]
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)

    state = demo_state(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(
        f"fastckpt {fastckpt.__version__}: state of {len(state)} tensors, {nbytes / 2**20:.0f} MiB"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        ours = root / "state.safetensors"
        theirs = root / "state.pt"
        fastckpt.save_file(state, ours)  # warm-up: page tables, thread start-up
        t_ours = min(timed(fastckpt.save_file, state, ours) for _ in range(3))
        t_theirs = min(timed(fsynced_torch_save, state, theirs) for _ in range(3))

        loaded = fastckpt.load_file(ours)
        same = all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
        print(f"reload with checksums verified: {'bitwise equal' if same else 'MISMATCH'}")

        data = bytearray(ours.read_bytes())
        data[-1000] ^= 0x40
        ours.write_bytes(bytes(data))
        try:
            fastckpt.load_file(ours)
            print("corruption: NOT detected")
            same = False
        except fastckpt.ChecksumMismatchError as err:
            print(f"corruption detected: {str(err)[:110]}...")

    gib = nbytes / 2**30
    print(
        f"durable write, best of 3: fastckpt {gib / t_ours:.2f} GiB/s, "
        f"torch.save+fsync {gib / t_theirs:.2f} GiB/s ({t_theirs / t_ours:.2f}x)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
