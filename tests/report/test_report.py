"""optbench report on fixture run dirs written by the project's own writer: table numbers, the
noise-aware verdict, the phase table, baselines and groups, gates, formats, plots, bad input."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from optbench.cli import main as cli_main
from optbench.errors import ReportError
from optbench.outputs import write_json_atomic
from optbench.report.analysis import build_report
from optbench.report.format import render
from optbench.report.plots import PLOT_FILES, identical_curves, pareto_front
from optbench.report.stats import speed_verdict
from tests.helpers import MODELS, fake_run, noisy, variants


def report_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["report", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture
def sweep(tmp_path):
    """A precision sweep: fp32 baseline, a clear 2x, one inside the noise, one incompatible."""
    root = tmp_path / "sweep"
    fake_run(root / "0_fp32", overrides=["precision=fp32", "model=tiny"], step_times=noisy(0.10, seed=1),
             loss_eval=4.9000, peak_bytes=100 * 2**20, started="01")
    fake_run(root / "1_bf16", overrides=["precision=bf16", "model=tiny"], step_times=noisy(0.05, seed=2),
             loss_eval=4.9004, peak_bytes=80 * 2**20, started="02")
    fake_run(root / "2_fp16", overrides=["precision=fp16", "model=tiny"], step_times=noisy(0.101, seed=3),
             loss_eval=4.9100, peak_bytes=160 * 2**20, started="03")
    fake_run(root / "3_tf32", overrides=["precision=tf32", "model=tiny"], status="incompatible",
             error="precision=tf32 needs CUDA tensor cores; use precision=fp32 on CPU", started="04")
    return root


# ------------------------------------------------------------------------------- numbers
def test_table_numbers_against_the_baseline(sweep):
    report = build_report([sweep])
    rows = variants(report)
    assert list(rows) == ["precision=fp32", "precision=bf16", "precision=fp16", "precision=tf32"]
    base, fast, same, blocked = rows.values()
    assert base["baseline"] and base["vs_baseline"] is None
    base_tps = 128 / float(np.median(noisy(0.10, seed=1)))
    assert base["tokens_per_s"] == pytest.approx(base_tps)
    assert fast["vs_baseline"]["speedup"] == pytest.approx(fast["tokens_per_s"] / base_tps)
    assert fast["vs_baseline"]["speedup"] == pytest.approx(2.0, rel=0.05)
    assert fast["vs_baseline"]["ci_low"] > 1.8 and fast["vs_baseline"]["verdict"] == "faster"
    assert fast["vs_baseline"]["loss_delta"] == pytest.approx(0.0004) and fast["vs_baseline"]["loss_kind"] == "eval"
    assert fast["vs_baseline"]["memory_ratio"] == pytest.approx(0.8)
    assert same["vs_baseline"]["verdict"] == "no significant difference"
    assert same["vs_baseline"]["ci_low"] < 1 < same["vs_baseline"]["ci_high"]
    assert same["vs_baseline"]["memory_ratio"] == pytest.approx(1.6)
    assert blocked["status"] == "incompatible" and blocked["tokens_per_s"] is None
    assert "needs CUDA tensor cores" in blocked["reason"]
    text = render(report, "table")
    assert "baseline: precision=fp32 (the first run that completed)" in text
    assert f"{fast['vs_baseline']['speedup']:.2f}x [" in text and "+0.00040" in text
    tf32_line = next(line for line in text.splitlines() if "precision=tf32" in line)
    assert "incompatible [" in tf32_line and "x [" not in tf32_line  # the reason is a note under the table
    ref = tf32_line.split("incompatible ")[1].split("]")[0] + "]"
    assert text.count("precision=tf32 needs CUDA tensor cores") == 1
    assert f"{ref} incompatible: precision=tf32 needs CUDA tensor cores" in text


def test_verdict_accounts_for_noise():
    assert speed_verdict(1.2, 1.9) == "faster"
    assert speed_verdict(0.5, 0.9) == "slower"
    assert speed_verdict(0.97, 1.05) == "no significant difference"


def test_a_ratio_inside_the_noise_is_no_win_and_a_clear_2x_is_faster(tmp_path):
    """Two draws from the same 20%-noisy machine differ by a few percent: not a speedup."""
    fake_run(tmp_path / "a", overrides=["x=a"], step_times=noisy(0.1, rel=0.2, n=30, seed=3), started="01")
    fake_run(tmp_path / "b", overrides=["x=b"], step_times=noisy(0.1, rel=0.2, n=30, seed=4), started="02")
    fake_run(tmp_path / "c", overrides=["x=c"], step_times=noisy(0.05, rel=0.2, n=30, seed=7), started="03")
    rows = variants(build_report([tmp_path]))
    noise = rows["x=b"]["vs_baseline"]
    assert abs(noise["speedup"] - 1) > 0.02  # the point estimate alone would claim a 3% change
    assert noise["verdict"] == "no significant difference"
    assert rows["x=c"]["vs_baseline"]["verdict"] == "faster"


def test_a_load_shift_during_the_runs_is_not_a_speedup(tmp_path):
    """The shared machine got busy for part of each run: the medians differ 2.8x, but the block
    bootstrap keeps slow stretches together and the interval covers 1."""
    rng = np.random.default_rng(0)
    busy_late = np.array([0.1] * 14 + [0.3] * 16) * (1 + 0.03 * rng.standard_normal(30))
    busy_early = np.array([0.3] * 12 + [0.1] * 18) * (1 + 0.03 * rng.standard_normal(30))
    fake_run(tmp_path / "a", overrides=["x=a"], step_times=busy_late.tolist(), started="01")
    fake_run(tmp_path / "b", overrides=["x=b"], step_times=busy_early.tolist(), started="02")
    result = variants(build_report([tmp_path]))["x=b"]["vs_baseline"]
    assert result["speedup"] > 2.5
    assert result["verdict"] == "no significant difference"


def test_the_speedup_gate_needs_the_whole_interval_above_the_bar(tmp_path, capsys):
    """A 2.8x point estimate inside the noise does not pass --min-speedup 2; a clean 2x passes 1.8."""
    rng = np.random.default_rng(0)
    busy_late = np.array([0.1] * 14 + [0.3] * 16) * (1 + 0.03 * rng.standard_normal(30))
    busy_early = np.array([0.3] * 12 + [0.1] * 18) * (1 + 0.03 * rng.standard_normal(30))
    fake_run(tmp_path / "a", overrides=["x=a"], step_times=busy_late.tolist(), started="01")
    fake_run(tmp_path / "b", overrides=["x=b"], step_times=busy_early.tolist(), started="02")
    code, _, err = report_cli(capsys, str(tmp_path), "--min-speedup", "2", "--no-plots")
    assert code == 1 and "min-speedup 2: x=b vs x=a: speedup 2.7" in err and "needs the 95% interval >= 2x" in err
    fake_run(tmp_path / "c", overrides=["x=c"], step_times=noisy(0.05 * 1.1, seed=4), started="03")
    code, _, err = report_cli(capsys, str(tmp_path / "a"), str(tmp_path / "c"), "--min-speedup", "1.8", "--no-plots")
    assert code == 0, err


def test_too_few_timed_steps_get_no_verdict(tmp_path):
    fake_run(tmp_path / "a", overrides=["x=a"], step_times=[0.1, 0.11, 0.1, 0.12], started="01")
    fake_run(tmp_path / "b", overrides=["x=b"], step_times=[0.05, 0.05, 0.06, 0.05], started="02")
    result = variants(build_report([tmp_path]))["x=b"]["vs_baseline"]
    assert result["speedup"] == pytest.approx(0.105 / 0.05)
    assert result["ci_low"] is None and result["verdict"] == "too few timed steps (need 10 per variant)"


def test_speedup_is_per_token_when_the_batch_changes(tmp_path):
    """Double the tokens per step in 1.5x the step time: 1.33x faster, though each step is slower."""
    fake_run(tmp_path / "a", overrides=["train.batch_size=8"], step_times=noisy(0.10, seed=1), started="01")
    fake_run(tmp_path / "b", overrides=["train.batch_size=16"], tokens_per_step=256,
             step_times=[t * 1.5 for t in noisy(0.10, seed=1)], started="02")
    rows = variants(build_report([tmp_path]))
    assert rows["train.batch_size=16"]["vs_baseline"]["speedup"] == pytest.approx(4 / 3)


def test_bootstrap_is_deterministic(sweep):
    first = render(build_report([sweep]), "json")
    assert render(build_report([sweep]), "json") == first


def test_repeats_pool_and_widen_the_interval(tmp_path):
    """A variant run three times is one row; run-to-run noise widens its interval."""
    for i, median in enumerate((0.10, 0.11, 0.09)):
        fake_run(tmp_path / f"{2 * i}_A", overrides=["x=a"], step_times=noisy(median, rel=0.01, seed=i),
                 started=f"{2 * i:02d}")
        fake_run(tmp_path / f"{2 * i + 1}_B", overrides=["x=b"], step_times=noisy(median / 1.03, rel=0.01, seed=9 + i),
                 started=f"{2 * i + 1:02d}")
    report = build_report([tmp_path])
    rows = variants(report)
    assert rows["x=a"]["num_runs"] == 3 and rows["x=a"]["timed_steps"] == 120
    pooled = rows["x=b"]["vs_baseline"]
    assert pooled["speedup"] == pytest.approx(1.03, rel=0.02)
    single = variants(build_report([tmp_path / "0_A", tmp_path / "1_B"]))["x=b"]["vs_baseline"]
    assert pooled["ci_high"] - pooled["ci_low"] > 2 * (single["ci_high"] - single["ci_low"])
    assert "-- Runs" in render(report, "table")


# ------------------------------------------------------------------------------- phases
def test_phase_sweep_gets_the_cumulative_table(tmp_path):
    fake_run(tmp_path / "0", overrides=["phase=0_baseline"], step_times=noisy(0.10, seed=1), started="01",
             peak_bytes=100)
    fake_run(tmp_path / "1", overrides=["phase=1_compile"], step_times=noisy(0.08, seed=2), started="02",
             peak_bytes=100)
    fake_run(tmp_path / "2", overrides=["phase=2_ckpt"], tokens_per_step=256, step_times=noisy(0.12, seed=3),
             started="03", peak_bytes=60)
    fake_run(tmp_path / "3", overrides=["phase=5_offload"], status="incompatible",
             error="optimizer=cpu_offload needs CUDA", started="04")
    fake_run(tmp_path / "4", overrides=["phase=10_last"], tokens_per_step=256, step_times=noisy(0.06, seed=4),
             started="05", peak_bytes=70)
    report = build_report([tmp_path])
    table = json.loads(render(report, "json"))["groups"][0]["phases"]
    assert [row["phase"] for row in table] == ["0_baseline", "1_compile", "2_ckpt", "5_offload", "10_last"]
    tps = {row["phase"]: row["tokens_per_s"] for row in table if row["tokens_per_s"]}
    assert table[1]["vs_baseline"]["speedup"] == pytest.approx(tps["1_compile"] / tps["0_baseline"])
    assert table[2]["vs_previous"]["speedup"] == pytest.approx(tps["2_ckpt"] / tps["1_compile"])
    assert table[2]["previous"] == "1_compile"
    assert table[3]["status"] == "incompatible" and table[3]["vs_previous"] is None
    assert table[4]["previous"] == "2_ckpt"  # the blocked phase is skipped
    assert table[4]["vs_previous"]["speedup"] == pytest.approx(2.0, rel=0.05)
    assert table[2]["peak_bytes"] == 60 and table[2]["vs_baseline"]["memory_ratio"] == pytest.approx(0.6)
    text = render(report, "table")
    assert "Phases (cumulative" in text and "baseline: phase=0_baseline\n" in text
    assert "optimizer=cpu_offload needs CUDA" in text


def test_default_baseline_is_phase_0_even_when_it_ran_later(tmp_path):
    fake_run(tmp_path / "1", overrides=["phase=1_compile"], started="01")
    fake_run(tmp_path / "0", overrides=["phase=0_baseline"], started="02")
    group = json.loads(render(build_report([tmp_path]), "json"))["groups"][0]
    assert group["baseline"] == "phase=0_baseline"


# ------------------------------------------------------------------------- groups, baseline
def test_other_models_are_listed_not_compared(tmp_path):
    fake_run(tmp_path / "a", overrides=["model=tiny", "precision=fp32"], started="01")
    fake_run(tmp_path / "b", overrides=["model=small", "precision=fp32"], model="small", started="02")
    fake_run(tmp_path / "c", overrides=["model=small", "precision=bf16"], model="small",
             step_times=noisy(0.05), started="03")
    groups = json.loads(render(build_report([tmp_path]), "json"))["groups"]
    assert [g["model"] for g in groups] == ["tiny", "small"]
    assert [v["vs_baseline"] for v in groups[0]["variants"]] == [None]
    small = {v["label"]: v for v in groups[1]["variants"]}
    assert small["precision=fp32"]["baseline"]
    assert small["precision=bf16"]["vs_baseline"]["speedup"] == pytest.approx(2.0, rel=0.05)


def test_baseline_option_picks_the_reference(sweep):
    report = build_report([sweep], baseline=["precision=bf16"])
    rows = variants(report)
    assert rows["precision=bf16"]["baseline"]
    assert rows["precision=fp32"]["vs_baseline"]["speedup"] == pytest.approx(0.5, rel=0.05)
    assert rows["precision=fp32"]["vs_baseline"]["verdict"] == "slower"


def test_unknown_baseline_is_one_line_exit_2(sweep, capsys):
    code, out, err = report_cli(capsys, str(sweep), "--baseline", "precision=fp8")
    assert code == 2 and out == ""
    assert err.strip() == ("optbench: error: no run matches --baseline precision=fp8; "
                           "the runs have precision=bf16|fp16|fp32|tf32")
    code, _, err = report_cli(capsys, str(sweep), "--baseline", "fp32")
    assert code == 2 and "takes KEY=VALUE" in err and len(err.strip().splitlines()) == 1
    code, _, err = report_cli(capsys, str(sweep), "--baseline", "model=tiny")
    assert code == 2 and "--baseline model=tiny matches 4 variants" in err and "add another --baseline" in err
    code, _, err = report_cli(capsys, str(sweep), "--candidate", "precision=fp8", "--min-speedup", "2")
    assert code == 2 and "no run matches --candidate precision=fp8; the runs have precision=" in err


# -------------------------------------------------------------------------------- gates
def test_gates_pass_exit_0(sweep, capsys):
    code, out, err = report_cli(capsys, str(sweep / "0_fp32"), str(sweep / "1_bf16"), "--min-speedup", "1.5",
                                "--max-loss-delta", "0.001", "--max-memory-ratio", "1.5", "--out", str(sweep))
    assert code == 0, err
    for gate in ("min-speedup 1.5", "max-loss-delta 0.001", "max-memory-ratio 1.5"):
        assert f"ok      {gate}: precision=bf16 vs precision=fp32" in out
    assert "gate failed" not in err


def test_each_failing_gate_is_named_exit_1(sweep, capsys):
    code, out, err = report_cli(capsys, str(sweep), "--min-speedup", "3", "--max-loss-delta", "0.001",
                                "--max-memory-ratio", "1.5", "--no-plots")
    assert code == 1
    failed = [line for line in err.splitlines() if line.startswith("optbench: gate failed:")]
    # bf16: speedup ~2x < 3; fp16: no speedup, loss delta 0.01, memory 1.6x; tf32: did not complete (3 gates)
    assert any("min-speedup 3: precision=bf16 vs precision=fp32: speedup 1.9" in f for f in failed)
    assert any("max-loss-delta 0.001: precision=fp16" in f and "0.010000" in f for f in failed)
    assert any("max-memory-ratio 1.5: precision=fp16" in f and "1.60x" in f for f in failed)
    assert sum("precision=tf32" in f and "candidate did not complete (incompatible" in f for f in failed) == 3
    assert not any("precision=bf16" in f and "max-loss-delta" in f for f in failed)  # 0.0004 passes
    assert len(failed) == 1 + 3 + 3


def test_gates_with_non_numbers_exit_2(sweep, capsys):
    for value in ("fast", "nan", "-1", "inf"):
        code, out, err = report_cli(capsys, str(sweep), "--min-speedup", value)
        assert code == 2 and out == "", value
        assert len(err.strip().splitlines()) == 1 and "--min-speedup" in err, err


def test_phase_sweep_gates_the_last_phase(tmp_path, capsys):
    fake_run(tmp_path / "0", overrides=["phase=0_baseline"], step_times=noisy(0.1, seed=1), started="01")
    fake_run(tmp_path / "1", overrides=["phase=1_compile"], step_times=noisy(0.2, seed=2), started="02")
    fake_run(tmp_path / "2", overrides=["phase=2_more"], step_times=noisy(0.025, seed=3), started="03")
    code, _, err = report_cli(capsys, str(tmp_path), "--min-speedup", "3", "--no-plots")
    assert code == 0, err  # 1_compile is slower, but the plan's gate judges the cumulative result
    code, _, err = report_cli(capsys, str(tmp_path), "--min-speedup", "3", "--candidate", "phase=1_compile",
                              "--no-plots")
    assert code == 1 and "phase=1_compile vs phase=0_baseline" in err


def test_unmeasured_memory_fails_its_gate(tmp_path, capsys):
    fake_run(tmp_path / "a", overrides=["x=a"], peak_bytes=None, started="01")
    fake_run(tmp_path / "b", overrides=["x=b"], peak_bytes=None, started="02")
    code, _, err = report_cli(capsys, str(tmp_path), "--max-memory-ratio", "2", "--no-plots")
    assert code == 1 and "peak memory not measured" in err


# ---------------------------------------------------------------------- formats and files
def test_json_round_trip_and_formats(sweep, capsys):
    code, out, _ = report_cli(capsys, str(sweep), "--format", "json")
    assert code == 0
    printed = json.loads(out)
    assert printed == json.loads((sweep / "report.json").read_text())
    rows = {v["label"]: v for v in printed["groups"][0]["variants"]}
    summary = json.loads((sweep / "1_bf16" / "summary.json").read_text())
    assert rows["precision=bf16"]["tokens_per_s"] == summary["throughput"]["tokens_per_s"]
    assert rows["precision=bf16"]["memory"]["peak_bytes"] == summary["memory"]["peak_bytes"]
    assert json.dumps(printed, allow_nan=False)  # strict JSON: no NaN anywhere

    table = list(csv.DictReader(io.StringIO((sweep / "report.csv").read_text())))
    assert [r["variant"] for r in table] == list(rows)
    assert float(table[1]["speedup"]) == pytest.approx(rows["precision=bf16"]["vs_baseline"]["speedup"])
    assert table[3]["status"] == "incompatible" and table[3]["tokens_per_s"] == ""

    markdown = (sweep / "report.md").read_text()
    assert markdown.startswith("# optbench report") and "| variant | status |" in markdown
    assert "![loss_curves.png](loss_curves.png)" in markdown
    for fmt, marker in (("markdown", "| variant |"), ("csv", "group,variant,baseline"), ("table", "variant  ")):
        code, out, _ = report_cli(capsys, str(sweep), "--format", fmt, "--no-plots")
        assert code == 0 and marker in out


def test_plots_are_valid_png_files(sweep, tmp_path, capsys):
    from matplotlib.image import imread

    out_dir = tmp_path / "elsewhere"
    code, _, err = report_cli(capsys, str(sweep), "--out", str(out_dir))
    assert code == 0 and str(out_dir) in err
    for name in PLOT_FILES:
        path = out_dir / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        height, width, _ = imread(path).shape
        assert height > 200 and width > 400
    assert not (sweep / "report.md").exists()  # --out, not the reviewed dir


def test_identical_loss_curves_are_drawn_once_and_named_together():
    a, b = [(0, 7.0), (1, 6.5)], [(0, 7.0), (1, 6.4)]
    assert identical_curves([("x", a), ("y", b), ("z", list(a)), ("w", b)]) == [[0, 2], [1, 3]]


def test_pareto_front():
    # (time, memory): the 3rd is beaten by the 1st on both; the others trade one for the other
    assert pareto_front([(1.0, 5.0), (2.0, 3.0), (1.5, 6.0), (3.0, 1.0)]) == [0, 1, 3]


# ------------------------------------------------------------------------------ bad input
def test_a_path_with_no_runs_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = report_cli(capsys, str(tmp_path / "empty"))
    assert code == 2 and out == "" and "no runs under" in err and len(err.strip().splitlines()) == 1
    code, _, err = report_cli(capsys, str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    assert not (tmp_path / "empty" / "report.md").exists()


def test_a_broken_run_is_listed_and_the_others_reported(sweep, capsys):
    path = sweep / "1_bf16" / "summary.json"
    (sweep / "1_bf16" / ".hydra" / "config.yaml").write_text(json.dumps(json.loads(path.read_text())["config"]))
    path.write_text(path.read_text()[:-25])  # cut mid-record, as a killed writer would
    code, out, err = report_cli(capsys, str(sweep))
    assert code == 0 and "Traceback" not in err
    rows = variants(build_report([sweep]))
    assert rows["precision=fp16"]["vs_baseline"]["verdict"] == "no significant difference"  # still compared
    assert rows["precision=bf16"]["status"] == "unreadable"
    words = " ".join(out.split())  # the console wraps long notes to its width
    assert f"{path} is not valid JSON" in words and "truncated or corrupt" in words
    assert (sweep / "report.md").is_file()


def test_a_torn_last_metrics_line_is_skipped_and_noted(sweep, capsys):
    path = sweep / "1_bf16" / "metrics.jsonl"
    whole = path.read_text().splitlines()
    path.write_text("\n".join(whole) + "\n" + whole[-1][:20])  # a record cut off mid-write
    code, out, _ = report_cli(capsys, str(sweep), "--no-plots")
    assert code == 0 and f"{path} line {len(whole) + 1} is torn" in out
    run = next(r for g in build_report([sweep]).groups for v in g.variants for r in v.runs if r.dir.name == "1_bf16")
    records = [json.loads(line) for line in whole]
    train, evals = run.curves  # every whole record's loss kept, by step
    assert train == tuple((r["step"], r["loss"]) for r in records if r["kind"] == "train") and len(train) > 1
    assert evals == tuple((r["step"], r["loss"]) for r in records if r["kind"] == "eval")


def test_metrics_lines_optbench_never_writes_are_noted(sweep, capsys):
    """A line of JSON that is no record leaves the run's curve out; a loss that is no number (but
    for "nan"/"inf", how a diverged step is written) is left out of it: each with a note."""
    path = sweep / "1_bf16" / "metrics.jsonl"
    whole = path.read_text().splitlines()
    first = json.loads(whole[0])
    path.write_text("\n".join([json.dumps({**first, "loss": "x"}), json.dumps({**first, "step": 99, "loss": "nan"}),
                               *whole[1:]]) + "\n")
    code, out, _ = report_cli(capsys, str(sweep), "--no-plots")
    words = " ".join(out.split())
    assert code == 0 and f"{path} has 1 train/eval record(s) whose loss is no number" in words
    path.write_text("\n".join([*whole[:2], "[1, 2]", *whole[2:]]) + "\n")
    code, out, _ = report_cli(capsys, str(sweep), "--no-plots")
    words = " ".join(out.split())
    assert code == 0 and f"{path} line 3 is [1, 2], not a JSON object" in words and "its loss curve is not drawn" in words


def test_nothing_readable_exit_2(tmp_path, capsys):
    fake_run(tmp_path / "r", overrides=["model=tiny"])
    path = tmp_path / "r" / "summary.json"
    path.write_text(path.read_text()[:-25])
    code, out, err = report_cli(capsys, str(tmp_path / "r"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(path) in err and "truncated or corrupt" in err
    assert not (tmp_path / "r" / "report.md").exists()  # nothing that looks like a completed report


def test_report_error_is_a_config_error():
    with pytest.raises(ReportError, match="at least one PATH"):
        build_report([])


def test_a_killed_job_is_listed_with_its_reason(sweep):
    """A Hydra job dir without summary.json (killed, e.g. out of memory) is not silently dropped."""
    killed = sweep / "4_fp16"
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "overrides.yaml").write_text("- precision=fp16\n- model=tiny\n- train.batch_size=64\n")
    (killed / ".hydra" / "config.yaml").write_text(
        "model:\n" + "".join(f"  {k}: {v}\n" for k, v in MODELS["tiny"].items()) + "task:\n  name: lm\n"
    )
    report = build_report([sweep])
    assert len(report.groups) == 1  # grouped by the model in .hydra/config.yaml
    row = next(v for v in variants(report).values() if v["runs"] == ["4_fp16"])
    assert row["status"] == "no summary" and "killed" in row["reason"]
    assert variants(report)["precision=fp32 train.batch_size=-"]["baseline"]


def test_the_same_config_on_two_devices_is_two_variants(tmp_path):
    fake_run(tmp_path / "a", overrides=["x=a"], started="01")
    fake_run(tmp_path / "b", overrides=["x=a"], step_times=noisy(0.01), started="02")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    summary["device"] = "cuda:0 (NVIDIA H100 80GB HBM3)"
    write_json_atomic(tmp_path / "b" / "summary.json", summary)
    rows = variants(build_report([tmp_path]))
    assert list(rows) == ["x=a on cpu", "x=a on cuda:0"]
    assert rows["x=a on cuda:0"]["vs_baseline"]["speedup"] == pytest.approx(10, rel=0.1)


def test_the_prediction_error_per_variant_and_over_the_sweep(tmp_path):
    """summary.json's predicted step beside the measured median: a column per variant, one line
    over the report; a run that predicted nothing shows '-' and is left out of the line."""
    root = tmp_path / "sweep"
    for name, measured, predicted in (("0_fp32", 0.10, 0.11), ("1_bf16", 0.05, 0.045), ("2_fp16", 0.10, None)):
        run = fake_run(root / name, overrides=[f"precision={name[2:]}", "model=tiny"],
                       step_times=noisy(measured, seed=len(name)), started=name[0])
        if predicted is not None:
            summary = json.loads((run / "summary.json").read_text())
            summary["predicted"] = {"step_time_s": predicted, "method": "test"}
            write_json_atomic(run / "summary.json", summary)
    report = build_report([root])
    table = variants(report)
    fp32 = table["precision=fp32"]["predicted"]
    measured = table["precision=fp32"]["step_time_s"]["median"]
    assert fp32["step_time_s"] == 0.11 and fp32["error"] == pytest.approx(0.11 / measured - 1)
    assert table["precision=fp16"]["predicted"] == {"step_time_s": None, "error": None}
    text = render(report, "table")
    assert "predicted s (error)" in text and f"0.11 ({0.11 / measured - 1:+.0%})" in text
    worst = max((table[k]["predicted"]["error"] for k in ("precision=fp32", "precision=bf16")), key=abs)
    assert "over 2 variant(s)" in text and f"worst {worst:+.1%}" in text
    words = " ".join(text.split())
    assert "error = predicted / measured - 1" in words  # what the figure is
    assert "recorded no machine-speed probe" in words  # and whether the machine let it hold


@pytest.mark.parametrize("after, says", [(4e9, "as much as the error: on a loaded machine"),
                                         (9.5e9, "less than the error: the error is mostly the prediction's own")])
def test_a_large_prediction_error_says_whether_the_machine_moved_as_much(tmp_path, after, says):
    """Issue 47 item 4: a +232% error with no note; on a loaded machine the prediction cannot hold."""
    for job, (measured, predicted) in enumerate(((0.10, 0.11), (0.05, 0.12))):
        run = fake_run(tmp_path / f"{job}_x", overrides=[f"x={job}"], step_times=noisy(measured, seed=job),
                       started=f"{job:02d}")
        summary = json.loads((run / "summary.json").read_text())
        summary["predicted"] = {"step_time_s": predicted, "method": "test"}
        summary["machine_speed"] = {"before": {"flops": 10e9}, "after": {"flops": after if job else 10e9}}
        write_json_atomic(run / "summary.json", summary)
    words = " ".join(render(build_report([tmp_path]), "table").split())
    assert "worst +1" in words and "(x=1)" in words and says in words
