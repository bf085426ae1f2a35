"""S3-compatible object stores: URLs and options, the client, tensors as objects, the backend.

* :mod:`fastckpt.storage.s3.config` - ``S3Url``, ``S3Options``.
* :mod:`fastckpt.storage.s3.errors` - the ``ObjectStoreError`` family.
* :mod:`fastckpt.storage.s3.client` - the obstore / boto3 client.
* :mod:`fastckpt.storage.s3.tensors` - safetensors files as objects.
* :mod:`fastckpt.storage.s3.copy` - server-side copies of unchanged byte ranges.
* :mod:`fastckpt.storage.s3.backend` - ``S3Backend``, ``S3Staging`` and the lease lock.

The package imports nothing itself.
"""
