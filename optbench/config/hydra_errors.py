"""Hydra's composition errors as optbench's one line.

Hydra reports a config it cannot compose (an unknown key or preset, a value of the wrong type, an
override it cannot parse) itself, as a block on stderr: the message, then ``full_key``,
``reference_type`` and ``object_type`` lines, the options of a group and its search path, and a
hint to set ``HYDRA_FULL_ERROR=1``. ``held_stderr`` keeps what is written to stderr while Hydra
composes; when composing fails, ``one_line`` turns the block into one line (with the keys of the
node a misspelt key was looked for in), and anything else (a warning) is passed on as written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

HINT = "Set the environment variable HYDRA_FULL_ERROR=1"


def _schemas() -> dict[str, type]:
    """Every schema class by name: the registered ones and every dataclass their fields hold."""
    import typing

    from optbench.config import SCHEMAS

    found: dict[str, type] = {}
    todo = [c for c in SCHEMAS.values() if isinstance(c, type)]
    while todo:
        cls = todo.pop()
        if not dataclasses.is_dataclass(cls) or cls.__name__ in found:
            continue
        found[cls.__name__] = cls
        todo += [t for t in typing.get_type_hints(cls).values() if isinstance(t, type)]
    return found


def _keys_of(schema_name: str) -> str:
    cls = _schemas().get(schema_name)
    return f" (its keys are {', '.join(sorted(f.name for f in dataclasses.fields(cls)))})" if cls else ""


def one_line(text: str) -> str:
    """Hydra's error block ``text`` as one line: its messages joined, a group's options listed on
    it, the details (full_key, types, search path, the HYDRA_FULL_ERROR hint) left out."""
    lines = text.splitlines()
    if any(line.startswith("Traceback") for line in lines):  # an exception Hydra printed whole: its last line
        lines = [next(line for line in reversed(lines) if line.strip() and not line.startswith(HINT))]
    parts: list[str] = []
    for line in lines:
        if line.startswith("Config search path:"):
            break
        if not line.strip() or line.startswith((HINT, "To append to your config use", " ")):
            continue
        if line.startswith("\t"):  # an option of the group named on the line before
            parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line.strip()
            continue
        missing = re.match(r"Key '[^']+' not in '(\w+)'", line)
        parts.append(line.rstrip(".") + (_keys_of(missing.group(1)) if missing else ""))
    joined = parts[0] if parts else text.strip()
    for part in parts[1:]:
        joined += ("; " + part[0].lower() + part[1:]) if part.startswith(("Available", "See")) else ": " + part
    return joined


class _Held:
    """A stand-in for stderr that keeps what is written until ``started()`` (then writes through)."""

    def __init__(self, real: Any, started: Callable[[], bool]) -> None:
        self.real, self.started, self.parts, self.holding = real, started, [], True

    def release(self) -> None:
        if self.holding:
            self.holding = False
            self.real.write("".join(self.parts))
            self.parts.clear()

    def write(self, text: str) -> int:
        if self.holding and self.started():
            self.release()
        if self.holding:
            self.parts.append(text)
            return len(text)
        return self.real.write(text)

    def flush(self) -> None:
        if not self.holding:
            self.real.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding: the real stream's
        return getattr(self.real, name)


@contextlib.contextmanager
def held_stderr(started: Callable[[], bool]) -> Iterator[None]:
    """Around Hydra's ``main``: until ``started()``, stderr is kept; a failure to compose (Hydra's
    exit 1 before the job started) is printed as ``optbench: error: <one line>``, anything else
    written as it was."""
    real = sys.stderr
    held = _Held(real, started)
    sys.stderr = held
    try:
        yield
    except SystemExit as exc:
        if exc.code == 1 and held.holding and not started():
            text = "".join(held.parts)
            held.parts.clear()
            warnings = [line for line in text.splitlines(keepends=True) if "Warning: " in line]
            held.release()
            real.write("".join(warnings) + f"optbench: error: {one_line(text)}\n")
        raise
    finally:
        held.release()
        if sys.stderr is held:
            sys.stderr = real
