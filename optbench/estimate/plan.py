"""``optbench plan``: the fastest configurations that fit, for a model, a device and a global batch.

The search runs over data parallelism (FSDP2 or DDP when ``estimate.world_size`` > 1), precision
(bf16 and, on cards with float8 tensor cores, float8; fp32 and bf16 on this CPU), activation
checkpointing (none, selective every 2nd block, full) and the micro-batch with its gradient
accumulation (``train.batch_size`` x ``train.grad_accum`` x world size = ``estimate.global_batch``
samples). For each (parallel, precision, checkpointing) the micro-batches that divide the per-rank
batch and fit are found by traced memory (``_fitting_sizes``: the largest first, then bisection);
the two largest are candidates (a larger micro-batch has fewer steps of fixed cost). Each
candidate's step is traced, or is the search's where it is the same (``_Steps``), and predicted
(``optbench.estimate.predict``): on
``estimate.gpu``'s card by its roofline, on this machine's CPU (``estimate.gpu=none``) by the
per-op benchmark. The configurations that fit are ranked by predicted tokens/s; the best
``estimate.top`` are printed as the overrides that run them.

On this machine every candidate is traced first, and the ops of all of them are then timed in one
interleaved benchmark: each round runs every distinct op of every candidate once. A ranking
compares candidates, so their ops must meet the same moments of the machine. Timed candidate
after candidate, a slow stretch of a shared host (seconds long, up to 2x) could land on one
candidate's ops and not on another's: one plan put batch 8 x 2 at 8,888 tokens/s against 15,537
for 16 x 1, which the runs measured only 5-8% apart (docs/estimate-speed.md).

On this machine the ranking adds up each op's **fastest** round, while the printed step time and
tokens/s add up each op's median round (``op_timings``): the median is what a run's median step
measures, the fastest what an op takes when the host leaves the machine alone, the steadier basis
for ordering two steps. Over the bench-plan runs on a shared host, plans ranked by the fastest put
the two leading configurations in the same order five times in five, plans ranked by the median
three times in four (bench/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch

from optbench.config import Config
from optbench.errors import ConfigError

ACS = (("none", 1), ("selective", 2), ("full", 1))
FLOAT8_GPUS = ("h100", "h200")
GPUS_NAMES = {"h100": "H100", "h200": "H200", "a100": "A100"}


@dataclasses.dataclass
class Candidate:
    parallel: str
    precision: str
    ac: tuple[str, int]
    micro_batch: int
    accum: int
    peak_bytes: int
    speed: dict[str, Any] | None = None
    rank_step_s: float | None = None  # the ranking's step: each op at its fastest round (this machine only)
    traced: tuple[Config, Any, Any] | None = None  # (its config, typical step, heavy step) until predicted

    @property
    def overrides(self) -> list[str]:
        mode, every = self.ac
        return [f"parallel={self.parallel}", f"precision={self.precision}", f"ac={mode}",
                *([f"ac.every={every}"] if mode == "selective" else []),
                f"train.batch_size={self.micro_batch}", f"train.grad_accum={self.accum}"]

    @property
    def tokens_per_s(self) -> float:
        return self.speed["tokens_per_s"] if self.speed and "tokens_per_s" in self.speed else 0.0

    @property
    def rank_key(self) -> float:
        """What the plan ranks by, higher first: tokens per second of the ranking's step on this
        machine, else of the prediction."""
        if self.rank_step_s:
            return self.speed["tokens_per_s"] * self.speed["step_time_s"] / self.rank_step_s
        return self.tokens_per_s


def global_batch(cfg: Config, *, world_size: int) -> tuple[int, int]:
    """(samples per optimizer step, per rank): ``estimate.global_batch`` or the config's own."""
    total = cfg.estimate.global_batch or cfg.train.batch_size * cfg.train.grad_accum * world_size
    if total % world_size:
        raise ConfigError(f"estimate.global_batch={total} samples cannot be split over {world_size} ranks; use a "
                          f"multiple of {world_size} (e.g. {max(world_size, total - total % world_size)})")
    return total, total // world_size


