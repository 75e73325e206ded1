"""The stacked estimate (two or three short copies of the model traced, their blocks stacked) equals
the whole model's trace byte for byte, component for component, and says how it was made; cuBLAS's
workspaces are counted apart."""

from __future__ import annotations

import pytest

from optbench.config import to_config
from optbench.errors import ConfigError
from optbench.estimate.cuda_libs import parse_workspace_config, step_workspace_bytes
from optbench.estimate.stacking import (
    Event,
    NotStackable,
    Timeline,
    block_index,
    innermost,
    plan_for,
    rename,
    stack,
)
from optbench.estimate.tracer import stacking_plan, step_tracer, trace_step
from tests.helpers import compose_cfg

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")

SMALL = ["model=small", "model.layers=10", "train.seq_len=64"]  # copies of 2 and 3 blocks, the fewest that stack


def cfg_of(*overrides: str):
    return to_config(compose_cfg(list(overrides)))


@pytest.mark.parametrize(("overrides", "world_size", "how"), [
    (SMALL, 1, "stacked from traces of 2 and 3 blocks"),
    ([*SMALL, "precision=bf16", "ac=full", "train.grad_accum=3"], 1, "stacked"),
    (["model=small", "model.layers=34", "train.seq_len=32", "ac=selective", "ac.every=3"], 1,
     "stacked from traces of 7 and 10 blocks (one unit of 3 blocks repeated to 34 blocks)"),
    ([*SMALL, "parallel=ddp"], 2, "stacked"),
    ([*SMALL, "optimizer=muon"], 1, "stacked"),
    ([*SMALL, "optimizer=cpu_offload"], 1, "stacked"),
    ([*SMALL, "parallel=fsdp2"], 4, "stacked from traces of 2 and 3 blocks"),
    ([*SMALL, "parallel=fsdp2", "parallel.cpu_offload=true"], 2, "stacked"),
    ([*SMALL, "parallel=fsdp2", "precision=bf16", "ac=full", "train.grad_accum=2"], 8, "stacked"),
], ids=["fp32", "bf16-ac-accum3", "selective-every3", "ddp", "muon", "torchao-offload", "fsdp2",
        "fsdp2-cpu-offload", "fsdp2-bf16-ac-accum"])
def test_the_stacked_step_equals_the_whole_trace(overrides, world_size, how):
    cfg = cfg_of(*overrides)
    whole = trace_step(cfg, world_size=world_size, micro_batch=2, stacked=False)
    stacked = trace_step(cfg, world_size=world_size, micro_batch=2)
    assert how in stacked.method and whole.method == "the whole model traced"
    for part in ("before_step", "during_step"):
        w, s = getattr(whole, part), getattr(stacked, part)
        assert (w is None) == (s is None)
        if w is not None:
            assert (s.components, s.phase, s.module, s.host) == (w.components, w.phase, w.module, w.host)
    assert (stacked.state_bytes, stacked.extra) == (whole.state_bytes, whole.extra)
    assert stacked.steady_peak() == whole.steady_peak()
    if whole.before_step.host:
        assert stacked.host_peak() == whole.host_peak()


def test_every_micro_batch_of_a_search_is_stacked_alike():
    cfg = cfg_of(*SMALL, "precision=bf16")
    with step_tracer(cfg, world_size=1, stacked=False) as whole, step_tracer(cfg, world_size=1) as stacked:
        for micro_batch in (1, 3, 8):
            step = stacked(micro_batch)
            assert step.method.startswith("stacked from traces of 2 and 3 blocks")
            assert step.steady_peak() == whole(micro_batch).steady_peak()


def test_models_whose_blocks_differ_or_are_few_are_traced_whole():
    fused = cfg_of("task=climate_text", "fusion=gated", "model=small")
    assert stacking_plan(fused) is None
    with pytest.raises(ConfigError, match="cannot be stacked"):
        trace_step(fused, world_size=1, micro_batch=1, stacked=True)
    assert stacking_plan(cfg_of("model=small")) is None  # 6 blocks: copies of 2 and 3 would not pay
    assert plan_for(55, period=1).extra == 52 and plan_for(12, period=3) is None
    assert plan_for(34, period=3).la == 7 and plan_for(34, period=3).extra == 8  # 7 + 3 + 8 x 3 = 34


