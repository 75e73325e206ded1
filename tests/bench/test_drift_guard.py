"""make bench's drift guard (bench/bench_overhead.py), without running the benchmark: the verdict
from pair figures with injected machine drift, and which probes bracket which pair."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_overhead") as module:
        yield module


GF = 1e9
QUIET = [(200.4, 201.1, 200.2), (201.1, 199.9, 200.6), (200.6, 201.5, 200.9)]  # GFLOP/s, ~0.5% apart


STEADY = [3.50, 3.53, 3.55, 3.52, 3.56]  # s: a quiet side's timed steps, median 0.9% over the fastest


def pairs_of(bench, ratios: list[float], probes: list[tuple[float, float, float]]) -> list:
    return [bench.Pair(order=("optbench", "peer"), optbench_tps=500 * r, peer_tps=500.0,
                       probes=tuple(p * GF for p in probe), steps={"optbench": STEADY, "peer": STEADY})
            for r, probe in zip(ratios, probes, strict=True)]


def verdict_of(bench, pairs: list, target: float = 0.97):
    return bench.decide([p.ratio for p in pairs], [p.drift for p in pairs], target,
                        [bench.drift_text(p) for p in pairs])


def test_a_quiet_machine_gets_a_verdict(bench):
    # the last quiet measurement's ratios: 1.3% above the target, probes within 0.8%
    verdict = verdict_of(bench, pairs_of(bench, [0.970, 0.983, 1.014], QUIET))
    assert verdict.passed is True
    assert verdict.ratio == pytest.approx(0.983)
    assert verdict.line.endswith("PASS") and "min 0.970 - max 1.014" in verdict.line
    slow = verdict_of(bench, pairs_of(bench, [0.90, 0.91, 0.93], QUIET))
    assert slow.passed is False and slow.line.endswith("FAIL")


def test_drift_between_the_sides_withholds_the_verdict(bench):
    # the machine got 30% slower between the two sides of every pair
    busy = [(200.0, 140.0, 140.0), (140.0, 200.0, 200.0), (200.0, 140.0, 200.0)]
    verdict = verdict_of(bench, pairs_of(bench, [0.970, 0.983, 1.014], busy))
    assert verdict.passed is None
    assert verdict.line.startswith("NO VERDICT")
    assert "200.0 / 140.0 / 140.0 GFLOP/s" in verdict.reason and "pair 0 42.9%" in verdict.reason


def test_load_between_the_probes_shows_in_the_steps_and_withholds_the_verdict(bench):
    # the probes saw a quiet machine, but a neighbour's job slowed three of each peer side's five steps
    pairs = pairs_of(bench, [1.10, 1.12, 1.09], QUIET)
    for pair in pairs:
        pair.steps["peer"] = [3.5, 3.5, 4.2, 4.3, 4.4]
    assert all(pair.loaded == {"peer": pytest.approx(0.2)} for pair in pairs)
    verdict = verdict_of(bench, pairs, target=1.0)
    assert verdict.passed is None
    assert "peer's median step 20% over its fastest" in verdict.reason
    # one slow step of five leaves the median, and the verdict, alone
    for pair in pairs:
        pair.steps["peer"] = [3.5, 3.52, 9.0, 3.51, 3.53]
    assert not any(pair.loaded for pair in pairs)
    assert verdict_of(bench, pairs, target=1.0).passed is True


def test_drift_cannot_fake_a_pass(bench):
    # optbench is really 5% slower than the peer (FAIL), but the machine sped up by 4% for its side of
    # every pair: the measured ratios clear the target, the probes show the 4% and no PASS is given
    sped_up = [(200.0, 208.0, 200.0)] * 3
    verdict = verdict_of(bench, pairs_of(bench, [0.95 * 1.04] * 3, sped_up))
    assert verdict.ratio >= 0.97
    assert verdict.passed is None


def test_drift_cannot_fake_a_fail(bench):
    sped_up = [(200.0, 208.0, 200.0)] * 3
    verdict = verdict_of(bench, pairs_of(bench, [0.99 / 1.04] * 3, sped_up))
    assert verdict.ratio < 0.97
    assert verdict.passed is None


def test_one_drifted_pair_does_not_sink_decisive_steady_ones(bench):
    probes = [QUIET[0], (200.0, 140.0, 200.0), QUIET[2]]
    verdict = verdict_of(bench, pairs_of(bench, [1.00, 0.70, 0.99], probes))
    assert verdict.passed is True
    assert verdict.ratio == pytest.approx(0.99)


def test_a_side_that_shared_the_cpus_with_another_process_is_no_evidence(bench):
    # the probes and the steps look steady, but /proc/stat saw other processes take 30% of the CPUs
    pairs = pairs_of(bench, [0.99, 1.00, 1.01], QUIET)
    pairs[0].others = {"optbench": 0.004, "peer": 0.30}
    assert pairs[0].drift == math.inf and pairs[1].drift < 0.01
    assert verdict_of(bench, pairs).passed is True  # the two other pairs still decide alike
    pairs[1].others = {"optbench": 0.25, "peer": 0.004}
    verdict = verdict_of(bench, pairs)
    assert verdict.passed is None
    assert "pair 0 unbounded" in verdict.reason
    assert "other processes used 30% of the CPUs during the peer side" in verdict.reason


def test_a_side_measures_the_cpu_others_used_meanwhile(bench, monkeypatch):
    readings = iter([(100.0, 10.0), (130.0, 30.0)])  # the machine: 30 CPU-s busy; the side's children: 20
    monkeypatch.setattr(bench, "cpu_seconds", lambda: next(readings))
    clock = iter([5.0, 15.0])  # 10 s of wall
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    result = bench.run_side(lambda: {"tokens_per_s": 500.0})
    assert result == {"tokens_per_s": 500.0, "others": pytest.approx(10 / 20)}


def test_the_machine_cpu_reading_counts_the_child_processes(bench):
    machine_0, children_0 = bench.cpu_seconds()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                    "while time.process_time() < end: pass"], check=True)
    machine_1, children_1 = bench.cpu_seconds()
    assert children_1 - children_0 >= 0.29
    if not math.isnan(machine_0):  # Linux: /proc/stat saw at least what the child used
        assert machine_1 - machine_0 >= 0.2


def test_decide_needs_one_drift_per_ratio(bench):
    with pytest.raises(ValueError):
        bench.decide([0.98, 0.99], [0.0], 0.97)
    with pytest.raises(ValueError):
        bench.decide([], [], 0.97)


def test_each_pair_is_bracketed_by_the_probes_before_between_and_after_its_sides(bench, monkeypatch):
    # one probe before every side and one after the last: 2 * pairs + 1, pair k gets probes 2k..2k+2
    speeds = iter([200.0, 201.0, 140.0, 141.0, 142.0, 202.0, 203.0])
    monkeypatch.setattr(bench, "run_probe", lambda: {"flops": next(speeds) * GF, "matmuls": 370, "threads": 2})
    order: list[str] = []
    machine_cpu = [0.0]  # /proc/stat's busy CPU seconds, as the fake sides advance it
    monkeypatch.setattr(bench, "cpu_seconds", lambda: (machine_cpu[0], 0.0))

    def side(name: str, tps: float):
        def run(*args, **kwargs) -> dict:
            order.append(name)
            if order.count("peer") == 2 and name == "peer":  # another process ran during pair 1's peer side
                machine_cpu[0] += 1000.0
            return {"tokens_per_s": tps, "step_times_s": STEADY, "threads": 2}
        return run

    monkeypatch.setattr(bench, "run_optbench", side("optbench", 490.0))
    monkeypatch.setattr(bench, "run_peer", side("peer", 500.0))
    pairs = bench.process_view(bench.DIMS["tiny"], pairs=3, steps=1)
    assert order == ["optbench", "peer", "peer", "optbench", "optbench", "peer"]
    assert [p.order for p in pairs] == [("optbench", "peer"), ("peer", "optbench"), ("optbench", "peer")]
    assert [tuple(x / GF for x in p.probes) for p in pairs] == [(200.0, 201.0, 140.0), (140.0, 141.0, 142.0),
                                                                 (142.0, 202.0, 203.0)]
    assert pairs[2].probe_drift == pytest.approx(203 / 142 - 1) and pairs[2].drift == pairs[2].probe_drift
    assert pairs[0].steps == {"optbench": STEADY, "peer": STEADY}
    assert pairs[0].others == {"optbench": 0.0, "peer": 0.0}
    assert set(pairs[1].busy) == {"peer"} and pairs[1].drift == math.inf
    assert next(speeds, None) is None


def test_the_probe_measures_matmuls_after_its_warm_up(bench):
    probe = bench.speed_probe(seconds=0.02, warmup_s=0.01)
    assert probe["flops"] > 1e8 and probe["matmuls"] >= 3 and probe["threads"] >= 1
