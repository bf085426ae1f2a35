"""The package face: every public name resolves, and ``import fastckpt`` imports no torch."""

from __future__ import annotations

import subprocess
import sys

import fastckpt


def test_every_public_name_resolves_to_the_object_of_its_module() -> None:
    import fastckpt.verify  # binding the submodule must not replace the function verify

    public = set(fastckpt.__all__) - {"__version__"}
    assert public == set(fastckpt._MODULE_OF)  # one list of names, nothing missing
    for name in sorted(public):
        value = getattr(fastckpt, name)
        module = sys.modules[fastckpt._MODULE_OF[name]]
        assert value is getattr(module, name), name
    assert set(dir(fastckpt)) >= public | {"dcp", "integrations"}
    assert callable(fastckpt.verify) and fastckpt.verify.__name__ == "verify"


def test_import_fastckpt_is_light_until_a_name_is_used() -> None:
    code = (
        "import sys, fastckpt; assert 'torch' not in sys.modules, 'torch at import'; "
        "fastckpt.save_file; assert 'torch' in sys.modules; "
        "assert 'torch.distributed.checkpoint' not in sys.modules; "
        "fastckpt.dcp.Writer; assert 'torch.distributed.checkpoint' in sys.modules; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_unknown_names_raise_attribute_error() -> None:
    try:
        fastckpt.no_such_name  # noqa: B018
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("fastckpt.no_such_name resolved")
