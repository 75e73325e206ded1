"""Muon for the trunk's weight matrices, AdamW for everything else, stepped as one optimizer."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from optbench.config import MuonOptimizerConfig

log = logging.getLogger(__name__)


class OptimizerChain(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped and scheduled as one.

    ``param_groups`` are the inner optimizers' own group dicts, so an LR scheduler (or GradScaler's
    unscale) acting on the chain acts on the groups the inner optimizers really step; ``state`` is
    a live, read-only view over the inner states (``_ChainedState``; MemTracker reads it). Step
    hooks work as on any optimizer.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        params = [p for opt in optimizers.values() for g in opt.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.param_groups = [g for opt in optimizers.values() for g in opt.param_groups]
        self.state = _ChainedState([opt.state for opt in optimizers.values()])  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        assert closure is None, "OptimizerChain.step takes no closure"
        for opt in self.optimizers.values():
            opt.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])


class _ChainedState(Mapping):
    """The inner optimizers' states as one read-only mapping. Not a ``collections.ChainMap``: its
    lookup indexes each map in turn, and an optimizer's state is a ``defaultdict``, so looking up
    an AdamW parameter created an empty entry for it in Muon's state, which from then on hid
    AdamW's exp_avg/exp_avg_sq from every reader of ``state`` (MemTracker measured a Muon run's
    peak without them; a checkpoint's size left them out)."""

    def __init__(self, states: list[Mapping]) -> None:
        self.states = states

    def __getitem__(self, key: Any) -> Any:
        for state in self.states:
            if key in state:  # membership never creates an entry, unlike indexing a defaultdict
                return state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:  # the inner optimizers' parameters are disjoint
        for state in self.states:
            yield from state

    def __len__(self) -> int:
        return sum(1 for _ in self)


def is_trunk_matrix(name: str, param: nn.Parameter, *, blocks: str = "layers") -> bool:
    """A 2-D weight inside the decoder's blocks (``blocks``: the dotted path of their container,
    ``optbench.model.decoder``) or a fused model's ``layers`` blocks: attention and MLP projections
    (GPT-2's Conv1D weights too)."""
    return param.ndim == 2 and (name.startswith(blocks + ".") or "layers" in name.split("."))


def build_muon(model: nn.Module, *, cfg: MuonOptimizerConfig, lr: float) -> OptimizerChain:
    """torch.optim.Muon over the trunk's 2-D weights, torch.optim.AdamW over the rest (embeddings
    and head decayed, norms not). Both use ``lr`` and ``cfg.weight_decay``; Muon's update is
    scaled by ``cfg.adjust_lr_fn``."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    parts = getattr(model, "decoder_parts", None)
    blocks = parts.layers if parts is not None else "layers"
    matrices = [p for n, p in named if is_trunk_matrix(n, p, blocks=blocks)]
    rest = [(n, p) for n, p in named if not is_trunk_matrix(n, p, blocks=blocks)]
    muon = torch.optim.Muon(
        matrices, lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps, eps=1e-7, adjust_lr_fn=cfg.adjust_lr_fn,
    )
    fused = cfg.impl == "fused"
    adamw = torch.optim.AdamW(
        [
            {"params": [p for _, p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, foreach=not fused, fused=fused,
    )
    log.info(
        "Applied optimizer Muon (%d trunk matrices, adjust_lr_fn=%s) + AdamW %s (%d other tensors)",
        len(matrices), cfg.adjust_lr_fn, cfg.impl, len(rest),
    )
    return OptimizerChain({"muon": muon, "adamw": adamw})
