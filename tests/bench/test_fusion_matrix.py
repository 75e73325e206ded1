"""make fusion-matrix's table (bench/fusion_matrix.py), without running the benchmark: a row from a
run's summary and generated JSON lines, the verdict from the gap's interval, the information gain
paired on the same steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("fusion_matrix") as module:
        yield module


def _run(path: Path, *, metrics: dict, samples: list[dict], score: dict) -> Path:
    path.mkdir(parents=True)
    summary = {"loss": {"eval_metrics": metrics}, "memory": {"peak_bytes": 2**20, "estimate_bytes": 2**20},
               "throughput": {"tokens_per_s": 1000.0}, "model": {"trainable_params": 10, "params": 30}}
    (path / "summary.json").write_text(json.dumps(summary))
    lines = [{"kind": "sample", **s} for s in samples] + [{"kind": "score", "score": score}]
    (path / "generated-x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _numbers(mae: float | None) -> dict:
    return {"numbers": {"area mean": {"mae": mae, "stated": 1.0 if mae is not None else 0.0, "n": 4},
                        "regions": {"mae": 1.0, "stated": 0.5, "n": 16}}, "loss": 0.3}


def test_a_row_says_whether_the_gap_excludes_0_and_pairs_the_gain_by_step(bench, tmp_path):
    gap = {"fusion/loss_true": 0.2, "fusion/loss_shuffled": 0.25, "fusion/loss_gap": 0.05,
           "fusion/loss_gap_low": 0.01, "fusion/loss_gap_high": 0.09}
    true = [{"step": s, "climate": "true", "nll": 10.0, "tokens": 100.0} for s in range(40)]
    zero = [{"step": s, "climate": "true", "nll": 12.0, "tokens": 100.0} for s in range(1, 41)]  # step 40 unpaired
    fused = _run(tmp_path / "f", metrics=gap, samples=true, score={"true": _numbers(0.9), "shuffled": _numbers(3.0)})
    control = _run(tmp_path / "c", metrics={"fusion/loss_true": 0.23}, samples=zero, score={"true": _numbers(None)})
    row = dict(zip(bench.HEAD, bench.row("gated", fused, control), strict=True))
    assert row["verdict"] == "reads the climate" and row["loss text-only"] == "0.2300"
    assert row["gain text-only-true [95%]"].startswith("+0.0200 [+0.0200, +0.0200]")  # 2 nats / 100 tokens, paired
    assert row["area-mean MAE (C) true / shuffled / text-only"] == "0.90 / 3.00 / never stated"
    assert row["regions MAE (C) true / shuffled / text-only"].startswith("1.00 (50% stated)")
    crossing = _run(tmp_path / "g", metrics={**gap, "fusion/loss_gap_low": -0.001}, samples=true,
                    score={"true": _numbers(0.9), "shuffled": _numbers(3.0)})
    assert bench.row("gated", crossing, control)[-1] == "does not read the climate (in this budget)"
