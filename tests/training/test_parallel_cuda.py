"""Parallel runs on CUDA: nccl, the NCCL preset really applied, one worker per GPU. Skipped without
CUDA (this project's CPU machines); run on a GPU machine with `pytest -q tests/training/test_parallel_cuda.py`."""

from __future__ import annotations

import pytest
import torch

from optbench.outputs import read_metrics
from optbench.run.train import train
from tests.helpers import ON_CUDA, compose_cfg

pytestmark = pytest.mark.cuda

RUN = ["model=tiny", "train.steps=6", "train.seq_len=64", "measure.warmup_steps=2", "train.eval_batches=1",
       "log.progress=log", *ON_CUDA]


def test_ddp_on_one_gpu_uses_nccl_with_the_tuned_preset(tmp_path):
    result = train(compose_cfg([*RUN, "train.batch_size=4", "parallel=ddp", "parallel.nproc_per_node=1",
                                "nccl=tuned", "precision=bf16"]), run_dir=tmp_path)
    assert result.status == "completed", result.error
    applied = result.summary["applied"]
    assert applied["parallel"]["backend"] == "nccl" and applied["parallel"]["mode"] == "ddp"
    assert applied["nccl"]["applied"] is True and applied["nccl"]["env"]["NCCL_NSOCKS_PERTHREAD"] == "4"
    assert result.summary["memory"]["peak_source"].startswith("torch.cuda.max_memory_allocated")


def test_more_workers_than_gpus_is_refused(tmp_path):
    count = torch.cuda.device_count()
    result = train(compose_cfg([*RUN, "parallel=ddp", f"parallel.nproc_per_node={count + 1}"]), run_dir=tmp_path)
    assert result.exit_code == 2 and f"set parallel.nproc_per_node={count}" in result.error


@pytest.mark.multi_gpu
def test_fsdp2_matches_ddp_on_two_gpus(tmp_path):
    common = [*RUN, "train.batch_size=2", "parallel.nproc_per_node=2"]
    ddp = train(compose_cfg([*common, "parallel=ddp"]), run_dir=tmp_path / "ddp")
    fsdp = train(compose_cfg([*common, "parallel=fsdp2"]), run_dir=tmp_path / "fsdp2")
    assert ddp.status == fsdp.status == "completed", (ddp.error, fsdp.error)
    assert fsdp.summary["world_size"] == 2 and fsdp.summary["applied"]["parallel"]["backend"] == "nccl"
    loss = [[r["loss"] for r in read_metrics(run.run_dir) if r["kind"] == "train"] for run in (ddp, fsdp)]
    assert loss[1] == pytest.approx(loss[0], rel=1e-4)  # fp32 on GPU: TF32 is off, kernels may differ
