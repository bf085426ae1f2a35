"""Every on-disk name and record, defined once.

* :mod:`fastckpt.format.paths` - relative paths read from records, checked.
* :mod:`fastckpt.format.records` - ``manifest.json``, ``commit.json``, ``refs.json`` and their
  schema versions: parsing and sealing.
* :mod:`fastckpt.format.sharded` - DCP ``Metadata`` <-> the JSON record ``fastckpt-dcp.json``.

The package imports nothing itself.
"""
