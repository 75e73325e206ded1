"""Does the climate-aware language model read the climate? (``make fusion-matrix``)

For each data file — ``synthetic`` (``optbench data synth``: a global grid) and ``era5`` (a
real-like regional ERA5 download, ``bench/era5_like.py``: ``t2m`` over a UK box, NetCDF3, packed
int16) — with optbench's own commands only:

1. the file, its captions (``optbench data captions --lines``: only the training steps' texts go
   to the base) and those lines tokenized;
2. a ``task=lm`` base trained on the training texts (``checkpoint.every``);
3. the multirun ``task=climate_text`` x ``fusion=<kinds>`` x ``task.text_only=false,true`` over
   the frozen base: the fused model, and the text-only control trained for the same steps on the
   same texts with an all-zero climate;
4. ``optbench generate RUN --score``: greedy text for eval samples spread over the eval split with
   the true climate, a shuffled one (a derangement) and, once, the base alone, its numbers parsed
   and compared with the field's;
5. a table per file, from the runs' ``summary.json`` and the generated JSON lines: the eval text
   loss (per token, over up to ``task.eval_samples`` strided eval samples) with the true climate,
   the shuffled one (gap with its block-bootstrap 95% interval) and the text-only control (the
   information gain, text-only minus true, with its block-bootstrap interval over the generated
   samples' teacher-forced losses); the MAE (in C) of the generated area mean and regional means
   for true, shuffled and text-only (with the share of texts that state them within
   ``--max-tokens``); trainable and total parameters; peak memory measured (MemTracker)
   beside the estimate; tokens/s. A kind whose gap interval includes 0 is marked "does not read
   the climate (in this budget)".

    python bench/fusion_matrix.py [--data synthetic,era5] [--fusions add,cross_attention,gated,prefix]
        [--model tiny] [--steps 200] [--base-steps 200] [--samples 32] [--out outputs/fusion-matrix]
        [--table-only] [extra train overrides ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from optbench.tasks.text_scores import block_bootstrap  # noqa: E402

# per file: how it is written, what is captioned, the text length and the patching
DATA = {
    "synthetic": {"write": ["data", "synth", "{file}", "--days", "90", "--nlat", "16", "--nlon", "32",
                            "--levels", "1000"],
                  "captions": ["--variables", "temperature"], "seq_len": 224, "patch": 4,
                  "variables": "[temperature]"},
    "era5": {"write": ["bench/era5_like.py", "{file}", "--days", "90"], "captions": [], "seq_len": 200,
             "patch": 8, "variables": "[t2m]"},
}
EVAL_FRACTION = 0.25


def run(*args: str) -> None:
    """``optbench ARGS`` (or ``python bench/X.py ARGS``), failing loudly."""
    command = [sys.executable, *args] if args[0].endswith(".py") else [sys.executable, "-m", "optbench", *args]
    print("+ " + " ".join(command[1:]), flush=True)
    code = subprocess.call(command, cwd=HERE.parent)
    if code:
        raise SystemExit(f"{' '.join(args[:2])} exited with {code}")


# ------------------------------------------------------------------------------------ the runs
def prepare(name: str, out: Path, args) -> dict[str, Path]:
    """The data file, its captions and tokenized training texts, and the base's checkpoints."""
    spec, d = DATA[name], out / name
    if d.exists():  # its runs would resume (or refuse to): never mix two benchmarks' runs
        raise SystemExit(f"{d} exists from an earlier run: give another --out, or --table-only to print its tables")
    d.mkdir(parents=True)
    files = {"data": d / "data.nc", "pairs": d / "captions.jsonl", "lines": d / "captions.txt",
             "tokens": d / "captions.bin", "base": d / "base"}
    run(*[a.format(file=files["data"]) for a in spec["write"]])
    run("data", "captions", str(files["data"]), str(files["pairs"]), "--lines", str(files["lines"]),
        "--eval-fraction", str(EVAL_FRACTION), *spec["captions"])
    run("data", "tokenize", str(files["lines"]), str(files["tokens"]))
    run("train", "task=lm", "data=tokens", f"data.path={files['tokens']}", f"model={args.model}",
        f"train.steps={args.base_steps}", f"checkpoint.every={args.base_steps}", "train.eval_every=0",
        f"train.seq_len={spec['seq_len']}", f"train.batch_size={args.batch_size}", "train.device=cpu",
        "log.progress=log", f"hydra.run.dir={files['base']}")
    return files


