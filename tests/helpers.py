"""Helpers the tests share (fixtures and hooks stay in conftest.py): compose the real conf/ with
overrides, run the CLI as a user would, and write run directories as ``optbench train`` leaves them."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from optbench.config import compose
from optbench.outputs import write_run_summary
from optbench.summary import LoopProgress, Memory, Model, RunSummary, StepTimes, Throughput, read_run_summary

ROOT = Path(__file__).resolve().parent.parent

# what every config a test composes starts from (compose_cfg, and FAST for the command line), unless the
# test sets the key itself (the last value of a key wins): a test that is
# about something else skips the run's own trace before its loop (tests/estimate/, and the tests
# that read memory.estimate_bytes or predicted, set estimate.in_run=true) and the re-check of the
# CPU's matmul ceiling (tests/test_measure.py measures it; a test of MFU's peak sets
# measure.peak_tflops=null): together about 1 s of each tiny run's 2 s on 2 cores
TEST_DEFAULTS = ["estimate.in_run=false", "measure.peak_tflops=100"]
# what the CUDA tier (tests marked ``cuda``) sets back: a GPU run's own estimate (its fit check, its
# estimate_bytes) and its datasheet peak are what those tests check. Without it, 7 of them failed on
# an H200 (2026-11-30): no estimate, "given: measure.peak_tflops=100" for the peak
ON_CUDA = ["estimate.in_run=true", "measure.peak_tflops=null"]

# small and fast: a training step of the tiny model on 4 x 32 tokens takes milliseconds. The fast
# tier runs on the CPU even where CUDA is present (its determinism and MemTracker claims are CPU
# claims); the tests marked ``cuda`` hold the CUDA checks.
FAST = [
    "model=tiny",
    "train.device=cpu",
    "train.steps=6",
    "train.batch_size=4",
    "train.seq_len=32",
    "measure.warmup_steps=2",
    "train.eval_batches=1",
    "log.progress=log",
    # the step's prediction before the loop (tests/estimate/test_predict.py and tests/bench test it)
    # times every op of the step on this CPU: left out of the runs that test something else
    "estimate.predict=false",
    *TEST_DEFAULTS,
]


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    return compose([*TEST_DEFAULTS, *(overrides or [])])  # a test's own value of a key comes last and wins


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 300):
    """``optbench ARGS`` in a subprocess; returns the CompletedProcess (text)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("HYDRA_FULL_ERROR", None)
    if env and "HYDRA_FULL_ERROR" in env:
        full_env["HYDRA_FULL_ERROR"] = env["HYDRA_FULL_ERROR"]
    return subprocess.run(
        [sys.executable, "-m", "optbench", *args],
        cwd=cwd or ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Captured:
    """What ``capsys.readouterr`` gives, for a caller without pytest's capsys (a module or session
    fixture): what was written to ``sys.stdout``/``sys.stderr`` while ``captured()`` was entered."""

    def __init__(self) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()

    def captured(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(contextlib.redirect_stdout(self.out))
        stack.enter_context(contextlib.redirect_stderr(self.err))
        return stack

    def readouterr(self) -> tuple[str, str]:
        said = self.out.getvalue(), self.err.getvalue()
        for stream in (self.out, self.err):
            stream.seek(0)
            stream.truncate()
        return said


def run_cli_here(*args: str, capsys=None) -> subprocess.CompletedProcess:
    """``optbench ARGS`` in this process (``optbench.cli.main``), for a test that is about what the
    command says and returns, not about the process boundary (importing torch again costs seconds per
    process): its exit status (0 when main returns), stdout and stderr, as ``run_cli`` gives them
    (read through pytest's ``capsys``; without it, through a ``Captured`` of its own).
    The SIGTERM handler, ``sys.argv``, HYDRA_FULL_ERROR, Hydra's job state and the root logger's
    handlers and level are put back."""
    if capsys is None:
        own = Captured()
        with own.captured():
            return run_cli_here(*args, capsys=own)
    import logging
    import signal

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from optbench.cli import main

    capsys.readouterr()
    handler, argv, code = signal.getsignal(signal.SIGTERM), list(sys.argv), 0
    hydra_cfg, hydra_was_on = HydraConfig.instance().cfg, GlobalHydra.instance().is_initialized()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # Hydra's job logging replaces them
    full_error = os.environ.pop("HYDRA_FULL_ERROR", None)  # as run_cli: the user's one-line errors
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        # Hydra's job state (the run's output dir, the config search path) is process-wide: put it back,
        # or a later in-process train() reads this command's hydra.runtime
        HydraConfig.instance().cfg = hydra_cfg
        if not hydra_was_on and GlobalHydra.instance().is_initialized():
            GlobalHydra.instance().clear()
        signal.signal(signal.SIGTERM, handler)
        sys.argv = argv
        for added in set(root.handlers) - set(handlers):
            added.close()
        root.handlers[:], root.level = handlers, level
        if full_error is not None:
            os.environ["HYDRA_FULL_ERROR"] = full_error
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["optbench", *args], code, out, err)


def once_per_session(tmp_path_factory, name: str, make) -> tuple[Path, object]:
    """``make(directory)`` run once for the whole test session, whichever pytest-xdist worker asks
    first (a file lock in the directory the workers share; the others wait for it, then read it):
    for a run that costs tens of seconds (two ranks, a subprocess) and that tests on both workers
    assert on. Returns (directory, what ``make`` returned, as JSON keeps it); a ``make`` that
    failed fails every test that asks, each running it again."""
    import fcntl

    shared = shared_directory(tmp_path_factory)
    directory, made = shared / f"once-{name}", shared / f"once-{name}.json"
    with open(shared / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.is_file():
            shutil.rmtree(directory, ignore_errors=True)  # a failed attempt's leftovers
            directory.mkdir(parents=True)
            made.write_text(json.dumps(make(directory)))
    return directory, json.loads(made.read_text())


def shared_directory(tmp_path_factory) -> Path:
    """The temporary directory every pytest-xdist worker of this session shares (this process's own
    without xdist)."""
    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared  # .../pytest-N/popen-gwK -> .../pytest-N


class SharedPresets(dict):
    """``optbench.config.compose``'s presets merged once per session, not once per worker: the
    process's own table (Hydra's first phase for each list of group overrides: 0.08 CPU-s each with
    optbench.config.hydra_loader, 0.16 before it; one read back from here, under a millisecond), which
    also reads what another worker merged from ``directory`` and writes what this one merged there
    (pickled: to the YAML and the struct flag what Hydra composed). In a full run 89 of 389 merges
    were another worker's repeats. A file that cannot be read is merged again."""

    def __init__(self, directory: Path, own: dict) -> None:
        super().__init__(own)
        self.directory = directory

    def _path(self, key: object) -> Path:
        import hashlib

        return self.directory / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.pickle"

    def __contains__(self, key: object) -> bool:
        if super().__contains__(key):
            return True
        import pickle

        try:
            merged = pickle.loads(self._path(key).read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError):
            return False
        super().__setitem__(key, merged)
        return True

    def __setitem__(self, key: object, merged: object) -> None:
        import pickle

        super().__setitem__(key, merged)
        path = self._path(key)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_bytes(pickle.dumps(merged))
        os.replace(partial, path)  # whole or absent for a reader on another worker


# ------------------------------------------------------------ run directories for optbench report
MODELS = {
    "tiny": {"name": "tiny", "dim": 128, "layers": 4, "heads": 4, "ffn_dim": 512, "vocab_size": 1024},
    "small": {"name": "small", "dim": 256, "layers": 6, "heads": 8, "ffn_dim": 1024, "vocab_size": 8192},
}
PARAMS = {"tiny": 1_049_728, "small": 8_916_224}


def train_fused_climate_run(root: Path, *, fusion: str, steps: int, more: tuple[str, ...] = ()) -> Path:
    """A small fused ``task=climate_text`` model (32 wide, 2 layers, byte vocabulary) trained ``steps``
    steps of batch 4 on the captions of a 30-day, 6-hourly synthetic file, checkpointed at its last
    step: ``root`` holds ``data.nc``, ``c.jsonl`` and the run in ``run/``. Returns ``root``."""
    from optbench.data.captions import write_captions
    from optbench.data.netcdf.synth import write_synthetic
    from optbench.run.train import train

    write_synthetic(root / "data.nc", days=30, step_hours=6, nlat=8, nlon=16, levels=(1000.0,))
    write_captions([str(root / "data.nc")], root / "c.jsonl", variables=["temperature"])
    cfg = compose_cfg(["task=climate_text", "data=netcdf", f"data.paths=[{root / 'data.nc'}]",
                       f"data.text={root / 'c.jsonl'}", "data.variables=[temperature]", f"fusion={fusion}",
                       "train.seq_len=48", "train.batch_size=4", f"train.steps={steps}", f"checkpoint.every={steps}",
                       "model.dim=32", "model.heads=2", "model.layers=2", "model.ffn_dim=64", "model.vocab_size=256",
                       "train.device=cpu", "log.progress=log", "measure.track_memory=false", "measure.warmup_steps=1",
                       "estimate.predict=false", *TEST_DEFAULTS, *more])
    result = train(cfg, run_dir=root / "run")
    assert result.status == "completed", result.error
    return root


def noisy(median: float, *, n: int = 40, rel: float = 0.05, seed: int = 0) -> list[float]:
    """Step times around ``median`` with a relative spread, like a real (noisy) run."""
    rng = np.random.default_rng(seed)
    return [float(median * (1 + rel * z)) for z in rng.standard_normal(n)]


def read_summary(run_dir) -> dict:
    """A run's summary.json as its keys spell it, read through the record (``read_run_summary``)."""
    return read_run_summary(run_dir).to_dict()


def fake_run(
    run_dir, *, overrides: list[str], step_times: list[float] | None = None, tokens_per_step: int = 128,
    loss_final: float = 5.0, loss_eval: float | None = 4.9, peak_bytes: int | None = 100 * 2**20,
    status: str = "completed", error: str | None = None, model: str = "tiny", started: str = "00",
):
    """A run dir as optbench train leaves it: summary.json from a RunSummary, metrics.jsonl, overrides."""
    run_dir.mkdir(parents=True)
    record = RunSummary(overrides=list(overrides), status=status, error=error, task="lm", device="cpu (test)",
                        started_at=f"2026-11-26T00:00:{started}+0000")
    record.set_config({"model": MODELS[model], "task": {"name": "lm"}, "train": {"seed": 0}},
                      f"{abs(hash((model, *overrides))):012x}"[:12])
    if status == "completed":
        times = step_times or noisy(0.1)
        median = float(np.median(times))
        record.model = Model(name=model, params=PARAMS[model], flops_per_token=6 * PARAMS[model])
        record.throughput = Throughput(
            tokens_per_step=tokens_per_step, step_times_s=times, timed_steps=len(times),
            tokens_per_s=tokens_per_step / median, mfu=0.1, peak_flops=2e11, peak_source="test peak",
            step_time_s=StepTimes(median=median, p10=float(np.percentile(times, 10)),
                                  p90=float(np.percentile(times, 90)), mean=float(np.mean(times))),
        )
        record.memory = Memory(peak_bytes=peak_bytes, peak_source="test")
        record.add(LoopProgress(steps=len(times) + 2, first_loss=7.0, final_loss=loss_final))
        record.loss.eval = loss_eval
        lines = [{"kind": "train", "step": s, "loss": 7.0 - (7.0 - loss_final) * s / (len(times) + 1),
                  "step_time_s": t, "timed": s >= 2} for s, t in enumerate([0.5, 0.5, *times])]
        if loss_eval is not None:
            lines.append({"kind": "eval", "step": len(times) + 1, "loss": loss_eval})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    write_run_summary(run_dir, record)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return run_dir


def variants(report, group: int = 0) -> dict:
    from optbench.report.format import render

    return {v["label"]: v for v in json.loads(render(report, "json"))["groups"][group]["variants"]}


# ------------------------------------------------------------ a finished run with checkpoints
SAVING = [*FAST, "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0"]  # the ``finished`` fixture's


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of a run directory (the ``finished`` fixture's) a test may change."""
    target = tmp_path / "run"
    shutil.copytree(run, target, ignore=shutil.ignore_patterns(".optbench.lock"))
    return target


def cli_one_line(capsys, *args: str) -> tuple[int, str]:
    """``optbench ARGS`` in this process, expected to end with one line on stderr and no traceback:
    (exit status, stderr)."""
    import pytest

    from optbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return exit_info.value.code, err


@contextlib.contextmanager
def bench_module(name: str) -> Iterator[types.ModuleType]:
    """``bench/NAME.py`` imported as module NAME (registered while in use: dataclasses resolve their
    module by name), for the tests of a benchmark's own logic."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def assert_cached_decoding_matches(model, cfg: DictConfig, tokens, context, *, prompt: int, rtol: float) -> None:
    """``optbench generate``'s key/value-cached decoding (its kind's ``ModelSpec.decode_step``): the
    first ``prompt`` tokens, then one token at a time, give the logits of the whole sequence run at
    once, with ``context`` and without a climate (the base alone)."""
    import torch

    from optbench.training.kinds import model_spec

    with torch.no_grad():
        for climate in (context, None):
            whole = model(tokens) if climate is None else model(tokens, context=climate)
            step = model_spec(cfg).decode_step(model, climate)
            parts = [step(tokens[:, :prompt])] + [step(tokens[:, i: i + 1]) for i in range(prompt, tokens.shape[1])]
            torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=rtol, atol=1e-5)
