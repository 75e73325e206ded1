"""Predicted vs measured for the runs under a directory (``bash bench/gpu_check.sh predict``):
each run's summary.json ``predicted`` (made before its loop) beside its measured throughput, and its
traced memory estimate beside the measured peak (``torch.cuda.max_memory_allocated`` on a GPU).

    python bench/predict_table.py RUNS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(run: Path) -> str:
    try:
        s = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        return f"| {run.name} | no summary.json ({type(exc).__name__}) | | | | | | | |"
    if s["status"] != "completed":
        return f"| {run.name} | {s['status']}: {(s['error'] or '')[:90]} | | | | | | | |"
    t, m, p = s["throughput"], s["memory"], s.get("predicted") or {}
    world = s["world_size"] or 1
    measured = t["tokens_per_s"] / world
    if "tokens_per_s_per_device" in p:
        predicted = p["tokens_per_s_per_device"]
        speed = f"{predicted:,.0f} | {measured:,.0f} | {predicted / measured - 1:+.1%}"
    else:
        speed = f"{p.get('error', 'not predicted')} | {measured:,.0f} | -"
    est, peak = m["estimate_bytes"], m["peak_bytes"]
    memory = "- | - | -" if not est or not peak else \
        f"{est / 2**30:.2f} GiB | {peak / 2**30:.2f} GiB | {est / peak - 1:+.1%}"
    mfu = "-" if t.get("mfu") is None else f"{t['mfu']:.1%} ({t['peak_source']})"
    return f"| {run.name} | {speed} | {memory} | {p.get('method', '-')}; peak: {m['peak_source']} | {mfu} |"


def main() -> None:
    root = Path(sys.argv[1])
    print("| run | predicted tokens/s/device | measured | error | estimate | measured peak | error | how | MFU (peak) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for run in sorted(p for p in root.iterdir() if p.is_dir()):
        print(row(run))


if __name__ == "__main__":
    main()
