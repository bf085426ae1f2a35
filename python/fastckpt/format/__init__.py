"""Every on-disk name and record, defined once.

* :mod:`fastckpt.format.records` - ``manifest.json``, ``commit.json``, ``refs.json`` and their
  schema versions: parsing and sealing.
* :mod:`fastckpt.format.sharded` - DCP ``Metadata`` <-> the JSON record ``fastckpt-dcp.json``.

Records are read and written through a storage backend (:mod:`fastckpt.storage`, the layer
below). The package imports nothing itself.
"""
