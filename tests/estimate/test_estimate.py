"""optbench estimate: exact counts, the FLOPs cross-check, the FakeTensor trace against real-tensor
measurements (single device and FSDP2), sharding, DDP buckets, CPU offload, the train hook, bad input."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optbench.config import to_config
from optbench.errors import ConfigError
from optbench.estimate.api import (
    GIB,
    closed_form,
    count_model,
    estimate,
    resolve_world_size,
)
from optbench.estimate.fake import fake_mesh
from optbench.estimate.fit import largest_micro_batch
from optbench.estimate.format import render
from optbench.estimate.memtrace import COMPONENTS, NotTraceable
from optbench.estimate.tracer import step_tracer, trace_step
from optbench.outputs import read_metrics
from optbench.run.train import train
from optbench.tasks import build_task
from optbench.training.build import build_model
from tests.helpers import FAST, compose_cfg, read_summary, run_cli_here

TINY = ["model=tiny", "train.batch_size=2", "train.seq_len=32"]


def cfg_of(*overrides: str):
    return to_config(compose_cfg(list(overrides)))


def expected_params(dim: int, layers: int, ffn: int, vocab: int) -> int:
    """Embedding + untied head + per block (q, k, v, o, two MLP matrices, two norms) + final norm."""
    return 2 * vocab * dim + layers * (4 * dim * dim + 2 * dim * ffn + 2 * dim) + dim


@pytest.mark.parametrize(
    ("preset", "shape", "count"),
    [
        ("tiny", (128, 4, 512, 1024), 1_049_728),
        ("small", (256, 6, 1024, 8192), 8_916_224),
        ("134m", (768, 12, 3072, 32000), 134_105_856),
        ("1b", (2048, 18, 8192, 32000), 1_037_117_440),
        ("9.9b", (4096, 48, 16384, 32000), 9_926_217_728),
        ("13.1b", (4400, 55, 17600, 32000), 13_059_688_400),
    ],
)
def test_counts_are_exact(preset, shape, count):
    counts = count_model(cfg_of(f"model={preset}"))
    assert counts.params == expected_params(*shape) == count
    dim, layers, ffn, vocab = shape
    assert counts.matmul_params == layers * (4 * dim * dim + 2 * dim * ffn) + dim * vocab
    assert counts.flops_per_token == 6 * counts.matmul_params + 12 * layers * dim * 256


def test_estimate_flops_match_flop_counter():
    """The FLOPs/token the estimate reports is what a real forward+backward of that config does
    (math attention: FlopCounterMode has no formula for the CPU flash kernel)."""
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize

    cfg = cfg_of(*TINY, "attention=math")
    task = build_task(cfg)
    model = build_model(cfg, task)
    materialize(model, device=torch.device("cpu"), seed=0)
    batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (2, 33))}
    with FlopCounterMode(display=False) as counter:
        task.losses(model(task.inputs(batch)), batch, with_aux=False).total.backward()
    assert counter.get_total_flops() == count_model(cfg).flops_per_token * 2 * 32


def _within(memory: dict, fraction: float) -> bool:
    return abs(memory["estimate_bytes"] - memory["peak_bytes"]) <= fraction * memory["peak_bytes"]


def test_train_records_an_estimate_that_changes_nothing(tmp_path):
    """summary.json carries the FakeTensor trace of the run's own config beside MemTracker's
    measurement on the run's real tensors (within 10%); tracing before the loop leaves the RNG and
    everything else alone: the losses are identical to a run without it (estimate.in_run=false)."""
    config = [*FAST, "train.grad_accum=2"]  # the 2nd micro-batch runs with all gradients allocated
    with_estimate = train(compose_cfg([*config, "estimate.in_run=true"]), run_dir=tmp_path / "with")
    memory = with_estimate.summary["memory"]
    assert with_estimate.status == "completed"
    assert memory["estimate_bytes"] is not None and _within(memory, 0.10)
    without = train(compose_cfg([*config, "estimate.in_run=false"]), run_dir=tmp_path / "without")
    assert without.summary["memory"]["estimate_bytes"] is None and without.summary["predicted"] is None
    losses = [[r["loss"] for r in read_metrics(run.run_dir) if r["kind"] == "train"] for run in (with_estimate, without)]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_a_compiled_checkpointed_run_is_estimated_within_2_percent_of_its_measured_peak(tmp_path):
    """compile= with full checkpointing: the peak is inside a block's compiled backward, where
    Inductor's kernels read fused values' inputs late (the add before a norm is recomputed in the
    norm's backward kernel, so the matmul output it adds lives until then). The estimate held them
    only to the fused node's place in the graph: 6.0% under the measured peak at 8 x 128 tokens
    (profiler memory events); holding them to the fused node's last use: within 1%; with the
    kernels' order and their in-place results (the GELU gradient over its matmul): exact."""
    result = train(compose_cfg([*FAST, "train.batch_size=8", "train.seq_len=128", "compile=default", "ac=full",
                                "train.steps=3", "measure.warmup_steps=2", "train.eval_batches=0",
                                "estimate.in_run=true"]),
                   run_dir=tmp_path)
    memory = result.summary["memory"]
    assert result.status == "completed", result.error
    assert "profile_memory" in memory["peak_source"] and _within(memory, 0.02), memory


def test_fsdp2_run_on_two_ranks_records_its_estimate_and_trains_after_it(bf16_fsdp2_cli):
    """Two gloo workers (bf16 FSDP2, the run tests/training/test_parallel.py checks from the command
    line): each traces the run's FSDP2 step on a fake subgroup before training; the real run then
    trains (DTensor's plans cached for the fake mesh are forgotten, or its gradient norm would
    all-reduce over the destroyed fake group) and measures its peak with FSDPMemTracker."""
    run_dir, _ = bf16_fsdp2_cli
    summary = read_summary(run_dir)
    memory = summary["memory"]
    assert summary["status"] == "completed", summary["error"]
    assert "FSDPMemTracker" in memory["peak_source"] and _within(memory, 0.10)


def _real_fsdp_peak(cfg, *, world_size: int) -> int:
    """Two real training steps of FSDP2 on real tensors, parallelized by training's own
    ``parallelize`` (a fake process group: no communication), measured by torch's FSDPMemTracker;
    the peak covers the second, steady-state step."""

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from optbench.distributed import Machine
    from optbench.optim.optimizers import build_optimizer
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize
    from optbench.training.parallelize import parallelize
    from optbench.training.precision import maybe_autocast

    cpu = torch.device("cpu")
    with fake_mesh(world_size):
        task = build_task(cfg)
        model = build_model(cfg, task)
        parallelize(model, cfg=cfg, machine=Machine(device=cpu, cuda_available=False, cuda_devices=0,
                                                     cpu_threads=torch.get_num_threads(), world_size=world_size))
        materialize(model, device=cpu, seed=0)
        optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=1e-3)
        batch = {"tokens": torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1))}
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batch["tokens"],))
        with tracker:
            for step in range(2):
                with maybe_autocast(cfg.precision, device=cpu):  # as train_step: outputs live to the end
                    outputs = model(task.inputs(batch))
                    losses = task.losses(outputs, batch, with_aux=True)
                losses.total.backward()
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del outputs, losses
                if step == 0:
                    tracker.reset_mod_stats()
        return tracker.get_tracker_snapshot("peak")[cpu]["Total"]


@pytest.mark.filterwarnings("ignore:DTensor random operators")
@pytest.mark.parametrize("overrides", [["precision=fp32"], ["precision=bf16", "ac=full"]])
def test_fsdp2_trace_matches_real_tensors_on_a_fake_process_group(overrides):
    """The FakeTensor trace (one step, steady state derived, optimizer on the local shards) equals
    two real steps of FSDP2 measured by torch's FSDPMemTracker, within 2%."""
    cfg = cfg_of(*TINY, "parallel=fsdp2", *overrides)
    traced = trace_step(cfg, world_size=2, micro_batch=2, target="cpu").steady_peak().total
    real = _real_fsdp_peak(cfg, world_size=2)
    assert abs(traced - real) <= 0.02 * real, (traced, real)


@pytest.fixture(scope="module")
def tiny_steps() -> dict:
    """TINY's step traced at micro-batch 2 for a GPU, on one device without parallelism (``None``)
    and with FSDP2 over 1, 2 and 4 ranks, once for the tests that compare them (each only reads)."""
    fsdp2 = cfg_of(*TINY, "parallel=fsdp2")
    steps = {w: trace_step(fsdp2, world_size=w, micro_batch=2) for w in (1, 2, 4)}
    return {**steps, None: trace_step(cfg_of(*TINY), world_size=1, micro_batch=2)}


