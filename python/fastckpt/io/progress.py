"""A one-line progress bar for long command-line operations, shown only on a terminal.

fastckpt's heavy work (reading, checksumming, writing) runs inside single Rust calls with the
GIL released. :func:`polled_progress` draws a bar from a background thread that polls a byte
count: a :class:`fastckpt._native.ByteCounter` that the Rust core advances where the bytes are
moved, or (:func:`io_progress`) the bytes this process has read and written (``rchar`` +
``wchar`` of ``/proc/self/io``). Where no counter exists the bar simply jumps to done.

Nothing is drawn when the stream is not a terminal (pipes, files, CI logs): scripts that
parse the output never see control characters.
"""

from __future__ import annotations

import contextvars
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "IOMeter",
    "ProgressBar",
    "active_counter",
    "counting",
    "format_bytes",
    "io_progress",
    "log_throughput",
    "polled_progress",
]

log = logging.getLogger(__name__)

_PROC_IO = Path("/proc/self/io")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


#: The byte counter that loads through a file mapping advance, for the duration of
#: :func:`counting` in this thread. Mapped reads are page faults, not ``read`` calls, so only the
#: core (which hashes every byte it maps) can count them for a progress bar.
_ACTIVE_COUNTER: contextvars.ContextVar[Any] = contextvars.ContextVar("fastckpt_progress")


