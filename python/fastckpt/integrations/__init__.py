"""Plugins that put fastckpt under other training frameworks.

* :mod:`fastckpt.integrations.lightning` - a PyTorch Lightning ``CheckpointIO`` (and its
  asynchronous form); needs the ``lightning`` extra (``pip install 'fastckpt-io[lightning]'``).

The package imports nothing itself, so importing it never requires an optional framework:
import the module you need.
"""