def test_fsdp2_divides_parameters_gradients_and_optimizer_states_by_the_world_size(tiny_steps):
    cfg = cfg_of(*TINY, "parallel=fsdp2")
    during = {w: tiny_steps[w].during_step.components for w in (1, 2, 4)}
    single = tiny_steps[None].during_step.components
    params, tensors = count_model(cfg).params, 4 * 8 + 3
    for world in (1, 2, 4):
        assert during[world]["parameters"] == during[world]["gradients"] == 4 * params // world
        # exp_avg and exp_avg_sq are sharded; AdamW's step counter is one fp32 scalar per tensor
        assert during[world]["optimizer_states"] == 8 * params // world + 4 * tensors
    for key in ("parameters", "gradients", "optimizer_states"):
        assert during[1][key] == single[key]
    counts = count_model(cfg)
    forms = {w: closed_form(cfg, counts=counts, world_size=w, micro_batch=2)["components"] for w in (1, 4)}
    for key in ("parameters", "gradients", "optimizer_states"):
        assert forms[4][key] * 4 == forms[1][key]
        assert forms[1][key] == {"parameters": 4, "gradients": 4, "optimizer_states": 8}[key] * counts.params


def test_ddp_adds_a_second_copy_of_the_gradients_and_cpu_offload_moves_states_to_the_host(tiny_steps):
    single = tiny_steps[None]
    ddp = trace_step(cfg_of(*TINY, "parallel=ddp"), world_size=2, micro_batch=2)
    grads = 4 * count_model(cfg_of(*TINY)).params
    assert ddp.extra["ddp_buckets"] == grads
    assert ddp.steady_peak().total == single.steady_peak().total + grads

    # every tensor on the host: no optimizer step on the device at all
    offload = cfg_of(*TINY, "optimizer=cpu_offload", "optimizer.minimal_size=1")
    traced = trace_step(offload, world_size=1, micro_batch=2)
    assert traced.during_step is None and traced.state_bytes == 0
    assert traced.steady_peak().components["optimizer_states"] == 0
    assert traced.steady_peak().total < single.steady_peak().total
    form = closed_form(offload, counts=count_model(offload), world_size=1, micro_batch=2)
    assert form["host_bytes"] == 16 * count_model(offload).params

    # torchao's default: tensors under minimal_size elements keep an AdamW (two fp32 states) on the device
    small = cfg_of(*TINY, "optimizer=cpu_offload")
    model = build_model(small, build_task(small))
    kept = [p.numel() for p in model.parameters() if p.numel() < small.optimizer.minimal_size]
    assert 0 < sum(kept) < count_model(small).params
    traced = trace_step(small, world_size=1, micro_batch=2)
    assert traced.state_bytes == 8 * sum(kept) + 4 * len(kept)  # exp_avg, exp_avg_sq and a step counter each


def test_fsdp2_cpu_offload_policy_moves_shards_and_states_off_the_device(tiny_steps):
    plain = tiny_steps[2]  # FSDP2 over 2 ranks
    offload_cfg = cfg_of(*TINY, "parallel=fsdp2", "parallel.cpu_offload=true")
    offload = trace_step(offload_cfg, world_size=2, micro_batch=2)
    shard = 4 * count_model(offload_cfg).params // 2
    assert plain.host_peak() == 0
    # on the host in the step: parameter and gradient shards plus AdamW's two states (and step counters)
    assert offload.host_peak() >= 4 * shard
    assert offload.host_peak() - 4 * shard < 0.01 * shard
    assert offload.steady_peak().total < plain.steady_peak().total - shard
    form = closed_form(offload_cfg, counts=count_model(offload_cfg), world_size=2, micro_batch=2)
    assert form["host_bytes"] == pytest.approx(offload.host_peak(), rel=0.01)
    assert form["components"]["parameters"] == form["components"]["optimizer_states"] == 0


