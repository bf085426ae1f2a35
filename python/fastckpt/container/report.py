"""The result of verifying a checkpoint: one report per file, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fastckpt.container.locate import Kind
from fastckpt.container.reader import FileReport
from fastckpt.storage.registry import display_path

__all__ = ["VerifyReport"]


@dataclass
class VerifyReport:
    """The result of :func:`verify`.

    Attributes:
        target: what was verified.
        kind: ``"root"`` (save_checkpoint root), ``"index"`` (one index directory),
            ``"manager"`` (a CheckpointManager checkpoint), ``"sharded"`` (a
            :mod:`fastckpt.dcp` checkpoint) or ``"file"`` (a lone safetensors file).
        files: one :class:`FileReport` per file, the commit record itself first.
        indices: the committed indices that were checked (roots and index directories).
    """

    target: Path
    kind: Kind
    files: list[FileReport] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every file verified."""
        return all(report.ok for report in self.files)

    @property
    def failures(self) -> list[FileReport]:
        """The files that did not verify."""
        return [report for report in self.files if not report.ok]

    def failed_indices(self) -> list[int]:
        """Indices with at least one failed file (a damaged manifest fails them all)."""
        if any(not r.ok and r.index is None for r in self.files):
            return list(self.indices)
        return sorted({r.index for r in self.failures if r.index is not None})

    def index_ok(self, index: int) -> bool:
        """Whether every file of ``index`` (and the manifest) verified."""
        return index in self.indices and index not in self.failed_indices()

    def summary(self) -> str:
        """A human-readable account: one line per failure, or a one-line all-clear."""
        scope = f"{len(self.files)} file(s)"
        if self.indices:
            scope += f" of index(es) {self.indices}"
        if self.ok:
            return f"{display_path(self.target)}: ok ({scope} verified)"
        lines = [f"{display_path(self.target)}: {len(self.failures)} problem(s) in {scope}"]
        lines += [f"  {r.status}: {r.message}" for r in self.failures]
        return "\n".join(lines)

    def __str__(self) -> str:
        """Same as :meth:`summary`."""
        return self.summary()
