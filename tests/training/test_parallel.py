"""DDP and FSDP2 on 2 CPU ranks (gloo), self-launched and under torchrun; checkpoints, exact resume,
graceful preemption. Process start and gloo init cost seconds, so every multi-rank run is made once
(module fixtures) and serves several assertions."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from optbench.checkpoint import store as checkpoint
from optbench.distributed import Machine
from optbench.errors import IncompatibleError
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.training import preflight as compat
from tests.helpers import ROOT, TEST_DEFAULTS, compose_cfg, once_per_session, read_summary, run_cli_here

# 10 steps so a signal sent after step 1 lands mid-run; the global batch is 4 samples of 32 tokens:
# 1 process x 4, DDP 2 ranks x 1 x 2 accumulation micro-steps (gradient sync on the last only),
# FSDP2 2 ranks x 2
# The step's prediction before the loop (its per-op benchmark) is left out of these runs but the
# torchrun one, which checks that it is recorded and that it changes nothing the others compare
BASE = ["model=tiny", "train.steps=10", "train.seq_len=32", "measure.warmup_steps=2", "train.eval_batches=1",
        "log.progress=log", "train.warmup_steps=2", "estimate.predict=false", *TEST_DEFAULTS]
SINGLE = [*BASE, "train.batch_size=4"]
DDP = [*BASE, "train.batch_size=1", "train.grad_accum=2", "parallel=ddp", "parallel.nproc_per_node=2"]
FSDP2 = [*BASE, "train.batch_size=2", "parallel=fsdp2", "parallel.nproc_per_node=2"]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(run_dir) if r["kind"] == "train"]


# ------------------------------------------------------------------------------ the shared runs
@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The single-process run the DDP and the killed-then-resumed runs compare against; once per session
    (read only)."""
    def make(run_dir):
        result = train(compose_cfg(SINGLE), run_dir=run_dir)
        assert result.status == "completed", result.error

    return once_per_session(tmp_path_factory, "parallel_single", make)[0]


@pytest.fixture(scope="module")
def torchrun_ddp_run(tmp_path_factory):
    """DDP under torchrun (its environment, its rendezvous), as a cluster user would launch it; once
    per session, whichever pytest-xdist worker asks first (three tests compare against it)."""
    def make(run_dir):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "optbench", "train", *DDP, "estimate.predict=true", "estimate.in_run=true", f"hydra.run.dir={run_dir}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]

    return once_per_session(tmp_path_factory, "torchrun_ddp", make)[0]


def start_cli(args: list[str], run_dir: Path) -> subprocess.Popen:
    """``optbench train ARGS`` in its own session (so a signal can go to its whole process group,
    as a terminal's Ctrl-C or SLURM's does), output into files beside the run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "optbench", "train", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        stdout=open(run_dir.parent / f"{run_dir.name}.out", "w"), stderr=subprocess.STDOUT,
    )


def stop_mid_run(proc: subprocess.Popen, run_dir: Path, *, sig: int, whole_group: bool, after: int = 1) -> int:
    """Send ``sig`` once step ``after`` is in metrics.jsonl; returns the exit status."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and any(r["step"] >= after for r in read_metrics(run_dir)):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    if whole_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    return proc.wait(timeout=300)


def resume_and_compare(args: list[str], run_dir: Path, reference: Path) -> dict:
    """The interrupted run's config again, in the same run directory: it resumes (checkpoint.resume=auto)
    and must end bit-identical to the run that was never interrupted."""
    stopped = read_summary(run_dir)
    assert stopped["status"] == "interrupted", stopped["error"]
    stopped_at = stopped["steps"]
    assert 1 < stopped_at < 10, stopped_at
    assert checkpoint.complete_checkpoints(run_dir / "checkpoints")[-1][0] == stopped_at
    again = train(compose_cfg(args), run_dir=run_dir)
    assert again.status == "completed", again.error
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert summary["applied"]["checkpoint"]["resumed_step"] == stopped_at
    assert losses(run_dir) == losses(reference)  # exact: == on floats, every step
    assert grad_norms(run_dir) == grad_norms(reference)
    assert summary["loss"]["eval"] == read_summary(reference)["loss"]["eval"]
    assert summary["loss"]["first"] == read_summary(reference)["loss"]["first"]
    return summary


