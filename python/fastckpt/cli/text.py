"""Text the commands print from what they read: names made safe for a terminal."""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: object) -> str:
    """``str(text)`` as the commands print a name read from a checkpoint or a folder they did
    not write (a tensor name, a metadata pair, an item, a file's relpath): every character
    Python does not count as printable (:meth:`str.isprintable`: the C0 controls, newline and
    tab included, DEL, the C1 controls, the Unicode line and paragraph separators, the
    bidirectional and other format controls, a lone surrogate) as its backslash escape
    (``\\n``, ``\\x1b``, ``\\u202e``), as the command line shows a name that is not
    UTF-8. Before, a downloaded file's tensor named ``w\\nok: ...`` forged a line of
    ``fastckpt verify``'s answer, and ``ESC [2J`` in a name cleared the terminal."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
