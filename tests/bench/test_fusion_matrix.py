"""make fusion-matrix's statistics and verdicts (bench/fusion_stats.py, bench/fusion_matrix.py),
without running the benchmark: the gap's test over seeds, Holm's correction, the paired
block-bootstrap interval, misses counted, the ridge read-out, and which comparisons the headline
judges."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("fusion_matrix") as module:
        yield module


def test_the_gap_test_is_over_seeds_and_holm_adjusts_across_tests(bench):
    fs = bench.fs
    clear = fs.gap_test([0.030, 0.032, 0.028, 0.031, 0.029])
    assert clear["n"] == 5 and clear["low"] > fs.MIN_GAP and clear["p"] < 1e-4
    crossing = fs.gap_test([0.030, -0.010, 0.002, 0.025, -0.004])  # one good seed does not decide it
    assert crossing["low"] < 0 < crossing["high"] and crossing["p"] > 0.2
    assert fs.gap_test([0.5])["p"] == 1.0  # one seed: no spread, no verdict
    assert fs.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert fs.holm([0.001, 0.9]) == pytest.approx([0.002, 0.9])


def test_the_paired_interval_resamples_blocks_and_drops_misses(bench):
    fs = bench.fs
    times = [f"2000-01-{day:02d}T00:00:00" for day in range(1, 31)]
    blocks = fs.block_ids(times)
    assert blocks.tolist() == [d // 5 for d in range(30)]  # 5 days a block
    other = np.arange(30, dtype=float)
    shifted = fs.paired_interval(other + 1.0, other, blocks)
    assert (shifted["value"], shifted["low"], shifted["high"], shifted["n"], shifted["blocks"]) == (1.0, 1.0, 1.0, 30, 6)
    mine = other + np.where(np.arange(30) < 15, 2.0, 0.0)
    mine[[0, 29]] = np.nan  # two texts that never state the number: left out of the pairs
    varied = fs.paired_interval(mine, other, blocks)
    assert varied["n"] == 28 and varied["low"] < varied["value"] < varied["high"]
    records = [{"field": {"mean": 5.0, "region:north": 1.0}, "numbers": {"mean": 6.5}},
               {"field": {"mean": 5.0, "region:north": 1.0}, "numbers": {}}]
    err, share = fs.errors(records, "area mean")
    assert err[0] == 1.5 and math.isnan(err[1]) and share.tolist() == [1.0, 0.0]


def test_the_ridge_read_out_recovers_a_linear_field(bench):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(40, 200)), rng.normal(size=200)
    x_new = rng.normal(size=(5, 200))
    got = bench.fs.ridge(x, x @ w + 3.0, x_new, lam=1e-6)
    assert np.corrcoef(got, x_new @ w + 3.0)[0, 1] > 0.2  # more features than samples: a shrunk read-out
    small = rng.normal(size=(60, 3))
    assert bench.fs.ridge(small, small @ [1.0, -2.0, 0.5] + 3.0, small[:4], lam=1e-9) == pytest.approx(
        small[:4] @ [1.0, -2.0, 0.5] + 3.0, abs=1e-5)


def _versus(low: float, high: float, blocks: int) -> dict:
    return {"mae": 1.0, "stated": 1.0, "value": (low + high) / 2, "low": low, "high": high, "n": 10, "blocks": blocks}


def test_the_headline_judges_only_intervals_from_enough_blocks(bench):
    result = {"gap": bench.fs.gap_test([0.03, 0.031, 0.029]), "quantities": {
        "area mean": {"mae": 1.0, "stated": 1.0, "versus": {"best constant (training mean)": _versus(-0.9, -0.2, 6),
                                                            "persistence (the last input step's value)":
                                                                _versus(-0.9, -0.2, 3)}},
        "regions": {"mae": 1.0, "stated": 1.0, "versus": {"best constant (training mean)": _versus(0.1, 0.4, 6)}},
        "points": {"mae": 1.0, "stated": 1.0, "versus": {"best constant (training mean)": _versus(-0.9, -0.2, 6)}}}}
    tie = {"gap": bench.fs.gap_test([0.03, -0.02, 0.001]), "quantities": {}}
    bench.verdicts([result, tie])
    assert result["verdict"].startswith("reads the climate") and tie["verdict"].startswith("no evidence")
    assert result["gap"]["p_holm"] == pytest.approx(2 * result["gap"]["p"])
    assert result["beats"] == ["best constant (training mean) (area mean)"]  # persistence: 3 blocks, not judged
    assert result["loses_to"] == ["best constant (training mean) (regions)"]  # points: not in the headline
    assert bench.mae_cell(math.nan, 0.0) == "never stated (0%)" and bench.mae_cell(1.234, 0.5) == "1.23 (50%)"


def test_resume_goes_on_only_with_the_same_sizes_and_keeps_what_is_complete(bench, tmp_path):
    args = bench.argparse.Namespace(resume=False, **{k: 1 for k in bench.SIZES})
    with pytest.raises(SystemExit, match="no earlier run"):
        bench.claim(tmp_path / "out", bench.argparse.Namespace(**{**vars(args), "resume": True}))
    bench.claim(tmp_path / "out", args)
    record = (tmp_path / "out" / "matrix.json").read_text()
    with pytest.raises(SystemExit, match="--resume to go on"):
        bench.claim(tmp_path / "out", args)  # a second benchmark never mixes its runs with the first's
    bench.claim(tmp_path / "out", bench.argparse.Namespace(**{**vars(args), "resume": True}))
    with pytest.raises(SystemExit, match="--steps 1 there, 400 here"):
        bench.claim(tmp_path / "out", bench.argparse.Namespace(**{**vars(args), "resume": True, "steps": 400}))
    assert (tmp_path / "out" / "matrix.json").read_text() == record  # nothing rewritten
    run = tmp_path / "run"
    run.mkdir()
    assert not bench.completed(run)
    (run / "summary.json").write_text('{"status": "interrupted"}')
    assert not bench.completed(run)  # an interrupted base is trained again
    (run / "summary.json").write_text('{"status": "completed"}')
    assert bench.completed(run)
