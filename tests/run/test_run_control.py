"""Run control: the profiler, early stopping, the loss-spike guard, the time budget, bounded
shutdown, the memory refusal, out-of-memory as an outcome, resumable sweeps, the log level."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from optbench.config import compose, to_config
from optbench.errors import IncompatibleError, RunStopped
from optbench.outputs import format_summary, read_metrics
from optbench.run.train import train
from tests.helpers import FAST, ROOT, read_summary, run_cli_here

# fewer steps than FAST, no MemTracker: these tests are about how a run ends, not what it measures
QUICK = [*FAST, "train.steps=3", "measure.warmup_steps=1", "measure.track_memory=false"]


@pytest.fixture(scope="module")
def completed(tmp_path_factory) -> Path:
    """One completed QUICK run, the reference of the time budget and sweep tests."""
    run_dir = tmp_path_factory.mktemp("completed")
    assert train(compose(QUICK), run_dir=run_dir).status == "completed"
    return run_dir


def _train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


# ------------------------------------------------------------------------------------- profiler
def test_profiler_trace_parses_names_real_ops_and_its_steps_are_not_timed(tmp_path):
    overrides = [*QUICK, "train.steps=4", "profile=trace", "profile.skip_first=1", "profile.wait=0",
                 "profile.warmup=1", "profile.active=1"]
    result = train(compose(overrides), run_dir=tmp_path)
    assert result.status == "completed", result.error
    profile = result.summary["profile"]
    # 0-based, as metrics.jsonl: step 0 is skipped, 1 warms the profiler up, 2 is recorded (profile.active=1;
    # `steps` listed the warm-up step too, 1-based, so the default's 3 recorded steps read as 4: issue 27 item 10)
    assert profile["steps"] == [2] and profile["warmup_steps"] == [1] and profile["excluded_steps"] == [1, 2]
    assert profile["excluded_from_timing"]
    # 4 steps: 1 warm-up, 2 profiled (the profiler's warm-up and active step) -> one timed step
    assert result.summary["throughput"]["timed_steps"] == 1
    timed = [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "train" and r["timed"]]
    assert timed == [3]
    assert "recorded step 2, profiler warm-up step 1 (left out of the timing)" in format_summary(
        result.record, tmp_path)
    traces = list((tmp_path / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and profile["traces"] == [traces[0].name]
    events = json.loads(traces[0].read_text())["traceEvents"]  # the Chrome trace format Perfetto reads
    names = {e.get("name") for e in events}
    assert "aten::mm" in names or "aten::addmm" in names
    top = [op["name"] for op in profile["top_ops"]]
    assert any(name in ("aten::mm", "aten::addmm", "aten::bmm") for name in top)
    assert not any(name.startswith("ProfilerStep") for name in top)  # an annotation, not an operator
    assert "top operators by self CPU time" in (tmp_path / "train.log").read_text()
    assert "left out of the timing" in format_summary(result.record, tmp_path)


def test_memory_snapshot_on_a_cpu_is_refused_naming_the_fix(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    result = train(compose([*QUICK, "profile=trace", "profile.memory_snapshot=true"]), run_dir=tmp_path)
    assert result.status == "incompatible" and result.exit_code == 2
    assert "profile.memory_snapshot=false" in result.error


# ------------------------------------------------------------------------------------- stopping
def test_early_stopping_triggers_on_a_plateau(tmp_path):
    # lr ~ 0: the eval loss cannot improve by min_delta, so patience 1 stops after the 2nd evaluation
    cfg = compose([*QUICK, "train.lr=1e-12", "train.eval_every=1", "stopping=plateau", "stopping.patience=1"])
    result = train(cfg, run_dir=tmp_path)
    assert result.status == "stopped_early" and result.status != "completed"
    assert result.summary["steps"] == 2
    assert result.exit_code == 0
    early = result.summary["stopping"]["early"]
    # 0-based step indices, as metrics.jsonl records the evaluations (they said 1 and 2: issue 27 item 6)
    evals = [r["step"] for r in read_metrics(tmp_path) if r["kind"] == "eval"]
    assert evals == [0, 1]
    assert early["best_step"] == 0 and early["evals_without_improvement"] == 1 and early["stopped_at_step"] == 1
    assert "did not improve" in result.error and "(best " in result.error
    assert result.error.endswith("at step 0); stopped after step 1 (2/3 done)")
    assert "stopped_early" in format_summary(result.record, tmp_path).splitlines()[0]


def test_an_expected_outcome_is_said_once_at_its_level_not_as_an_error(tmp_path, caplog):
    """A phase this machine cannot run is a recorded outcome (a CPU sweep of the plan blocks 5 of
    its 10 phases): one WARNING with the reason, no ERROR (issue 27 item 11)."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with caplog.at_level(logging.INFO, logger="optbench"):
        result = train(compose([*QUICK, "optimizer=cpu_offload"]), run_dir=tmp_path / "blocked")
    assert result.status == "incompatible"
    said = [r for r in caplog.records if "optimizer=cpu_offload needs CUDA" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"] and not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_time_limit_is_printed_as_an_outcome_not_an_error(tmp_path, capsys):
    result = run_cli_here("train", *QUICK, "run.time_limit_s=6e-5", f"hydra.run.dir={tmp_path}", capsys=capsys)
    assert result.returncode == 124  # the exit status still says it: re-run to go on
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("optbench: time_limit: run.time_limit_s=6e-05 reached after step 0 (1/3 done")
    assert "error" not in result.stderr.lower()


def test_early_stopping_needs_an_evaluation_cadence(tmp_path):
    result = train(compose([*QUICK, "stopping=plateau"]), run_dir=tmp_path)
    assert result.status == "failed" and result.user_error and "train.eval_every" in result.error


def _guard(window=4, factor=3.0, action="skip", max_skips=2):
    from optbench.config import StoppingConfig
    from optbench.run.loop.stopping import LossSpikeGuard

    cfg = SimpleNamespace(stopping=StoppingConfig(spike_factor=factor, spike_window=window, spike_action=action,
                                                  max_skips=max_skips))
    return LossSpikeGuard(SimpleNamespace(cfg=cfg))


def test_loss_spike_guard_skips_then_stops():
    guard = _guard()
    assert all(guard.accepts_update(s, loss=loss, grad_norm=1.0) for s, loss in enumerate([5, 4, 5, 6]))
    assert not guard.accepts_update(4, loss=16.0, grad_norm=1.0)  # > 3 x the median 5
    assert guard.accepts_update(5, loss=14.0, grad_norm=1.0)  # < 3 x 5: kept, and the count resets
    assert not guard.accepts_update(6, loss=40.0, grad_norm=1.0)
    with pytest.raises(RunStopped) as stopped:  # the second skip in a row: stopping.max_skips=2
        guard.accepts_update(7, loss=40.0, grad_norm=1.0)
    assert stopped.value.status == "loss_spike"
    assert guard.finish(ranks_agree=True).skipped_steps == [4, 6]  # its section of summary.json
    with pytest.raises(RunStopped):
        stop = _guard(action="stop")
        for step, loss in enumerate([5, 5, 5, 5, 50]):
            stop.accepts_update(step, loss=loss, grad_norm=1.0)


def test_a_vetoed_update_leaves_the_parameters_untouched():
    from optbench.optim.optimizers import build_optimizer
    from optbench.tasks import build_task
    from optbench.training.build import build_model, build_train_loader, materialize, seed_everything
    from optbench.training.step import StepContext, StepHooks, train_step

    cfg = to_config(compose(QUICK))
    seed_everything(0)
    task = build_task(cfg)
    train_set, _ = task.build_datasets()
    model = build_model(cfg, task)
    materialize(model, device=torch.device("cpu"), seed=0)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=cfg.train.lr)
    machine = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
    batches = iter(build_train_loader(train_set, cfg=cfg, machine=machine, start=0))
    before = [p.detach().clone() for p in model.parameters()]
    ctx = StepContext(model=model, task=task, cfg=cfg, device=torch.device("cpu"), optimizer=optimizer)
    stats = train_step(ctx, batches, step=0, hooks=StepHooks(vetoes=(lambda step, loss, grad_norm: False,)))
    assert stats.skipped and all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    train_step(ctx, batches, step=1, hooks=StepHooks(vetoes=(lambda step, loss, grad_norm: True,)))
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_loop_asks_the_guard_before_each_update(tmp_path, monkeypatch):
    from optbench.run.loop.stopping import LossSpikeGuard

    asked = []

    def veto_step_1(self, step, *, loss, grad_norm):
        asked.append(step)
        return step != 1

    monkeypatch.setattr(LossSpikeGuard, "accepts_update", veto_step_1)
    result = train(compose([*QUICK, "stopping.spike_factor=3"]), run_dir=tmp_path)  # the guard is built
    assert result.status == "completed" and asked == [0, 1, 2]
    assert [r["skipped"] for r in read_metrics(tmp_path) if r["kind"] == "train"] == [False, True, False]


