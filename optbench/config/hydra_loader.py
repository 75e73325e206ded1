"""Hydra's first phase for ``optbench.config.compose``: the presets chosen by the group overrides
merged, by one config loader per config directory, held for the process, that parses each file once.

``hydra.compose`` under ``initialize_config_dir`` builds a new loader for every composition, and
the loader parses every file of the defaults tree again: its cache (``CachingConfigRepository``)
lives for one composition. Here Hydra's own loader (``ConfigLoaderImpl.load_configuration``, the
call ``hydra.compose`` makes) composes as before, over a repository that keeps what each file parsed
to and hands out a deep copy (Hydra merges a loaded file's nodes into the composed config without
copying them, and later steps change them in place). A composition of 8 different group overrides
took 0.157-0.172 s of CPU each that way and 0.110-0.112 s this way, the same configs to the byte
(two runs each on the 2-core machine of bench/RESULTS.md; tests/config/test_config.py compares every preset).
Files are read once per process, as ``compose``'s own table of first phases already assumes: a
config's files do not change under a running command.
"""

from __future__ import annotations

import copy
from typing import Any

from hydra._internal.config_repository import IConfigRepository
from omegaconf import DictConfig, open_dict


class _ParsedOnce(IConfigRepository):
    """A Hydra config repository (``IConfigRepository``) that parses each config once: ``load_config``
    keeps the result per (search path, config) and returns a deep copy of it; the rest is the
    delegate's. Hydra deep-copies the repository at every composition, before it adds the primary
    config's search path to the copy's sources (which it sets anew): the copy is a shallow one here,
    sharing the parsed configs."""

    def __init__(self, delegate: Any, parsed: dict[tuple[Any, ...], Any]) -> None:
        self.delegate, self.parsed = delegate, parsed

    def __deepcopy__(self, memo: dict) -> _ParsedOnce:
        return _ParsedOnce(copy.copy(self.delegate), self.parsed)

    def load_config(self, config_path: str) -> Any:
        key = (tuple(source.full_path() for source in self.delegate.get_sources()), config_path)
        if key not in self.parsed:
            self.parsed[key] = self.delegate.load_config(config_path=config_path)
        return copy.deepcopy(self.parsed[key])

    def get_schema_source(self) -> Any:
        return self.delegate.get_schema_source()

    def initialize_sources(self, config_search_path: Any) -> None:
        self.delegate.initialize_sources(config_search_path)

    def group_exists(self, config_path: str) -> bool:
        return self.delegate.group_exists(config_path=config_path)

    def config_exists(self, config_path: str) -> bool:
        return self.delegate.config_exists(config_path=config_path)

    def get_group_options(self, group_name: str, results_filter: Any = None) -> list[str]:
        if results_filter is None:
            return self.delegate.get_group_options(group_name=group_name)
        return self.delegate.get_group_options(group_name=group_name, results_filter=results_filter)

    def get_sources(self) -> list[Any]:
        return self.delegate.get_sources()


_LOADERS: dict[str, Any] = {}  # per config directory


def first_phase(directory: str, config_name: str, overrides: list[str]) -> DictConfig:
    """What ``hydra.compose(config_name, overrides)`` returns under
    ``initialize_config_dir(directory, version_base="1.3")``: the composed config without its
    ``hydra`` node, composed for a single run (``RunMode.RUN``, not from a shell)."""
    from hydra import version
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.utils import setup_globals
    from hydra.types import RunMode

    version.setbase("1.3")
    loader = _LOADERS.get(directory)
    if loader is None:
        setup_globals()  # Hydra's resolvers (``${now:...}``), as building a Hydra registers them
        loader = ConfigLoaderImpl(config_search_path=create_config_search_path(directory))
        loader.repository = _ParsedOnce(loader.repository, {})
        _LOADERS[directory] = loader
    cfg = loader.load_configuration(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN,
                                    from_shell=False)
    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg
