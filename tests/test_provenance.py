"""summary.json ``provenance``: the commit, the packages, the GPU and the CPU a run used;
``optbench --version`` prints them; ``optbench report`` says when pooled runs differ in them."""

from __future__ import annotations

import json
import subprocess

import torch

from optbench.measure import cpu_name
from optbench.provenance import differences, git_state
from optbench.report.analysis import build_report
from optbench.summary import RunSummary
from tests.helpers import ROOT, fake_run, run_cli_here


def test_a_summary_names_the_commit_the_packages_and_the_machine():
    record = RunSummary().to_dict()["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert record["git"]["commit"] == head.stdout.strip() and isinstance(record["git"]["dirty"], bool)
    assert record["packages"]["torch"] == torch.__version__.split("+")[0] or \
        record["packages"]["torch"] == torch.__version__
    assert record["packages"]["transformers"] and record["packages"]["xarray"] and record["packages"]["numpy"]
    assert record["cpu"] == cpu_name()
    assert record["gpu"] is None if not torch.cuda.is_available() else record["gpu"]["names"]


def test_without_a_checkout_the_commit_is_null_and_says_why(monkeypatch, tmp_path):
    import optbench.provenance as provenance

    monkeypatch.setattr(provenance, "__file__", str(tmp_path / "site-packages" / "optbench" / "provenance.py"))
    state = git_state()
    assert state["commit"] is None and state["dirty"] is None and "not run from a git checkout" in state["why"]


def test_version_prints_the_commit_and_packages(capsys):
    result = run_cli_here("--version", capsys=capsys)
    assert result.returncode == 0
    first, *rest = result.stdout.splitlines()
    assert first.startswith("optbench ") and " git " in first
    assert any(line.strip().startswith("torch ") for line in rest) and rest[-1].startswith("cpu ")


def test_report_warns_in_one_line_when_pooled_runs_differ(tmp_path):
    a = fake_run(tmp_path / "a", overrides=["precision=fp32"])
    b = fake_run(tmp_path / "b", overrides=["precision=fp32"], started="01")
    assert not [n for n in build_report([tmp_path]).notes if "differ in what" in n]
    summary = json.loads((b / "summary.json").read_text())
    summary["provenance"]["packages"]["torch"] = "2.11.0"
    (b / "summary.json").write_text(json.dumps(summary))
    (warning,) = [n for n in build_report([tmp_path]).notes if "differ in what" in n]
    assert "packages.torch" in warning and "'2.11.0'" in warning and "\n" not in warning
    assert differences([json.loads((a / "summary.json").read_text())["provenance"], summary["provenance"]]) \
        .keys() == {"packages.torch"}