def test_time_budget_stops_with_a_checkpoint_and_resumes_exactly(tmp_path, completed, monkeypatch):
    from optbench.checkpoint import resume

    budget = train(compose([*QUICK, "run.time_limit_s=6e-5"]), run_dir=tmp_path / "cut")
    assert budget.status == "time_limit" and budget.exit_code == 124
    assert budget.summary["steps"] == 1 and "step-00000001" in budget.error and "run.time_limit_s=6e-05" in budget.error
    assert budget.summary["stopping"]["time_budget"]["time_limit_s"] == 6e-5
    assert "reached after step 0 (1/3 done, " in budget.error  # the 0-based index of the last step
    assert budget.summary["stopping"]["time_budget"]["stopped_at_step"] == 0
    assert (tmp_path / "cut" / "checkpoints" / "step-00000001").is_dir()
    checked, check = [], resume.check_config_changes
    monkeypatch.setattr(resume, "check_config_changes", lambda path, changes: checked.append(path.name) or check(
        path, changes))
    resumed = train(compose(QUICK), run_dir=tmp_path / "cut")
    assert checked == ["step-00000001"]  # checked once, by the plan: loading it checks nothing again
    assert resumed.status == "completed" and resumed.summary["applied"]["checkpoint"]["resumed_step"] == 1
    assert _train_losses(tmp_path / "cut") == _train_losses(completed)