def test_a_config_launch_would_refuse_says_so_beside_its_memory():
    """The estimate traces memory for any config, but one that `optbench train` would refuse on the
    described GPUs must not read as a plan: torchao's offload is single-GPU, and refuses clipping."""
    refused = estimate(cfg_of(*TINY, "parallel=ddp", "optimizer=cpu_offload", "estimate.world_size=8",
                              "estimate.search=false"))
    assert any("cannot run with parallel=ddp" in r for r in refused["launch_blockers"])
    assert any("train.clip_grad=null" in r for r in refused["launch_blockers"])
    assert "refused at launch" in render(refused, fmt="markdown")
    assert "refused      at launch on 8 GPU(s)" in render(refused, fmt="table")
    runnable = estimate(cfg_of(*TINY, "parallel=fsdp2", "parallel.cpu_offload=true", "estimate.world_size=8",
                               "estimate.search=false"))
    assert runnable["launch_blockers"] == []
    assert "refused" not in render(runnable, fmt="markdown") + render(runnable, fmt="table")


def test_host_shards_larger_than_the_device_peak_do_not_hide_it():
    """Many thin blocks under CPUOffloadPolicy: far more bytes of sharded parameters on the host than
    the device ever holds. The device peak is still found, in backward, with a gathered block."""
    cfg = cfg_of("model=tiny", "model.layers=32", "ac=full", "train.seq_len=16", "train.batch_size=1",
                 "parallel=fsdp2", "parallel.cpu_offload=true")
    peak = trace_step(cfg, world_size=2, micro_batch=1).before_step
    assert peak.components["parameters"] > 2 * peak.total  # host shards, left out of the device total
    assert peak.phase == "backward" and peak.components["fsdp_buffers"] > 0
    assert peak.total == sum(v for k, v in peak.components.items() if k not in peak.host)


def test_gpu_target_keeps_what_cuda_rms_norm_keeps_also_under_checkpointing():
    """A CPU decomposes RMSNorm and keeps its fp32 normalized tensor for backward; CUDA's fused kernel
    keeps only input and rstd. The GPU estimate follows CUDA, checkpoint recomputation included."""
    peaks = {}
    for ac in ("none", "full"):
        cfg = cfg_of("model=tiny", "train.seq_len=256", f"ac={ac}")
        for target in ("cuda", "cpu"):
            peaks[ac, target] = trace_step(cfg, world_size=1, micro_batch=4, target=target).before_step
    norms, normalized = 2 * 4 + 1, 4 * 4 * 256 * 128  # fp32 (batch, seq, dim) per norm
    kept = {ac: peaks[ac, "cpu"].components["activations"] - peaks[ac, "cuda"].components["activations"]
            for ac in ("none", "full")}
    assert kept["none"] == norms * normalized
    assert 0 < kept["full"] < kept["none"]


def test_13b_fsdp2_on_8_ranks_shards_and_traces():
    """The 13.1b shape on 8 fake ranks (2 of its 55 layers, to keep the suite fast)."""
    cfg = cfg_of("model=13.1b", "model.layers=2", "precision=bf16", "parallel=fsdp2", "train.batch_size=1",
                 "train.seq_len=128")
    traced = trace_step(cfg, world_size=8, micro_batch=1)
    params = count_model(cfg).params
    assert traced.during_step.components["parameters"] == pytest.approx(4 * params / 8, rel=1e-3)
    assert traced.state_bytes == pytest.approx(8 * params / 8, rel=1e-3)
    assert traced.steady_peak().components["fsdp_buffers"] > 0


@pytest.fixture(scope="module")
def tiny_result():
    # seq 128: the peak grows ~7 MB per sample; 0.11914 GiB (90% usable, less H100's two 32 MiB cuBLAS
    # workspaces) fits 5 samples, not 6
    return estimate(cfg_of("model=tiny", "train.batch_size=2", "train.seq_len=128", "estimate.device_gb=0.11914"))


def test_estimate_reports_verdict_search_and_throughput(tiny_result):
    result = tiny_result
    assert result["model"]["params"] == 1_049_728
    traced = result["memory"]["traced"]
    assert traced["total"] == sum(traced[k] for k in COMPONENTS)
    assert result["device"]["capacity_bytes"] == int(0.11914 * GIB)
    assert result["device"]["verdict"] == "fits"
    assert traced["cuda_workspaces"] == 2 * 32 * 2**20  # measured on an H200 (bench/RESULTS.md)
    search = result["micro_batch_search"]
    assert search["exact"] and search["max_micro_batch"] == 5 and search["bytes_per_sample"] > 0
    assert list(search["traced_peaks"]) == ["2", "6"]  # one probe, just past where the first trace put the answer
    budget = result["device"]["usable_bytes"]
    with step_tracer(cfg_of("model=tiny", "train.seq_len=128"), world_size=1, workspaces=2 * 32 * 2**20) as trace:
        assert trace(5).steady_peak().total <= budget < trace(6).steady_peak().total
    tp = result["throughput"]
    assert tp["peak_source"] == "datasheet H100 SXM dense float32"
    assert tp["tokens_per_s_per_gpu"] == pytest.approx(0.4 * 66.9e12 / result["model"]["flops_per_token"])
    assert "peak" in render(result, fmt="table")
    assert render(result, fmt="markdown").count("\n") == 2
    assert json.loads(render(result, fmt="json"))["model"]["params"] == 1_049_728


