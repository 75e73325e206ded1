"""What makes ``optbench estimate`` fast without changing a byte of it: a fused model's FLOPs counted on
short copies (exactly the whole model's count), and the packages transformers would import for
nothing left unimported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from torch import nn

from optbench.config import to_config
from optbench.tasks import build_task
from optbench.training.kinds import fused, model_spec
from tests.helpers import ROOT, compose_cfg

CLIMATE = ["task=climate_text", "task.climate_shape=[2,1,16,32]", "task.patch_size=4", "train.seq_len=32"]


@pytest.mark.parametrize("overrides", [
    ["model=hf_llama_tiny", "model.hf.config_overrides.num_hidden_layers=5", "fusion=cross_attention",
     "fusion.every=2", "fusion.freeze_base=true", "fusion.encoder_layers=0"],
    ["model=hf_llama_tiny", "model.hf.config_overrides.num_hidden_layers=6", "fusion=gated", "fusion.every=4"],
    ["model=tiny", "model.layers=5", "fusion=cross_attention", "fusion.every=4", "precision=bf16"],
    ["model=tiny", "fusion=gated", "fusion.every=2", "fusion.freeze_base=true"],
    ["model=tiny", "fusion=add"],
], ids=["hf-cross-frozen", "hf-gated", "own-cross-bf16", "own-gated-frozen", "own-add"])
def test_fused_flops_from_short_copies_are_the_whole_models_count(overrides):
    """The estimate's FLOPs/token of a fused model from copies of 1 and 2 layers (one or two fusion
    blocks) equals FlopCounterMode over the whole model's step, forward and training, exactly."""
    cfg = to_config(compose_cfg([*CLIMATE, *overrides]))
    task, spec = build_task(cfg), model_spec(cfg)
    base = spec.build.args[0]
    stacked = fused._stacked_flops(base, spec.build(cfg, task), cfg, task)
    assert stacked is not None and stacked == fused._measured_flops(base, cfg, task)


def test_blocks_that_differ_are_counted_whole():
    """Copies tell the count only of alike blocks: a block of another shape or class, or another
    parameter frozen, and the whole model is counted."""
    assert fused._alike([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert not fused._alike([nn.Linear(4, 4), nn.Linear(4, 8)])
    assert not fused._alike([nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4))])
    frozen = nn.Linear(4, 4)
    frozen.weight.requires_grad_(False)
    assert not fused._alike([nn.Linear(4, 4), frozen])
    cfg = to_config(compose_cfg([*CLIMATE, "model=tiny", "model.layers=2", "fusion=gated", "fusion.every=1"]))
    task, spec = build_task(cfg), model_spec(cfg)
    assert fused._stacked_flops(spec.build.args[0], spec.build(cfg, task), cfg, task) is None  # too short to gain


def test_an_hf_estimate_imports_neither_scipy_nor_torchao():
    """A fresh ``optbench estimate`` of a Hugging Face model imports transformers' modeling code but
    not what it would import for object-detection losses (scipy.optimize) and quantized checkpoints
    (torchao); training's own torchao imports (float8) still work in that process."""
    code = (
        "import json, sys\n"
        "from optbench.cli import main\n"
        "sys.argv = ['optbench', 'estimate', 'model=hf_llama_tiny', 'estimate.search=false',"
        " 'estimate.predict=false', 'train.seq_len=32']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "seen = {name: name in sys.modules for name in "
        "('transformers.modeling_utils', 'scipy', 'scipy.optimize', 'torchao')}\n"
        "import torchao.float8  # noqa: F401\n"
        "print(json.dumps(seen))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"transformers.modeling_utils": True, "scipy": False, "scipy.optimize": False, "torchao": False}
