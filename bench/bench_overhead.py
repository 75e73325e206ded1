"""make bench: what does optbench cost over a plain PyTorch training loop of the same dims?

Two views, each labelled in the output:

process  (the headline) ``optbench train`` run as a user runs it, in its own process, with its
         defaults (z-loss on every step, foreach AdamW, clipping, the synthetic-data DataLoader,
         finite checks, metrics/TensorBoard), timed by its own clock: the median of the timed steps
         in its summary.json. Against it, ``bench/peer_loop.py``: an independent minimal loop
         (nanoGPT style) that shares no code with optbench, also in its own process, also timed as
         the median of its steps after the same warm-up. Pairs run interleaved, A B, B A, A B, ...
         (neither side always first); each pair gives a ratio optbench/peer (median and min-max
         across pairs shown). Target >= 0.97. Drift guard: a machine-speed probe (``--probe``: its
         own short process, torch's default thread count under the bench's environment, as both
         timed processes have; 0.2 s of 512^3 fp32 matmuls warm-up, then the median of ~0.5 s of
         them) runs right before every side and once after the last, so each side sits between two
         like probes. A pair's drift, the most the machine's own speed can have biased its ratio,
         is how far its three probes (before A, between, after B) spread, or, when a side's median
         timed step ran over 5% slower than its fastest (load that came and went between the
         probes), that slowdown; unbounded when other processes used over 5% of the CPUs while a
         side ran (/proc/stat less the side's own CPU time: load that stayed between the probes).
         The verdict allows for it: PASS only when the median of the pairs' ratios, each divided
         by (1 + its drift), is still >= the target, FAIL only when the median of the ratios times
         (1 + drift) is still below it; otherwise NO VERDICT, naming each pair's drift and probe
         figures: a machine that got busier half-way can fake neither.
hf       (the same pairs, probes and verdict as the process view) ``optbench train model=hf`` (a Llama
         of the dims below, its shape set through ``model.hf.config_overrides``) against
         ``bench/hf_peer_loop.py``: a plain transformers loop (``AutoModelForCausalLM.from_config``,
         logits, cross-entropy, clip, AdamW) that shares no code with optbench. Target >= 0.97.
step     (in one process, optbench's own model on both sides) optbench's ``train_step`` with the
         z-loss a default run computes, vs a plain hand-written step (forward, cross-entropy,
         backward, clip, step; no z-loss) on an identically initialized copy; both sides use the
         same AdamW (foreach, the same parameter groups). It isolates what optbench's step body adds
         from process, model and data effects.

    python bench/bench_overhead.py [--pairs 3] [--steps 5] [--dims reference] [--views process,step,hf]
    python bench/bench_overhead.py --probe   # one machine-speed probe, as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DIMS = {
    # the reference dims: dim 512, 8 layers, 8 heads, ffn 2048, vocab 32000, batch 8 x 256
    "reference": {"dim": 512, "layers": 8, "heads": 8, "ffn": 2048, "vocab": 32000, "batch": 8, "seq": 256},
    "tiny": {"dim": 128, "layers": 4, "heads": 4, "ffn": 512, "vocab": 1024, "batch": 8, "seq": 128},
}
WARMUP = 3
PROBE_SIZE = 512  # fp32 PROBE_SIZE^3 matmuls: ~1.3 ms each on a quiet 2-core AMD EPYC (~200 GFLOP/s)
PROBE_WARMUP_S = 0.2  # a fresh process's first matmuls run ~17% slow (thread pool, MKL set-up)
PROBE_SECONDS = 0.5  # ~370 matmuls: a 10-50 ms hiccup of the host moves their median by nothing
# a side whose median timed step is this much slower than its fastest was loaded while it ran (quiet
# reference-dims sides: ~1-2%; a neighbour's single-threaded job against the 2-thread side: 2-3x)
STEADY_STEPS = 0.05
# a side during which other processes used more than this share of the machine's CPUs (/proc/stat,
# less the side's own CPU time) ran on a busy machine: its ratio is no evidence (quiet: 0.3-0.6%)
OTHERS_SHARE = 0.05


def optbench_overrides(d: dict[str, int]) -> list[str]:
    return [f"model.dim={d['dim']}", f"model.layers={d['layers']}", f"model.heads={d['heads']}",
            f"model.ffn_dim={d['ffn']}", f"model.vocab_size={d['vocab']}", f"train.batch_size={d['batch']}",
            f"train.seq_len={d['seq']}", "precision=fp32", "train.device=cpu"]


def spread_text(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [min {min(values):.3f} - max {max(values):.3f}]"


# ------------------------------------------------------------------------------- process view
def run_optbench(d: dict[str, int], *, steps: int, workdir: Path, hf: bool = False) -> dict:
    run_dir = workdir / f"optbench-{time.monotonic_ns()}"
    command = [str(Path(sys.executable).parent / "optbench"), "train", *(hf_overrides(d) if hf else optbench_overrides(d)),
               f"train.steps={WARMUP + steps}", f"train.timing_warmup={WARMUP}", "train.progress=log",
               f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
    summary_path = run_dir / "summary.json"
    if done.returncode or not summary_path.exists():
        raise SystemExit(f"optbench train failed ({done.returncode}): {done.stderr[-2000:]}")
    throughput = json.loads(summary_path.read_text())["throughput"]
    return {"tokens_per_s": throughput["tokens_per_s"], "step_times_s": throughput["step_times_s"]}


def hf_overrides(d: dict[str, int]) -> list[str]:
    """``model=hf``: a Llama of dims ``d`` (hf_llama_tiny's fields, resized), fp32 on the CPU."""
    shape = {"hidden_size": d["dim"], "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"],
             "num_key_value_heads": d["heads"], "intermediate_size": d["ffn"], "vocab_size": d["vocab"]}
    return ["model=hf_llama_tiny", *(f"model.hf.config_overrides.{k}={v}" for k, v in shape.items()),
            f"train.batch_size={d['batch']}", f"train.seq_len={d['seq']}", "precision=fp32", "train.device=cpu"]


