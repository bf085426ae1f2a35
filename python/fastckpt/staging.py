"""Stagers: copy live tensors into host buffers that are allocated once and reused.

An async save must not write live tensors (training mutates them), so it first *stages* a
snapshot. Fresh host pages cost a page fault each (far more than a copy into warm memory; see
benches/NOTES.md), so the stagers keep one buffer per tensor name and reuse it as long as
dtype and shape match: host memory stays bounded by one copy of the state and flat across
repeated saves. :meth:`Stager.reserve` allocates (and touches) them ahead of the first save.
Given a file image's views (:mod:`fastckpt.file_images`), a stager copies into those instead,
so that the file's writer needs no second copy.

* :class:`CpuStager` - plain host buffers, synchronous copies (CPU tensors, or CUDA tensors
  when pinned memory is off).
* :class:`CudaStager` - pinned host buffers filled by non-blocking device-to-host copies on a
  side stream, synchronized before the snapshot is handed to the writer.

:class:`BackgroundWriter` is the engine both :class:`fastckpt.CheckpointManager` and
:class:`fastckpt.CheckpointHook` run their async saves on: one write in flight, an optional
capture (staging) phase that training waits on, a bounded wait for the previous write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from fastckpt.file_images import ImagePool

__all__ = [
    "BACKGROUND_NICE",
    "BackgroundWriter",
    "CpuStager",
    "CudaStager",
    "Stager",
    "StagerOptions",
    "WriteFuture",
    "background_executor",
    "make_image_pool",
    "make_stager",
    "reserve_groups",
    "stage_groups",
]

#: How much lower than the training thread the background writer runs (Linux nice units).
#: On a machine with few cores the writer's copies and syscalls otherwise take CPU from the
#: training step; at a lower priority they fill the gaps instead.
BACKGROUND_NICE = 10


def _lower_thread_priority() -> None:
    """Lower this OS thread's priority (threads it spawns, e.g. Rust writers, inherit it)."""
    try:
        current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), current + BACKGROUND_NICE)
    except (OSError, AttributeError):  # not Linux, or not permitted: run at normal priority
        pass


