"""``optbench validate``: the plan's phase 9 as one command — the baseline snapshot against the fully
optimized configuration that runs on this machine, with the plan's gates.

What it does, and which module does it:

* compose both sides (and every phase, to know which ones this machine can run) and check them with
  ``optbench.compat``'s rules before anything trains; the default candidate is the furthest phase in
  the plan's order that runs here, and every phase that cannot is named with the rule's reason;
* run baseline and candidate (``--all-phases``: also the runnable phases in between) interleaved in
  counterbalanced order, each as its own ``optbench train`` process (``optbench.compare``'s runner),
  into one output directory;
* review them with ``optbench.review`` (pooled repeats, block-bootstrap confidence intervals, loss
  delta, memory ratio, the cumulative phase table) and judge the plan's gates with review's gate
  logic: speedup >= 3.0 with the whole 95% interval, loss delta <= 0.001, memory ratio <= 50/15;
* add what the plan reports and review does not: epoch time per side (samples per epoch from the
  dataset), the projected epoch time on the plan's 2 and 4 GPUs from ``optbench estimate``'s
  throughput model (labelled a projection), and each phase beside the plan's claimed speedup;
* write ``validate.md``/``.csv``/``.json`` and ``validate_phases.png`` next to review's
  ``report.*`` and plots.

Exit status: 0 when every gate holds, 1 when a gate fails or a run did not complete, 2 for bad input
(one line, before anything runs).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from optbench.errors import IncompatibleError
from optbench.report import OneLineParser, add_gate_options
from optbench.review import (
    COMPARE_MANIFEST,
    Comparison,
    Gates,
    Group,
    Report,
    ReportError,
    Variant,
    build_report,
    dig,
    natural_key,
    num,
    parse_override,
    percentile,
)

PLAN = "plan 001 (phases 1-9)"
# The plan's phase 9 gates: "assert speedup >= 3.0", "assert loss_delta < 0.001", and "Memory usage
# safe: <50GB/GPU" against a baseline of "~15GB/GPU": 50/15 as a ratio, so that it means the same at
# any model scale.
PLAN_GATES = Gates(min_speedup=3.0, max_loss_delta=0.001, max_memory_ratio=round(50 / 15, 2))
PLAN_HEADLINE = "5-10x (conservative 3-5x) for phases 1-8"
PROJECTED_WORLD_SIZES = (2, 4)  # the plan's 2-GPU and 4-GPU setups


@dataclass(frozen=True)
class Claim:
    """The plan's expected epoch-time gain of one phase over the previous one, read as a speedup:
    "15-30% faster" is 1.15-1.30x."""

    low: float
    high: float
    text: str


# plan 001, "Success Criteria" of each phase ("Epoch time improves: Expect ...")
PLAN_CLAIMS: dict[int, Claim] = {
    1: Claim(1.15, 1.30, "15-30% faster (7 -> 5-6 min/epoch)"),
    2: Claim(1.30, 1.60, "1.3-1.6x faster (5 -> 3-4 min/epoch)"),
    3: Claim(1.20, 1.30, "20-30% faster (3-4 -> 2.5-3 min/epoch)"),
    4: Claim(1.05, 1.10, "5-10% faster"),
    5: Claim(1.15, 1.25, "15-25% faster despite CPU overhead"),
    6: Claim(1.05, 1.10, "5-10% faster"),
    7: Claim(1.10, 1.20, "10-20% faster"),
    8: Claim(1.05, 1.15, "5-15% faster if FlexAttention used (+3-5% faster optimizer steps)"),
}


def phase_number(name: str | None) -> int | None:
    match = re.match(r"(\d+)", name or "")
    return int(match.group(1)) if match else None


def claim_between(previous: str | None, phase: str | None) -> tuple[float, float] | None:
    """The plan's claimed speedup of ``phase`` over ``previous``: the product of the per-phase claims
    in between (phases sharing a number, like the two phase 7s, count once)."""
    first, last = phase_number(previous), phase_number(phase)
    if first is None or last is None or last <= first:
        return None
    low = high = 1.0
    for number in range(first + 1, last + 1):
        if number not in PLAN_CLAIMS:
            return None
        low, high = low * PLAN_CLAIMS[number].low, high * PLAN_CLAIMS[number].high
    return low, high


def claim_text(span: tuple[float, float] | None) -> str:
    return "-" if span is None else f"{span[0]:.2f}-{span[1]:.2f}x"


# ------------------------------------------------------------------------------ the command line
def build_parser() -> argparse.ArgumentParser:
    from optbench.compare import _repeats
    from optbench.estimate import GPUS

    parser = OneLineParser(
        prog="optbench validate",
        usage="optbench validate [OVERRIDES] [candidate=PHASE|candidate=KEY=VALUE ...] [baseline=...] [options]",
        description="The plan's phase 9: the baseline (phase=0_baseline) against the furthest phase that runs "
                    "here (or candidate=...), interleaved with repeats, judged by the plan's gates. OVERRIDES "
                    "apply to both sides.",
    )
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                        help="train overrides for both sides; candidate=... and baseline=... for one side")
    parser.add_argument("--repeats", type=_repeats, default=3, metavar="N", help="runs of each side (default 3)")
    parser.add_argument("--out", metavar="DIR",
                        help="where the runs and the report go (default outputs/validate/<date>/<time>)")
    parser.add_argument("--all-phases", action="store_true",
                        help="also run every runnable phase between the baseline and the candidate (the full "
                             "cumulative table; costs a run per phase per repeat)")
    parser.add_argument("--project-gpu", choices=sorted(GPUS), default="h100",
                        help="the GPU of the 2- and 4-GPU projection (default h100)")
    parser.add_argument("--project-mfu", type=_fraction, metavar="F",
                        help="MFU the projection assumes (default: the MFU measured on a known GPU, else "
                             "estimate.mfu's 0.4)")
    add_gate_options(parser)
    parser.epilog = (f"gates default to the plan's: --min-speedup {PLAN_GATES.min_speedup:g} --max-loss-delta "
                     f"{PLAN_GATES.max_loss_delta:g} --max-memory-ratio {PLAN_GATES.max_memory_ratio:g}")
    return parser


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"'{text}' must be in (0, 1]")
    return value


def gates_from(args: argparse.Namespace) -> Gates:
    """The plan's gates, each replaced by its option when given."""
    return Gates(
        PLAN_GATES.min_speedup if args.min_speedup is None else args.min_speedup,
        PLAN_GATES.max_loss_delta if args.max_loss_delta is None else args.max_loss_delta,
        PLAN_GATES.max_memory_ratio if args.max_memory_ratio is None else args.max_memory_ratio,
    )


