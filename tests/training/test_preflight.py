"""Every compatibility rule, on a CPU machine and on a (described, not real) CUDA machine; the
message names every option that blocks a config; an incompatible run leaves an honest summary."""

from __future__ import annotations

import pytest
import torch

from optbench.config import to_config
from optbench.distributed import Machine
from optbench.errors import IncompatibleError
from optbench.run.train import train
from optbench.training import preflight as compat
from tests.helpers import FAST, compose_cfg, read_summary

CPU = Machine(device=torch.device("cpu"), cuda_available=False, cuda_devices=0, cpu_threads=2)
CUDA = Machine(device=torch.device("cuda", 0), cuda_available=True, cuda_devices=1, cpu_threads=2)
# what a planned two-worker run (parallel.nproc_per_node=2) looks like, on CPU and on two GPUs
CPU_X2 = Machine(device=torch.device("cpu"), cuda_available=False, cuda_devices=0, cpu_threads=2,
                 world_size=2, local_world_size=2)
CUDA_X2 = Machine(device=torch.device("cuda", 0), cuda_available=True, cuda_devices=2, cpu_threads=2,
                  world_size=2, local_world_size=2)


def reasons(overrides: list[str], machine: Machine = CPU) -> list[str]:
    return compat.blocking_reasons(to_config(compose_cfg(overrides)), machine)


def test_defaults_are_compatible_everywhere():
    assert reasons([]) == [] and reasons([], CUDA) == []


@pytest.mark.parametrize(
    ("overrides", "needle", "fix"),
    [
        (["precision=tf32"], "precision=tf32", "precision=fp32"),
        (["compile=reduce-overhead"], "compile=reduce-overhead", "use compile=default on CPU"),
        (["attention=flex"], "FlexAttention does not support backward on CPU", "use attention=sdpa on CPU"),
        (["optimizer=cpu_offload", "train.clip_grad=null"], "optimizer=cpu_offload needs CUDA", "optimizer=adamw"),
        (["parallel=fsdp2", "parallel.cpu_offload=true"], "parallel.cpu_offload=true offloads", "parallel.cpu_offload=false"),
    ],
)
def test_cuda_only_options_are_refused_on_cpu_only(overrides, needle, fix):
    on_cpu = reasons(overrides)
    assert any(needle in r and fix in r for r in on_cpu), on_cpu
    assert not any(needle in r for r in reasons(overrides, CUDA))


def test_cpu_offload_is_single_gpu_only():
    for mode in ("ddp", "fsdp2"):
        found = reasons(["optimizer=cpu_offload", "train.clip_grad=null", f"parallel={mode}"], CUDA_X2)
        assert any(f"cannot run with parallel={mode}" in r and "single-GPU" in r for r in found), found
    fsdp2 = reasons(["optimizer=cpu_offload", "train.clip_grad=null", "parallel=fsdp2"], CUDA_X2)
    assert any("phase=7_fsdp2_cpu_offload_policy" in r for r in fsdp2)


def test_cpu_offload_refuses_gradient_clipping():
    assert any("train.clip_grad=null" in r for r in reasons(["optimizer=cpu_offload"], CUDA))
    assert reasons(["optimizer=cpu_offload", "train.clip_grad=null"], CUDA) == []


def test_offloaded_gradients_refuse_gradient_accumulation():
    base = ["optimizer=cpu_offload", "train.clip_grad=null", "optimizer.offload_gradients=true"]
    assert any("train.grad_accum=2" in r for r in reasons([*base, "train.grad_accum=2"], CUDA))
    assert reasons([*base, "train.grad_accum=1"], CUDA) == []


def test_cpu_offload_refuses_loss_scaling():
    found = reasons(["optimizer=cpu_offload", "train.clip_grad=null", "precision=fp16"], CUDA)
    assert any("precision=fp16" in r and "precision=bf16" in r for r in found), found


@pytest.mark.parametrize("optimizer", ["muon", "cpu_offload"])
def test_onecycle_needs_a_single_momentum(optimizer):
    found = reasons([f"optimizer={optimizer}", "train.clip_grad=null", "train.schedule=onecycle"], CUDA)
    assert any("train.schedule=onecycle" in r and f"optimizer={optimizer}" in r for r in found), found


def test_fsdp2_cpu_offload_policy_is_refused_on_cpu_only():
    assert reasons(["parallel=fsdp2"], CPU_X2) == []
    found = reasons(["parallel=fsdp2", "parallel.cpu_offload=true"], CPU_X2)
    assert found and "set parallel.cpu_offload=false on CPU" in found[0]
    on_gpu = reasons(["parallel=fsdp2", "parallel.cpu_offload=true"], CUDA_X2)
    assert not [r for r in on_gpu if "cpu_offload" in r], on_gpu


def test_phase_7_on_cpu_names_every_option_that_blocks_it():
    with pytest.raises(IncompatibleError) as err:
        compat.check(to_config(compose_cfg(["phase=7_fsdp2"])), CPU_X2)
    message = str(err.value)
    assert "\n" not in message
    assert "options block this run" in message
    assert "optimizer=cpu_offload needs CUDA" in message  # the CUDA-only option it inherits
    assert "optimizer=cpu_offload cannot run with parallel=fsdp2" in message  # and not even on GPUs
    assert "precision" not in message and "ac=" not in message  # what it can run is not named
    assert "parallel=fsdp2 with" not in message  # FSDP2 itself runs on CPU (gloo)
    assert message.startswith("2 options block this run")


def test_phase_7_variant_is_what_a_gpu_can_run():
    on_gpu = reasons(["phase=7_fsdp2_cpu_offload_policy"], CUDA_X2)
    # a CPU-only torch build has no NCCL to check the described GPUs against
    on_gpu = [r for r in on_gpu if not (r.startswith("parallel.backend=nccl") and not torch.cuda.is_available())]
    assert on_gpu == [], on_gpu


def test_too_few_gpus_name_a_fix_that_works():
    """Two workers on one GPU: DDP may drop to one worker per GPU, FSDP2 may not (one rank is
    refused), so its message must not send the user to parallel.nproc_per_node=1."""
    one_gpu_two_workers = Machine(device=torch.device("cuda", 0), cuda_available=True, cuda_devices=1,
                                  cpu_threads=2, world_size=2, local_world_size=2)
    ddp = reasons(["parallel=ddp"], one_gpu_two_workers)
    assert any("set parallel.nproc_per_node=1" in r for r in ddp), ddp
    fsdp2 = reasons(["phase=7_fsdp2_cpu_offload_policy"], one_gpu_two_workers)
    assert any("parallel=fsdp2 shards over 2 or more GPUs but torch sees 1" in r for r in fsdp2), fsdp2
    assert not any("nproc_per_node=1" in r for r in fsdp2), fsdp2


def test_flex_backward_really_is_missing_on_cpu():
    """The torch behaviour the flex rule stands on: when a torch adds the CPU backward, this fails."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q)


def test_incompatible_run_records_every_reason_and_no_metrics(tmp_path):
    result = train(compose_cfg([*FAST, "phase=5_cpu_offload", "nccl=default"]), run_dir=tmp_path)
    assert result.status == "incompatible" and result.exit_code == 2
    summary = read_summary(tmp_path)
    assert summary["status"] == "incompatible" and "optimizer=cpu_offload needs CUDA" in summary["error"]
    assert summary["steps"] == 0 and not (tmp_path / "metrics.jsonl").exists()
