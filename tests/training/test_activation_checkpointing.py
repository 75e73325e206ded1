"""Activation checkpointing: the identical loss, really recomputes, really saves memory."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from optbench.config import to_config
from optbench.distributed import detect_machine
from optbench.model.counts import count_matmul_params
from optbench.model.transformer import Transformer, math_attention
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training.build import materialize
from optbench.training.parallelize import parallelize
from tests.helpers import FAST, compose_cfg


def _train_losses(run):
    return [r["loss"] for r in read_metrics(run.run_dir) if r["kind"] == "train"]


def test_full_and_selective_give_the_identical_loss(tmp_path):
    runs = {
        mode: train(compose_cfg([*FAST, f"ac={mode}"]), run_dir=tmp_path / mode)
        for mode in ("none", "full", "selective")
    }
    assert all(run.status == "completed" for run in runs.values())
    assert _train_losses(runs["full"]) == _train_losses(runs["none"])
    assert _train_losses(runs["selective"]) == _train_losses(runs["none"])
    assert runs["full"].summary["applied"]["activation_checkpointing"] == {"mode": "full", "blocks": 4}
    assert runs["selective"].summary["applied"]["activation_checkpointing"] == {"mode": "selective", "blocks": 2}


def _counted_flops(overrides: list[str]) -> tuple[int, Transformer]:
    cfg = to_config(compose_cfg(["model=tiny", "train.seq_len=64", *overrides]))
    task = build_task(cfg)
    with torch.device("meta"):
        model = Transformer(cfg.model, embed=task.build_embed(), head=task.build_head(), causal=True,
                            max_seq_len=64, attention=math_attention)
    parallelize(model, cfg=cfg, machine=detect_machine("cpu"))
    materialize(model, device=torch.device("cpu"), seed=0)
    batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (2, 65))}
    with FlopCounterMode(display=False) as counter:
        task.losses(model(task.inputs(batch)), batch, with_aux=False).total.backward()
    return counter.get_total_flops(), model


def test_checkpointing_really_recomputes_the_forward():
    none, model = _counted_flops(["ac=none"])
    full, _ = _counted_flops(["ac=full"])
    selective, _ = _counted_flops(["ac=selective", "ac.every=2"])
    cfg = model.cfg
    tokens = 2 * 64
    # A block's forward is its matmuls plus attention scores and values. Non-reentrant checkpointing
    # stops recomputing once every saved tensor is back (torch's early stop), so the last matmul,
    # mlp.w2, whose output no backward needs, is not redone.
    block_forward = 2 * count_matmul_params(model.layers) // cfg.layers + 4 * cfg.dim * 64
    w2_forward = 2 * cfg.ffn_dim * cfg.dim
    recompute_per_block_token = block_forward - w2_forward
    assert full - none == recompute_per_block_token * cfg.layers * tokens
    assert selective - none == recompute_per_block_token * (cfg.layers // 2) * tokens


def test_checkpointing_lowers_measured_peak_memory(tmp_path):
    wide = [*FAST, "train.seq_len=256", "train.batch_size=8", "model.vocab_size=64", "train.steps=3",
            "train.eval_batches=0"]
    none = train(compose_cfg([*wide, "ac=none"]), run_dir=tmp_path / "none")
    full = train(compose_cfg([*wide, "ac=full"]), run_dir=tmp_path / "full")
    assert none.status == full.status == "completed"
    assert full.summary["memory"]["peak_bytes"] < 0.75 * none.summary["memory"]["peak_bytes"]