def search_space(cfg: Config, *, world_size: int) -> list[tuple[str, str, tuple[str, int]]]:
    """(parallel, precision, checkpointing) combinations to search."""
    from optbench.training.float8 import misaligned_dims

    parallels = ["single"] if world_size == 1 else ["fsdp2", "ddp"]
    if cfg.estimate.gpu == "none":
        precisions = ["fp32", "bf16"]
    else:
        precisions = ["bf16"]
        aligned = not misaligned_dims(dim=cfg.model.dim, ffn_dim=cfg.model.ffn_dim, tokens_per_micro_batch=None)
        if cfg.estimate.gpu in FLOAT8_GPUS and aligned:
            precisions.append("float8")
    acs = [ac for ac in ACS if ac[0] != "selective" or cfg.model.layers >= 2 * ac[1]]
    return [(p, q, ac) for p in parallels for q in precisions for ac in acs]


def left_out(cfg: Config, *, world_size: int) -> list[str]:
    """Every option ``search_space`` does not search, each with why (issue 47: a plan that listed no
    float8 gave no reason)."""
    from optbench.training.float8 import misaligned_dims

    searched = {precision for _, precision, _ in search_space(cfg, world_size=world_size)}
    out = []
    if cfg.estimate.gpu == "none":
        out += ["precision=float8, float8_rowwise: a CPU has no float8 matmuls (they need compute capability 8.9: "
                "estimate.gpu=h100|h200 plans for such a card)",
                "precision=tf32: TF32 is a CUDA tensor-core mode; on a CPU its matmuls run in fp32, as precision=fp32",
                "precision=fp16: bf16 stands for 16-bit autocast here (the same bytes; fp16 adds a GradScaler)"]
    else:
        card = GPUS_NAMES.get(cfg.estimate.gpu, cfg.estimate.gpu)
        misaligned = misaligned_dims(dim=cfg.model.dim, ffn_dim=cfg.model.ffn_dim, tokens_per_micro_batch=None)
        if "float8" not in searched:
            why = (f"the {card} has no float8 tensor cores (estimate.gpu=h100|h200 have)"
                   if cfg.estimate.gpu not in FLOAT8_GPUS else
                   f"float8 matmuls need every dimension divisible by 16; not divisible: {'; '.join(misaligned)}")
            out.append(f"precision=float8, float8_rowwise: {why}")
        else:
            out.append("precision=float8_rowwise: the roofline prices it as float8 (the same float8 peak)")
        out += [f"precision=fp32, tf32: a lower matmul peak than bf16 on the {card} (its datasheet's)",
                "precision=fp16: the same tensor-core peak as bf16, and a GradScaler besides: bf16 stands for it"]
    if not any(mode == "selective" for _, _, (mode, _) in search_space(cfg, world_size=world_size)):
        out.append(f"ac=selective: every 2nd block of {cfg.model.layers} needs model.layers >= 4")
    out.append("parallel=ddp, fsdp2: one rank (estimate.world_size=N plans over N)" if world_size == 1 else
               f"parallel=single: {world_size} ranks (estimate.world_size)")
    out.append(f"parallel.cpu_offload, compile, attention, optimizer: not searched; each candidate keeps the "
               f"config's own (compile={cfg.compile.name} attention={cfg.attention.name} "
               f"optimizer={cfg.optimizer.name}, no CPU offload): give another as an override")
    return out


def configured(cfg: Config, *, parallel: str, precision: str, ac: tuple[str, int], micro_batch: int, accum: int,
               world_size: int) -> Config:
    """``cfg`` with one candidate's choices (the precision group's values as composing it gives)."""
    return dataclasses.replace(
        cfg, precision=_precision(precision),
        ac=dataclasses.replace(cfg.ac, name=ac[0], every=ac[1]),
        parallel=dataclasses.replace(cfg.parallel, name=parallel, nproc_per_node=world_size if parallel != "single"
                                     else 1, cpu_offload=False),
        train=dataclasses.replace(cfg.train, batch_size=micro_batch, grad_accum=accum),
        estimate=dataclasses.replace(cfg.estimate, world_size=world_size if parallel != "single" else None))


