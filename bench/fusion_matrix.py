"""The plan's scale matrix for the climate-aware language model (``make fusion-matrix``).

Plan 004 claims a table of fusion kinds over model scales ("2.9M mock to 8B frozen base"). This
measures it on this machine, with optbench's own commands only:

1. ``optbench data synth`` a NetCDF file and ``optbench data captions`` its paired text (``--lines``
   also writes the texts one per line), ``optbench data tokenize`` those lines;
2. per model preset, a ``task=lm`` base trained on the captions' text (``checkpoint.every``);
3. the multirun: ``task=climate_text`` x ``fusion=add,cross_attention,gated`` x the presets, each
   over its preset's frozen base (``fusion.freeze_base=true fusion.base_checkpoint=...``);
4. a table from the runs' ``summary.json``: parameters, trainable share, FLOPs/token really
   computed, step time (median and p10-p90), peak memory measured (MemTracker) beside the
   estimate (``optbench estimate``'s trace, recorded by each run), and the eval loss with the true
   climate, shuffled climate and the base alone, and the gap with its standard error.

    python bench/fusion_matrix.py [--models tiny,small] [--steps 60] [--out outputs/fusion-matrix]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run(*args: str) -> None:
    print("+ optbench " + " ".join(args), flush=True)
    code = subprocess.call([sys.executable, "-m", "optbench", *args])
    if code:
        raise SystemExit(f"optbench {args[0]} exited with {code}")


def human(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}{unit}"
    return f"{value:.0f}{unit}"


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f} MiB"


def table(sweep: Path) -> str:
    rows = []
    for path in sorted(sweep.glob("*/summary.json")):
        s = json.loads(path.read_text())
        cfg, model, tp, mem = s["config"], s["model"], s["throughput"], s["memory"]
        metrics = (s["loss"]["eval_metrics"] or {})
        st = tp["step_time_s"] or {}
        gap, err = metrics.get("fusion/loss_gap"), metrics.get("fusion/loss_gap_stderr")
        rows.append([
            cfg["model"]["name"], cfg["fusion"]["name"], s["status"], human(model.get("params")),
            human(model.get("trainable_params")),
            f"{1 - model['frozen_share']:.1%}" if model.get("frozen_share") is not None else "n/a",
            human(model.get("flops_per_token"), "FLOP"),
            f"{st['median']:.3f} s [{st['p10']:.3f}-{st['p90']:.3f}]" if st else "n/a",
            mib(mem["peak_bytes"]), mib(mem["estimate_bytes"]),
            *(f"{metrics[k]:.4f}" if k in metrics else "n/a"
              for k in ("fusion/loss_true", "fusion/loss_shuffled", "fusion/loss_base")),
            f"{gap:+.4f} ± {err:.4f}" if gap is not None else "n/a",
        ])
    head = ["model", "fusion", "status", "params", "trainable", "trainable share", "FLOPs/token (training)",
            "step time median [p10-p90]", "peak memory (measured)", "estimate", "loss true", "loss shuffled",
            "loss base", "gap (shuffled - true) ± s.e."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,small", help="model presets (comma-separated)")
    parser.add_argument("--fusions", default="add,cross_attention,gated")
    parser.add_argument("--steps", type=int, default=60, help="training steps of each fused run")
    parser.add_argument("--base-steps", type=int, default=150, help="training steps of each task=lm base")
    parser.add_argument("--batch-size", type=int, default=8, help="train.batch_size of every run")
    parser.add_argument("--out", default="outputs/fusion-matrix")
    parser.add_argument("--table-only", action="store_true", help="print the table of an earlier run")
    parser.add_argument("extra", nargs="*", help="more overrides for the fused runs (e.g. train.batch_size=4)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    if not args.table_only:
        out.mkdir(parents=True, exist_ok=True)
        data, pairs, lines, tokens = out / "data.nc", out / "captions.jsonl", out / "captions.txt", out / "captions.bin"
        run("data", "synth", str(data), "--days", "60", "--nlat", "16", "--nlon", "32", "--levels", "1000", "500")
        run("data", "captions", str(data), str(pairs), "--lines", str(lines))
        run("data", "tokenize", str(lines), str(tokens))
        common = ["train.seq_len=256", f"train.batch_size={args.batch_size}", "train.device=cpu"]
        run("train", "-m", "task=lm", "data=tokens", f"data.path={tokens}", f"model={args.models}",
            f"train.steps={args.base_steps}", f"checkpoint.every={args.base_steps}", "train.eval_every=0",
            *common, f"hydra.sweep.dir={out}/base", "hydra.sweep.subdir=${model.name}",
            "hydra.callbacks.report.enabled=false")
        run("train", "-m", "task=climate_text", "data=netcdf", f"data.paths=[{data}]", f"data.text={pairs}",
            "data.augment.enabled=false", f"fusion={args.fusions}", f"model={args.models}",
            "fusion.freeze_base=true", f"fusion.base_checkpoint={out}/base/" + "${model.name}/checkpoints",
            f"train.steps={args.steps}", "train.eval_batches=2", *common, *args.extra,
            f"hydra.sweep.dir={out}/matrix", "hydra.sweep.subdir=${model.name}_${fusion.name}",
            "hydra.callbacks.report.enabled=false")
    print(table(out / "matrix"))


if __name__ == "__main__":
    main()
