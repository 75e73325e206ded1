"""The whole model's traced step from the traces of two short copies of it (``optbench estimate``
in seconds for 9.9B/13.1B models).

A decoder's blocks are identical, so a step of an ``L``-block model is a step of a short model with
its middle repeated. Two copies are traced: ``a`` with ``la`` blocks and ``b`` with one *unit* more
(a unit is one block, or ``every`` blocks under selective activation checkpointing, whose pattern
repeats with that period). Every tracked op of a step is an *event* (the device bytes, by component,
after the op), labeled by the block it ran in. In ``b`` the events of the extra unit (the *middle*)
form runs; with them removed, ``b``'s runs line up one for one with ``a``'s.

* An event outside the middle holds the same things in both copies except the state of one more
  unit (its parameters, its saved activations, its gradients: whatever of the unit exists at that
  moment), so in the ``L``-block model it holds ``b + k (b - a)`` bytes, ``k`` the units beyond
  ``b``'s. Runs whose events pair up are extrapolated event by event (exact); a run whose event
  count differs between the copies (a per-parameter loop: CPU gradient clipping, the optimizer's
  state set-up; in every default config) is extrapolated through its largest event
  (``approximate_runs`` counts them; lining such loops up step by step would need each op's
  identity, since some of their steps also grow with the model). A block's run whose count
  differs means the blocks are not alike in the trace: NotStackable, and ``optbench.estimate.tracer`` tries
  the peaks of three copies on a line, then the whole model.
* A middle run becomes ``k + 1`` copies of itself in a row, each starting where the last ended: the
  run's profile relative to its start is the unit's own, and each copy starts ``net`` (the run's
  end minus its start) higher than the one before. Its largest event is at the first copy or the
  last, whichever ``net``'s sign favours.

The peak of each part of the step (before the optimizer step, during it) is the largest of these;
the most activation bytes held before the optimizer step (``StepTrace.activation_peak``) is the
largest of the same events by their activations (``stack(by=...)``), not a line through the two
copies' own maxima: a copy's may sit in the loss where the whole model's sits in its blocks.
``tests/estimate/test_estimate.py`` checks the result against the whole model's trace, byte for byte.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

# a decoder block's module name: the first numbered component of its path (optbench's "layers.3",
# transformers' "model.layers.3" or GPT-2's "transformer.h.3", the blocks of any decoder found by
# optbench.model.decoder; what lies inside a block, e.g. a mixture's "experts.5", comes after it)
_LAYER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@functools.lru_cache(maxsize=8192)  # asked of the active modules' names on every traced op
def _depth_key(name: str) -> tuple[int, int, int, str]:
    """A name inside a block first, and of those the lower block: in backward the module tracker
    holds two blocks at once, ``layers.1``'s last modules finishing (a transformers block's
    attention hands back its input's gradient after the next block's MLP has started) while
    ``layers.0`` runs, and the one now running is the lower; then deeper first; then the name:
    never the order of a set, which moves with Python's hash seed."""
    match = _LAYER.search(name)
    return (1, -int(match.group(1)), len(name), name) if match else (0, 0, len(name), name)


def innermost(module_names: Any) -> str | None:
    """The innermost of the active modules' names, the same on every run."""
    return max(module_names, key=_depth_key, default=None)


def block_index(module_names: Any) -> int | None:
    """The index of the block (``layers.<i>``) the innermost active module belongs to, or None."""
    # a name inside a block has the depth key (1, -index, ...), and those outrank every other name
    key = max(map(_depth_key, module_names), default=None)
    return None if key is None or not key[0] else -key[1]


@dataclass(frozen=True)
class Event:
    """Device bytes after one op: by component (the estimate's order), in all, and where it ran."""

    components: tuple[int, ...]
    total: int
    where: tuple[str, str | None]

    def plus(self, other: Event, times: int = 1) -> Event:
        return Event(tuple(x + times * y for x, y in zip(self.components, other.components, strict=True)),
                     self.total + times * other.total, self.where)

    def minus(self, other: Event) -> Event:
        return self.plus(other, -1)


@dataclass
class Timeline:
    """The events of one traced step in order, each with its block index, in parts (a new part at
    each ``new_part``: before the optimizer step, during it)."""

    parts: list[list[tuple[int | None, Event]]] = field(default_factory=lambda: [[]])

    def record(self, block: int | None, event: Event) -> None:
        self.parts[-1].append((block, event))

    def new_part(self) -> None:
        self.parts.append([])


@dataclass(frozen=True)
class Plan:
    """Which short copies to trace for a ``layers``-block model: ``la`` and ``la + period`` blocks,
    and ``extra`` units beyond the longer one."""

    layers: int
    period: int
    la: int

    @property
    def lb(self) -> int:
        return self.la + self.period

    @property
    def extra(self) -> int:
        return (self.layers - self.lb) // self.period

    def describe(self) -> str:
        unit = "block" if self.period == 1 else f"unit of {self.period} blocks"
        return (f"stacked from traces of {self.la} and {self.lb} blocks (one {unit} repeated to "
                f"{self.layers} blocks)")


def plan_for(layers: int, *, period: int) -> Plan | None:
    """The copies to trace, or None when the model is too short for them to pay: together they must
    have at most half the model's blocks (each trace also runs the embedding, the head and the
    optimizer, and a fallback traces more)."""
    la = 2 * period + layers % period
    plan = Plan(layers=layers, period=period, la=la)
    return plan if 2 * (plan.la + plan.lb) <= layers else None


class NotStackable(Exception):
    """The two copies' steps do not line up (the blocks are not alike): trace the whole model."""


