"""optbench validate (the plan's phase 9): phase choice, the plan's claims, gates and verdict on
injected results, bad input, and one real end-to-end validation (two optbench train processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from optbench.cli import main as cli_main
from optbench.data.netcdf.synth import write_synthetic
from optbench.errors import ReportError
from optbench.estimate.api import count_model
from optbench.exits import VERDICTS
from optbench.outputs import write_json_atomic
from optbench.report.analysis import Gates, build_report
from optbench.report.compare import run_order
from optbench.report.runs import COMPARE_MANIFEST
from optbench.validate.api import assemble, projection
from optbench.validate.claims import PLAN_GATES, claim_between
from optbench.validate.format import render_csv, render_markdown, render_text
from optbench.validate.setup import (
    Composer,
    PhaseState,
    Setup,
    Side,
    choose_candidate,
    prepare,
    side_overrides,
    split_overrides,
)
from tests.helpers import ROOT, TEST_DEFAULTS, fake_run, noisy

PHASES = ["0_baseline", "1_compile", "2_ac", "3_loss_freq", "4_dataloader", "5_cpu_offload", "6_bf16",
          "7_fsdp2", "7_fsdp2_cpu_offload_policy", "8_flex_fused_adamw"]
CPU_STATES = [PhaseState(p, [] if int(p[0]) <= 4 else [f"{p} needs CUDA: fix it"]) for p in PHASES]


# --------------------------------------------------------------------------- the plan's claims
def test_claims_multiply_over_the_span_and_count_a_shared_phase_number_once():
    low, high = claim_between("0_baseline", "4_dataloader")
    assert low == pytest.approx(1.15 * 1.30 * 1.20 * 1.05) and high == pytest.approx(1.30 * 1.60 * 1.30 * 1.10)
    assert claim_between("6_bf16", "7_fsdp2_cpu_offload_policy") == pytest.approx((1.10, 1.20))
    assert claim_between("7_fsdp2", "7_fsdp2_cpu_offload_policy") is None  # the same phase, two variants
    assert claim_between("0_baseline", "8_flex_fused_adamw") == pytest.approx((2.627, 5.644), abs=1e-3)
    assert PLAN_GATES == Gates(3.0, 0.001, 3.33)


# ------------------------------------------------------------------------------- phase choice
def test_the_furthest_runnable_phase_is_the_candidate_even_past_a_blocked_one():
    assert choose_candidate(CPU_STATES, "0_baseline") == "4_dataloader"
    gpu2 = [PhaseState(p, ["torchao is single-GPU"] if p == "7_fsdp2" else []) for p in PHASES]
    assert choose_candidate(gpu2, "0_baseline") == "8_flex_fused_adamw"
    with pytest.raises(ReportError, match="no phase after 4_dataloader runs on this machine.*5_cpu_offload: "):
        choose_candidate(CPU_STATES, "4_dataloader")


def test_sides_are_named_by_phase_or_override():
    common, base, cand = split_overrides(["model=tiny", "candidate=6_bf16", "baseline=precision=bf16"])
    assert common == ["model=tiny"] and base == ["precision=bf16"] and cand == ["6_bf16"]
    assert side_overrides(cand, what="candidate", phases=PHASES, default_phase="0_baseline") == ["phase=6_bf16"]
    assert side_overrides(base, what="baseline", phases=PHASES, default_phase="0_baseline") == [
        "phase=0_baseline", "precision=bf16"]
    with pytest.raises(ReportError, match="unknown candidate phase '9_x'; the phases are: 0_baseline, "):
        side_overrides(["phase=9_x"], what="candidate", phases=PHASES, default_phase="0_baseline")
    with pytest.raises(ReportError, match="would set both sides"):
        split_overrides(["phase=3_loss_freq"])


def test_run_order_counterbalances_more_than_two_sides():
    assert run_order(3, sides=("A", "p", "B")) == ["A", "p", "B", "B", "p", "A", "A", "p", "B"]


# --------------------------------------------------------------- gates and verdict, injected
def _validation_dir(root, *, b_times, b_loss=4.9, b_peak=120 * 2**20, b_status="completed", repeats=2,
                    middle=False):
    """A validate output dir as its runs leave it: A (phase 0) and B (phase 4), interleaved; with
    ``middle``, phase 2 between them (--all-phases)."""
    runs = []
    sides = ("A", "phase-2_ac", "B") if middle else ("A", "B")
    for r in range(repeats):
        for side in sides if r % 2 == 0 else tuple(reversed(sides)):
            name = f"{len(runs)}_{side}"
            phase = {"A": "0_baseline", "B": "4_dataloader"}.get(side, "2_ac")
            kwargs = dict(step_times=noisy(0.4, seed=r), loss_eval=4.9, peak_bytes=100 * 2**20) if side == "A" else \
                dict(step_times=b_times(r), loss_eval=b_loss, peak_bytes=b_peak, status=b_status,
                     error=None if b_status == "completed" else "killed") if side == "B" else \
                dict(step_times=noisy(0.2, seed=20 + r), loss_eval=4.9, peak_bytes=90 * 2**20)
            fake_run(root / name, overrides=[f"phase={phase}", "model=tiny"], started=f"{len(runs):02d}", **kwargs)
            summary = json.loads((root / name / "summary.json").read_text())
            summary["config"]["train"].update(batch_size=4, grad_accum=2)
            write_json_atomic(root / name / "summary.json", summary)
            runs.append({"dir": name, "side": side if side in ("A", "B") else None})
    write_json_atomic(root / COMPARE_MANIFEST, {"a": [], "b": [], "runs": runs})
    return root


def _setup(samples=1000, *, middle=False):
    sides = [Side("A", "baseline", ["phase=0_baseline", "model=tiny"]), Side("B", "candidate", ["phase=4_dataloader", "model=tiny"])]
    if middle:
        sides.insert(1, Side("phase-2_ac", "intermediate", ["phase=2_ac", "model=tiny"]))
    return Setup(["model=tiny"], sides, CPU_STATES, samples, ["a note"])


def _validate(root, *, middle=False):
    report = build_report([root], candidate=["phase=4_dataloader"], gates=PLAN_GATES)
    return assemble(report, _setup(middle=middle))


def test_a_clear_4x_with_the_same_loss_is_validated_with_epoch_times_and_claims(tmp_path):
    result = _validate(_validation_dir(tmp_path, b_times=lambda r: noisy(0.1, seed=10 + r)))
    assert result["validated"] and result["why_not"] == []
    assert [g["gate"] for g in result["gates"] if g["ok"]] == ["min-speedup", "max-loss-delta", "max-memory-ratio"]
    base, cand = result["baseline"], result["candidate"]
    # 128 tokens per step of 4 x 2 samples: 16 tokens per sample; 1000 samples per epoch
    assert base["epoch"]["tokens_per_sample"] == 16
    assert base["epoch"]["seconds"] == pytest.approx(1000 * 16 / base["tokens_per_s"])
    assert base["epoch"]["ci_low"] < base["epoch"]["seconds"] < base["epoch"]["ci_high"]
    assert cand["epoch"]["seconds"] == pytest.approx(base["epoch"]["seconds"] / result["comparison"]["speedup"])
    rows = {r["phase"]: r for r in result["phases"]}
    assert rows["0_baseline"]["here"] == "baseline"
    assert rows["2_ac"]["here"].startswith("runs here, not run")
    assert rows["4_dataloader"]["here"] == "candidate" and rows["4_dataloader"]["previous"] == "0_baseline"
    assert rows["4_dataloader"]["claim_span"] == pytest.approx(claim_between("0_baseline", "4_dataloader"))
    assert rows["4_dataloader"]["vs_baseline"]["ci_low"] > 3
    assert rows["6_bf16"]["here"] == "blocked: 6_bf16 needs CUDA"
    assert [s["phase"] for s in result["skipped"]] == PHASES[5:]
    text = render_markdown(result)
    assert text.startswith("# Phase 9 validation: VALIDATED")
    assert "- 7_fsdp2: 7_fsdp2 needs CUDA: fix it" in text
    # measured on a CPU: nothing to project the plan's GPUs from (issue 27 item 9), and it says why
    assert "PROJECTION" not in text and base["projection"] == [] and cand["projection"] == []
    assert "Projection to the plan's GPUs: not projected: nothing measured on cpu (test) predicts the MFU of a H100" \
        in text and "give --project-mfu F" in text
    assert "4_dataloader,candidate,5-10% faster,0_baseline," in render_csv(result)


def test_all_phases_set_each_phase_beside_the_plan_claim_for_its_span(tmp_path):
    result = _validate(_validation_dir(tmp_path, b_times=lambda r: noisy(0.1, seed=10 + r), middle=True), middle=True)
    rows = {r["phase"]: r for r in result["phases"]}
    middle, last = rows["2_ac"], rows["4_dataloader"]
    assert middle["here"] == "intermediate" and middle["previous"] == "0_baseline"
    assert middle["vs_previous"]["speedup"] == pytest.approx(2.0, rel=0.1)
    assert middle["claim_span"] == pytest.approx(claim_between("0_baseline", "2_ac"))
    assert last["previous"] == "2_ac" and last["vs_previous"]["speedup"] == pytest.approx(2.0, rel=0.1)
    assert last["claim_span"] == pytest.approx((1.20 * 1.05, 1.30 * 1.10))
    assert last["vs_baseline"]["speedup"] == pytest.approx(4.0, rel=0.1) and result["validated"]


def test_a_candidate_that_is_not_a_phase_gets_its_own_row_after_the_baseline(tmp_path):
    root = tmp_path / "v"
    runs = []
    for i, side in enumerate(["A", "B", "B", "A"]):
        extra = ["compile=default"] if side == "B" else []
        fake_run(root / f"{i}_{side}", overrides=["phase=0_baseline", *extra, "model=tiny"], started=f"{i:02d}",
                 step_times=noisy(0.4 if side == "A" else 0.3, seed=i))
        runs.append({"dir": f"{i}_{side}", "side": side})
    write_json_atomic(root / COMPARE_MANIFEST, {"runs": runs})
    setup = Setup(["model=tiny"], [Side("A", "baseline", ["phase=0_baseline", "model=tiny"]),
                                   Side("B", "candidate", ["phase=0_baseline", "compile=default", "model=tiny"])],
                  CPU_STATES, 1000)
    result = assemble(build_report([root], gates=PLAN_GATES), setup)
    rows = result["phases"]
    assert [r["phase"] for r in rows[:3]] == ["0_baseline", "0_baseline + compile=default", "1_compile"]
    assert rows[0]["here"] == "baseline" and rows[0]["tokens_per_s"] == result["baseline"]["tokens_per_s"]
    assert rows[1]["here"] == "candidate" and rows[1]["vs_baseline"]["speedup"] == pytest.approx(4 / 3, rel=0.05)
    assert rows[2]["here"] == "runs here; after the candidate" and not result["validated"]


def test_the_projection_needs_an_mfu_that_means_something_for_the_gpu(tmp_path):
    """Projected from the MFU measured on a known GPU, or one given; not from estimate.mfu's 0.4 for a
    model measured on a CPU, which gave both sides of a tiny model 7.56M tokens/s (issue 27 item 9)."""
    root = _validation_dir(tmp_path, b_times=lambda r: noisy(0.1, seed=10 + r), repeats=1)
    summary = json.loads((root / "0_A" / "summary.json").read_text())
    tps, fpt = summary["throughput"]["tokens_per_s"], summary["model"]["flops_per_token"]
    summary["throughput"].update(peak_flops=tps * fpt / 0.25, peak_source="datasheet H100 SXM dense float32")
    write_json_atomic(root / "0_A" / "summary.json", summary)
    report = build_report([root], gates=PLAN_GATES)
    side = Side("A", "baseline", ["phase=0_baseline", "model=tiny"])
    side.cfg, side.config = Composer()(side.overrides, what="baseline")
    variants = {v.first.side: v for v in report.groups[0].variants}
    gpu, why = projection(side, variants["A"], samples_per_epoch=1000, gpu="h100", mfu=None)
    cpu, cpu_why = projection(side, variants["B"], samples_per_epoch=1000, gpu="h100", mfu=None)
    given, _ = projection(side, variants["B"], samples_per_epoch=1000, gpu="h100", mfu=0.3)
    assert why is None and gpu[0]["mfu"] == pytest.approx(0.25) and gpu[0]["mfu_source"].startswith(
        "measured here (datasheet H100")
    assert cpu == [] and cpu_why.startswith("not projected: nothing measured on cpu (test) predicts the MFU of a H100")
    assert given[0]["mfu"] == 0.3 and given[0]["mfu_source"] == "given (--project-mfu)"
    # tokens/s = MFU x 66.9 TFLOP/s (H100 SXM fp32) / FLOPs per token, x2 GPUs; an epoch of 1000 x 256 tokens
    per_gpu = 0.25 * 66.9e12 / count_model(side.config).flops_per_token
    assert gpu[0]["tokens_per_s"] == pytest.approx(2 * per_gpu, rel=0.01)
    assert gpu[0]["epoch_s"] == pytest.approx(1000 * 256 / (2 * per_gpu), rel=0.01)
    assert gpu[1]["epoch_s"] == pytest.approx(gpu[0]["epoch_s"] / 2)


def test_mfu_agrees_with_the_tokens_per_s_beside_it(tmp_path):
    """Pooled over repeats of unequal speed, MFU x peak / FLOPs per token is the tokens/s printed
    beside it (it was the mean of the runs' MFUs: 9,888 tokens/s at 16.7%, 13,211 at 15.2%)."""
    result = _validate(_validation_dir(tmp_path, b_times=lambda r: noisy(0.1 * (1 + r), seed=10 + r)))
    for side in (result["baseline"], result["candidate"]):
        assert side["mfu"] * side["peak_flops"] * side["world_size"] / side["flops_per_token"] == \
            pytest.approx(side["tokens_per_s"], rel=1e-9)
    assert f"{result['candidate']['mfu']:.1%}" in render_text(result, width=100)


def test_the_plan_is_not_judged_where_its_last_phase_cannot_run(tmp_path):
    """On a CPU the furthest phase that runs is 4 of 8: the plan's gates are measured against it and
    reported, not judged (exit 3, which make validate treats as done); a run that failed is still a
    failure; a candidate the user names is judged."""
    root = _validation_dir(tmp_path, b_times=lambda r: noisy(0.3, seed=10 + r))  # 1.3x: the 3x gate fails
    report = build_report([root], candidate=["phase=4_dataloader"], gates=PLAN_GATES)
    picked = _setup()
    picked.picked = True
    result = assemble(report, picked)
    assert result["verdict"] == "NOT JUDGED HERE" and not result["validated"]
    assert result["why_not"][0].startswith("the plan's phases 5_cpu_offload..8_flex_fused_adamw cannot run on this "
                                           "machine") and VERDICTS[result["verdict"]] == 3
    text = render_text(result, width=100)
    assert "Gates (the plan's phase 9): measured, not judged" in text and "would fail" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert assemble(report, _setup())["verdict"] == "NOT VALIDATED"  # candidate=4_dataloader named: judged
    failed = _validation_dir(tmp_path / "f", b_times=lambda r: None, b_status="failed")
    report = build_report([failed], candidate=["phase=4_dataloader"], gates=PLAN_GATES)
    assert assemble(report, picked)["verdict"] == "NOT VALIDATED"


@pytest.mark.parametrize("case, expected", [
    (dict(b_times=lambda r: noisy(0.2, seed=10 + r)), "gate failed: min-speedup 3: "),
    (dict(b_times=lambda r: noisy(0.1, seed=10 + r), b_loss=4.95), "gate failed: max-loss-delta 0.001: "),
    (dict(b_times=lambda r: noisy(0.1, seed=10 + r), b_peak=400 * 2**20), "gate failed: max-memory-ratio 3.33: "),
    (dict(b_times=lambda r: None, b_status="failed"), "candidate did not complete (failed: killed)"),
])
def test_a_failing_gate_or_a_candidate_that_did_not_run_is_never_validated(tmp_path, case, expected):
    result = _validate(_validation_dir(tmp_path, **case))
    assert not result["validated"]
    assert any(expected in why for why in result["why_not"]), result["why_not"]
    assert render_markdown(result).startswith("# Phase 9 validation: NOT VALIDATED")


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("args, message", [
    (["candidate=9_nope"], "unknown candidate phase '9_nope'; the phases are: 0_baseline, 1_compile"),
    (["candidate=0_baseline"], "resolves to the same config as the baseline"),
    (["--min-speedup", "nan"], "--min-speedup: 'nan' must be a finite number >= 0"),
    (["--max-loss-delta", "inf"], "--max-loss-delta: 'inf' must be a finite number >= 0"),
    (["phase=2_ac"], "name the candidate's phase with candidate=phase=2_ac"),
    (["hydra.run.dir=x"], "validate puts every run under --out itself"),
    (["candidate=8_flex_fused_adamw", "train.device=cpu"],
     "candidate phase=8_flex_fused_adamw cannot run on this machine, so it cannot be validated here: attention=flex "
     "needs CUDA"),
])
def test_bad_input_is_one_line_exit_2_before_anything_runs(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["validate", *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_climate_under_ddp_picks_the_furthest_phase_and_counts_the_epoch_from_the_files(tmp_path):
    path = tmp_path / "tiny.nc"
    write_synthetic(path, days=6, step_hours=6, nlat=8, nlon=16, time_chunk=4)  # 24 steps
    setup = prepare(["task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={tmp_path / 's'}",
                     "data.eval_fraction=0.2", "model=tiny", "parallel=ddp", "train.device=cpu"], all_phases=True)
    assert setup.candidate.phase == "4_dataloader" and setup.candidate.config.parallel.name == "ddp"
    assert [s.key for s in setup.sides] == ["A", "phase-1_compile", "phase-2_ac", "phase-3_loss_freq", "B"]
    assert setup.baseline.config.parallel.name == "ddp" and setup.baseline.config.task.name == "climate"
    # 24 steps, history 2: 22 windows, the last 20% (5) held out for eval
    assert setup.samples_per_epoch == 17
    assert [s.name for s in setup.states if not s.runnable] == PHASES[5:]
    # parallel=ddp cannot carry FSDP2's CPUOffloadPolicy: the row names the option, not the command line
    assert setup.state("7_fsdp2_cpu_offload_policy").reasons[0].startswith("parallel.cpu_offload=true")


# --------------------------------------------------------------------------------- end to end
def test_make_validate_on_a_cpu_picks_phase_4_runs_both_sides_reports_and_ends_without_an_error(tmp_path):
    """`make validate` as a user types it, on a CPU: the plan's phases 5-8 cannot run, so phase 4 is
    measured against the plan's gates, reported, not judged: optbench validate exits 3 and make
    ends without `make: *** Error` (issue 27 item 11)."""
    out = tmp_path / "v"
    venv = Path(sys.executable).parent.parent
    args = ["model=tiny", "train.device=cpu", "train.steps=3", "train.seq_len=16", "train.batch_size=2",
            "train.grad_accum=1", "measure.warmup_steps=1", "train.eval_batches=1", "log.progress=log", "compile=none",
            "dataloader=baseline", "estimate.predict=false", *TEST_DEFAULTS, "--repeats", "1", "--out", str(out), "--format", "json"]
    done = subprocess.run(["make", "-s", "-o", str(venv / ".installed"), "validate", f"VENV={venv}",
                           f"VALIDATE_ARGS={' '.join(args)}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Error" not in done.stderr and "make validate: measured and reported, not judged on this machine" in done.stdout
    assert "optbench: NOT JUDGED HERE: phase=4_dataloader vs phase=0_baseline (exit 3)" in done.stderr
    result = json.loads(done.stdout[done.stdout.index("{\n"):done.stdout.rindex("}") + 1])
    assert result == json.loads((out / "validate.json").read_text())
    assert not result["validated"] and result["verdict"] == "NOT JUDGED HERE"
    assert result["baseline"]["overrides"][0] == "phase=0_baseline"
    assert result["candidate"]["overrides"][0] == "phase=4_dataloader"
    assert result["baseline"]["status"] == result["candidate"]["status"] == "completed"
    assert result["machine"]["device"].startswith("cpu")
    assert "compile=none is given for both sides, so phase 4_dataloader's own change of compile (none -> default) is not " \
        "measured" in result["notes"]
    assert [s["phase"] for s in result["skipped"]] == PHASES[5:]
    gates = {g["gate"]: g for g in result["gates"]}
    assert not gates["min-speedup"]["ok"] and gates["max-memory-ratio"]["value"] is not None
    base = result["baseline"]
    assert base["epoch"]["samples_per_epoch"] == 1_000_000 and base["epoch"]["tokens_per_sample"] == pytest.approx(16)
    assert base["projection"] == [] and base["projection_note"].startswith("not projected: nothing measured on cpu")
    for name in ("validate.md", "validate.csv", "validate_phases.png", "report.md", "compare.json", "0_A/summary.json",
                 "1_B/summary.json"):
        assert (out / name).is_file(), name


def test_a_validation_that_cannot_be_written_leaves_the_one_before_whole(tmp_path):
    """A full disk (here a 2 KiB file size limit) while validate.md/csv/json are rewritten: one
    error, the earlier ones as they were, not a new .md beside a cut .json."""
    from optbench.errors import ReportError
    from optbench.validate.format import write_validation
    from tests.run.test_reliability import file_size_limit

    result = _validate(_validation_dir(tmp_path / "runs", b_times=lambda r: noisy(0.1, seed=10 + r)))
    out = tmp_path / "out"
    out.mkdir()
    write_validation(result, out, plots=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"validate.md", "validate.csv", "validate.json"}
    with file_size_limit(2 * 1024), pytest.raises(ReportError, match=f"cannot write the validation into {out}"):
        write_validation({**result, "validated": not result["validated"]}, out, plots=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
