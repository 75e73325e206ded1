"""Graceful preemption: SIGTERM (a cluster taking the node back) or SIGINT (Ctrl-C) during training
asks the loop to stop at the next step boundary, after a checkpoint, instead of dying mid-step.

The handler only records the signal; the loop polls ``StopRequest.signum`` once per step, and in a
multi-rank job the ranks agree (the largest signal number any rank saw) so they all stop at the same
step. A second SIGINT more than ``FORCE_AFTER_S`` seconds after the first stops at once (the usual
"press Ctrl-C again"); copies of one signal delivered to the whole process group, and forwarded by a
launcher, arrive within milliseconds and do not count as a second press. SIGKILL is never caught:
checkpoints are written to a temporary directory and renamed, so one cannot be left half-written.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

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
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
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
