"""The model: meta-device build, FLOPs formula cross-checked with FlopCounterMode, data sampler."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from optbench.config import to_config
from optbench.data.markov import SyntheticTokens
from optbench.data.sampler import ShardedSampler
from optbench.model.decoder import flops_per_token
from optbench.model.transformer import Transformer, math_attention, sdpa_attention
from optbench.tasks import build_task
from optbench.training.build import build_model, materialize
from tests.helpers import compose_cfg


def test_flops_per_token_matches_flop_counter():
    """6 N_matmul + 12 L d T is exactly what the matmuls of a forward+backward do. The math attention
    path is used because FlopCounterMode has no formula for CPU flash-attention kernels."""
    cfg = to_config(compose_cfg(["model=tiny", "train.seq_len=64", "train.batch_size=2"]))
    task = build_task(cfg)
    with torch.device("meta"):
        model = Transformer(cfg.model, embed=task.build_embed(), head=task.build_head(), causal=True,
                            max_seq_len=64, attention=math_attention)
    materialize(model, device=torch.device("cpu"), seed=0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65))
    batch = {"tokens": tokens}
    with FlopCounterMode(display=False) as counter:
        task.losses(model(task.inputs(batch)), batch, with_aux=False).total.backward()
    assert counter.get_total_flops() == flops_per_token(model, seq_len=64) * 2 * 64


def test_init_is_deterministic_and_finite():
    cfg = to_config(compose_cfg(["model=tiny"]))
    task = build_task(cfg)
    a, b = build_model(cfg, task), build_model(cfg, task)
    materialize(a, device=torch.device("cpu"), seed=3)
    materialize(b, device=torch.device("cpu"), seed=3)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name


def test_sampler_shards_cover_every_sample_once_per_epoch():
    n, world = 103, 4
    seen = []
    for rank in range(world):
        it = iter(ShardedSampler(n, seed=7, rank=rank, world_size=world))
        seen += [next(it) for _ in range(n // world)]
    assert len(seen) == len(set(seen)) == (n // world) * world


def test_sampler_resumes_exactly():
    full = iter(ShardedSampler(50, seed=1))
    reference = [next(full) for _ in range(120)]  # crosses two epoch boundaries
    resumed = iter(ShardedSampler(50, seed=1, start=70))
    assert [next(resumed) for _ in range(50)] == reference[70:]


def test_synthetic_samples_are_addressable_and_structured():
    ds = SyntheticTokens(vocab_size=512, seq_len=64, seed=0, split="train", branching=4, noise=0.0,
                         num_samples=100)
    assert torch.equal(ds[5]["tokens"], ds[5]["tokens"])
    assert not torch.equal(ds[5]["tokens"], ds[6]["tokens"])
    tokens = ds[5]["tokens"]
    successors = torch.from_numpy(ds.successors)
    assert all(tokens[t + 1] in successors[tokens[t]] for t in range(64))


def test_math_attention_matches_sdpa():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    for causal in (True, False):
        torch.testing.assert_close(math_attention(q, k, v, causal), sdpa_attention(q, k, v, causal))
