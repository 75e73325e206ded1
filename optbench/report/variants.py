"""A variant: the runs of one resolved config on one device (repeats pooled), its throughput,
loss and memory, the group it belongs to (model and task), and the label a report shows."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optbench.config.renames import upgrade_and_warn
from optbench.errors import ReportError
from optbench.report.runs import (
    Run,
    dig,
    num,
)
from optbench.report.stats import (
    MIN_TIMED_STEPS,
    Throughput,
    bootstrap_tokens_per_s,
    pooled_throughput,
)
from optbench.summary import RunSummary

Field = Callable[[RunSummary], Any]  # one value of a run's record: lambda s: s.loss.final

LOSS: dict[str, Field] = {"eval": lambda s: s.loss.eval, "final": lambda s: s.loss.final}  # by Variant.loss's kind


@dataclass
class Variant:
    key: str
    runs: list[Run]
    label: str = ""
    tag: str = ""  # "#3": the Hydra job number of a sweep's job (else its place in the report), "A"/"B" in a compare
    is_baseline: bool = False
    throughput: Throughput | None = None
    boot: np.ndarray | None = None
    ceilings: dict[str, tuple[float, str]] = field(default_factory=dict)  # the group's highest, per ceiling_key

    _completed: tuple[int, list[Run]] = field(default=(-1, []), init=False, repr=False, compare=False)

    @property
    def completed(self) -> list[Run]:
        """The runs that completed; counted again only when runs were added (``_completed``: how many
        runs there were then, and these): every cell of the report asks, and 10,000 repeats made it slow."""
        if self._completed[0] != len(self.runs):
            self._completed = (len(self.runs), [r for r in self.runs if r.completed])
        return self._completed[1]

    @property
    def first(self) -> Run:
        return self.runs[0]

    @property
    def status(self) -> str:
        done = len(self.completed)
        if done == len(self.runs):
            return "completed"
        if done == 0:
            return self.first_failure.status
        return f"completed {done}/{len(self.runs)}"

    @property
    def first_failure(self) -> Run:
        return next(r for r in self.runs if not r.completed)

    @property
    def reason(self) -> str | None:
        if len(self.completed) == len(self.runs):
            return None
        failed = self.first_failure
        return f"{failed.status}: {failed.error or 'no error recorded'}"

    def _values(self, value: Field) -> list[float] | None:
        """``value`` of every completed run; None when there is none or one is not a finite number."""
        values = [num(value(r.summary)) for r in self.completed]
        return None if not values or any(v is None for v in values) else values

    def mean_of(self, value: Field) -> float | None:
        values = self._values(value)
        return None if values is None else float(np.mean(values))

    def max_of(self, value: Field) -> float | None:
        values = self._values(value)
        return None if values is None else max(values)

    def median_of(self, value: Field) -> float | None:
        values = self._values(value)
        return None if values is None else float(np.median(values))

    def loss(self) -> tuple[float | None, str]:
        """Eval loss on the fixed held-out batches when every run has one, else the final train loss."""
        value = self.mean_of(LOSS["eval"])
        return (value, "eval") if value is not None else (self.mean_of(LOSS["final"]), "final")

    def peak_memory(self) -> float | None:
        return self.max_of(lambda s: s.memory.peak_bytes)  # the largest of the repeats: what must fit

    def own_peak(self) -> tuple[float | None, str | None]:
        """(FLOP/s, source): the highest peak its runs measured against (a CPU ceiling only rises)."""
        best: tuple[float | None, str | None] = (None, None)
        for run in self.completed:
            value = num(run.summary.throughput.peak_flops)
            if value is not None and (best[0] is None or value > best[0]):
                best = (value, run.summary.throughput.peak_source)
        return best

    def peak(self) -> tuple[float | None, str | None]:
        """(FLOP/s, source) of the peak behind this variant's MFU: its own, or a higher one measured
        the same way (same dtype, size and threads) by another run in its group (``ceilings``): a CPU
        ceiling measured later, on a quieter moment, shows the earlier one was too low, and every
        MFU of the group is then against one peak, comparable (and never overstated)."""
        own = self.own_peak()
        key = ceiling_key(own[1])
        if key is not None and key in self.ceilings and own[0] is not None and self.ceilings[key][0] >= own[0]:
            return self.ceilings[key]
        return own

    def flops_per_token(self) -> float | None:
        return num(self.completed[0].summary.model.flops_per_token) if self.completed else None

    def world_size(self) -> int:
        return int(num(self.completed[0].summary.world_size) or 1) if self.completed else 1

    def mfu(self) -> float | None:
        """MFU of the pooled throughput every table shows: tokens/s x FLOPs per token / (peak x world
        size). Not the mean of the runs' own MFUs: over repeats of unequal speed that disagrees with
        the pooled tokens/s (issue 27: 13,211 tokens/s at 15.2% beside 9,888 at 16.7%)."""
        peak, fpt = self.peak()[0], self.flops_per_token()
        if self.throughput is None or not peak or fpt is None:
            return None
        return self.throughput.tokens_per_s * fpt / (peak * self.world_size())

    def schedule(self) -> tuple[int | None, int | None]:
        """(train.steps, train.seq_len) of its runs: a loss after another number of steps or of
        another sequence length is another experiment."""
        train = dig(self.first.summary.config, "train")
        train = train if isinstance(train, dict) else {}
        return num(train.get("steps")), num(train.get("seq_len"))

    def tokens_per_update(self) -> int | None:
        """Tokens per optimizer step (the batch a loss is trained with), as the runs report it."""
        values = {num(r.summary.throughput.tokens_per_step) for r in self.completed}
        return int(values.pop()) if len(values) == 1 and None not in values else None

    def prepare(self) -> None:
        self.throughput = pooled_throughput(self.completed)
        if self.throughput is not None and self.throughput.timed_steps >= MIN_TIMED_STEPS:
            self.boot = bootstrap_tokens_per_s(self.throughput, seed_key=self.key)


def variant_key(run: Run) -> str:
    """Runs of one resolved config are repeats of one variant (A and B of a compare stay apart,
    even in an A/A test)."""
    side = f"{run.side} " if run.side else ""
    device = f" on {run.summary.device}"
    mixed = f" {config_changed(run)}" if config_changed(run) else ""  # half one config: never pooled
    if run.summary.config_hash:
        return f"{side}config {run.summary.config_hash}{device}{mixed}"
    return f"{side}overrides {' '.join(sorted(run.overrides))}{device}{mixed}"


def config_changed(run: Run) -> str | None:
    """"(config changed at step N: key was -> now, ...)" for a run resumed under a changed config."""
    record = run.summary.checkpoint
    changes = record.config_changes if record is not None else None
    if not isinstance(changes, list) or not changes:
        return None
    what = ", ".join(f"{c.get('key')} {c.get('was')} -> {c.get('now')}" for c in changes if isinstance(c, dict))
    return f"(config changed at step {record.resumed_step}: {what})"


def group_key(run: Run) -> tuple[str, str, str, str]:
    """(model name, task, exact model shape, schedule): runs are compared only within one group. The
    schedule is train.steps and train.seq_len: a 14-step run and a 30-step run of one config are two
    experiments (their losses differ by the training, not by the config)."""
    config = run.summary.config
    model = dig(config, "model") if isinstance(dig(config, "model"), dict) else {}
    overrides = run.override_map()
    name = run.summary.model.name or model.get("name") or overrides.get("model") or "?"
    task = run.summary.task or dig(config, "task.name") or overrides.get("task") or "?"
    return str(name), str(task), json.dumps(model, sort_keys=True, default=str), schedule_text(run)


def schedule_text(run: Run) -> str:
    """"14 steps x seq 256" (what is known of it)."""
    train = dig(run.summary.config, "train")
    train = train if isinstance(train, dict) else {}
    parts = [f"{train['steps']} steps" if num(train.get("steps")) is not None else "",
             f"seq {train['seq_len']}" if num(train.get("seq_len")) is not None else ""]
    return " x ".join(p for p in parts if p)


# ------------------------------------------------------------------------- --baseline, --candidate
def parse_selector(items: list[str] | None, *, option: str) -> list[tuple[str, str]]:
    selector = []
    for item in upgrade_and_warn(items or []):  # an old name (ac=none) as train reads it
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ReportError(f"{option} takes KEY=VALUE (an override, e.g. phase=0_baseline), got '{item}'")
        selector.append((key.lstrip("+"), value))
    return selector


def matches(variant: Variant, selector: list[tuple[str, str]]) -> bool:
    overrides = variant.first.override_map()
    for key, value in selector:
        actual = overrides[key] if key in overrides else config_value(variant.first, key)
        if actual != value:
            return False
    return True


CEILING = re.compile(r"measured CPU matmul ceiling, \S+ \d+\^3 best of \d+, \d+ threads?")


def ceiling_key(source: str | None) -> str | None:
    """What makes two measured CPU ceilings comparable ("float32 1024^3 best of 5, 2 threads"), or None."""
    match = CEILING.match(source or "")
    return match.group(0) if match else None


def align_ceilings(variants: list[Variant]) -> None:
    """Give every variant the highest CPU ceiling the group's runs measured the same way."""
    best: dict[str, tuple[float, str]] = {}
    for variant in variants:
        flops, source = variant.own_peak()
        key = ceiling_key(source)
        if key is not None and flops is not None and (key not in best or flops > best[key][0]):
            best[key] = (flops, f"{source}; the highest of this group's runs, measured the same way")
    for variant in variants:
        variant.ceilings = best


