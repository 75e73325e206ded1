"""``optbench compare A_OVERRIDES -- B_OVERRIDES [--repeats 3]``: an honest A/B on a noisy machine.

Both sides are composed and checked first (a typo in B is found before A has trained), and must
train the same model and task on the same seed and data. Then A and B run alternately, in
counterbalanced order (A B, B A, A B, ...: a slow drift of the machine favours neither side), each
as its own ``optbench train`` process into ``--out``/<n>_<A|B>. Separate processes, not in-process
``train()`` calls, because a run must not inherit another's state: the process-wide peak RSS,
torch.compile's caches, the CUDA caching allocator and its peak counters, global TF32 flags, and a
distributed process group all outlive a run inside one process, and the user's own runs are
processes too. Finally the report compares B with A, pooling the repeats so that run-to-run noise
widens the confidence interval.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from optbench.config.renames import upgrade_and_warn
from optbench.errors import ReportError
from optbench.exits import BAD_INPUT
from optbench.files import os_error_message
from optbench.outputs import write_json_atomic
from optbench.report.runs import COMPARE_MANIFEST
from optbench.summary import SummaryError, read_run_summary

SIDES = ("A", "B")
PROGRESS_EVERY_S = 5.0  # how often a child's progress line is echoed
_PROGRESS = re.compile(r"step \d+ \((\d+)/(\d+) done\).*")


def compose_side(overrides: list[str], side: str):
    """Compose with Hydra, as ``optbench train`` will, check the typed config and its compatibility
    with this machine: a side that would be refused is refused before anything trains."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from optbench.config import compose, to_config
    from optbench.training.preflight import preflight

    try:
        cfg = compose(overrides)
        preflight(to_config(cfg))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReportError(f"{side} overrides {' '.join(overrides) or '(none)'}: {first}") from None
    return cfg


def check_same_experiment(cfg_a, cfg_b) -> None:
    """An A/B isolates what differs: same model, task, seed and data on both sides."""
    from omegaconf import OmegaConf

    for key in ("model", "task.name", "data", "train.seed"):
        a, b = OmegaConf.select(cfg_a, key), OmegaConf.select(cfg_b, key)
        if OmegaConf.is_config(a):
            a, b = OmegaConf.to_container(a, resolve=True), OmegaConf.to_container(b, resolve=True)
        if a != b:
            raise ReportError(
                f"A and B differ in {key} ({_short(a)} vs {_short(b)}); compare runs the same model, task, "
                f"seed and data on both sides: give {key} to both, or use optbench train -m + optbench report"
            )


def _short(value) -> str:
    text = json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def run_order(repeats: int, sides: tuple[str, ...] = SIDES) -> list[str]:
    """A B, B A, A B, ...: counterbalanced, so a linear drift of the machine cancels (with more
    sides, as optbench validate --all-phases runs: forward, then backward)."""
    order: list[str] = []
    for r in range(repeats):
        order += list(sides) if r % 2 == 0 else list(reversed(sides))
    return order


def default_out() -> Path:
    return Path("outputs") / "compare" / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")


def prepare_out(out: Path, *, writes: tuple[str, ...] = ()) -> None:
    """``--out`` of compare (and validate, which also ``writes`` its own files): a new directory, or
    one that holds none of what they write (runs, a report), so nothing there before is written over."""
    if out.is_dir() and any(out.rglob("summary.json")):
        raise ReportError(f"{out} already holds runs; choose another --out (nothing was run)")
    from optbench.report.format import REPORT_FILES

    there = [name for name in (*REPORT_FILES, *writes) if (out / name).exists()] if out.is_dir() else []
    if there:
        raise ReportError(f"{out} already holds {', '.join(there)}; choose another --out (nothing was run)")
    if any(c in str(out.resolve()) for c in "'\"\\"):
        raise ReportError(f"--out {out}: quotes and backslashes in the path cannot be passed to Hydra")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(os_error_message(exc, "create --out") + " (nothing was run)") from None


def train_once(overrides: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """One ``optbench train`` process. Its console output goes to ``console.log`` in the run dir as
    it comes, and its progress ("step N (N+1/M done) ...") is echoed every few seconds: a side that trains for
    minutes is not silent."""
    command = [sys.executable, "-m", "optbench", "train", *overrides, f"hydra.run.dir='{run_dir.resolve()}'"]
    run_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    with open(run_dir / "console.log", "w") as console:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert child.stdout is not None
        shown = 0.0
        for line in child.stdout:
            console.write(line)
            console.flush()
            lines.append(line)
            match = _PROGRESS.search(line)
            last = match is not None and match.group(1) == match.group(2)
            if match and (last or time.monotonic() - shown >= PROGRESS_EVERY_S):
                print(f"        {match.group(0).strip()}", flush=True)
                shown = time.monotonic()
        child.wait()
    output = "".join(lines)
    return subprocess.CompletedProcess(command, child.returncode, output, output)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("optbench: error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def _status_of(run_dir: Path) -> str:
    """How the run in ``run_dir`` ended, as its summary says ("no summary", "unreadable": it says nothing)."""
    if not (run_dir / "summary.json").is_file():
        return "no summary"
    try:
        return read_run_summary(run_dir).status
    except SummaryError:
        return "unreadable"


def run_all(out: Path, order: list[str], overrides: dict[str, list[str]]) -> list[int]:
    codes = []
    for index, side in enumerate(order):
        name = f"{index}_{side}"
        command = " ".join(["optbench train", *overrides[side]])
        print(f"[{index + 1}/{len(order)}] {side}: {command} -> {out / name}", flush=True)
        started = time.perf_counter()
        result = train_once(overrides[side], out / name)
        status = _status_of(out / name)
        print(f"        {status} in {time.perf_counter() - started:.1f} s", flush=True)
        if result.returncode == BAD_INPUT:  # a user error or an impossible combination repeats on every run
            reason = _last_line(result.stderr).removeprefix("optbench: error: ")
            raise ReportError(f"{side} run {out / name}: {reason}")
        codes.append(result.returncode)
    return codes


def compare(a_overrides: list[str], b_overrides: list[str], *, repeats: int, out: Path) -> list[int]:
    """Check both sides, then run them alternately into ``out`` (its manifest first): each run's
    exit status. Bad input is a ``ReportError`` before anything runs."""
    a_overrides, b_overrides = upgrade_and_warn(a_overrides), upgrade_and_warn(b_overrides)
    check_same_experiment(compose_side(a_overrides, "A"), compose_side(b_overrides, "B"))
    prepare_out(out)
    order = run_order(repeats)
    try:
        write_json_atomic(out / COMPARE_MANIFEST, {
            "a": a_overrides, "b": b_overrides, "repeats": repeats,
            "runs": [{"dir": f"{i}_{side}", "side": side} for i, side in enumerate(order)],
        })
    except OSError as exc:
        raise ReportError(os_error_message(exc, "write into --out") + " (nothing was run)") from None
    try:
        return run_all(out, order, {"A": a_overrides, "B": b_overrides})
    except OSError as exc:
        raise ReportError(os_error_message(exc, "write into --out") + f"; the runs so far are in {out}") from None
