"""Python's cyclic garbage collector held off while optbench's heavy dependencies are imported.

Importing torch, torch._dynamo, Hydra and the trainer creates some 400,000 long-lived objects, and the
collector's full passes over them while they are being created cost about 1.5 s of a command's 4 s of
imports (measured on the 2-core machine of bench/RESULTS.md: 4.0 against 2.5 CPU-s). Nothing imported is
garbage, so the collector is off during the imports; afterwards the imported objects are frozen (kept,
no longer scanned) and collection resumes for everything the command allocates. The freeze is done
once per process: a later block in the same process would otherwise freeze what ran before it.
``optbench estimate`` and ``plan`` hold it in their own way (``optbench.estimate.command.collect_from_here``).

Where it is used: the workers' forkserver (``optbench.forkserver``), through two modules it imports
around its preloaded ones (``optbench.preload_start``, ``optbench.preload_done``), and the test suite's
workers. Not ``optbench train``'s own process: held there, a SIGTERM to the whole process group of a
two-rank run was sometimes recorded with no completed step (2 failures in 5 of
tests/training/test_parallel.py's whole-group test, none in 9 without it), and the cause is not found yet.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_frozen = False  # this process froze its imports already


@contextlib.contextmanager
def imports_held() -> Iterator[None]:
    """The collector off for the imports in the ``with`` block, the imported objects frozen after it
    (the first time in this process; later blocks only hold the collector off)."""
    if not gc.isenabled():  # a caller holds it already: it decides when it resumes
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        freeze_once()
        gc.enable()


def freeze_once() -> None:
    global _frozen
    if not _frozen:
        gc.freeze()
        _frozen = True
