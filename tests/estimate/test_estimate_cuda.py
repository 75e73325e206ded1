"""CUDA-only check of the estimate (skipped on a CPU machine; run on a GPU with
`pytest tests/estimate/test_estimate_cuda.py`, or `make bench-estimate` for the whole table): the GPU
estimate, traced on FakeTensors with CUDA's saved tensors modeled (RMSNorm), against
torch.cuda.max_memory_allocated of the same run."""

from __future__ import annotations

import pytest

from optbench.run.train import train
from tests.helpers import FAST, ON_CUDA, compose_cfg

pytestmark = pytest.mark.cuda

# base (134M parameters) so that cuBLAS's workspace, which max_memory_allocated holds and no trace
# sees, stays a small fraction of the peak
CUDA = [arg for arg in FAST if arg not in ("train.device=cpu", "model=tiny")] + [
    "train.device=cuda", "model=134m", "train.seq_len=256", *ON_CUDA]


@pytest.mark.parametrize("overrides", [["precision=bf16"], ["precision=bf16", "ac=full"], ["precision=fp32"]])
def test_gpu_estimate_is_within_10_percent_of_max_memory_allocated(tmp_path, overrides):
    result = train(compose_cfg([*CUDA, *overrides]), run_dir=tmp_path)
    assert result.status == "completed", result.error
    memory = result.summary["memory"]
    assert memory["peak_source"] == "torch.cuda.max_memory_allocated"
    error = (memory["estimate_bytes"] - memory["peak_bytes"]) / memory["peak_bytes"]
    assert abs(error) <= 0.10, f"estimate {memory['estimate_bytes']:,} vs measured {memory['peak_bytes']:,}"
