"""The predicted step (optbench.estimate.predict): every op of the traced step recorded with the
FLOPs the model really does, the per-op benchmark on real tensors (RNG untouched), stacking equal
to the whole model, the roofline's projection (labelled "roofline only" without measured
efficiencies), collectives from message sizes, the auxiliary loss every few steps, compiled
memory, the planner and its bad input. No wall-clock is asserted: bench/bench_predict.py measures."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time

import pytest
import torch

from optbench.config import to_config
from optbench.estimate.api import count_model, estimate
from optbench.estimate.op_timings import OpTimes
from optbench.estimate.plan import search_space
from optbench.estimate.predict import complete, on_gpu, on_this_machine, traces_for
from optbench.estimate.speed import BREAKDOWN, Link, ddp_allreduce_s
from optbench.estimate.tracer import step_tracer
from tests.helpers import ROOT, compose_cfg, run_cli_here

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")

TINY = ["model=tiny", "train.batch_size=2", "train.seq_len=32"]
# compile=: at 4 x 32 tokens the blocks' saved activations (4.9 MB), not the logits, make the step's peak.
# FAST's shape: the block compiled and timed here is the graph tests/training/test_optimizations.py's
# compiled run compiles, so whichever of the two runs second finds Inductor's kernels in its cache
# (with an empty cache 4 C++ compiles instead of 18 and 7 s instead of 20 here)
COMPILED = ["model=tiny", "train.batch_size=4", "train.seq_len=32", "compile=default"]


def cfg_of(*overrides: str):
    return to_config(compose_cfg(list(overrides)))


def estimate_cfg(*overrides: str):
    from optbench.config import compose

    return to_config(compose(list(overrides), config_name="estimate"))


def traced_ops(cfg, *, world_size: int = 1, stacked: bool | None = None, target: str = "cuda"):
    with step_tracer(cfg, world_size=world_size, target=target, stacked=stacked) as trace:
        return traces_for(cfg, trace, cfg.train.batch_size)


@pytest.fixture(scope="module")
def tiny_on_cpu():
    """The ops of TINY's step as a CPU runs it, traced once for the tests of the per-op benchmark
    (each only reads them)."""
    typical, heavy = traced_ops(cfg_of(*TINY), target="cpu")
    assert heavy is None
    return typical


# once per worker (session-scoped): the slowest-first order (tests/conftest.py) runs the compiled block's
# timing test long before this module's others, and a module-scoped trace was made again each time the
# module's tests resumed after another module's (3 times, 6.9 CPU-s, in one worker of a full run)
@pytest.fixture(scope="session")
def compiled_on_cpu():
    """COMPILED's step traced once as a CPU runs it (each block through AOTAutograd's partitioner:
    seconds), for the tests of a compiled block's memory and timing (each only reads it): (config,
    the StepTrace with its ops recorded, its typical step's ops)."""
    cfg = cfg_of(*COMPILED)
    with step_tracer(cfg, world_size=1, target="cpu") as trace:
        step = trace(cfg.train.batch_size, ops=True)
        typical, heavy = traces_for(cfg, trace, cfg.train.batch_size, first=step)
    assert heavy is None and typical is step.ops
    return cfg, step, typical


def matmul_flops(ops) -> float:
    """FLOPs of the step's matmuls and attention, the whole model's (stacked when copies were)."""
    def figures(log):
        return {"flops": float(sum(log.costs[c].flops for s, _, _, c, _ in log.calls
                                   if c.kind in ("matmul", "attention") and s.startswith("micro")))}
    return ops.total(figures)["flops"]


def test_the_recorded_ops_do_the_model_flops_and_recomputation_adds_the_forward():
    """A step's matmuls and attention do the model's 6 N + 12 L d T FLOPs per token
    (flops_per_token) and what the kernels recompute: flash attention's backward multiplies Q K^T
    again (2 L d T more per token, torch's count); full activation checkpointing runs every block's
    forward again in the backward, up to the last tensor the backward needs (torch's checkpoint
    stops early: the MLP's output projection is not recomputed)."""
    cfg = cfg_of(*TINY, "model.layers=2", "train.grad_accum=3")
    typical, heavy = traced_ops(cfg)
    counts = count_model(cfg)
    m, tokens = cfg.model, 2 * 32 * 3
    flash_recompute = 2 * m.layers * m.dim * 32 * tokens
    assert heavy is None
    assert matmul_flops(typical) == counts.flops_per_token * tokens + flash_recompute
    recomputed = matmul_flops(traced_ops(cfg_of(*TINY, "model.layers=2", "train.grad_accum=3", "ac=full"))[0])
    block_forward = (counts.flops_per_token * tokens - 6 * m.dim * m.vocab_size * tokens) / 3
    output_projection = 2 * m.dim * m.ffn_dim * m.layers * tokens
    assert recomputed == counts.flops_per_token * tokens + flash_recompute + block_forward - output_projection


