"""Bounded shutdown: a stop request (SIGTERM/SIGINT) ends the process within ``run.stop_timeout_s``
even when the main thread never reaches a step boundary (stuck in a kernel, a collective, a step
that takes hours).

The loop's ``StopRequest`` handler is Python code, which runs only when the main thread is back in
the interpreter; a step stuck in C++ never lets it run. The C-level signal handler, though, writes
the signal number to the fd given to ``signal.set_wakeup_fd`` at once, from any state of the main
thread. A daemon thread waits on that fd; after a stop signal it gives the loop
``stop_timeout_s`` to stop by itself (checkpoint and ``interrupted``, as always), and if it has not,
writes the summary as ``interrupted`` with the last completed step and checkpoint, then ends the
process with status 128 + the signal (``os._exit``: nothing else runs, the stuck thread included).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import select
import signal
import sys
import threading

from optbench.checkpoint import Manager
from optbench.exits import signal_exit
from optbench.files import timestamp
from optbench.run.loop import Component, RunContext
from optbench.run.preemption import STOP_SIGNALS
from optbench.summary import RunSummary, StopRecord

log = logging.getLogger(__name__)
POLL_S = 0.5  # how often the waiting thread looks at ``finished`` when no byte arrives


class Watchdog(Component):
    def __init__(self, ctx: RunContext, *, record: RunSummary, checkpoint_manager: Manager, exit=os._exit) -> None:
        """``record``: the run's summary so far (what it writes, with the loop's progress, when it
        ends the process); ``checkpoint_manager``: the run's checkpoint manager; ``exit`` ends the process."""
        self.ctx = ctx
        self.bound_s = ctx.cfg.run.stop_timeout_s
        self.record = record
        self.checkpoint_manager = checkpoint_manager
        self.exit = exit
        self.finished = threading.Event()
        self.thread: threading.Thread | None = None
        self._previous_fd: int | None = None
        self._read_fd = self._write_fd = -1

    def start(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd needs a non-blocking fd
        try:
            self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no signal reaches this loop's handlers anyway
            self._close_fds()
            return
        self.thread = threading.Thread(target=self._watch, name="optbench-watchdog", daemon=True)
        self.thread.start()

    def _wait_for_stop_signal(self) -> int | None:
        while not self.finished.is_set():
            ready, _, _ = select.select([self._read_fd], [], [], POLL_S)
            if not ready:
                continue
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return None
            for signum in data:
                if signum in STOP_SIGNALS:
                    return signum
        return None

    def _watch(self) -> None:
        signum = self._wait_for_stop_signal()
        if signum is None or self.finished.wait(self.bound_s):
            return
        done, total = self.ctx.progress.steps, self.ctx.total
        checkpoint = self.checkpoint_manager.last()
        name = signal.Signals(signum).name
        message = (f"stopped by {name} while {self.ctx.running} was running: it did not end "
                   f"within run.stop_timeout_s={self.bound_s:g}, so the process was ended; {done}/{total} "
                   "steps done, " + (f"checkpoint {checkpoint}; checkpoint.resume=auto in the same run directory "
                                  "continues from it" if checkpoint else "no checkpoint"))
        log.error("interrupted: %s", message)
        if self.ctx.outputs.enabled:  # the one line every ending prints (rank 0's)
            print(f"optbench: error: interrupted: {message}", file=sys.stderr, flush=True)
        snapshot = copy.deepcopy(self.record)  # the main thread is stuck: nothing changes it meanwhile
        snapshot.add(dataclasses.replace(self.ctx.progress), self.checkpoint_manager.record(),
                     StopRecord(signal=name, bound_s=self.bound_s, last_step=done,
                                last_checkpoint=str(checkpoint) if checkpoint else None, forced=True))
        snapshot.end("interrupted", message)
        snapshot.finished_at = timestamp()
        try:
            self.ctx.outputs.write_summary(snapshot)
            for handler in logging.getLogger().handlers:
                handler.flush()
        finally:
            self.exit(signal_exit(signum))

    def _close_fds(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._read_fd = self._write_fd = -1

    def finish(self, *, ranks_agree: bool) -> None:
        self.finished.set()
        if self.thread is None:
            self._close_fds()
            return
        signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        with contextlib.suppress(OSError):  # wake the thread now rather than at its next poll
            os.write(self._write_fd, b"\0")  # 0 is no signal's number: it only sees finished set
        self.thread.join(timeout=1.0)
        self._close_fds()
