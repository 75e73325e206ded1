"""Python's cyclic garbage collector held off while optbench's heavy dependencies are imported.

Importing torch, torch._dynamo, Hydra and the trainer creates some 400,000 long-lived objects, and the
collector's full passes over them while they are being created cost about 1.5 s of a command's 4 s of
imports (measured on the 2-core machine of bench/RESULTS.md: 4.0 against 2.5 CPU-s). Nothing imported is
garbage, so the collector is off during the imports; afterwards the imported objects are frozen (kept,
no longer scanned) and collection resumes for everything the command allocates. The freeze is done
once per process: a later command in the same process (a test, a script calling ``optbench.cli.main``)
would otherwise freeze what the earlier one left behind. ``optbench estimate`` and ``plan`` hold it in
their own way (``optbench.estimate.command.collect_from_here``).

The workers' forkserver (``optbench.forkserver``) does the same with two modules it imports around its
preloaded ones: ``optbench.preload_start`` and ``optbench.preload_done``.
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