def background_executor(name: str) -> ThreadPoolExecutor:
    """A one-thread executor for background checkpoint work, at lowered priority."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=_lower_thread_priority
    )


@dataclass(frozen=True)
class StagerOptions:
    """How to stage. ``pinned``/``non_blocking`` only matter for CUDA tensors."""

    pinned: bool
    non_blocking: bool


class Stager(Protocol):
    """Copies tensors into reusable host buffers."""

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Return host copies of ``tensors`` (complete when this returns): copied into
        ``into[name]`` where given (a file image's view), else into the stager's own buffer."""
        ...

    def reserve(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Allocate (and touch) the buffers a :meth:`stage` of ``tensors`` will use, without
        copying; returns the bytes newly allocated (names in ``into`` need none)."""
        ...

    @property
    def allocations(self) -> int:
        """How many buffers were allocated so far (a warm stage allocates none)."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes currently held in staging buffers."""
        ...


class _BufferPool:
    """One reusable host buffer per name, replaced only when dtype/shape change."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0
        self._lock = threading.Lock()

    def get(
        self, name: str, like: torch.Tensor, into: Mapping[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``into[name]`` when given, else this pool's buffer for ``name``."""
        if into is not None and name in into:
            return into[name]
        return self._get(name, like)[0]

    def _get(self, name: str, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        with self._lock:
            buffer = self.buffers.get(name)
            if buffer is None or buffer.dtype != like.dtype or buffer.shape != like.shape:
                buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)
                self.buffers[name] = buffer
                self.allocations += 1
                return buffer, True
            return buffer, False

    def reserve(
        self, tensors: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None
    ) -> int:
        """Allocate the missing buffers for ``tensors`` (except names in ``into``) and touch
        their pages (a page fault per fresh page is most of a first copy's cost); returns the
        bytes allocated."""
        allocated = 0
        for name, tensor in tensors.items():
            if into is not None and name in into:
                continue
            buffer, fresh = self._get(name, tensor)
            if fresh:
                buffer.zero_()
                allocated += buffer.numel() * buffer.element_size()
        return allocated

    def retain_only(
        self, names: Iterable[str], into: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Drop buffers of tensors that are no longer part of the state, or that are now
        staged into ``into``."""
        names = set(names) - set(into or ())
        with self._lock:
            for name in set(self.buffers) - names:
                del self.buffers[name]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class CpuStager:
    """Synchronous copies into reusable (unpinned) host buffers."""

    def __init__(self) -> None:
        """Create an empty pool; buffers appear on the first :meth:`stage`."""
        self._pool = _BufferPool(pinned=False)

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Copy every tensor into ``into[name]`` or its pooled buffer; return the copies."""
        staged = {}
        for name, tensor in tensors.items():
            buffer = self._pool.get(name, tensor, into)
            buffer.copy_(tensor.detach())
            staged[name] = buffer
        self._pool.retain_only(tensors, into)
        return staged

    def reserve(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Allocate and touch the buffers a :meth:`stage` of ``tensors`` will use (no copy);
        returns the bytes newly allocated."""
        return self._pool.reserve(tensors, into)

    @property
    def allocations(self) -> int:
        """Buffers allocated so far."""
        return self._pool.allocations

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return self._pool.nbytes


class CudaStager:
    """Pinned host buffers, non-blocking D2H copies on a side stream, one sync at the end."""

    def __init__(self, options: StagerOptions) -> None:
        """Create the pool (pinned per ``options``) and a side stream for the copies."""
        self.options = options
        self._pool = _BufferPool(pinned=options.pinned)
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Copy every tensor to ``into[name]`` (pinned when the image is) or its pooled host
        buffer; returns once all copies finished."""
        staged = {}
        cuda_tensors = {n: t for n, t in tensors.items() if t.is_cuda}
        if cuda_tensors and self._stream is not None:
            # The side stream must see all work the training stream queued on these tensors.
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for name, tensor in cuda_tensors.items():
                    buffer = self._pool.get(name, tensor, into)
                    buffer.copy_(tensor.detach(), non_blocking=self.options.non_blocking)
                    staged[name] = buffer
            self._stream.synchronize()
        for name, tensor in tensors.items():
            if name not in staged:
                buffer = self._pool.get(name, tensor, into)
                buffer.copy_(tensor.detach())
                staged[name] = buffer
        self._pool.retain_only(tensors, into)
        return {name: staged[name] for name in tensors}

    def reserve(
        self,
        tensors: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> int:
        """Allocate (pinned, per the options) and touch the buffers a :meth:`stage` of
        ``tensors`` will use (no copy); returns the bytes newly allocated."""
        return self._pool.reserve(tensors, into)

    @property
    def allocations(self) -> int:
        """Buffers allocated so far."""
        return self._pool.allocations

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return self._pool.nbytes


def stage_groups(
    stager: Stager,
    groups: dict[str, dict[str, torch.Tensor]],
    select: Callable[[str, str], bool],
    images: ImagePool | None = None,
) -> None:
    """Replace the selected tensors of ``{group: {name: tensor}}`` by staged copies, in place.

    ``select(group, name)`` says which tensors to copy now; the stager's pool is keyed by
    group and name, so the same tensor reuses the same buffer on every save. With ``images``
    each group (one file) large enough is staged into its :class:`~fastckpt.file_images.
    FileImage` instead, which the file's writer then writes without copying it again
    (every tensor of the group must be staged, by this call or an earlier one of the same
    save, for the writer to use the image).
    """
    into = None if images is None else images.destinations(groups, select)[0]
    selected = {
        f"{group}\0{name}": tensor
        for group, tensors in groups.items()
        for name, tensor in tensors.items()
        if select(group, name)
    }
    for key, staged in stager.stage(selected, into).items():
        group, name = key.split("\0", 1)
        groups[group][name] = staged


def reserve_groups(
    stager: Stager,
    groups: Mapping[str, Mapping[str, torch.Tensor]],
    select: Callable[[str, str], bool],
    images: ImagePool | None = None,
) -> int:
    """Allocate (and touch) the buffers :func:`stage_groups` with the same arguments will
    use (keyed the same way, images included), without copying; returns the bytes newly
    allocated."""
    into, allocated = (
        (None, 0) if images is None else images.destinations(groups, select, touch=True)
    )
    return allocated + stager.reserve(
        {
            f"{group}\0{name}": tensor
            for group, tensors in groups.items()
            for name, tensor in tensors.items()
            if select(group, name)
        },
        into,
    )


def make_image_pool(options: StagerOptions) -> ImagePool:
    """The file-image pool for stagers made by :func:`make_stager` with ``options``
    (pinned images only when CUDA is available and pinned memory is asked for)."""
    return ImagePool(pinned=options.pinned and torch.cuda.is_available())


def make_stager(options: StagerOptions) -> Stager:
    """The right stager for this process: CUDA staging when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return CudaStager(options)
    return CpuStager()


T = TypeVar("T")


class WriteFuture(Future[T]):
    """The Future of one background write; it remembers whether it delivered a failure.

    A failure is reported exactly once: :meth:`result` raising it or :meth:`exception`
    returning it to the caller counts as reporting it, and :meth:`BackgroundWriter.collect`
    (the next save) and :meth:`BackgroundWriter.close` then stay quiet about it.
    """

    def __init__(self) -> None:
        """A pending Future (the writer thread resolves it)."""
        super().__init__()
        self.failure_reported = False

    def result(self, timeout: float | None = None) -> T:
        """The write's result; its failure is raised (and counts as reported)."""
        # Waits like result() (TimeoutError, CancelledError), then tells a failure apart.
        if super().exception(timeout) is not None:
            self.failure_reported = True
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The write's failure or None; a failure returned counts as reported."""
        error = super().exception(timeout)
        if error is not None:
            self.failure_reported = True
        return error


def _stderr_line(message: str) -> None:
    """Write ``fastckpt: <message>`` to stderr (at interpreter exit, where nobody can catch
    an error)."""
    try:
        sys.stderr.write(f"fastckpt: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # stderr closed or gone: nowhere to say it
        pass


#: Every :class:`BackgroundWriter` with a tracked write (one not yet reported), held
#: strongly: a writer whose owner (a manager, a hook) was dropped without ``close()`` is kept
#: until its write is reported, so a failure nobody saw still reaches stderr at exit.
#: :func:`_finish_pending_writes` goes through them at exit.
_TRACKED: set[BackgroundWriter[Any]] = set()
_TRACKED_LOCK = threading.Lock()


def _finish_pending_writes() -> None:
    """At interpreter exit: finish every write still pending (see
    :meth:`BackgroundWriter.finish_at_exit`)."""
    with _TRACKED_LOCK:
        writers = list(_TRACKED)
    for writer in writers:
        writer.finish_at_exit()


# Registered with threading's own exit hooks, which run at the start of interpreter shutdown,
# before threads are joined and in reverse order of registration: registered after
# concurrent.futures' (imported above), this runs before it stops accepting work, so a pending
# write can still start its capture. Plain ``atexit`` runs after that, too late.
_register_threading_exit = getattr(threading, "_register_atexit", None)
if _register_threading_exit is not None:
    with contextlib.suppress(RuntimeError):  # imported during shutdown: too late to register
        _register_threading_exit(_finish_pending_writes)
else:  # pragma: no cover - CPython >= 3.9 has it
    import atexit

    atexit.register(_finish_pending_writes)


class BackgroundWriter(Generic[T]):
    """One background checkpoint write in flight at a time, on one lowered-priority thread.

    A write may start with a *capture* (copying live tensors into staging buffers) that runs
    under the capture lock on a second background thread at the caller's priority: training
    waits for the capture before its next optimizer step, so a lowered priority would only
    make it wait longer while the training threads hold the CPU (measured in
    benches/NOTES.md). Code that mutates the saved state holds
    :meth:`guard` meanwhile, which waits only while a capture is in progress. Before the next
    write, :meth:`collect` waits (at most ``wait_timeout`` seconds) for the previous one:

    * it succeeded: its result is returned;
    * it failed: its error is raised once, chained (the next write then starts cleanly);
      a failure its :class:`WriteFuture` already delivered (``result()`` raised it,
      ``exception()`` returned it) is not raised again;
    * it is still running: ``TimeoutError`` says what is being written, and the write stays
      tracked, so its outcome is reported by a later :meth:`collect` or :meth:`close`.

    A write still tracked when the interpreter exits (its owner never called :meth:`close`)
    is finished then (:meth:`finish_at_exit`); when it fails or outlasts ``wait_timeout``, a
    warning on stderr names it.

    Args:
        name: the thread name prefix.
        wait_timeout: seconds :meth:`collect` waits for the previous write (None: forever).
        typed_errors: raise a failed write's own exception (with a note naming the write)
            instead of a ``RuntimeError`` chained to it.
    """

    def __init__(
        self, name: str, *, wait_timeout: float | None = None, typed_errors: bool = False
    ) -> None:
        """Prepare the writer; the thread starts at :meth:`start` (or the first submit)."""
        self.name = name
        self.wait_timeout = wait_timeout
        self.typed_errors = typed_errors
        self._executor: ThreadPoolExecutor | None = None
        self._capture_executor: ThreadPoolExecutor | None = None
        self._future: WriteFuture[T] | None = None
        self._what = ""
        self._pid = os.getpid()
        self._capture_lock = threading.Lock()
        self._capture_done = threading.Event()
        self._capture_done.set()

    @property
    def running(self) -> bool:
        """Whether the background thread is started."""
        return self._executor is not None

    @property
    def busy(self) -> bool:
        """Whether a write was submitted and has not finished yet."""
        future = self._future
        return future is not None and not future.done()

    @property
    def in_flight(self) -> str | None:
        """What the write in flight (or finished but not collected) writes, or None."""
        return None if self._future is None else self._what

    def start(self) -> None:
        """Start the background threads (idempotent)."""
        if self._executor is None:
            self._executor = background_executor(self.name)
        if self._capture_executor is None:
            self._capture_executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self.name}-capture"
            )
            # Create its thread now, from the caller's thread, so that it inherits the caller's
            # priority (the pool would otherwise spawn it from the lowered-priority writer).
            self._capture_executor.submit(lambda: None)

    def capture(self, copy: Callable[[], None]) -> None:
        """Run ``copy`` on this thread under the capture lock."""
        with self._capture_lock:
            copy()

    def submit(
        self, what: str, write: Callable[[], T], *, capture: Callable[[], None] | None = None
    ) -> Future[T]:
        """Run ``capture`` (under the capture lock) then ``write`` on the background thread.

        Args:
            what: what is written, for messages (e.g. the checkpoint path).
            write: the write; its result is what :meth:`collect` returns.
            capture: copies the state first; :meth:`guard` waits until it is done.

        Raises:
            RuntimeError: a write is still tracked (:meth:`collect` it first).
        """
        if self._future is not None:
            raise RuntimeError(
                f"a background checkpoint write of {self._what} is still tracked; collect it "
                "before starting another"
            )
        self.start()
        assert self._executor is not None
        if capture is not None:
            self._capture_done.clear()
        future: WriteFuture[T] = WriteFuture()
        try:
            self._executor.submit(self._execute, future, capture, write)
        except BaseException:
            self._capture_done.set()
            raise
        self._future = future
        self._what = what
        self._pid = os.getpid()
        with _TRACKED_LOCK:
            _TRACKED.add(self)
        return future

    def _untrack(self) -> None:
        """The tracked write was reported (or cancelled): forget it."""
        self._future = None
        with _TRACKED_LOCK:
            _TRACKED.discard(self)

    def _execute(
        self, future: WriteFuture[T], capture: Callable[[], None] | None, write: Callable[[], T]
    ) -> None:
        """The background thread's job: run the write and resolve its Future."""
        if not future.set_running_or_notify_cancel():  # cancelled before it started
            self._capture_done.set()
            return
        try:
            result = self._run(capture, write)
        except BaseException as err:
            future.set_exception(err)
        else:
            future.set_result(result)

    def _run(self, capture: Callable[[], None] | None, write: Callable[[], T]) -> T:
        if capture is not None:
            try:
                assert self._capture_executor is not None
                # This (lowered-priority) thread only waits; the capture thread runs at the
                # priority of the thread that started the writer.
                self._capture_executor.submit(self.capture, capture).result()
            finally:
                self._capture_done.set()
        return write()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Hold while mutating saved state: waits for an in-progress capture, then keeps the
        next capture from starting until the block ends."""
        self._capture_done.wait()
        with self._capture_lock:
            yield

    def collect(self) -> T | None:
        """Wait (at most :attr:`wait_timeout` seconds) for the tracked write; report it once.

        Returns:
            The write's result, or None when no write is tracked.

        Raises:
            TimeoutError: the write is still running (it stays tracked; the message names it).
            RuntimeError: the write failed (chained to its error; raised once, and not at
                all when its Future already delivered it). With ``typed_errors``: the
                write's own exception instead.
        """
        return self._collect(self.wait_timeout)

    def _collect(self, timeout: float | None) -> T | None:
        future = self._future
        if future is None:
            return None
        try:
            # The base class's method: waiting here does not count as the caller seeing it.
            error = Future.exception(future, timeout=timeout)
        except TimeoutError:
            raise TimeoutError(
                errno.ETIMEDOUT,
                f"the background checkpoint write of {self._what} is still running after "
                f"{timeout} s; it stays tracked and its outcome is reported by the next save or "
                "close (raise the wait timeout if writes take this long)",
            ) from None
        except CancelledError:  # the caller cancelled it before it started: nothing written
            self._untrack()
            return None
        self._untrack()
        if error is not None:
            if future.failure_reported:
                return None  # its Future already raised it: reported once
            if self.typed_errors:
                error.add_note(
                    f"raised by the background checkpoint write of {self._what} (reported "
                    "once, by the call after it)"
                )
                raise error
            raise RuntimeError(
                f"the previous background checkpoint write failed ({self._what}): {error}"
            ) from error
        return Future.result(future)

    def finish_at_exit(self) -> None:
        """Finish the tracked write at interpreter exit (called by the exit hook).

        Waits up to :attr:`wait_timeout`; a write still running then is named on stderr (a
        kill from now on loses it) and waited for until it ends. A write that failed, and
        whose failure nobody was shown, is named on stderr as not saved. Never raises.
        """
        future = self._future
        if future is None or self._pid != os.getpid():  # nothing pending, or a forked child
            return
        what = self._what
        outlasted = False
        try:
            try:
                error = Future.exception(future, timeout=self.wait_timeout)
            except TimeoutError:
                outlasted = True
                _stderr_line(
                    f"WARNING: the interpreter is exiting while the background checkpoint write of "
                    f"{what} is still running after {self.wait_timeout} s (close() was not "
                    "called); waiting for it to end: killing the process now loses it"
                )
                error = Future.exception(future)
        except CancelledError:
            return
        except BaseException as err:  # Ctrl-C while waiting: say what may be lost, go on
            _stderr_line(
                f"WARNING: interrupted ({type(err).__name__}) while waiting at exit for the "
                f"background checkpoint write of {what}; it may NOT be saved"
            )
            return
        if error is None:
            self._untrack()
            if outlasted:
                _stderr_line(f"the background checkpoint write of {what} ended: it is saved")
            return
        if not future.failure_reported:
            _stderr_line(
                f"WARNING: {what} was NOT saved: its background checkpoint write failed and "
                f"close() was not called to report it: {type(error).__name__}: {error}"
            )
        self._untrack()

    def close(self) -> T | None:
        """Wait for the tracked write however long it takes, report it, stop the thread.

        Raises:
            RuntimeError: the tracked write failed (chained to its error; with
                ``typed_errors``, its own exception), unless its Future already delivered it.
        """
        try:
            return self._collect(None)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._capture_executor is not None:
                self._capture_executor.shutdown(wait=True)
                self._capture_executor = None
