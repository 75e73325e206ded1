"""Does the climate-aware language model read the climate, and is what it writes better than what
simpler things get? (``make fusion-matrix``; ``--quick`` for minutes)

Per data file — ``synthetic`` (``optbench data synth``, a global grid), ``era5`` (``bench/era5_like.py``:
an ERA5 download's layout, synthetic values), ``era5uk`` (real ERA5 2 m temperature over the UK,
March 2019, ``bench/data/``) and ``ncep`` (real NCEP reanalysis air temperature over North America,
6-hourly 2013-2014, xarray's tutorial file, ``bench/data/``: trained on 2013, judged on the whole of
2014) — and per text mode (``describe``: the text of the last input step; ``forecast``: of the
step after it), with optbench's own commands only:

1. captions (``optbench data captions --mode M --eval-fraction F``); a ``task=lm`` base trained on
   the training steps' texts (one per file);
2. ``task=climate_text`` x ``fusion=<kinds>`` x ``task.text_only=false,true`` x ``train.seed=0..N-1``
   over the frozen base: each fused model and its all-zero-climate control, N trainings each;
3. ``optbench generate RUN... --score`` on the same strided eval samples for every run (one process
   for a matrix's fused runs, one for its controls): the fused
   models with their own climate, another eval sample's (``shuffled``) and a random training
   sample's (``train``: the input distribution they were trained on, at the wrong time); the
   controls with theirs (all zeros);
4. the baselines, from the field on the same samples: the best constant (training mean), the
   hour-of-day climatology of the training steps, persistence (forecast), a ridge read-out of the
   input frames trained on the training steps; and per fused run a linear probe of its trained
   encoder (``bench/fusion_probe.py``: the same ridge on the encoder's output tokens, from the run's
   checkpoint, so runs trained before it was added get it too);
5. per file and mode: the loss gap (shuffled - true climate, per token) mean +- sd over seeds with
   its t interval (and the gap to the ``train`` climate, from the generated samples' teacher-forced
   losses) and the verdict (one-sided t-test over seeds of gap > MIN_GAP, Holm-corrected over
   every file x mode x kind); per quantity the MAE (C or K) of the numbers the generated texts
   state, averaged over seeds, with the share stated (a text that does not state it is a miss,
   counted), and the difference to every control and baseline with a paired block-bootstrap 95%
   interval (blocks of 5 days); for ``gated``, how open each fused layer's gates are at each run's
   last checkpoint (``|tanh(alpha)|``: where the loss gap is ~0, whether the climate was shut out).

The printed tables go to ``--results``/fusion-matrix-NAME.md (``--name``; quick or full by default); beside them the aggregated
results (``.jsonl``, one line per file x mode x kind) and the raw lines (``.raw.jsonl``: one per run
with its gaps and per-sample errors per quantity and climate, one per baseline with its per-sample
errors; a fused run's line has its probe's per-sample errors and, for ``gated``, its gate openings), from which every number of the tables is recomputed.

    python bench/fusion_matrix.py [--quick] [--data synthetic,era5,era5uk,ncep] [--modes describe,forecast] [--base own|hf]
        [--encoder fresh|forecaster]
        [--fusions gated,cross_attention] [--seeds 5] [--steps 200] [--samples 48] [--eval-samples 128]
        [--out outputs/fusion-matrix] [--results bench/results] [--name NAME] [--resume] [--table-only]
        [extra train overrides ...]

An interrupted run goes on with the same command and ``--resume``: every data file, captions file,
base and generated file already complete is kept, a seed whose every run completed is not launched
again (so a copy of ``--out`` resumes too), and each Hydra multirun skips its finished jobs
(``optbench.run.sweep``); ``--out``'s ``matrix.json`` records the sizes, and a resume with other
sizes is refused (files, modes, kinds and seeds may be added: ``--seeds 5`` goes on from 3).

``--quick`` (gated only, 2 seeds, 20 steps of batch 4 and a 20-step base, 12 generated texts of 24
eval samples, 60-day synthetic files) runs every file, mode, control and baseline in about 3
minutes on 2 quiet cores: it checks the pipeline; at that size the models state no number yet. The
default size takes about 55 minutes there (120 trainings of 200 steps and their texts).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fusion_probe as fp  # noqa: E402
import fusion_stats as fs  # noqa: E402

# a quantity no text of a run states has no mean error: NaN, reported as "never stated"
warnings.filterwarnings("ignore", "Mean of empty slice", RuntimeWarning)

# per file: how it is written, what is captioned, the text length and the patching
DATA = {
    "synthetic": {"write": ["data", "synth", "{file}", "--days", "{days}", "--nlat", "16", "--nlon", "32",
                            "--levels", "1000"],
                  "captions": ["--variables", "temperature"], "seq_len": 224, "patch": 4,
                  "variables": "[temperature]", "eval_fraction": 0.4},
    "era5": {"write": ["bench/era5_like.py", "{file}", "--days", "{days}"], "captions": [], "seq_len": 200,
             "patch": 8, "variables": "[t2m]", "eval_fraction": 0.4},
    "era5uk": {"copy": "bench/data/era5uk_2019-03_t2m_3h.nc", "captions": [], "seq_len": 200, "patch": 8,
               "variables": "[t2m]", "eval_fraction": 0.4},
    # 2920 steps: the last half is exactly 2014, held out whole (73 blocks of 5 days)
    "ncep": {"copy": "bench/data/ncep_air_2013-2014_6h.nc", "captions": [], "seq_len": 200, "patch": 8,
             "variables": "[air]", "eval_fraction": 0.5},
}
QUANTITIES = ("area mean", "regions", "points", "anomaly", "trend")
HEADLINE = ("area mean", "regions")  # the main table's beats / loses to (the synthetic file's area mean is constant)
MIN_BLOCKS = 5  # a paired interval from fewer blocks is printed but judges nothing
CONTROL = "all-zero climate (text-only control, trained)"
QUESTIONS = {
    CONTROL: "does the climate input add anything over the texts' own regularities?",
    "shuffled climate (another eval sample's)": "does the model use this sample's climate, not any climate?",
    "training climate (a random training sample's)": "does it use this sample's climate, not any climate of the "
                                                     "distribution it was trained on?",
    "best constant (training mean)": "is it better than always saying the training mean?",
    "climatology (training mean for the hour of day)": "is it better than the hour-of-day climatology?",
    "persistence (the last input step's value)": "does the forecast beat 'as at the last input step'?",
    "linear read-out of the input (ridge)": "how close is it to what a linear read-out of the input gets?",
    fp.LABEL: fp.QUESTION,
}


# in a job of --jobs N > 1 (a thread per file x mode, each launching its commands): its log and threads
_JOB = threading.local()


def run(*args: str) -> None:
    """``optbench ARGS`` (or ``python bench/X.py ARGS``), failing loudly. In a parallel job its output
    goes to the job's log (the command line is printed here too) and it gets the job's share of the
    cores as its intra-op threads (``OMP_NUM_THREADS`` where the caller has not set it)."""
    command = [sys.executable, *args] if args[0].endswith(".py") else [sys.executable, "-m", "optbench", *args]
    log: Path | None = getattr(_JOB, "log", None)
    # one write per line: the jobs' threads print beside each other, and print() writes the end apart
    sys.stdout.write("+ " + " ".join(command[1:]) + (f"  (output: {log})" if log else "") + "\n")
    sys.stdout.flush()
    if log is None:
        code = subprocess.call(command, cwd=HERE.parent)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(_JOB.threads)}
        with log.open("a") as out:
            out.write("+ " + " ".join(command[1:]) + "\n")
            out.flush()
            code = subprocess.call(command, cwd=HERE.parent, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code:
        raise SystemExit(f"{' '.join(args[:2])} exited with {code}" + (f" (its output: {log})" if log else ""))


def run_all(names: list[str], out: Path, args) -> None:
    """Per file its data, captions and base (``prepare``), then per mode its fused runs and texts
    (``matrix``): one after the other, or ``args.jobs`` at a time (at most one per file x mode), each
    job with its log (``out/FILE/prepare.log``, ``out/FILE/MODE.log``) and ``CPUs // jobs`` threads
    per command, a file's matrices once its base is trained. Every job runs to its end; the first
    failure is raised after them (what completed is kept for ``--resume``)."""
    earlier = [out / name for name in names if (out / name).exists() and not args.resume]
    if earlier:  # before anything is written: their runs would resume (or refuse to), never mix two benchmarks'
        raise SystemExit(f"{earlier[0]} exists from an earlier run: give another --out, --resume to go on with it, "
                         "or --table-only to print its tables")
    for name in names:
        (out / name).mkdir(parents=True, exist_ok=True)
    pairs = [(name, mode) for name in names for mode in args.modes]
    jobs = min(args.jobs, len(pairs))
    if jobs <= 1:
        for name in names:
            prepare(name, out, args)
        for name, mode in pairs:
            matrix(name, mode, out / name / "data.nc", out, args)
        return
    threads = max(1, (os.cpu_count() or 1) // jobs)

    def job(log: Path, work, after: concurrent.futures.Future | None = None) -> None:
        if after is not None:
            after.result()  # the file's base: its failure is this job's too
        _JOB.log, _JOB.threads = log, threads
        work()

    # the bases are queued first, so a matrix waiting for its base never holds the worker that base needs
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        bases = {name: pool.submit(job, out / name / "prepare.log", functools.partial(prepare, name, out, args))
                 for name in names}
        futures = [*bases.values(), *(
            pool.submit(job, out / name / f"{mode}.log",
                        functools.partial(matrix, name, mode, out / name / "data.nc", out, args), bases[name])
            for name, mode in pairs)]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        raise failed[0]


# ------------------------------------------------------------------------------------ the runs
def prepare(name: str, out: Path, args) -> Path:
    """The data file and the base (trained on the describe captions' training texts); with
    ``--resume`` each step whose output is complete is skipped (a file is written whole or not at all,
    the base is done when its summary says completed)."""
    spec, d = DATA[name], out / name
    data = d / "data.nc"
    if not data.is_file():
        partial = d / "data.partial.nc"  # renamed when whole: an interrupted write is never taken for the file
        if "copy" in spec:
            shutil.copyfile(HERE.parent / spec["copy"], partial)
        else:
            run(*[a.format(file=partial, days=args.days) for a in spec["write"]])
        partial.replace(data)
    for mode in args.modes:
        if not (d / f"{mode}.txt").is_file():  # written last, whole, after the captions and their sidecar
            run("data", "captions", str(data), str(d / f"{mode}.jsonl"), "--lines", str(d / f"{mode}.txt"), "--mode",
                mode, "--eval-fraction", str(spec["eval_fraction"]), *spec["captions"])
    if not completed(d / "base"):
        run("data", "tokenize", str(d / f"{args.modes[0]}.txt"), str(d / "captions.bin"))
        run("train", "task=lm", "data=tokens", f"data.path={d / 'captions.bin'}", f"model={args.model}",
            f"train.steps={args.base_steps}", f"checkpoint.every={args.base_steps}", "train.eval_every=0",
            f"train.seq_len={spec['seq_len']}", f"train.batch_size={args.batch_size}", "train.device=cpu",
            "log.progress=log", f"hydra.run.dir={d / 'base'}")
    if args.encoder == "forecaster" and not completed(d / "forecaster"):
        # the climate encoder's trunk, trained to forecast the field on the training steps only (the
        # same split as the captions'), at the fused runs' width, patching and history
        run("train", "task=climate", "data=netcdf", f"data.paths=[{data}]", f"data.variables={spec['variables']}",
            f"data.eval_fraction={spec['eval_fraction']}", f"task.patch_size={spec['patch']}", f"model={args.model}",
            f"train.steps={args.base_steps}", f"checkpoint.every={args.base_steps}", f"train.batch_size={args.batch_size}",
            "train.device=cpu", "log.progress=log", f"hydra.run.dir={d / 'forecaster'}")
    if args.base == "hf" and not (d / "base-hf" / "config.json").is_file():
        partial = d / "base-hf.partial"  # renamed when whole: an interrupted export is never taken for the base
        shutil.rmtree(partial, ignore_errors=True)
        run("export", str(d / "base"), str(partial))
        partial.replace(d / "base-hf")
    return data


def base_overrides(d: Path, args) -> list[str]:
    """The fused runs' base: optbench's decoder from the base run's checkpoint (``own``), or the same
    weights exported in Hugging Face's format and fused as ``model=hf`` (``hf``: transformers' code runs
    the decoder, the fusion goes in by hooks; the texts in the base's own byte tokens)."""
    if args.base == "hf":
        return ["model=hf", f"model.hf.config={d / 'base-hf'}", f"model.hf.weights={d / 'base-hf'}", "data.tokenizer=bytes"]
    return [f"model={args.model}", f"fusion.base_checkpoint={d / 'base'}/checkpoints"]


def encoder_overrides(d: Path, args) -> list[str]:
    """The climate encoder: initialized fresh (``fresh``) or from the forecaster's trunk
    (``forecaster``: ``fusion.encoder_checkpoint``, trained on with the fusion layers, not frozen)."""
    return [f"fusion.encoder_checkpoint={d / 'forecaster'}"] if args.encoder == "forecaster" else []


def completed(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run whose summary says it completed."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "completed"
    except (OSError, ValueError):
        return False


# what every run of one --out directory must share: --resume refuses other values (files, modes,
# kinds and seeds may be added: their runs are new)
SIZES = ("model", "base", "encoder", "days", "steps", "base_steps", "batch_size", "lr", "samples", "eval_samples", "extra")
EARLIER = {"base": "own", "encoder": "fresh"}  # a run recorded before these sizes existed had these


def claim(out: Path, args) -> None:
    """Record the sizes of a new benchmark in ``out/matrix.json``; with ``--resume`` check that the
    earlier run there had the same, so no run of other sizes joins its tables."""
    record, sizes = out / "matrix.json", {k: getattr(args, k) for k in SIZES}
    if not args.resume:
        if record.exists():
            raise SystemExit(f"{out} holds an earlier run of this benchmark: give another --out, --resume to go on "
                             "with it, or --table-only to print its tables")
        out.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(sizes, indent=1) + "\n")
        return
    try:
        earlier = json.loads(record.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--resume: {record} unreadable ({e}): no earlier run of this benchmark there; drop --resume") from None
    earlier = {**EARLIER, **earlier}
    differ = [f"--{k.replace('_', '-')} {earlier.get(k)} there, {sizes[k]} here" for k in SIZES if earlier.get(k) != sizes[k]]
    if differ:
        raise SystemExit(f"--resume {out}: its runs had other sizes ({'; '.join(differ)}): resume with the same, "
                         "or give another --out")


def matrix(name: str, mode: str, data: Path, out: Path, args) -> None:
    """The fused runs and their all-zero controls over the frozen base, every seed; then the texts."""
    spec, d = DATA[name], out / name
    seeds = todo_seeds(d / mode, args)
    if seeds:
        sweep(name, mode, data, out, args, seeds)
    else:
        print(f"{d / mode}: every run of seeds 0-{args.seeds - 1} completed earlier: kept", flush=True)
    # the texts: a generated file is written whole, so a resumed benchmark keeps it; one generate
    # process per climate list (the fused runs', the controls'), every run of it in turn
    todo = [r for r in sorted((d / mode).glob("*-seed*")) if not (r / "generated.jsonl").is_file()]
    for control in (False, True):
        runs = [str(r) for r in todo if ("text_only_True" in r.name) == control]
        if runs:
            run("generate", *runs, "--samples", str(args.samples), "--climate", "true" if control else "true,shuffled,train",
                "--max-tokens", str(spec["seq_len"]), "--batch-size", str(args.samples), "--score", "--show", "0",
                "--out-name", "generated.jsonl")


def sweep(name: str, mode: str, data: Path, out: Path, args, seeds: list[int]) -> None:
    """One Hydra multirun: every kind, fused and control, over ``seeds``."""
    spec, d = DATA[name], out / name
    run("train", "-m", "task=climate_text", "data=netcdf", f"data.paths=[{data}]", f"data.text={d / f'{mode}.jsonl'}",
        f"data.variables={spec['variables']}", f"data.eval_fraction={spec['eval_fraction']}",
        f"task.patch_size={spec['patch']}", f"fusion={','.join(args.fusions)}", "task.text_only=false,true",
        f"train.seed={','.join(map(str, seeds))}", *base_overrides(d, args), *encoder_overrides(d, args),
        "fusion.freeze_base=true",
        f"train.steps={args.steps}",
        f"train.seq_len={spec['seq_len']}", f"train.batch_size={args.batch_size}", f"train.lr={args.lr}",
        f"task.eval_samples={args.eval_samples}", "train.device=cpu", "log.progress=log", "measure.track_memory=false",
        "estimate.predict=false", *args.extra,
        f"hydra.sweep.dir={d / mode}",
        "hydra.sweep.subdir=${fusion.name}-text_only_${task.text_only}-seed${train.seed}",
        "hydra.callbacks.report.enabled=false")


def todo_seeds(sweep_dir: Path, args) -> list[int]:
    """The seeds with a run still to train: a seed whose every run (each kind, fused and control)
    completed is not launched again. Its runs are kept as they are, even when they were trained in
    another copy of ``--out`` (their config records other paths, so the sweep's own check, the same
    config hash, would train them again): ``matrix.json``'s sizes are what a resume checks."""
    runs = [(kind, control) for kind in args.fusions for control in (False, True)]
    return [s for s in range(args.seeds)
            if not all(completed(sweep_dir / f"{kind}-text_only_{control}-seed{s}") for kind, control in runs)]


# ----------------------------------------------------------------------------------- the table
def samples(run_dir: Path, climate: str) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "generated.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("kind") == "sample" and r["climate"] == climate]


def text_loss(run_dir: Path, climate: str) -> float:
    """Per token: the teacher-forced loss of the generated samples' true texts under ``climate``."""
    picked = samples(run_dir, climate)
    return sum(r["nll"] for r in picked) / sum(r["tokens"] for r in picked)


def raw_lines(name: str, mode: str, d: Path, kinds: list[str], field: fs.Field) -> list[dict]:
    """One line per run (its gaps, per sample and quantity the error of each climate's text, NaN: not
    stated) and one per baseline (its per-sample errors), in the eval samples' order."""
    lines, ref = [], None
    for kind in kinds:
        for control in (False, True):
            for r in seed_runs(d, kind, control):
                metrics = json.loads((r / "summary.json").read_text())["loss"]["eval_metrics"]
                climates = ("true",) if control else ("true", "shuffled", "train")
                ref = ref or samples(r, "true")
                lines.append({"file": name, "mode": mode, "run": r.name, "kind": kind, "text_only": control,
                              "gap": None if control else metrics["fusion/loss_gap"],
                              "loss": {c: text_loss(r, c) for c in climates},
                              "steps": [x["step"] for x in samples(r, "true")],
                              "errors": {c: {q: _nan_none(fs.errors(samples(r, c), q)[0]) for q in QUANTITIES}
                                         for c in climates},
                              "probe": None if control else {q: _nan_none(fp.probe_errors(
                                  [r], samples(r, "true"), q, data=d.parent / "data.nc",
                                  text=d.parent / f"{mode}.jsonl")) for q in QUANTITIES},
                              "gates": fp.gate_openings(r, data=d.parent / "data.nc", text=d.parent / f"{mode}.jsonl")
                              if kind == "gated" and not control else None})
    if ref is not None:
        for label, pred in field.baselines([x["step"] for x in ref]).items():
            lines.append({"file": name, "mode": mode, "baseline": label,
                          "errors": {q: _nan_none(fs.baseline_errors(pred, ref, q)) for q in QUANTITIES}})
    return lines


def _nan_none(values: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else round(float(v), 5) for v in values]


def seed_runs(d: Path, kind: str, control: bool) -> list[Path]:
    return sorted(p for p in d.glob(f"{kind}-text_only_{control}-seed*") if (p / "generated.jsonl").is_file())


def mean_over_seeds(runs: list[Path], climate: str, quantity: str) -> tuple[np.ndarray, float]:
    """Per sample: the error averaged over the seeds whose text states it; the share stated over
    every text of every seed (misses counted)."""
    errs, shares = zip(*(fs.errors(samples(r, climate), quantity) for r in runs), strict=True)
    e = np.array(errs)
    with np.errstate(all="ignore"):
        per = np.nanmean(e, axis=0)
    return per, float(np.nanmean(np.array(shares)))


def kind_rows(name: str, mode: str, d: Path, kind: str, field: fs.Field) -> tuple[dict, list[dict]]:
    """The gap over seeds and, per quantity, the fused model's MAE against every comparison."""
    fused = seed_runs(d, kind, False)
    gaps = [json.loads((r / "summary.json").read_text())["loss"]["eval_metrics"]["fusion/loss_gap"] for r in fused]
    ref = samples(fused[0], "true")
    steps, blocks = [r["step"] for r in ref], fs.block_ids([r["time"] for r in ref])
    base = field.baselines(steps)
    train_gaps = [text_loss(r, "train") - text_loss(r, "true") for r in fused]
    result = {"file": name, "mode": mode, "kind": kind, "seeds": len(fused), "gap": fs.gap_test(gaps), "gaps": gaps,
              "train_gap": fs.gap_test(train_gaps), "train_gaps": train_gaps,
              "samples": len(ref), "blocks": int(len(np.unique(blocks))), "quantities": {}}
    if kind == "gated":
        result["gates"] = [fp.gate_openings(r, data=d.parent / "data.nc", text=d.parent / f"{mode}.jsonl")
                           for r in fused]
    for quantity in QUANTITIES:
        if not any(fs.quantity_of(k) == quantity for k in ref[0]["field"]):
            continue
        mine, stated = mean_over_seeds(fused, "true", quantity)
        others = {"shuffled climate (another eval sample's)": mean_over_seeds(fused, "shuffled", quantity),
                  "training climate (a random training sample's)": mean_over_seeds(fused, "train", quantity)}
        control = seed_runs(d, kind, True)
        if control:
            others[CONTROL] = mean_over_seeds(control, "true", quantity)
        for label, pred in base.items():
            others[label] = (fs.baseline_errors(pred, ref, quantity), 1.0)
        others[fp.LABEL] = (fp.probe_errors(fused, ref, quantity, data=d.parent / "data.nc",
                                            text=d.parent / f"{mode}.jsonl"), 1.0)
        result["quantities"][quantity] = {
            "mae": float(np.nanmean(mine)), "stated": stated,
            "versus": {label: {"mae": float(np.nanmean(e)), "stated": s, **fs.paired_interval(mine, e, blocks)}
                       for label, (e, s) in others.items()}}
    return result, []


def verdicts(results: list[dict]) -> None:
    adjusted = fs.holm([r["gap"]["p"] for r in results])
    for r, p in zip(results, adjusted, strict=True):
        r["gap"]["p_holm"] = p
        reads = p < fs.ALPHA
        r["verdict"] = (f"reads the climate (gap > {fs.MIN_GAP} nats/token over seeds, Holm p={p:.3g})" if reads
                        else f"no evidence that it reads the climate (Holm p={p:.3g})")
        judged = [(f"{label} ({q})", v) for q in HEADLINE for label, v in
                  r["quantities"].get(q, {}).get("versus", {}).items() if v["blocks"] >= MIN_BLOCKS]
        r["beats"] = [name for name, v in judged if v["high"] < 0]
        r["loses_to"] = [name for name, v in judged if v["low"] > 0]


def mae_cell(mae: float, stated: float) -> str:
    """An MAE and the share of texts that state the quantity ("never stated": every text a miss)."""
    if isinstance(stated, float) and stated == 0:
        return "never stated (0%)"
    return f"{mae:.2f} ({stated:.0%})"


def fmt(v: float, digits: int = 2) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.{digits}f}"


def table(results: list[dict]) -> str:
    head = ["file", "mode", "fusion", "seeds", "gap mean ± sd [95% over seeds]", "verdict",
            "gap to a training climate mean ± sd",
            "area-mean MAE (stated)", "regions MAE (stated)", "beats (interval < 0)", "loses to (interval > 0)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        g, area, regions = r["gap"], r["quantities"].get("area mean", {}), r["quantities"].get("regions", {})
        lines.append("| " + " | ".join([
            r["file"], r["mode"], r["kind"], str(r["seeds"]),
            f"{g['mean']:+.4f} ± {g['sd']:.4f} [{g['low']:+.4f}, {g['high']:+.4f}]", r["verdict"],
            f"{r['train_gap']['mean']:+.4f} ± {r['train_gap']['sd']:.4f}",
            mae_cell(area.get("mae", math.nan), area.get("stated", math.nan)),
            mae_cell(regions.get("mae", math.nan), regions.get("stated", math.nan)),
            "; ".join(r["beats"]) or "none", "; ".join(r["loses_to"]) or "none"]) + " |")
    return "\n".join(lines)


def gates_table(results: list[dict]) -> str:
    """How open the gated kind's gates are at each run's last checkpoint, per fused layer: mean over
    seeds [min, max] of ``|tanh(alpha)|``. Empty where no gated kind was run."""
    rows = [r for r in results if r.get("gates")]
    if not rows:
        return ""
    columns = list(dict.fromkeys((index, gate) for r in rows for seed in r["gates"] for index, gates in seed.items()
                                 for gate in gates))
    lines = ["Gate openings of `gated` at each run's last checkpoint: |tanh(alpha)| of the cross-attention (attn) "
             "and MLP gate of each fused layer (named by the decoder layer it precedes; 0 at initialization: "
             "closed, the layer adds nothing to the decoder; 1: fully open), mean over seeds [min, max]:", "",
             "| file | mode | seeds | " + " | ".join(f"layer {i} {g}" for i, g in columns) + " |",
             "|" + "---|" * (3 + len(columns))]
    for r in rows:
        cells = []
        for index, gate in columns:
            values = [seed[index][gate] for seed in r["gates"] if index in seed]
            cells.append(f"{np.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]")
        lines.append(f"| {r['file']} | {r['mode']} | {len(r['gates'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail(r: dict) -> str:
    """Per quantity: the fused model's MAE and every comparison's, with the paired difference."""
    head = f"\n{r['file']}, {r['mode']}, {r['kind']} ({r['seeds']} seeds, {r['samples']} eval samples in {r['blocks']} " \
           "blocks of 5 days): MAE of the stated numbers; difference fused - other [95% paired block bootstrap]"
    lines = [head, "| quantity | fused (stated) | vs | its MAE (stated) | fused - it [95%] | the question |",
             "|---|---|---|---|---|---|"]
    for quantity, q in r["quantities"].items():
        for label, v in q["versus"].items():
            few = f"; {v['blocks']} blocks: too few to judge" if v["blocks"] < MIN_BLOCKS else ""
            lines.append(f"| {quantity} | {mae_cell(q['mae'], q['stated'])} | {label} | {mae_cell(v['mae'], v['stated'])} "
                         f"| {fmt(v['value'])} [{fmt(v['low'])}, {fmt(v['high'])}] "
                         f"(n={v['n']}{few}) | "
                         f"{QUESTIONS.get(label, '')} |")
    return "\n".join(lines)


def report(out: Path, args) -> tuple[str, list[dict], list[dict]]:
    results, raw = [], []
    for name in args.data:
        for mode in args.modes:
            d = out / name / mode
            if not d.is_dir():
                continue
            field = fs.Field(out / name / "data.nc", out / name / f"{mode}.jsonl")
            kinds = [kind for kind in args.fusions if seed_runs(d, kind, False)]
            results += [kind_rows(name, mode, d, kind, field)[0] for kind in kinds]
            raw += raw_lines(name, mode, d, kinds, field)
    verdicts(results)
    rule = (f"Verdict rule: a kind reads the climate when the one-sided t-test over seeds of 'loss gap > {fs.MIN_GAP} "
            f"nats/token' (shuffled - true climate, per token, each seed's gap over the run's strided eval samples) "
            f"has a Holm-adjusted p < {fs.ALPHA} across all {len(results)} file x mode x kind tests. MAEs are averaged "
            "over seeds per sample; 'stated' is the share of (sample, seed) texts that state the quantity (a text "
            "that does not is a miss, and its sample is left out of that comparison's pairs). 'beats' / 'loses to': "
            f"the comparisons of {' and '.join(HEADLINE)} whose paired block-bootstrap 95% interval of fused - other "
            f"lies below / above 0, from at least {MIN_BLOCKS} blocks of {fs.BLOCK_DAYS:g} days (fewer: printed, not "
            "judged).")
    gates = gates_table(results)
    text = "\n".join([table(results), "", rule, *(["", gates] if gates else []), *(detail(r) for r in results)])
    return text, results, raw


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="minutes: gated only, 2 seeds, 20 steps of batch 4, 12 generated of 24 eval samples, 60 days")
    parser.add_argument("--data", default="synthetic,era5,era5uk")
    parser.add_argument("--modes", default="describe,forecast")
    parser.add_argument("--fusions", default="gated,cross_attention")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--base", choices=("own", "hf"), default="own",
                        help="the fused runs' frozen base: own (optbench's decoder, from the base run's checkpoint) or "
                             "hf (the same base exported with optbench export, fused as model=hf)")
    parser.add_argument("--encoder", choices=("fresh", "forecaster"), default="fresh",
                        help="the fused runs' climate encoder: fresh, or initialized from a forecaster (task=climate) "
                             "trained on the training steps (fusion.encoder_checkpoint), then trained with the fusion")
    parser.add_argument("--days", type=int, default=240, help="days of the synthetic and ERA5-like files")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--base-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--samples", type=int, default=48, help="eval samples generate writes text for")
    parser.add_argument("--eval-samples", type=int, default=128, help="task.eval_samples of the fused runs")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="jobs at a time (default: the CPUs; at most one per file x mode): each file's base, then "
                             "its file x mode matrices, each with CPUs/jobs threads and its output in "
                             "OUT/FILE/prepare.log or OUT/FILE/MODE.log")
    parser.add_argument("--out", default="outputs/fusion-matrix")
    parser.add_argument("--results", default="bench/results", help="where the tables and raw JSON lines go")
    parser.add_argument("--table-only", action="store_true", help="print the tables of an earlier run")
    parser.add_argument("--resume", action="store_true",
                        help="go on with an interrupted run in --out (same sizes): what is complete is kept")
    parser.add_argument("--name", help="the results files' name, fusion-matrix-NAME.* (default: quick or full)")
    parser.add_argument("extra", nargs="*", help="more overrides for the fused runs")
    args = parser.parse_args(argv)
    if args.quick:  # every file, mode, control and baseline, at a size that says nothing yet: it shows the pipeline
        args.fusions, args.seeds, args.steps, args.base_steps, args.samples, args.days = "gated", 2, 20, 20, 12, 60
        args.batch_size, args.eval_samples = 4, 24
    args.data, args.modes, args.fusions = args.data.split(","), args.modes.split(","), args.fusions.split(",")
    bad = [n for n in args.data if n not in DATA]
    if bad:
        raise SystemExit(f"--data {','.join(bad)}: use {', '.join(DATA)}")
    absent = [f"{n} ({DATA[n]['copy']})" for n in args.data if "copy" in DATA[n] and not (HERE.parent / DATA[n]["copy"]).is_file()]
    if absent and not args.table_only:  # before anything is written under --out
        raise SystemExit(f"--data {', '.join(absent)}: the file is absent: put it there as bench/data/README.md says, "
                         "or leave that file out of --data")
    out, started = Path(args.out).resolve(), time.perf_counter()
    if not args.table_only:
        claim(out, args)
        run_all(args.data, out, args)
    text, results, raw = report(out, args)
    where = (f"{platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end, "
             f"{time.perf_counter() - started:.0f} s")
    text = f"{where}; {' '.join(sys.argv[1:]) or 'defaults'}\n\n{text}"
    print(text, flush=True)
    write_results(Path(args.results), args.name or ("quick" if args.quick else "full"), text, results, raw)


def write_results(results_dir: Path, name: str, text: str, results: list[dict], raw: list[dict]) -> None:
    """The printed tables and, beside them, the aggregated and the raw JSON lines."""
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"fusion-matrix-{name}.md").write_text(text + "\n")
    (results_dir / f"fusion-matrix-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    (results_dir / f"fusion-matrix-{name}.raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))


if __name__ == "__main__":
    main()
