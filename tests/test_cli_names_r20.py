"""Names read from a checkpoint's files reach the terminal escaped (round 20, interop finding 4).

A safetensors file downloaded from a hub chooses its tensor names and metadata. Before,
``fastckpt inspect`` and ``verify`` (and ``diff``, ``ls``, the sharded tables) printed them raw:
a newline in a name forged a line of output (``ok: model.safetensors: 1 file(s) verified``
under an UNCHECKED report), ``ESC [2J`` cleared the screen, colour codes and a right-to-left
override changed what the reader saw. Now every character Python does not count as printable
is shown as its backslash escape (``\\n``, ``\\x1b``, ``\\u202e``), while ordinary Unicode
names print as they are. Each runs in-process through ``cli.main`` on real files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import fastckpt
import fastckpt.dcp
from cli_support import Run, cli_runner
from fastckpt.cli.text import printable

#: Names that forge a line, drive the terminal, or hide what they say.
HOSTILE = [
    "w\nok: model.safetensors: 1 file(s) verified",  # a forged "ok:" line
    "w\x1b[2J\x1b[32mall good\x1b[0m",  # clear screen, colours
    "w\rok",  # carriage return: overwrites the line
    "w\x00\x07\x7f",  # NUL, BEL, DEL
    "w\x9b31m",  # C1 CSI: a colour code on terminals that honour 8-bit controls
    "w\u2028ok",  # LINE SEPARATOR: a line break to some viewers
    "w\u202egnp.exe",  # RIGHT-TO-LEFT OVERRIDE: shows as "wexe.png"
]


@pytest.fixture()
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli.main(args)``: (status, stdout, stderr)."""
    return cli_runner(capsys)


def foreign_file(path: Path, names: list[str], metadata: dict[str, str] | None = None) -> Path:
    """A safetensors file as another tool writes it (no fastckpt checksums): one float32
    scalar-sized tensor per name, and ``metadata``."""
    header: dict[str, object] = {}
    for i, name in enumerate(names):
        header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = json.dumps(header).encode()
    payload = b"".join(struct.pack("<f", float(i)) for i in range(len(names)))
    path.write_bytes(struct.pack("<Q", len(data)) + data + payload)
    return path


def assert_terminal_safe(text: str, lines: int | None = None) -> None:
    """Nothing but printable characters and the output's own newlines; ``lines`` of them."""
    odd = sorted({c for c in text if not c.isprintable() and c != "\n"})
    assert not odd, (odd, text)
    if lines is not None:
        assert len(text.splitlines()) == lines, text


@pytest.mark.parametrize("name", HOSTILE, ids=[ascii(n) for n in HOSTILE])
def test_inspect_and_verify_print_a_foreign_files_tensor_names_escaped(
    run: Run, tmp_path: Path, name: str
) -> None:
    """Before: the names went to stdout raw, e.g. verify's ``unchecked: w`` then a forged
    ``ok: model.safetensors: 1 file(s) verified`` line; now one escaped name per row."""
    path = foreign_file(tmp_path / "names.safetensors", [name])
    status, out, err = run("inspect", path)
    assert status == 0, err
    assert_terminal_safe(out, lines=3)  # the head, the table's header, its row
    assert printable(name) in out
    status, out, err = run("verify", path)
    assert status == 3, err  # unchecked: no checksums
    assert_terminal_safe(out, lines=3)
    assert f"unchecked: {printable(name)}" in out
    assert not any(line.startswith("ok:") for line in out.splitlines())


def test_inspect_prints_a_foreign_files_metadata_escaped(run: Run, tmp_path: Path) -> None:
    """Before: ``metadata: k<ESC>[31m=v`` and a forged line after it."""
    path = foreign_file(tmp_path / "meta.safetensors", ["w"], {"k\x1b[31m": "v\nok: all verified"})
    status, out, err = run("inspect", path)
    assert status == 0, err
    assert_terminal_safe(out, lines=4)
    assert "metadata: k\\x1b[31m=v\\nok: all verified" in out


def test_diff_prints_added_and_removed_names_escaped(run: Run, tmp_path: Path) -> None:
    """Before: the CHANGE table's TENSOR cells were raw (a newline split a row in two)."""
    a = foreign_file(tmp_path / "a.safetensors", ["same", "gone\nidentical: 2 tensor(s)"])
    b = foreign_file(tmp_path / "b.safetensors", ["same", "new\x1b[2J"])
    status, out, err = run("diff", a, b)
    assert status == 1, err
    assert_terminal_safe(out)
    assert "gone\\nidentical: 2 tensor(s)" in out and "new\\x1b[2J" in out
    assert not any(line.startswith("identical:") for line in out.splitlines())


