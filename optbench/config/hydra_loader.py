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

``interpolation_map_when_needed``, entered by ``first_phase`` and by ``optbench train``/``estimate``
around ``@hydra.main``: at every node of the defaults tree (each preset is one: its defaults list
names its schema) Hydra builds a config of every group choice known so far, which only an
interpolated default (``- b: ${a}``) reads, and builds it whether the node has one or not; a third
of a composition's time went to it. While entered, the map is built for the nodes that have one:
the 8 compositions above then took 0.078-0.094 s each (three runs).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
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
    with interpolation_map_when_needed():
        cfg = loader.load_configuration(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN,
                                        from_shell=False)
    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


@contextlib.contextmanager
def interpolation_map_when_needed() -> Iterator[None]:
    """While entered, Hydra builds the map of known group choices (``_create_interpolation_map``)
    only for a node of the defaults tree that has an interpolated default, the one reader of the map
    (see the module's docstring); everything else is Hydra's own. Entered again inside itself, it
    changes nothing; a Hydra whose function is not there or takes other arguments is left as it is."""
    from hydra._internal import defaults_list as tree
    from hydra.core.default_element import InputDefault

    original = getattr(tree, "_create_interpolation_map", None)
    if original is None or getattr(original, "when_needed", False) or \
            list(inspect.signature(original).parameters) != ["overrides", "defaults_list", "self_added"]:
        yield
        return

    def built_when_needed(overrides: Any, defaults_list: list, self_added: bool) -> Any:
        if any(isinstance(d, InputDefault) and d.is_interpolation() for d in defaults_list):
            return original(overrides, defaults_list, self_added)
        return None  # read by no one: the node has no interpolated default

    built_when_needed.when_needed = True  # type: ignore[attr-defined]
    tree._create_interpolation_map = built_when_needed
    try:
        yield
    finally:
        tree._create_interpolation_map = original
