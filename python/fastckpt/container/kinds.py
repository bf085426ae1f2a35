"""The kinds of container a path can name, and the one place that tells them apart.

:func:`open_container` works out what a path names (with
:func:`fastckpt.container.locate.locate`) and returns one object of the class of that kind:

* :class:`RootContainer` - a :func:`fastckpt.save_checkpoint` root (``manifest.json`` inside);
* :class:`IndexContainer` - one committed index directory of such a root;
* :class:`ManagerContainer` - a :class:`fastckpt.CheckpointManager` checkpoint
  (``commit.json`` inside);
* :class:`ShardedContainer` - a sharded checkpoint of :mod:`fastckpt.dcp`
  (``fastckpt-dcp.json`` inside);
* :class:`TensorFile` - a lone (safetensors) file.

Code that does something different for each kind (``verify``, ``safe_open``, the ``verify``,
``inspect``, ``diff`` and ``export`` commands) does not compare kind names: it writes a
:class:`KindVisitor` - one method per kind - and asks the container to
:meth:`~Container.accept` it, which calls the method of its own kind. The visitor's methods
keep each command's own code where it lives (the verifier in :mod:`fastckpt.container.verify`,
the lazy reader's targets in :mod:`fastckpt.container.lazy`, the commands in
:mod:`fastckpt.cli`), so this module imports nothing above the container layer; and a visitor
that misses a kind cannot be instantiated (mypy says so before it runs), so a new kind cannot
be forgotten by one caller.

```python
class Where(KindVisitor[str]):
    def root(self, c): return f"root {c.root}"
    def index(self, c): return f"index {c.index} of {c.root}"
    def manager(self, c): return "a CheckpointManager checkpoint"
    def sharded(self, c): return "a sharded checkpoint"
    def file(self, c): return "a lone file"

open_container("runs/exp1/3").accept(Where())   # 'index 3 of runs/exp1'
```
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from fastckpt.container.locate import KIND_NAMES, Kind, Location, locate

__all__ = [
    "Container",
    "IndexContainer",
    "KindVisitor",
    "ManagerContainer",
    "RootContainer",
    "SavedContainer",
    "ShardedContainer",
    "TensorFile",
    "container_at",
    "open_container",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Container(ABC):
    """What a path names, of one kind (see the module docstring for the kinds).

    Attributes:
        path: the path as given (``manifest.json``, ``commit.json`` and
            ``fastckpt-dcp.json`` resolved to their directory).
    """

    path: Path
    #: The kind's name (:data:`fastckpt.container.locate.Kind`), as reports carry it.
    kind: ClassVar[Kind]
    #: Whether an index (``index=``, ``--index``) applies: a save_checkpoint root or one of its
    #: index directories.
    takes_index: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """How the kind is called in messages (``"CheckpointManager checkpoint"``)."""
        return KIND_NAMES[self.kind]

    @abstractmethod
    def accept(self, visitor: KindVisitor[T]) -> T:
        """Call the method of ``visitor`` for this kind, with this container."""


@dataclass(frozen=True)
class SavedContainer(Container):
    """A :func:`fastckpt.save_checkpoint` root or one of its index directories.

    Attributes:
        root: the save_checkpoint root (``manifest.json`` inside).
    """

    root: Path
    takes_index: ClassVar[bool] = True

    @property
    def own_index(self) -> int | None:
        """The index an index directory is (None for the root itself)."""
        return None


@dataclass(frozen=True)
class RootContainer(SavedContainer):
    """A save_checkpoint root: every committed index, or the one ``index=`` chooses."""

    kind: ClassVar[Kind] = "root"

    def accept(self, visitor: KindVisitor[T]) -> T:
        return visitor.root(self)


@dataclass(frozen=True)
class IndexContainer(SavedContainer):
    """One index directory of a save_checkpoint root (``ROOT/<index>``).

    Attributes:
        index: the index the directory's name says.
    """

    index: int
    kind: ClassVar[Kind] = "index"

    @property
    def own_index(self) -> int | None:
        return self.index

    def accept(self, visitor: KindVisitor[T]) -> T:
        return visitor.index(self)


@dataclass(frozen=True)
class ManagerContainer(Container):
    """A CheckpointManager checkpoint directory (``commit.json`` inside)."""

    kind: ClassVar[Kind] = "manager"

    def accept(self, visitor: KindVisitor[T]) -> T:
        return visitor.manager(self)


@dataclass(frozen=True)
class ShardedContainer(Container):
    """A sharded checkpoint of :mod:`fastckpt.dcp` (``fastckpt-dcp.json`` inside)."""

    kind: ClassVar[Kind] = "sharded"

    def accept(self, visitor: KindVisitor[T]) -> T:
        return visitor.sharded(self)


@dataclass(frozen=True)
class TensorFile(Container):
    """A lone file, no commit record around it (a safetensors file, normally)."""

    kind: ClassVar[Kind] = "file"

    def accept(self, visitor: KindVisitor[T]) -> T:
        return visitor.file(self)


class KindVisitor(ABC, Generic[T]):
    """What a caller does with each kind of container: one method per kind, all required.

    Pass it to :meth:`Container.accept`; the container calls the method of its kind.
    """

    @abstractmethod
    def root(self, container: RootContainer) -> T:
        """A save_checkpoint root."""

    @abstractmethod
    def index(self, container: IndexContainer) -> T:
        """One index directory of a save_checkpoint root."""

    @abstractmethod
    def manager(self, container: ManagerContainer) -> T:
        """A CheckpointManager checkpoint."""

    @abstractmethod
    def sharded(self, container: ShardedContainer) -> T:
        """A sharded (DCP) checkpoint."""

    @abstractmethod
    def file(self, container: TensorFile) -> T:
        """A lone file."""


def _index(location: Location) -> IndexContainer:
    assert location.root is not None and location.index is not None
    return IndexContainer(location.path, location.root, location.index)


#: The class of each kind :func:`locate` tells.
_CLASSES: dict[Kind, Callable[[Location], Container]] = {
    "root": lambda location: RootContainer(location.path, location.path),
    "index": _index,
    "manager": lambda location: ManagerContainer(location.path),
    "sharded": lambda location: ShardedContainer(location.path),
    "file": lambda location: TensorFile(location.path),
}


def container_at(location: Location) -> Container:
    """The container of a :class:`~fastckpt.container.locate.Location`."""
    return _CLASSES[location.kind](location)


def open_container(path: str | os.PathLike[str]) -> Container:
    """The container ``path`` names (what :func:`~fastckpt.container.locate.locate` tells).

    Raises:
        FileNotFoundError: it does not exist, is neither a regular file nor a directory, or is
            a directory that is not a fastckpt checkpoint (the message says which).
    """
    return container_at(locate(path))