def phase_names() -> list[str]:
    from optbench.config import conf_dir

    return sorted((p.stem for p in (conf_dir() / "phase").glob("*.yaml")), key=natural_key)


def split_overrides(items: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(common, baseline, candidate): ``candidate=X``/``baseline=X`` name one side, the rest both."""
    common, sides = [], {"baseline": [], "candidate": []}
    for item in items:
        key, sep, value = item.partition("=")
        if sep and key in sides:
            if not value:
                raise ReportError(f"{key}= needs a phase or an override, e.g. {key}=phase=6_bf16")
            sides[key].append(value)
        elif parse_override(item)[0] == "phase":
            raise ReportError(f"{item} would set both sides; name the candidate's phase with candidate={item}")
        elif parse_override(item)[0].startswith("hydra."):
            raise ReportError(f"{item}: validate puts every run under --out itself; drop the hydra override")
        else:
            common.append(item)
    return common, sides["baseline"], sides["candidate"]


def side_overrides(spec: list[str], *, what: str, phases: list[str], default_phase: str) -> list[str]:
    """``6_bf16`` or ``phase=6_bf16`` -> ``phase=6_bf16``; other overrides kept; a side without a
    phase builds on ``default_phase``."""
    out = [f"phase={item}" if "=" not in item else item for item in spec]
    chosen = [parse_override(o)[1] for o in out if parse_override(o)[0] == "phase"]
    if len(chosen) > 1:
        raise ReportError(f"{what} names {len(chosen)} phases ({', '.join(chosen)}); give one")
    for name in chosen:
        if name not in phases:
            raise ReportError(f"unknown {what} phase '{name}'; the phases are: {', '.join(phases)}")
    return out if chosen else [f"phase={default_phase}", *out]


# ------------------------------------------------------------------------------- what runs here
@dataclass
class PhaseState:
    name: str
    reasons: list[str]  # empty: it runs on this machine

    @property
    def runnable(self) -> bool:
        return not self.reasons


@dataclass
class Side:
    key: str  # "A" (baseline), "B" (candidate), or "phase-<name>" (--all-phases)
    role: str  # baseline | candidate | intermediate
    overrides: list[str]
    cfg: Any = None  # the composed DictConfig
    config: Any = None  # the typed Config

    @property
    def phase(self) -> str | None:
        found = [parse_override(o)[1] for o in self.overrides if parse_override(o)[0] == "phase"]
        return found[0] if found else None


@dataclass
class Setup:
    common: list[str]
    sides: list[Side]  # baseline first, candidate last
    states: list[PhaseState]
    samples_per_epoch: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> Side:
        return self.sides[0]

    @property
    def candidate(self) -> Side:
        return self.sides[-1]

    def state(self, name: str | None) -> PhaseState | None:
        return next((s for s in self.states if s.name == name), None)


class Composer:
    """``optbench.config.compose`` (as ``optbench train`` composes), typed, once per override list
    (Hydra's compose takes ~0.3 s; the phases and the sides share configs)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, overrides: list[str], *, what: str):
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        from optbench.config import compose, to_config

        key = tuple(overrides)
        try:
            if key not in self._cache:
                cfg = compose(overrides)
                self._cache[key] = cfg, to_config(cfg)
            return self._cache[key]
        except (HydraException, OmegaConfBaseException, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            error = ReportError(f"{what} overrides {' '.join(overrides) or '(none)'}: {first}")
            error.reason = first  # type: ignore[attr-defined]  (a phase's row shows only this)
            raise error from None


def blocking_reasons(config: Any) -> list[str]:
    """What would refuse this config at launch here: compat's preflight (the one check train and
    compare run), with each of its rules' reasons listed apart for the report."""
    from optbench import compat

    machines: list[Any] = []
    try:
        compat.preflight(config, seen=machines.append)
    except IncompatibleError as exc:
        return (compat.blocking_reasons(config, machines[0]) if machines else []) or [str(exc)]
    return []


def phase_states(compose: Composer, common: list[str], phases: list[str]) -> list[PhaseState]:
    states = []
    for name in phases:
        try:
            _cfg, config = compose([f"phase={name}", *common], what=f"phase {name}")
        except ReportError as exc:
            states.append(PhaseState(name, [getattr(exc, "reason", str(exc))]))
            continue
        states.append(PhaseState(name, blocking_reasons(config)))
    return states


def choose_candidate(states: list[PhaseState], baseline_phase: str) -> str:
    """The furthest phase in the plan's order, after the baseline, that runs on this machine."""
    after = [s for s in states if natural_key(s.name) > natural_key(baseline_phase)]
    runnable = [s for s in after if s.runnable]
    if not runnable:
        blocked = "; ".join(f"{s.name}: {s.reasons[0]}" for s in after) or "there are none"
        raise ReportError(f"no phase after {baseline_phase} runs on this machine ({blocked})")
    return runnable[-1].name


def phase_settings(phase: str) -> dict[str, str]:
    """What a phase preset sets, its chain of earlier phases included, read from conf/phase/: group
    choices (``override /compile: default`` -> compile=default) and values (train.batch_size=16)."""
    import yaml

    from optbench.config import conf_dir

    text = (conf_dir() / "phase" / f"{phase}.yaml").read_text()
    node = yaml.safe_load(text) or {}
    settings: dict[str, str] = {}
    for entry in node.pop("defaults", []) or []:
        if isinstance(entry, str) and entry.startswith("/phase/"):
            settings.update(phase_settings(entry.removeprefix("/phase/")))
        elif isinstance(entry, dict):
            for key, value in entry.items():
                settings[key.removeprefix("override ").lstrip("/")] = str(value)

    def flatten(tree: dict, prefix: str = "") -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                flatten(value, f"{prefix}{key}.")
            else:
                settings[f"{prefix}{key}"] = str(value)

    flatten(node)
    return settings


def overridden_phase_settings(common: list[str], phase: str, baseline_phase: str) -> list[str]:
    """Overrides given for both sides that replace what ``phase`` itself changes (``parallel=ddp``
    turns phase 7's FSDP2 into DDP): said, so that nobody reads the row as the plan's phase."""
    own, base = phase_settings(phase), phase_settings(baseline_phase)
    notes = []
    for item in common:
        key, value = parse_override(item)
        if key in own and own[key] != base.get(key):
            notes.append(f"{key}={value} is given for both sides, so phase {phase}'s own change of {key} "
                         f"({base.get(key, '-')} -> {own[key]}) is not measured")
    return notes


def epoch_samples(config: Any) -> int | None:
    """Training samples in one epoch of the configured data (the task's own train dataset)."""
    from optbench.tasks import build_task

    train, _eval = build_task(config).build_datasets()
    try:
        return len(train)
    except TypeError:  # a streaming dataset (data=netcdf) knows its split
        return num(getattr(getattr(train, "split", None), "num_samples", None))


def prepare(argv_overrides: list[str], *, all_phases: bool) -> Setup:
    """Everything that can be refused is refused here, before anything trains."""
    from optbench.compare import check_same_experiment

    common, base_spec, cand_spec = split_overrides(argv_overrides)
    phases = phase_names()
    base_overrides = side_overrides(base_spec, what="baseline", phases=phases, default_phase="0_baseline")
    base_phase = Side("A", "baseline", base_overrides).phase
    cand_known = side_overrides(cand_spec, what="candidate", phases=phases, default_phase=base_phase) if cand_spec else None
    compose = Composer()
    baseline = Side("A", "baseline", [*base_overrides, *common])
    baseline.cfg, baseline.config = compose(baseline.overrides, what="baseline")
    if reasons := blocking_reasons(baseline.config):
        raise ReportError(f"the baseline ({' '.join(base_overrides)}) cannot run on this machine: {reasons[0]}")
    states = None
    if cand_known is None:  # the furthest phase that runs here
        states = phase_states(compose, common, phases)
        cand_known = [f"phase={choose_candidate(states, base_phase)}"]
    candidate = Side("B", "candidate", [*cand_known, *common])
    candidate.cfg, candidate.config = compose(candidate.overrides, what="candidate")
    _refuse_identical(baseline, candidate)
    if reasons := blocking_reasons(candidate.config):
        raise ReportError(f"candidate {' '.join(cand_known)} cannot run on this machine, so it cannot be "
                          f"validated here: {'; '.join(reasons)} (without candidate=, optbench validate "
                          "picks the furthest phase that runs here)")
    check_same_experiment(baseline.cfg, candidate.cfg)
    states = states or phase_states(compose, common, phases)
    sides = [baseline]
    if all_phases:
        sides += intermediate_sides(compose, common, states, base_phase, candidate)
    sides.append(candidate)
    notes = []
    for side in sides[1:]:
        if side.phase and side.phase != base_phase:
            notes += overridden_phase_settings(common, side.phase, base_phase)
    return Setup(common, sides, states, epoch_samples(baseline.config), notes)


def _refuse_identical(baseline: Side, candidate: Side) -> None:
    from omegaconf import OmegaConf

    a = OmegaConf.to_container(baseline.cfg, resolve=True)
    b = OmegaConf.to_container(candidate.cfg, resolve=True)
    if a == b:
        raise ReportError(
            f"the candidate ({' '.join(candidate.overrides)}) resolves to the same config as the baseline "
            f"({' '.join(baseline.overrides)}): nothing to validate; name another candidate=PHASE"
        )


def intermediate_sides(compose: Composer, common: list[str], states: list[PhaseState], base_phase: str,
                       candidate: Side) -> list[Side]:
    if candidate.phase is None or candidate.phase == base_phase:
        raise ReportError("--all-phases needs a candidate phase after the baseline's (candidate=PHASE)")
    low, high = natural_key(base_phase), natural_key(candidate.phase)
    sides = []
    for state in states:
        if state.runnable and low < natural_key(state.name) < high:
            side = Side(f"phase-{state.name}", "intermediate", [f"phase={state.name}", *common])
            side.cfg, side.config = compose(side.overrides, what=f"phase {state.name}")
            sides.append(side)
    return sides


# ------------------------------------------------------------------------------------- results
def find_variants(report: Report) -> tuple[Group, Variant, Variant]:
    """The group holding side A, its baseline and the candidate (side B)."""
    for group in report.groups:
        sided = {v.first.side: v for v in group.variants if v.first.side}
        if "A" in sided and "B" in sided:
            return group, sided["A"], sided["B"]
    raise ReportError(f"{report.root}: no baseline (A) and candidate (B) runs of one model and task to compare")


def epoch_time(setup_side: Side | None, variant: Variant, samples_per_epoch: int | None) -> dict[str, Any] | None:
    """Seconds for one epoch at the measured throughput (and its 95% interval from the bootstrap)."""
    tp = variant.throughput
    if tp is None or not samples_per_epoch:
        return None
    samples_per_step = _samples_per_step(setup_side, variant)
    if not samples_per_step:
        return None
    tokens_per_sample = round(tp.tokens_per_step / samples_per_step, 6)  # tokens/s x median: float noise
    seconds = samples_per_epoch * tokens_per_sample / tp.tokens_per_s
    interval = None
    if variant.boot is not None:
        interval = (samples_per_epoch * tokens_per_sample / percentile(variant.boot, 97.5),
                    samples_per_epoch * tokens_per_sample / percentile(variant.boot, 2.5))
    return {"seconds": seconds, "ci_low": interval[0] if interval else None,
            "ci_high": interval[1] if interval else None, "samples_per_epoch": samples_per_epoch,
            "tokens_per_sample": tokens_per_sample}


def _samples_per_step(side: Side | None, variant: Variant) -> int | None:
    """batch_size x grad_accum x world size of the run (its resolved config and summary)."""
    summary = variant.first.summary
    train = (summary.get("config") or {}).get("train") or {}
    batch, accum = num(train.get("batch_size")), num(train.get("grad_accum"))
    if (batch is None or accum is None) and side is not None and side.config is not None:
        batch, accum = side.config.train.batch_size, side.config.train.grad_accum
    world = num(summary.get("world_size")) or 1
    return int(batch * accum * world) if batch and accum else None


def projection(side: Side, variant: Variant, *, samples_per_epoch: int | None, gpu: str,
               mfu: float | None) -> list[dict[str, Any]]:
    """Epoch time on the plan's 2 and 4 GPUs from ``optbench estimate``'s throughput model:
    tokens/s per GPU = MFU x the GPU's dense datasheet peak for the dtype / FLOPs per token,
    linear in the number of GPUs (no communication modeled). MFU: ``mfu`` if given, else the one
    measured here on a known GPU, else estimate.mfu (an assumption, and said to be one)."""
    from optbench.estimate import count_model, throughput

    if side.config is None:
        return []
    measured = variant.mean_of("throughput.mfu")
    source = str(dig(variant.first.summary, "throughput.peak_source") or "")
    if mfu is not None:
        used, how = mfu, "given (--project-mfu)"
    elif measured is not None and source.startswith("datasheet"):
        used, how = measured, f"measured here ({source})"
    else:
        used, how = side.config.estimate.mfu, "assumed (estimate.mfu; nothing measured here predicts a GPU's MFU)"
    config = replace(side.config, estimate=replace(side.config.estimate, gpu=gpu, mfu=used))
    counts = count_model(config)
    rows = []
    for world_size in PROJECTED_WORLD_SIZES:
        model = throughput(config, counts=counts, world_size=world_size)
        if model is None:
            continue
        tokens_per_s = model["tokens_per_s_job"]
        rows.append({
            "world_size": world_size, "gpu": gpu, "mfu": used, "mfu_source": how, "peak_source": model["peak_source"],
            "tokens_per_s": tokens_per_s,
            "epoch_s": samples_per_epoch * counts.seq_len / tokens_per_s if samples_per_epoch else None,
        })
    return rows


def side_summary(side: Side | None, variant: Variant, setup: Setup, args: argparse.Namespace | None) -> dict[str, Any]:
    tp = variant.throughput
    return {
        "role": side.role if side else None, "overrides": side.overrides if side else variant.first.overrides,
        "label": variant.label, "status": variant.status, "reason": variant.reason,
        "runs": len(variant.runs), "completed": len(variant.completed),
        "tokens_per_s": tp.tokens_per_s if tp else None,
        "step_time_s": {"median": tp.median, "p10": tp.p10, "p90": tp.p90} if tp else None,
        "epoch": epoch_time(side, variant, setup.samples_per_epoch),
        "mfu": variant.mean_of("throughput.mfu"),
        "peak_source": dig(variant.first.summary, "throughput.peak_source"),
        "peak_bytes": variant.peak_memory(),
        "loss": dict(zip(("value", "kind"), variant.loss(), strict=True)),
        "projection": (projection(side, variant, samples_per_epoch=setup.samples_per_epoch,
                                  gpu=args.project_gpu if args else "h100",
                                  mfu=args.project_mfu if args else None)
                       if side is not None and variant.completed else []),
    }


def phase_table(setup: Setup, group: Group, baseline: Variant, candidate: Variant) -> list[dict[str, Any]]:
    """Every phase of the plan: what happened to it here, beside the plan's claims (a candidate that
    is not a phase of its own gets a row after its baseline's)."""
    measured = {row.phase: row for row in group.phases}
    base_phase, cand_phase = setup.baseline.phase, setup.candidate.phase
    ran = {base_phase: setup.baseline}
    ran.update({side.phase: side for side in setup.sides[1:] if side.phase and side.phase != base_phase})
    rows = []
    for state in setup.states:
        name = state.name
        row = _phase_row(name, claim_between(base_phase, name))
        if name in ran:
            side = ran[name]
            found = measured.get(name)
            variant = {"baseline": baseline, "candidate": candidate}.get(side.role, found.variant if found else None)
            _fill(row, side.role, variant, group)
            if side.role != "baseline" and row["vs_baseline"]:
                previous = found.previous if found is not None and found.vs_previous is not None else base_phase
                row["previous"] = previous
                row["vs_previous"] = found.vs_previous.to_dict() if previous != base_phase else row["vs_baseline"]
                row["claim_span"] = claim_between(previous, name)
        elif not state.runnable:
            row["here"] = "blocked: " + "; ".join(_gist(r) for r in state.reasons)
        elif cand_phase != base_phase and natural_key(base_phase or "") < natural_key(name) < natural_key(cand_phase or ""):
            row["here"] = "runs here, not run (--all-phases runs it)"
        elif natural_key(name) < natural_key(base_phase or ""):
            row["here"] = "before the baseline"
        else:
            row["here"] = "runs here; after the candidate"
        rows.append(row)
        if name == base_phase and cand_phase == base_phase:  # candidate=KEY=VALUE on the baseline's phase
            own = [o for o in setup.candidate.overrides if o not in setup.common and parse_override(o)[0] != "phase"]
            extra = _phase_row(f"{base_phase} + {' '.join(own)}", None)
            _fill(extra, "candidate", candidate, group)
            extra.update(previous=base_phase, vs_previous=extra["vs_baseline"], claim_vs_previous=None)
            rows.append(extra)
    return rows


def _phase_row(name: str, claim_vs_baseline: tuple[float, float] | None) -> dict[str, Any]:
    number = phase_number(name)
    return {"phase": name, "claim_vs_previous": PLAN_CLAIMS[number].text if number in PLAN_CLAIMS else None,
            "claim_vs_baseline": claim_vs_baseline, "here": None, "status": None, "previous": None,
            "vs_previous": None, "claim_span": None, "vs_baseline": None, "tokens_per_s": None, "peak_bytes": None}


def _fill(row: dict[str, Any], role: str, variant: Variant | None, group: Group) -> None:
    row["here"] = role
    if variant is None:
        return
    row.update(status=variant.status, peak_bytes=variant.peak_memory(),
               tokens_per_s=variant.throughput.tokens_per_s if variant.throughput else None)
    comparison = group.comparisons.get(variant.key)
    if role != "baseline" and comparison is not None:
        row["vs_baseline"] = comparison.to_dict()


def _gist(reason: str) -> str:
    """The blocking option's clause of a compat reason (the whole reason is listed under Skipped)."""
    return re.split(r"[:;]", reason, maxsplit=1)[0].strip()


def verdict(report: Report, candidate: Variant, baseline: Variant, codes: list[int]) -> tuple[bool, list[str]]:
    """Validated only when every gate holds and every run of both sides completed."""
    why = [f"gate failed: {g.message}" for g in report.gate_results if not g.ok]
    for variant, role in ((baseline, "baseline"), (candidate, "candidate")):
        if len(variant.completed) < len(variant.runs):
            why.append(f"{role} {variant.label}: {len(variant.runs) - len(variant.completed)} of {len(variant.runs)} "
                       f"runs did not complete ({variant.reason})")
    if not report.gate_results:
        why.append("no gate was judged")
    if any(codes) and not why:
        why.append("a run exited with an error (see its console.log)")
    return not why, why


def assemble(report: Report, setup: Setup, *, args: argparse.Namespace | None = None,
             codes: list[int] | None = None, command: str = "") -> dict[str, Any]:
    """The validation as a JSON-able dict: sides, gates, verdict, the phase table, the machine."""
    group, baseline, candidate = find_variants(report)
    by_key = {"A": setup.baseline, "B": setup.candidate}
    ok, why = verdict(report, candidate, baseline, codes or [])
    comparison: Comparison | None = group.comparisons.get(candidate.key)
    first = baseline.first.summary
    blocked = [{"phase": s.name, "reasons": s.reasons} for s in setup.states if not s.runnable]
    return {
        "validated": ok, "why_not": why, "command": command, "plan": PLAN, "plan_headline": PLAN_HEADLINE,
        "plan_claims_multiply_to": claim_between("0", "8"),
        "machine": {"device": first.get("device"), "world_size": first.get("world_size"),
                    "versions": first.get("versions")},
        "model": group.name, "task": group.task, "params": group.params(),
        "samples_per_epoch": setup.samples_per_epoch, "common_overrides": setup.common,
        "baseline": side_summary(by_key["A"], baseline, setup, args),
        "candidate": side_summary(by_key["B"], candidate, setup, args),
        "comparison": comparison.to_dict() if comparison else None,
        "gates": [g.to_dict() for g in report.gate_results],
        "phases": phase_table(setup, group, baseline, candidate),
        "skipped": blocked, "notes": setup.notes,
    }


# ------------------------------------------------------------------------------------ rendering
def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _bytes(n: float | None) -> str:
    from optbench.report_format import human_bytes

    return human_bytes(n)


def _speedup(c: dict[str, Any] | None) -> str:
    if not c or c.get("speedup") is None:
        return "-"
    if c.get("ci_low") is None:
        return f"{c['speedup']:.2f}x ({c.get('verdict')})"
    return f"{c['speedup']:.2f}x [{c['ci_low']:.2f}-{c['ci_high']:.2f}] {c['verdict']}"


def _epoch(e: dict[str, Any] | None) -> str:
    if not e:
        return "-"
    if e.get("ci_low") is None:
        return _duration(e["seconds"])
    return f"{_duration(e['seconds'])} [{_duration(e['ci_low'])}-{_duration(e['ci_high'])}]"


def _table(header: list[str], rows: list[list[str]]) -> str:
    from optbench.report_format import markdown_table

    return markdown_table(header, rows)


def render_markdown(result: dict[str, Any]) -> str:
    base, cand = result["baseline"], result["candidate"]
    machine = result["machine"]
    versions = machine.get("versions") or {}
    lines = [
        f"# Phase 9 validation: {'VALIDATED' if result['validated'] else 'NOT VALIDATED'}",
        "",
        f"- command: `{result['command']}`" if result["command"] else "",
        f"- machine: {machine.get('device')}, world size {machine.get('world_size')}; torch {versions.get('torch')}"
        + (f", CUDA {versions['cuda']}" if versions.get("cuda") else ""),
        f"- model {result['model']} ({result['params']:,} params), task {result['task']}"
        if result.get("params") else f"- model {result['model']}, task {result['task']}",
        f"- baseline: `{' '.join(base['overrides'])}`",
        f"- candidate: `{' '.join(cand['overrides'])}`",
    ]
    lines = [line for line in lines if line]
    if not result["validated"]:
        lines += ["", "Not validated:"] + [f"- {why}" for why in result["why_not"]]
    lines += ["", "## Gates (the plan's phase 9)", ""]
    lines.append(_table(["gate", "threshold", "value", "result", "detail"], [
        [g["gate"], f"{g['threshold']:g}", "-" if g["value"] is None else f"{g['value']:.4g}",
         "pass" if g["ok"] else "FAIL", g["message"]] for g in result["gates"]]))
    lines += ["", "## Baseline vs candidate", ""]
    header = ["", "baseline", "candidate"]
    rows = [
        ["runs completed", f"{base['completed']}/{base['runs']}", f"{cand['completed']}/{cand['runs']}"],
        ["tokens/s", _num(base["tokens_per_s"]), _num(cand["tokens_per_s"])],
        ["step time median [p10-p90]", _step(base), _step(cand)],
        [f"epoch time [95% CI] ({_count(result['samples_per_epoch'])} samples)", _epoch(base["epoch"]),
         _epoch(cand["epoch"])],
        ["MFU", _pct(base["mfu"]), _pct(cand["mfu"])],
        ["peak memory", _bytes(base["peak_bytes"]), _bytes(cand["peak_bytes"])],
        ["loss", _loss(base["loss"]), _loss(cand["loss"])],
        ["speedup [95% CI]", "1.00x", _speedup(result["comparison"])],
    ]
    for index, world in enumerate(PROJECTED_WORLD_SIZES):
        b = base["projection"][index] if len(base["projection"]) > index else None
        c = cand["projection"][index] if len(cand["projection"]) > index else None
        label = f"PROJECTION, not measured: epoch on {world}x {(b or c or {}).get('gpu', '?').upper()}"
        rows.append([label, _proj(b), _proj(c)])
    lines.append(_table(header, rows))
    proj = cand["projection"][0] if cand["projection"] else base["projection"][0] if base["projection"] else None
    if proj:
        lines += ["", f"Projection: `optbench estimate`'s throughput model — tokens/s per GPU = MFU x "
                      f"{proj['gpu'].upper()} dense datasheet peak for the dtype / FLOPs per token, linear in the "
                      f"number of GPUs, no communication modeled; MFU {proj['mfu_source']}. It is not a "
                      f"measurement: with an assumed MFU the two sides differ only by their dtype's peak."]
    lines += ["", "## Phases beside the plan's claims", "",
              f"The plan claims {PLAN_HEADLINE}; its per-phase claims multiply to "
              f"{claim_text(result['plan_claims_multiply_to'])}. A claim \"X% faster\" is read as a speedup of 1+X.",
              ""]
    lines.append(_table(
        ["phase", "here", "plan: vs previous phase", "measured vs previous run [95% CI]", "plan over that span",
         "measured vs baseline [95% CI]", "plan vs baseline", "tokens/s", "peak memory"],
        [[r["phase"], r["here"] or "-", r["claim_vs_previous"] or "-",
          (f"{_speedup(r['vs_previous'])} (vs {r['previous']})" if r["vs_previous"] else "-"),
          claim_text(r["claim_span"]), _speedup(r["vs_baseline"]), claim_text(r["claim_vs_baseline"]),
          _num(r["tokens_per_s"]), _bytes(r["peak_bytes"]) if r["peak_bytes"] else "-"] for r in result["phases"]]))
    if result["skipped"]:
        lines += ["", "## Skipped: cannot run on this machine (compatibility check)", ""]
        lines += [f"- {s['phase']}: {'; '.join(s['reasons'])}" for s in result["skipped"]]
    if result["notes"]:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in result["notes"]]
    lines += ["", "Statistics, per-run tables and plots: [report.md](report.md). "
                  "Cumulative speedup per phase beside the plan's: ![validate_phases.png](validate_phases.png)", ""]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _count(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _step(side: dict[str, Any]) -> str:
    s = side["step_time_s"]
    return "-" if not s else f"{s['median']:.4f} s [{s['p10']:.4f}-{s['p90']:.4f}]"


def _loss(loss: dict[str, Any]) -> str:
    return "-" if loss["value"] is None else f"{loss['value']:.5f} ({loss['kind']})"


def _proj(p: dict[str, Any] | None) -> str:
    if not p:
        return "-"
    return f"{_duration(p['epoch_s'])} ({_num(p['tokens_per_s'])} tokens/s at {p['mfu']:.0%} MFU)"


CSV_FIELDS = ("phase", "here", "claim_vs_previous", "previous", "speedup_vs_previous", "ci_low_vs_previous",
              "ci_high_vs_previous", "claim_span_low", "claim_span_high", "speedup_vs_baseline", "ci_low_vs_baseline",
              "ci_high_vs_baseline", "claim_vs_baseline_low", "claim_vs_baseline_high", "tokens_per_s", "peak_bytes")


def render_csv(result: dict[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for r in result["phases"]:
        prev, base = r["vs_previous"] or {}, r["vs_baseline"] or {}
        span, total = r["claim_span"] or (None, None), r["claim_vs_baseline"] or (None, None)
        row = {"phase": r["phase"], "here": r["here"], "claim_vs_previous": r["claim_vs_previous"],
               "previous": r["previous"], "speedup_vs_previous": prev.get("speedup"),
               "ci_low_vs_previous": prev.get("ci_low"), "ci_high_vs_previous": prev.get("ci_high"),
               "claim_span_low": span[0], "claim_span_high": span[1], "speedup_vs_baseline": base.get("speedup"),
               "ci_low_vs_baseline": base.get("ci_low"), "ci_high_vs_baseline": base.get("ci_high"),
               "claim_vs_baseline_low": total[0], "claim_vs_baseline_high": total[1],
               "tokens_per_s": r["tokens_per_s"], "peak_bytes": r["peak_bytes"]}
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def plot_phases(result: dict[str, Any], path: Path) -> Path:
    """Measured cumulative speedup of each phase that ran (with its 95% interval) beside the plan's
    claimed range over the same baseline, and the speedup gate."""
    from matplotlib.figure import Figure

    from optbench.plots import _empty, _save

    rows = [r for r in result["phases"] if r["vs_baseline"] and r["vs_baseline"].get("speedup") is not None]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    if not rows:
        _empty(ax, "no phase after the baseline completed")
        return _save(fig, path)
    xs = range(len(rows))
    for x, r in zip(xs, rows, strict=True):
        c = r["vs_baseline"]
        if c.get("ci_low") is not None:
            ax.errorbar([x], [c["speedup"]], yerr=[[c["speedup"] - c["ci_low"]], [c["ci_high"] - c["speedup"]]],
                        fmt="o", color="tab:blue", capsize=4, label="measured (95% CI)" if x == 0 else None)
        else:
            ax.plot([x], [c["speedup"]], "o", color="tab:blue", label="measured (no interval)" if x == 0 else None)
        if r["claim_vs_baseline"]:
            low, high = r["claim_vs_baseline"]
            ax.bar([x], [high - low], bottom=[low], width=0.4, color="tab:orange", alpha=0.35,
                   label="the plan's claim" if x == 0 else None)
    gate = next((g["threshold"] for g in result["gates"] if g["gate"] == "min-speedup"), None)
    if gate is not None:
        ax.axhline(gate, color="tab:red", linestyle="--", linewidth=1, label=f"gate {gate:g}x")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(list(xs), [r["phase"] for r in rows], rotation=20, ha="right")
    ax.set_xlim(-0.7, len(rows) - 0.3)
    ax.set_ylabel("speedup vs the baseline (tokens/s ratio)")
    ax.set_title(f"cumulative speedup: {result['machine'].get('device')}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


VALIDATE_FILES = ("validate.md", "validate.csv", "validate.json", "validate_phases.png")


def write_validation(result: dict[str, Any], out: Path, *, plots: bool) -> list[Path]:
    from optbench.outputs import write_json_atomic

    try:
        (out / "validate.md").write_text(render_markdown(result))
        (out / "validate.csv").write_text(render_csv(result))
        write_json_atomic(out / "validate.json", result)
        written = [out / name for name in VALIDATE_FILES[:3]]
        if plots:
            written.append(plot_phases(result, out / "validate_phases.png"))
    except OSError as exc:
        raise ReportError(f"cannot write the validation into {out}: {exc.strerror}; choose another --out") from None
    return written


# ---------------------------------------------------------------------------------------- main
def default_out() -> Path:
    return Path("outputs") / "validate" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def run_sides(setup: Setup, out: Path, repeats: int) -> list[int]:
    """compare's runner: counterbalanced order, each run its own ``optbench train`` process; the
    manifest tells review (and a later ``optbench report``) which run is the baseline (A) and the
    candidate (B)."""
    from optbench.compare import run_all, run_order
    from optbench.outputs import write_json_atomic

    keys = [side.key for side in setup.sides]
    order = run_order(repeats, sides=tuple(keys))
    write_json_atomic(out / COMPARE_MANIFEST, {
        "a": setup.baseline.overrides, "b": setup.candidate.overrides, "repeats": repeats, "validate": True,
        "runs": [{"dir": f"{i}_{key}", "side": key if key in ("A", "B") else None} for i, key in enumerate(order)],
    })
    return run_all(out, order, {side.key: side.overrides for side in setup.sides})


def main(argv: list[str]) -> None:
    from optbench.compare import prepare_out
    from optbench.report_format import write_outputs

    args = build_parser().parse_intermixed_args(argv)
    gates = gates_from(args)
    setup = prepare(args.overrides, all_phases=args.all_phases)
    candidate = setup.candidate
    blocked = [s for s in setup.states if not s.runnable]
    print(f"optbench validate: baseline {' '.join(setup.baseline.overrides)}", flush=True)
    print(f"                   candidate {' '.join(candidate.overrides)}", flush=True)
    for state in blocked:
        print(f"  skipped {state.name}: {state.reasons[0]}", flush=True)
    for note in setup.notes:
        print(f"  note: {note}", flush=True)
    out = Path(args.out) if args.out else default_out()
    prepare_out(out)
    try:
        codes = run_sides(setup, out, args.repeats)
    except KeyboardInterrupt:
        print(f"optbench: validate interrupted; the runs so far are in {out}", file=sys.stderr)
        raise SystemExit(130) from None
    selector = [f"phase={candidate.phase}"] if candidate.phase and candidate.phase != setup.baseline.phase else None
    report = build_report([out], candidate=selector, gates=gates)
    written = write_outputs(report, out, plots=not args.no_plots)
    command = " ".join(["optbench validate", *argv])
    result = assemble(report, setup, args=args, codes=codes, command=command)
    written += write_validation(result, out, plots=not args.no_plots)
    text = {"json": json.dumps(result, indent=2, default=str) + "\n", "csv": render_csv(result)}.get(
        args.format, render_markdown(result) + "\n")
    sys.stdout.write(text)
    sys.stdout.flush()
    print(f"optbench: validation written to {out} ({', '.join(p.name for p in written)})", file=sys.stderr)
    for why in result["why_not"]:
        print(f"optbench: {why}", file=sys.stderr)
    print(f"optbench: {'VALIDATED' if result['validated'] else 'NOT VALIDATED'}: {candidate.overrides[0]} vs "
          f"{setup.baseline.overrides[0]}", file=sys.stderr)
    raise SystemExit(0 if result["validated"] else 1)
