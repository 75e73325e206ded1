"""``optbench data captions DATA.nc PAIRS.jsonl``: text computed from the climate fields themselves.

Real users pair their NetCDF data with their own text (weather bulletins, reports). For tests,
demos and the fusion benchmark this writes one caption per time step, computed exactly from the
fields (``optbench.data.facts``), so that the text is predictable from what the model is shown
and a fused model can be checked for reading it. On a regional grid (the UK, ``t2m`` only) a
caption reads like

    Area 49-61N 11W-2E. Mean 7.8 C, 1.2 K above normal, warming 0.4 K in 6 h. Northwest 6.1 C,
    northeast 7.0 C, southwest 9.2 C, southeast 8.8 C. At 52.2N 1.0W 8.3 C, at 58.2N 4.0W 5.9 C.

and on a global grid it begins "Global mean ...", names latitude bands and quadrants and says the
mean surface pressure, wind and humidity where the file has them.

``--mode describe`` (the default) captions what the model sees: the text of time t is paired with
the sample whose *last input step* is t, and its trend spans the ``--history`` window.
``--mode forecast`` captions what comes next: the text of time t is paired with the sample whose
*target* is t, and its trend is the change from the last input step to it. Anomalies are against
the climatology of the *training* steps only (``--eval-fraction`` says where the eval split
starts, as ``data.eval_fraction``), so no eval step informs a training text.

Without ``--variables`` the roles the file has (temperature, pressure, humidity, winds) are
described and the others left out; ``--variables`` names them (names or roles) explicitly.

The file format (what ``data.text`` reads) is JSON lines, one object per line:
``{"time": "2000-01-01T06:00:00", "text": "..."}``; ``time`` is an ISO 8601 date-time equal to one
of the time coordinates of the NetCDF data (or the integer step index for files without a time
coordinate). Any such file works (a user's own texts); ``optbench data captions`` also writes a
sidecar ``PAIRS.jsonl.json`` (``CaptionSpec``: mode, history, eval fraction, variables) that the
task reads to pair each text with its sample, and that ``optbench generate`` reads to score the
numbers a model writes. ``--lines`` writes the texts of the *training* steps alone, one per line
(for ``optbench data tokenize``: a ``task=lm`` base that never saw an evaluation text).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from optbench.config import AugmentConfig, NetCDFDataConfig
from optbench.config.roles import PHYSICAL_ROLES
from optbench.data.facts import time_label
from optbench.errors import ConfigError

MODES = ("describe", "forecast")
FORMAT = 1


@dataclass(frozen=True)
class CaptionSpec:
    """How a captions file was written (its sidecar): enough to pair its texts with samples and to
    compute, for any step, the facts its text states."""

    mode: str
    history: int
    eval_fraction: float
    variables: list[str]
    train_steps: int

    def text_offset(self) -> int:
        """The step a sample's text is of, counted from the sample's first step: its last input
        step (describe) or its target (forecast)."""
        return self.history - 1 if self.mode == "describe" else self.history


def sidecar_path(path: str | Path) -> Path:
    return Path(f"{path}.json")


def read_spec(path: str | Path) -> CaptionSpec | None:
    """The sidecar of the captions file ``path`` (None: a file without one, e.g. a user's own)."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
        return CaptionSpec(**{f.name: meta[f.name] for f in dataclasses.fields(CaptionSpec)})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{side} (the sidecar of {path}) cannot be read ({type(exc).__name__}: {exc}); "
                          f"write the captions again with `optbench data captions`, or remove it") from exc


def step_hours(times: np.ndarray) -> float | None:
    if len(times) < 2 or not np.issubdtype(np.asarray(times).dtype, np.datetime64):
        return None
    return float(np.median(np.diff(times)) / np.timedelta64(1, "h"))


def caption_variables(paths: list[str]) -> list[str]:
    """The variables of the files that have a role captions describe (the first of each role)."""
    from optbench.data.netcdf import open_dataset, resolve_paths, role_of

    path = resolve_paths(paths)[0]
    ds = open_dataset(path)
    try:
        found = []
        for role in PHYSICAL_ROLES:
            names = [str(v) for v in ds.data_vars if role_of(str(v), ds[v].attrs, {}) == role and len(ds[v].dims) >= 3]
            found += names[:1]
        have = ", ".join(map(str, ds.data_vars)) or "none"
    finally:
        ds.close()
    if not found:
        raise ConfigError(f"{path} has no variable captions can describe (temperature, pressure, humidity, winds by "
                          f"CF standard_name or name; it has: {have}); name them with --variables NAME ...")
    return found