@pytest.mark.parametrize("kernel", ["efficient_attention", "flash_attention", "cudnn_attention"])
def test_grouped_query_attention_counts_each_query_head_against_its_groups_key_and_value(monkeypatch, kernel):
    """transformers calls SDPA with ``enable_gqa`` on CUDA (a Llama's 32 query heads, 8 key/value
    heads): the kernel runs each query head against its group's key and value, so the op costs what it
    would with key and value repeated to the query's heads. torch 2.11's counter asserted equal heads
    (every Hugging Face Llama estimate failed so on an H200); its strict form stands in for it here."""
    import torch.utils.flop_counter as counter

    from optbench.estimate.ops import _cost

    def strict(count):
        def counted(*shapes):
            assert len({s[1] for s in shapes}) == 1, "sdpa_flop_count: query/key/value shapes are incompatible"
            return count(*shapes)
        return counted

    repeated = counter.sdpa_backward_flop_count  # torch's count with key and value at the query's heads
    monkeypatch.setattr(counter, "sdpa_flop_count", strict(counter.sdpa_flop_count))
    monkeypatch.setattr(counter, "sdpa_backward_flop_count", strict(counter.sdpa_backward_flop_count))
    b, heads, groups, s, d = 2, 8, 2, 16, 32
    q, out = (torch.empty(b, heads, s, d, device="meta") for _ in range(2))
    k, v = (torch.empty(b, groups, s, d, device="meta") for _ in range(2))
    forward, backward = (getattr(torch.ops.aten, f"_scaled_dot_product_{kernel}{end}") for end in ("", "_backward"))
    attention = 2 * (2 * b * heads * s * s * d)  # q @ k^T, then the scores @ v, for every query head
    assert _cost(forward.default, (q, k, v), {}, None).flops == attention
    # the gradients' four matmuls and the scores again: 2.5x the forward's
    assert _cost(backward.default, (out, q, k, v), {}, None).flops == repeated(*[q.shape] * 4) == 5 * attention // 2
    with pytest.raises(AssertionError, match="incompatible"):  # the strict counter, given the op as it ran
        counter.flop_registry[forward](q, k, v, out_val=None)


def test_two_short_copies_stack_to_the_whole_models_ops():
    """10 blocks traced as copies of 2 and 3 give the whole model's FLOPs, op count and projected
    seconds (a deterministic cost: the roofline)."""
    cfg = estimate_cfg("model=small", "model.layers=10", "train.seq_len=32", "train.batch_size=2")
    stacked, _ = traced_ops(cfg)
    whole, _ = traced_ops(cfg, stacked=False)
    assert stacked.plan is not None and whole.plan is None
    assert matmul_flops(stacked) == matmul_flops(whole)
    projection = on_gpu(cfg, key="H100 SXM", world_size=1)
    seconds = [complete(projection, typical=ops, heavy=None, flops_per_token=1, seq_len=32, trainable_params=1,
                        device=None) for ops in (stacked, whole)]
    assert seconds[0]["ops"] == seconds[1]["ops"]
    for key in BREAKDOWN:
        assert seconds[0]["breakdown_s"][key] == pytest.approx(seconds[1]["breakdown_s"][key], rel=1e-9, abs=1e-15)


def test_the_per_op_benchmark_runs_every_op_on_real_tensors_and_leaves_the_rng_alone(tiny_on_cpu):
    log = tiny_on_cpu.logs[0]
    times = OpTimes(torch.device("cpu"))
    state = torch.get_rng_state()
    seconds = {call: times(call) for _, _, _, call, _ in log.calls}
    assert torch.equal(state, torch.get_rng_state())
    assert not times.skipped
    matmuls = [s for call, s in seconds.items() if call.kind == "matmul"]
    assert matmuls and all(s > 0 for s in matmuls)
    assert len(seconds) < len(log.calls) / 3  # blocks repeat their ops: each distinct one is timed once


def test_each_op_is_timed_once_per_process_device_and_thread_count(monkeypatch, tiny_on_cpu):
    import optbench.estimate.op_timings as op_timings

    calls = list(dict.fromkeys(call for _, _, _, call, _ in tiny_on_cpu.logs[0].calls))
    seconds = [OpTimes(torch.device("cpu"))(call) for call in calls]
    timed = []

    def counted(call, *, device):
        timed.append(call)
        raise op_timings.NotRunnable("counted")

    monkeypatch.setattr(op_timings, "time_call", counted)
    again = OpTimes(torch.device("cpu"))
    assert [again(call) for call in calls] == seconds and not timed and not again.skipped
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:  # another thread count is another measurement; what cannot run stays skipped, not retried
        other = [OpTimes(torch.device("cpu")) for _ in range(2)]
        assert other[0](calls[0]) == 0.0 and other[1](calls[0]) == 0.0
    finally:
        torch.set_num_threads(threads)
    assert timed == [calls[0]] and calls[0].name in other[1].skipped


