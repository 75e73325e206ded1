"""The run's own estimate of a Hugging Face causal LM equals the peak MemTracker measures on its real
tensors, for architectures optbench's code never names, each with its own quirk, written here with
``save_pretrained``: Gemma (tied embeddings, its own norm), Gemma2 (logit soft-capping, a sliding
window), Phi (partial rotary, parallel attention and MLP), OPT (learned positions), Bloom (ALiBi),
StableLM (partial rotary, grouped KV heads), Falcon (parallel attention and MLP, multi-query), Llama
(grouped KV heads) — under the groups that change memory. And the stacked trace of an HF model (one
block traced, the rest counted) equals its whole trace."""

from __future__ import annotations

import pytest
import torch

from optbench.config import to_config
from optbench.estimate.tracer import trace_step
from optbench.run.train import train
from tests.helpers import TEST_DEFAULTS, compose_cfg, run_cli

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, max_position_embeddings=64)
RUN = ["train.device=cpu", "train.steps=3", "measure.warmup_steps=2", "train.batch_size=2", "train.seq_len=32",
       "train.eval_batches=0", "log.progress=log", "estimate.predict=false", *TEST_DEFAULTS]


def _configs() -> dict:
    t = transformers
    attention = dict(num_hidden_layers=2, num_attention_heads=4)
    return {
        "llama": t.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=1, **attention, **SHAPE),
        "gemma": t.GemmaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=1, head_dim=8,
                               **attention, **SHAPE),
        "gemma2": t.Gemma2Config(hidden_size=32, intermediate_size=64, num_key_value_heads=2, head_dim=8,
                                 sliding_window=8, **attention, **SHAPE),
        "phi": t.PhiConfig(hidden_size=32, intermediate_size=64, partial_rotary_factor=0.5, resid_pdrop=0.0,
                           embd_pdrop=0.0, **attention, **SHAPE),
        "opt": t.OPTConfig(hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, **attention, **SHAPE),
        "bloom": t.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=128, hidden_dropout=0.0),
        "stablelm": t.StableLmConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                                     partial_rotary_factor=0.25, **attention, **SHAPE),
        "falcon": t.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
                                 parallel_attn=True, new_decoder_architecture=False, alibi=False, vocab_size=128,
                                 hidden_dropout=0.0),
    }


@pytest.fixture(scope="module")
def archs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    for name, config in _configs().items():
        torch.manual_seed(1)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
    return root


# (architecture, overrides): every group that changes memory, each on an architecture of its own
# (Gemma2 and Bloom have no SDPA path in transformers: attention=math)
CASES = [
    ("llama", []),
    ("gemma", ["precision=bf16"]),
    ("gemma2", ["attention=math", "ac=selective", "ac.every=2"]),
    ("phi", ["ac=full"]),
    ("opt", ["optimizer=muon"]),
    ("bloom", ["attention=math", "precision=bf16", "ac=full"]),
    ("stablelm", ["train.grad_accum=2"]),
    ("falcon", []),
    ("falcon", ["parallel=fsdp2", "parallel.nproc_per_node=2", "precision=bf16"]),
    ("llama", ["parallel=ddp", "parallel.nproc_per_node=2"]),
]


@pytest.mark.parametrize(("arch", "more"), CASES, ids=[" ".join([a, *m]) for a, m in CASES])
def test_the_estimate_of_an_unnamed_architecture_is_its_measured_peak(archs, arch, more, tmp_path):
    """Byte for byte: the traced step keeps what the real one keeps (transformers skips its causal
    mask on real tensors, and in the trace too). With accumulation the run draws a new batch for each
    micro-step where the trace reuses one: a few bytes apart (8 here), as for optbench's own model."""
    result = train(compose_cfg(["model=hf", f"model.hf.config={archs / arch}", *RUN, *more, "estimate.in_run=true"]),
                   run_dir=tmp_path)
    assert result.status == "completed", result.error
    memory = result.summary["memory"]
    assert "MemTracker on real tensors, step 1" in memory["peak_source"], memory
    slack = 16 if "train.grad_accum=2" in more else 0
    assert abs(memory["estimate_bytes"] - memory["peak_bytes"]) <= slack, memory


@pytest.mark.parametrize("arch", ["llama", "falcon"])
def test_a_stacked_hf_estimate_is_its_whole_trace(archs, arch):
    """10 blocks of an HF model stacked from traces of 2 and 3: the whole model's bytes, component for
    component, before and during the optimizer step."""
    cfg = to_config(compose_cfg(["model=hf", f"model.hf.config={archs / arch}", "train.seq_len=32",
                                 "+model.hf.config_overrides.num_hidden_layers=10"]))
    stacked = trace_step(cfg, world_size=1, micro_batch=2, target="cuda", stacked=True)
    whole = trace_step(cfg, world_size=1, micro_batch=2, target="cuda", stacked=False)
    assert stacked.method.startswith("stacked from traces of 2 and 3 blocks"), stacked.method
    assert stacked.steady_peak().components == whole.steady_peak().components
    assert stacked.during_step.components == whole.during_step.components


def test_the_estimate_of_an_hf_model_is_the_first_thing_on_the_screen(archs):
    """A fresh process (imports happen once): importing transformers' modeling code imports torchao,
    whose CUDA kernels for another Python fail to load, and torch warns about its enum registrations;
    none of it reaches the user, whose first line is the estimate."""
    done = run_cli("estimate", "model=hf", f"model.hf.config={archs / 'llama'}", "train.seq_len=32",
                   "estimate.search=false", "estimate.predict=false")
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("optbench estimate for ") and ": hf precision=" in first, done.stdout
    for noise in ("Failed to load", "_pytree", "deprecated", "Warning"):
        assert noise not in done.stderr, done.stderr