def job_number(run: Run) -> int | None:
    """The Hydra job number of a sweep's job dir ("3_model=tiny,phase=3_loss_freq" or "3"), as the sweep's
    recap prints it (#3)."""
    match = re.match(r"(\d+)(_|$)", run.dir.name)
    return int(match.group(1)) if match else None


def tag_variants(variants: list[Variant]) -> None:
    """The short name every table and plot gives a variant: its side in a compare, its job number
    in a sweep (the numbers the sweep printed), else its place in the report (from 0)."""
    numbers = [job_number(v.first) if len(v.runs) == 1 else None for v in variants]
    by_job = None not in numbers and len(set(numbers)) == len(numbers)
    sides = [v.first.side for v in variants if v.first.side]
    by_side = len(set(sides)) == len(sides)  # two compares reviewed together: their A and B are numbered
    for index, (variant, number) in enumerate(zip(variants, numbers, strict=True)):
        variant.tag = (variant.first.side if by_side else None) or f"#{number if by_job else index}"


def config_value(run: Run, key: str) -> str | None:
    value = dig(run.summary.config, key)
    if isinstance(value, dict):  # a group: its preset's name, or its first field
        value = value["name"] if "name" in value else next(iter(value.values()), None)
    return None if value is None or isinstance(value, (dict, list)) else str(value)


