"""The bottom layer: one safetensors file, one nest of tensors, staging memory, byte counters.

* :mod:`fastckpt.io.headers` - the header reader and I/O defaults (no torch).
* :mod:`fastckpt.io.files` - ``save_file`` / ``load_file`` / ``read_metadata``, dtype names.
* :mod:`fastckpt.io.images` - file images: staging memory laid out as the file.
* :mod:`fastckpt.io.staging` - the CPU and CUDA stagers.
* :mod:`fastckpt.io.tree` - nested state <-> a JSON skeleton and flat tensors.
* :mod:`fastckpt.io.progress` - byte counters and the progress bar.
* :mod:`fastckpt.io.paths` - names and relative paths read from untrusted records, checked
  before they touch a filesystem.
* :mod:`fastckpt.io.forksafe` - module-wide locks a forked child can take.

Nothing here knows a checkpoint's layout. The package imports nothing itself.
"""
