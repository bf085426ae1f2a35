"""``python -m fastckpt.bench``: fastckpt measured side by side with its peers on your disk.

One process builds one transformer-like state (weights + Adam moments) and hands the same
tensors to every writer (fastckpt sync in its default mode, with O_DIRECT forced, without
checksums, and async; ``torch.save``, safetensors, PyTorch DCP with 1 and 2 threads and
``async_save``, and the O_DIRECT disk ceiling) and reader,
measures memory per writer and a training loop's step throughput with periodic async
checkpoints, and checks the bar of ``docs/performance.md``. See ``benches/README.md``.

Modules: :mod:`~fastckpt.bench.state` (the state), :mod:`~fastckpt.bench.writers`,
:mod:`~fastckpt.bench.readers`, :mod:`~fastckpt.bench.cache` (cold reads),
:mod:`~fastckpt.bench.memory`, :mod:`~fastckpt.bench.training`, :mod:`~fastckpt.bench.bar`,
:mod:`~fastckpt.bench.report`, :mod:`~fastckpt.bench.environment`,
:mod:`~fastckpt.bench.harness` (the run) and :mod:`~fastckpt.bench.cli` (the options).
Scenarios of their own: ``s3`` (:mod:`~fastckpt.bench.s3`), ``s3-sharded``
(:mod:`~fastckpt.bench.s3_sharded`) and ``tiers`` (:mod:`~fastckpt.bench.tiers`: a fast tier
promoted to S3 or to a throttled directory, :mod:`~fastckpt.bench.throttled`, vs straight to
them; restore times).
"""

from __future__ import annotations

__all__: list[str] = []