# ------------------------------------------------------------------------------- equivalence
def test_ddp_over_two_ranks_reproduces_the_single_process_curve(single_run, torchrun_ddp_run):
    """2 ranks x batch 1 x 2 micro-steps see the same 4 samples per step as 1 process x batch 4."""
    assert losses(torchrun_ddp_run) == pytest.approx(losses(single_run), rel=1e-5)
    assert grad_norms(torchrun_ddp_run) == pytest.approx(grad_norms(single_run), rel=1e-5)
    assert losses(torchrun_ddp_run) != losses(single_run)  # really two ranks: other reduction order
    summary, single = read_summary(torchrun_ddp_run), read_summary(single_run)
    assert summary["world_size"] == 2 and single["world_size"] == 1
    parallel = summary["applied"]["parallel"]
    assert parallel["mode"] == "ddp" and parallel["backend"] == "gloo" and parallel["launcher"] == "torchrun"
    assert summary["applied"]["nccl"]["applied"] is False
    predicted = summary["predicted"]  # each rank benchmarked its ops; the gloo all-reduce is modeled
    assert predicted["step_time_s"] > 0 and predicted["method"].startswith("per-op benchmark")
    assert predicted["communication"] is not None and single["predicted"] is None  # estimate.predict=false
    assert summary["throughput"]["tokens_per_step"] == single["throughput"]["tokens_per_step"] == 4 * 32
    assert len(summary["memory"]["per_rank"]) == 2
    assert summary["memory"]["peak_bytes"] == max(r["peak_bytes"] for r in summary["memory"]["per_rank"])
    assert [r["step"] for r in read_metrics(torchrun_ddp_run) if r["kind"] == "train"] == list(range(10))


# ---------------------------------------------------------------- preemption and exact resume
def test_sigterm_to_the_whole_group_then_resume_equals_an_uninterrupted_ddp_run(tmp_path, torchrun_ddp_run):
    run_dir = tmp_path / "run"
    code = stop_mid_run(start_cli(DDP, run_dir), run_dir, sig=signal.SIGTERM, whole_group=True)
    assert code == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in read_summary(run_dir)["error"]
    resume_and_compare(DDP, run_dir, torchrun_ddp_run)  # self-launched == torchrun, bit for bit


def test_sigterm_to_the_whole_group_reaches_the_loader_workers_and_the_run_still_resumes_exactly(tmp_path, single_run):
    """dataloader=tuned (the plan's phase 4 and the phases after it): the group's SIGTERM reaches the
    loader's worker processes too; the run still stops after a checkpoint, and resumes bit for bit
    (the workers' batches are the main process's)."""
    args = [*SINGLE, "dataloader=tuned"]
    run_dir = tmp_path / "run"
    code = stop_mid_run(start_cli(args, run_dir), run_dir, sig=signal.SIGTERM, whole_group=True)
    assert code == 128 + signal.SIGTERM, (run_dir.parent / "run.out").read_text()[-2000:]
    assert "stopped by SIGTERM" in read_summary(run_dir)["error"]
    resume_and_compare(args, run_dir, single_run)


