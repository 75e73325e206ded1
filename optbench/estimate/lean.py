"""What an estimate leaves unimported: transformers' modeling code imports, when they are installed,
scipy.optimize (the Hungarian matching of its object-detection losses) and torchao (loading
torchao-quantized checkpoints) — about 0.7 s of CPU that ``optbench estimate|plan`` of a Hugging Face
model never runs. ``transformers_without_unused`` makes this process's transformers take both as not
installed, before it imports them: its availability checks are cached per process, so they are run
once while the packages are hidden (``sys.modules[name] = None``, which ``importlib.util.find_spec``
reports as absent), then the packages are visible again to everything else (optbench's own float8 and
CPU-offload code import torchao themselves, directly). ``optbench train`` does not call it.
"""

from __future__ import annotations

import importlib
import sys

# the package, and transformers' cached check of it (transformers.utils.import_utils)
UNUSED_BY_TRANSFORMERS = {"scipy": "is_scipy_available", "torchao": "is_torchao_available"}


def transformers_without_unused() -> list[str]:
    """Hide ``UNUSED_BY_TRANSFORMERS`` from transformers for the rest of this process; the packages
    hidden (none when each is already imported, or transformers already checked for it)."""
    hidden = [name for name in UNUSED_BY_TRANSFORMERS if name not in sys.modules]
    if not hidden:
        return []
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        checks = importlib.import_module("transformers.utils.import_utils")
        for name in hidden:
            getattr(checks, UNUSED_BY_TRANSFORMERS[name])()
    finally:
        for name in hidden:
            del sys.modules[name]
    return hidden
