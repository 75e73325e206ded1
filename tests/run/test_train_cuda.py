"""CUDA-only checks (skipped on a CPU machine; run them on a GPU with `pytest tests/run/test_train_cuda.py`)."""

from __future__ import annotations

import pytest
import torch

from optbench.measure import gpu_peak_key
from optbench.outputs import read_metrics
from optbench.run.train import train
from tests.helpers import FAST, ON_CUDA, compose_cfg

pytestmark = pytest.mark.cuda

CUDA = [arg for arg in FAST if arg != "train.device=cpu"] + ["train.device=cuda", *ON_CUDA]


def test_cuda_run_measures_with_the_allocator_and_the_datasheet(tmp_path):
    result = train(compose_cfg([*CUDA, "precision=bf16"]), run_dir=tmp_path)
    assert result.status == "completed", result.error
    summary = result.summary
    assert summary["device"].startswith("cuda:")
    assert summary["memory"]["peak_source"] == "torch.cuda.max_memory_allocated"
    assert summary["memory"]["peak_bytes"] > 0
    if gpu_peak_key(torch.cuda.get_device_name()) is None:
        assert summary["throughput"]["mfu"] is None
    else:
        assert summary["throughput"]["peak_source"].startswith("datasheet")
        assert summary["throughput"]["peak_source"].endswith("bfloat16")
        assert 0 < summary["throughput"]["mfu"] < 1


def test_tf32_is_applied_on_cuda(tmp_path):
    """applied.precision.tf32 is read back from torch's flag and the device; and the matmuls really
    changed: TF32 rounds their inputs to 10 mantissa bits, so the losses move, a little."""
    tf32 = train(compose_cfg([*CUDA, "precision=tf32"]), run_dir=tmp_path / "tf32")
    assert tf32.status == "completed", tf32.error
    assert torch.backends.cuda.matmul.allow_tf32 is True  # the run left torch's flag as it set it
    fp32 = train(compose_cfg([*CUDA, "precision=fp32"]), run_dir=tmp_path / "fp32")
    assert torch.backends.cuda.matmul.allow_tf32 is False
    has_tf32_units = torch.cuda.get_device_capability() >= (8, 0)
    assert tf32.summary["applied"]["precision"]["tf32"] is has_tf32_units
    assert fp32.summary["applied"]["precision"]["tf32"] is False
    assert tf32.summary["throughput"]["peak_source"].endswith("tf32")
    if has_tf32_units:
        lt = [r["loss"] for r in read_metrics(tf32.run_dir) if r["kind"] == "train"]
        lf = [r["loss"] for r in read_metrics(fp32.run_dir) if r["kind"] == "train"]
        assert lt != lf and lt == pytest.approx(lf, rel=1e-2)


def test_checkpointing_lowers_the_cuda_peak(tmp_path):
    wide = [*CUDA, "train.seq_len=512", "train.batch_size=16", "model.vocab_size=64", "train.steps=4"]
    none = train(compose_cfg([*wide, "ac=none"]), run_dir=tmp_path / "none")
    full = train(compose_cfg([*wide, "ac=full"]), run_dir=tmp_path / "full")
    assert full.summary["memory"]["peak_bytes"] < none.summary["memory"]["peak_bytes"]


def test_profiler_on_cuda_records_kernels_and_a_memory_snapshot(tmp_path):
    import json

    result = train(compose_cfg([*CUDA, "profile=trace", "profile.skip_first=2", "profile.wait=0", "profile.warmup=1",
                                "profile.active=2", "profile.memory_snapshot=true"]), run_dir=tmp_path)
    assert result.status == "completed", result.error
    profile = result.summary["profile"]
    trace = json.loads(next((tmp_path / "profile").glob("*.pt.trace.json")).read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # device kernels, not only CPU ops
    assert profile["top_ops"] and profile["top_ops"][0]["self_us"] > 0
    # operators only: on an H200 the ProfilerStep#N annotation (all the step's kernels) was listed first
    assert not any(op["name"].startswith("ProfilerStep") for op in profile["top_ops"])
    assert profile["top_ops"][0]["name"].startswith("aten::")
    assert profile["memory_snapshot"] and (tmp_path / "profile" / "memory_snapshot_rank0.pickle").stat().st_size > 0


def test_a_real_cuda_oom_is_recorded_and_the_allocator_is_left_clean(tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory
    # one micro-batch of this is far beyond any GPU; the up-front refusal is turned off to reach the OOM
    huge = [*CUDA, "run.check_memory=false", "train.seq_len=4096", "train.batch_size=512", "model.vocab_size=50304",
            "train.steps=4", "measure.warmup_steps=1"]
    result = train(compose_cfg(huge), run_dir=tmp_path)
    assert result.status == "oom", (result.status, result.error)
    record = result.summary["memory"]["oom"]
    assert record["step"] == 0 and record["capacity_bytes"] == total and record["reserved_bytes"] is not None
    assert "train.batch_size=" in record["advice"] or "fits" in record["advice"]
    assert torch.cuda.memory_reserved(0) < total // 10  # the cache was emptied for the next run


def test_a_config_beyond_the_gpu_is_refused_up_front(tmp_path):
    result = train(compose_cfg([*CUDA, "train.seq_len=4096", "train.batch_size=512", "model.vocab_size=50304"]),
                   run_dir=tmp_path)
    assert result.status == "incompatible" and result.exit_code == 2
    assert "memory" in result.error and "train.batch_size=" in result.error
