"""Performance at scale: the z-loss at cross-entropy's cost, float8 training's config,
compatibility rules and module swap (on the meta device), and drift-proof speed verdicts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from optbench.config import to_config
from optbench.distributed import Machine
from optbench.errors import ConfigError
from optbench.tasks import build_task
from optbench.tasks.lm import cross_entropy_and_logsumexp
from optbench.training import preflight as compat
from optbench.training.build import build_model
from optbench.training.parallelize import parallelize
from tests.helpers import ON_CUDA, compose_cfg

CPU = Machine(device=torch.device("cpu"), cuda_available=False, cuda_devices=0, cpu_threads=1)


# ------------------------------------------------------------------------------------- z-loss
def test_z_loss_shares_cross_entropys_pass_and_matches_the_two_pass_formula():
    logits = torch.randn(48, 101, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (48,))

    def fused(x):
        ce, lse = cross_entropy_and_logsumexp(x, targets[: len(x)])
        return ce + 0.3 * lse[:5].square().mean()

    def two_pass(x):
        return F.cross_entropy(x, targets[: len(x)]) + 0.3 * torch.logsumexp(x, -1)[:5].square().mean()

    assert torch.autograd.gradcheck(fused, (logits[:6, :7].detach().requires_grad_(),))
    (grad_fused,) = torch.autograd.grad(fused(logits), logits)
    (grad_ref,) = torch.autograd.grad(two_pass(logits), logits)
    torch.testing.assert_close(fused(logits), two_pass(logits))
    torch.testing.assert_close(grad_fused, grad_ref)


def test_lm_task_main_loss_is_plain_cross_entropy_with_or_without_the_z_loss():
    cfg = to_config(compose_cfg(["train.batch_size=2", "train.seq_len=16"]))
    task = build_task(cfg)
    batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (2, 17))}
    logits = torch.randn(2, 16, cfg.model.vocab_size)
    with_aux = task.losses(logits, batch, with_aux=True)
    without = task.losses(logits, batch, with_aux=False)
    assert torch.equal(with_aux.main, without.main)
    expected_z = cfg.task.z_loss_weight * torch.logsumexp(logits.flatten(0, 1), -1).square().mean()
    torch.testing.assert_close(with_aux.aux["z_loss"], expected_z)
    assert with_aux.total > without.total


# ------------------------------------------------------------------------------------- float8
@pytest.mark.parametrize("preset, recipe", [("float8", "tensorwise"), ("float8_rowwise", "rowwise")])
def test_float8_presets_compose_with_their_recipe(preset, recipe):
    cfg = to_config(compose_cfg([f"precision={preset}"]))
    assert cfg.precision.float8_recipe == recipe and cfg.precision.autocast == "bfloat16"
    ablation = to_config(compose_cfg(["ablation=9_float8"]))
    assert ablation.precision.float8_recipe == "tensorwise" and ablation.compile.name == "default"


@pytest.mark.parametrize("override, needle", [
    ("precision.float8_recipe=blockwise", "use one of tensorwise, rowwise"),
    ("precision.autocast=null", "set precision.autocast=bfloat16"),
])
def test_float8_bad_values_name_the_fix(override, needle):
    with pytest.raises(ConfigError, match=needle):
        to_config(compose_cfg(["precision=float8", override]))


def test_float8_conversion_prints_nothing_of_torchao_s_first_import():
    """A fresh process (torchao is imported once): the conversion ``optbench plan``'s float8
    candidates and a float8 estimate run imports torchao, whose CUDA kernels for another Python fail
    to load and whose enum registrations torch warns about; none of it reaches the screen."""
    code = ("import torch; from torch import nn; from optbench.training.float8 import apply_float8\n"
            "model = nn.Module(); model.layers = nn.ModuleList([nn.Linear(16, 16, device='meta')])\n"
            "print(apply_float8(model, recipe='tensorwise')['converted_linears'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    for noise in ("Failed to load", "_pytree", "deprecated", "Warning"):
        assert noise not in done.stderr, done.stderr


def test_float8_is_refused_on_cpu_with_the_fix():
    reasons = compat.blocking_reasons(to_config(compose_cfg(["precision=float8"])), CPU)
    assert len(reasons) == 1 and "compute capability 8.9" in reasons[0] and "use precision=bf16" in reasons[0]


def test_float8_is_refused_below_sm89_and_allowed_on_sm90(monkeypatch):
    gpu = Machine(device=torch.device("cuda", 0), cuda_available=True, cuda_devices=1, cpu_threads=1)
    cfg = to_config(compose_cfg(["precision=float8"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert (
        "precision=float8 (float8 tensorwise) needs compute capability 8.9 or newer (float8 tensor cores); "
        "this GPU is 8.0: use precision=bf16 on it") in compat.blocking_reasons(cfg, gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not any("compute capability" in reason for reason in compat.blocking_reasons(cfg, gpu))


def test_float8_dims_not_divisible_by_16_are_refused_naming_values_that_are():
    cfg = to_config(compose_cfg(["precision=float8", "model.dim=120", "model.heads=4", "model.ffn_dim=500",
                                 "train.batch_size=3", "train.seq_len=20"]))
    reason = next(r for r in compat.blocking_reasons(cfg, CPU) if "divisible by 16" in r)
    assert "model.dim=120 (use 112 or 128)" in reason and "model.ffn_dim=500 (use 496 or 512)" in reason
    assert "= 60 (make it a multiple of 16, e.g. 48 or 64)" in reason
    aligned = to_config(compose_cfg(["precision=float8"]))
    assert not any("divisible by 16" in r for r in compat.blocking_reasons(aligned, CPU))


def test_float8_swaps_the_block_linears_on_the_meta_device():
    from torchao.float8.float8_linear import Float8Linear

    cfg = to_config(compose_cfg(["precision=float8_rowwise", "ac=full"]))
    model = build_model(cfg, build_task(cfg))
    applied = parallelize(model, cfg=cfg, machine=CPU)
    swapped = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(swapped) == 6 * cfg.model.layers == applied["float8"]["converted_linears"]
    assert all(".attn.w" in n or ".mlp.w" in n for n in swapped)
    assert type(model.head) is torch.nn.Linear and "bf16 peak" in applied["float8"]["mfu_peak"]
    linear = next(m for m in model.modules() if isinstance(m, Float8Linear))
    assert linear.weight.is_meta and applied["float8"]["recipe"] == "rowwise"
    assert linear.config.cast_config_input.scaling_granularity.value == "axiswise"  # rowwise scales
    plain = to_config(compose_cfg([]))
    assert parallelize(build_model(plain, build_task(plain)), cfg=plain, machine=CPU)["float8"] is None


# ------------------------------------------------------------------------- drift-proof verdicts
def _with_probes(run_dir, before: float, after: float) -> None:
    from optbench.outputs import write_run_summary
    from optbench.summary import MachineSpeed, read_run_summary

    summary = read_run_summary(run_dir)
    summary.add(MachineSpeed(before={"flops": before}, after={"flops": after}, moved=after / before - 1))
    write_run_summary(run_dir, summary)


@pytest.mark.parametrize("b_probe, expected", [
    ((100e9, 100e9), "faster"),  # a steady machine: B's 1.5x is B's
    ((150e9, 210e9), "no verdict: machine speed moved 110%"),  # the machine itself got 2.1x faster
])
def test_a_speedup_smaller_than_the_machines_own_drift_gets_no_verdict(tmp_path, b_probe, expected):
    from optbench.report.analysis import build_report
    from tests.helpers import fake_run, noisy, variants

    _with_probes(fake_run(tmp_path / "a", overrides=["x=a"], step_times=noisy(0.15, seed=1), started="01"),
                 100e9, 100e9)
    _with_probes(fake_run(tmp_path / "b", overrides=["x=b"], step_times=noisy(0.10, seed=2), started="02"),
                 *b_probe)
    result = variants(build_report([tmp_path]))["x=b"]["vs_baseline"]
    assert result["speedup"] == pytest.approx(1.5, rel=0.05) and result["ci_low"] > 1.3
    assert result["verdict"].startswith(expected)
    if expected != "faster":
        assert "probe 100.0-210.0 GFLOP/s" in result["verdict"]
        assert f"more than the {result['speedup'] - 1:.0%} effect" in result["verdict"]


def test_every_run_records_the_machine_speed_before_and_after_its_loop(tmp_path):
    from optbench.run.train import train
    from tests.helpers import FAST

    run = train(compose_cfg([*FAST, "train.steps=3", "train.eval_batches=0"]), run_dir=tmp_path)
    speed = run.summary["machine_speed"]
    assert speed["before"]["flops"] > 0 and speed["after"]["flops"] > 0
    assert speed["moved"] == pytest.approx(speed["after"]["flops"] / speed["before"]["flops"] - 1)
    assert "512^3 matmuls on cpu" in speed["before"]["method"]


def _has_float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.cuda
@pytest.mark.skipif(not _has_float8_gpu(), reason="needs a CUDA GPU of compute capability >= 8.9")
def test_float8_trains_on_the_gpu_and_reports_mfu_against_the_bf16_peak(tmp_path):
    from optbench.run.train import train

    overrides = ["model=tiny", "train.device=cuda", "train.steps=8", "train.batch_size=8", "train.seq_len=64",
                 "train.eval_batches=1", "log.progress=log", "compile=default", *ON_CUDA]
    run = train(compose_cfg([*overrides, "precision=float8"]), run_dir=tmp_path / "f8")
    assert run.status == "completed", run.error
    assert run.summary["applied"]["float8"]["converted_linears"] == 24
    assert "dense bfloat16" in run.summary["throughput"]["peak_source"]
    bf16 = train(compose_cfg([*overrides, "precision=bf16"]), run_dir=tmp_path / "bf16")
    assert bf16.summary["throughput"]["peak_flops"] == run.summary["throughput"]["peak_flops"]
    # float8 matmuls really ran: the loss differs from bf16's, yet trains alike
    assert run.summary["loss"]["final"] != bf16.summary["loss"]["final"]
    assert run.summary["loss"]["final"] == pytest.approx(bf16.summary["loss"]["final"], rel=0.05)
