"""Errors that are the user's to fix.

A ``ConfigError`` (or a ``ValueError`` raised while the config is checked) is printed by the CLI
as one line and exits with status 2; no traceback unless ``HYDRA_FULL_ERROR=1``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad value or an impossible combination; the message names the fix."""


class IncompatibleError(ConfigError):
    """The config is valid but cannot run on this machine (recorded as status ``incompatible``)."""


class DivergedError(RuntimeError):
    """The loss or the gradient norm became non-finite; raised before the optimizer update."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(f"{what} is {value} at step {step}; the optimizer update was not applied")
        self.step = step


class Interrupted(RuntimeError):
    """SIGTERM/SIGINT stopped the run at a step boundary (after writing a checkpoint when one was
    possible); the process exits with 128 + the signal number."""

    def __init__(self, message: str, *, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class RunStopped(RuntimeError):
    """A component ended the run on purpose before ``train.steps``, with its own status
    (``stopped_early``, ``time_limit``, ``loss_spike``), at a step every rank agrees on; never
    ``completed``. ``run_loop`` treats it like ``Interrupted`` (the ranks agree)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class OutOfMemory(RuntimeError):
    """The device ran out of memory during a step (recorded as status ``oom`` with the step, the
    allocator's figures and the largest micro-batch that fits). Only this rank is known to have
    stopped, so the ranks do not agree."""


class ReportError(ConfigError):
    """Bad input to ``optbench report``/``compare``/``validate``: printed as one line, exit status 2."""
