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


STACKED_FUSED = {
    "own-cross": (["model=small", "model.layers=12", "fusion=cross_attention", "fusion.every=1",
                   "fusion.encoder_layers=0"], 1, "stacked from traces of 2 and 3 blocks"),
    "own-gated-frozen": (["model=small", "model.layers=24", "fusion=gated", "fusion.every=2", "fusion.encoder_layers=1",
                          "fusion.freeze_base=true"], 1, "stacked from traces of 4 and 6 blocks (one unit of 2 blocks"),
    "hf-cross-frozen-fsdp2": (["model=hf_llama_tiny", "model.hf.config_overrides.num_hidden_layers=12",
                               "fusion=cross_attention", "fusion.every=1", "fusion.encoder_layers=0",
                               "fusion.freeze_base=true", "parallel=fsdp2"], 4, "stacked from traces of 2 and 3 blocks"),
    "own-add": (["model=small", "model.layers=12", "fusion=add", "fusion.encoder_layers=1"], 1,
                "stacked from traces of 2 and 3 blocks"),
    "hf-gated": (["model=hf_llama_tiny", "model.hf.config_overrides.num_hidden_layers=20", "fusion=gated",
                  "fusion.every=2", "fusion.encoder_layers=1"], 1, "stacked from traces of 4 and 6 blocks"),
    # the copies hold their most activations in the loss, the whole model at the end of its blocks:
    # that moment is stacked as the peak is (a line through the copies' own maxima said 16,854,020
    # bytes where the whole model holds 25,007,124)
    "own-cross-frozen-fsdp2": (["model=small", "model.layers=12", "fusion=cross_attention", "fusion.every=1",
                                "fusion.encoder_layers=0", "fusion.freeze_base=true", "parallel=fsdp2"], 2,
                               "stacked from traces of 2 and 3 blocks"),
}


@pytest.mark.filterwarnings("ignore:DTensor random operators")
@pytest.mark.parametrize("case", list(STACKED_FUSED))
def test_a_fused_model_stacked_by_units_equals_its_whole_trace(case):
    """A fused model's unit (a fusion block and the decoder layers up to the next) repeats like a
    plain decoder's block: the stacked step is the whole model's, byte for byte, moment for moment."""
    from optbench.estimate.tracer import trace_step

    overrides, world_size, how = STACKED_FUSED[case]
    cfg = to_config(compose_cfg([*CLIMATE, *overrides]))
    whole = trace_step(cfg, world_size=world_size, micro_batch=2, stacked=False)
    stacked = trace_step(cfg, world_size=world_size, micro_batch=2)
    assert how in stacked.method and whole.method == "the whole model traced"
    for part in ("before_step", "during_step"):
        w, s = getattr(whole, part), getattr(stacked, part)
        assert (s.components, s.phase, s.module, s.host) == (w.components, w.phase, w.module, w.host)
    assert (stacked.state_bytes, stacked.extra, stacked.activation_peak) == \
        (whole.state_bytes, whole.extra, whole.activation_peak)


def test_a_fused_model_is_stacked_only_where_its_units_line_up():
    """The 004 shape's four units of 8 layers are too few to gain; a climate encoder deeper than a
    unit would be taken for decoder blocks past the first unit, and a prefix's copies do not line
    up block for block: all traced whole."""
    from optbench.estimate.tracer import stacking_plan

    def plan(*overrides: str):
        return stacking_plan(to_config(compose_cfg([*CLIMATE, *overrides])))

    assert plan("model=small", "model.layers=32", "fusion=cross_attention", "fusion.every=8",
                "fusion.encoder_layers=0") is None
    assert plan("model=small", "model.layers=12", "fusion=gated", "fusion.every=1", "fusion.encoder_layers=2") is None
    assert plan("model=small", "model.layers=12", "fusion=prefix", "fusion.encoder_layers=0") is None
    assert plan("model=small", "model.layers=12", "fusion=gated", "fusion.every=1", "fusion.encoder_layers=1").la == 2
    assert plan("model=small", "model.layers=40", "fusion=gated", "fusion.every=4", "fusion.encoder_layers=1").period == 4