def test_the_first_line_names_the_device_assumed_and_how_to_choose_and_a_stopped_search_says_why(tiny_result):
    """Issue 47 item 5: on a CPU the estimate silently targeted an H100 and printed `512 to 4174 (search
    stopped)` unexplained."""
    first = render(tiny_result, fmt="table").splitlines()[0]
    assert first.startswith("optbench estimate for an H100 SXM of 0.1191 GiB (estimate.gpu=h100, the default, with "
                            "estimate.device_gb=0.11914; not this machine")
    assert "choose estimate.gpu=a100|h200, or none to predict on this machine)" in first
    assert first.endswith(": tiny precision=fp32 parallel=single x 1 ac=none optimizer=adamw, micro-batch 2 x 128 tokens")
    stopped = {**tiny_result, "micro_batch_search": {**tiny_result["micro_batch_search"], "exact": False,
                                                     "upper_bound": 40}}
    line = next(x for x in render(stopped, fmt="table").splitlines() if "micro-batch  largest" in x)
    traces = len(tiny_result["micro_batch_search"]["traced_peaks"])
    assert f"largest that fits: 5 to 40 (search stopped: 5 surely fits, 40 is the most the traced peaks allow; the " \
           f"search stops after {traces} traces, so the answer lies between)" in line
    gpu_none = {**tiny_result, "device": None, "micro_batch_search": None}
    assert render(gpu_none, fmt="table").startswith("optbench estimate for no named GPU (estimate.gpu=none)")


@dataclass
class _Peak:
    total: int
    components: dict = field(default_factory=dict)  # none: the search's first probe doubles
    phase: str = "backward"


@dataclass
class _Step:
    micro_batch: int
    total: int
    growing: int = 0  # of total, the bytes at the peak that grow with the samples

    def steady_peak(self) -> _Peak:
        return _Peak(self.total, {"activations": self.growing} if self.growing else {})

    @property
    def activation_peak(self) -> int:
        return self.growing or self.total


@pytest.mark.parametrize("budget", [1_000, 1_036, 1_037, 5_000, 123_456])
def test_the_first_probe_just_past_where_the_first_peak_puts_the_answer_settles_an_affine_peak(budget):
    """A peak affine in the micro-batch (1,000 fixed bytes, 37 per sample): the first trace's split
    puts the answer where it is, and one probe just past it settles it (exact) when the first trace
    fits (doubling took two), two when it does not. Where the split misleads (a steeper piece takes
    over past the first trace), the answer is still exact: the probe only chooses where to look."""
    def affine(micro_batch: int) -> _Step:
        return _Step(micro_batch, 1_000 + 37 * micro_batch, growing=37 * micro_batch)

    truth = max(b for b in range(0, 10_000) if b == 0 or affine(b).total <= budget)
    for first in (1, 8, 64):
        calls = []
        result = largest_micro_batch(lambda b, calls=calls: calls.append(b) or affine(b), first=affine(first),
                                     budget=budget)
        assert result["exact"] and result["max_micro_batch"] == truth, (first, calls)
        # from below, the probe one past the answer does not fit and the chord from the first ends one
        # below it; from above, the answer needs a trace that fits and one past it
        assert len(calls) <= (1 if affine(first).total <= budget else 2), (first, calls)

    def kinked(micro_batch: int) -> _Step:  # the first trace sees only the flatter piece
        flat, steep = 1_000 + 37 * micro_batch, 100 * micro_batch - 600
        return _Step(micro_batch, flat, growing=37 * micro_batch) if flat >= steep else \
            _Step(micro_batch, steep, growing=100 * micro_batch)

    truth = max(b for b in range(0, 10_000) if b == 0 or kinked(b).total <= budget)
    result = largest_micro_batch(kinked, first=kinked(2), budget=budget, max_traces=8)
    assert result["exact"] and result["max_micro_batch"] == truth


