"""The async engine: one background checkpoint write in flight, on a lowered-priority thread.

:class:`BackgroundWriter` is what every async save runs on - :class:`fastckpt.CheckpointManager`,
:class:`fastckpt.CheckpointHook` and Lightning's ``AsyncFastCheckpointIO``: an optional capture
(staging) phase that training waits on, a bounded wait for the previous write, a failure
raised once, a pending write finished at interpreter exit.
"""

from __future__ import annotations

import concurrent.futures.thread
import contextlib
import errno
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from typing import Any, Generic, NoReturn, TypeVar

from fastckpt.io.forksafe import ForkSafeLock

__all__ = [
    "BACKGROUND_NICE",
    "BackgroundWriter",
    "WriteFuture",
    "after_pending_writes",
    "background_executor",
    "committed_before",
    "mark_committed",
    "report_tolerated",
    "stderr_line",
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


def stderr_line(message: str) -> None:
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
_TRACKED_LOCK = ForkSafeLock()  # free in a forked child


_COMMITTED_MARK = "_fastckpt_raised_after_commit"


def mark_committed(error: BaseException) -> None:
    """Record on ``error`` that it was raised after the write's commit (by a callback or a
    promotion run after it): reports then say the checkpoint is saved, not that it is lost."""
    setattr(error, _COMMITTED_MARK, True)


def committed_before(error: BaseException) -> bool:
    """Whether :func:`mark_committed` marked ``error``."""
    return getattr(error, _COMMITTED_MARK, False) is True


#: Called at interpreter exit once every pending write is finished (see
#: :func:`after_pending_writes`).
_AFTER_WRITES: list[Callable[[], None]] = []


def after_pending_writes(function: Callable[[], None]) -> None:
    """Have ``function`` called at interpreter exit after every pending write is finished
    (work a write's completion hands on, such as a promotion to a durable tier); it must not
    raise."""
    _AFTER_WRITES.append(function)


def _finish_pending_writes() -> None:
    """At interpreter exit: finish every write still pending (see
    :meth:`BackgroundWriter.finish_at_exit`), then what :func:`after_pending_writes` asked."""
    with _TRACKED_LOCK:
        writers = list(_TRACKED)
    for writer in writers:
        writer.finish_at_exit()
    for function in _AFTER_WRITES:
        function()


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


#: Every writer of this process, for :func:`_forget_parent_threads` after a fork.
_ALL: weakref.WeakSet[BackgroundWriter[Any]] = weakref.WeakSet()


def _interpreter_exiting() -> bool:
    """Whether the interpreter began to exit: concurrent.futures stopped taking work (its exit
    hook ran: the main thread still counts as alive while the exit hooks run), or Python is
    finalizing."""
    return bool(getattr(concurrent.futures.thread, "_shutdown", False)) or sys.is_finalizing()


def _forget_parent_threads() -> None:
    """In the child of ``os.fork()``: only the forking thread exists there. Each writer drops
    its parent's threads, the write they run (the parent's, which the parent finishes), and
    locks a parent thread may have held at the fork; its next save starts fresh threads.
    Before, a child saving with an inherited async manager waited forever (its write went to
    a thread that does not exist there), and so did its exit."""
    _TRACKED.clear()
    for writer in list(_ALL):
        writer._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_threads)


