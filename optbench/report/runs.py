"""Run directories as ``optbench report`` reads them: ``summary.json`` (the typed record
``optbench.summary.RunSummary``, of any schema version), ``metrics.jsonl`` and
``.hydra/overrides.yaml``. A summary that cannot be read makes the run ``unreadable`` (listed with
the reader's one line, never dropped silently); a torn last line of ``metrics.jsonl`` is skipped and
noted.

A team's outputs/ holds thousands of runs, so reading keeps per run only what the report uses: its
loss curves (not every metrics record), its overrides, and its record, whose configs, provenance and
the like are shared between the runs that recorded them alike (``Shared``). One walk finds the runs;
a config written under today's names is not rebuilt (``config_is_current``).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from optbench.config.renames import config_is_current, new_option, upgrade_config, upgrade_override
from optbench.errors import ConfigError, ReportError
from optbench.files import parse_jsonl, timestamp
from optbench.outputs import config_hash
from optbench.summary import RunSummary, SummaryError, read_run_summary

COMPARE_MANIFEST = "compare.json"
YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: the same documents, ten times faster
Point = tuple[int, float]  # (step, loss) of a loss curve


def dig(tree: Any, dotted: str) -> Any:
    """``tree["a"]["b"]`` for ``"a.b"`` in a nested dict (a run's resolved config); None where any
    level is missing (configs of other versions may lack keys)."""
    node = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def num(value: Any) -> int | float | None:
    """A finite number, or None (non-finite values are stored as strings like "nan")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def natural_key(text: str) -> tuple:
    """"10_x" after "9_x": digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def parse_override(text: str) -> tuple[str, str]:
    """``key=value`` (also ``+key=``, ``++key=``, ``~key``) -> (key, value)."""
    body = text.lstrip("+~")
    key, sep, value = body.partition("=")
    if text.startswith("~") and not sep:
        return key, "(deleted)"
    return key, value


@dataclass
class Run:
    dir: Path
    summary: RunSummary
    curves: tuple[tuple[Point, ...], tuple[Point, ...]]  # (train, eval) losses of metrics.jsonl, by step
    overrides: list[str]
    side: str | None = None  # "A" or "B" in an optbench compare dir
    notes: list[str] = field(default_factory=list)  # what the reader skipped (a torn metrics line)
    real: Path | None = None  # dir.resolve(), as load_runs found it (None: not resolved yet)

    @property
    def status(self) -> str:
        return str(self.summary.status)

    @property
    def error(self) -> str | None:
        return self.summary.error

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    def override_map(self) -> dict[str, str]:
        return dict(parse_override(o) for o in self.overrides)

    def sort_key(self) -> tuple:
        return (str(self.summary.started_at or ""), natural_key(str(self.dir)))


class Shared:
    """One copy of each value that many runs recorded alike: thousands of copies of one config,
    provenance or loss curve held once (a report over 10,000 runs holds megabytes, not gigabytes).
    Only for plain values (as JSON reads them), which no reader of a Run changes."""

    def __init__(self) -> None:
        self._seen: dict[bytes, Any] = {}
        self._curves: dict[tuple[Point, ...], tuple[Point, ...]] = {}

    def one(self, value: Any) -> Any:
        """``value``, or an equal one seen before (equal pickles: the same types and values)."""
        if not isinstance(value, (dict, list)) or not value:
            return value
        return self._seen.setdefault(pickle.dumps(value, protocol=5), value)

    def config(self, config: Any) -> Any:
        """A config whose every group is shared (configs that differ in one seed share the rest)."""
        if not isinstance(config, dict):
            return config
        return self.one({key: self.one(value) for key, value in config.items()})

    def summary(self, summary: RunSummary) -> None:
        summary.config = self.config(summary.config)
        summary.overrides = self.one(summary.overrides)
        summary.applied, summary.predicted = self.one(summary.applied), self.one(summary.predicted)
        summary.versions, summary.provenance = self.one(summary.versions), self.one(summary.provenance)
        summary.throughput.step_times_s = self.one(summary.throughput.step_times_s)

    def curve(self, points: list[Point]) -> tuple[Point, ...]:
        key = tuple(points)
        return self._curves.setdefault(key, key)


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(
            f"{path} is not valid JSON ({exc.msg}, line {exc.lineno}): the {what} is truncated or corrupt; "
            f"rerun that run or leave its directory out"
        ) from None
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror}") from None


def _load_metrics(run_dir: Path, notes: list[str], shared: Shared) -> tuple[tuple[Point, ...], tuple[Point, ...]]:
    """The run's (train, eval) loss curves from its metrics records, read one file at a time and
    kept as points only; a torn last line is skipped and a corrupt file left out, each with a note
    (the summary's numbers do not depend on them)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return (), ()  # a run that failed before training has none
    try:
        records, torn = parse_jsonl(path, objects_only=True)  # optbench writes one object per line
    except ConfigError as exc:
        notes.append(f"{exc}: its loss curve is not drawn")
        return (), ()
    except OSError as exc:
        notes.append(f"cannot read {path}: {exc.strerror}: its loss curve is not drawn")
        return (), ()
    if torn:
        notes.append(torn)
    odd = sum(1 for r in records if r.get("kind") in ("train", "eval") and num(r.get("loss")) is None
              and r.get("loss") not in NON_FINITE)
    if odd:
        notes.append(f"{path} has {odd} train/eval record(s) whose loss is no number (edited or corrupt?): "
                     "left out of its loss curve")
    return shared.curve(_points(records, "train")), shared.curve(_points(records, "eval"))


NON_FINITE = ("nan", "inf", "-inf")  # how metrics.jsonl spells a loss that is no finite number


def _points(records: list[dict[str, Any]], kind: str) -> list[Point]:
    found = [(r.get("step"), num(r.get("loss"))) for r in records if r.get("kind") == kind]
    return [(s, v) for s, v in found if v is not None and isinstance(s, int)]


def _load_overrides(run_dir: Path, summary: RunSummary) -> list[str]:
    """Hydra's own record (.hydra/overrides.yaml) when present, else the summary's copy, under the
    current config names (a run written before a rename reads as one written after it)."""
    return [_upgraded(o) for o in _recorded_overrides(run_dir, summary)]


@lru_cache(maxsize=65536)
def _upgraded(override: str) -> str:
    """``upgrade_override``'s new name, once per distinct override (a sweep's runs repeat most)."""
    return upgrade_override(override)[0]


def _recorded_overrides(run_dir: Path, summary: RunSummary) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        text = None
    if text is not None:
        try:
            loaded = yaml.load(text, Loader=YamlLoader)
        except yaml.YAMLError:
            raise ReportError(f"{path} is not valid YAML: truncated or corrupt") from None
        if isinstance(loaded, list):
            return [str(o) for o in loaded]
    overrides = summary.overrides
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def load_run(run_dir: Path, shared: Shared | None = None) -> Run:
    """The run in ``run_dir``; one whose summary cannot be read is a Run with status ``unreadable``.
    ``shared``: what the other runs of this report recorded, to hold what this one records alike once."""
    shared = shared or Shared()
    try:
        summary = read_run_summary(run_dir)
    except SummaryError as exc:
        return _unreadable_run(run_dir, str(exc))
    notes: list[str] = []
    try:
        overrides = _load_overrides(run_dir, summary)
    except ReportError as exc:
        notes.append(str(exc))
        overrides = [_upgraded(str(o)) for o in summary.overrides or []]
    if not config_is_current(summary.config):
        upgraded = upgrade_config(summary.config)
        if upgraded != summary.config:  # written before a rename: read as if written after it, so it
            summary.set_config(upgraded, config_hash(upgraded))  # pools with today's
    summary.model.name = new_option("model", summary.model.name)
    shared.summary(summary)
    return Run(run_dir, summary, _load_metrics(run_dir, notes, shared), shared.one(overrides), notes=notes)


def _placeholder(status: str, error: str, *, config: dict[str, Any] | None, started_at: str | None = None) -> RunSummary:
    """The record of a run whose summary.json cannot be read or is not there: how it is listed."""
    return RunSummary(status=status, error=error, config=config, started_at=started_at, versions={})


def _unreadable_run(run_dir: Path, why: str) -> Run:
    """Listed with why; grouped by its composed config (.hydra/config.yaml), as an unfinished run."""
    summary = _placeholder("unreadable", why, config=_hydra_config(run_dir))
    try:
        overrides = _load_overrides(run_dir, summary)
    except ReportError:
        overrides = []
    return Run(run_dir, summary, ((), ()), overrides)


def load_unfinished_run(run_dir: Path, shared: Shared | None = None) -> Run:
    """A Hydra job dir without summary.json: the process was killed (out of memory, a signal) or is
    still running. Listed with that reason; its composed config comes from .hydra/config.yaml."""
    config = _hydra_config(run_dir)
    started = timestamp((run_dir / ".hydra").stat().st_mtime)
    summary = _placeholder("no summary", "no summary.json: the run was killed (out of memory? a signal?) or is "
                           "still running", config=config, started_at=started)
    return Run(run_dir, summary, ((), ()), _load_overrides(run_dir, summary))


def _hydra_config(run_dir: Path) -> dict[str, Any] | None:
    config_path = run_dir / ".hydra" / "config.yaml"
    try:
        config = yaml.load(config_path.read_text(), Loader=YamlLoader) if config_path.is_file() else None
    except (yaml.YAMLError, OSError):
        config = None
    if not isinstance(config, dict):
        return None
    return config if config_is_current(config) else upgrade_config(config)


def find_run_dirs(path: Path) -> tuple[list[Path], list[Path]]:
    """(dirs with a summary.json, Hydra job dirs without one) below ``path``, in one walk of the tree
    (symbolic links to directories are not followed)."""
    if not path.exists():
        raise ReportError(f"{path} does not exist; give a run dir, a sweep dir or an outputs dir (optbench train "
                          "writes them under outputs/ unless hydra.run.dir or hydra.sweep.dir says where)")
    if path.is_file():
        if path.name != "summary.json":
            raise ReportError(f"{path} is a file; give a run dir, a sweep dir or an outputs dir")
        return [path.parent], []
    done, hydra = set(), set()
    for where, dirs, files in os.walk(path):
        if "summary.json" in files or "summary.json" in dirs:
            done.add(where)
        if os.path.basename(where) == ".hydra" and ("overrides.yaml" in files or "overrides.yaml" in dirs):
            hydra.add(os.path.dirname(where))
    if not done and not hydra:
        raise ReportError(
            f"no runs under {path}: no summary.json found (give a run dir, a sweep dir or outputs/)"
        )
    return sorted(Path(d) for d in done), sorted(Path(d) for d in hydra - done)


class _Sides:
    """``compare_side`` with each compare manifest read once (a compare dir holds many runs)."""

    def __init__(self) -> None:
        self._manifests: dict[Path, dict[Any, Any]] = {}

    def side(self, run_dir: Path) -> str | None:
        parent = run_dir.parent
        if parent not in self._manifests:
            self._manifests[parent] = _sides(parent)
        return self._manifests[parent].get(run_dir.name)


def _sides(compare_dir: Path) -> dict[Any, Any]:
    manifest = compare_dir / COMPARE_MANIFEST
    if not manifest.is_file():
        return {}
    data = _load_json(manifest, "compare manifest")
    runs = data.get("runs") if isinstance(data, dict) else None
    return {r.get("dir"): r.get("side") for r in runs or [] if isinstance(r, dict)}


def compare_side(run_dir: Path) -> str | None:
    """"A" or "B" when ``run_dir`` belongs to an ``optbench compare`` output dir (its manifest)."""
    return _sides(run_dir.parent).get(run_dir.name)


def load_runs(paths: list[Path]) -> list[Run]:
    seen: dict[Path, Run] = {}
    shared, sides = Shared(), _Sides()
    for path in paths:
        done, unfinished = find_run_dirs(path)
        # run_dir.resolve(): the walk below a dir follows no link, so its dirs are below the dir's real
        # place and one resolve per path does (not one per run)
        base = path.resolve() if path.is_dir() else None
        for run_dir, loader in [(d, load_run) for d in done] + [(d, load_unfinished_run) for d in unfinished]:
            key = base / run_dir.relative_to(path) if base is not None else run_dir.resolve()
            if key not in seen:
                seen[key] = loader(run_dir, shared)
                seen[key].side, seen[key].real = sides.side(run_dir), key
    runs = sorted(seen.values(), key=Run.sort_key)
    if runs and all(r.status == "unreadable" for r in runs):
        raise ReportError(str(runs[0].error) + ("" if len(runs) == 1 else f" (and {len(runs) - 1} more: no run "
                                                                         "below the given paths can be read)"))
    return runs