def test_ls_and_inspect_of_manager_checkpoints_escape_item_names(run: Run, tmp_path: Path) -> None:
    """An item key (``commit.json``'s ``items``) and a value path are file contents too."""
    item = "model\x1b[31m\nstep_99"
    config = fastckpt.CheckpointManager.Config.with_sync_save()
    with fastckpt.CheckpointManager(config) as manager:
        manager.save(tmp_path / "step_1", {item: {"w": torch.ones(2), "note\rx": 1}})
    status, out, err = run("ls", tmp_path)
    assert status == 0, err
    assert_terminal_safe(out)
    assert printable(item) in out
    status, out, err = run("inspect", tmp_path / "step_1")
    assert status == 0, err
    assert_terminal_safe(out)
    assert f"item {printable(item)}:" in out


def test_promote_prints_a_checkpoint_folder_name_escaped(run: Run, tmp_path: Path) -> None:
    """A manager checkpoint's folder name (chosen by whoever saved into the tier) reached
    the terminal raw in ``promote``'s report."""
    name = "step\x1b[2J\nok"
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        m.save(tmp_path / "tier" / name, {"m": {"w": torch.ones(2)}})
    status, out, err = run("promote", tmp_path / "tier", tmp_path / "durable")
    assert status == 0, err
    assert_terminal_safe(out + err)
    assert f"promoted {printable(name)} of" in out
    status, out, err = run("promote", tmp_path / "tier", tmp_path / "durable")
    assert status == 0, err
    assert_terminal_safe(out + err)
    assert f"already holds {printable(name)}" in out


def test_verify_of_a_folder_of_checkpoints_prints_their_folder_names_escaped(
    run: Run, tmp_path: Path
) -> None:
    """A folder of manager checkpoints whose names another tool chose: before, ``verify``
    printed each folder name raw, so a damaged checkpoint named ``b\nok: ...`` forged an
    ``ok:`` line under its own ``BAD:`` line (the round-20 note left this open)."""
    names = ["a\x1b[2J", "b\nok: forged: 1 item(s) verified"]
    with fastckpt.CheckpointManager(fastckpt.CheckpointManager.Config.with_sync_save()) as m:
        for name in names:
            m.save(tmp_path / name, {"m": {"w": torch.ones(64)}})
    data = next((tmp_path / names[1]).rglob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # a flipped byte in the damaged one's tensor data
    data.write_bytes(bytes(raw))
    status, out, err = run("verify", tmp_path)
    assert status == 1, (out, err)
    assert_terminal_safe(out + err)
    assert not any(line.startswith("ok: forged") for line in out.splitlines()), out
    assert f"BAD: {printable(tmp_path / names[1])}" in out
    assert f"ok: {printable(tmp_path / names[0])}" in out


def test_inspect_of_a_sharded_checkpoint_escapes_tensor_and_value_names(
    run: Run, tmp_path: Path
) -> None:
    """The GLOBAL SHAPE table and the ``values:`` line of a sharded (DCP) checkpoint."""
    state = {"model": {"w\x1b[2J": torch.ones(2), "v\nok": 3}}
    fastckpt.dcp.save_state(tmp_path / "dcp", state)
    status, out, err = run("inspect", tmp_path / "dcp")
    assert status == 0, err
    assert_terminal_safe(out)
    assert "model.w\\x1b[2J" in out and "model.v\\nok" in out


def test_an_error_quoting_a_tensor_name_is_escaped(run: Run, tmp_path: Path) -> None:
    """The one-line error on stderr quotes the malformed tensor's name; before, its ESC
    sequence reached the terminal (``one_line`` only folded its newline)."""
    name = "w\x1b[2J\x1b]0;title\x07"
    path = tmp_path / "bad.safetensors"
    header = json.dumps({name: {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<f", 1.0))
    status, out, err = run("inspect", path)
    assert status == 2 and not out
    assert_terminal_safe(err, lines=1)
    assert "w\\x1b[2J\\x1b]0;title\\x07" in err


def test_ordinary_unicode_names_print_as_they_are(run: Run, tmp_path: Path) -> None:
    """Only what a terminal would act on is escaped: accents, CJK and emoji are names."""
    names = ["Gewicht.ß", "权重.偏置", "emb.🙂", "a b"]
    path = foreign_file(tmp_path / "plain.safetensors", names)
    status, out, err = run("inspect", path)
    assert status == 0, err
    assert all(name in out for name in names)
    assert "\\" not in out


def test_printable_escapes_every_control_and_separator_class() -> None:
    """C0 (tab and newline included), DEL, C1, the Unicode line and paragraph separators,
    bidirectional controls, a lone surrogate (a non-UTF-8 byte of a file name): each as its
    backslash escape; anything else (and a non-string) as ``str()`` gives it."""
    assert printable("a\tb\nc\x1b") == "a\\tb\\nc\\x1b"
    assert printable("\x00\x7f\x85\x9b") == "\\x00\\x7f\\x85\\x9b"
    assert printable("\u2028\u2029\u202e\u2066") == "\\u2028\\u2029\\u202e\\u2066"
    assert printable("caf\udce9") == "caf\\udce9"
    assert printable("plain name.weight") == "plain name.weight"
    assert printable(3) == "3"
