"""The on-disk store: everything that knows file names, records and commit protocols.

* :mod:`fastckpt.store.paths` - names and relative paths read from records, checked.
* :mod:`fastckpt.store.records` - ``manifest.json`` and ``commit.json``: names, schema
  versions, parsing and serialization, defined once.
* :mod:`fastckpt.store.backend` - the storage interface every read and write goes through;
  the local filesystem is its first implementation.
* :mod:`fastckpt.store.reader` - the one check of a recorded file (size + crc32c).
* :mod:`fastckpt.store.commit` - the root lock and the atomic directory/index commits.
* :mod:`fastckpt.store.locate` - what a path names (root, index, manager checkpoint, file).

The package imports nothing itself: import the module you need.
"""
