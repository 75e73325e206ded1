"""Hydra's compositions with less repeated work, the same configs: ``first_phase`` (the first phase of
``optbench.config.compose``) and ``optbench train``/``estimate`` around ``@hydra.main`` (a sweep
composes every job again) compose inside ``composing_once_per_file``. While it is entered:

- **Each config file is parsed once per process.** Hydra's loader parses every file of the defaults
  tree again at each composition: its cache (``CachingConfigRepository``) lives for one. Here that
  cache sits over a repository that keeps what each file parsed to, per search path, and hands out
  a deep copy (Hydra merges a loaded file's nodes into the composed config without copying them, and
  later steps change them in place). A config's files do not change under a running command, as
  ``compose``'s own table of first phases already assumes.
- **The map of known group choices is built where it is read.** At every node of the defaults tree
  (each preset is one: its defaults list names its schema) Hydra builds a config of every group
  choice known so far, which only an interpolated default (``- b: ${a}``) reads, whether the node has
  one or not.

Everything else is Hydra's own code. ``first_phase`` also keeps one loader per config directory for
the process, where ``hydra.compose`` under ``initialize_config_dir`` builds a new one each time.
Eight compositions of different group overrides (``compose`` with its table emptied each time) took
0.157-0.172 s of CPU each before, 0.110-0.112 s with the files parsed once, 0.078-0.094 s with the map
built where read as well (2-3 runs each on the 2-core machine of bench/RESULTS.md). In the whole test
suite, Hydra's 441 compositions took 79.8 s of CPU before and its 449 took 37.5 s after (the
``optbench train``/``estimate`` commands' own 111-112: 23.0 and 9.2 s).
tests/config/test_config.py checks the configs against ``hydra.compose``'s.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from typing import Any

from hydra._internal.config_repository import CachingConfigRepository, IConfigRepository
from hydra.core.object_type import ObjectType
from omegaconf import DictConfig, open_dict

_PARSED: dict[tuple[Any, ...], Any] = {}  # (search path, config path) -> what Hydra parsed, for the process


class _ParsedOnce(IConfigRepository):
    """A Hydra config repository that parses each config once per process: ``load_config`` keeps the
    result per (search path, config) and returns a deep copy of it; the rest is the delegate's.
    Hydra deep-copies the repository at every composition, before it adds the primary config's
    search path to the copy's sources (which it sets anew): the copy is a shallow one here."""

    def __init__(self, delegate: Any) -> None:
        self.delegate = delegate

    def __deepcopy__(self, memo: dict) -> _ParsedOnce:
        return _ParsedOnce(copy.copy(self.delegate))

    def load_config(self, config_path: str) -> Any:
        key = (tuple(source.full_path() for source in self.delegate.get_sources()), config_path)
        if key not in _PARSED:
            _PARSED[key] = self.delegate.load_config(config_path=config_path)
        return copy.deepcopy(_PARSED[key])

    def get_schema_source(self) -> Any:
        return self.delegate.get_schema_source()

    def initialize_sources(self, config_search_path: Any) -> None:
        self.delegate.initialize_sources(config_search_path)

    def group_exists(self, config_path: str) -> bool:
        return self.delegate.group_exists(config_path=config_path)

    def config_exists(self, config_path: str) -> bool:
        return self.delegate.config_exists(config_path=config_path)

    def get_group_options(self, group_name: str, results_filter: Any = ObjectType.CONFIG) -> list[str]:
        return self.delegate.get_group_options(group_name=group_name, results_filter=results_filter)  # None: all

    def get_sources(self) -> list[Any]:
        return self.delegate.get_sources()


class _CachingOverParsedOnce(CachingConfigRepository):
    """Hydra's per-composition cache over the files parsed once per process."""

    def __init__(self, delegate: Any) -> None:
        super().__init__(_ParsedOnce(delegate))


@contextlib.contextmanager
def composing_once_per_file() -> Iterator[None]:
    """While entered, Hydra's compositions parse each file once per process and build the map of
    known group choices only for a node with an interpolated default (see the module's docstring).
    Entered again inside itself, it changes nothing; a Hydra whose private parts here are not
    there or take other arguments composes as it does."""
    from hydra._internal import config_loader_impl as loader
    from hydra._internal import defaults_list as tree
    from hydra.core.default_element import InputDefault

    original_map = getattr(tree, "_create_interpolation_map", None)
    original_cache = getattr(loader, "CachingConfigRepository", None)
    if original_map is None or original_cache is not CachingConfigRepository or \
            list(inspect.signature(original_map).parameters) != ["overrides", "defaults_list", "self_added"]:
        yield  # entered already (the cache is ours), or another Hydra
        return

    def built_when_needed(overrides: Any, defaults_list: list, self_added: bool) -> Any:
        if any(isinstance(d, InputDefault) and d.is_interpolation() for d in defaults_list):
            return original_map(overrides, defaults_list, self_added)
        return None  # read by no one: the node has no interpolated default

    tree._create_interpolation_map = built_when_needed
    loader.CachingConfigRepository = _CachingOverParsedOnce
    try:
        yield
    finally:
        tree._create_interpolation_map = original_map
        loader.CachingConfigRepository = original_cache


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
        loader = _LOADERS[directory] = ConfigLoaderImpl(config_search_path=create_config_search_path(directory))
    with composing_once_per_file():
        cfg = loader.load_configuration(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN,
                                        from_shell=False)
    if "hydra" in cfg:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg
