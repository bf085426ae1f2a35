"""Factories that rebuild torch's container modules from already-built children.

``nn.Sequential``, ``nn.ModuleList`` and ``nn.ModuleDict`` take their children positionally
(or as one list/dict), so a spec cannot call their constructors with keyword arguments taken
from the instance. :func:`fastckpt.checkpoint.specs.model_spec` records them as a call to one of
these
functions instead, with one nested spec per child, in order and under the child's own name, so
the rebuilt container has the same ``state_dict`` keys. The trust policy admits these three
functions as model targets by default; each one only assembles modules that nested specs
already built under the same policy.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

__all__ = ["module_dict", "module_list", "sequential"]


def _check_children(children: object, kind: str, keyed: bool) -> None:
    if keyed:
        if not isinstance(children, dict) or not all(isinstance(k, str) for k in children):
            raise TypeError(f"{kind}: children must be a dict of name -> module")
        values = list(children.values())
    else:
        if not isinstance(children, list):
            raise TypeError(f"{kind}: children must be a list of modules")
        values = children
    for value in values:
        if not isinstance(value, nn.Module):
            raise TypeError(f"{kind}: every child must be an nn.Module, got {type(value).__name__}")


def sequential(children: dict[str, nn.Module]) -> nn.Sequential:
    """``nn.Sequential`` of ``children`` in order, each under its name (``"0"``, ``"fc"``...).

    Args:
        children: Child name -> module, in the order the container runs them.

    Returns:
        The container.

    Raises:
        TypeError: If ``children`` is not a dict of modules with string names.
    """
    _check_children(children, "sequential", keyed=True)
    return nn.Sequential(OrderedDict(children))


def module_list(children: list[nn.Module]) -> nn.ModuleList:
    """``nn.ModuleList`` of ``children`` (named ``"0"``, ``"1"``... as torch numbers them).

    Args:
        children: The modules, in order.

    Returns:
        The container.

    Raises:
        TypeError: If ``children`` is not a list of modules.
    """
    _check_children(children, "module_list", keyed=False)
    return nn.ModuleList(children)


def module_dict(children: dict[str, nn.Module]) -> nn.ModuleDict:
    """``nn.ModuleDict`` of ``children``, in order.

    Args:
        children: Child name -> module.

    Returns:
        The container.

    Raises:
        TypeError: If ``children`` is not a dict of modules with string names.
    """
    _check_children(children, "module_dict", keyed=True)
    return nn.ModuleDict(children)
