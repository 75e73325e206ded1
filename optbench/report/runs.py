"""Run directories as ``optbench report`` reads them: ``summary.json`` (the typed record
``optbench.summary.RunSummary``, of any schema version), ``metrics.jsonl`` and
``.hydra/overrides.yaml``. A summary that cannot be read makes the run ``unreadable`` (listed with
the reader's one line, never dropped silently); a torn last line of ``metrics.jsonl`` is skipped and
noted."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from optbench.config.renames import new_option, upgrade_config, upgrade_overrides
from optbench.errors import ConfigError, ReportError
from optbench.files import parse_jsonl, timestamp
from optbench.outputs import config_hash
from optbench.summary import RunSummary, SummaryError, read_run_summary

COMPARE_MANIFEST = "compare.json"


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
    metrics: list[dict[str, Any]]
    overrides: list[str]
    side: str | None = None  # "A" or "B" in an optbench compare dir
    notes: list[str] = field(default_factory=list)  # what the reader skipped (a torn metrics line)

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


def _load_metrics(run_dir: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The run's metrics records; a torn last line is skipped and a corrupt file left out, each
    with a note (the summary's numbers do not depend on them)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []  # a run that failed before training has none
    try:
        records, torn = parse_jsonl(path)
    except ConfigError as exc:
        notes.append(f"{exc}: its loss curve is not drawn")
        return []
    except OSError as exc:
        notes.append(f"cannot read {path}: {exc.strerror}: its loss curve is not drawn")
        return []
    if torn:
        notes.append(torn)
    return records


def _load_overrides(run_dir: Path, summary: RunSummary) -> list[str]:
    """Hydra's own record (.hydra/overrides.yaml) when present, else the summary's copy, under the
    current config names (a run written before a rename reads as one written after it)."""
    return upgrade_overrides(_recorded_overrides(run_dir, summary))[0]


def _recorded_overrides(run_dir: Path, summary: RunSummary) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if path.is_file():
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            raise ReportError(f"{path} is not valid YAML: truncated or corrupt") from None
        if isinstance(loaded, list):
            return [str(o) for o in loaded]
    overrides = summary.overrides
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def load_run(run_dir: Path) -> Run:
    """The run in ``run_dir``; one whose summary cannot be read is a Run with status ``unreadable``."""
    try:
        summary = read_run_summary(run_dir)
    except SummaryError as exc:
        return _unreadable_run(run_dir, str(exc))
    notes: list[str] = []
    try:
        overrides = _load_overrides(run_dir, summary)
    except ReportError as exc:
        notes.append(str(exc))
        overrides = upgrade_overrides([str(o) for o in summary.overrides or []])[0]
    upgraded = upgrade_config(summary.config)
    if upgraded != summary.config:  # written before a rename: read as if written after it, so it
        summary.set_config(upgraded, config_hash(upgraded))  # pools with today's
    summary.model.name = new_option("model", summary.model.name)
    return Run(run_dir, summary, _load_metrics(run_dir, notes), overrides, notes=notes)


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
    return Run(run_dir, summary, [], overrides)


def load_unfinished_run(run_dir: Path) -> Run:
    """A Hydra job dir without summary.json: the process was killed (out of memory, a signal) or is
    still running. Listed with that reason; its composed config comes from .hydra/config.yaml."""
    config = _hydra_config(run_dir)
    started = timestamp((run_dir / ".hydra").stat().st_mtime)
    summary = _placeholder("no summary", "no summary.json: the run was killed (out of memory? a signal?) or is "
                           "still running", config=config, started_at=started)
    return Run(run_dir, summary, [], _load_overrides(run_dir, summary))


def _hydra_config(run_dir: Path) -> dict[str, Any] | None:
    config_path = run_dir / ".hydra" / "config.yaml"
    try:
        config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
    except (yaml.YAMLError, OSError):
        config = None
    return upgrade_config(config) if isinstance(config, dict) else None


def find_run_dirs(path: Path) -> tuple[list[Path], list[Path]]:
    """(dirs with a summary.json, Hydra job dirs without one) below ``path``."""
    if not path.exists():
        raise ReportError(f"{path} does not exist")
    if path.is_file():
        if path.name != "summary.json":
            raise ReportError(f"{path} is a file; give a run dir, a sweep dir or an outputs dir")
        return [path.parent], []
    done = {p.parent for p in path.rglob("summary.json")}
    unfinished = {p.parent.parent for p in path.rglob(".hydra/overrides.yaml")} - done
    if not done and not unfinished:
        raise ReportError(
            f"no runs under {path}: no summary.json found (give a run dir, a sweep dir or outputs/)"
        )
    return sorted(done), sorted(unfinished)


def compare_side(run_dir: Path) -> str | None:
    """"A" or "B" when ``run_dir`` belongs to an ``optbench compare`` output dir (its manifest)."""
    manifest = run_dir.parent / COMPARE_MANIFEST
    if not manifest.is_file():
        return None
    data = _load_json(manifest, "compare manifest")
    runs = data.get("runs") if isinstance(data, dict) else None
    sides = {r.get("dir"): r.get("side") for r in runs or [] if isinstance(r, dict)}
    return sides.get(run_dir.name)


def load_runs(paths: list[Path]) -> list[Run]:
    seen: dict[Path, Run] = {}
    for path in paths:
        done, unfinished = find_run_dirs(path)
        for run_dir, loader in [(d, load_run) for d in done] + [(d, load_unfinished_run) for d in unfinished]:
            key = run_dir.resolve()
            if key not in seen:
                seen[key] = loader(run_dir)
                seen[key].side = compare_side(run_dir)
    runs = sorted(seen.values(), key=Run.sort_key)
    if runs and all(r.status == "unreadable" for r in runs):
        raise ReportError(str(runs[0].error) + ("" if len(runs) == 1 else f" (and {len(runs) - 1} more: no run "
                                                                         "below the given paths can be read)"))
    return runs