def run_hf_peer(d: dict[str, int], *, steps: int) -> dict:
    command = [sys.executable, str(ROOT / "bench" / "hf_peer_loop.py"), *(f"--{k}={v}" for k, v in d.items()),
               f"--steps={WARMUP + steps}", f"--warmup={WARMUP}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench/hf_peer_loop.py failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_peer(d: dict[str, int], *, steps: int) -> dict:
    command = [sys.executable, str(ROOT / "bench" / "peer_loop.py"), *(f"--{k}={v}" for k, v in d.items()),
               f"--steps={WARMUP + steps}", f"--warmup={WARMUP}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench/peer_loop.py failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def speed_probe(seconds: float = PROBE_SECONDS, warmup_s: float = PROBE_WARMUP_S) -> dict:
    """FLOP/s of this process's matmuls right now: ``warmup_s`` of fp32 PROBE_SIZE^3 matmuls left
    out, then the median time of those run in the next ``seconds``. Run it in a fresh process
    (``--probe``, see ``run_probe``) to measure the machine as the timed processes see it."""
    import torch

    a = torch.full((PROBE_SIZE, PROBE_SIZE), 1 / PROBE_SIZE)
    b = torch.full((PROBE_SIZE, PROBE_SIZE), 0.5)  # constant operands: the global RNG is left alone
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        torch.mm(a, b)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return {"flops": 2 * PROBE_SIZE**3 / statistics.median(times), "matmuls": len(times),
            "threads": torch.get_num_threads()}


def run_probe() -> dict:
    """``speed_probe`` in its own process, started like the timed ones (this interpreter, this
    environment, torch's default thread count), so it shares neither the bench process's idle
    thread pool nor its first-call set-up."""
    command = [sys.executable, str(Path(__file__).resolve()), "--probe"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"machine probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy: user, nice, system, irq, softirq and steal in
    /proc/stat, NaN without one; CPU seconds of this process's finished children)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
        machine = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        machine = math.nan
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return machine, children.ru_utime + children.ru_stime


def run_side(fn: Callable[[], dict]) -> dict:
    """``fn()`` (one timed process), with ``others``: the share of the machine's CPUs that other
    processes used while it ran (NaN where /proc/stat cannot tell)."""
    machine_0, own_0 = cpu_seconds()
    start = time.monotonic()
    result = fn()
    wall = max(time.monotonic() - start, 1e-9)
    machine_1, own_1 = cpu_seconds()
    others = (machine_1 - machine_0) - (own_1 - own_0)
    share = others / (wall * (os.cpu_count() or 1))
    return {**result, "others": share if math.isnan(share) else max(0.0, share)}  # NaN stays unknown


@dataclass
class Pair:
    """One interleaved pair: both sides' tokens/s, their timed step times (s) and the probes before
    its first side, between its sides and after its second side (FLOP/s)."""

    order: tuple[str, str]
    optbench_tps: float
    peer_tps: float
    probes: tuple[float, float, float]
    steps: dict[str, list[float]] = field(default_factory=dict)
    others: dict[str, float] = field(default_factory=dict)  # the share of the CPUs others used, per side

    @property
    def ratio(self) -> float:
        return self.optbench_tps / self.peer_tps

    @property
    def probe_drift(self) -> float:
        """How far the machine's speed moved within the pair: max / min - 1 over its probes."""
        return max(self.probes) / min(self.probes) - 1

    @property
    def step_spread(self) -> dict[str, float]:
        """Each side's median timed step over its fastest, - 1."""
        return {side: statistics.median(times) / min(times) - 1 for side, times in self.steps.items() if times}

    @property
    def loaded(self) -> dict[str, float]:
        """The sides whose median step ran more than STEADY_STEPS slower than their fastest: load
        that came and went within the side, between the probes."""
        return {side: value for side, value in self.step_spread.items() if value > STEADY_STEPS}

    @property
    def busy(self) -> dict[str, float]:
        """The sides during which other processes used more than OTHERS_SHARE of the CPUs."""
        return {side: share for side, share in self.others.items() if share > OTHERS_SHARE}

    @property
    def drift(self) -> float:
        """The most the machine's own speed can have biased this pair's ratio (either way); inf
        when another process competed for the CPUs during a side (no bound: with every core
        threaded, one competing thread slowed the probe's 2-thread matmuls up to 18x)."""
        return math.inf if self.busy else max([self.probe_drift, *self.loaded.values()])


@dataclass
class Verdict:
    """``passed``: True PASS, False FAIL, None no verdict (``reason`` says why)."""

    passed: bool | None
    ratio: float  # the median of the pairs' ratios
    summary: str  # the median, its min-max, the range drift allows
    reason: str = ""

    @property
    def line(self) -> str:
        if self.passed is None:
            return f"NO VERDICT: {self.reason}"
        return f"ratio {self.ratio:.3f} ({self.summary}) {'PASS' if self.passed else 'FAIL'}"


def percent(drift: float) -> str:
    return "unbounded" if math.isinf(drift) else f"{drift:.1%}"


def decide(ratios: list[float], drifts: list[float], target: float, details: list[str] | None = None) -> Verdict:
    """PASS / FAIL / no verdict from per-pair ratios and each pair's drift (0 where nothing can
    drift between the sides, inf where nothing bounds it; ``details``: what each pair's drift is
    made of, for the reason). A drift d can have biased its pair's ratio by up to a factor (1 + d)
    either way, so PASS needs the median of ratio / (1 + d) >= target and FAIL the median of
    ratio * (1 + d) < target: the median is monotone, so these bound the median the pairs would
    have given on a steady machine."""
    if not ratios or len(ratios) != len(drifts):
        raise ValueError(f"{len(ratios)} ratios, {len(drifts)} drifts: need one drift per pair, at least one")
    ratio = statistics.median(ratios)
    low = statistics.median(r / (1 + d) for r, d in zip(ratios, drifts, strict=True))
    high = statistics.median(r * (1 + d) for r, d in zip(ratios, drifts, strict=True))
    spread = f"median of {len(ratios)}, min {min(ratios):.3f} - max {max(ratios):.3f}"
    summary = f"{spread}, target >= {target}"
    if max(drifts) > 0:
        summary += f"; {low:.3f}-{high:.3f} allowing for each pair's machine drift, up to {percent(max(drifts))}"
    if low >= target or high < target:
        return Verdict(low >= target, ratio, summary)
    moved = ", ".join(f"pair {i} {percent(d)}" + (f" ({details[i]})" if details else "")
                      for i, d in enumerate(drifts))
    reason = (f"ratio {ratio:.3f} ({spread}), but the machine's own speed moved within the pairs ({moved}), "
              f"so a steady machine could have given {low:.3f}-{high:.3f}, either side of the {target} target; "
              "rerun on a quieter machine")
    return Verdict(None, ratio, summary, reason)


def drift_text(pair: Pair) -> str:
    """What the pair's drift is made of: its probes, the sides loaded between them, the sides
    during which other processes competed for the CPUs."""
    text = "probes " + " / ".join(f"{p / 1e9:.1f}" for p in pair.probes) + " GFLOP/s"
    text += "".join(f", {side}'s median step {value:.0%} over its fastest" for side, value in pair.loaded.items())
    return text + "".join(f", other processes used {share:.0%} of the CPUs during the {side} side"
                          for side, share in pair.busy.items())


def pair_text(index: int, pair: Pair) -> str:
    def side(name: str, tokens_per_s: float) -> str:
        notes = []
        if name in pair.step_spread:
            notes.append(f"steps +{pair.step_spread[name]:.1%}")
        if name in pair.others and not math.isnan(pair.others[name]):
            notes.append(f"others {pair.others[name]:.1%}")
        return f"{name} {tokens_per_s:,.0f} tokens/s" + (f" ({', '.join(notes)})" if notes else "")

    return (f"  pair {index} ({' then '.join(pair.order)}): {side('optbench', pair.optbench_tps)}, "
            f"{side('peer', pair.peer_tps)}, ratio {pair.ratio:.3f}; probes "
            f"{' / '.join(f'{p / 1e9:.1f}' for p in pair.probes)} GFLOP/s (before / between / after); "
            f"drift {percent(pair.drift)}")


def process_view(d: dict[str, int], *, pairs: int, steps: int, hf: bool = False) -> list[Pair]:
    """Interleaved pairs of processes: ``optbench train`` vs bench/peer_loop.py, or (``hf``)
    ``optbench train model=hf`` vs bench/hf_peer_loop.py."""
    name = "[hf view] `optbench train model=hf`" if hf else "[process view] `optbench train`"
    peer = "bench/hf_peer_loop.py (plain transformers)" if hf else "bench/peer_loop.py"
    print(f"{name} (summary.json's timed steps) vs {peer}, "
          f"{pairs} pairs, {steps} timed steps each after {WARMUP} warm-up", flush=True)
    first = run_probe()
    print(f"  drift guard: a machine probe (its own process, {first['threads']} threads, median of {first['matmuls']} "
          f"fp32 {PROBE_SIZE}^3 matmuls after {PROBE_WARMUP_S} s warm-up) before every side and after the last; "
          f"per side, steps +x% = its median timed step over its fastest (over {STEADY_STEPS:.0%}: load during the "
          f"side), others x% = the CPU share other processes used meanwhile (over {OTHERS_SHARE:.0%}: no evidence)",
          flush=True)
    probes = [first["flops"]]
    results = []
    with tempfile.TemporaryDirectory(prefix="optbench-bench-") as tmp:
        for index in range(pairs):
            sides = [("optbench", lambda: run_optbench(d, steps=steps, workdir=Path(tmp), hf=hf)),
                     ("peer", lambda: (run_hf_peer if hf else run_peer)(d, steps=steps))]
            if index % 2:
                sides.reverse()
            result = {}
            for name, fn in sides:
                result[name] = run_side(fn)
                probes.append(run_probe()["flops"])
            if result["peer"].get("threads", first["threads"]) != first["threads"]:
                print(f"  note: the peer ran {result['peer']['threads']} threads, the probe {first['threads']}")
            pair = Pair(order=(sides[0][0], sides[1][0]), optbench_tps=result["optbench"]["tokens_per_s"],
                        peer_tps=result["peer"]["tokens_per_s"], probes=tuple(probes[-3:]),
                        steps={name: result[name].get("step_times_s", []) for name in result},
                        others={name: result[name]["others"] for name in result})
            results.append(pair)
            print(pair_text(index, pair), flush=True)
    return results


# ---------------------------------------------------------------------------------- step view
def interleave_rounds(sides: dict[str, Callable[[int], float]], *, rounds: int, steps_per_round: int,
                      tokens_per_step: int) -> list[float]:
    """Step view's schedule: ``rounds`` rounds of ``steps_per_round`` steps a side, the order
    alternating each round; round 0 is warm-up. Prints each side's tokens/s; returns each later
    round's ratio optbench / hand tokens/s (hand's median step time over optbench's)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    ratios = []
    step = 0
    for round_index in range(rounds):
        order = list(sides.items())
        if round_index % 2:
            order.reverse()
        per_round = {}
        for name, fn in order:
            elapsed = [fn(step + i) for i in range(steps_per_round)]
            per_round[name] = statistics.median(elapsed)
            if round_index:
                times[name].extend(elapsed)
        step += steps_per_round
        if round_index:
            ratios.append(per_round["hand"] / per_round["optbench"])
    for name, values in times.items():
        print(f"  {name:>8}: {tokens_per_step / statistics.median(values):,.0f} tokens/s median over {len(values)} steps")
    print(f"[step view] ratio optbench / hand-written tokens/s = {spread_text(ratios)} over {len(ratios)} rounds")
    return ratios


def step_view(d: dict[str, int], *, rounds: int, steps_per_round: int) -> list[float]:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from optbench.config import compose, to_config
    from optbench.distributed import detect_machine
    from optbench.optim.optimizers import build_optimizer, build_scheduler
    from optbench.tasks import build_task
    from optbench.training.build import build_model, build_train_loader, materialize
    from optbench.training.step import train_step

    cfg = to_config(compose([*optbench_overrides(d), "train.steps=1000", "train.warmup_steps=10"]))
    machine = detect_machine("cpu")
    device = machine.device
    task = build_task(cfg)
    train_set, _ = task.build_datasets()
    models = []
    for _ in range(2):
        model = build_model(cfg, task)
        materialize(model, device=device, seed=0)
        models.append(model)
    model_a, model_b = models
    opt_a = build_optimizer(model_a, cfg=cfg.optimizer, lr=cfg.train.lr)
    sched_a = build_scheduler(opt_a, cfg=cfg.train)
    decay = [p for p in model_b.parameters() if p.dim() >= 2]
    rest = [p for p in model_b.parameters() if p.dim() < 2]
    opt_b = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    assert opt_a.defaults["foreach"] and not opt_a.defaults.get("fused"), "both sides must use foreach AdamW"
    batches_a = iter(build_train_loader(train_set, cfg=cfg, machine=machine))
    fixed = next(iter(build_train_loader(train_set, cfg=cfg, machine=machine)))["tokens"]
    inputs_b, targets_b = fixed[:, :-1].contiguous(), fixed[:, 1:].contiguous()
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    print(f"[step view] optbench train_step (z-loss on, as a default run) vs a plain hand-written step "
          f"(no z-loss), same model and foreach AdamW, one process; {rounds} rounds x {steps_per_round} steps, "
          "round 0 warm-up", flush=True)

    def step_a(step: int) -> float:
        start = time.perf_counter()
        train_step(model_a, task=task, optimizer=opt_a, batches=batches_a, device=device, cfg=cfg,
                   step=step, with_aux=True)
        sched_a.step()
        return time.perf_counter() - start

    def step_b(step: int) -> float:
        start = time.perf_counter()
        logits = model_b(inputs_b).float().flatten(0, 1)
        loss = F.cross_entropy(logits, targets_b.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model_b.parameters(), 1.0)
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - start

    return interleave_rounds({"optbench": step_a, "hand": step_b}, rounds=rounds, steps_per_round=steps_per_round,
                             tokens_per_step=tokens_per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process (after 3 warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="step view: rounds (round 0 is warm-up)")
    parser.add_argument("--dims", choices=sorted(DIMS), default="reference")
    parser.add_argument("--views", default="process,step,hf")
    parser.add_argument("--min-ratio", type=float, default=0.97)
    parser.add_argument("--probe", action="store_true", help="print one machine-speed probe (JSON) and exit")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(speed_probe()))
        return
    d = DIMS[args.dims]
    print(f"dims={args.dims} ({d}), fp32, CPU, {os.cpu_count()} cores; verdict on the process view", flush=True)
    views = args.views.split(",")
    verdict = None
    if "process" in views:
        pairs = process_view(d, pairs=args.pairs, steps=args.steps)
        verdict = decide([p.ratio for p in pairs], [p.drift for p in pairs], args.min_ratio,
                         [drift_text(p) for p in pairs])
        print(f"[process view] ratio optbench / peer tokens/s = {verdict.ratio:.3f} ({verdict.summary})",
              flush=True)
    if "step" in views:
        step_ratios = step_view(d, rounds=args.rounds, steps_per_round=2)
        if verdict is None:  # only when the process view did not run; its rounds interleave in one process, unprobed
            verdict = decide(step_ratios, [0.0] * len(step_ratios), args.min_ratio)
    verdicts = [] if verdict is None else [("optbench's model", verdict)]
    if "hf" in views:
        pairs = process_view(d, pairs=args.pairs, steps=args.steps, hf=True)
        hf_verdict = decide([p.ratio for p in pairs], [p.drift for p in pairs], args.min_ratio,
                            [drift_text(p) for p in pairs])
        print(f"[hf view] ratio optbench / transformers loop tokens/s = {hf_verdict.ratio:.3f} ({hf_verdict.summary})",
              flush=True)
        verdicts.append(("model=hf", hf_verdict))
    if not verdicts:
        raise SystemExit("--views names none of process, step, hf")
    for label, each in verdicts:
        print(f"{label}: {each.line}" if len(verdicts) > 1 else each.line)
    worst = [each.passed for _, each in verdicts]
    raise SystemExit(1 if False in worst else 3 if None in worst else 0)  # 3: NO VERDICT, 1: FAIL


if __name__ == "__main__":
    main()
