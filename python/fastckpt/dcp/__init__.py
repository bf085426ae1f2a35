"""fastckpt as the storage layer of PyTorch Distributed Checkpoint (DCP).

DCP plans sharded saves and loads (who writes which chunk, deduplication, resharding onto a
new mesh); fastckpt stores the chunks: Rust-written safetensors files with crc32c, JSON
metadata instead of pickle, and an atomic commit.

```python
import torch.distributed.checkpoint as dcp
import fastckpt.dcp

dcp.save(state, storage_writer=fastckpt.dcp.Writer("ckpt/step-100"))
dcp.load(state, storage_reader=fastckpt.dcp.Reader("ckpt/step-100"))
fastckpt.dcp.verify_sharded("ckpt/step-100")            # no process group needed
fastckpt.dcp.consolidate("ckpt/step-100", "full.safetensors")
```

See ``docs/sharded.md``.
"""

from __future__ import annotations

from fastckpt.container.sharded.commit import RECORD_NAME
from fastckpt.container.sharded.consolidate import consolidate, describe_sharded, verify_sharded
from fastckpt.dcp.reader import Reader
from fastckpt.dcp.stager import DcpStager
from fastckpt.dcp.state import (
    async_save_state,
    contains_dtensors,
    is_sharded_checkpoint,
    load_state,
    save_state,
)
from fastckpt.dcp.writer import Writer
from fastckpt.errors import NotCommittedError, UnsupportedValueError

__all__ = [
    "RECORD_NAME",
    "DcpStager",
    "NotCommittedError",
    "Reader",
    "UnsupportedValueError",
    "Writer",
    "async_save_state",
    "consolidate",
    "contains_dtensors",
    "describe_sharded",
    "is_sharded_checkpoint",
    "load_state",
    "save_state",
    "verify_sharded",
]