def effective_value(variant: Variant, key: str) -> str:
    """The value of ``key`` for this variant: its override, else its resolved config, else "-"."""
    overrides = variant.first.override_map()
    if key in overrides:
        return overrides[key]
    return config_value(variant.first, key) or "-"


def label_variants(variants: list[Variant]) -> None:
    """Label each variant by the overrides that differ between variants (not the whole config)."""
    keys: list[str] = []
    for variant in variants:
        for key in variant.first.override_map():
            if key not in keys:
                keys.append(key)
    differing = [k for k in keys if len({effective_value(v, k) for v in variants}) > 1]
    if not differing and not any(v.first.side for v in variants):
        differing = keys  # one variant, or variants that differ only in the device: name them fully
    devices = {str(v.first.summary.device) for v in variants if v.first.summary.device}
    short = {d.split(" (")[0] for d in devices}
    for variant in variants:
        parts = [f"{k}={effective_value(variant, k)}" for k in differing]
        side = variant.first.side
        variant.label = " ".join(([side] if side else []) + parts) or "(defaults)"
        device = variant.first.summary.device
        if len(devices) > 1 and device:  # the same config on two machines: two variants
            variant.label += f" on {device.split(' (')[0] if len(short) == len(devices) else device}"
        changed = config_changed(variant.first)
        if changed:  # resumed under another config: not the config its overrides name
            variant.label += f" {changed}"
    counts: dict[str, int] = {}
    for variant in variants:
        counts[variant.label] = counts.get(variant.label, 0) + 1
    for variant in variants:
        if counts[variant.label] > 1:  # same overrides, different resolved config (conf/ changed)
            variant.label += f" [{variant.first.summary.config_hash or variant.first.dir.name}]"
