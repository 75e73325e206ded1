"""How every ``optbench`` command ends: the one table from outcomes to exit statuses, and the one
line an error is printed as.

Every command takes its status from here: a run's from its ``status`` (``run_exit``), a sweep's
from its jobs' (``sweep_exit``), report's and compare's from their gates and runs
(``review_exit``), validate's from its verdict (``VERDICTS``), a signal's as 128 + its number.
Bad input is always ``BAD_INPUT`` (2), one line on stderr (``fail``), no traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import NoReturn

OK = 0
FAILED = 1  # a run failed, diverged, ran out of memory or hit a loss spike; a gate failed
BAD_INPUT = 2  # a bad value, an impossible combination, an option that cannot apply
NOT_JUDGED = 3  # optbench validate measured, but the plan's last phase cannot run here
TIME_LIMIT = 124  # run.time_limit_s stopped the run (the same command resumes it)
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT) stopped a sweep, compare or validate

# a run's summary.json ``status`` -> the exit status of ``optbench train``
RUN_STATUS = {
    "completed": OK, "stopped_early": OK,
    "diverged": FAILED, "failed": FAILED, "loss_spike": FAILED, "oom": FAILED,
    "incompatible": BAD_INPUT, "time_limit": TIME_LIMIT, "interrupted": INTERRUPTED,
}

# optbench validate's verdict -> its exit status
VERDICTS = {"VALIDATED": OK, "NOT VALIDATED": FAILED, "NOT JUDGED HERE": NOT_JUDGED}


def signal_exit(signum: int) -> int:
    """A process stopped by signal ``signum`` (SIGTERM: 143), as a shell reports it."""
    return 128 + signum


def signal_of(code: int) -> int | None:
    """The signal a process that exited with ``code`` was stopped by (None: not a signal)."""
    return code - 128 if 128 < code < 160 else None


def run_exit(status: str, *, user_error: bool = False, signum: int | None = None) -> int:
    """One run: a user error is bad input whatever status it left; a signal is 128 + its number."""
    if user_error:
        return BAD_INPUT
    if status == "interrupted" and signum:
        return signal_exit(signum)
    return RUN_STATUS[status]


def sweep_exit(statuses: Iterable[str]) -> int:
    """A sweep: interrupted, else 1 when any job failed, else 124 when any hit its time budget, else 0
    (an ``incompatible`` job is a recorded, expected outcome: a CPU cannot run every phase)."""
    found = set(statuses)
    if "interrupted" in found:
        return INTERRUPTED
    if any(RUN_STATUS.get(status, FAILED) == FAILED for status in found):
        return FAILED
    if "time_limit" in found:
        return TIME_LIMIT
    return OK


def review_exit(*, gates_ok: bool, runs: Iterable[int] = ()) -> int:
    """``optbench report``/``compare``: 1 when a gate fails or a run it made did not exit 0."""
    return OK if gates_ok and not any(runs) else FAILED


def fail(message: str, *, code: int = BAD_INPUT) -> NoReturn:
    """One line on stderr and the exit status; the traceback only with HYDRA_FULL_ERROR=1 (the
    caller re-raises for that)."""
    print(f"optbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)
