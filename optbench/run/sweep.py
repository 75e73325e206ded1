"""A Hydra multirun (``optbench train -m ...``) that survives its jobs.

Hydra's basic launcher runs the jobs one after another in this process; a job function that raises
makes the sweeper re-raise at the end of the batch (so no end-of-sweep callback runs) and a bare
traceback is all the user sees. ``run_job`` therefore never lets an ordinary exception escape:
``train`` already records every outcome of a run (completed, incompatible, failed, diverged) in the
job's ``summary.json``; anything that escapes even that is recorded here as ``failed`` and the sweep
goes on. Only an interruption (Ctrl-C) stops the sweep, after its job recorded ``interrupted``.

Resumable: re-running the same ``-m`` command over the same ``hydra.sweep.dir`` skips every job
whose directory already holds a summary of a finished run (``FINISHED``) with the same config hash
(``already_finished``), resumes the interrupted (and time-limited) ones from their last checkpoint
(``checkpoint.resume=auto``), runs the failed ones again, and the end-of-sweep report covers them all.

Exit status of a sweep: 0 when every job completed or was ``incompatible`` (a phase this machine
cannot run is an expected, recorded outcome: a CPU sweep of the plan blocks phases 5-8), 1 when
any job failed, diverged, ran out of memory (``oom``) or hit a loss spike, 124 when a job stopped at
its time budget (``time_limit``: re-run the sweep to go on), 130 when interrupted. ``stopped_early``
is a finished run (``optbench.exits.sweep_exit``).
"""

from __future__ import annotations

import logging
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from optbench.outputs import reason_gist
from optbench.run.rerun import FINISHED  # outcomes a re-run of the same sweep keeps as they are
from optbench.summary import RunSummary, summary_or_reason

log = logging.getLogger(__name__)


@dataclass
class JobOutcome:
    num: int
    overrides: list[str]
    status: str
    error: str | None
    run_dir: Path
    tokens_per_s: float | None = None
    final_loss: float | None = None
    skipped: bool = False  # finished in an earlier run of the same sweep


def already_finished(cfg: DictConfig, run_dir: Path) -> RunSummary | None:
    """The summary in ``run_dir`` when it records a finished run (``FINISHED``) of this very config
    (the same config hash), else None."""
    from omegaconf import OmegaConf

    from optbench.outputs import config_hash

    summary, _ = summary_or_reason(run_dir)
    if summary is None:  # none; or a corrupt one (or of a newer schema): not skipped, the job's run
        return None  # refuses to train over it (optbench.run.rerun) and the sweep records why
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    assert isinstance(resolved, dict)
    resolved.pop("hydra", None)
    if summary.status in FINISHED and summary.config_hash == config_hash(resolved):
        return summary
    return None


def run_job(cfg: DictConfig, outcomes: list[JobOutcome]) -> str:
    """Train one job of a sweep, append its outcome, and return its status (never raises, except
    KeyboardInterrupt after an interrupted run, which stops the sweep)."""
    from hydra.core.hydra_config import HydraConfig

    from optbench.run.train import train

    hydra_cfg = HydraConfig.get()
    num, overrides = hydra_cfg.job.num, list(hydra_cfg.overrides.task)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    kept = already_finished(cfg, run_dir)
    if kept is not None:
        log.info("job #%d already %s in %s (same config hash): skipped", num, kept.status, run_dir)
        outcomes.append(JobOutcome(num, overrides, kept.status, kept.error, run_dir, skipped=True,
                                   tokens_per_s=kept.throughput.tokens_per_s, final_loss=kept.loss.final))
        return kept.status
    try:
        result = train(cfg)
    except Exception as exc:  # train() records its own failures; this is one it could not record
        log.error("job #%d could not run:\n%s", num, traceback.format_exc())
        outcomes.append(JobOutcome(num, overrides, "failed", f"{type(exc).__name__}: {exc}", run_dir))
        return "failed"
    outcomes.append(JobOutcome(
        num, overrides, result.status, result.error, result.run_dir,
        tokens_per_s=result.record.throughput.tokens_per_s, final_loss=result.record.loss.final,
    ))
    if result.status == "interrupted":
        raise KeyboardInterrupt
    return result.status


def _varying(outcomes: list[JobOutcome]) -> dict[int, str]:
    """Each job's overrides without those every job shares."""
    common = set.intersection(*(set(o.overrides) for o in outcomes)) if len(outcomes) > 1 else set()
    return {o.num: " ".join(x for x in o.overrides if x not in common) or "(no overrides)" for o in outcomes}


def format_recap(outcomes: list[JobOutcome]) -> str:
    """One line per job: its status and either its throughput and loss or why it did not run."""
    if not outcomes:
        return "optbench sweep: no job ran"
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    sweep_dir = outcomes[0].run_dir.parent
    head = ", ".join(f"{n} {status}" for status, n in counts.items())
    lines = [f"optbench sweep -> {sweep_dir}: {len(outcomes)} jobs: {head}"]
    labels = _varying(outcomes)
    width = max(len(label) for label in labels.values())
    columns = shutil.get_terminal_size((120, 24)).columns
    for outcome in outcomes:
        if outcome.status == "completed" and outcome.tokens_per_s is not None:
            detail = f"{outcome.tokens_per_s:>10,.0f} tokens/s  loss {outcome.final_loss:.4f}"
        else:  # the gist: the whole reason was logged once when the job ended, and is in its summary.json
            detail = reason_gist(f"{outcome.status}: {outcome.error or ''}").removeprefix(f"{outcome.status}: ")
        if outcome.skipped:
            detail = f"(kept from an earlier run of this sweep) {detail}"
        line = f"  #{outcome.num:<2} {labels[outcome.num]:<{width}}  {outcome.status:<12} {detail}"
        lines.append(line if len(line) <= columns else line[:columns - 1] + "…")
    return "\n".join(lines)
