"""make bench-energy (bench/bench_energy.py) at the test size: every phase built side by side and
stepped in interleaved rounds; each claim's factor is taken within a round, its median and interval
printed beside the plan's claim."""

from __future__ import annotations

import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_energy") as module:
        yield module


def test_the_interval_brackets_the_median_of_the_round_ratios(bench):
    median, low, high, least, most = bench.interval([1.0, 2.0, 3.0, 4.0, 100.0])
    assert median == 3.0 and least == 1.0 and most == 100.0 and least <= low <= median <= high <= most


def test_each_claim_is_printed_beside_the_factor_its_rounds_measured(bench, capsys):
    argv = ["--rounds", "2", "--warmup", "1", "--phases", "0_baseline,1_bridge,3_vectorized", "model=energy_tiny",
            "data.num_samples=64"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "16x: batched text bridge" in rows["1_bridge"]
    assert "41.6x: 8.33x (2_adaptive) x 5x (3_vectorized)" in rows["3_vectorized"]  # a skipped phase: the product
    assert "40x throughput" in rows["3_vectorized vs 0_baseline"]
    assert rows["3_vectorized"].count("x [") == 1 and "machine: " in out and "load average" in out


def test_phases_from_a_later_one_are_not_labelled_as_the_plans_baseline(bench):
    """``--phases 3_vectorized,...`` (the plan's experiment size on a GPU): the first row is the first
    phase measured, not "the plan before", and the last row carries the claims between the two
    phases, not the plan's 40x over its baseline."""
    rounds = [{"3_vectorized": (100.0, 5.0), "4_batch": (400.0, 5.0), "6_bf16": (420.0, 5.0)}] * 3
    rows = {line.split(" | ")[0].strip("| "): line for line in
            bench.table(["3_vectorized", "4_batch", "6_bf16"], rounds).splitlines()}
    assert "the first phase measured" in rows["3_vectorized"] and "0.5 samples/s" not in rows["3_vectorized"]
    assert "40x throughput" not in rows["6_bf16 vs 3_vectorized"]
    assert "12x: 4x (4_batch) x 2x (5_dataloader) x 1.5x (6_bf16)" in rows["6_bf16 vs 3_vectorized"]
    assert "4.20x" in rows["6_bf16 vs 3_vectorized"]