def test_a_sweep_rerun_keeps_only_a_finished_run_of_the_same_config(tmp_path, completed):
    from optbench.run.sweep import already_finished

    assert already_finished(compose(QUICK), completed).status == "completed"
    assert already_finished(compose([*QUICK, "train.lr=1e-3"]), completed) is None
    summary = json.loads((completed / "summary.json").read_text())
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "status": "interrupted"}))
    assert already_finished(compose(QUICK), tmp_path) is None  # resumed instead


# ------------------------------------------------------------------------------ bounded shutdown
STUCK = textwrap.dedent("""
    import sys, time
    import optbench.run.loop as loop
    from optbench.config import compose
    from optbench.run.train import train

    real = loop.train_step
    def stuck(*args, step, **kwargs):
        if step == 1:
            time.sleep(3600)  # a step that never returns (signals do not end a sleep: PEP 475)
        return real(*args, step=step, **kwargs)
    loop.train_step = stuck
    result = train(compose(sys.argv[2:]), run_dir=sys.argv[1])
    raise SystemExit(result.exit_code)
""")


def test_sigterm_during_a_stuck_step_ends_within_the_bound(tmp_path):
    from optbench.checkpoint.store import complete_checkpoints

    run_dir = tmp_path / "run"
    overrides = [*QUICK, "checkpoint.every=1", "run.stop_timeout_s=2"]
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(run_dir), *overrides], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        # until step 0 is logged and its checkpoint written whole: the loop is then inside the stuck
        # step (however long a loaded machine took to save)
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file() and read_metrics(run_dir) and complete_checkpoints(run_dir / "checkpoints"):
                break
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert time.monotonic() - sent < 60
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["steps"] == 1
    assert summary["stop"]["forced"] and summary["stop"]["last_step"] == 1
    assert "run.stop_timeout_s=2" in summary["error"] and "step-00000001" in summary["error"]
    assert "optbench: error: interrupted: stopped by SIGTERM while step 1 was running" in output  # one line


# ------------------------------------------------------------------------------------ memory
def test_a_config_larger_than_the_device_is_refused_naming_what_fits(monkeypatch):
    from optbench.estimate.tracer import trace_step
    from optbench.run.loop import oom

    cfg = to_config(compose([*QUICK, "train.batch_size=64", "train.seq_len=64"]))
    estimate = trace_step(cfg, world_size=1, micro_batch=64, target="cpu").steady_peak().total
    monkeypatch.setattr(oom, "device_capacity", lambda device, local_ranks=1: (estimate // 2, "the test's RAM"))
    with pytest.raises(IncompatibleError) as refused:
        oom.check_fits(cfg, estimate_bytes=estimate, device=torch.device("cpu"), world_size=1)
    message = str(refused.value)
    assert "2.0x the test's RAM" in message and "run.check_memory=false" in message
    fits = int(message.split("train.batch_size=")[1].split()[0])
    assert 1 <= fits < 32
    oom.check_fits(cfg, estimate_bytes=estimate // 4, device=torch.device("cpu"), world_size=1)  # fits: no error


def test_out_of_memory_is_recorded_as_oom_with_the_step_and_advice(tmp_path, monkeypatch):
    import optbench.run.loop as loop
    from optbench.run.loop import oom

    real = loop.train_step

    def oom_at_step_1(*args, step, **kwargs):
        if step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, step=step, **kwargs)

    monkeypatch.setattr(loop, "train_step", oom_at_step_1)
    # the advice's search is the refusal test's; here a stand-in that records what it was asked
    asked = []
    monkeypatch.setattr(oom, "advice", lambda cfg, **kw: asked.append(kw) or "train.batch_size=2 fits")
    result = train(compose(QUICK), run_dir=tmp_path)
    assert result.status == "oom" and result.exit_code == 1
    record = result.summary["memory"]["oom"]
    assert record["step"] == 1 and result.summary["steps"] == 1
    assert record["advice"] == "train.batch_size=2 fits" and asked[0]["budget"] < record["capacity_bytes"]
    assert "out of memory in step 2 of 3" in result.error and "Tried to allocate" in result.error


# ------------------------------------------------------------------------------------- logging
def test_log_level_sets_the_console_not_the_log_file():
    from optbench.logs import apply_log_level

    console = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    root.addHandler(console)
    try:
        assert apply_log_level("warning", progress="log") == logging.WARNING
        assert console.level == logging.WARNING
        assert logging.getLogger("matplotlib").level == logging.WARNING
        assert apply_log_level("auto", progress="bar") == logging.WARNING  # beside a bar: the bar is the output
        assert apply_log_level("auto", progress="log") == logging.INFO == console.level
    finally:
        root.removeHandler(console)
        apply_log_level("info", progress="log")
