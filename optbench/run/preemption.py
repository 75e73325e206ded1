"""Graceful preemption: SIGTERM (a cluster taking the node back) or SIGINT (Ctrl-C) during training
asks the loop to stop at the next step boundary, after a checkpoint, instead of dying mid-step.

The handler only records the signal; the loop polls ``StopRequest.signum`` once per step, and in a
multi-rank job the ranks agree (the largest signal number any rank saw) so they all stop at the same
step. A second SIGINT more than ``FORCE_AFTER_S`` seconds after the first stops at once (the usual
"press Ctrl-C again"); copies of one signal delivered to the whole process group, and forwarded by a
launcher, arrive within milliseconds and do not count as a second press. SIGKILL is never caught:
checkpoints are written to a temporary directory and renamed, so one cannot be left half-written.

Before the loop installs its ``StopRequest`` (start-up: composing, building, loading) and after it
(writing results), ``install_startup_handler`` (``optbench train``) turns SIGTERM into an
``Interrupted`` exception at once: there is no step to finish, and the run still ends with a
summary (status ``interrupted``) and exit status 143 instead of dying without a word.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
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


def install_startup_handler() -> None:
    """SIGTERM outside the training loop raises ``Interrupted`` (see the module docstring)."""
    global _phase, _received
    _phase, _received = "during start-up, before the first step", None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _startup_handler)


def startup_interruption() -> Interrupted | None:
    """The Interrupted the start-up handler raised, if it did (the CLI reports it when it escaped)."""
    return _received


def _startup_handler(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = Interrupted(f"stopped by {signal.Signals(signum).name} {_phase}", signum=signum)
    raise _received
