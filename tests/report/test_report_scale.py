"""optbench report over many runs (a team's outputs/): copies of one run, each with its own
train.seed override as a seed sweep leaves it, pool as repeats of one variant and give the numbers
a handful of them gives; the long tables print as rich lays them out; a corrupt summary among them
is one line. How fast and how small is measured by make bench-report (bench/bench_report.py), not here."""

from __future__ import annotations

import json
import os

import pytest

from optbench.report import tables
from optbench.report.analysis import build_report
from optbench.report.format import render
from tests.helpers import fake_run, noisy, variants


def seed_sweep(root, source, count: int):
    """``count`` copies of ``source`` as the jobs of ``-m train.seed=0,1,...`` (hard links: cheap)."""
    for seed in range(count):
        job = root / f"{seed}_model=tiny,train.seed={seed}"
        (job / ".hydra").mkdir(parents=True)
        for name in ("summary.json", "metrics.jsonl"):
            os.link(source / name, job / name)
        (job / ".hydra" / "overrides.yaml").write_text(f"- model=tiny\n- train.seed={seed}\n")
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return fake_run(tmp_path_factory.mktemp("source") / "run", overrides=["model=tiny", "train.seed=0"],
                    step_times=noisy(0.1, seed=4))


def test_seeds_of_one_config_pool_as_repeats_and_give_a_handful_s_numbers(source, tmp_path):
    few = variants(build_report([seed_sweep(tmp_path / "few", source, 3)]))
    many = variants(build_report([seed_sweep(tmp_path / "many", source, 300)]))
    assert list(few) == list(many) == ["model=tiny train.seed=0"]  # one variant, named by its first run
    few, many = few["model=tiny train.seed=0"], many["model=tiny train.seed=0"]
    assert (few["num_runs"], many["num_runs"], many["num_completed"]) == (3, 300, 300)
    assert len(set(many["runs"])) == 300 and many["runs"][299] == "299_model=tiny,train.seed=299"
    assert many["timed_steps"] == 100 * few["timed_steps"]
    assert many["loss"]["compared_kind"] == few["loss"]["compared_kind"] == "eval"
    assert many["memory"] == few["memory"]  # the largest of the repeats
    for key in ("tokens_per_s", "step_time_s", "mfu"):  # percentiles of 100x the steps, means of 300
        assert many[key] == pytest.approx(few[key], rel=1e-12), key  # losses: equal to rounding
    assert {k: many["loss"][k] for k in ("final", "eval")} == pytest.approx({k: few["loss"][k] for k in ("final", "eval")})
    summary = json.loads((source / "summary.json").read_text())
    assert many["tokens_per_s"] == pytest.approx(summary["throughput"]["tokens_per_s"])


def test_a_long_table_prints_as_rich_lays_it_out(source, tmp_path, monkeypatch):
    """Past tables.PLAIN_FROM rows, rich lays out a few rows and the rest are written at its widths:
    the same text, at each console width (runs' paths wrapped where the console is narrow)."""
    report = build_report([seed_sweep(tmp_path / "outputs" / "multirun" / "2026-11-28" / "07-00-00", source,
                                      tables.PLAIN_FROM + 5)])
    last = f"{tables.PLAIN_FROM + 4}_model=tiny,train.seed={tables.PLAIN_FROM + 4}"
    for width in (60, 100, 200):
        fast = render(report, "table", width=width)
        monkeypatch.setattr(tables, "PLAIN_FROM", 10**9)
        assert fast == render(report, "table", width=width)  # rich renders every row
        monkeypatch.undo()
        lines = fast.splitlines()
        assert any(line.rstrip().endswith("completed   3,2") or last in line for line in lines) or width < 200
        assert sum("completed" in line for line in lines) >= tables.PLAIN_FROM + 5


def test_a_corrupt_summary_among_many_is_one_line_and_the_rest_pool(source, tmp_path, capsys):
    sweep = seed_sweep(tmp_path / "sweep", source, 250)
    broken = sweep / "7_model=tiny,train.seed=7" / "summary.json"
    broken.unlink()  # its own file, not the shared one
    broken.write_text((source / "summary.json").read_text()[:-25])
    report = build_report([sweep])
    rows = {v["label"]: v for g in json.loads(render(report, "json"))["groups"] for v in g["variants"]}
    assert rows["model=tiny train.seed=0"]["num_runs"] == 249 and rows["model=tiny train.seed=0"]["status"] == "completed"
    assert rows["model=tiny train.seed=7"]["status"] == "unreadable" and len(rows) == 2  # listed on its own
    said = [line for line in render(report, "markdown").splitlines() if f"{broken} is not valid JSON" in line]
    assert len(said) == 1 and "truncated or corrupt" in said[0]
