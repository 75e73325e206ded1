"""make bench-estimate: how close is ``optbench estimate`` to the memory a run really uses?

For each model x precision x activation checkpointing (and DDP and FSDP2 over two local workers),
one short ``optbench train`` run (in this process, one after the other) records both numbers in its summary.json: ``memory.estimate_bytes``
(the FakeTensor trace of that very config, before the loop) and ``memory.peak_bytes`` (on a CPU:
torch's MemTracker following the real tensors of one whole steady-state step, step 2; on CUDA:
``torch.cuda.max_memory_allocated`` over the run; the largest rank's with DDP/FSDP2). The closed form (bytes/param + activations) is
printed beside them. Prints every error and the worst; exits 1 when the worst exceeds --max-error.

    python bench/bench_estimate.py [--models tiny,small] [--max-error 0.10]

On a GPU, cuBLAS's workspace (tens of MiB, allocated through the caching allocator) is part of
max_memory_allocated and of no trace: use --models small,base there so it stays a small fraction.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optbench.config import to_config  # noqa: E402
from optbench.estimate import closed_form, count_model, gib  # noqa: E402
from optbench.train import train  # noqa: E402

# The CPU peak is MemTracker's on the last warm-up step (train.timing_warmup - 1): with 3, step 2, a
# steady-state step. Step 1 is not one: DDP rebuilds its gradient buckets there (in the order the
# first backward produced gradients), so MemTracker sees them allocated inside the step, while on
# every later step they already exist.
RUN = ["train.steps=4", "train.timing_warmup=3", "train.batch_size=8", "train.seq_len=128",
       "train.eval_batches=1", "train.progress=log"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from optbench.config import conf_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return hydra_compose(config_name="train", overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="default: tiny,small on a CPU, small,base on CUDA")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--checkpointing", default="none,full")
    parser.add_argument("--max-error", type=float, default=0.10)
    args = parser.parse_args()
    import torch

    target = "cuda" if torch.cuda.is_available() else "cpu"
    models = args.models or ("small,base" if target == "cuda" else "tiny,small")

    rows, worst = [], (0.0, "")
    grid = [(m, p, ac, "single") for m, p, ac in itertools.product(
        models.split(","), args.precisions.split(","), args.checkpointing.split(","))]
    first = models.split(",")[0]  # and data parallelism over 2 local workers (gloo on a CPU)
    if target == "cpu" or torch.cuda.device_count() >= 2:
        grid += [(first, "fp32", "none", "ddp"), (first, "bf16", "full", "fsdp2")]
    else:
        print("(DDP and FSDP2 rows need 2 GPUs; this machine has 1)")
    print(f"{'config':<28}{'measured':>12}{'estimate':>12}{'bytes off':>10}{'error':>9}{'closed form':>13}{'error':>8}"
          "  measured by")
    for model, precision, ac, parallel in grid:
        overrides = [f"model={model}", f"precision={precision}", f"checkpointing={ac}", f"parallel={parallel}",
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
    if worst[0] > args.max_error:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
