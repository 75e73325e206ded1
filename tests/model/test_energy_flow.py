"""The energy-flow model of plan 003: its optimized forms compute what its "before" forms compute
(the loop and the vectorized flow processor, the per-sample and the batched text bridge), adaptive
stopping stops, and task=energy_flow trains, records its flow steps, resumes exactly and is refused
in one line where an option cannot apply."""

from __future__ import annotations

import pytest
import torch

from optbench.config import to_config
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training.build import build_model, materialize
from tests.helpers import TEST_DEFAULTS, compose_cfg

ENERGY = ["model=energy_tiny", "task=energy_flow", "data=energy_synthetic", "data.num_samples=64", "train.device=cpu",
          "train.steps=4", "train.batch_size=4", "measure.warmup_steps=1", "train.eval_batches=1", "log.progress=log",
          "estimate.predict=false", "log.every=1", "estimate.search=false", *TEST_DEFAULTS]


def _built(*overrides: str):
    cfg = to_config(compose_cfg([*ENERGY, *overrides]))
    task = build_task(cfg)
    model = build_model(cfg, task)
    materialize(model, device=torch.device("cpu"), seed=cfg.train.seed)
    return cfg, task, model


def _batch(task, size: int = 4) -> dict:
    train_set, _ = task.build_datasets()
    return torch.utils.data.default_collate([train_set[i] for i in range(size)])


