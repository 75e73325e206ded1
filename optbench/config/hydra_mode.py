"""``@hydra.main`` without its first composition.

Before it runs a command, Hydra composes the whole config once only to read ``hydra.mode``
(``Hydra.get_mode``: RUN, MULTIRUN or None, the last when nothing sets it; a config that does not
compose is None there too, and the run's own composition reports it), then composes it again
for the run. That first composition is a quarter of a second of CPU in every ``optbench train``
and ``optbench estimate`` (a 2-step tiny ``optbench train``, five pairs with and without it: 5.63
against 5.78 s of wall, median). No config under conf/ sets ``hydra.mode`` (tests/config/test_config.py
reads every file), so only the command line can: an override of ``hydra.mode``, of a ``hydra/``
group or of the search path, or another config directory (``--config-dir``, ``--config-path``).
``mode_read_without_composing`` answers None without composing when there is neither, and leaves
the question to Hydra otherwise: the mode, the composition and the run are Hydra's own either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def may_set_mode(overrides: list[str], sources: list[tuple[str, str]], *, main: str) -> bool:
    """Whether ``hydra.mode`` may be set by these overrides (one of ``hydra.mode`` itself, the whole
    ``hydra`` node, a ``hydra/`` group, the search path) or by a config source other than
    optbench's conf/ (``main``) and Hydra's own: ``sources`` are the search path's (provider, path)
    pairs, to which ``--config-dir`` adds one and ``--config-path`` changes main's path."""
    for provider, path in sources:
        if provider not in ("hydra", "main", "schema") or (provider == "main" and path != main):
            return True
    for override in overrides:
        key = override.lstrip("~+").split("=", 1)[0].strip()
        if key in ("hydra", "hydra.mode") or key.startswith(("hydra/", "hydra.searchpath")):
            return True
    return False


@contextlib.contextmanager
def mode_read_without_composing() -> Iterator[None]:
    """While entered, Hydra reads the mode of a command line that cannot set it as None without
    composing (see the module's docstring); any other command line is Hydra's own ``get_mode``."""
    from hydra._internal.hydra import Hydra

    from optbench.config import conf_dir

    original = Hydra.get_mode

    def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
        sources = [(source.provider, source.path) for source in self.config_loader.get_sources()]
        if may_set_mode(list(overrides), sources, main=str(conf_dir())):
            return original(self, config_name=config_name, overrides=overrides)
        return None

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = original
