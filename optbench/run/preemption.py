"""Graceful preemption: SIGTERM (a cluster taking the node back) or SIGINT (Ctrl-C) during training
asks the loop to stop at the next step boundary, after a checkpoint, instead of dying mid-step.

The handler only records the signal; the loop polls ``StopRequest.signum`` once per step, and in a
multi-rank job the ranks agree (the largest signal number any rank saw) so they all stop at the same
step. A second SIGINT more than ``FORCE_AFTER_S`` seconds after the first stops at once (the usual
"press Ctrl-C again"); copies of one signal delivered to the whole process group, and forwarded by a
launcher, arrive within milliseconds and do not count as a second press. SIGKILL is never caught:
checkpoints are written to a temporary directory and renamed, so one cannot be left half-written.

Before the loop installs its ``StopRequest`` (start-up: importing, composing, building, loading)
and after it (writing results), ``install_startup_handler`` (the first thing ``optbench train``
does) records SIGTERM. Inside ``train`` (``interruptible()``) it also raises ``Interrupted`` at
once: there is no step to finish, and the run ends with a summary (status ``interrupted``) and exit
status 143. Outside it (an ``import torch``, Hydra composing the config, code that catches every
exception) raising would be swallowed or would end in an unrelated traceback, so the signal is only
recorded there and honoured at the next phase boundary (``pending_interruption``: after the
imports, when the job starts, when ``train`` starts, when its start-up ends, after the results
are written).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from optbench.errors import Interrupted

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FORCE_AFTER_S = 2.0


class StopRequest:
    """Install with ``install()`` (main thread only; elsewhere it does nothing), undo with
    ``restore()``. ``signum`` is the first stop signal received, or None."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        global _phase
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            _phase = "after training, while writing results"
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            log.warning("received %s: stopping at the next step boundary after a checkpoint "
                        "(Ctrl-C again to stop at once)", signal.Signals(signum).name)
        elif signum == signal.SIGINT and time.monotonic() - self._first_at > FORCE_AFTER_S:
            raise KeyboardInterrupt


_phase = "during start-up, before the first step"
_received: Interrupted | None = None
_at_once = False  # inside interruptible(): the handler raises


def install_startup_handler() -> None:
    """SIGTERM outside the training loop is recorded (and raised inside ``interruptible``)."""
    global _phase, _received
    _phase, _received = "during start-up, before the first step", None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _startup_handler)


def startup_interruption() -> Interrupted | None:
    """The SIGTERM the start-up handler recorded, if any (the CLI reports it)."""
    return _received


def honour_pending() -> None:
    """A phase boundary: raise the Interrupted of a SIGTERM received since the handler was installed
    (while it still is: a caller that put its own handler back has taken the signal over)."""
    if _received is not None and signal.getsignal(signal.SIGTERM) is _startup_handler:
        raise _received


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """A block a SIGTERM interrupts at once (``train``'s: it records every outcome); a signal
    received before it is raised on entry."""
    global _at_once
    honour_pending()
    _at_once = True
    try:
        yield
    finally:
        _at_once = False


def _startup_handler(signum: int, frame: FrameType | None) -> None:
    global _received
    if _received is None:
        _received = Interrupted(f"stopped by {signal.Signals(signum).name} {_phase}", signum=signum)
    if _at_once:
        raise _received
