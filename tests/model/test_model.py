"""The model: meta-device build, FLOPs formula cross-checked with FlopCounterMode, data sampler."""

from __future__ import annotations

import weakref

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


def test_sampler_resumes_exactly_across_its_chunks(monkeypatch):
    """Indices are handed out a chunk at a time: a stream resumed in the middle of a chunk, of an
    epoch and of a rank's shard is the uninterrupted stream's tail."""
    import optbench.data.sampler as sampler

    monkeypatch.setattr(sampler, "CHUNK", 7)
    for rank in (0, 2):
        full = iter(ShardedSampler(53, seed=3, rank=rank, world_size=3))
        reference = [next(full) for _ in range(60)]  # 17 a rank an epoch: three epoch boundaries
        for start in (0, 5, 7, 16, 17, 30):
            resumed = iter(ShardedSampler(53, seed=3, rank=rank, world_size=3, start=start))
            assert [next(resumed) for _ in range(60 - start)] == reference[start:], (rank, start)


def test_the_first_index_of_a_large_epoch_builds_no_list_of_the_epoch():
    """The first batch of a large corpus does not wait for a Python list of its whole epoch: of
    5,000,000 samples, the first 100 indices hold the epoch's order at 8 bytes an index (40 MB; a
    list of its ints would be 180 MB), and none of it in torch's allocator, whose trackers would
    count it as the memory of the step that draws them."""
    import tracemalloc

    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveStorages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.outputs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.outputs.append(weakref.ref(out))  # a view keeps its base alive (._base)
            return out

    tracemalloc.start()
    try:
        with LiveStorages() as made:
            stream = iter(ShardedSampler(5_000_000, seed=0))
            first = [next(stream) for _ in range(100)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 40_000_000 <= peak < 45_000_000, peak
    assert made.outputs and all(ref() is None for ref in made.outputs)  # torch's tensors all freed
    assert first == ShardedSampler(5_000_000, seed=0).epoch_indices(0)[:100].tolist()


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