_PRECISIONS: dict[str, Any] = {}


def _precision(name: str) -> Any:
    """The precision group's values, read from its file (composing again is not possible inside
    the command's own Hydra app)."""
    if name not in _PRECISIONS:
        from omegaconf import OmegaConf

        from optbench.config import PrecisionConfig, conf_dir

        values = OmegaConf.to_container(OmegaConf.load(conf_dir() / "precision" / f"{name}.yaml"))
        values.pop("defaults", None)
        _PRECISIONS[name] = PrecisionConfig(**values)
    return _PRECISIONS[name]


def budget_bytes(cfg: Config, *, world_size: int) -> tuple[int, str]:
    """What one device may use: ``estimate.gpu``'s memory less the headroom, or on this machine
    (``gpu=none``) ``estimate.device_gb`` or its RAM shared by the ranks."""
    from optbench.estimate.api import device_budget

    device = device_budget(cfg)
    if device is not None:
        return device["usable_bytes"], f"{device['name']} {device['capacity_bytes'] / 2**30:.3g} GiB"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    usable = int(ram * (1 - cfg.estimate.headroom) / world_size)
    return usable, f"this machine's RAM ({ram / 2**30:.0f} GiB over {world_size} rank(s))"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------------ the search
def plan(cfg: Config) -> dict[str, Any]:
    """Every (parallel, precision, checkpointing) searched, the candidates predicted, ranked."""
    from optbench.estimate.api import check_world_size

    started = time.perf_counter()
    world = cfg.estimate.world_size or 1
    check_world_size(cfg, world_size=world, parallel="fsdp2" if world > 1 else "single")
    total, per_rank = global_batch(cfg, world_size=world)
    budget, device = budget_bytes(cfg, world_size=world)
    candidates: list[Candidate] = []
    refused: list[str] = []
    context = _Context(cfg)
    for parallel, precision, ac in search_space(cfg, world_size=world):
        found, why = _combination(context, parallel=parallel, precision=precision, ac=ac, world=world,
                                  per_rank=per_rank, budget=budget)
        candidates += found
        if why:
            refused.append(why)
    context.prepare(candidates, world=world)
    for candidate in candidates:
        cfg_of, typical, heavy = candidate.traced
        candidate.speed, candidate.rank_step_s = context.predict(cfg_of, world=world, typical=typical, heavy=heavy)
        candidate.traced = None
    if not candidates:
        raise ConfigError(f"no configuration of model={cfg.model.name} fits {device} at a global batch of {total} "
                          f"samples on {world} rank(s): " + "; ".join(refused[:3]) + "; use more ranks or a "
                          "smaller train.seq_len")
    candidates.sort(key=lambda c: c.rank_key, reverse=True)
    return {"model": cfg.model.name, "world_size": world, "global_batch": total, "seq_len": cfg.train.seq_len,
            "device": device, "budget_bytes": budget, "target": context.target, "ranked_by": context.ranked_by,
            "candidates": [_row(c) for c in candidates], "refused": refused,
            "left_out": left_out(cfg, world_size=world),
            "elapsed_s": time.perf_counter() - started}


