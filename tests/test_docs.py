"""Every example in the user guide (docs/) runs as written.

Each page runs in a fresh temporary directory, as a script would run there (the directory is
on ``sys.path``). Its fenced blocks run in page order:

* ```python blocks are executed in one namespace per page; a block whose first line is
  ``# file: NAME.py`` is written to that file instead (a module later blocks import);
* ```bash blocks must start with ``fastckpt ``; every line is run as ``python -m fastckpt``
  with the same arguments against the files the page's python blocks created, and must exit
  0, or N when the line ends with ``# exit status N``;
* ```text, ```console and ```json blocks are shown, never run (``make demo``, sample output);
  a ```text block right after a bash block (its commands' output, in order), or after a
  python block that prints, is that block's sample output: it must be what the block prints
  now, up to the parts that differ between runs (times, durations, rates; :func:`normalized`).
  ``FASTCKPT_REGEN_DOCS=1`` rewrites the blocks that differ from the real output instead.

Relative links between the guide's pages must point at existing pages.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastckpt.checkpoint import trust, values

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
SHOWN_ONLY = {"text", "console", "json"}
FILE_MARKER = re.compile(r"#\s*file:\s*(\S+\.py)\s*$")
EXIT_MARKER = re.compile(r"\s+#\s*exit status\s+(\d+)\s*$")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
REQUIRED = [
    "getting-started.md",
    "strategy-and-hooks.md",
    "checkpoint-manager.md",
    "specs-and-trust.md",
    "on-disk-format.md",
    "reliability.md",
    "performance.md",
    "migrating.md",
    "cli.md",
    "sharded.md",
    "object-storage.md",
    "lazy-reads.md",
    "lightning.md",
    "incremental.md",
]


#: What differs between two runs of a command: ISO and table timestamps, durations, rates.
VOLATILE = [
    (re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?(\+00:00)?"), "<time>"),
    (re.compile(r"\b\d+(\.\d+)? s\b"), "<seconds> s"),
    (re.compile(r"\(\d+(\.\d+)? [KMGT]?i?B/s\)"), "(<rate>)"),
    # The checksums of trained weights: the same seed gives different float results on CPUs
    # with other vector units (the CI machine's differ from the one the samples came from).
    (re.compile(r"\b(crc32c|computed) [0-9a-f]{8}\b"), r"\1 <crc32c>"),
]
REGENERATE = os.environ.get("FASTCKPT_REGEN_DOCS") == "1"


def normalized(text: str) -> str:
    """``text`` with the parts that differ between runs replaced by placeholders, table
    padding collapsed (a timestamp's width is fixed, but a placeholder's is not)."""
    for pattern, placeholder in VOLATILE:
        text = pattern.sub(placeholder, text)
    return "\n".join(re.sub(r"  +", "  ", line.rstrip()) for line in text.strip().splitlines())


@dataclass
class Block:
    """One fenced block of a page."""

    language: str
    body: str
    line: int
    start: int  # offsets of the body in the page
    end: int
    follows_directly: bool  # only blank lines between the previous block and this one


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, with the line each starts on."""
    text = page.read_text()
    found = []
    previous_end = None
    for m in FENCE.finditer(text):
        direct = previous_end is not None and not text[previous_end : m.start()].strip()
        found.append(
            Block(
                m.group(1),
                m.group(2),
                text.count("\n", 0, m.start()) + 1,
                m.start(2),
                m.end(2),
                direct,
            )
        )
        previous_end = m.end()
    return found


def fastckpt_lines(block: Block) -> list[tuple[list[str], int]]:
    """``(arguments, expected exit status)`` of each command line of a bash block."""
    commands = []
    for raw in block.body.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        expected = 0
        marker = EXIT_MARKER.search(line)
        if marker:
            expected = int(marker.group(1))
            line = line[: marker.start()]
        words = shlex.split(line, comments=True)
        assert words[0] == "fastckpt", f"line {block.line}: bash blocks run only fastckpt: {raw}"
        commands.append((words[1:], expected))
    return commands


def test_the_guide_has_every_page() -> None:
    assert sorted(p.name for p in PAGES if p.name in REQUIRED) == sorted(REQUIRED)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_between_pages_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if "://" in target or not target.endswith(".md") or target.startswith("../"):
            continue  # external, or outside the guide (owned by other parts of the repo)
        assert (page.parent / target).is_file(), f"{page.name}: broken link to {target}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, registry in (
        (values, "_SERIALIZERS"),
        (trust, "_TRUSTED_PATHS"),
        (trust, "_TRUSTED_OBJECTS"),
    ):
        # pages register serializers and trusted targets: keep them out of other tests
        monkeypatch.setattr(module, registry, copy.copy(getattr(module, registry)))
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    written: list[str] = []
    last_output: str | None = None  # what the block just run printed (None: nothing)
    rewrites: list[tuple[Block, str]] = []
    try:
        for block in blocks(page):
            output, last_output = last_output, None
            where = f"{page.name}:{block.line}"
            if block.language == "python":
                first = block.body.splitlines()[0] if block.body else ""
                marker = FILE_MARKER.match(first)
                if marker:
                    (tmp_path / marker.group(1)).write_text(block.body)
                    written.append(Path(marker.group(1)).stem)
                    continue
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    exec(compile(block.body, where, "exec"), namespace)
                last_output = printed.getvalue() or None
            elif block.language == "bash":
                outputs = []
                for args, expected in fastckpt_lines(block):
                    result = subprocess.run(
                        [sys.executable, "-m", "fastckpt", *args],
                        capture_output=True,
                        text=True,
                        timeout=120,
                    )
                    assert result.returncode == expected, (
                        f"{where}: fastckpt {shlex.join(args)} exited {result.returncode}, "
                        f"expected {expected}\n{result.stdout}{result.stderr}"
                    )
                    assert "Traceback" not in result.stderr, result.stderr
                    outputs.append(result.stdout)
                last_output = "".join(outputs)
            elif block.language == "text" and block.follows_directly and output is not None:
                if REGENERATE:
                    if normalized(block.body) != normalized(output):
                        rewrites.append((block, output))
                else:
                    assert normalized(block.body) == normalized(output), (
                        f"{where}: the sample output differs from what the block prints now "
                        f"(FASTCKPT_REGEN_DOCS=1 rewrites it):\n{output}"
                    )
            else:
                assert block.language in SHOWN_ONLY, (
                    f"{where}: fence language {block.language!r}; use python or bash to run "
                    f"it, or one of {sorted(SHOWN_ONLY)} to only show it"
                )
    finally:
        for name in written:  # modules the page wrote must not leak into other pages
            sys.modules.pop(name, None)
    if rewrites:
        text = page.read_text()
        for block, output in sorted(rewrites, key=lambda pair: -pair[0].start):
            text = text[: block.start] + output.rstrip("\n") + "\n" + text[block.end :]
        page.write_text(text)
