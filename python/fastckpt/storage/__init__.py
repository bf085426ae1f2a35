"""Where bytes live: the storage-backend interface and its implementations.

* :mod:`fastckpt.storage.backend` - ``StorageBackend`` and ``Staging`` (the interface every
  read and write goes through) and the local filesystem, the first implementation.
* :mod:`fastckpt.storage.s3` - S3-compatible object stores (a subpackage).
* :mod:`fastckpt.storage.registry` - URL scheme -> backend; ``configure_storage``.
* :mod:`fastckpt.storage.lock` - the root lock.

The package imports nothing itself.
"""
