"""make bench-estimate: how close is ``optbench estimate`` to the memory a run really uses?

For each model x precision x activation checkpointing (and DDP and FSDP2 over two local workers),
one short ``optbench train`` run (in this process, one after the other) records both numbers in its summary.json: ``memory.estimate_bytes``
(the FakeTensor trace of that very config, before the loop) and ``memory.peak_bytes`` (on a CPU:
torch's MemTracker following the real tensors of one whole steady-state step, step 2; on CUDA:
``torch.cuda.max_memory_allocated`` over the run; the largest rank's with DDP/FSDP2). The closed form (bytes/param + activations) is
printed beside them. Prints every error and the worst; exits 1 when the worst exceeds --max-error.

    python bench/bench_estimate.py [--models tiny,small] [--max-error 0.10]

On a GPU, cuBLAS's workspace (tens of MiB, allocated through the caching allocator) is part of
max_memory_allocated and of no trace: use --models small,134m there so it stays a small fraction.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optbench.config import to_config  # noqa: E402
from optbench.estimate.api import closed_form, count_model  # noqa: E402
from optbench.estimate.format import gib  # noqa: E402
from optbench.run.train import train  # noqa: E402

# The CPU peak is MemTracker's on the last warm-up step (measure.warmup_steps - 1): with 3, step 2, a
# steady-state step. Step 1 is not one: DDP rebuilds its gradient buckets there (in the order the
# first backward produced gradients), so MemTracker sees them allocated inside the step, while on
# every later step they already exist.
RUN = ["train.steps=4", "measure.warmup_steps=3", "train.batch_size=8", "train.seq_len=128",
       "train.eval_batches=1", "log.progress=log"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from optbench.config import conf_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return hydra_compose(config_name="train", overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="default: tiny,small on a CPU, small,134m on CUDA")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--ac", default="none,full", help="activation checkpointing (ac=) presets")
    parser.add_argument("--max-error", type=float, default=0.10)
    parser.add_argument("--no-scale", action="store_true", help="skip the 9.9b/13.1b stacked-vs-whole timing")
    parser.add_argument("--scale-limit", type=float, default=10.0, help="seconds per stacked 9.9b/13.1b estimate")
    args = parser.parse_args()
    import torch

    target = "cuda" if torch.cuda.is_available() else "cpu"
    models = args.models or ("small,134m" if target == "cuda" else "tiny,small")

    rows, worst = [], (0.0, "")
    grid = [(m, p, ac, "single") for m, p, ac in itertools.product(
        models.split(","), args.precisions.split(","), args.ac.split(","))]
    first = models.split(",")[0]  # and data parallelism over 2 local workers (gloo on a CPU)
    if target == "cpu" or torch.cuda.device_count() >= 2:
        grid += [(first, "fp32", "none", "ddp"), (first, "bf16", "full", "fsdp2")]
    else:
        print("(DDP and FSDP2 rows need 2 GPUs; this machine has 1)")
    print(f"{'config':<28}{'measured':>12}{'estimate':>12}{'bytes off':>10}{'error':>9}{'closed form':>13}{'error':>8}"
          "  measured by")
    for model, precision, ac, parallel in grid:
        overrides = [f"model={model}", f"precision={precision}", f"ac={ac}", f"parallel={parallel}",
                     "parallel.nproc_per_node=" + ("1" if parallel == "single" else "2"), *RUN]
        with tempfile.TemporaryDirectory() as run_dir:
            result = train(compose(overrides), run_dir=run_dir)
        if result.status != "completed":
            raise SystemExit(f"{' '.join(overrides)}: {result.status}: {result.error}")
        memory = result.summary["memory"]
        measured, estimated = memory["peak_bytes"], memory["estimate_bytes"]
        cfg = to_config(compose(overrides))
        closed = closed_form(cfg, counts=count_model(cfg), world_size=result.summary["world_size"],
                             micro_batch=cfg.train.batch_size, target=target)["total"]
        error = (estimated - measured) / measured
        closed_error = (closed - measured) / measured
        name = f"{model} {precision} ac={ac}" + ("" if parallel == "single" else f" {parallel} x 2")
        rows.append(error)
        worst = max(worst, (abs(error), name))
        print(f"{name:<28}{gib(measured):>12}{gib(estimated):>12}{estimated - measured:>+10,}{error:>+9.2%}"
              f"{gib(closed):>13}{closed_error:>+8.1%}  {memory['peak_source'].split(';')[0]}", flush=True)
    print(f"worst estimate error: {worst[0]:.2%} ({worst[1]}); limit {args.max_error:.0%}")
    wrong = [] if args.no_scale else scale_rows(args.scale_limit)
    if worst[0] > args.max_error or wrong:
        raise SystemExit(1)


# The plan's models as a user estimates them (the command, its process start included), stacked
# (the default) and with the whole model traced, one after the other: seconds, the peak and the
# micro-batch search's answer of each, and their difference (the stacked estimate must equal the
# whole trace within 0.5%; on the configs here it is byte-exact).
SCALE = [
    ["model=9.9b", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8"],
    ["model=13.1b", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8"],
    ["model=13.1b", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8", "ac=full"],
]


def scale_rows(limit_s: float) -> list[str]:
    """Prints the stacked vs whole estimate of each SCALE config, with the whole/stacked time ratio
    (side by side, so it holds on a busy machine); returns the configs whose stacked estimate is more
    than 0.5% off the whole trace or finds another largest micro-batch. The seconds are compared
    with ``limit_s`` and reported with the load, not failed on: a busy machine could fake either."""
    import json
    import os
    import subprocess
    import time

    print(f"\n{'optbench estimate ... (micro-batch search on)':<62}{'stacked':>10}{'whole':>9}{'ratio':>7}  "
          "peak (stacked = whole?)  largest micro-batch  how")
    wrong, slow = [], []
    for overrides in SCALE:
        runs = {}
        for stacked in ("null", "false"):
            command = [sys.executable, "-m", "optbench", "estimate", *overrides, "estimate.format=json",
                       f"estimate.stacked={stacked}"]
            started = time.perf_counter()
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[stacked] = (time.perf_counter() - started, json.loads(out))
        (fast, a), (whole_s, b) = runs["null"], runs["false"]
        peak_a, peak_b = a["memory"]["traced"]["total"], b["memory"]["traced"]["total"]
        off = (peak_a - peak_b) / peak_b
        search_a, search_b = (r["micro_batch_search"]["max_micro_batch"] for r in (a, b))
        how = a["memory"]["method"].rpartition("save; ")[2]
        print(f"{' '.join(overrides):<62}{fast:>9.1f}s{whole_s:>8.1f}s{whole_s / fast:>6.1f}x  {gib(peak_a)} "
              f"({'byte-exact' if peak_a == peak_b else f'{off:+.3%}'})  {search_a} (whole: {search_b})  {how}")
        if abs(off) > 0.005 or search_a != search_b:
            wrong.append(" ".join(overrides))
        if fast > limit_s:
            slow.append(" ".join(overrides))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"within 0.5% of the whole trace: {'all' if not wrong else 'MISSED by ' + ', '.join(wrong)}; "
          f"under {limit_s:.0f} s: {'all' if not slow else 'not ' + ', '.join(slow)} (load average {load})")
    return wrong


if __name__ == "__main__":
    main()
