"""Fit a GPU's efficiencies (``optbench.estimate.efficiency``) from runs measured on it.

The roofline (``optbench.estimate.roofline``) costs each op of a traced step at
max(FLOPs / (peak x matmul efficiency), bytes / (HBM bandwidth x memory efficiency), host seconds
per kernel). This script traces each measured run's own config (on this CPU, FakeTensors, as
``optbench estimate estimate.gpu=...`` does), and finds the efficiencies that minimize the squared
log error of the predicted step time over the runs marked ``fit``; the other runs are checks the fit
never saw (compiled runs: their fused kernels are the roofline's approximation). The fit is
cached in a pickle of the traced runs (``--retrace`` traces again). It prints every
run's prediction and error, and with ``--write`` stores the result with its source in
optbench/estimate/efficiency.py.

    python bench/fit_efficiency.py [--write]

The runs are the H200 figures in bench/RESULTS.md (torch 2.11.0+cu130, 2026-11-26): the
foundation smoke (base, batch 8 x 1024, eager, per precision), the phase sweep (base, seq 256)
and the 1b scale runs (compiled, fused AdamW). Phases with torchao's CPU offload are left out:
their optimizer runs on the host, which the roofline does not model.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CARD = "H200"
SOURCE = "H200 141GB, torch 2.11.0+cu130, 2026-11-26 (bench/RESULTS.md), fitted by bench/fit_efficiency.py"
SMOKE = ["model=134m", "train.batch_size=8", "train.seq_len=1024"]
SCALE = ["model=1b", "train.seq_len=2048", "train.batch_size=32", "compile=default", "optimizer=adamw_fused",
         "dataloader=tuned"]
# (name, overrides, measured seconds per optimizer step, used by the fit)
RUNS = [
    ("base fp32, batch 8 x 1024", [*SMOKE, "precision=fp32"], 0.1631, True),
    ("base tf32", [*SMOKE, "precision=tf32"], 0.0722, True),
    ("base bf16", [*SMOKE, "precision=bf16"], 0.0491, True),
    ("base fp16", [*SMOKE, "precision=fp16"], 0.0564, True),
    ("base bf16 + full AC", [*SMOKE, "precision=bf16", "ac=full"], 0.0731, True),
    ("phase 0_baseline (8 x 3 x 256)", ["model=134m", "phase=0_baseline"], 6144 / 47782, True),
    ("phase 1_compile", ["model=134m", "phase=1_compile"], 6144 / 50637, False),
    ("phase 2_checkpointing (16 x 2)", ["model=134m", "phase=2_ac"], 8192 / 47044, False),
    ("phase 3_loss_freq", ["model=134m", "phase=3_loss_freq"], 8192 / 49067, False),
    ("phase 4_dataloader", ["model=134m", "phase=4_dataloader"], 8192 / 49969, False),
    ("1b bf16 + compile + fused AdamW, 32 x 2048", [*SCALE, "precision=bf16"], 0.807, True),
    ("1b float8 + compile + fused AdamW", [*SCALE, "precision=float8"], 0.676, False),
]
PEAKS = ("float32", "tf32", "bfloat16")


@dataclass
class Traced:
    """One run's ops as arrays: weight, FLOPs, bytes, which peak, and the constant seconds (data)."""

    name: str
    measured: float
    fit: bool
    weight: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    peak: np.ndarray  # index into PEAKS, -1: not a matmul
    peak_flops: np.ndarray
    constant_s: float


def trace_run(overrides: list[str]) -> tuple:
    from optbench.config import compose, to_config
    from optbench.estimate.api import count_model
    from optbench.estimate.predict import traces_for
    from optbench.estimate.roofline import RooflineCosts
    from optbench.estimate.tracer import step_tracer

    cfg = to_config(compose([*overrides, f"estimate.gpu={CARD.lower()}"], config_name="estimate"))
    with step_tracer(cfg, world_size=1, target="cuda") as trace:
        typical, _ = traces_for(cfg, trace, cfg.train.batch_size)
    # the data wait of the measured runs happened on the GPU host's CPU, whose speed this machine
    # does not know (its own batch time, under others' load, exceeded whole measured steps): the
    # fit sees compute only, and the efficiencies absorb what a baseline loader cost there
    return cfg, typical, RooflineCosts(CARD, cfg=cfg), 0.0, count_model(cfg)


