"""Machine drift: whether the machine's own speed, probed before and after every run
(``summary.json`` ``machine_speed``, see ``optbench.run.loop.machine_speed``), moved more than the
effect a comparison claims; then ``optbench report`` and ``compare`` give no speed verdict."""

from __future__ import annotations

from optbench.summary import RunSummary

ADVICE = "rerun on a quieter machine (there, optbench compare --repeats runs both sides alternately)"
# said once under a table whose rows carry "no verdict: speed moved N%"
DRIFT_NOTE = ("no speed verdict where the machine's own speed (a matmul probe before and after every run) moved more "
              "than the effect claimed: a machine that got busier half-way makes the later run look slower by as "
              f"much, whatever it is; {ADVICE}")


def machine_speeds(summaries: list[RunSummary]) -> list[float]:
    """Every machine-speed probe (FLOP/s, before and after each run's loop) of these runs."""
    return [flops for summary in summaries for flops in summary.machine_speed.probed_flops()]


def drift_moved(summaries: list[RunSummary], speedup: float | None) -> float | None:
    """How much the probes of these runs moved (max/min - 1), when that is more than the effect the
    speedup claims; None when the probes agree, or when the runs carry none (older summaries)."""
    speeds = machine_speeds(summaries)
    if speedup is None or len(speeds) < 2:
        return None
    moved = max(speeds) / min(speeds) - 1
    return moved if moved > abs(speedup - 1) else None


def drift_reason(summaries: list[RunSummary], speedup: float | None) -> str | None:
    """Why no speed verdict can be given, when the probes of these runs span more than the effect
    claimed: a machine that got busier half-way makes the later variant look slower by as much,
    whatever it is. None when the probes agree, or when the runs carry none (older summaries)."""
    moved = drift_moved(summaries, speedup)
    if moved is None or speedup is None:
        return None
    speeds = machine_speeds(summaries)
    return (f"no verdict: machine speed moved {moved:.0%} during these runs (probe {min(speeds) / 1e9:,.1f}-"
            f"{max(speeds) / 1e9:,.1f} GFLOP/s), more than the {abs(speedup - 1):.0%} effect; {ADVICE}")