def open_describer(paths: list[str], *, spec: CaptionSpec, block: int = 64):
    """(layout, source, ``Describer``) for the files ``paths`` as ``spec`` says (the climatology
    of its training steps computed here). The caller closes the source."""
    from optbench.data.facts import Describer
    from optbench.data.netcdf import ClimateSource, build_layout
    from optbench.data.netcdf.climatology import compute_climatology

    cfg = NetCDFDataConfig(paths=list(paths), history=spec.history, variables=list(spec.variables),
                           eval_fraction=spec.eval_fraction, augment=AugmentConfig(enabled=False))
    layout = build_layout(cfg)
    source = ClimateSource(layout, regrid=False)
    climatology = None
    if any(ch.role == "temperature" for ch in layout.channels):
        climatology = compute_climatology(source, train_steps=spec.train_steps, block=block)
    return layout, source, Describer(layout, history=spec.history, mode=spec.mode, climatology=climatology,
                                     step_hours=step_hours(layout.times))


def make_spec(paths: list[str], *, variables: list[str] | None, history: int, mode: str,
              eval_fraction: float) -> CaptionSpec:
    """The spec of new captions: the variables (the file's own without ``variables``), checked
    options, and where the training steps end (``optbench.data.netcdf.split_steps``, as a run of
    ``data.history=history data.eval_fraction=eval_fraction`` splits them)."""
    from optbench.data.netcdf import build_layout, split_steps

    if mode not in MODES:
        raise ConfigError(f"--mode {mode} is not one of {', '.join(MODES)}")
    if history < 1 or not 0.0 < eval_fraction < 1.0:
        raise ConfigError(f"--history {history} --eval-fraction {eval_fraction}: give a history >= 1 and a fraction "
                          "in (0, 1), as data.history and data.eval_fraction")
    names = list(variables) if variables else caption_variables(paths)
    cfg = NetCDFDataConfig(paths=list(paths), history=history, variables=names, eval_fraction=eval_fraction,
                           augment=AugmentConfig(enabled=False))
    layout = build_layout(cfg)
    _, evaluation = split_steps(layout.num_steps, history=history, eval_fraction=eval_fraction,
                                paths=", ".join(str(s.path) for s in layout.files))
    return CaptionSpec(mode=mode, history=history, eval_fraction=eval_fraction,
                       variables=[v.name for v in layout.variables], train_steps=evaluation.first)


def _captions(source, describer, *, num_steps: int, block: int):
    """(step, caption) of every step, reading ``block`` steps at a time (and the steps before a
    block that its first captions' trends reach back to)."""
    back = describer.history
    for lo in range(0, num_steps, block):
        first = max(0, lo - back)
        data = source.read(first, min(num_steps, lo + block))
        for step in range(lo, first + len(data)):
            yield step, describer.caption(data, step - first, step=step)


def write_captions(paths: list[str], out: str | Path, *, variables: list[str] | None = None, history: int = 2,
                   mode: str = "describe", eval_fraction: float = 0.1, block: int = 64,
                   lines: str | Path | None = None) -> dict:
    """Write one caption per time step of the NetCDF ``paths`` to ``out`` (JSON lines) with its
    sidecar and, with ``lines``, the training steps' texts one per line. Each file is written
    atomically; returns counts for the command's message."""
    from optbench.data.tokenizer import refuse_overwriting_inputs
    from optbench.files import write_atomic

    out = Path(out)
    outputs = [out, sidecar_path(out), *([Path(lines)] if lines is not None else [])]
    refuse_overwriting_inputs(outputs, inputs=[Path(p) for p in paths])
    spec = make_spec(paths, variables=variables, history=history, mode=mode, eval_fraction=eval_fraction)
    layout, source, describer = open_describer(paths, spec=spec, block=block)
    try:
        rows = [(step, text) for step, text in _captions(source, describer, num_steps=layout.num_steps, block=block)]
    finally:
        source.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps({"time": time_label(layout.times[s]), "text": t}) + "\n" for s, t in rows))
    meta = {"format": FORMAT, **dataclasses.asdict(spec), "captions": len(rows),
            "lines": str(lines) if lines is not None else None}
    write_atomic(sidecar_path(out), json.dumps(meta, indent=2) + "\n")
    train_texts = [t for s, t in rows if s < spec.train_steps]
    if lines is not None:
        write_atomic(lines, "".join(t + "\n" for t in train_texts))
    lengths = [len(t.encode()) for _, t in rows]
    return {"captions": len(rows), "max_bytes": max(lengths, default=0), "train_texts": len(train_texts),
            "mean_bytes": float(np.mean(lengths)) if lengths else 0.0, "variables": spec.variables}