def test_fsdp2_interrupted_then_resumed_is_exact_and_matches_ddp(tmp_path, torchrun_ddp_run):
    """An FSDP2 run saving every 2 steps is stopped by SIGINT at step k; resuming from the step-2
    checkpoint recomputes steps 2..k-1, which must equal the interrupted run's own (a straight run
    up to k) bit for bit, and the whole curve must match DDP's."""
    args = [*FSDP2, "checkpoint.every=2", "checkpoint.keep_last=0"]
    run_dir = tmp_path / "run"
    code = stop_mid_run(start_cli(args, run_dir), run_dir, sig=signal.SIGINT, whole_group=False, after=2)
    assert code == 128 + signal.SIGINT
    stopped_at = read_summary(run_dir)["steps"]
    assert 2 < stopped_at < 10 and "stopped by SIGINT" in read_summary(run_dir)["error"]
    straight = {"loss": losses(run_dir), "grad_norm": grad_norms(run_dir)}
    root = run_dir / "checkpoints"
    newest = checkpoint.complete_checkpoints(root)[-1]
    assert newest[0] == stopped_at  # the stop checkpoint, written at the step boundary
    assert sorted(p.name for p in newest[1].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # sharded

    resumed = train(compose_cfg([*args, f"checkpoint.resume={root}/step-00000002"]), run_dir=run_dir)
    assert resumed.status == "completed", resumed.error
    assert resumed.summary["applied"]["checkpoint"]["resumed_step"] == 2
    assert losses(run_dir)[:stopped_at] == straight["loss"]  # exact: == on floats
    assert grad_norms(run_dir)[:stopped_at] == straight["grad_norm"]

    assert losses(run_dir) == pytest.approx(losses(torchrun_ddp_run), rel=1e-5)  # FSDP2 == DDP
    assert grad_norms(run_dir) == pytest.approx(grad_norms(torchrun_ddp_run), rel=1e-5)
    summary = resumed.summary
    assert summary["world_size"] == 2
    parallel = summary["applied"]["parallel"]
    assert parallel["mode"] == "fsdp2" and parallel["launcher"] == "optbench"
    assert parallel["mp_policy"] == {"param_dtype": "float32", "reduce_dtype": "float32"}
    assert parallel["sharded_blocks"] == 4
    assert "FSDPMemTracker" in summary["memory"]["peak_source"] and len(summary["memory"]["per_rank"]) == 2


KILL_DURING_A_SAVE = """
import os, signal, sys
import torch.distributed.checkpoint.filesystem as fs
from optbench.run.train import train
from tests.helpers import compose_cfg

original, calls = fs.FileSystemWriter.write_data, []
def write_then_die(self, plan, planner):
    calls.append(1)
    result = original(self, plan, planner)
    if len(calls) == 4:  # the tensors of the 4th checkpoint are on disk, its metadata is not
        result.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return result
fs.FileSystemWriter.write_data = write_then_die
train(compose_cfg(sys.argv[2:]), run_dir=sys.argv[1])
"""


def test_sigkill_during_a_checkpoint_write_then_exact_resume_and_keep_last(tmp_path, single_run):
    """Checkpoints at steps 2, 4, 6 (keep_last=2 removes step 2); the process is SIGKILLed while
    writing step 8's. Step 6 stays loadable, and resuming from it ends bit-identical to a run that
    was never killed."""
    run_dir = tmp_path / "run"
    args = [*SINGLE, "checkpoint.every=2", "checkpoint.keep_last=2"]
    killed = subprocess.run([sys.executable, "-c", KILL_DURING_A_SAVE, str(run_dir), *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    root = run_dir / "checkpoints"
    assert [step for step, _ in checkpoint.complete_checkpoints(root)] == [4, 6]  # step 2 pruned
    assert (root / ".tmp-step-00000008").is_dir()  # the half-written one, never read
    result = train(compose_cfg(args), run_dir=run_dir)  # resume=auto
    assert result.status == "completed", result.error
    assert result.summary["applied"]["checkpoint"]["resumed_step"] == 6
    assert losses(run_dir) == losses(single_run)  # exact, every step (0-5 kept, 6-9 recomputed)
    assert grad_norms(run_dir) == grad_norms(single_run)
    assert result.summary["loss"]["eval"] == read_summary(single_run)["loss"]["eval"]
    assert not (root / ".tmp-step-00000008").exists()  # cleaned by the next save
    assert [p.name for _, p in checkpoint.complete_checkpoints(root)] == ["step-00000008", "step-00000010"]


def test_bf16_fsdp2_from_the_command_line(bf16_fsdp2_cli):
    """The headline command on a CPU: world size 2 and the FSDP2 policy in summary.applied."""
    run_dir, stdout = bf16_fsdp2_cli
    assert " x 2" in stdout  # the printed summary: device x world size
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["applied"]["parallel"]["mp_policy"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert summary["applied"]["precision"]["autocast"] == "bfloat16"


# ------------------------------------------------------------------------------- bad input
def fake_machine(**fields) -> Machine:
    base = dict(device=torch.device("cpu"), cuda_available=False, cuda_devices=0, cpu_threads=2)
    return Machine(**{**base, **fields})


@pytest.mark.parametrize(
    ("overrides", "machine", "expected"),
    [
        (["parallel=fsdp2", "parallel.nproc_per_node=1"], dict(world_size=1), "nothing to shard"),
        (["parallel=ddp", "parallel.backend=nccl"], dict(world_size=2), "parallel.backend=nccl needs CUDA"),
        (["parallel=ddp", "parallel.nproc_per_node=4"],
         dict(device=torch.device("cuda", 0), cuda_available=True, cuda_devices=2, world_size=4, local_world_size=4),
         "set parallel.nproc_per_node=2"),
        ([], dict(world_size=2, launcher="torchrun"), "use parallel=ddp or parallel=fsdp2 under torchrun"),
    ],
)
def test_impossible_parallel_setups_are_refused(overrides, machine, expected):
    from optbench.config import to_config

    with pytest.raises(IncompatibleError, match=expected):
        compat.check(to_config(compose_cfg(overrides)), fake_machine(**machine))


def test_parallel_errors_exit_2_with_one_line_before_any_worker_starts(tmp_path, capsys):
    done = run_cli_here("train", *BASE, "parallel=fsdp2", "parallel.nproc_per_node=1", f"hydra.run.dir={tmp_path}",
                        capsys=capsys)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("optbench: error: incompatible: parallel=fsdp2")
    assert "Traceback" not in done.stderr and "elastic" not in done.stderr
    assert read_summary(tmp_path)["status"] == "incompatible"
    single = train(compose_cfg([*BASE, "parallel.nproc_per_node=2"]), run_dir=tmp_path / "single")
    assert single.exit_code == 2 and "use parallel=ddp or parallel=fsdp2" in single.error
    nccl = train(compose_cfg([*DDP, "parallel.backend=nccl"]), run_dir=tmp_path / "nccl")
    assert nccl.exit_code == 2 and nccl.status == "incompatible"


def test_resume_errors(tmp_path, single_run):
    made = train(compose_cfg([*SINGLE, "train.steps=4", "checkpoint.every=4", "measure.warmup_steps=1"]),
                 run_dir=tmp_path / "made")
    assert made.status == "completed", made.error
    ckpts = tmp_path / "made" / "checkpoints"
    cases = {
        # another world size: refused by the launching process, before workers start
        "2 ranks": ([*DDP, f"checkpoint.dir={ckpts}"], "written by 1 ranks but this run has 2"),
        "none": ([*SINGLE, f"checkpoint.dir={ckpts}", "checkpoint.resume=none"], "already holds checkpoints"),
        "path": ([*SINGLE, f"checkpoint.resume={tmp_path}/nope"], "no optbench checkpoint there"),
        "model": ([*SINGLE, f"checkpoint.dir={ckpts}", "model.dim=64"], "holds another model"),
        "done": ([*SINGLE, "train.steps=4", "measure.warmup_steps=1", f"checkpoint.resume={ckpts}/step-00000004"],
                 "nothing is left to train"),
    }
    for name, (overrides, message) in cases.items():
        result = train(compose_cfg(overrides), run_dir=tmp_path / name)
        assert result.exit_code == 2 and message in result.error, (name, result.error)
        assert "\n" not in result.error
    assert [step for step, _ in checkpoint.complete_checkpoints(ckpts)] == [4]  # nothing lost


def test_slurm_launcher_config_composes():
    """conf/hydra/launcher/slurm.yaml composes against hydra-submitit-launcher's schema and builds
    the launcher (no cluster needed: submitting is the only step that talks to SLURM)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from optbench.config import conf_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        cfg = compose(config_name="train", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                                      "parallel=fsdp2", "parallel.nproc_per_node=8"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.partition == "gpu" and launcher.nodes == 1 and launcher.tasks_per_node == 1
    assert launcher.gpus_per_node == 8 and launcher.additional_parameters.requeue is True
    built = instantiate(launcher)
    assert type(built).__name__ == "SlurmLauncher" and built.params["gpus_per_node"] == 8


def test_a_checkpoint_restores_model_optimizer_scheduler_and_every_rng(tmp_path):
    import random

    import numpy as np

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    progress = checkpoint.Progress(step=1, samples_per_rank=8, first_loss=2.5)
    path = checkpoint.save(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
                           progress=progress, meta={"model": {}}, keep_last=0)
    expected = (torch.rand(3), np.random.rand(3), random.random(), model.weight.clone(),
                optimizer.state_dict()["state"][0]["exp_avg"].clone(), scheduler.get_last_lr())
    with torch.no_grad():
        model.weight.zero_()
    fresh_optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda step: 1.0 / (step + 1))
    assert checkpoint.load(path, model=model, optimizer=fresh_optimizer, scheduler=fresh_scheduler,
                           scaler=None) == progress
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2] and torch.equal(model.weight, expected[3])
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], expected[4])
    assert fresh_scheduler.get_last_lr() == expected[5] and fresh_scheduler.last_epoch == 1


class _AgentSpy:
    """Stands in for torch elastic's LocalElasticAgent inside torch's own ``launch_agent``: records the
    grace period the agent would give stopped workers, and finishes without starting any."""

    seen: dict = {}

    def __init__(self, *, spec, shutdown_timeout: int = 30, **kwargs) -> None:
        _AgentSpy.seen = {"shutdown_timeout": shutdown_timeout, "nproc": spec.local_world_size}

    def run(self):
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        return RunResult(state=WorkerState.SUCCEEDED, return_values={0: "done"})

    def get_event_succeeded(self):
        from torch.distributed.elastic.events import Event, EventSource

        return Event(name="optbench-test", source=EventSource.AGENT)

    get_event_failed = get_event_succeeded


def test_stopped_workers_get_the_grace_period_optbench_sets(monkeypatch):
    """The agent torch elastic builds for optbench's workers gets SHUTDOWN_TIMEOUT_S seconds
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT changes it) to let stopped workers reach a step boundary and
    checkpoint; torch's own default would be 30 s."""
    import dataclasses

    import torch.distributed.launcher.api as launcher

    from optbench.distributed import SHUTDOWN_TIMEOUT_S, launch_local_workers

    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(launcher.LaunchConfig)}:
        pytest.skip("this torch's LaunchConfig has no shutdown_timeout: its agent keeps torch's 30 s")
    monkeypatch.setattr(launcher, "LocalElasticAgent", _AgentSpy)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert launch_local_workers(print, nproc=2, start_method="spawn").values == {0: "done"}
    assert _AgentSpy.seen == {"shutdown_timeout": SHUTDOWN_TIMEOUT_S, "nproc": 2} and SHUTDOWN_TIMEOUT_S != 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert launch_local_workers(print, nproc=1, start_method="spawn").values == {0: "done"}
    assert _AgentSpy.seen == {"shutdown_timeout": 7, "nproc": 1}


def test_launch_config_without_shutdown_timeout_still_launches(monkeypatch):
    """torch 2.11's LaunchConfig has no shutdown_timeout (a lent H200 with that torch failed every
    local launch on it, "unexpected keyword argument"): there the launch goes on, with torch's own
    grace period."""
    import dataclasses

    import torch.distributed.launcher.api as launcher

    from optbench.distributed import launch_local_workers

    fields = [(f.name, f.type, f) for f in dataclasses.fields(launcher.LaunchConfig) if f.name != "shutdown_timeout"]
    old_launch_config = dataclasses.make_dataclass("LaunchConfig", fields)  # no __post_init__: nothing else read
    launched = []

    def elastic_launch(config, entrypoint):
        launched.append(config)
        return lambda *args: {0: entrypoint(*args)}

    monkeypatch.setattr(launcher, "LaunchConfig", old_launch_config)
    monkeypatch.setattr(launcher, "elastic_launch", elastic_launch)
    assert launch_local_workers(lambda: "done", nproc=2, start_method="spawn").values == {0: "done"}
    (config,) = launched
    assert isinstance(config, old_launch_config) and config.nproc_per_node == 2
    assert not hasattr(config, "shutdown_timeout")


def what_a_worker_sees(words: str) -> dict:
    """A local worker's view of its start (run in the worker): it says ``words`` on stdout and stderr."""
    print(f"stdout: {words}", flush=True)
    print(f"stderr: {words}", file=sys.stderr, flush=True)
    keys = ("OPTBENCH_TEST_MARK", "OPTBENCH_LOCAL_WORKER", "OPTBENCH_LOCK_TOKEN", "PYTEST_CURRENT_TEST", "RANK",
            "WORLD_SIZE", "MASTER_PORT", "WANDB_SERVICE")
    return {**{k: os.environ.get(k) for k in keys}, "threads": torch.get_num_threads(), "parent": os.getppid()}


def a_worker_that_fails(words: str) -> None:
    raise RuntimeError(words)


def launched_into(path: Path, words: str) -> dict:
    """One worker launched while this process's fds 1 and 2 point at ``path``: rank 0's view."""
    from optbench.distributed import launch_local_workers

    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        outcome = launch_local_workers(what_a_worker_sees, words, nproc=1)
    finally:
        for fd, saved_fd in zip((1, 2), saved, strict=True):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
    assert outcome.values is not None, outcome.failure
    return outcome.values[0]


def test_forkserver_workers_get_the_launch_s_environment_output_and_a_live_server(tmp_path, monkeypatch):
    """Workers forked from the warm server see the launcher's environment and fds as they are at each
    launch (not as they were when the server started), torch's thread count from OMP_NUM_THREADS, and
    elastic's per-rank variables; a changed variable an import may read starts a new server, and so
    does a dead one. The servers this test starts preload only the workers' module (the preloaded
    list saves time, it changes nothing here); the first launch uses this process's server as it is."""
    from optbench import forkserver
    from optbench.distributed import launch_local_workers
    from optbench.files import lock_token

    monkeypatch.setattr(forkserver, "PRELOAD", ())
    monkeypatch.setattr(forkserver, "PRELOAD_IF_IMPORTED", {})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = launched_into(tmp_path / "first.out", "one")
    server = forkserver.server_pid()
    assert first["parent"] == server and first["threads"] == 1 and first["OPTBENCH_TEST_MARK"] is None
    assert (first["RANK"], first["WORLD_SIZE"], first["OPTBENCH_LOCAL_WORKER"]) == ("0", "1", "1")
    assert first["OPTBENCH_LOCK_TOKEN"] == lock_token() and first["MASTER_PORT"] != os.environ.get("MASTER_PORT")
    assert first["PYTEST_CURRENT_TEST"] == os.environ["PYTEST_CURRENT_TEST"]  # this test's, whoever started it
    assert (tmp_path / "first.out").read_text().splitlines()[-2:] == ["stdout: one", "stderr: one"]

    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read per launch: the same server
    monkeypatch.setenv("WANDB_SERVICE", "2-123-unix-/tmp/wandb-123/socket")  # as W&B sets it when a run logs
    monkeypatch.setenv("_MLFLOW_TELEMETRY_SESSION_ID", "a1b2")
    second = launched_into(tmp_path / "second.out", "two")
    assert forkserver.server_pid() == second["parent"] == server and second["threads"] == 2
    assert second["WANDB_SERVICE"] == "2-123-unix-/tmp/wandb-123/socket"  # the launch's, in the worker
    failed = launch_local_workers(a_worker_that_fails, "the worker's own words", nproc=1)
    assert failed.values is None and failed.failure == "worker rank 0 failed: the worker's own words"
    assert "stdout: two" in (tmp_path / "second.out").read_text() and "two" not in (tmp_path / "first.out").read_text()

    monkeypatch.setenv("OPTBENCH_TEST_MARK", "second")  # what an import may read: a new server
    third = launched_into(tmp_path / "third.out", "three")
    assert third["OPTBENCH_TEST_MARK"] == "second" and third["parent"] == forkserver.server_pid() != server

    os.kill(third["parent"], signal.SIGKILL)  # a dead server is started again at the next launch
    while Path(f"/proc/{third['parent']}/stat").read_text().split()[2] != "Z":
        time.sleep(0.01)
    fourth = launched_into(tmp_path / "fourth.out", "four")
    assert fourth["parent"] == forkserver.server_pid() not in (server, third["parent"])
    assert fourth["OPTBENCH_TEST_MARK"] == "second" and "stderr: four" in (tmp_path / "fourth.out").read_text()


def what_a_worker_has_imported() -> bool:
    return "transformers.modeling_utils" in sys.modules


def test_a_hugging_face_launchers_server_imports_transformers_modeling_code_once(monkeypatch):
    """A launcher that has imported transformers' modeling code (a Hugging Face run's: its preflight built
    the model on the meta device; this test worker's: tests/conftest.py) starts the server with it
    imported, so each worker forked from it has it without importing it; a launcher without it
    (optbench's own model's) starts a server without it."""
    from optbench import forkserver
    from optbench.distributed import launch_local_workers

    assert "transformers.modeling_utils" in sys.modules
    assert forkserver.preload_list("m") == ["optbench.preload_start", *forkserver.PRELOAD, "optbench.preload_hf", "m",
                                            "optbench.preload_done"]
    outcome = launch_local_workers(what_a_worker_has_imported, nproc=1)  # this module imports no transformers
    assert outcome.values == {0: True}, outcome.failure
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # where CUDA is, transformers is not preloaded
    assert forkserver.preload_list("m") == ["optbench.preload_start", *forkserver.PRELOAD, "m", "optbench.preload_done"]
    monkeypatch.undo()
    monkeypatch.setattr(forkserver, "PRELOAD_IF_IMPORTED", {"a.module.nothing.imported": "optbench.preload_hf"})
    assert "optbench.preload_hf" not in forkserver.preload_list("m")


# a fresh interpreter made to look like a CUDA machine, as the workers' server starts: torch.cuda says a
# device is there, and any call that would initialize CUDA (the lazy init behind
# get_device_capability/properties) is recorded while it imports the preload list it is given
AS_A_SERVER_ON_A_GPU = """
import json, sys, traceback
import torch
tried = []
def initialize(*args, **kwargs):
    tried.append("".join(traceback.format_stack(limit=8)))
    raise RuntimeError("CUDA initialized")
torch.cuda.is_available = lambda: True
torch.version.cuda = "12.8"
torch.cuda._lazy_init = initialize
torch.cuda.get_device_properties = lambda *args, **kwargs: initialize()
torch.cuda.get_device_capability = lambda *args, **kwargs: initialize()
for name in json.loads(sys.argv[1]):
    try:
        __import__(name)
    except RuntimeError:
        pass
print(json.dumps(tried))
"""


def test_nothing_the_server_imports_on_a_gpu_machine_initializes_cuda(monkeypatch):
    """A worker forked from a server that initialized CUDA cannot use CUDA ("Cannot re-initialize CUDA
    in forked subprocess"): on an H200 every worker of a DDP run failed so, the server having imported
    transformers' modeling code, whose torchao import reads the device's capability. Where torch sees a
    device, what a Hugging Face launcher's server imports touches no CUDA (with optbench.preload_hf in
    the list, one initialization is recorded)."""
    from optbench import forkserver

    assert "transformers.modeling_utils" in sys.modules  # as in a Hugging Face run's launcher
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    preload = forkserver.preload_list("optbench.run.train")
    monkeypatch.undo()
    done = subprocess.run([sys.executable, "-c", AS_A_SERVER_ON_A_GPU, json.dumps(preload)], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    tried = json.loads(done.stdout.strip().splitlines()[-1])
    assert tried == [], tried[0]


# a command's first launch, in a fresh interpreter: the resource tracker is not running yet. The
# server and this process are in one process group (a session of their own), which gets one SIGTERM
# and one SIGINT, as a cluster or a terminal sends them
FIRST_LAUNCH = """
import json, os, signal, time
from optbench import forkserver
forkserver.PRELOAD = ()  # the server's imports change nothing here; they only take time
forkserver.ensure_server("optbench.collector")
server = forkserver.server_pid()
with open(f"/proc/{server}/status") as status:
    mask = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
received = []
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, frame: received.append(signum))
    os.killpg(0, sig)
time.sleep(0.5)  # a server the signals end is gone well within this
alive = os.waitpid(server, os.WNOHANG)[0] == 0  # reaps a server that ended
if alive:
    os.kill(server, signal.SIGKILL)
    os.waitpid(server, 0)
print(json.dumps({"blocked": [s.name for s in forkserver.STOP_SIGNALS if mask >> (s - 1) & 1],
                  "alive": alive, "received": sorted(received)}))
"""


def test_a_commands_first_launch_starts_a_server_that_a_signal_to_its_group_does_not_stop():
    """The server starts with the stop signals blocked, also when its start is the first thing that
    starts multiprocessing's resource tracker (``optbench train parallel=ddp``'s first launch), whose
    start unblocks SIGINT and SIGTERM. A server a SIGTERM to the group ended would leave its running
    workers to torch's parent-death signal, SIGINT, beside the SIGTERM: a worker inside a collective
    then runs both handlers at once, SIGINT's first, and the run recorded "stopped by SIGINT"."""
    done = subprocess.run([sys.executable, "-c", FIRST_LAUNCH], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["blocked"] == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    assert seen["received"] == [signal.SIGINT, signal.SIGTERM]  # the group got both
    assert seen["alive"]


def test_the_rendezvous_names_its_events_as_torch_does_without_reading_the_whole_stack(tmp_path, monkeypatch):
    """torch elastic's rendezvous names each event by the method that recorded it; during a launch
    optbench reads that name from the frame (``optbench.distributed._method_name``), not from
    ``inspect.stack()``: the same names, the launch's events go through it, torch's own is put back."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from optbench import distributed, forkserver

    torch_s = dynamic_rendezvous.get_method_name

    class Handler:  # the shape of the rendezvous's calls: _record(...) -> get_method_name() names its caller
        def _record(self, depth: int) -> str:
            return dynamic_rendezvous.get_method_name() if depth == 2 else dynamic_rendezvous.get_method_name(depth)

        def next_rendezvous(self, depth: int = 2, nesting: int = 0) -> str:
            return self.next_rendezvous(depth, nesting - 1) if nesting > 0 else self._record(depth)

    expected = [Handler().next_rendezvous(depth, nesting) for depth in (1, 2, 3, 10**6) for nesting in (0, 60)]
    assert expected[:4] == ["_record", "_record", "next_rendezvous", "next_rendezvous"]
    assert expected[-2:] == ["no_method_name"] * 2
    with distributed._rendezvous_names_from_frames():
        assert dynamic_rendezvous.get_method_name is distributed._method_name
        assert [Handler().next_rendezvous(depth, nesting) for depth in (1, 2, 3, 10**6) for nesting in (0, 60)] == expected
    assert dynamic_rendezvous.get_method_name is torch_s

    names, named = [], distributed._method_name

    def counted(depth: int = 2) -> str:
        names.append(named(depth + 1))  # one frame more: this one
        return names[-1]

    monkeypatch.setattr(distributed, "_method_name", counted)
    monkeypatch.setattr(forkserver, "PRELOAD", ())
    monkeypatch.setattr(forkserver, "PRELOAD_IF_IMPORTED", {})
    assert launched_into(tmp_path / "out", "named")["RANK"] == "0"
    assert "next_rendezvous" in names and "no_method_name" not in names
    assert dynamic_rendezvous.get_method_name is torch_s


def a_worker_that_waits_for_a_signal(path: str) -> None:
    """A local worker that writes its pid to ``path``, then waits for SIGTERM or SIGINT and writes
    the name of the first it gets to ``path``.signal."""
    def record(signum: int, frame: object) -> None:
        Path(f"{path}.signal").write_text(signal.Signals(signum).name)
        os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, record)
    Path(f"{path}.tmp").write_text(str(os.getpid()))
    os.replace(f"{path}.tmp", path)
    time.sleep(120)


A_LAUNCHER_THAT_DIES = """
import sys
from optbench import forkserver
from optbench.distributed import launch_local_workers
from tests.training.test_parallel import a_worker_that_waits_for_a_signal
forkserver.PRELOAD = ()
launch_local_workers(a_worker_that_waits_for_a_signal, sys.argv[1], nproc=1)
"""


def test_a_forkserver_worker_whose_launcher_died_gets_sigterm(tmp_path):
    """The forkserver's workers are the server's children, so a launcher killed outright (SIGKILL)
    would leave them running; a thread of each worker watches the launcher and sends the worker
    SIGTERM when it is gone (not SIGINT: a SIGTERM to the whole group would otherwise read as
    Ctrl-C where the launcher closed before the worker's main thread next ran Python)."""
    mark = tmp_path / "worker"
    launcher = subprocess.Popen([sys.executable, "-c", A_LAUNCHER_THAT_DIES, str(mark)], cwd=ROOT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        received = Path(f"{mark}.signal")
        while not received.exists():
            assert time.monotonic() < deadline, "the worker outlived its launcher without a signal"
            time.sleep(0.05)
        assert received.read_text() == "SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # the server and the worker share its process group
        launcher.wait()


def test_ddp_buckets_allocated_before_a_tracked_step_are_counted(tmp_path):
    """MemTracker sees only storages allocated inside the step it follows. DDP allocates its gradient
    buckets when ``replicate`` builds it (in the first forward) and again when it rebuilds them (in
    the second); from the third step on they exist before the step, and the CPU peak must add them
    (read from DDP itself) or it is one gradient copy short of what the process holds."""
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from optbench.config import to_config
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize
    from optbench.training.data_parallel import apply_ddp, ddp_buckets_outside, ddp_gradient_buckets

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # nothing timed: one thread does not spin against a loaded CPU
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = to_config(compose_cfg(["model=tiny"]))
        model = build_model(cfg, build_task(cfg))
        apply_ddp(model, world_size=1, device=torch.device("cpu"), compiled=False)
        materialize(model, device=torch.device("cpu"), seed=0)
        assert ddp_gradient_buckets(model) is None  # DDP is built at the first forward
        grad_bytes = 4 * sum(p.numel() for p in model.parameters())
        outside, peaks = [], []
        for _ in range(3):
            before = ddp_gradient_buckets(model)
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                model(torch.randint(0, cfg.model.vocab_size, (2, 16))).float().mean().backward()
            outside.append(ddp_buckets_outside(before, ddp_gradient_buckets(model)))
            peaks.append(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
        assert outside == [0, 0, grad_bytes]  # built in step 0, rebuilt in step 1, already there in step 2
        assert ddp_gradient_buckets(model) == (grad_bytes, True)
        assert peaks[2] + outside[2] > peaks[1]  # without them the steady step would read lower
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