def matrix(name: str, files: dict[str, Path], out: Path, args) -> None:
    """The fused runs and their text-only controls over the frozen base."""
    spec = DATA[name]
    run("train", "-m", "task=climate_text", "data=netcdf", f"data.paths=[{files['data']}]",
        f"data.text={files['pairs']}", f"data.variables={spec['variables']}", f"data.eval_fraction={EVAL_FRACTION}",
        "data.augment.enabled=false", f"task.patch_size={spec['patch']}", f"fusion={args.fusions}",
        "task.text_only=false,true", f"model={args.model}", "fusion.freeze_base=true",
        f"fusion.base_checkpoint={files['base']}/checkpoints", f"train.steps={args.steps}",
        f"checkpoint.every={args.steps}", f"train.seq_len={spec['seq_len']}", f"train.batch_size={args.batch_size}",
        f"train.lr={args.lr}", "train.device=cpu", "log.progress=log", *args.extra,
        f"hydra.sweep.dir={out / name / 'matrix'}", "hydra.sweep.subdir=${fusion.name}-text_only_${task.text_only}",
        "hydra.callbacks.report.enabled=false")


def generate(run_dir: Path, climates: str, args) -> None:
    run("generate", str(run_dir), "--samples", str(args.samples), "--climate", climates, "--max-tokens",
        str(args.max_tokens), "--batch-size", str(args.samples), "--score", "--quiet",
        "--out", str(run_dir / f"generated-{climates.replace(',', '-')}.jsonl"))


def generate_all(name: str, out: Path, args) -> None:
    kinds = args.fusions.split(",")
    for i, kind in enumerate(kinds):
        fused = out / name / "matrix" / f"{kind}-text_only_False"
        generate(fused, "true,shuffled,base" if i == 0 else "true,shuffled", args)  # frozen base: one base
        generate(out / name / "matrix" / f"{kind}-text_only_True", "true", args)


# ----------------------------------------------------------------------------------- the table
def records(run_dir: Path) -> tuple[list[dict], dict]:
    """The generated samples and the score of a run (both files, if there are two)."""
    samples, score = [], {}
    for path in sorted(run_dir.glob("generated-*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        samples += [r for r in lines if r["kind"] == "sample"]
        score.update(next((r["score"] for r in lines if r["kind"] == "score"), {}))
    return samples, score


def information_gain(fused: list[dict], control: list[dict], *, seed: int = 0) -> dict[str, float]:
    """Text-only minus true-climate loss per token over the same generated samples (teacher-forced
    true texts), with a block-bootstrap 95% interval over time blocks."""
    true = {r["step"]: r for r in fused if r["climate"] == "true"}
    zero = {r["step"]: r for r in control if r["climate"] == "true"}
    steps = sorted(set(true) & set(zero))
    if not steps:
        return {"value": float("nan"), "low": float("nan"), "high": float("nan")}
    diff = np.array([zero[s]["nll"] - true[s]["nll"] for s in steps])
    return block_bootstrap(diff, np.array([true[s]["tokens"] for s in steps]), seed=seed)


def mae(score: dict, climate: str, quantity: str = "area mean") -> str:
    entry = score.get(climate, {}).get("numbers", {}).get(quantity)
    if entry is None:
        return "n/a"
    if entry["mae"] is None:
        return "never stated"
    return f"{entry['mae']:.2f}" + ("" if entry["stated"] == 1 else f" ({entry['stated']:.0%} stated)")


def interval(value: float, low: float, high: float) -> str:
    return f"{value:+.4f} [{low:+.4f}, {high:+.4f}]"


def row(kind: str, fused_dir: Path, control_dir: Path) -> list[str]:
    s = json.loads((fused_dir / "summary.json").read_text())
    c = json.loads((control_dir / "summary.json").read_text())
    m, cm = s["loss"]["eval_metrics"] or {}, c["loss"]["eval_metrics"] or {}
    fused, score = records(fused_dir)
    control, control_score = records(control_dir)
    gain = information_gain(fused, control)
    reads = m["fusion/loss_gap_low"] > 0
    mem, tp = s["memory"], s["throughput"]
    return [
        kind, f"{m['fusion/loss_true']:.4f}", f"{m['fusion/loss_shuffled']:.4f}", f"{cm['fusion/loss_true']:.4f}",
        interval(m["fusion/loss_gap"], m["fusion/loss_gap_low"], m["fusion/loss_gap_high"]),
        interval(gain["value"], gain["low"], gain["high"]),
        *(" / ".join(mae(sc, climate, quantity) for sc, climate in ((score, "true"), (score, "shuffled"),
                                                                     (control_score, "true")))
          for quantity in ("area mean", "regions")),
        f"{s['model']['trainable_params']:,} / {s['model']['params']:,}",
        f"{mem['peak_bytes'] / 2**20:.1f} / {mem['estimate_bytes'] / 2**20:.1f} MiB"
        if mem.get("peak_bytes") and mem.get("estimate_bytes") else "n/a",
        f"{tp['tokens_per_s']:,.0f}" if tp.get("tokens_per_s") else "n/a",
        "reads the climate" if reads else "does not read the climate (in this budget)",
    ]


HEAD = ["fusion", "loss true", "loss shuffled", "loss text-only", "gap shuffled-true [95%]",
        "gain text-only-true [95%]", "area-mean MAE (C) true / shuffled / text-only", "regions MAE (C) true / shuffled / text-only", "trainable / total params",
        "peak measured / estimate", "tokens/s", "verdict"]


def table(name: str, out: Path, kinds: list[str]) -> str:
    sweep = out / name / "matrix"
    rows = [row(k, sweep / f"{k}-text_only_False", sweep / f"{k}-text_only_True") for k in kinds
            if (sweep / f"{k}-text_only_False" / "summary.json").is_file()]
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)] + ["| " + " | ".join(r) + " |" for r in rows]
    base = records(sweep / f"{kinds[0]}-text_only_False")[1].get("base")
    if base is not None:
        lines.append(f"\nThe frozen base alone (no climate): area-mean MAE {mae({'base': base}, 'base')} C, regions "
                     f"MAE {mae({'base': base}, 'base', 'regions')} C, text loss {base['loss']:.4f} over the same "
                     "generated samples.")
    return "\n".join(lines)


