"""Real runs: the sweep-end report written by the Hydra callback, the speedup gate on real outputs,
and optbench compare (A/B in separate processes, same seed and data)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from optbench.cli import main as cli_main
from optbench.report.compare import run_order
from optbench.report.format import REPORT_FILES
from optbench.report.plots import PLOT_FILES
from optbench.report.sweep_report import SweepReport
from tests.helpers import FAST, run_cli_here


def test_sweep_ends_with_its_report_and_the_speedup_gate_fails_by_name(tmp_path, capsys):
    """A sweep where one job is incompatible still gets report.md; `optbench report outputs/
    --min-speedup 100` exits 1 naming the gate."""
    sweep = tmp_path / "multirun" / "sweep"
    result = run_cli_here("train", "-m", "precision=fp32,tf32", *FAST, f"hydra.sweep.dir={sweep}", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert f"optbench: sweep report written to {sweep / 'report.md'}" in result.stdout
    for name in (*REPORT_FILES, *PLOT_FILES):
        assert (sweep / name).is_file(), name
    markdown = (sweep / "report.md").read_text()
    assert "baseline: precision=fp32" in markdown
    tf32 = next(line for line in markdown.splitlines() if "| precision=tf32 |" in line)
    assert tf32.startswith("| #1 | precision=tf32 | incompatible [")  # the sweep's job number; the reason a note
    ref = tf32.split("incompatible ")[1].split("]")[0] + "]"
    assert f"- {ref} incompatible: precision=tf32 needs CUDA" in markdown
    data = json.loads((sweep / "report.json").read_text())
    fp32 = data["groups"][0]["variants"][0]
    summary = json.loads(next(sweep.glob("0_*/summary.json")).read_text())
    assert fp32["tokens_per_s"] == pytest.approx(summary["throughput"]["tokens_per_s"])
    assert fp32["step_time_s"]["median"] == pytest.approx(summary["throughput"]["step_time_s"]["median"])

    result = run_cli_here("report", str(tmp_path), "--min-speedup", "100", "--no-plots", capsys=capsys)
    assert result.returncode == 1
    assert "optbench: gate failed: min-speedup 100: precision=tf32 vs precision=fp32" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_callback_never_fails_a_sweep(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text('{"status": "comp')  # truncated
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    callback = SweepReport()
    callback.on_multirun_start(config=config)
    callback.on_multirun_end(config=config)  # must not raise
    err = capsys.readouterr().err
    assert "optbench: sweep report not written" in err and f"run `optbench report {tmp_path}`" in err


def test_a_disabled_callback_writes_nothing(tmp_path, capsys):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    callback = SweepReport(enabled=False)
    callback.on_multirun_start(config=config)
    callback.on_multirun_end(config=config)
    assert list(tmp_path.iterdir()) == [] and capsys.readouterr() == ("", "")


def test_run_order_is_counterbalanced():
    assert run_order(1) == ["A", "B"]
    assert run_order(3) == ["A", "B", "B", "A", "A", "B"]


def test_compare_runs_a_and_b_with_the_same_seed_and_reports(tmp_path, capsys):
    out = tmp_path / "cmp"  # the sides train in processes of their own; compare itself runs here
    result = run_cli_here("compare", *FAST, "--", *FAST, "attention=math", "--repeats", "1", "--out", str(out),
                          "--max-loss-delta", "1e-4", "--no-plots", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert "[1/2] A: optbench train" in result.stdout and "[2/2] B: optbench train" in result.stdout
    assert result.stdout.count("        step 5 (6/6 done) loss ") == 2  # each child's progress is shown
    manifest = json.loads((out / "compare.json").read_text())
    assert [r["dir"] for r in manifest["runs"]] == ["0_A", "1_B"]
    a, b = (json.loads((out / d / "summary.json").read_text()) for d in ("0_A", "1_B"))
    assert a["status"] == b["status"] == "completed"
    assert b["applied"]["attention"] == "math" and a["applied"]["attention"] == "sdpa"
    assert a["loss"]["first"] == pytest.approx(b["loss"]["first"], abs=1e-5)  # same init, same batch
    assert (out / "0_A" / "console.log").is_file()
    group = json.loads((out / "report.json").read_text())["groups"][0]
    assert group["baseline"] == "A attention=sdpa"
    b_row = group["variants"][1]
    assert b_row["label"] == "B attention=math" and b_row["vs_baseline"]["speedup"] > 0
    assert b_row["vs_baseline"]["verdict"] == "too few timed steps (need 10 per variant)"  # FAST: 4
    assert "ok      max-loss-delta 0.0001" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compile=none"], "separate A's overrides from B's with ' -- '"),
        (["--", "train.seed=1"], "A and B differ in train.seed (0 vs 1)"),
        (["--", "model=small"], "A and B differ in model"),
        (["--", "attention=nope"], "B overrides attention=nope:"),
        (["--", "train.steps=0"], "B overrides train.steps=0:"),
        pytest.param(["--", "precision=tf32"], "B overrides precision=tf32: precision=tf32 needs CUDA",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="tf32 runs on CUDA")),
        (["--", "--repeats", "0"], "--repeats: '0' must be at least 1"),
        (["--", "--min-speedup", "fast"], "--min-speedup: 'fast' is not a number"),
    ],
)
def test_compare_bad_input_is_one_line_exit_2_before_anything_runs(tmp_path, capsys, args, message):
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", *args, "--out", str(out)])
    _, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_compare_refuses_an_out_dir_that_holds_runs(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["compare", "--", "attention=math", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "already holds runs" in capsys.readouterr().err


def test_compare_and_validate_refuse_an_out_dir_that_holds_a_report(tmp_path, capsys):
    """A report (or a validation) already in --out would be written over: refused before anything runs."""
    from tests.helpers import cli_one_line

    (tmp_path / "report.md").write_text("kept")
    code, err = cli_one_line(capsys, "compare", "--", "attention=math", "--out", str(tmp_path))
    assert code == 2 and f"{tmp_path} already holds report.md; choose another --out (nothing was run)" in err
    (tmp_path / "report.md").unlink()
    (tmp_path / "validate.json").write_text("kept")
    code, err = cli_one_line(capsys, "validate", "model=tiny", "--repeats", "1", "--out", str(tmp_path))
    assert code == 2 and "already holds validate.json" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["validate.json"]


def test_a_report_that_cannot_be_written_leaves_the_one_before_whole(finished, tmp_path, capsys):
    """A full disk (here a 2 KiB file size limit) while the report is rewritten: one line, and the
    earlier report.md/csv/json/plots stay as they were, not half replaced."""
    from tests.helpers import cli_one_line
    from tests.run.test_reliability import file_size_limit

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        cli_main(["report", str(finished), "--out", str(out)])
    assert done.value.code == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {*REPORT_FILES, *PLOT_FILES}
    with file_size_limit(2 * 1024):
        code, err = cli_one_line(capsys, "report", str(finished), "--out", str(out))
    assert code == 2 and f"cannot write the report into {out}" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