class _Recorded:
    """An op stand-in that logs each call (``OpCall.func`` is called with the real arguments)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.overloadpacket = name  # what OpCall.name reads

    def __call__(self, *args, **kwargs) -> None:
        self.log.append(self.name)


def test_a_steps_ops_are_timed_round_after_round_in_its_order(monkeypatch):
    """Each round runs every op once, in the step's order (after one warm-up round), until each has
    its repeats; an op that cannot run is never called; at most PREPARED_BYTES of inputs are held,
    so a longer list is timed group after group."""
    import optbench.estimate.op_timings as op_timings
    from optbench.estimate.ops import OpCall, TensorSpec

    log: list[str] = []
    four_floats = TensorSpec(shape=(4,), stride=(1,), dtype=torch.float32)
    calls = [OpCall(func=_Recorded(name, log), args=(four_floats,), kwargs=()) for name in "abc"]
    group = OpCall(func=_Recorded("pg", log), args=(("opaque", "ProcessGroup"),), kwargs=())
    # ops this fast stay for MAX_REPEATS rounds; never reaching MIN_SECONDS, even when a loaded host stalls one
    monkeypatch.setattr(op_timings, "MIN_SECONDS", float("inf"))
    seconds = op_timings.time_interleaved([calls[0], group, *calls[1:]], device=torch.device("cpu"))
    repeats = op_timings.MAX_REPEATS
    assert log == ["a", "b", "c"] * (1 + repeats)
    assert seconds[group] is None and all(seconds[call] > 0 for call in calls)

    log.clear()
    monkeypatch.setattr(op_timings, "PREPARED_BYTES", 16)  # one op's four floats per group
    op_timings.time_interleaved(calls, device=torch.device("cpu"))
    assert log == ["a"] * (1 + repeats) + ["b"] * (1 + repeats) + ["c"] * (1 + repeats)


class _Sleeps:
    """An op stand-in that sleeps the next of ``seconds`` on each call (the last one from then on)."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds, self.overloadpacket = list(seconds), "sleeps"

    def __call__(self, *args, log: list[str] | None = None, **kwargs) -> None:
        if log is not None:
            log.append("slow")
        time.sleep(self.seconds.pop(0) if len(self.seconds) > 1 else self.seconds[0])


def test_an_op_counts_at_its_median_round_not_its_fastest():
    """A prediction is checked against a run's median step: an op that ran fast once (the warm-up
    aside) counts at its typical time. Sleeps only last at least as long as asked, so the bounds hold."""
    import optbench.estimate.op_timings as op_timings
    from optbench.estimate.ops import OpCall

    once_fast = OpCall(func=_Sleeps([0.03, 0.001, 0.03]), args=(), kwargs=())  # warm-up, a fast round, then slow
    seconds = op_timings.time_interleaved([once_fast], device=torch.device("cpu"))[once_fast]
    assert seconds >= 0.03
    assert op_timings.time_call(OpCall(func=_Sleeps([0.03, 0.001, 0.03]), args=(), kwargs=()),
                             device=torch.device("cpu")) >= 0.03
    assert 0.001 <= seconds.fastest < 0.02  # kept for rankings (the planner's)


def test_costs_for_ranking_read_each_ops_fastest_round_of_the_same_benchmark(monkeypatch):
    import optbench.estimate.op_timings as op_timings
    from optbench.estimate.ops import OpCall

    call = OpCall(func=torch.ops.aten.relu.default, args=(), kwargs=())
    monkeypatch.setattr(op_timings, "_TIMED", {})
    timed: list = []
    monkeypatch.setattr(op_timings, "time_interleaved",
                        lambda calls, *, device: timed.extend(calls) or dict.fromkeys(calls, op_timings.Seconds(3e-3, 1e-3)))
    costs = op_timings.MachineCosts(torch.device("cpu"), threads=torch.get_num_threads())
    costs.prepare([call])
    ranking = costs.fastest()
    assert costs.seconds(call, None) == 3e-3 and ranking.seconds(call, None) == 1e-3
    assert type(costs.seconds(call, None)) is float and costs.statistic == "median"
    assert timed == [call]  # one benchmark: the ranking view reads the same timings


def test_in_lockstep_every_entry_runs_every_round_until_all_are_done():
    """Apart, a fast op stays for MAX_REPEATS rounds and a slow one leaves after MIN_REPEATS; in
    lockstep both run every round (a compiled block and its matmuls then share all their rounds)."""
    import optbench.estimate.op_timings as op_timings

    for lockstep, slow_runs in ((False, 1 + op_timings.MIN_REPEATS), (True, 1 + op_timings.MAX_REPEATS)):
        log: list[str] = []
        entries = [("fast", functools.partial(log.append, "fast")),
                   ("slow", functools.partial(_Sleeps([0.002]), log=log))]
        op_timings.time_rounds(entries, device=torch.device("cpu"), lockstep=lockstep)
        assert log.count("fast") == 1 + op_timings.MAX_REPEATS and log.count("slow") == slow_runs