def test_a_peak_late_in_the_backward_does_not_send_the_first_probe_past_the_forward_s_peak():
    """The step's peak at micro-batch 2 is at the end of the backward (5,000 bytes of gradients, 1
    byte per sample of what is still held); the forward holds 37 per sample and overtakes it at 112
    samples. Read at the step's peak alone, the growth would put the probe past 1,000 samples, 7
    times the answer: the activation peak's growth puts it below the answer."""
    class _Late(_Step):
        @property
        def activation_peak(self) -> int:
            return 37 * self.micro_batch

    def late(micro_batch: int) -> _Step:
        backward, forward = 5_000 + micro_batch, 1_000 + 37 * micro_batch
        return _Late(micro_batch, max(backward, forward),
                     growing=micro_batch if backward >= forward else 37 * micro_batch)

    truth = max(b for b in range(1, 10_000) if late(b).total <= 6_000)
    calls = []
    result = largest_micro_batch(lambda b: calls.append(b) or late(b), first=late(2), budget=6_000, max_traces=8)
    assert result["exact"] and result["max_micro_batch"] == truth == 135
    assert calls[0] <= truth, calls


def test_the_cost_of_a_sample_is_taken_at_the_activation_peak():
    """When the step's peak is the optimizer step (activations freed), that peak grows by little per
    sample; what a sample costs is at the forward/backward peak (9.9b printed +31.3 MiB per sample
    for ~3 GiB of activations: issue 27 item 7)."""
    cfg = cfg_of("model=tiny", "train.batch_size=8", "train.seq_len=16", "estimate.device_gb=0.08")
    result = estimate(cfg)
    search = result["micro_batch_search"]
    assert result["memory"]["peak_phase"] == "optimizer step" and search["traced_peaks"].keys() >= {"4", "8"}
    peaks = search["traced_peaks"]
    assert search["peak_bytes_per_sample"] == (peaks["8"] - peaks["4"]) // 4
    closed = closed_form(cfg, counts=count_model(cfg), world_size=1, micro_batch=8, workspaces=0)
    per_sample = closed["components"]["activations"] / 8  # the closed form's activations of one sample
    assert 0.3 * per_sample < search["bytes_per_sample"] < 1.5 * per_sample
    assert search["bytes_per_sample"] > 4 * search["peak_bytes_per_sample"]
    line = next(x for x in render(result, fmt="table").splitlines() if "micro-batch  largest" in x)
    assert f"+{search['bytes_per_sample'] / 2**20:.1f} MiB per sample at the activation peak, +" in line


@pytest.mark.parametrize("budget", [90, 130, 200, 450, 5000])
def test_micro_batch_search_brackets_the_answer_of_a_convex_peak(budget):
    """Flat while model-size temporaries dominate, then activations: a convex peak, as traced."""

    def peak(micro_batch: int) -> int:
        return max(100 + micro_batch, 10 * micro_batch - 50)

    truth = max(b for b in range(0, 1000) if b == 0 or peak(b) <= budget)
    calls = []
    result = largest_micro_batch(lambda b: calls.append(b) or _Step(b, peak(b)), first=_Step(2, peak(2)),
                                 budget=budget, max_traces=8)
    assert result["max_micro_batch"] <= truth <= result["upper_bound"]
    assert result["exact"] and result["max_micro_batch"] == truth
    assert len(calls) <= 9


def test_cli_prints_json_and_writes_nothing_even_in_a_finished_runs_directory(tmp_path, monkeypatch, capsys):
    """The estimate as JSON on stdout, and nothing written: no run directory, no log file. train's
    finished-run guard is not an estimate's (conf/estimate.yaml's NoCallback), so one started inside a
    completed run's directory estimates and changes nothing there, nor beside it."""
    from tests.helpers import fake_run

    run = fake_run(tmp_path / "run", overrides=["model=tiny"])

    def contents() -> list:  # every file with its bytes and every directory, under tmp_path
        return sorted((p.relative_to(tmp_path), p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*"))

    before = contents()
    monkeypatch.chdir(run)
    out = run_cli_here("estimate", *TINY, "estimate.format=json", "estimate.search=false", capsys=capsys)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["model"]["params"] == 1_049_728
    assert result["config"] == {**result["config"], "parallel": "single", "world_size": 1}
    assert contents() == before


def test_an_estimate_sweep_prints_one_table_and_no_training_report(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = run_cli_here("estimate", "-m", *TINY, "parallel=single,ddp", "estimate.format=markdown",
                       "estimate.search=false", capsys=capsys)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row.split(" | ")[1] for row in rows] == ["single x 1", "ddp x 2"]
    assert out.stdout.count("| model |") == 1
    assert "sweep report" not in out.stdout + out.stderr  # train's end-of-sweep report stays off


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["estimate.world_size=0"], "estimate.world_size must be >= 1, got 0"),
        (["estimate.gpu=tpu"], "estimate.gpu=tpu is unknown; use h100, a100, h200, none"),
        (["train.batch_size=-2"], "train.batch_size must be positive, got -2"),
        (["estimate.device_gb=-1"], "estimate.device_gb must be positive, got -1"),
        (["estimate.mfu=1.5"], "estimate.mfu must be in (0, 1], got 1.5"),
        (["estimate.format=yaml"], "estimate.format=yaml is unknown"),
    ],
)
def test_bad_values_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        to_config(compose_cfg(overrides))


def test_a_kernel_that_cannot_be_traced_is_an_error_not_a_silent_substitute():
    with pytest.raises(NotTraceable, match="attention=flex cannot be traced on a CPU; estimate with attention=sdpa"):
        estimate(cfg_of(*TINY, "attention=flex"))


def test_world_size_needs_data_parallelism():
    with pytest.raises(ConfigError, match="estimate.world_size=8 with parallel=single"):
        resolve_world_size(cfg_of("estimate.world_size=8"))
    assert resolve_world_size(cfg_of("parallel=fsdp2")) == 2
    assert resolve_world_size(cfg_of("parallel=ddp", "estimate.world_size=8")) == 8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate.world_size=0"], "optbench: error: estimate.world_size must be >= 1, got 0"),
        (["estimate.nope=1"], "optbench: error: Could not override 'estimate.nope': Key 'nope' not in "
                              "'EstimateConfig' (its keys are "),
        (["estimate.world_size=2.5"], "optbench: error: Error merging override estimate.world_size=2.5: Value '2.5' "
                                      "of type 'float' could not be converted to Integer"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    out = run_cli_here("estimate", "model=tiny", *args, capsys=capsys)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@contextlib.contextmanager
def address_space(extra_bytes: int):
    """This process may map at most ``extra_bytes`` more than it has now (RLIMIT_AS): an allocation
    past it fails at once, whatever the kernel's overcommit policy."""
    import resource

    mapped = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_an_estimate_never_allocates_the_batch_it_traces():
    """A 2 x 2**36-token batch is 1 TiB of token ids: the trace builds it from shapes."""
    cfg = cfg_of("model=tiny", "train.batch_size=2", f"train.seq_len={2**36}", "estimate.search=false",
                 "estimate.predict=false")
    with address_space(4 * GIB):
        result = estimate(cfg)
    assert result["device"]["verdict"] == "does not fit"
    assert result["memory"]["traced"]["activations"] > 2**36 * 2 * 128 * 4  # at least one fp32 residual per token


def test_a_sequence_beyond_a_modules_positions_is_refused():
    overrides = ["model=module", "+model.module._target_=tests.model.custom_lm.build", "model.dim=32",
                 "model.vocab_size=96", "model.layers=2", "model.heads=4", "train.seq_len=65"]
    cfg = cfg_of(*overrides, "+model.module.max_seq_len=64")
    with pytest.raises(ConfigError, match=r"train.seq_len=65 exceeds the model's max_seq_len=64 \(tests.model.custom_lm"):
        build_model(cfg, build_task(cfg))
    cfg = cfg_of(*overrides[:-1], "train.seq_len=64", "+model.module.max_seq_len=64")
    assert build_model(cfg, build_task(cfg)).max_seq_len == 64


def test_every_card_estimate_gpu_names_has_its_memory_and_peak():
    """validate's --project-gpu choices come from the config's ESTIMATE_GPUS (its --help imports no
    estimate): each names a card the estimate knows."""
    from optbench.config.estimate import ESTIMATE_GPUS
    from optbench.estimate.api import GPUS

    assert set(GPUS) == set(ESTIMATE_GPUS) - {"none"}
