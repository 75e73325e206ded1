"""Building on the meta device (optbench.model.meta.on_meta): the initializers skipped there
change nothing the run sees, and building no longer imports torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from optbench.model.meta import on_meta
from optbench.training.build import build_model, materialize
from tests.helpers import compose_cfg


def test_the_model_built_without_meta_initializers_is_the_same_model():
    from optbench.config import to_config
    from optbench.tasks import build_task

    cfg = to_config(compose_cfg(["model=tiny"]))
    task = build_task(cfg)
    skipped = build_model(cfg, task)
    materialize(skipped, device=torch.device("cpu"), seed=3)
    with torch.device("meta"):  # what on_meta replaces: every initializer run on meta tensors
        from optbench.model.transformer import Transformer

        plain = Transformer(cfg.model, embed=task.build_embed(), head=task.build_head(), causal=task.causal,
                            max_seq_len=task.tokens_per_sample(), attention=None)
    materialize(plain, device=torch.device("cpu"), seed=3)
    a, b = skipped.state_dict(), plain.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_only_meta_tensors_are_skipped():
    torch.manual_seed(0)
    expected = nn.Linear(4, 3)
    torch.manual_seed(0)
    with on_meta():
        real = nn.Linear(4, 3, device="cpu")  # a real tensor made inside: initialized as usual
        meta = nn.Linear(4, 3)
        nn.init.trunc_normal_(tensor=meta.weight, std=0.02)
        meta.bias.normal_()
    assert torch.equal(real.weight, expected.weight) and torch.equal(real.bias, expected.bias)
    assert meta.weight.is_meta and meta.weight.shape == (3, 4) and meta.bias.is_meta


def test_building_on_meta_does_not_import_dynamo():
    code = ("import sys, torch; from torch import nn; from optbench.model.meta import on_meta\n"
            "with on_meta():\n"
            "    nn.Embedding(10, 4); nn.Linear(4, 4); nn.LayerNorm(4); nn.init.normal_(nn.Linear(2, 2).weight)\n"
            "assert 'torch._dynamo' not in sys.modules, 'imported'\n"
            "with torch.device('meta'):\n"
            "    nn.Embedding(10, 4)\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"  # the check can fail: a plain meta build does import it
