"""make bench-predict's verdict (bench/bench_predict.py), without running the benchmark: each row's
error per round, one-sided sign tests against both sides of the +-10% goal; PASS only when every
row's rounds fell inside too often for chance, FAIL when a row's fell beyond one side that often,
NO VERDICT in between; runs with others on the CPUs left out."""

from __future__ import annotations

import math
from math import isclose

import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_predict") as module:
        yield module


def row(bench, name: str, errors: list[float], *, others: list[float] | None = None):
    """A row whose round ``i`` predicted ``1 + errors[i]`` times a measured step that the machine
    moved from round to round."""
    r = bench.Row(name, "tiny", [])
    for index, error in enumerate(errors):
        measured = (1.0, 1.7, 0.8, 1.3, 2.0, 1.1, 0.9)[index % 7]
        r.runs.append(bench.Run(predicted=measured * (1 + error), measured=measured, steps=[measured],
                                probes=(100.0, 160.0), moved=0.3, others=(others or [0.0] * len(errors))[index]))
    return r


def test_every_round_of_every_row_within_the_goal_passes_however_the_machine_moved(bench):
    line, code = bench.verdict([row(bench, "fp32", [0.05, -0.08, 0.02, 0.09, -0.01]),
                                row(bench, "bf16", [-0.09, -0.02, -0.05, 0.0, 0.04])])
    assert code == 0 and "PASS" in line and "tiny fp32: 5 of 5 rounds within +-10%" in line


def test_a_row_beyond_one_side_in_every_round_fails(bench):
    line, code = bench.verdict([row(bench, "fp32", [0.05, -0.08, 0.02, 0.09, -0.01]),
                                row(bench, "ddp", [0.25, 0.12, 0.4, 0.11, 0.3])])
    assert code == 1 and "FAIL: tiny ddp" in line


@pytest.mark.parametrize("errors", [
    [0.05, -0.08, 0.02, 0.09],  # four rounds: a coin lands inside 4 of 4 with chance 1/16
    [0.05, -0.15, 0.02, 0.09, -0.01],  # one round outside: 4 of 5 inside could be chance
    [0.05, -0.15, 0.12, -0.3, 0.01],  # outside on both sides: 2 of 5 within
])
def test_rounds_that_could_be_chance_give_no_verdict(bench, errors):
    line, code = bench.verdict([row(bench, "fp32", [0.0] * 5), row(bench, "bf16", errors)])
    assert code == 3 and "NO VERDICT: tiny bf16" in line and "tiny fp32" not in line.split("NO VERDICT")[1]
    within = sum(abs(e) < 0.1 for e in errors)
    assert f"tiny bf16: {within} of {len(errors)} rounds within" in line


@pytest.mark.parametrize("others", [0.3, math.nan])
def test_a_run_with_others_on_the_cpus_is_left_out(bench, others):
    """The busy round is the only one outside the goal, and it is not counted: 4 of 4 inside
    cannot decide, so the verdict is NO VERDICT rather than a FAIL or PASS it helped make."""
    line, code = bench.verdict([row(bench, "fp32", [0.05, -0.08, 0.5, 0.09, -0.01],
                                    others=[0.0, 0.0, others, 0.0, 0.0])])
    assert code == 3 and "4 of 4 rounds within" in line


def test_the_sign_tests_chances(bench):
    assert isclose(bench.sign_p(5, 5), 1 / 32) and isclose(bench.sign_p(4, 5), 6 / 32)
    assert bench.sign_p(0, 0) == 1.0 and isclose(bench.sign_p(0, 5), 1.0)


def test_a_rows_error_is_the_median_of_its_rounds_errors_not_of_medians_from_different_rounds(bench):
    """Three rounds right on (0, +100%, 0: the median error is 0); the median prediction over the
    median measurement would pair round 1's prediction with round 0's run and say +100%."""
    r = bench.Row("ddp", "tiny", [])
    for predicted, measured in ((1.0, 1.0), (2.0, 1.0), (3.0, 3.0)):
        r.runs.append(bench.Run(predicted=predicted, measured=measured, steps=[measured], probes=(1.0, 1.0),
                                moved=0.0, others=0.0))
    assert r.median("predicted") / r.median("measured") - 1 == 1.0
    assert r.error == 0.0