def test_the_estimate_says_it_stacked_and_matches_the_whole_trace():
    from optbench.config import compose
    from optbench.estimate.api import estimate

    # the predicted step is neither asserted here nor part of the memory trace (test_predict.py's); the
    # search traces more micro-batches the same way (test_every_micro_batch_of_a_search_is_stacked_alike)
    overrides = ["model=134m", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8", "train.seq_len=128",
                 "estimate.predict=false", "estimate.search=false"]
    results = [estimate(to_config(compose([*overrides, f"estimate.stacked={s}"], config_name="estimate")))
               for s in ("null", "false")]
    stacked, whole = results
    assert "stacked from traces of 2 and 3 blocks (one block repeated to 12 blocks)" in stacked["memory"]["method"]
    assert "the whole model traced" in whole["memory"]["method"]
    assert stacked["memory"]["traced"] == whole["memory"]["traced"]
    assert stacked["memory"]["peak_module"] == whole["memory"]["peak_module"]


def test_cublas_workspaces_follow_the_card_and_the_environment(caplog):
    assert step_workspace_bytes(9, env={}) == 2 * 32 * 2**20  # Hopper: two threads x :4096:8
    assert step_workspace_bytes(8, env={}) == 2 * (2 * 4096 + 8 * 16) * 1024  # torch's :4096:2:16:8
    assert step_workspace_bytes(9, env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 2 * 16 * 8 * 1024
    assert parse_workspace_config(":4096:2:16:8") == (4096 * 2 + 16 * 8) * 1024
    assert parse_workspace_config(":4096:8:16") == 4096 * 8 * 1024  # as torch: the pairs it holds
    # a value without a pair: torch warns and keeps its default, and so does the estimate
    assert step_workspace_bytes(9, env={"CUBLAS_WORKSPACE_CONFIG": ":4096"}) == 2 * 32 * 2**20
    assert "holds no ':SIZE_KIB:COUNT' pair" in caplog.text
    # an absurd value (bytes written where KiB are meant) is refused in one line, not printed as
    # "381469726562499968.00 GiB" in the estimate's table
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG=:400000000000000000:1 asks cuBLAS for"):
        step_workspace_bytes(9, env={"CUBLAS_WORKSPACE_CONFIG": ":400000000000000000:1"})


def test_an_estimate_counts_the_workspaces_of_the_named_card(monkeypatch):
    from optbench.config import compose
    from optbench.estimate.api import estimate

    def workspaces(*overrides: str) -> int:
        # the workspaces come from the card alone: one block, no micro-batch search, no predicted step to compute
        cfg = to_config(compose(["model=tiny", "model.layers=1", "train.seq_len=32", "estimate.search=false",
                                 "estimate.predict=false", *overrides], config_name="estimate"))
        return estimate(cfg)["memory"]["traced"]["cuda_workspaces"]

    assert workspaces("estimate.gpu=h200") == 64 * 2**20
    assert workspaces("estimate.gpu=a100") == 2 * (2 * 4096 + 8 * 16) * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1")
    assert workspaces("estimate.gpu=h100") == 2 * 4096 * 1024


# ------------------------------------------------------------------ the stacking arithmetic alone
def _toy_timeline(layers: int, *, grad: int, act: int, head: int, between: bool) -> Timeline:
    """A made-up step of ``layers`` alike blocks, as (parameters, gradients, activations) events:
    forward saves ``act`` per block (with a temporary), the head holds ``head`` for a moment,
    backward frees each block's activations and keeps its ``grad``; a per-parameter loop at the end
    (one event per block plus two). ``between``: an event outside every block between two blocks."""
    timeline, params, grads, acts = Timeline(), 100 * layers + 50, 0, 0

    def at(block: int | None, temp: int = 0) -> None:
        timeline.record(block, Event((params, grads, acts + temp), params + grads + acts + temp,
                                     ("backward" if grads else "forward", None if block is None else f"layers.{block}")))

    at(None)
    for block in range(layers):
        at(block, temp=3)
        acts += act
        at(block)
        if between and block < layers - 1:
            at(None)
    at(None, temp=head)
    for block in reversed(range(layers)):
        at(block, temp=5)
        grads, acts = grads + grad, acts - act
        at(block)
    for _ in range(layers + 2):
        at(None, temp=1)
    return timeline


@pytest.mark.parametrize(("grad", "act", "head", "between"), [
    (10, 40, 500, False),  # activations outweigh gradients: the peak is at the start of backward
    (60, 20, 500, True),  # gradients outweigh them: at 2-3 blocks the head, at 30 the end of backward
    (0, 0, 0, True),  # nothing grows but the parameters
])
def test_stacking_equals_the_whole_timeline_even_when_the_peak_moves(grad, act, head, between):
    plan = plan_for(30, period=1)
    short = [_toy_timeline(n, grad=grad, act=act, head=head, between=between) for n in (plan.la, plan.lb)]
    (peak,), approximate = stack(plan, *short)
    whole = max((event for _, event in _toy_timeline(30, grad=grad, act=act, head=head, between=between).parts[0]),
                key=lambda e: e.total)
    assert (peak.total, peak.components) == (whole.total, whole.components)
    assert approximate == 1  # the per-parameter loop, whose length differs between the copies
    if grad > act:  # the moment moved: a line through the short copies' peaks would be under
        peak_a, peak_b = (max(e.total for _, e in t.parts[0]) for t in short)
        assert peak_b + plan.extra * (peak_b - peak_a) < whole.total


def test_a_block_whose_ops_differ_between_the_copies_is_not_stacked():
    plan = plan_for(30, period=1)
    a, b = (_toy_timeline(n, grad=10, act=40, head=500, between=False) for n in (plan.la, plan.lb))
    b.parts[0].insert(3, (0, b.parts[0][2][1]))  # one more op in block 0 of the longer copy
    with pytest.raises(NotStackable, match="differ"):
        stack(plan, a, b)


def test_the_block_of_an_op_is_the_same_whatever_the_set_order():
    names = ["Transformer", "Transformer.layers.1", "Transformer.layers.0"]
    assert block_index(names) == block_index(list(reversed(names))) == 0  # backward: the lower is running
    # the lower block wins over a deeper module of the block finishing (a transformers block's attention
    # hands back its input's gradient after the next block's backward has started)
    assert block_index(["Transformer.layers.1.attn", "Transformer.layers.0"]) == 0
    assert block_index(["M.model.layers.1.self_attn", "M.model.layers.0.mlp.down_proj"]) == 0
    assert innermost({"M.model.layers.0", "M.model.layers.0.mlp"}) == "M.model.layers.0.mlp"  # then the deeper
    assert innermost({"Transformer.head", "Transformer"}) == "Transformer.head"
    event = Event((1,), 1, ("backward", "layers.3.attn"))
    assert rename(event, 10, at_least=2).where[1] == "layers.13.attn"
    assert rename(event, 10, at_least=4).where[1] == "layers.3.attn"


def test_the_same_estimate_whatever_the_hash_seed(tmp_path):
    """Found in review: with the block of an op picked from a set, this config stacked under one
    Python hash seed and fell back to an approximation 333,344 bytes under under the others. The
    command under a fixed seed against this process's own (another: random, or the other fixed one)."""
    import json
    import os

    from tests.helpers import run_cli

    args = ["estimate", "model=small", "train.seq_len=8", "model.layers=24", "parallel=fsdp2", "train.grad_accum=2",
            "optimizer=cpu_offload", "train.batch_size=1", "estimate.world_size=1", "estimate.search=false",
            "estimate.format=json"]
    seed = "9" if os.environ.get("PYTHONHASHSEED") == "0" else "0"
    done = run_cli(*args, cwd=tmp_path, env={"PYTHONHASHSEED": seed})
    assert done.returncode == 0, done.stderr
    from optbench.config import compose
    from optbench.estimate.api import estimate

    here = estimate(to_config(compose(args[1:], config_name="estimate")))["memory"]
    results = [json.loads(done.stdout)["memory"], json.loads(json.dumps(here))]
    assert results[0] == results[1]
    whole = estimate(to_config(compose([*args[1:], "estimate.stacked=false"], config_name="estimate")))["memory"]
    assert results[0]["traced"] == whole["traced"]
    assert "stacked from traces of 2 and 3 blocks" in results[0]["method"] and results[0]["peak_module"] == "head"
