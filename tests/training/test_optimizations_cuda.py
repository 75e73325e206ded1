"""Checks that need CUDA (skipped without it): FlexAttention against SDPA, forward and backward;
torchao's CPUOffloadOptimizer really offloading and training like fused AdamW; CUDA graphs applied."""

from __future__ import annotations

import pytest
import torch

from optbench.outputs import read_metrics
from optbench.run.train import train
from tests.helpers import FAST, compose_cfg

pytestmark = pytest.mark.cuda

CUDA = [arg for arg in FAST if arg != "train.device=cpu"] + ["train.device=cuda"]


@pytest.mark.parametrize("causal", [True, False])
def test_flex_matches_sdpa_forward_and_backward(causal):
    from optbench.model.transformer import sdpa_attention
    from optbench.training.attention import FlexAttention

    torch.manual_seed(0)
    shape = (2, 4, 256, 64)
    q, k, v = (torch.randn(shape, device="cuda", requires_grad=True) for _ in range(3))
    flex_out = FlexAttention()(q, k, v, causal)
    flex_grads = torch.autograd.grad(flex_out.square().sum(), (q, k, v))
    sdpa_out = sdpa_attention(q, k, v, causal)
    sdpa_grads = torch.autograd.grad(sdpa_out.square().sum(), (q, k, v))
    torch.testing.assert_close(flex_out, sdpa_out, rtol=1e-4, atol=1e-4)
    for flex_grad, sdpa_grad in zip(flex_grads, sdpa_grads, strict=True):
        torch.testing.assert_close(flex_grad, sdpa_grad, rtol=1e-3, atol=1e-3)


def test_flex_trains_like_sdpa(tmp_path):
    sdpa = train(compose_cfg([*CUDA, "attention=sdpa"]), run_dir=tmp_path / "sdpa")
    flex = train(compose_cfg([*CUDA, "attention=flex"]), run_dir=tmp_path / "flex")
    assert flex.status == "completed", flex.error
    assert flex.summary["applied"]["attention"] == "flex" and sdpa.summary["applied"]["attention"] == "sdpa"
    ls = [r["loss"] for r in read_metrics(sdpa.run_dir) if r["kind"] == "train"]
    lf = [r["loss"] for r in read_metrics(flex.run_dir) if r["kind"] == "train"]
    assert lf != ls  # another kernel rounds differently: an ignored attention=flex would repeat SDPA's losses
    assert lf == pytest.approx(ls, rel=1e-3)


def test_cpu_offload_keeps_optimizer_state_on_the_cpu(tmp_path):
    pytest.importorskip("torchao", reason="optimizer=cpu_offload needs torchao (a project dependency)")
    common = [*CUDA, "train.clip_grad=null", "model.dim=256", "model.ffn_dim=1024"]
    fused = train(compose_cfg([*common, "optimizer=adamw_fused"]), run_dir=tmp_path / "fused")
    offload = train(compose_cfg([*common, "optimizer=cpu_offload"]), run_dir=tmp_path / "offload")
    assert offload.status == "completed", offload.error
    applied = offload.summary["applied"]["optimizer"]
    assert applied["class"] == "torchao.optim.cpu_offload.CPUOffloadOptimizer"
    assert applied["inner"] == "AdamW (fused)"
    assert applied["offloaded"]["tensors"] > 0  # every matrix of >= 4096 elements
    # the same AdamW update, computed on the CPU instead of the GPU
    lf = [r["loss"] for r in read_metrics(fused.run_dir) if r["kind"] == "train"]
    lo = [r["loss"] for r in read_metrics(offload.run_dir) if r["kind"] == "train"]
    assert lo == pytest.approx(lf, rel=1e-4)
    assert offload.summary["memory"]["peak_bytes"] < fused.summary["memory"]["peak_bytes"]


def test_reduce_overhead_records_cuda_graphs(tmp_path):
    """applied.compile.cudagraphs is read back from Inductor's cudagraph trees: graphs recorded under
    reduce-overhead, none under compile=default (a dropped mode would read like the latter)."""
    run = train(compose_cfg([*CUDA, "compile=reduce-overhead", "train.eval_batches=0"]), run_dir=tmp_path / "ro")
    assert run.status == "completed", run.error
    applied = run.summary["applied"]["compile"]
    assert applied["cudagraphs"] is True and applied["cudagraphs_recorded"] >= 1, applied
    default = train(compose_cfg([*CUDA, "compile=default", "train.eval_batches=0"]), run_dir=tmp_path / "default")
    assert default.status == "completed", default.error
    assert default.summary["applied"]["compile"]["cudagraphs"] is False
    assert default.summary["applied"]["compile"]["cudagraphs_recorded"] == 0
