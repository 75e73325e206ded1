"""The plan's phase 9 as data (``optbench validate``'s API): which runs are the baseline and the
candidate, epoch times and the projection to the plan's GPUs, the phase table beside the plan's
claims, the verdict, and the runs themselves (``run_sides``: compare's runner)."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from optbench.errors import ReportError
from optbench.report.analysis import Comparison, Group, Report
from optbench.report.runs import COMPARE_MANIFEST, natural_key, num, parse_override
from optbench.report.stats import percentile
from optbench.report.variants import Variant
from optbench.validate.claims import (
    PLAN,
    PLAN_CLAIMS,
    PLAN_HEADLINE,
    PROJECTED_WORLD_SIZES,
    claim_between,
    phase_number,
)
from optbench.validate.setup import (
    Setup,
    Side,
)


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
    train = (summary.config or {}).get("train") or {}
    batch, accum = num(train.get("batch_size")), num(train.get("grad_accum"))
    if (batch is None or accum is None) and side is not None and side.config is not None:
        batch, accum = side.config.train.batch_size, side.config.train.grad_accum
    world = num(summary.world_size) or 1
    return int(batch * accum * world) if batch and accum else None


def projection(side: Side, variant: Variant, *, samples_per_epoch: int | None, gpu: str,
               mfu: float | None) -> tuple[list[dict[str, Any]], str | None]:
    """Epoch time on the plan's 2 and 4 GPUs from ``optbench estimate``'s throughput model:
    tokens/s per GPU = MFU x the GPU's dense datasheet peak for the dtype / FLOPs per token,
    linear in the number of GPUs (no communication modeled). Only with an MFU that means something
    for that GPU: ``mfu`` (--project-mfu), or the one measured here on a known GPU. Anything else
    (estimate.mfu's 0.4 for a model measured on a CPU) is an assumption under which both sides get
    the same tokens/s up to their dtype's peak: nothing is projected, and the note says why.
    (rows, why there are none)."""
    from optbench.estimate.api import count_model, throughput

    measured = variant.mfu()
    source = str(variant.peak()[1] or "")
    if mfu is not None:
        used, how = mfu, "given (--project-mfu)"
    elif measured is not None and source.startswith("datasheet"):
        used, how = measured, f"measured here ({source})"
    else:
        where = variant.first.summary.device or "this machine"
        assumed = f"estimate.mfu {side.config.estimate.mfu:g}" if side.config is not None else "estimate.mfu"
        return [], (f"not projected: nothing measured on {where} predicts the MFU of a {gpu.upper()}, and an assumed "
                    f"one ({assumed}) gives both sides the same tokens/s up to their dtype's peak; give "
                    "--project-mfu F to project with an MFU you expect")
    if side.config is None:
        return [], None
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
    return rows, None


def side_summary(side: Side | None, variant: Variant, setup: Setup, args: argparse.Namespace | None) -> dict[str, Any]:
    tp = variant.throughput
    rows, why = [], None
    if side is not None and variant.completed:
        rows, why = projection(side, variant, samples_per_epoch=setup.samples_per_epoch,
                               gpu=args.project_gpu if args else "h100", mfu=args.project_mfu if args else None)
    peak, peak_source = variant.peak()
    return {
        "role": side.role if side else None, "overrides": side.overrides if side else variant.first.overrides,
        "label": variant.label, "status": variant.status, "reason": variant.reason,
        "runs": len(variant.runs), "completed": len(variant.completed),
        "tokens_per_s": tp.tokens_per_s if tp else None,
        "step_time_s": {"median": tp.median, "p10": tp.p10, "p90": tp.p90} if tp else None,
        "epoch": epoch_time(side, variant, setup.samples_per_epoch),
        # of the pooled tokens/s above: tokens_per_s x flops_per_token / (peak_flops x world_size)
        "mfu": variant.mfu(), "peak_flops": peak, "peak_source": peak_source,
        "flops_per_token": variant.flops_per_token(), "world_size": variant.world_size(),
        "peak_bytes": variant.peak_memory(),
        "loss": dict(zip(("value", "kind"), variant.loss(), strict=True)),
        "projection": rows, "projection_note": why,
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
            row["here"] = "blocked: " + "; ".join(gist(r) for r in state.reasons)
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


def gist(reason: str) -> str:
    """The blocking option's clause of a compat reason (the whole reason is listed under Skipped)."""
    return re.split(r"[:;]", reason, maxsplit=1)[0].strip()



def not_judged_here(setup: Setup) -> str | None:
    """Why the plan cannot be judged on this machine: the candidate was picked as the furthest phase
    that runs here, and the plan's last phase is not it (a CPU blocks phases 5-8). The gates are
    the plan's for its whole stack; held against part of it they measure, they do not judge."""
    last = setup.states[-1] if setup.states else None
    if not setup.picked or last is None or last.runnable:
        return None
    blocked = [s.name for s in setup.states if not s.runnable]
    return (f"the plan's phases {blocked[0]}..{blocked[-1]} cannot run on this machine (see Skipped), so its gates, "
            f"set for the whole stack, are measured here against {setup.candidate.phase}, the furthest phase that "
            "runs, and not judged; name a candidate=PHASE to judge it, or run on the plan's GPUs")


def validation_verdict(report: Report, candidate: Variant, baseline: Variant, codes: list[int],
                       setup: Setup) -> tuple[str, list[str]]:
    """VALIDATED only when every gate holds and every run of both sides completed; NOT VALIDATED
    when a gate fails or a run did not complete; NOT JUDGED HERE when the plan's stack cannot run on
    this machine (``not_judged_here``) and every run completed."""
    why = []
    for variant, role in ((baseline, "baseline"), (candidate, "candidate")):
        if len(variant.completed) < len(variant.runs):
            why.append(f"{role} {variant.label}: {len(variant.runs) - len(variant.completed)} of {len(variant.runs)} "
                       f"runs did not complete ({variant.reason})")
    if any(codes) and not why:
        why.append("a run exited with an error (see its console.log)")
    partial = not_judged_here(setup)
    if partial and not why:
        return "NOT JUDGED HERE", [partial]
    why = [f"gate failed: {g.message}" for g in report.gate_results if not g.ok] + why
    if not report.gate_results:
        why.append("no gate was judged")
    return ("NOT VALIDATED" if why else "VALIDATED"), why


def assemble(report: Report, setup: Setup, *, args: argparse.Namespace | None = None,
             codes: list[int] | None = None, command: str = "") -> dict[str, Any]:
    """The validation as a JSON-able dict: sides, gates, verdict, the phase table, the machine."""
    group, baseline, candidate = find_variants(report)
    by_key = {"A": setup.baseline, "B": setup.candidate}
    verdict, why = validation_verdict(report, candidate, baseline, codes or [], setup)
    comparison: Comparison | None = group.comparisons.get(candidate.key)
    first = baseline.first.summary
    blocked = [{"phase": s.name, "reasons": s.reasons} for s in setup.states if not s.runnable]
    return {
        "verdict": verdict, "validated": verdict == "VALIDATED", "why_not": why, "command": command, "plan": PLAN, "plan_headline": PLAN_HEADLINE,
        "plan_claims_multiply_to": claim_between("0", "8"),
        "machine": {"device": first.device, "world_size": first.world_size, "versions": first.versions},
        "model": group.name, "task": group.task, "params": group.params(),
        "samples_per_epoch": setup.samples_per_epoch, "common_overrides": setup.common,
        "baseline": side_summary(by_key["A"], baseline, setup, args),
        "candidate": side_summary(by_key["B"], candidate, setup, args),
        "comparison": comparison.to_dict() if comparison else None,
        "gates": [g.to_dict() for g in report.gate_results],
        "phases": phase_table(setup, group, baseline, candidate),
        "skipped": blocked, "notes": setup.notes,
    }


def default_out() -> Path:
    return Path("outputs") / "validate" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def run_sides(setup: Setup, out: Path, repeats: int) -> list[int]:
    """compare's runner: counterbalanced order, each run its own ``optbench train`` process; the
    manifest tells review (and a later ``optbench report``) which run is the baseline (A) and the
    candidate (B)."""
    from optbench.outputs import write_json_atomic
    from optbench.report.compare import run_all, run_order

    keys = [side.key for side in setup.sides]
    order = run_order(repeats, sides=tuple(keys))
    write_json_atomic(out / COMPARE_MANIFEST, {
        "a": setup.baseline.overrides, "b": setup.candidate.overrides, "repeats": repeats, "validate": True,
        "runs": [{"dir": f"{i}_{key}", "side": key if key in ("A", "B") else None} for i, key in enumerate(order)],
    })
    return run_all(out, order, {side.key: side.overrides for side in setup.sides})