def _runs(part: list, key: Any) -> list[tuple[Any, list[Event]]]:
    """The part's events grouped into runs of one key; events outside every block but between two
    blocks (FSDP2's all-gather copy-out between one block's forward and the next) belong to the
    block before them."""
    runs = [(k, [event for _, event in group]) for k, group in groupby(part, key=lambda item: key(item[0]))]
    merged: list[tuple[Any, list[Event]]] = []
    for index, (k, events) in enumerate(runs):
        between = k is None and 0 < index < len(runs) - 1 and runs[index + 1][0] is not None
        if between and merged and merged[-1][0] is not None:
            merged[-1][1].extend(events)
        elif merged and merged[-1][0] == k:
            merged[-1][1].extend(events)
        else:
            merged.append((k, events))
    return merged


def moved(module: str | None, shift: int, *, at_least: int) -> str | None:
    """``module`` with its block index moved by ``shift`` (blocks at or past ``at_least``)."""
    if module is None or not shift:
        return module

    def move(match: re.Match) -> str:
        index = int(match.group(1))
        return match.group(0).replace(match.group(1), str(index + shift if index >= at_least else index))

    return _LAYER.sub(move, module, count=1)


def rename(event: Event, shift: int, *, at_least: int) -> Event:
    """The event with its module's block index moved by ``shift`` (blocks at or past ``at_least``)."""
    phase, module = event.where
    return Event(event.components, event.total, (phase, moved(module, shift, at_least=at_least)))


@dataclass
class _Stacker:
    plan: Plan
    by: int | None = None  # the largest event by this component (an index of Event.components), else by total
    approximate_runs: int = 0

    def size(self, event: Event) -> int:
        return event.total if self.by is None else event.components[self.by]

    def key_a(self, block: int | None) -> Any:
        p = self.plan.period
        return None if block is None else ("first", block) if block < p else ("rest", block)

    def key_b(self, block: int | None) -> Any:
        p = self.plan.period
        if block is None:
            return None
        return ("first", block) if block < p else "middle" if block < 2 * p else ("rest", block - p)

    def peak(self, part_a: list, part_b: list) -> Event | None:
        runs_a, runs_b = _runs(part_a, self.key_a), _runs(part_b, self.key_b)
        outer_b = [(k, events) for k, events in runs_b if k != "middle"]
        if [k for k, _ in outer_b] != [k for k, _ in runs_a]:  # a run split by a middle one differs too
            raise NotStackable("the short copies' steps do not line up block for block")
        extrapolated = {id(events_b): self._extrapolate(events_a, events_b, block=k is not None)
                        for (k, events_a), (_, events_b) in zip(runs_a, outer_b, strict=True)}
        best: Event | None = None
        last = last_b = last_key = None  # the previous run's last event (the whole model's, copy b's), its key
        for k, events in runs_b:
            if k == "middle":
                if last is None or last_b is None:
                    raise NotStackable("the step starts inside a repeated block")
                forward = isinstance(last_key, tuple) and last_key[0] == "first"  # after the first unit
                candidate = self._middle(events, start_b=last_b, start=last, backward=not forward)
            else:
                run = extrapolated[id(events)]
                candidate, last, last_b, last_key = max(run, key=self.size), run[-1], events[-1], k
            if best is None or self.size(candidate) > self.size(best):
                best = candidate
        return best

    def _extrapolate(self, events_a: list[Event], events_b: list[Event], *, block: bool) -> list[Event]:
        k, shift = self.plan.extra, self.plan.extra * self.plan.period
        if len(events_a) == len(events_b):
            out = [b.plus(b.minus(a), k) for a, b in zip(events_a, events_b, strict=True)]
        elif block:  # the blocks are not alike in the trace
            raise NotStackable("a block's ops differ between the short copies")
        else:  # a per-parameter loop: through the largest event (and the last, which the next run starts from)
            self.approximate_runs += 1
            top_a, top_b = max(events_a, key=self.size), max(events_b, key=self.size)
            out = [top_b.plus(top_b.minus(top_a), k), events_b[-1].plus(events_b[-1].minus(events_a[-1]), k)]
        return [rename(e, shift, at_least=2 * self.plan.period) for e in out]

    def _middle(self, events: list[Event], *, start_b: Event, start: Event, backward: bool) -> Event:
        top = max(events, key=lambda e: self.size(e) - self.size(start_b))
        net = events[-1].minus(start_b)
        copies = self.plan.extra if self.size(net) > 0 else 0  # the last copy of k + 1, or the first
        peak = start.plus(top.minus(start_b)).plus(net, copies)
        # the j-th copy in time is block p + j p going forward, and block p + (k - j) p in backward
        blocks_on = (self.plan.extra - copies if backward else copies) * self.plan.period
        return rename(Event(peak.components, peak.total, top.where), blocks_on, at_least=self.plan.period)


def stack(plan: Plan, timeline_a: Timeline, timeline_b: Timeline, *, by: int | None = None,
          parts: int | None = None) -> tuple[list[Event | None], int]:
    """Per part of the step (the first ``parts``, or all), the ``plan.layers``-block model's
    largest event (by total, or by the component of index ``by``); and how many runs were
    extrapolated through their largest event only."""
    if len(timeline_a.parts) != len(timeline_b.parts):
        raise NotStackable("the short copies' steps have different parts")
    stacker = _Stacker(plan, by=by)
    pairs = list(zip(timeline_a.parts, timeline_b.parts, strict=True))[:parts]
    peaks = [stacker.peak(a, b) if b else None for a, b in pairs]
    return peaks, stacker.approximate_runs


def linear(value_a: int, value_b: int, plan: Plan) -> int:
    """A per-unit quantity of the ``plan.layers``-block model from the two copies' values."""
    return value_b + plan.extra * (value_b - value_a)


def collinear(values: list[int]) -> bool:
    """Three values, one unit apart, on a line."""
    first, second, third = values
    return second - first == third - second