def test_a_prediction_times_the_steps_ops_interleaved_before_it_adds_them_up(monkeypatch, tiny_on_cpu):
    import optbench.estimate.op_timings as op_timings

    typical = tiny_on_cpu
    prepared: list = []
    monkeypatch.setattr(op_timings, "_TIMED", {})
    monkeypatch.setattr(op_timings, "time_interleaved",
                        lambda calls, *, device: prepared.extend(calls) or dict.fromkeys(calls, 1e-3))
    monkeypatch.setattr(op_timings, "time_call", lambda call, *, device: pytest.fail(f"{call.name} timed alone"))
    projection = on_this_machine(cfg_of(*TINY), device=torch.device("cpu"), world_size=1)
    complete(projection, typical=typical, heavy=None, flops_per_token=1, seq_len=32, trainable_params=1, device=None)
    in_order = list(dict.fromkeys(call for log in typical.logs for *_, call, _ in log.calls))
    assert prepared == in_order  # each distinct op once, in the order the step first runs it


def test_a_compiled_block_and_its_matmuls_and_attention_are_timed_in_the_same_rounds(monkeypatch, compiled_on_cpu):
    """compile=: a compiled block's "other ops" are its time less its matmuls and attention per op;
    the two are timed in the same rounds (one ``time_rounds``), so the difference is not between
    two moments of the machine. Nothing is compiled here: the block's runner is a stand-in."""
    import optbench.estimate.compiled_time as compiled_time
    import optbench.estimate.op_timings as op_timings

    cfg, _, typical = compiled_on_cpu
    runs: list[str] = []
    rounds: list[list] = []

    def timed(entries, *, device, lockstep):
        assert lockstep  # every entry in every round, not the ops alone once the block is done
        rounds.append([key for key, _ in entries])
        return {key: 1.0 if isinstance(key, tuple) else 1e-3 for key, _ in entries}

    monkeypatch.setattr(op_timings, "_TIMED", {})
    monkeypatch.setattr(op_timings, "time_interleaved", lambda calls, *, device: dict.fromkeys(calls, 2e-3))
    monkeypatch.setattr(compiled_time, "_block_runner", lambda block, args, kwargs, **_: lambda: runs.append("block"))
    monkeypatch.setattr(compiled_time, "time_rounds", timed)
    projection = on_this_machine(cfg, device=torch.device("cpu"), world_size=1)
    speed = complete(projection, typical=typical, heavy=None, flops_per_token=1, seq_len=32, trainable_params=1,
                     device=torch.device("cpu"))
    kept = [call for stage, _, block, call, _ in typical.logs[-1].calls
            if stage == "micro 0" and block == 0 and call.kind in ("matmul", "attention")]
    assert len(rounds) == 1 and rounds[0] == [("block", 0), *dict.fromkeys(kept)]
    assert runs == ["block"]  # run once before the rounds: what compiles it
    blocks = speed["compiled_blocks"]
    assert blocks["block_fwd_bwd_s"] == [1.0]
    assert blocks["of_which_matmuls_and_attention_s"] == [pytest.approx(len(kept) * 1e-3)]  # not the step's 2e-3


def test_a_compiled_block_is_compiled_and_timed_for_real_on_this_cpu(compiled_on_cpu):
    """The real path (one tiny block compiled by Inductor): forward + backward with autograd on
    inside the benchmark's no-grad rounds, its matmuls and attention timed beside it."""
    cfg, _, typical = compiled_on_cpu
    projection = on_this_machine(cfg, device=torch.device("cpu"), world_size=1)
    speed = complete(projection, typical=typical, heavy=None, flops_per_token=1, seq_len=32, trainable_params=1,
                     device=torch.device("cpu"))
    blocks = speed["compiled_blocks"]
    assert blocks["period"] == 1 and blocks["block_fwd_bwd_s"][0] > 0
    assert 0 < blocks["of_which_matmuls_and_attention_s"][0]
    assert speed["breakdown_s"]["other ops"] > 0


def test_the_projection_says_roofline_only_without_measured_efficiencies_and_splits_the_step():
    result = estimate(estimate_cfg(*TINY, "estimate.search=false", "estimate.gpu=a100"))
    speed = result["speed"]
    assert speed["method"].startswith("roofline only") and "A100" in speed["device"]
    assert sum(speed["breakdown_s"].values()) == pytest.approx(speed["step_time_s"])
    assert speed["breakdown_s"]["forward matmuls"] > 0 and speed["breakdown_s"]["backward matmuls"] > 0
    assert speed["tokens_per_s"] == pytest.approx(2 * 32 / speed["step_time_s"])
    assert speed["mfu"] == pytest.approx(speed["tokens_per_s"] * result["model"]["flops_per_token"] / 19.5e12)


