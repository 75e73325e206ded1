"""make bench-plan's verdict (bench/bench_plan.py), without running the benchmark: #1 against each
other configuration round by round, a one-sided sign test each; PASS only when every one lost to #1
too often for chance (or, within the non-inferiority margin, came out no faster than it by more than
the margin that often), FAIL when one beat it that often, NO VERDICT in between."""

from __future__ import annotations

import math

import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_plan") as module:
        yield module


@pytest.fixture(scope="module")
def runs():
    """bench_predict's Row and Run, which bench_plan's rounds are made of."""
    with bench_module("bench_predict") as module:
        yield module


def configuration(runs, name: str, steps: list[float], *, others: list[float] | None = None):
    row = runs.Row(name, "tiny", [])
    for index, step in enumerate(steps):
        row.runs.append(runs.Run(predicted=0.1, measured=step, steps=[step], probes=(1.0, 1.0), moved=0.0,
                                  others=(others or [0.0] * len(steps))[index]))
    return row


# the machine's speed moved round to round by more than the 10% between the configurations: no
# single round is steady, but #1 is the faster in each
MOVING = [1.00, 1.60, 0.80, 1.30, 2.00]


def test_a_pick_faster_in_every_round_passes_however_much_the_machine_moved(bench, runs):
    rows = [configuration(runs, "#1", MOVING), configuration(runs, "#2", [x * 1.1 for x in MOVING]),
            configuration(runs, "#3", [x * 1.3 for x in MOVING])]
    line, code = bench.verdict(rows)
    assert code == 0 and "PASS" in line and "#1 faster in 5 of 5 rounds (a coin: p = 0.031)" in line


def test_one_other_faster_in_every_round_fails(bench, runs):
    rows = [configuration(runs, "#1", MOVING), configuration(runs, "#2", [x * 1.1 for x in MOVING]),
            configuration(runs, "#3", [x * 0.95 for x in MOVING])]
    line, code = bench.verdict(rows)
    assert code == 1 and "FAIL: #3" in line


@pytest.mark.parametrize("rounds", [2, 4])
def test_too_few_rounds_give_no_verdict_even_when_the_pick_always_won(bench, runs, rounds):
    """A coin wins 4 of 4 with chance 1/16 > 5%: the fewest rounds that can decide are five."""
    rows = [configuration(runs, "#1", MOVING[:rounds]), configuration(runs, "#2", [x * 1.5 for x in MOVING[:rounds]])]
    line, code = bench.verdict(rows)
    assert code == 3 and "NO VERDICT: against #2" in line


def test_a_split_record_gives_no_verdict(bench, runs):
    rows = [configuration(runs, "#1", MOVING), configuration(runs, "#2", [1.1, 1.5, 0.9, 1.2, 2.1])]
    line, code = bench.verdict(rows)
    assert code == 3 and "#1 faster in 3 of 5 rounds" in line


# an equal configuration: it wins some rounds and loses some, always by less than 5%
EQUAL = [1.03, 0.97, 1.01, 0.98, 1.02]


def test_an_equal_configuration_passes_within_the_margin_and_not_without_it(bench, runs):
    rows = [configuration(runs, "#1", MOVING), configuration(runs, "#2", [x * e for x, e in zip(MOVING, EQUAL, strict=True)]),
            configuration(runs, "#3", [x * 1.3 for x in MOVING])]
    line, code = bench.verdict(rows)
    assert code == 0 and "#1 faster in 3 of 5 rounds" in line and "its step above 95% of #1's in 5 (p = 0.031)" in line
    assert "PASS: #1 ran faster than #3, and was not slower than #2 by more than the margin" in line
    line, code = bench.verdict(rows, margin=0.0)
    assert code == 3 and "NO VERDICT: against #2" in line


def test_a_configuration_faster_by_more_than_the_margin_in_some_rounds_gives_no_verdict(bench, runs):
    """8% faster in two rounds of five, slower in three: neither side is decided."""
    rows = [configuration(runs, "#1", MOVING),
            configuration(runs, "#2", [x * e for x, e in zip(MOVING, [0.92, 1.02, 0.92, 1.01, 1.03], strict=True)])]
    line, code = bench.verdict(rows)
    assert code == 3 and "its step above 95% of #1's in 3" in line


def test_a_configuration_faster_in_every_round_fails_even_within_the_margin(bench, runs):
    rows = [configuration(runs, "#1", MOVING), configuration(runs, "#2", [x * 0.98 for x in MOVING])]
    line, code = bench.verdict(rows)
    assert code == 1 and "FAIL: #2" in line


@pytest.mark.parametrize("others", [0.3, math.nan])
def test_a_round_with_others_on_the_cpus_is_left_out_of_its_pair(bench, runs, others):
    """Four clean rounds of five: 4 of 4 is not enough, so the busy round cannot be what decides."""
    rows = [configuration(runs, "#1", MOVING, others=[0.0, 0.0, others, 0.0, 0.0]),
            configuration(runs, "#2", [x * 1.2 for x in MOVING])]
    line, code = bench.verdict(rows)
    assert code == 3 and "#1 faster in 4 of 4 rounds" in line
