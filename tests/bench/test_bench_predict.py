"""make bench-predict's verdict (bench/bench_predict.py), without running the benchmark: the error
per row, NO VERDICT when the machine moved more than the goal (or others used the CPUs), else PASS
or FAIL against +-10%."""

from __future__ import annotations

import math

import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_predict") as module:
        yield module


STEADY = [1.00, 1.01, 1.02, 1.01, 1.00]


def row(bench, name: str, predicted: float, *, probes=(100.0, 101.0), moved=0.01, others=0.01, steps=STEADY):
    r = bench.Row(name, "tiny", [])
    r.runs.append(bench.Run(predicted=predicted, measured=1.01, steps=list(steps), probes=probes, moved=moved,
                            others=others))
    return r


def test_every_row_within_the_goal_on_a_steady_machine_passes(bench):
    line, code = bench.verdict([row(bench, "fp32", 1.05), row(bench, "bf16", 0.95)])
    assert code == 0 and line.startswith("PASS") and "worst error -5.9% (tiny bf16)" in line


def test_one_row_past_the_goal_fails(bench):
    line, code = bench.verdict([row(bench, "fp32", 1.05), row(bench, "ddp", 1.25)])
    assert code == 1 and "FAIL" in line and "+23.8% (tiny ddp)" in line


@pytest.mark.parametrize("drift", [
    {"probes": (100.0, 115.0)},  # the machine's speed moved 15% between the probes
    {"moved": -0.2},  # the run's own loop probes moved
    {"steps": [1.0, 1.3, 1.4, 1.3, 1.2]},  # load came and went within the run
    {"others": 0.3},  # other processes used 30% of the CPUs
    {"others": math.nan},  # unknown: no /proc/stat
])
def test_a_machine_that_moved_more_than_the_goal_gives_no_verdict(bench, drift):
    line, code = bench.verdict([row(bench, "fp32", 1.05), row(bench, "bf16", 1.5, **drift)])
    assert code == 3 and line.startswith("NO VERDICT") and "tiny bf16" in line