def test_loss_every_4_steps_predicts_the_typical_step_and_the_mean():
    """The heavy step (auxiliary loss) is traced apart: the typical step (a run's median) is the
    light one, the mean weighs one heavy in four."""
    cfg = estimate_cfg(*TINY, "estimate.search=false", "loss_freq=every_4")
    speed = estimate(cfg)["speed"]
    assert speed["step_time_mean_s"] > speed["step_time_s"]


def test_collectives_follow_the_message_sizes():
    """DDP all-reduces every gradient (modeled: DDP cannot wrap FakeTensors); FSDP2's all-gathers
    and reduce-scatters are the traced ops' own, their bytes the parameters'."""
    from optbench.estimate.links import NVLINK_LATENCY_S

    grads = 4 * count_model(cfg_of(*TINY)).params
    ring = 2 * 7 / 8 * grads / 100e9
    assert ddp_allreduce_s(gradient_bytes=grads, world=8, link=Link(100e9, 1e-5, "stated")) == pytest.approx(1e-5 + ring)
    assert ddp_allreduce_s(gradient_bytes=100 * 2**20, world=8, link=Link(100e9, 1e-5, "stated")) == pytest.approx(
        4 * 1e-5 + 2 * 7 / 8 * 100 * 2**20 / 100e9)  # four 25 MiB buckets
    ddp = estimate(estimate_cfg(*TINY, "estimate.search=false", "parallel=ddp", "estimate.world_size=8",
                                "estimate.link_gbps=100"))["speed"]["communication"]
    assert ddp["bytes"] == grads and ddp["total_s"] == pytest.approx(NVLINK_LATENCY_S + ring)
    fsdp = estimate(estimate_cfg(*TINY, "estimate.search=false", "parallel=fsdp2", "estimate.world_size=4"))
    communication = fsdp["speed"]["communication"]
    assert communication["bytes"] >= 2 * grads  # parameters gathered (forward, backward), gradients scattered
    assert "NVLink" in communication["link"] and communication["total_s"] > 0


def test_a_world_size_the_model_cannot_shard_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = run_cli_here("estimate", "model=tiny", "parallel=fsdp2", "estimate.world_size=1000000000", capsys=capsys)
    assert out.returncode == 2 and out.stdout == ""
    assert "estimate.world_size=1000000000 cannot shard model=tiny with FSDP2" in out.stderr
    assert "use at most 1,024 ranks" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_the_planner_ranks_what_fits_by_predicted_speed(tmp_path, monkeypatch, capsys):
    """One device of 0.2 GiB (a100: no float8): the micro-batches that fit the budget, each reaching
    the global batch with its accumulation, ranked by predicted tokens/s."""
    monkeypatch.chdir(tmp_path)
    out = run_cli_here("plan", "model=tiny", "train.seq_len=64", "estimate.gpu=a100", "estimate.global_batch=16",
                       "estimate.device_gb=0.2", "estimate.format=json", capsys=capsys)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    rows = result["candidates"]
    speeds = [row["tokens_per_s"] for row in rows]
    assert speeds == sorted(speeds, reverse=True) and len(rows) >= 3
    assert all(row["peak_bytes"] <= result["budget_bytes"] for row in rows)
    for row in rows:
        values = dict(o.split("=") for o in row["overrides"])
        assert int(values["train.batch_size"]) * int(values["train.grad_accum"]) == 16
    assert {dict(o.split("=") for o in row["overrides"])["ac"] for row in rows} == {
        "none", "selective", "full"}


def _leading(value, size: int) -> bool:
    from optbench.estimate.ops import TensorSpec

    if isinstance(value, TensorSpec):
        return bool(value.shape) and value.shape[0] == size
    return isinstance(value, tuple) and any(_leading(v, size) for v in value)


