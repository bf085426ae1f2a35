"""The old ``fastckpt.store`` package path: its modules moved to :mod:`fastckpt.format`,
:mod:`fastckpt.storage` and :mod:`fastckpt.container` (docs/architecture.md); each old
module path (``fastckpt.store.commit``, ...) still imports, as the module at its new path.
"""
