"""The stacked estimate (two or three short copies of the model traced, their blocks stacked) equals
the whole model's trace byte for byte, component for component, and says how it was made; cuBLAS's
workspaces are counted apart."""

from __future__ import annotations

import pytest

from optbench.config import to_config
from optbench.cuda_libs import parse_workspace_config, step_workspace_bytes
from optbench.errors import ConfigError
from optbench.stacking import plan_for
from optbench.tracer import stacking_plan, step_tracer, trace_step
from tests.conftest import compose_cfg

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")

SMALL = ["model=small", "train.seq_len=64"]  # 6 blocks: copies of 2 and 3 (and 4, 5)


def cfg_of(*overrides: str):
    return to_config(compose_cfg(list(overrides)))


@pytest.mark.parametrize(("overrides", "world_size", "how"), [
    (SMALL, 1, "stacked from traces of 2 and 3 blocks"),
    ([*SMALL, "precision=bf16", "checkpointing=full", "train.grad_accum=3"], 1, "stacked"),
    (["model=base", "model.layers=25", "train.seq_len=32", "checkpointing=selective", "checkpointing.every=3"], 1,
     "stacked from traces of 7 and 10 blocks (one unit of 3 blocks repeated to 25 blocks)"),
    ([*SMALL, "parallel=ddp"], 2, "stacked"),
    ([*SMALL, "optimizer=muon"], 1, "stacked"),
    ([*SMALL, "optimizer=cpu_offload"], 1, "stacked"),
    # FSDP2's backward hooks land in one block or the next depending on the block count: the peaks of
    # 3, 4 and 5 blocks, which lie on a line, are extrapolated instead
    ([*SMALL, "parallel=fsdp2"], 4, "the peaks of 3, 4 and 5 blocks extrapolated to 6"),
    ([*SMALL, "parallel=fsdp2", "parallel.cpu_offload=true"], 2, "the peaks of"),
    ([*SMALL, "parallel=fsdp2", "precision=bf16", "checkpointing=full", "train.grad_accum=2"], 8, "stacked"),
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
            assert stacked(micro_batch).steady_peak() == whole(micro_batch).steady_peak()


def test_models_whose_blocks_differ_or_are_few_are_traced_whole():
    fused = cfg_of("task=climate_text", "fusion=gated", "model=small")
    assert stacking_plan(fused) is None
    with pytest.raises(ConfigError, match="cannot be stacked"):
        trace_step(fused, world_size=1, micro_batch=1, stacked=True)
    assert stacking_plan(cfg_of("model=tiny")) is None  # 4 blocks: copies of 2 and 3 would not save
    assert plan_for(55, period=1).extra == 52 and plan_for(12, period=3) is None
    assert plan_for(25, period=3).la == 7 and plan_for(25, period=3).extra == 5  # 7 + 3 + 5 x 3 = 25


def test_the_estimate_says_it_stacked_and_matches_the_whole_trace():
    from optbench.config import compose
    from optbench.estimate import estimate

    overrides = ["model=base", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8", "train.seq_len=128"]
    results = [estimate(to_config(compose([*overrides, f"estimate.stacked={s}"], config_name="estimate")))
               for s in ("null", "false")]
    stacked, whole = results
    assert "extrapolated to 12" in stacked["memory"]["method"] or "stacked from" in stacked["memory"]["method"]
    assert "the whole model traced" in whole["memory"]["method"]
    assert stacked["memory"]["traced"] == whole["memory"]["traced"]
    assert stacked["micro_batch_search"] == whole["micro_batch_search"]


def test_cublas_workspaces_follow_the_card_and_the_environment():
    assert step_workspace_bytes(9, env={}) == 2 * 32 * 2**20  # Hopper: two threads x :4096:8
    assert step_workspace_bytes(8, env={}) == 2 * (2 * 4096 + 8 * 16) * 1024  # torch's :4096:2:16:8
    assert step_workspace_bytes(9, env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 2 * 16 * 8 * 1024
    assert parse_workspace_config(":4096:2:16:8") == (4096 * 2 + 16 * 8) * 1024
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG"):
        parse_workspace_config(":4096")


def test_an_estimate_counts_the_workspaces_of_the_named_card(monkeypatch):
    from optbench.config import compose
    from optbench.estimate import estimate

    def workspaces(*overrides: str) -> int:
        cfg = to_config(compose(["model=tiny", "train.seq_len=32", *overrides], config_name="estimate"))
        return estimate(cfg)["memory"]["traced"]["cuda_workspaces"]

    assert workspaces("estimate.gpu=h200") == 64 * 2**20
    assert workspaces("estimate.gpu=a100") == 2 * (2 * 4096 + 8 * 16) * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1")
    assert workspaces("estimate.gpu=h100") == 2 * 4096 * 1024


def test_a_malformed_cublas_workspace_config_is_one_line_and_exit_2(tmp_path):
    from tests.conftest import run_cli

    done = run_cli("estimate", "model=tiny", "estimate.search=false", cwd=tmp_path,
                   env={"CUBLAS_WORKSPACE_CONFIG": ":4096"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "CUBLAS_WORKSPACE_CONFIG=':4096'" in done.stderr
    assert "Traceback" not in done.stderr