def test_the_planner_times_every_candidates_ops_in_one_interleaved_benchmark(tmp_path, monkeypatch, capsys):
    """On this machine the candidates are compared, so their ops are timed together, round after
    round, before any is predicted: one benchmark holding both micro-batches' ops, no op timed alone.
    The ranking adds up each op's fastest round, the printed step its median round: here every op's
    median is the same, so 2 x 1 (one micro-step) has the shorter median step, but the ops of
    micro-batch 2 never ran faster than that while those of micro-batch 1 did, and 1 x 2 ranks first."""
    import optbench.estimate.op_timings as op_timings
    import optbench.estimate.plan as planner

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(planner, "search_space", lambda cfg, *, world_size: [("single", "fp32", ("none", 1))])
    benchmarks: list[list] = []

    def timed(calls, *, device):
        benchmarks.append(list(calls))
        return {call: op_timings.Seconds(1e-3, 1e-3 if _leading(call.args, 2) else 1e-5) for call in calls}

    monkeypatch.setattr(op_timings, "_TIMED", {})
    monkeypatch.setattr(op_timings, "time_interleaved", timed)
    monkeypatch.setattr(op_timings, "time_call", lambda call, *, device: pytest.fail(f"{call.name} timed alone"))
    out = run_cli_here("plan", "model=tiny", "model.layers=2", "train.seq_len=16", "estimate.gpu=none",
                       "estimate.global_batch=2", "estimate.format=json", capsys=capsys)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    rows = result["candidates"]
    assert [dict(o.split("=") for o in row["overrides"])["train.batch_size"] for row in rows] == ["1", "2"]
    assert len(benchmarks) == 1
    batches = {call.args[1].shape[0] for call in benchmarks[0] if call.name == "aten.embedding"}
    assert batches == {1, 2}
    assert rows[0]["rank_step_time_s"] < rows[1]["rank_step_time_s"]
    assert rows[0]["step_time_s"] > rows[1]["step_time_s"]  # by the median alone, 2 x 1 would lead
    assert "ranked by the predicted step with each op at its fastest round" in planner.format_plan(result, top=5)


def test_a_plan_candidate_traced_on_its_configurations_shared_model_is_its_fresh_trace():
    """The planner builds each configuration's fake model once: its candidates' traces (4 x 1 and
    2 x 2 are the search's own, 1 x 4 traced after it: accumulation's first, middle and last
    micro-steps) hold the same peak and the same ops, in the same order, as a trace of the
    candidate's own config on a model built for it: the ranking's inputs are the same."""
    import optbench.estimate.plan as planner
    from optbench.estimate.predict import step_calls
    from optbench.estimate.tracer import step_tracer

    cfg = estimate_cfg("model=tiny", "model.layers=2", "train.seq_len=16", "estimate.gpu=none")  # one block of 2 kept
    context = planner._Context(cfg)
    choice = dict(parallel="single", precision="bf16", ac=("selective", 2), world=1)
    probe = planner.configured(cfg, parallel="single", precision="bf16", ac=("selective", 2), micro_batch=1,
                               accum=2, world_size=1)
    with step_tracer(probe, world_size=1, target="cpu") as trace:
        steps = planner._Steps(trace, per_rank=4)
        assert planner._fitting_sizes(steps.search, per_rank=4, budget=2**40) == [1, 2, 4]
        assert set(steps.steps) == {(4, 1), (2, 2)}  # the top in one micro-step, the next one down in two
        searched = dict(steps.steps)
        shared = [planner._candidate(context, steps, **choice, micro_batch=m, accum=4 // m) for m in (4, 2, 1)]
        assert set(steps.steps) == {(4, 1), (2, 2), (1, 4)}
    assert [c.traced[1] for c in shared[:2]] == [searched[4, 1].ops, searched[2, 2].ops]  # reused, not retraced
    for candidate in shared:
        with step_tracer(candidate.traced[0], world_size=1, target="cpu") as trace:
            fresh = planner._candidate(context, planner._Steps(trace, per_rank=4), **choice,
                                       micro_batch=candidate.micro_batch, accum=candidate.accum)
        assert candidate.peak_bytes == fresh.peak_bytes
        assert step_calls(*candidate.traced[1:]) == step_calls(*fresh.traced[1:])
    assert len({c.peak_bytes for c in shared}) == 3


@pytest.mark.parametrize(("precision", "ac"), [("bf16", ("none", 1)), ("float8", ("selective", 2))])
def test_a_plan_candidate_reusing_the_searchs_trace_is_predicted_as_its_fresh_trace(precision, ac):
    """On a GPU's roofline the planner's candidates whose step the search traced (the per-rank
    batch in one micro-step, a smaller micro-batch with accumulation 2) are that very trace: each
    holds the peak, the ops (FLOPs and bytes, in order) and so the prediction of a fresh trace of
    its own config on a model built for it."""
    import optbench.estimate.plan as planner

    cfg = estimate_cfg("model=tiny", "model.layers=2", "train.seq_len=16", "estimate.gpu=h100")
    context = planner._Context(cfg)
    choice = dict(parallel="single", precision=precision, ac=ac, world=1)
    probe = planner.configured(cfg, parallel="single", precision=precision, ac=ac, micro_batch=1, accum=2, world_size=1)
    with step_tracer(probe, world_size=1, target="cuda") as trace:
        steps = planner._Steps(trace, per_rank=4)
        assert planner._fitting_sizes(steps.search, per_rank=4, budget=2**40) == [1, 2, 4]
        searched = dict(steps.steps)
        assert set(searched) == {(4, 1), (2, 2)}
        reused = [planner._candidate(context, steps, **choice, micro_batch=m, accum=4 // m) for m in (4, 2)]
        accumulated = steps(4, accum=2, ops=True)  # not a candidate: the top with accumulation
    assert [c.traced[1] for c in reused] == [searched[4, 1].ops, searched[2, 2].ops]
    for candidate in reused:
        with step_tracer(candidate.traced[0], world_size=1, target="cuda") as trace:
            fresh = planner._candidate(context, planner._Steps(trace, per_rank=4), **choice,
                                       micro_batch=candidate.micro_batch, accum=candidate.accum)
        assert candidate.peak_bytes == fresh.peak_bytes
        ours, theirs = candidate.traced[1].logs[0], fresh.traced[1].logs[0]
        assert [(s, p, b, c.func, ours.costs[c]) for s, p, b, c, _ in ours.calls] == \
            [(s, p, b, c.func, theirs.costs[c]) for s, p, b, c, _ in theirs.calls]
        predicted = [context.predict(c.traced[0], world=1, typical=c.traced[1], heavy=None)[0] for c in (candidate, fresh)]
        assert [{k: v for k, v in p.items() if k != "predicted_in_s"} for p in predicted] == \
            [{k: v for k, v in predicted[1].items() if k != "predicted_in_s"}] * 2  # all but how long it took
    # the top's own step, not one with accumulation: there no micro-step runs with the gradients allocated
    assert searched[4, 1].before_step.total < accumulated.before_step.total


def test_the_planners_fitting_micro_batches_are_every_divisor_whose_peak_fits():
    """The divisors whose traced peak fits, whatever the budget: the per-rank batch's own (one
    micro-step), then the others' (accumulation 2, growing with the micro-batch): where the largest
    of those fits, two traces; else by bisection; where none does, the peak at 1."""
    import optbench.estimate.plan as planner

    traced: list[int] = []

    def peaks(top):
        def search(micro_batch):  # planner._Steps.search: the steady peak, the top in one micro-step
            traced.append(micro_batch)
            return top if micro_batch == 12 else 1000 + 100 * micro_batch
        return search

    for top in (900, 1400, 2100):  # a step without accumulation holds less than one with it, or more
        for budget in (899, 999, 1100, 1150, 1200, 1400, 1500, 1800, 2100, 10**9):
            traced.clear()
            found = planner._fitting_sizes(peaks(top), per_rank=12, budget=budget)
            fitting = [d for d in (1, 2, 3, 4, 6) if 1000 + 100 * d <= budget] + ([12] if top <= budget else [])
            assert found == (fitting or 1100), (top, budget)
            assert traced[0] == 12 and len(traced) <= (5 if top <= budget else 4)
            if top <= budget and 1600 <= budget:
                assert traced == [12, 6]
    assert planner._fitting_sizes(peaks(1100), per_rank=1, budget=1099) == 1100 == planner._fitting_sizes(
        peaks(1100), per_rank=12, budget=1099)
    assert planner._fitting_sizes(peaks(1100), per_rank=1, budget=1100) == [1]


def test_the_search_space_follows_the_ranks_and_the_card():

    many = search_space(estimate_cfg("model=tiny", "estimate.gpu=h100"), world_size=8)
    assert {p for p, _, _ in many} == {"fsdp2", "ddp"} and {q for _, q, _ in many} == {"bf16", "float8"}
    assert {q for _, q, _ in search_space(estimate_cfg("model=tiny", "estimate.gpu=a100"), world_size=1)} == {"bf16"}
    here = search_space(estimate_cfg("model=tiny", "estimate.gpu=none"), world_size=1)
    assert {p for p, _, _ in here} == {"single"} and {q for _, q, _ in here} == {"fp32", "bf16"}
    assert {ac for _, _, (ac, _) in here} == {"none", "selective", "full"}


def test_every_option_the_planner_leaves_out_is_named_with_its_reason():
    """Issue 47 item 5: a plan for a model whose intermediate_size is 344 listed no float8 and said
    nothing; every precision, checkpointing and parallel option not searched is named, with why."""
    from optbench.estimate.plan import format_plan, left_out

    misaligned = left_out(estimate_cfg("model=tiny", "model.ffn_dim=344", "estimate.gpu=h100"), world_size=1)
    assert ("precision=float8, float8_rowwise: float8 matmuls need every dimension divisible by 16; not divisible: "
            "model.ffn_dim=344 (use 336 or 352)") in misaligned
    aligned = left_out(estimate_cfg("model=tiny", "estimate.gpu=h100"), world_size=8)
    assert not any(line.startswith("precision=float8,") for line in aligned)
    assert "precision=float8_rowwise: the roofline prices it as float8 (the same float8 peak)" in aligned
    assert "parallel=single: 8 ranks (estimate.world_size)" in aligned
    a100 = left_out(estimate_cfg("model=tiny", "estimate.gpu=a100"), world_size=1)
    assert "precision=float8, float8_rowwise: the A100 has no float8 tensor cores (estimate.gpu=h100|h200 have)" in a100
    here = left_out(estimate_cfg("model=tiny", "estimate.gpu=none"), world_size=1)
    assert any(line.startswith("precision=float8, float8_rowwise: a CPU has no float8 matmuls") for line in here)
    # every precision preset is either searched or named with a reason, on every target
    for gpu, lines in (("h100", aligned), ("a100", a100), ("none", here)):
        searched = {q for _, q, _ in search_space(estimate_cfg("model=tiny", f"estimate.gpu={gpu}"), world_size=1)}
        named = {name.strip() for line in lines if line.startswith("precision=")
                 for name in line.removeprefix("precision=").split(":")[0].split(",")}
        presets = {p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml")}
        assert searched | named == presets, gpu
    two_layers = left_out(estimate_cfg("model=tiny", "model.layers=2", "estimate.gpu=h100"), world_size=1)
    assert "ac=selective: every 2nd block of 2 needs model.layers >= 4" in two_layers
    result = {"model": "tiny", "world_size": 1, "device": "H100", "global_batch": 8, "seq_len": 16, "target": "x",
              "candidates": [], "ranked_by": "y", "refused": [], "left_out": misaligned, "elapsed_s": 0.0}
    assert "  left out: precision=float8, float8_rowwise: float8 matmuls need" in format_plan(result, top=5)


@pytest.mark.parametrize(("args", "message"), [
    (["estimate.world_size=3", "estimate.global_batch=16"], "estimate.global_batch=16 samples cannot be split over 3"),
    # no configuration fits 1 MB (2 blocks' parameters alone are 2.6 MB): one sample, one trace per configuration
    (["estimate.gpu=a100", "model.layers=2", "estimate.global_batch=1", "estimate.device_gb=0.001"],
     "no configuration of"),
    (["estimate.gpu=tpu"], "estimate.gpu=tpu is unknown"),
])
def test_the_planner_refuses_what_it_cannot_search_in_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    out = run_cli_here("plan", "model=tiny", "train.seq_len=32", *args, capsys=capsys)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_compiled_block_saves_what_the_partitioner_chooses(compiled_on_cpu):
    """compile=: the blocks' saved activations are AOTAutograd's min-cut choice, fewer than eager's;
    under full checkpointing a compiled block saves its input only, as the eager one does."""
    from optbench.estimate.tracer import trace_step

    def activations(*extra: str) -> int:
        cfg = cfg_of(*COMPILED[:-1], *extra)
        return trace_step(cfg, world_size=1, micro_batch=4, target="cpu").before_step.components["activations"]

    _, compiled, _ = compiled_on_cpu  # COMPILED, traced at its micro-batch 4 on a CPU
    assert compiled.before_step.components["activations"] < activations()
    eager_ac, compiled_ac = activations("ac=full"), activations("ac=full", "compile=default")
    assert not math.isclose(eager_ac, 0) and compiled_ac <= eager_ac


def test_the_profilers_memory_events_measure_what_memtracker_measures_on_an_eager_step():
    """measure.ProfiledPeak (what a compiled CPU run is measured with) on an eager step: the same
    peak as MemTracker, to within the allocator's few bytes of bookkeeping."""
    from optbench.measure import ProfiledPeak
    from optbench.optim.optimizers import build_optimizer
    from optbench.run.loop.memory import cpu_memory_tracker
    from optbench.tasks import build_task
    from optbench.training.build import build_model, materialize
    from optbench.training.step import StepContext, StepHooks, train_step

    cfg = cfg_of("model=tiny", "train.batch_size=4", "train.seq_len=32", "train.grad_accum=2")
    task, cpu = build_task(cfg), torch.device("cpu")
    model = build_model(cfg, task)
    materialize(model, device=cpu, seed=0)
    optimizer = build_optimizer(model, cfg=cfg.optimizer, lr=1e-3)
    batches = iter(lambda: task.example_batch(4), None)
    peaks = {}
    for step, kind in enumerate(("warm-up", "profiler", "memtracker")):
        tracker = ProfiledPeak(model, optimizer) if kind == "profiler" else cpu_memory_tracker(model, optimizer)
        with tracker if kind != "warm-up" else contextlib.nullcontext():
            ctx = StepContext(model=model, task=task, cfg=cfg, device=cpu, optimizer=optimizer)
            hooks = StepHooks(between_micro_steps=(tracker.reset_mod_stats,) if kind != "warm-up" else ())
            train_step(ctx, batches, step=step, with_aux=True, hooks=hooks)
        if kind != "warm-up":
            peaks[kind] = tracker.get_tracker_snapshot("peak")[cpu]["Total"]
    assert abs(peaks["profiler"] - peaks["memtracker"]) <= 64, peaks
