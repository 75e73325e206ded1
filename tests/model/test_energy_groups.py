"""task=energy_flow under the groups that apply to every task: DDP over two gloo ranks, compile (the
vectorized flows; the loop is refused in one line), activation checkpointing (the flow processor is
the one block)."""

from __future__ import annotations

import pytest
import torch

from optbench.distributed import detect_machine
from optbench.model.energy_flow import flow_processor
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.training.build import materialize
from optbench.training.parallelize import parallelize
from tests.model.test_energy_flow import ENERGY, _batch, _built

# one micro-batch of 2 samples, 2 micro-steps a step: the curve DDP's 2 ranks x 2 samples must reproduce,
# and the eager, uncheckpointed curve of the vectorized flows (the defaults) that compile and ac=full must
# keep, so one run serves the three tests. 2 flow steps, not energy_tiny's 4: compiled with an empty
# Inductor cache, 27 C++ compiles instead of 34 (23 s instead of 28 here)
FIXED = [*ENERGY, "bridge=batched", "flow_stop=fixed", "train.eval_batches=0", "train.batch_size=2",
         "train.grad_accum=2", "model.max_steps=2"]


def _losses(run) -> list[float]:
    assert run.status == "completed", run.error
    return [r["loss"] for r in read_metrics(run.run_dir) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run of ``FIXED`` (flows=vectorized, compile=none, ac=none: the defaults)."""
    run = train(compose(FIXED), run_dir=tmp_path_factory.mktemp("energy") / "single")
    assert run.summary["applied"]["task"]["forms"]["flows"] == "vectorized"
    assert run.summary["applied"]["compile"]["blocks"] == 0
    assert run.summary["applied"]["activation_checkpointing"]["blocks"] == 0
    return run


def test_ddp_over_two_ranks_reproduces_the_single_process_curve(tmp_path, reference):
    """2 ranks x 2 samples see the same 4 samples per step as 1 process x 2 samples x 2 micro-steps;
    the flows per sample (max_active_flows over a micro-batch) are the same in both."""
    single = reference
    ddp = train(compose([*FIXED, "train.grad_accum=1", "parallel=ddp", "parallel.nproc_per_node=2"]),
                run_dir=tmp_path / "ddp")
    assert _losses(ddp) == pytest.approx(_losses(single), rel=1e-5) and len(_losses(single)) == 4
    assert ddp.summary["world_size"] == 2 and ddp.summary["applied"]["parallel"]["mode"] == "ddp"
    assert ddp.summary["applied"]["parallel"]["backend"] == "gloo"
    assert ddp.summary["throughput"]["tokens_per_step"] == single.summary["throughput"]["tokens_per_step"] == 4


def test_the_vectorized_flows_compile_and_match_eager(tmp_path, reference):
    compiled = train(compose([*FIXED, "flows=vectorized", "compile=default"]), run_dir=tmp_path / "compiled")
    assert _losses(compiled) == pytest.approx(_losses(reference), rel=1e-5, abs=1e-5)
    assert compiled.summary["applied"]["compile"]["blocks"] == 1


def test_checkpointing_the_flow_processor_gives_the_identical_loss_and_recomputes_it(tmp_path, reference):
    full = train(compose([*FIXED, "ac=full"]), run_dir=tmp_path / "full")
    assert _losses(full) == _losses(reference)  # ac=none
    assert full.summary["applied"]["activation_checkpointing"] == {"mode": "full", "blocks": 1}
    # backward runs the flows again under ac=full (a pre-hook: torch's early stop ends the recomputation
    # once every saved tensor is back, before the forward would return)
    for mode, forwards in (("none", 1), ("full", 2)):
        cfg, task, _ = _built(f"ac={mode}")
        model = _meta_parallelized(cfg, task)
        calls = []
        flow_processor(model).register_forward_pre_hook(lambda *args, seen=calls: seen.append(1))
        batch = _batch(task)
        task.losses(model(batch["input"]), batch, with_aux=False).total.backward()
        assert len(calls) == forwards, mode


def _meta_parallelized(cfg, task):
    from optbench.training.kinds import model_spec

    model = model_spec(cfg).build(cfg, task)
    parallelize(model, cfg=cfg, machine=detect_machine("cpu"))
    materialize(model, device=torch.device("cpu"), seed=0)
    return model


def compose(overrides: list[str]):
    from tests.helpers import compose_cfg

    return compose_cfg(overrides)
