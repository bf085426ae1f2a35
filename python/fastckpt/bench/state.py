"""The benchmark state: a transformer-like model's weights plus its Adam moments.

Every writer and reader in one run sees the same tensors, built once by :func:`build_state`.
The shapes are those of a decoder block (attention q/k/v/o, a 4x MLP, two layer norms) repeated
over as many layers as fit, with a token embedding sized to make up the rest, so the total is
within a few KiB of the requested size whatever it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StateSpec", "build_state", "plan_state", "state_bytes"]

#: Hidden sizes tried, largest first; the first whose layer fits twice in the budget is used.
_HIDDEN_SIZES = (1024, 512, 256, 128, 64, 32, 16)
#: Copies of each parameter in the state: the weight, Adam ``exp_avg`` and ``exp_avg_sq``.
_COPIES = 3


@dataclass(frozen=True)
class StateSpec:
    """Shape plan of a benchmark state.

    Attributes:
        hidden: model width.
        layers: decoder blocks.
        vocab: embedding rows (fills the budget the whole blocks leave).
        dtype: element type of every tensor.
    """

    hidden: int
    layers: int
    vocab: int
    dtype: torch.dtype = torch.float32

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every model parameter (each stored three times in the state)."""
        d = self.hidden
        shapes: dict[str, tuple[int, ...]] = {}
        if self.vocab:
            shapes["embed.weight"] = (self.vocab, d)
        for layer in range(self.layers):
            prefix = f"layers.{layer}"
            for part in ("q", "k", "v", "o"):
                shapes[f"{prefix}.attn.{part}.weight"] = (d, d)
            shapes[f"{prefix}.mlp.up.weight"] = (4 * d, d)
            shapes[f"{prefix}.mlp.down.weight"] = (d, 4 * d)
            for norm in ("norm1", "norm2"):
                shapes[f"{prefix}.{norm}.weight"] = (d,)
                shapes[f"{prefix}.{norm}.bias"] = (d,)
        return shapes

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the whole state (weights and both moments)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        elements = 0
        for shape in self.parameter_shapes().values():
            count = 1
            for dim in shape:
                count *= dim
            elements += count
        return elements * itemsize * _COPIES


def _layer_elements(hidden: int) -> int:
    return 12 * hidden * hidden + 4 * hidden


def plan_state(size_gib: float, dtype: torch.dtype = torch.float32) -> StateSpec:
    """Choose hidden size, layer count and embedding rows for a state of ``size_gib`` GiB.

    Raises:
        ValueError: the size is not positive.
    """
    if size_gib <= 0:
        raise ValueError(f"state size must be positive, got {size_gib} GiB")
    itemsize = torch.empty((), dtype=dtype).element_size()
    budget = int(size_gib * 2**30) // (itemsize * _COPIES)  # elements per copy
    hidden = _HIDDEN_SIZES[-1]
    for candidate in _HIDDEN_SIZES:
        if 2 * _layer_elements(candidate) <= budget:
            hidden = candidate
            break
    layers = budget // _layer_elements(hidden)
    vocab = (budget - layers * _layer_elements(hidden)) // hidden
    return StateSpec(hidden=hidden, layers=layers, vocab=max(vocab, 1), dtype=dtype)


def build_state(spec: StateSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Materialize the state of ``spec``: ``model.*`` weights and ``optim.*`` Adam moments.

    Values are deterministic for a given seed (weights ~ N(0, 0.02²), ``exp_avg`` a scaled
    copy, ``exp_avg_sq`` its square), so a child process rebuilds the very same bytes.
    """
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, shape in spec.parameter_shapes().items():
        weight = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02)
        exp_avg = weight * 0.01
        exp_avg_sq = exp_avg.square()
        state[f"model.{name}"] = weight.to(spec.dtype)
        state[f"optim.{name}.exp_avg"] = exp_avg.to(spec.dtype)
        state[f"optim.{name}.exp_avg_sq"] = exp_avg_sq.to(spec.dtype)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Total bytes of tensor data in ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())
