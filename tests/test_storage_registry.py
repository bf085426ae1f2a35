"""The scheme registry: a path's URL scheme picks its storage backend from one table, so a
new store is one backend module and one entry (storage/registry.py)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from fastckpt.storage import registry
from fastckpt.storage.backend import LOCAL


@pytest.fixture
def memstore(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A backend module for ``mem://`` that records what it was asked."""
    calls = types.SimpleNamespace(opened=[], options=[])
    module = types.ModuleType("memstore_backend")
    sentinel = object()

    def backend_for_url(url: str) -> Any:
        calls.opened.append(url)
        return sentinel

    def register_storage_options(url: str, options: Any) -> None:
        calls.options.append((url, options))

    module.backend_for_url = backend_for_url  # type: ignore[attr-defined]
    module.register_storage_options = register_storage_options  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "memstore_backend", module)
    monkeypatch.setitem(registry.SCHEMES, "mem", "memstore_backend")
    calls.sentinel = sentinel
    return calls


def test_a_registered_scheme_gets_its_own_backend(memstore: types.SimpleNamespace) -> None:
    assert registry.is_object_url("mem://bucket/run")
    assert registry.is_object_url(Path("mem://bucket/run"))  # pathlib's spelling, mem:/bucket
    assert registry.backend_for("mem://bucket/run") is memstore.sentinel
    assert registry.display_path(Path("mem://bucket/run")) == "mem://bucket/run"
    registry.configure_storage("mem://bucket", endpoint_url="http://127.0.0.1:1")
    assert memstore.options == [("mem://bucket", {"endpoint_url": "http://127.0.0.1:1"})]
    assert memstore.opened == ["mem://bucket/run"]


def test_unregistered_schemes_and_plain_paths_are_local(tmp_path: Path) -> None:
    for path in (tmp_path, "runs/a", "gs://bucket/run", "x:/y"):
        assert not registry.is_object_url(path)
        assert registry.backend_for(path) is LOCAL
    # (other schemes a test registered, the benchmark's throttled://, may be listed too)
    with pytest.raises(ValueError, match=r"only s3://(, \w+://)* URLs take storage options"):
        registry.configure_storage("gs://bucket", region="x")


def test_register_scheme_checks_the_name() -> None:
    with pytest.raises(ValueError, match="a scheme is a name"):
        registry.register_scheme("c", "some.module")  # a Windows drive letter, not a scheme


def test_s3_is_the_registered_object_store() -> None:
    assert registry.SCHEMES["s3"] == "fastckpt.storage.s3.backend"
    assert registry.is_object_url("s3://bucket/key") and registry.is_object_url("s3:/bucket/key")
