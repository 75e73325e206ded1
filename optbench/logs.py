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

import contextlib
import logging
import sys
from collections.abc import Iterator

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


class _Drop(logging.Filter):
    """Drops the records of one logger whose message contains any of ``parts``."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


# What a first import of torchao logs, though nothing of it is wrong: its prebuilt CUDA kernels for
# another Python fail to load ("Failed to load .../torchao/_C_mxfp8....so"), and its enum
# registrations make torch warn that registering enums is deprecated. optbench triggers it through
# transformers' modeling code (model=hf: transformers imports torchao for its quantizer) and float8's
# conversion (precision=float8, optbench plan's float8 candidates). Exactly these, by logger.
IMPORT_NOISE = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("register_constant() on Enum subclasses is deprecated",),
}


@contextlib.contextmanager
def quiet_imports(noise: dict[str, tuple[str, ...]] = IMPORT_NOISE) -> Iterator[None]:
    """Inside: the records of ``noise`` (logger name -> message parts) dropped, every other record of
    those loggers kept. Around an import optbench triggers on the user's behalf."""
    filters = [(logging.getLogger(name), _Drop(*parts)) for name, parts in noise.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers' progress bars off for the block ("Loading weights", "Writing model shards"): a
    command says what it read or wrote, or why it could not, in one line; as they were after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
