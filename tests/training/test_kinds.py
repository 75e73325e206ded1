"""The model registry (optbench.training.kinds): a kind defined and registered here, and nowhere else,
is built, parallelized, trained and traced by the estimate like the built-in ones."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from optbench.config import ModelConfig, to_config
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.training.kinds import (
    ModelSpec,
    kind_spec,
    model_spec,
    register_model,
    registered,
    unregister_model,
)
from tests.helpers import FAST, compose_cfg


@dataclass
class ToyConfig(ModelConfig):
    """A kind of its own: no decoder_parts, no attention, blocks under ``mixers``."""

    name: str = "toy"
    dim: int = 16
    layers: int = 3
    heads: int = 1
    ffn_dim: int = 32
    vocab_size: int = 64


class Mixer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Toy(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.mixers = nn.ModuleList(Mixer(cfg.dim, cfg.ffn_dim) for _ in range(cfg.layers))
        self.out = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens)
        for mixer in self.mixers:
            h = mixer(h)
        return self.out(h)

    @torch.no_grad()
    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.reset_parameters()


def build_toy(cfg, task) -> nn.Module:
    with torch.device("meta"):
        return Toy(cfg.model)


TOY = ModelSpec(kind="toy", config_type=ToyConfig, build=build_toy, block_groups=lambda m: {"mixers": m.mixers},
                flops_per_token=lambda m, seq_len: 6 * sum(p.numel() for p in m.mixers.parameters() if p.ndim == 2))


@pytest.fixture
def toy():
    register_model(TOY)
    yield TOY
    unregister_model("toy")


def toy_cfg(*overrides: str):
    return dataclasses.replace(to_config(compose_cfg([*FAST, *overrides])), model=ToyConfig())


def test_the_built_in_kinds_are_registered_by_their_config_class():
    assert {"transformer", "hf", "module"} <= set(registered())
    cfg = to_config(compose_cfg(["model=tiny"]))
    assert kind_spec(cfg.model).kind == "transformer" and model_spec(cfg).kind == "transformer"
    with pytest.raises(AssertionError, match="no model kind is registered for ToyConfig"):
        kind_spec(ToyConfig())


def test_a_registered_kind_trains_and_is_traced_through_its_spec(toy, tmp_path):
    losses = {}
    for ac in ("none", "full"):
        result = train(toy_cfg(f"ac={ac}", "log.every=1", "estimate.in_run=true"), run_dir=tmp_path / ac)
        assert result.status == "completed", result.error
        summary = result.summary
        losses[ac] = [r["loss"] for r in read_metrics(tmp_path / ac) if r["kind"] == "train"]
        toy_model = Toy(ToyConfig())
        assert summary["model"]["name"] == "toy"
        assert summary["model"]["params"] == sum(p.numel() for p in toy_model.parameters())
        assert summary["model"]["flops_per_token"] == 6 * 3 * 2 * 16 * 32
        assert summary["applied"]["activation_checkpointing"] == {"mode": ac, "blocks": 3 if ac == "full" else 0}
        assert summary["applied"]["attention"] == "unknown"
        assert summary["memory"]["estimate_bytes"] > 0  # the run's own estimate traced the toy's step
    assert losses["none"] == losses["full"] and len(losses["none"]) == 6  # checkpointed per mixer, same losses


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_the_estimate_shards_a_registered_kind_by_its_block_groups(toy):
    from optbench.estimate.api import count_model
    from optbench.estimate.tracer import trace_step

    cfg = toy_cfg("parallel=fsdp2", "train.batch_size=2")
    assert count_model(cfg).block_params == 2 * 16 * 32 + 32 + 16
    whole = trace_step(cfg, world_size=1, micro_batch=2, target="cpu").steady_peak()
    sharded = trace_step(cfg, world_size=2, micro_batch=2, target="cpu").steady_peak()
    # every mixer and the root sharded over 2 ranks: half the parameters and gradients each
    assert sharded.components["parameters"] * 2 == whole.components["parameters"]
    assert sharded.components["gradients"] * 2 == whole.components["gradients"]
