"""What optbench measures once and keeps under ``~/.cache/optbench`` (``OPTBENCH_CACHE_DIR``
overrides, then ``XDG_CACHE_HOME``), and ``optbench cache list|clear``.

A run that reuses a cached value says so, once per process, at INFO (``log.level=info``, and always
in the run's ``train.log``): what it is, where, how old, and how to measure it again
(``note_reused``). The caches:

* ``cpu_peak``: this CPU's matmul ceilings per dtype, thread count and torch version, the peak a
  CPU run's MFU divides by (``optbench.measure.cpu_peak``; every run re-checks it with a few
  matmuls and raises it when they are faster);
* ``gloo_link``: the gloo all-reduce bandwidth between local processes, the collectives of a CPU
  estimate or plan (``optbench.estimate.links``);
* ``netcdf-stats``: the normalization statistics (``.json``) and climatologies (``.npz``) of
  NetCDF/Zarr training data, keyed on the files' paths, sizes and times, the variables and the
  training steps (``optbench.data.netcdf.stats``; ``data.stats_cache`` puts them elsewhere).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from optbench.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cache:
    name: str
    path: str  # below cache_dir(): a file, or a directory ending in "/"
    holds: str


CACHES = (
    Cache("cpu_peak", "cpu_peak.json", "this CPU's measured matmul ceilings (the peak behind a CPU run's MFU)"),
    Cache("gloo_link", "gloo_link.json", "the gloo all-reduce bandwidth between local processes (a CPU estimate's "
                                         "or plan's collectives)"),
    Cache("netcdf-stats", "netcdf-stats/", "normalization statistics and climatologies of NetCDF/Zarr training data"),
)
_NOTED: set[tuple[str, str]] = set()  # (cache, what) already said in this process


def cache_dir() -> Path:
    root = os.environ.get("OPTBENCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "optbench"
    )
    return Path(root)


def age(when: str | float | None) -> str:
    """How long ago ``when`` (optbench's ISO timestamp, or seconds since the epoch) was, in words."""
    if isinstance(when, str):
        try:
            when = datetime.strptime(when, "%Y-%m-%dT%H:%M:%S%z").timestamp()
        except ValueError:
            return "of unknown age"
    if when is None:
        return "of unknown age"
    seconds = max(0.0, time.time() - when)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count != 1 else ''} old"
    return "under a minute old"


def note_reused(name: str, what: str, path: Path, when: str | float | None, *, override: str = "") -> None:
    """Log, once per process for each ``what``, that a cached value is used: its age and how to
    measure it again (``optbench cache clear NAME``, or deleting ``path`` where a config put it
    outside the cache directory; or ``override``)."""
    if (name, what) in _NOTED:
        return
    _NOTED.add((name, what))
    inside = Path(path).resolve().is_relative_to(cache_dir().resolve())
    again = (f"optbench cache clear {name}" if inside else f"deleting {path}") + (f", or {override}" if override else "")
    log.info("%s: cached in %s, %s (measured again after: %s)", what, path, age(when), again)


# --------------------------------------------------------------------------------- the command
def _size(path: Path) -> tuple[int, int]:
    """(files, bytes) at ``path``: a file, or every file below a directory."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def listing() -> list[str]:
    """One line per cache: its name, path, files and bytes, age of the newest file, what it holds."""
    root, lines = cache_dir(), []
    for cache in CACHES:
        path = root / cache.path
        files, size = _size(path)
        newest = max((p.stat().st_mtime for p in ([path] if path.is_file() else path.rglob("*"))
                      if p.is_file()), default=None) if path.exists() else None
        state = "empty" if not files else f"{files} file{'s' if files != 1 else ''}, {size:,} bytes, newest " + \
            age(newest)
        lines.append(f"{cache.name:<13} {path}  ({state}): {cache.holds}")
    return lines


def clear(names: list[str]) -> list[str]:
    """Remove the named caches (all without names); one line per cache removed or already empty."""
    known = {c.name: c for c in CACHES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"optbench cache clear: no cache named {', '.join(unknown)}; the caches are "
                          f"{', '.join(known)} (optbench cache list)")
    done = []
    for cache in (known[n] for n in names) if names else CACHES:
        path = cache_dir() / cache.path
        files, _ = _size(path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        done.append(f"{cache.name}: " + (f"removed {path} ({files} file{'s' if files != 1 else ''}); measured "
                                         "again when next needed" if files else f"already empty ({path})"))
    return done


class _OneLineParser(argparse.ArgumentParser):
    """A usage mistake is one line and exit 2 (``ConfigError``), as every command's."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    from optbench.usage import HelpFormatter, epilog

    parser = _OneLineParser(prog="optbench cache", formatter_class=HelpFormatter, epilog=epilog("cache"),
                           description="What optbench measured once and reuses, under ~/.cache/optbench "
                                       "(OPTBENCH_CACHE_DIR overrides): list the caches, or clear some so that "
                                       "the next run measures again. A run that reuses one says so at INFO.")
    parser.add_argument("action", choices=("list", "clear"), help="list: each cache, its size and age; "
                        "clear [NAME ...]: remove the named caches (every cache without names)")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"a cache to clear: {', '.join(c.name for c in CACHES)}")
    return parser


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    if args.action == "list" and args.names:
        raise ConfigError("optbench cache list takes no names; optbench cache clear NAME removes one")
    root = cache_dir()
    if root.exists() and not root.is_dir():
        where = "OPTBENCH_CACHE_DIR" if os.environ.get("OPTBENCH_CACHE_DIR") else "the cache directory"
        raise ConfigError(f"{root} ({where}) is a file, not a directory; point OPTBENCH_CACHE_DIR at a directory, "
                          "or move the file away")
    print("\n".join(listing() if args.action == "list" else clear(args.names)))