def arrays(name: str, overrides: list[str], measured: float, fit: bool) -> Traced:
    from optbench.estimate.speed import stage_weight

    cfg, typical, costs, constant, _ = trace_run(overrides)
    rows = []
    for weight, log, (stage, _phase, _block, call, fused) in typical.weighted():
        if call.kind in ("view", "collective") or (cfg.compile.name != "none" and fused):
            continue
        cost = log.costs[call]
        w = weight * stage_weight(stage, cfg.train.grad_accum)
        peak_name, peak = costs.peak(cost.dtype) if call.kind in ("matmul", "attention") else (None, 0.0)
        rows.append((w, cost.flops, cost.bytes, PEAKS.index(peak_name) if peak_name else -1, peak))
    w, f, b, p, pf = (np.array(col, dtype=float) for col in zip(*rows, strict=True))
    return Traced(name, measured, fit, w, f, b, p.astype(int), pf, constant)


def traced_runs(*, retrace: bool) -> list[Traced]:
    """Every run's ops as arrays, cached (per runs list and torch version) under optbench's cache."""
    import pickle

    import torch

    from optbench.caches import cache_dir

    key = repr((RUNS, torch.__version__))
    cache = cache_dir() / "fit_efficiency_traces.pkl"
    if not retrace and cache.exists():
        stored = pickle.loads(cache.read_bytes())
        if stored["key"] == key:
            return stored["runs"]
    runs = [arrays(*run) for run in RUNS]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_bytes(pickle.dumps({"key": key, "runs": runs}))
    return runs


def predict(run: Traced, x: np.ndarray) -> float:
    """The roofline's step time for efficiencies x = (matmul per peak..., memory, host seconds,
    matmul latency seconds)."""
    from optbench.estimate.roofline import HBM_BYTES_PER_S

    matmul, memory, host, latency = x[:3], x[3], x[4], x[5]
    compute = np.where(run.peak >= 0, run.flops / (run.peak_flops * matmul[np.maximum(run.peak, 0)] + 1e-30)
                       + latency, 0.0)
    traffic = run.nbytes / (HBM_BYTES_PER_S[CARD] * memory)
    return float(np.sum(run.weight * np.maximum(np.maximum(compute, traffic), host)) + run.constant_s)


def fit(runs: list[Traced]) -> np.ndarray:
    from scipy.optimize import minimize

    used = [r for r in runs if r.fit]

    def params(z: np.ndarray) -> np.ndarray:  # fractions in (0, 1), seconds > 0
        return np.concatenate([1 / (1 + np.exp(-z[:4])), np.exp(z[4:])])

    def loss(z: np.ndarray) -> float:
        return sum(math.log(predict(r, params(z)) / r.measured) ** 2 for r in used)

    start = np.array([1.0, 0.0, 0.0, 0.5, math.log(10e-6), math.log(5e-6)])
    best = minimize(loss, start, method="Nelder-Mead", options={"maxiter": 6000, "xatol": 1e-4, "fatol": 1e-12})
    return params(best.x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="store the fit in optbench/estimate/efficiency.py")
    parser.add_argument("--retrace", action="store_true", help="trace the runs again (else the cached traces)")
    args = parser.parse_args()
    runs = traced_runs(retrace=args.retrace)
    x = fit(runs)
    print(f"{CARD}: matmul {dict(zip(PEAKS, (round(float(v), 3) for v in x[:3]), strict=True))} of the dense peaks "
          f"+ {x[5] * 1e6:.1f} us per matmul, memory {x[3]:.3f} of HBM, host {x[4] * 1e6:.1f} us per kernel")
    print(f"{'run':<46}{'measured s':>12}{'predicted s':>13}{'error':>9}  role")
    for run in runs:
        pred = predict(run, x)
        print(f"{run.name:<46}{run.measured:>12.4f}{pred:>13.4f}{pred / run.measured - 1:>+9.1%}  "
              f"{'fit' if run.fit else 'check (not fitted)'}")
    if args.write:
        path = Path(__file__).resolve().parent.parent / "optbench" / "estimate" / "efficiency.py"
        text = path.read_text()
        head = text[:text.index("EFFICIENCY: dict[str, dict] =")]
        entry = {"matmul": {k: round(float(v), 4) for k, v in zip(PEAKS, x[:3], strict=True)},
                 "memory": round(float(x[3]), 4), "host_s": round(float(x[4]), 8),
                 "matmul_latency_s": round(float(x[5]), 8),
                 "source": f"{SOURCE}; fitted on its {sum(r.fit for r in runs)} runs marked fit"}
        path.write_text(head + f"EFFICIENCY: dict[str, dict] = {{\n    {CARD!r}: {entry!r},\n}}\n")
        print(f"written to {path}")


if __name__ == "__main__":
    main()
