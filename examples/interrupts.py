"""Ctrl-C and SIGTERM in the training example (``train_llama.py``).

Both end a run the same way: the partial run's ``summary.json`` and ``loss.png`` are written,
one line says where they are and how to resume, and the process exits with ``128 + signal``
(130 for Ctrl-C, 143 for SIGTERM) without a traceback. SIGTERM matters because it is what a
scheduler sends (Slurm, Kubernetes) and what ``torchrun`` forwards to every rank when it is
stopped; Python's default for it ends the process at once, with no records.

During the training steps a first signal only sets a flag: every rank finishes the step it is
in and the ranks agree on stopping through the per-step collective
(``training.run_steps``), so no rank leaves a collective its peers are still inside (they
would wait in it until torchrun's SIGKILL, rank 0 perhaps before writing any record). A second
signal stops at once, as Ctrl-C always did.

A rank blocked in a collective whose peer is gone (torchrun also sends SIGTERM to the
survivors when it restarts a job after a crash) never returns to Python, where handlers run:
under torchrun a watchdog thread, woken by the signal itself (``signal.set_wakeup_fd``), ends
such a rank ``STOP_GRACE_S`` after the signal, as the default SIGTERM would have at once.

Example:
    >>> import os, signal
    >>> with deferred_stop() as stop:
    ...     os.kill(os.getpid(), signal.SIGTERM)
    ...     stop.signum == signal.SIGTERM
    True
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any, Iterator, Optional

# The signals that stop a run: a terminal's Ctrl-C and a scheduler's (or torchrun's) SIGTERM.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a rank under torchrun may take to reach the end of its step after a stop signal
# before the watchdog ends it: longer than a step of the large presets on GPUs (about 1 s),
# well inside the 30 s torchrun waits before SIGKILL, leaving time for the records.
STOP_GRACE_S = 10.0


class SignalInterrupt(KeyboardInterrupt):
    """A stop signal turned into ``KeyboardInterrupt``: the path Ctrl-C already takes.

    Attributes:
        signum: the signal received (``signal.SIGINT`` or ``signal.SIGTERM``).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: Optional[int]) -> str:
    """How the messages name a stop: ``Ctrl-C`` for SIGINT (what a user pressed), else the
    signal's name (``SIGTERM``)."""
    if signum is None or signum == signal.SIGINT:
        return "Ctrl-C"
    return signal.Signals(signum).name


def exit_status(exc: KeyboardInterrupt) -> int:
    """``128 + signal``, as a shell reports a process a signal ended (plain Ctrl-C: 130)."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


def _raise_now(signum: int, frame: Optional[FrameType]) -> None:
    raise SignalInterrupt(signum)


def _in_main_thread() -> bool:
    # Python lets only the main thread install handlers (a script calling train() from a
    # thread keeps the default behaviour).
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handlers(handler: Any, signums: tuple[int, ...]) -> Iterator[None]:
    """``handler`` for ``signums`` within, the previous handlers restored after. A signal the
    process ignores stays ignored (``nohup``, a shell's background job: SIGINT is not for it).
    """
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signums
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def sigterm_as_interrupt() -> contextlib.AbstractContextManager:
    """Within: SIGTERM raises :class:`SignalInterrupt`, as SIGINT raises KeyboardInterrupt,
    so a run stopped while starting or closing ends with one line, not silently."""
    return _handlers(_raise_now, (signal.SIGTERM,))


class StopRequest:
    """The first stop signal received inside :func:`deferred_stop` (None: none yet)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.left = threading.Event()  # the steps are over: the watchdog stands down

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is not None:  # the second one: the user insists, stop now
            raise SignalInterrupt(signum)
        self.signum = signum


def _watch(read_fd: int, request: StopRequest, grace_s: float, rank: int) -> None:
    """Watchdog thread: after the first stop signal, end the process if the main thread has
    not left the steps within ``grace_s`` (it is stuck where no handler can run)."""
    try:
        while not request.left.is_set():
            data = os.read(read_fd, 64)  # one byte per signal; b"": the steps are over
            if not data:
                return
            signums = [b for b in data if b in STOP_SIGNALS]
            if signums and not request.left.wait(grace_s):
                # os.write, not print: the main thread may hold stdout's lock where it is stuck.
                os.write(2, (f"[train] rank {rank}: {signal_name(signums[0])} received, but "
                             f"the step did not end within {grace_s:g} s (blocked in a "
                             "collective whose peer is gone?): exiting without records\n"
                             ).encode())
                os._exit(128 + signums[0])
    finally:
        os.close(read_fd)


@contextlib.contextmanager
def _watchdog(request: StopRequest, grace_s: float, rank: int) -> Iterator[None]:
    """:func:`_watch` in a daemon thread, woken through ``signal.set_wakeup_fd``."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C-level handler must never block on it
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd, request, grace_s, rank), daemon=True,
                     name="stop-watchdog").start()
    try:
        yield
    finally:
        request.left.set()
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the thread's read returns b"" and it closes its end


@contextlib.contextmanager
def deferred_stop(grace_s: Optional[float] = None, rank: int = 0) -> Iterator[StopRequest]:
    """Within: the first SIGINT/SIGTERM is recorded on the yielded :class:`StopRequest` (the
    caller stops at its next step boundary); a second raises :class:`SignalInterrupt` at once.

    Args:
        grace_s: with a number, a watchdog ends the process ``grace_s`` after the first signal
            unless the block was left by then (for ranks, which can block in collectives);
            None: no watchdog (one process returns to Python between its operations).
        rank: named in the watchdog's message.
    """
    request = StopRequest()
    watchdog = (_watchdog(request, grace_s, rank) if grace_s is not None and _in_main_thread()
                else contextlib.nullcontext())
    with watchdog, _handlers(request._record, STOP_SIGNALS):
        yield request
