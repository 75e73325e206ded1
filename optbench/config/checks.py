"""The checks every schema's ``__post_init__`` shares; each raises ConfigError naming the key.
A number must also be finite: Hydra parses ``inf`` and ``nan``, and neither is a step count, a
learning rate or a number of seconds."""

from __future__ import annotations

import math
from typing import Any

from optbench.errors import ConfigError


def positive(**values: int | float) -> None:
    for key, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{key} must be positive, got {value}")


def one_of(key: str, value: Any, choices: tuple | list) -> None:
    """The one "X is unknown" check: ``value`` must be one of ``choices``."""
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{key}={value} is unknown; use one of {shown}")


def non_negative(**values: int | float) -> None:
    for key, value in values.items():
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"{key} must be >= 0, got {value}")


def finite(**values: float) -> None:
    """A number that is a scale, a threshold or a duration: ``nan`` and ``inf`` are refused."""
    for key, value in values.items():
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
