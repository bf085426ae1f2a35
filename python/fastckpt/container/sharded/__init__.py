"""The sharded container under :mod:`fastckpt.dcp`: parts, chunks, values, commit, export.

The package imports nothing itself.
"""