def example(name: str, out: Path, kind: str) -> str:
    """One generated text beside the field's true values (the first generated sample)."""
    samples, _ = records(out / name / "matrix" / f"{kind}-text_only_False")
    if not samples:
        return ""
    first = samples[0]["step"]
    picked = {r["climate"]: r for r in samples if r["step"] == first}
    field = ", ".join(f"{k} {v:g}" for k, v in picked["true"]["field"].items())
    lines = [f"{name}, {kind}, {picked['true']['time']} ({picked['true']['sample']}):",
             f"  field values: {field}", f"  caption:  {picked['true']['reference']}"]
    lines += [f"  {climate:<9} {r['text']}" for climate, r in picked.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="synthetic,era5", help="which files: synthetic, era5 (comma list)")
    parser.add_argument("--fusions", default="add,cross_attention,gated,prefix")
    parser.add_argument("--model", default="tiny", help="the model preset of the base and the fused runs")
    parser.add_argument("--steps", type=int, default=200, help="training steps of each fused run and control")
    parser.add_argument("--base-steps", type=int, default=200, help="training steps of the task=lm base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3, help="train.lr of the fused runs")
    parser.add_argument("--samples", type=int, default=32, help="eval samples generate writes text for")
    parser.add_argument("--max-tokens", type=int, default=120, help="generated tokens (the first sentences)")
    parser.add_argument("--out", default="outputs/fusion-matrix")
    parser.add_argument("--table-only", action="store_true", help="print the tables of an earlier run")
    parser.add_argument("extra", nargs="*", help="more overrides for the fused runs")
    args = parser.parse_args(argv)
    out, kinds = Path(args.out).resolve(), args.fusions.split(",")
    for name in args.data.split(","):
        if name not in DATA:
            raise SystemExit(f"--data {name}: use synthetic, era5 or both")
        if not args.table_only:
            started = time.perf_counter()
            matrix(name, prepare(name, out, args), out, args)
            generate_all(name, out, args)
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
        print(f"\n## {name}\n\n{table(name, out, kinds)}\n\n{example(name, out, 'gated')}\n", flush=True)


if __name__ == "__main__":
    main()