@contextmanager
def counting(counter: Any) -> Iterator[Any]:
    """Make ``counter`` (a :class:`fastckpt._native.ByteCounter`) the one that mapped loads of
    this thread advance (see :func:`active_counter`) until the block ends."""
    token = _ACTIVE_COUNTER.set(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTER.reset(token)


def active_counter() -> Any:
    """The counter set by the innermost :func:`counting` block of this thread, or None."""
    return _ACTIVE_COUNTER.get(None)


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB."""
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class IOMeter:
    """Bytes this process has read plus written since the meter was created.

    Attributes:
        available: whether the platform exposes the counters (Linux ``/proc/self/io``).
    """

    def __init__(self, path: Path = _PROC_IO) -> None:
        """Take the starting reading."""
        self._path = path
        start = self._read()
        self.available = start is not None
        self._start = start or 0

    def _read(self) -> int | None:
        try:
            text = self._path.read_text()
        except OSError:
            return None
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        try:
            return int(fields["rchar"]) + int(fields["wchar"])
        except (KeyError, ValueError):
            return None

    def moved(self) -> int:
        """Bytes read + written since creation (0 when unavailable)."""
        now = self._read()
        return 0 if now is None else max(0, now - self._start)


class ProgressBar:
    """``label [######------]  45%  1.2 GiB / 2.6 GiB  850.0 MiB/s`` on one redrawn line.

    Draws only when ``stream`` is a terminal (or ``enabled=True``); otherwise every method is
    a no-op. Redraws are rate-limited, and :meth:`close` erases the line so the command's own
    output starts on a clean line.

    Args:
        label: what is being done (shown first).
        total: expected bytes (None: unknown, so no percentage).
        stream: where to draw (default ``sys.stderr``).
        enabled: force drawing on or off (default: ``stream.isatty()``).
        min_interval: seconds between redraws.
        clock: monotonic time source (tests pass a fake one).
    """

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Prepare the bar; nothing is drawn before the first :meth:`update`."""
        self.label = label
        self.total = total if total and total > 0 else None
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self.done = 0
        self._min_interval = min_interval
        self._clock = clock
        self._started = clock()
        self._last_draw: float | None = None
        self._drawn = False
        self._lock = threading.Lock()

    def update(self, done: int, *, force: bool = False) -> None:
        """Set the progress to ``done`` bytes and redraw if enough time has passed."""
        with self._lock:
            self.done = max(self.done, done)
            if not self.enabled:
                return
            now = self._clock()
            recent = self._last_draw is not None and now - self._last_draw < self._min_interval
            if recent and not force:
                return
            self._last_draw = now
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The text of the bar as it would be drawn now, narrower than the terminal.

        A line as wide as the terminal wraps, and every later redraw (``\\r``) then leaves the
        wrapped part behind, so the bar drops detail to fit: first the rate, then the byte
        counts; the label is cut last.
        """
        elapsed = max((self._clock() if now is None else now) - self._started, 1e-9)
        done = min(self.done, self.total) if self.total else self.done
        width = max(shutil.get_terminal_size((80, 24)).columns - 1, 1)
        rate = f"{format_bytes(done / elapsed)}/s"
        if self.total is None:
            return _fit([self.label, format_bytes(done), rate], width)
        fraction = done / self.total
        percent = f"{fraction * 100:3.0f}%"
        amounts = f"{format_bytes(done)} / {format_bytes(self.total)}"
        for details in ([percent, amounts, rate], [percent, amounts], [percent]):
            tail = "  ".join(details)
            cells = min(40, width - len(self.label) - len(tail) - 4)  # " [" + "] "
            if cells >= 10:
                filled = int(fraction * cells)
                return f"{self.label} [{'#' * filled}{'-' * (cells - filled)}] {tail}"
        return _fit([self.label, percent], width)

    def _draw(self, now: float) -> None:
        self.stream.write("\r\x1b[2K" + self.line(now))
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Erase the bar (if one was drawn)."""
        with self._lock:
            if self.enabled and self._drawn:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
                self._drawn = False


def _fit(parts: list[str], width: int) -> str:
    """``parts`` joined by two spaces, dropping trailing parts (then cutting) to fit ``width``."""
    while len(parts) > 1 and len("  ".join(parts)) > width:
        parts = parts[:-1]
    return "  ".join(parts)[:width]


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # closed or detached stream
        return False


@contextmanager
def polled_progress(
    label: str,
    total: int | None,
    moved: Callable[[], int | None],
    *,
    stream: TextIO | None = None,
    enabled: bool | None = None,
    interval: float = 0.1,
) -> Iterator[ProgressBar]:
    """Draw a :class:`ProgressBar` for the duration of the block, polling ``moved()``.

    ``moved()`` returns the bytes done so far (``None``: no counter on this platform, so the
    bar only shows the start and the end). On a non-terminal nothing runs at all (no thread,
    no output). The final count is drawn before the bar is erased.

    Yields:
        The bar (callers may :meth:`ProgressBar.update` it themselves as well).
    """
    bar = ProgressBar(label, total, stream=stream, enabled=enabled, min_interval=interval)
    if not bar.enabled:
        yield bar
        return
    bar.update(0, force=True)  # show at once that something is going on
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            bar.update(moved() or 0)

    poller = threading.Thread(target=poll, name="fastckpt-progress", daemon=True)
    if moved() is not None:
        poller.start()
    try:
        yield bar
    finally:
        stop.set()
        if poller.is_alive():
            poller.join()
            bar.update(moved() or 0, force=True)
        bar.close()


def io_progress(
    label: str,
    total: int | None,
    *,
    stream: TextIO | None = None,
    enabled: bool | None = None,
    interval: float = 0.1,
) -> AbstractContextManager[ProgressBar]:
    """:func:`polled_progress` fed by this process's I/O counters (``/proc/self/io``).

    ``total`` is the number of bytes the block is expected to read plus write. Reads through a
    file mapping are page faults, not ``read`` calls, and do not count: where the Rust core
    does the work, pass it a :class:`fastckpt._native.ByteCounter` and poll that instead.
    """
    meter = IOMeter()
    return polled_progress(
        label,
        total,
        meter.moved if meter.available else lambda: None,
        stream=stream,
        enabled=enabled,
        interval=interval,
    )


def log_throughput(
    action: str, where: str, records: Iterable[Mapping[str, int]], start: float
) -> None:
    """Log a save/load at INFO on the ``fastckpt`` logger: files, bytes, seconds, GiB/s."""
    if not log.isEnabledFor(logging.INFO):
        return
    seconds = time.perf_counter() - start
    records = list(records)
    nbytes = sum(record["size"] for record in records)
    rate = nbytes / 2**30 / seconds if seconds > 0 else float("inf")
    log.info(
        "%s %s: %d files, %.1f MiB in %.3f s (%.2f GiB/s)",
        action,
        where,
        len(records),
        nbytes / 2**20,
        seconds,
        rate,
    )