class _Context:
    """What every candidate shares: the target device, and on this machine one per-op benchmark
    (``prepare``: every candidate's ops timed together, each distinct op once)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.here = cfg.estimate.gpu == "none"
        self.device_type = "cpu" if self.here else "cuda"
        self.target = "this machine (per-op benchmark)" if self.here else f"{cfg.estimate.gpu} (roofline)"
        self.ranked_by = ("predicted step with each op at its fastest round of the benchmark (the steadier "
                          "comparison); tokens/s and step: each op at its median round, what a run's median step "
                          "measures") if self.here else "predicted tokens/s"
        self.costs: Any = None

    def prepare(self, candidates: list[Candidate], *, world: int) -> None:
        """On this machine: one benchmark of every candidate's ops, interleaved (see the module's
        docstring), before any candidate is predicted."""
        from optbench.estimate.predict import on_this_machine, step_calls

        if not self.here or not candidates:
            return
        cfg, _, _ = candidates[0].traced
        self.costs = on_this_machine(cfg, device=torch.device("cpu"), world_size=world).costs
        self.costs.prepare([call for c in candidates for call in step_calls(*c.traced[1:])])

    def predict(self, cfg: Config, *, world: int, typical: Any, heavy: Any) -> tuple[dict[str, Any], float | None]:
        """The candidate's prediction, and on this machine the ranking's step: the same prediction
        summed with each op at its fastest round (see the module's docstring; None on a roofline)."""
        from optbench.estimate.api import GPUS, count_model
        from optbench.estimate.predict import complete, on_gpu, on_this_machine, predict

        counts = count_model(cfg)
        if self.here:
            prediction = on_this_machine(cfg, device=torch.device("cpu"), world_size=world)
            prediction.costs = self.costs  # ``prepare``'s, holding every candidate's ops timed together
        else:
            prediction = on_gpu(cfg, key=GPUS[cfg.estimate.gpu][0], world_size=world)
        speed = complete(prediction, typical=typical, heavy=heavy, flops_per_token=counts.flops_per_token,
                         seq_len=counts.seq_len, trainable_params=counts.trainable,
                         device=torch.device("cpu") if self.here else None)
        if not self.here:
            return speed, None
        prediction.costs = self.costs.fastest()
        return speed, predict(prediction, typical=typical, heavy=heavy)["step_time_s"]

def _combination(context: _Context, *, parallel: str, precision: str, ac: tuple[str, int], world: int,
                 per_rank: int, budget: int) -> tuple[list[Candidate], str | None]:
    """The candidates of one (parallel, precision, checkpointing): the two largest micro-batches
    that divide the per-rank batch and fit, each traced (``plan`` predicts them). Their model is
    built once, and their steps are the search's where they are the same (``_Steps``)."""
    from optbench.estimate.tracer import step_tracer

    name = f"{parallel} {precision} ac={ac[0]}"
    probe = configured(context.cfg, parallel=parallel, precision=precision, ac=ac, micro_batch=1,
                       accum=2, world_size=world)
    with step_tracer(probe, world_size=world, target=context.device_type,
                     workspaces=_workspaces(probe, context)) as trace:
        steps = _Steps(trace, per_rank=per_rank)
        sizes = _fitting_sizes(steps.search, per_rank=per_rank, budget=budget)
        if isinstance(sizes, int):
            return [], f"{name}: {sizes / 2**30:.2f} GiB per device at micro-batch 1"
        found = []
        for micro_batch in sizes[-2:]:
            candidate = _candidate(context, steps, parallel=parallel, precision=precision, ac=ac, world=world,
                                   micro_batch=micro_batch, accum=per_rank // micro_batch)
            if candidate.peak_bytes <= budget:
                found.append(candidate)
    return found, None


class _Steps:
    """One configuration's traced steps with their ops, kept by (micro-batch, accumulation): a
    candidate whose step the search traced is that very trace. The search traces each micro-batch
    with its own accumulation up to 2 (``search``): the per-rank batch in one micro-step, which is
    that candidate's step, and a smaller micro-batch with two micro-steps, the second of which
    finds the gradients allocated (the steady peak of any longer accumulation, and the step of the
    candidates of accumulation 2)."""

    def __init__(self, trace: Any, *, per_rank: int) -> None:
        self.trace, self.per_rank = trace, per_rank
        self.steps: dict[tuple[int, int], Any] = {}

    def search(self, micro_batch: int) -> int:
        """The steady peak of ``micro_batch`` samples per micro-step, in bytes."""
        step = self(micro_batch, accum=min(self.per_rank // micro_batch, 2), ops=True)
        return step.steady_peak().total

    def __call__(self, micro_batch: int, *, accum: int, ops: bool = False, with_aux: bool = True) -> Any:
        kept = ops and with_aux
        if kept and (micro_batch, accum) in self.steps:
            return self.steps[micro_batch, accum]
        step = self.trace(micro_batch, accum=accum, ops=ops, with_aux=with_aux)
        if kept:
            self.steps[micro_batch, accum] = step
        return step


def _fitting_sizes(search: Any, *, per_rank: int, budget: int) -> list[int] | int:
    """The divisors of the per-rank batch whose step fits (``search(micro_batch)``: its steady peak,
    ``_Steps.search``), or the peak at micro-batch 1 when none does. The per-rank batch itself
    runs in one micro-step; the smaller ones accumulate, and their peak grows with the
    micro-batch: where the largest of them fits they all do (a second trace), else the largest
    that fits is found by bisection."""
    sizes = divisors(per_rank)
    top = search(sizes[-1])
    rest = sizes[:-1]  # with accumulation
    if not rest:
        return sizes if top <= budget else top
    low, high = 0, len(rest) - 1  # rest[:low] fit; rest[high + 1:] do not
    first = None  # the peak at micro-batch 1, where nothing fits (the bisection reaches it)
    if top <= budget:  # then most likely the next one down as well: tried first
        peak = search(rest[-1])
        low, high = (len(rest), high) if peak <= budget else (0, high - 1)
    while low <= high:
        middle = (low + high) // 2
        peak = search(rest[middle])
        first = peak if middle == 0 else first
        if peak <= budget:
            low = middle + 1
        else:
            high = middle - 1
    fitting = rest[:low] + ([sizes[-1]] if top <= budget else [])
    return fitting or first


def _candidate(context: _Context, steps: _Steps, *, parallel: str, precision: str, ac: tuple[str, int], world: int,
               micro_batch: int, accum: int) -> Candidate:
    """One candidate traced with its ops (``steps``: its configuration's, ``_Steps``)."""
    from optbench.estimate.predict import traces_for

    cfg = configured(context.cfg, parallel=parallel, precision=precision, ac=ac, micro_batch=micro_batch,
                     accum=accum, world_size=world)

    def traced(batch: int, **kwargs: Any) -> Any:
        return steps(batch, accum=accum, **kwargs)

    step = traced(micro_batch, ops=True)
    typical, heavy = traces_for(cfg, traced, micro_batch, first=step)
    return Candidate(parallel, precision, ac, micro_batch, accum, step.steady_peak().total,
                     traced=(cfg, typical, heavy))


def _workspaces(cfg: Config, context: _Context) -> int:
    from optbench.estimate.api import gpu_workspaces

    return 0 if context.here else gpu_workspaces(cfg)


def _row(c: Candidate) -> dict[str, Any]:
    speed = c.speed or {}
    return {"overrides": c.overrides, "tokens_per_s": speed.get("tokens_per_s"), "step_time_s": speed.get("step_time_s"),
            "rank_step_time_s": c.rank_step_s, "mfu": speed.get("mfu"), "peak_bytes": c.peak_bytes,
            "breakdown_s": speed.get("breakdown_s")}


# ------------------------------------------------------------------------------------- printing
def format_plan(result: dict[str, Any], *, top: int) -> str:
    lines = [f"optbench plan: model={result['model']} on {result['world_size']} x {result['device']}, global batch "
             f"{result['global_batch']} samples x {result['seq_len']} tokens, predicted on {result['target']}",
             f"  {'rank':<5}{'tokens/s':>12}{'step s':>10}{'MFU':>7}{'peak/device':>13}  overrides"]
    for index, row in enumerate(result["candidates"][:top], start=1):
        mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
        lines.append(f"  {index:<5}{row['tokens_per_s']:>12,.0f}{row['step_time_s']:>10.4g}{mfu:>7}"
                     f"{row['peak_bytes'] / 2**30:>9.2f} GiB  {' '.join(row['overrides'])}")
    lines.append(f"  ranked by the {result['ranked_by']}")
    lines += [f"  does not fit: {why}" for why in result["refused"]]
    lines += [f"  left out: {why}" for why in result.get("left_out", [])]
    lines.append(f"  {len(result['candidates'])} configurations that fit, predicted in {result['elapsed_s']:.1f} s")
    return "\n".join(lines)
