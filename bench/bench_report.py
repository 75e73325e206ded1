"""make bench-report: does ``optbench report`` scale to a team's outputs/ (thousands of runs)?

Trains ONE tiny run (``model=tiny train.steps=12``, about 15 s on one core; or reuses ``--source
RUN_DIR``) and copies it N times (default 10,000) into a temporary outputs tree laid out as ``optbench
train -m train.seed=...`` leaves it (``multirun/<date>/<time>/<num>_<override_dirname>/``), each copy
with its own ``train.seed`` override where the report reads it (``.hydra/overrides.yaml``). The
copies are cheap: every other file (summary.json, metrics.jsonl, train.log, tensorboard/, the other
.hydra files; a tiny run writes no checkpoint) is a hard link to the source's. Then it runs ``optbench
report`` on the tree in a child process (plots included, as a user runs it) and prints one line: N,
the wall seconds (and CPU seconds: the machine may be shared) and the child's peak resident memory (``os.wait4``'s rusage), against the aims
(30 s, 1 GB).

By default every copy keeps the source's resolved config (summary.json is shared), so the report pools
the N seeds as repeats of one variant: one hierarchical bootstrap over N runs, N rows of runs, N loss
curves. ``--distinct-configs`` writes each copy its own summary.json whose config and hash record its
seed: N variants of one run each (N rows, N bars). ``--distinct-curves`` also scales each copy's
step times and losses by a small factor (no two curves alike). The child is killed when its resident
memory passes ``--max-rss-mb`` (default 6,000: the development machine is shared).

    python bench/bench_report.py [--runs 10000] [--source RUN_DIR] [--distinct-configs] [--distinct-curves]
    python bench/bench_report.py --runs 1000 --keep /tmp/tree --profile   # in-process: cProfile, tracemalloc
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AIM_S, AIM_MB = 30.0, 1024.0
SWEEP = Path("multirun") / "2026-11-28" / "07-00-00"
OWN = {"summary.json", "metrics.jsonl", ".optbench.lock"}  # written per copy (or not at all: the lock)


def optbench(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "optbench"), *args]


def train_source(where: Path) -> Path:
    """One finished ``model=tiny train.steps=12`` run."""
    run_dir = where / "source"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(optbench("train", "model=tiny", "train.steps=12", f"hydra.run.dir={run_dir}"),
                   check=True, env=env, cwd=where, stdout=subprocess.DEVNULL)
    return run_dir


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system: a copy (the files are a few KB)
        shutil.copyfile(source, target)


def _scaled_metrics(text: str, factor: float) -> str:
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    for record in records:
        for key in ("loss", "step_time_s"):
            if isinstance(record.get(key), float):
                record[key] *= factor
    return "".join(json.dumps(r) + "\n" for r in records)


def _own_summary(summary: dict, overrides: list[str], seed: int, factor: float | None) -> str:
    from optbench.outputs import config_hash

    record = copy.deepcopy(summary)
    record["overrides"] = overrides
    record["config"]["train"]["seed"] = seed
    record["config_hash"] = config_hash(record["config"])
    if factor is not None:
        record["throughput"]["step_times_s"] = [t * factor for t in record["throughput"]["step_times_s"]]
        record["loss"] = {k: v * factor if isinstance(v, float) else v for k, v in record["loss"].items()}
    return json.dumps(record, indent=2) + "\n"


def make_tree(source: Path, root: Path, runs: int, *, distinct_configs: bool, distinct_curves: bool) -> Path:
    """``runs`` copies of ``source`` as the jobs of one seed sweep below ``root``; the sweep dir."""
    sweep = root / SWEEP
    summary = json.loads((source / "summary.json").read_text())
    metrics = (source / "metrics.jsonl").read_text() if (source / "metrics.jsonl").is_file() else None
    shared = [p.relative_to(source) for p in source.rglob("*")
              if p.is_file() and p.name not in OWN and p.relative_to(source) != Path(".hydra/overrides.yaml")]
    base = [o for o in summary["overrides"] if not o.startswith("train.seed=")]
    for num in range(runs):
        overrides = sorted([*base, f"train.seed={num}"])
        job = sweep / f"{num}_{','.join(overrides)}"
        for rel in shared:
            _link(source / rel, job / rel)
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        factor = 1.0 + 0.05 * ((num * 7919) % 101) / 100 if distinct_curves else None
        if distinct_configs or factor is not None:
            (job / "summary.json").write_text(_own_summary(summary, overrides, num, factor))
        else:
            _link(source / "summary.json", job / "summary.json")
        if metrics is not None and factor is not None:
            (job / "metrics.jsonl").write_text(_scaled_metrics(metrics, factor))
        elif metrics is not None:
            _link(source / "metrics.jsonl", job / "metrics.jsonl")
    (sweep / "multirun.yaml").write_text((source / ".hydra" / "hydra.yaml").read_text())
    return sweep


def measure(command: list[str], *, max_rss_mb: float, timeout_s: float) -> tuple[float, float, float, int, str]:
    """(wall s, CPU s, peak RSS MB, exit status, why it was stopped or ""), from the child's own rusage."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stopped = ""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss = _rss_mb(proc.pid)
        if rss > max_rss_mb and not stopped:
            stopped = f"killed at {rss:,.0f} MB resident (over --max-rss-mb {max_rss_mb:,.0f})"
            proc.send_signal(signal.SIGKILL)
        elif time.perf_counter() - start > timeout_s and not stopped:
            stopped = f"killed after {timeout_s:.0f} s (--timeout-s)"
            proc.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if code not in (0, 1) and not stopped:
        stopped = f"exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}"
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, code, stopped


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def profile(tree: Path, out: Path) -> None:
    """Where the report's time and memory go, in this process: cProfile, then tracemalloc."""
    import cProfile
    import io
    import pstats
    import tracemalloc

    from optbench.report.analysis import build_report
    from optbench.report.format import render, write_outputs

    def once() -> None:
        report = build_report([tree])
        write_outputs(report, out, plots=True)
        render(report, "table")

    profiler = cProfile.Profile()
    profiler.runcall(once)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    print(text.getvalue())
    tracemalloc.start(10)
    once()
    current, peak = tracemalloc.get_traced_memory()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    print(f"tracemalloc: peak {peak / 2**20:,.0f} MB, still held {current / 2**20:,.0f} MB; largest at the end:")
    for stat in snapshot.statistics("lineno")[:15]:
        print(f"  {stat.size / 2**20:8.1f} MB  {stat.traceback[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10_000, help="copies of the run (default 10,000)")
    parser.add_argument("--source", type=Path, help="a finished run dir to copy (default: train one)")
    parser.add_argument("--distinct-configs", action="store_true", help="each copy's config records its seed")
    parser.add_argument("--distinct-curves", action="store_true", help="scale each copy's step times and losses")
    parser.add_argument("--max-rss-mb", type=float, default=6000.0)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--profile", action="store_true", help="profile in this process instead")
    parser.add_argument("--keep", type=Path, help="build the tree here and keep it (a kept tree is reused)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_report_") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        source = args.source or (where / "source" if (where / "source").is_dir() else train_source(where))
        tree = where / "outputs"
        mode = ("one variant per seed" if args.distinct_configs else "the seeds as repeats of one variant") + (
            ", distinct curves" if args.distinct_curves else ", identical curves")
        if tree.is_dir():  # a tree --keep left: reused as it is
            runs = sum(1 for _ in (tree / SWEEP).glob("*/summary.json"))
            print(f"bench-report: reusing {tree} ({runs:,} runs)", flush=True)
        else:
            start = time.perf_counter()
            make_tree(source, tree, args.runs, distinct_configs=args.distinct_configs,
                      distinct_curves=args.distinct_curves)
            runs = args.runs
            print(f"bench-report: {runs:,} copies of {source} ({mode}) made in {time.perf_counter() - start:.1f} s",
                  flush=True)
        if args.profile:
            profile(tree, where / "report")
            return
        wall, cpu, peak, code, stopped = measure(optbench("report", str(tree), "--out", str(where / "report")),
                                            max_rss_mb=args.max_rss_mb, timeout_s=args.timeout_s)
        print(f"bench-report: {runs} runs: {wall:.1f} s wall ({cpu:.1f} s CPU), peak RSS {peak:,.0f} MB, exit {code} "
              f"(aims: {AIM_S:.0f} s, {AIM_MB:,.0f} MB)" + (f"; {stopped}" if stopped else ""))


if __name__ == "__main__":
    main()