def _outputs_and_grads(*overrides: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    _, task, model = _built(*overrides)
    batch = _batch(task)
    outputs = model(batch["input"])
    task.losses(outputs, batch, with_aux=False).total.backward()
    return outputs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model.last_steps


def test_the_flow_loop_and_the_vectorized_flows_give_the_same_outputs_and_gradients():
    looped, loop_grads, _ = _outputs_and_grads("flows=loop")
    vectorized, grads, _ = _outputs_and_grads("flows=vectorized")
    torch.testing.assert_close(looped, vectorized, atol=1e-5, rtol=1e-5)
    assert loop_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert grad.abs().sum() > 0 or name.endswith("bias"), f"{name} got no gradient"
        torch.testing.assert_close(loop_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_the_per_sample_bridge_decodes_what_the_batched_bridge_decodes():
    _, task, model = _built("bridge=per_sample")
    batch = _batch(task)
    with torch.no_grad():
        batched = model(batch["input"])
        one_by_one = torch.cat([model(batch["input"][i:i + 1]) for i in range(4)])
    torch.testing.assert_close(one_by_one, batched, atol=1e-5, rtol=1e-5)
    task.augment(batch, step=0, micro=0)
    task.forward(model, batch)
    per_sample_hits = task.bridge_hits.clone()
    assert task.step_record()["bridge_forwards"] == 4  # the flow forward again, once per sample
    task.form.bridge = "batched"
    task.augment(batch, step=1, micro=0)
    task.forward(model, batch)
    assert torch.equal(task.bridge_hits, per_sample_hits) and task.step_record()["bridge_forwards"] == 0
    assert torch.equal(task.decode(batched), task.decode(one_by_one))


def test_adaptive_stopping_stops_once_the_flows_settle_and_fixed_runs_every_step():
    *_, fixed_steps = _outputs_and_grads("model.max_steps=12", "model.lattice_depth=40")
    assert fixed_steps == 12
    # every flow counts as settled when its energy turned by less than a cosine of -1: after patience steps
    *_, adaptive_steps = _outputs_and_grads("model.max_steps=12", "flow_stop=adaptive", "task.threshold=1e-9",
                                            "task.patience=2")
    assert adaptive_steps == 2


def test_energy_flow_trains_records_its_flow_steps_and_resumes_exactly(tmp_path):
    straight = train(compose_cfg([*ENERGY, "flow_stop=adaptive", "task.threshold=0.5", "checkpoint.every=2"]),
                     run_dir=tmp_path / "straight")
    assert straight.status == "completed", straight.error
    records = [r for r in read_metrics(tmp_path / "straight") if r["kind"] == "train"]
    used = [r["task"]["flow_steps"] for r in records]
    assert len(used) == 4 and all(len(steps) == 1 and 1 <= steps[0] <= 4 for steps in used)
    applied = straight.summary["applied"]["task"]
    assert applied["forms"]["stop"] == "adaptive" and applied["flow_steps"]["steps"] == 4
    assert applied["flow_steps"]["mean"] == pytest.approx(sum(s[0] for s in used) / 4)
    metrics = straight.summary["loss"]["eval_metrics"]
    assert -1 <= metrics["cosine"] <= 1 and 0 <= metrics["bridge_accuracy"] <= 1
    assert straight.summary["throughput"]["tokens_per_step"] == 4  # one sample, one "token"

    half = [*ENERGY, "flow_stop=adaptive", "task.threshold=0.5", "checkpoint.every=2"]
    assert train(compose_cfg([*half, "train.steps=2"]), run_dir=tmp_path / "resumed").status == "completed"
    resumed = train(compose_cfg(half), run_dir=tmp_path / "resumed")
    assert resumed.summary["applied"]["checkpoint"]["resumed_step"] == 2
    again = [(r["loss"], r["task"]) for r in read_metrics(tmp_path / "resumed") if r["kind"] == "train"]
    assert again == [(r["loss"], r["task"]) for r in records]


@pytest.mark.parametrize(("overrides", "names"), [
    (["model.max_active_flows=400"], ["model.max_active_flows=400", "lower model.max_active_flows to at most 144"]),
    (["model.max_active_flows=2"], ["leaves no flow", "train.batch_size=4"]),
    (["task=lm"], ["model=energy_tiny", "task=energy_flow"]),
    (["data=synthetic"], ["data=synthetic", "data=energy_synthetic"]),
    (["flows=loop", "compile=default"], ["compile=default", "flows=vectorized"]),
    (["loss_freq=every_4"], ["loss_freq=every_4", "loss_freq=every_step"]),
    (["attention=math"], ["attention=math", "attention=sdpa"]),
    (["data.load=device", "dataloader=tuned"], ["data.load=device", "data.load=memmap"]),
])
def test_options_that_cannot_apply_are_refused_in_one_line(tmp_path, overrides, names):
    result = train(compose_cfg([*ENERGY, *overrides]), run_dir=tmp_path)
    assert result.status == "incompatible" and result.exit_code == 2
    assert "\n" not in result.error and all(name in result.error for name in names), result.error


@pytest.mark.parametrize("value", ["nan", "inf", "0", "1.5"])
def test_a_threshold_that_is_not_a_finite_share_is_refused(value):
    from optbench.errors import ConfigError

    with pytest.raises(ConfigError, match=f"task.threshold must be a finite share in \\(0, 1\\], got {value}"):
        to_config(compose_cfg([*ENERGY, "flow_stop=adaptive", f"task.threshold={value}"]))


def test_a_sweep_of_the_plans_phases_reports_each_claim_beside_its_measured_factor(tmp_path, capsys):
    """`optbench train -m 'energy_phase=...'`: one report group, the phase table, and plan 003's
    claims beside each measured factor (the last phase against the baseline beside the 40x). Speed is
    what the claims are about: no memory tracking, 2 flow steps per forward (the tracker and the
    per-flow loop are what such a run spends its CPU on)."""
    import json

    from tests.helpers import run_cli_here

    overrides = [o for o in ENERGY if not o.startswith(("task=", "train.steps", "measure.warmup"))]
    result = run_cli_here("train", "-m", "energy_phase=0_baseline,1_bridge,3_vectorized", *overrides,
                          "train.steps=3", "measure.warmup_steps=1", "model.max_active_flows=16", "model.max_steps=2",
                          "measure.track_memory=false", f"hydra.sweep.dir={tmp_path}", capsys=capsys)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    data = json.loads((tmp_path / "report.json").read_text())
    (group,) = data["groups"]
    assert [row["phase"] for row in group["phases"]] == ["0_baseline", "1_bridge", "3_vectorized"]
    claims = group["plan_003_claims"]
    assert [(row["phase"], row["claim"]) for row in claims] == [
        ("0_baseline", None), ("1_bridge", 16.0), ("3_vectorized", 8.33 * 5.0), ("3_vectorized vs baseline", 40.0)]
    vectorized = next(row for row in group["phases"] if row["phase"] == "3_vectorized")
    assert claims[2]["speedup"] == pytest.approx(vectorized["vs_previous"]["speedup"])
    assert claims[2]["flow_steps"] is not None and claims[1]["flow_steps"] == 2  # fixed: max_steps every forward
    markdown = (tmp_path / "report.md").read_text()
    assert "plan 003 (energy-flow pipeline): the claims beside what was measured" in markdown
    assert "16x: batched text bridge" in markdown


@pytest.mark.parametrize("forms", [["flows=vectorized", "bridge=batched", "dataloader=baseline"],
                                   ["flows=loop", "bridge=per_sample", "data.load=memmap"],
                                   ["flows=loop", "bridge=none", "dataloader=baseline"]])
def test_the_estimate_is_the_measured_cpu_peak_for_every_form(tmp_path, forms):
    """The traced step against MemTracker's peak of a steady step (the second: AdamW's states exist
    through its backward, as the estimate's steady peak assumes), each form within 1%: the loop's
    per-flow tensors and the per-sample bridge's forwards are traced as they run, the bridge's bank
    is built in the traced step as in the run's first, and the whole dataset a run keeps on the
    device under data.load=device is counted (``Task.resident_bytes``). 3 flow steps of 16 flows: each
    flow step adds its tensors to the peak (the loop's: 118 kB at 3 steps, 152 kB at 6), so one the
    trace missed is far beyond 1%; tracing the loop costs seconds per flow step."""
    result = train(compose_cfg([*ENERGY, *forms, "model.max_steps=3", "model.max_active_flows=16", "train.steps=3",
                                "measure.warmup_steps=2", "train.eval_batches=0", "estimate.in_run=true"]),
                   run_dir=tmp_path)
    memory = result.summary["memory"]
    assert result.status == "completed", result.error
    assert "MemTracker" in memory["peak_source"] and "step 1" in memory["peak_source"]
    assert abs(memory["estimate_bytes"] - memory["peak_bytes"]) <= 0.01 * memory["peak_bytes"], memory


def test_the_estimate_traces_the_max_steps_bound_and_says_so_beside_the_plans_claim(tmp_path):
    """The traced peak of an adaptive run is its fixed run's (the bound), exact against the peak a
    fixed run measures on this CPU, and the plan's memory claim is printed beside it."""
    from optbench.estimate.api import estimate

    cfg = to_config(compose_cfg([*ENERGY, "flow_stop=adaptive", "model.name=energy_experiment"]))
    result = estimate(cfg)
    assert result["model"]["flops_per_token"] == _built()[2].flops_per_token(seq_len=1)
    assert any("max_steps=4 bound" in note for note in result["notes"])
    assert any("plan 003 claims ~222 MB" in note for note in result["notes"])
    fixed = to_config(compose_cfg(ENERGY))
    assert result["memory"]["traced"]["total"] == estimate(fixed)["memory"]["traced"]["total"]
