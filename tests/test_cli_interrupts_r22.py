"""Ctrl-C in the command line exits 130 "interrupted", however Python delivered it.

Round 22 (helper: interrupts): a Ctrl-C landing while a module's dataclass was being created
(``__set_name__``) reached the CLI as a ``RuntimeError`` whose cause is the
``KeyboardInterrupt``: ``fastckpt verify`` exited 1 with a traceback, the status it gives a
damaged checkpoint, 1 run in 40 interrupted at start-up.
"""

from __future__ import annotations

import pytest

from fastckpt.cli.main import EXIT_INTERRUPTED, _run


def _wrapped_interrupt() -> int:
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as interrupt:
        raise RuntimeError(
            "Error calling __set_name__ on 'Field' instance 'unchecked_tensors' in 'FileReport'"
        ) from interrupt


def _plain_interrupt() -> int:
    raise KeyboardInterrupt


@pytest.mark.parametrize("action", [_wrapped_interrupt, _plain_interrupt])
def test_an_interrupt_exits_130_even_wrapped_in_another_error(
    action: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert EXIT_INTERRUPTED == 130
    assert _run(action, "verify", debug=False) == EXIT_INTERRUPTED  # type: ignore[arg-type]
    captured = capsys.readouterr()
    assert captured.err == "fastckpt verify: interrupted\n" and captured.out == ""


def test_a_bug_not_caused_by_an_interrupt_still_raises() -> None:
    def bug() -> int:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        _run(bug, "verify", debug=False)
    with pytest.raises(RuntimeError, match="__set_name__"):  # --debug shows the traceback
        _run(_wrapped_interrupt, "verify", debug=True)
