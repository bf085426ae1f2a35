"""A committed set of files: written, committed, read back, verified.

* :mod:`fastckpt.container.commit` - staging, the atomic directory and index commits, prune.
* :mod:`fastckpt.container.reader` - the one check of a recorded file (size + crc32c).
* :mod:`fastckpt.container.snapshot` - consistent reads of a root that is being written.
* :mod:`fastckpt.container.locate` - what a path names (root, index, manager checkpoint, ...).
* :mod:`fastckpt.container.refs`, :mod:`fastckpt.container.links` - references between
  checkpoints and the links that keep each one self-contained.
* :mod:`fastckpt.container.verify`, :mod:`fastckpt.container.lazy`,
  :mod:`fastckpt.container.diff` - verification, lazy reads, comparison.
* :mod:`fastckpt.container.incremental` - fingerprints of unchanged tensors.
* :mod:`fastckpt.container.background` - the async engine.
* :mod:`fastckpt.container.sharded` - the sharded (DCP) container.

The package imports nothing itself.
"""
