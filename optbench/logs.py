"""``log.level``: how much a run prints on the console.

* ``auto`` (default): ``warning`` beside a progress bar (a terminal: the bar and the final summary
  are the output), ``info`` otherwise (CI, a log file: the per-step lines are the progress);
* ``warning``: the summary, the bar, warnings and errors;
* ``info``: also what was applied and one line per ``log.every`` steps;
* ``debug``: also debug detail, torch's and the other libraries' included.

Only console handlers change; ``train.log`` in the run directory keeps every ``info`` line (and
``debug`` ones at ``debug``). Chatty libraries (matplotlib, PIL, h5py, fsspec, torch's compiler)
log at ``warning`` and above below ``debug``.
"""

from __future__ import annotations

import logging
import sys

CHATTY = ("matplotlib", "PIL", "h5py", "fsspec", "urllib3", "torch._dynamo", "torch._inductor",
          "torch.distributed", "numexpr")


def console_level(level: str, *, progress: str) -> int:
    if level == "auto":
        bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        level = "warning" if bar else "info"
    return getattr(logging, level.upper())


def apply_log_level(level: str, *, progress: str) -> int:
    """Set the console handlers' level (file handlers keep theirs) and the libraries'; returns it."""
    value = console_level(level, progress=progress)
    root = logging.getLogger()
    for handler in root.handlers:
        console = getattr(handler, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
        if console and not isinstance(handler, logging.FileHandler):
            handler.setLevel(value)
    if value <= logging.DEBUG:
        root.setLevel(logging.DEBUG)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if value <= logging.DEBUG else logging.WARNING)
    return value