class _GuardLock:
    """The capture lock: guards share it (any number, from any threads, nested in a thread),
    a capture holds it alone (it waits until no guard is held, and guards wait for it)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._guards = 0
        self._capturing = False
        self._local = threading.local()

    def held_here(self) -> bool:
        """Whether the calling thread holds a guard."""
        return bool(getattr(self._local, "depth", 0))

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold a guard (a thread nesting guards does not wait for a capture: none can run
        while it holds the outer one)."""
        with self._condition:
            if not self.held_here():
                while self._capturing:
                    self._condition.wait()
            self._guards += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._condition:
                self._guards -= 1
                if not self._guards:
                    self._condition.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold it alone (a capture)."""
        with self._condition:
            while self._capturing or self._guards:
                self._condition.wait()
            self._capturing = True
        try:
            yield
        finally:
            with self._condition:
                self._capturing = False
                self._condition.notify_all()


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
        #: the thread running a write now (see :meth:`_collect`)
        self._writing_thread: int | None = None
        self._capture_executor: ThreadPoolExecutor | None = None
        self._future: WriteFuture[T] | None = None
        self._what = ""
        self._pid = os.getpid()
        self._capture_lock = _GuardLock()
        self._capture_done = threading.Event()
        self._capture_done.set()
        _ALL.add(self)

    def _after_fork(self) -> None:
        """See :func:`_forget_parent_threads`."""
        self._executor = None
        self._capture_executor = None
        self._future = None
        self._writing_thread = None
        self._what = ""
        self._pid = os.getpid()
        self._capture_lock = _GuardLock()
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
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-capture")
            # Create its thread now, from the caller's thread, so that it inherits the caller's
            # priority (the pool would otherwise spawn it from the lowered-priority writer).
            try:
                pool.submit(lambda: None)
            except RuntimeError as err:
                if "can't start new thread" not in str(err):
                    raise
                pool.shutdown(wait=False, cancel_futures=True)  # tried again at the next start
                raise OSError(
                    errno.EAGAIN,
                    f"{self.name}: no thread could be started for its background capture: the "
                    "process is at its thread limit (`ulimit -u`, a container's pids limit); "
                    "raise it or run fewer threads",
                ) from err
            self._capture_executor = pool

    def capture(self, copy: Callable[[], None]) -> None:
        """Run ``copy`` on this thread under the capture lock (alone: no :meth:`guard` held).

        Raises:
            RuntimeError: this thread holds a :meth:`guard`: the copy would wait for it forever.
        """
        self._refuse_waiting_on_own_guard("take a snapshot (synchronous staging)")
        with self._capture_lock.exclusive():
            copy()

    def held_by_this_thread(self) -> bool:
        """Whether the calling thread holds a :meth:`guard` (a save started here would wait
        for the guard it holds)."""
        return self._capture_lock.held_here()

    def _refuse_waiting_on_own_write(self, doing: str) -> None:
        """Refuse ``doing`` on the writer thread while it runs a write: a callback the write
        runs (a finalize_callback saving again, or closing) would wait for the write it is
        part of: until the wait timeout, then a TimeoutError blaming the write (a close:
        Python's "cannot join current thread", the manager closed)."""
        if self._writing_thread == threading.get_ident():
            raise RuntimeError(
                f"{self.name}: cannot {doing} from inside the background write of "
                f"{self._what} (a callback it runs, such as finalize_callback, runs on the "
                "writer thread, and would wait for the write it is part of); do it after "
                "its Future resolves, from your own thread"
            )

    def _refuse_waiting_on_own_guard(self, doing: str) -> None:
        if self._capture_lock.held_here():
            raise RuntimeError(
                f"{self.name}: cannot {doing} inside its lock()/guard() on the same thread: "
                "the snapshot waits until the lock is released, so this would wait for itself. "
                "Save (or wait for the previous save) outside the lock"
            )

    def submit(
        self, what: str, write: Callable[[], T], *, capture: Callable[[], None] | None = None
    ) -> Future[T]:
        """Run ``capture`` (under the capture lock) then ``write`` on the background thread.

        Args:
            what: what is written, for messages (e.g. the checkpoint path).
            write: the write; its result is what :meth:`collect` returns.
            capture: copies the state first; :meth:`guard` waits until it is done.

        Raises:
            RuntimeError: a write is still tracked (:meth:`collect` it first), or ``capture``
                is given on a thread holding a :meth:`guard` (it would copy after the guarded
                changes).
        """
        if self._future is not None:
            raise RuntimeError(
                f"a background checkpoint write of {self._what} is still tracked; collect it "
                "before starting another"
            )
        if capture is not None and self._capture_lock.held_here():
            # The copy would run when the lock is released, after what the lock guards
            # changed the tensors, while the plain values were taken now: two moments mixed.
            raise RuntimeError(
                f"cannot start a save of {self.name} inside its lock()/guard() on the same "
                "thread: its tensors would be copied when the lock is released, after the "
                "changes the lock guards, and its plain values now (a checkpoint of two "
                "moments). Save outside the lock"
            )
        if capture is not None:
            self._capture_done.clear()
        future: WriteFuture[T] = WriteFuture()
        try:
            self.start()
            assert self._executor is not None
            self._executor.submit(self._execute, future, capture, write)
        except RuntimeError as err:
            self._capture_done.set()
            if "can't start new thread" in str(err):
                # The pool queued the work before its thread failed to start: dropped with the
                # pool, or a later save's thread would run it unwatched (review 2: a "ghost"
                # write of the refused save, its capture signalled early). Before, CPython's
                # bare RuntimeError, naming nothing.
                if self._executor is not None:
                    self._executor.shutdown(wait=False, cancel_futures=True)
                    self._executor = background_executor(self.name)  # its thread: at the next
                raise OSError(
                    errno.EAGAIN,
                    f"cannot save {what}: no thread could be started for the background write: "
                    "the process is at its thread limit (`ulimit -u`, a container's pids "
                    "limit); nothing was written. Raise it or run fewer threads",
                ) from err
            if threading.main_thread().is_alive() and not _interpreter_exiting():
                raise
            # concurrent.futures takes no work once the interpreter began to exit (a thread
            # saving after the main thread returned, or while the exit hooks run), and
            # fastckpt's writes use its threads.
            raise RuntimeError(
                f"cannot save {what}: the interpreter is exiting (the main thread returned), "
                f"and Python's thread pools take no more work ({err}); nothing was written. "
                "Join the thread that saves before the main thread returns"
            ) from err
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
        self._writing_thread = threading.get_ident()
        try:
            result = self._run(capture, write)
        except BaseException as err:
            future.set_exception(err)
        else:
            future.set_result(result)
        finally:
            self._writing_thread = None

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
        next capture from starting until the block ends. Guards are shared: any number of
        threads may hold one at once, and a thread may nest them (an inner guard neither
        waits nor blocks)."""
        if self._capture_lock.held_here():
            with self._capture_lock.shared():
                yield
            return
        self._capture_done.wait()
        with self._capture_lock.shared():
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

    def settle(self, doing: str, why: str = "its collectives use the same process group") -> None:
        """Wait (at most :attr:`wait_timeout` seconds) until the tracked write is done,
        leaving it tracked: its outcome is reported by the next :meth:`collect` as usual.
        For a caller about to run collectives of its own (``doing``) on the process group
        the write's commit uses (two threads' collectives on one group pair up wrongly), or
        about to read what the write writes; ``why``: which, for the timeout's message.

        Raises:
            TimeoutError: the write is still running after the wait timeout.
            RuntimeError: called where the write waits for this thread (its guard held).
        """
        future = self._future
        if future is None or future.done():
            return
        if not self._capture_done.is_set():
            self._refuse_waiting_on_own_guard(doing)
        self._refuse_waiting_on_own_write(doing)
        done, _ = wait([future], timeout=self.wait_timeout)
        if not done:
            raise TimeoutError(
                errno.ETIMEDOUT,
                f"{doing} waits for the background checkpoint write of {self._what}, still "
                f"running after {self.wait_timeout} s ({why}); call it again once the write "
                "is done",
            )

    def collect_waiting(self) -> T | None:
        """:meth:`collect`, waiting as long as the tracked write takes (no timeout)."""
        return self._collect(None)

    def _collect(self, timeout: float | None) -> T | None:
        future = self._future
        if future is None:
            return None
        if not future.done() and not self._capture_done.is_set():
            self._refuse_waiting_on_own_guard("wait for the previous save")
        if not future.done():
            self._refuse_waiting_on_own_write("save")
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
                return None  # its Future (or a signal handler's close) raised it: once
            future.failure_reported = True  # a call this one interrupted stays quiet
            self._raise_failure(error)
        return Future.result(future)

    def _raise_failure(self, error: BaseException) -> NoReturn:
        """Raise the tracked write's failure ``error`` as :meth:`collect` reports it."""
        if self.typed_errors:
            error.add_note(
                f"raised by the background checkpoint write of {self._what} (reported "
                "once, by the call after it)"
            )
            raise error
        if committed_before(error):
            raise RuntimeError(
                f"{self._what} is saved (committed), but what ran after its commit in the "
                f"background (a callback, a promotion) failed: {error}"
            ) from error
        raise RuntimeError(
            f"the previous background checkpoint write failed ({self._what}): {error}"
        ) from error

    def collect_reentrant(self) -> None:
        """Wait, however long, for the tracked write from a signal handler that interrupted
        this thread inside :meth:`close` or :meth:`collect` (which cannot go on until the
        handler returns), and raise its failure.

        No lock of this writer is taken (the interrupted call may hold one; the Future's own
        condition is re-entrant), and the write stays tracked for the interrupted call, which
        then stays quiet about a failure raised here: it is raised once.

        Raises:
            RuntimeError: the write failed, as for :meth:`collect`.
        """
        future = self._future
        if future is None:
            return  # none tracked, or the interrupted call already has its outcome
        try:
            # The base class's method: waiting here does not count as the caller seeing it.
            error = Future.exception(future)
        except CancelledError:
            return
        if error is None or future.failure_reported:
            return
        future.failure_reported = True
        self._raise_failure(error)

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
                stderr_line(
                    f"WARNING: the interpreter is exiting while the background checkpoint write of "
                    f"{what} is still running after {self.wait_timeout} s (close() was not "
                    "called); waiting for it to end: killing the process now loses it"
                )
                error = Future.exception(future)
        except CancelledError:
            return
        except BaseException as err:  # Ctrl-C while waiting: say what may be lost, go on
            stderr_line(
                f"WARNING: interrupted ({type(err).__name__}) while waiting at exit for the "
                f"background checkpoint write of {what}; it may NOT be saved"
            )
            return
        if error is None:
            self._untrack()
            if outlasted:
                stderr_line(f"the background checkpoint write of {what} ended: it is saved")
            return
        if not future.failure_reported and committed_before(error):
            stderr_line(
                f"WARNING: {what} is saved (committed), but what ran after its commit (a "
                "callback, a promotion) failed and close() was not called to report it: "
                f"{type(error).__name__}: {error}"
            )
        elif not future.failure_reported:
            stderr_line(
                f"WARNING: {what} was NOT saved: its background checkpoint write failed and "
                f"close() was not called to report it: {type(error).__name__}: {error}"
            )
        self._untrack()

    def check_closable(self) -> None:
        """Refuse to close from inside this thread's own :meth:`guard` while a write is
        tracked: its snapshot waits for that guard, and the close for the snapshot (a
        deadlock forever before); and from the writer thread itself (a callback the write
        runs), which would wait for the write it is part of.

        Raises:
            RuntimeError: says to close outside the lock, or after the write.
        """
        if self._future is not None:
            self._refuse_waiting_on_own_guard("close")
        self._refuse_waiting_on_own_write("close")

    def close(self) -> T | None:
        """Wait for the tracked write however long it takes, report it, stop the thread.

        Raises:
            RuntimeError: the tracked write failed (chained to its error; with
                ``typed_errors``, its own exception), unless its Future already delivered it;
                or (nothing done, still open) this thread holds a :meth:`guard` while a write
                is tracked (see :meth:`check_closable`).
        """
        self.check_closable()
        try:
            return self._collect(None)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._capture_executor is not None:
                self._capture_executor.shutdown(wait=True)
                self._capture_executor = None


def report_tolerated(
    logger: logging.Logger,
    message: str,
    error: BaseException,
    callback: Callable[[Any], object] | None,
    *,
    stacklevel: int = 1,
) -> None:
    """Report a failure training goes on after (a save or a promotion that is not strict):
    ``message`` logged as a warning and warned as a ``RuntimeWarning``, then ``error`` given
    to ``callback``; an exception the callback raises is logged and dropped."""
    logger.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    if callback is not None:
        try:
            callback(error)
        except Exception:
            logger.exception("the error callback %r failed", callback)
