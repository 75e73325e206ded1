"""The per-op benchmark: each distinct op of a traced step (``optbench.estimate.ops``) run on real
tensors of its traced shapes, strides and dtypes on this machine, and timed.

Each ``OpCall`` is timed once however often the step runs it (every block runs the same ops), so
the cost does not grow with depth. Float tensors hold uniform [0, 1) values (no NaN through sqrt or
log), integer ones zeros (valid indices); denormals are flushed while timing (a real step's values
are normal; an in-place op repeated on its own output could otherwise drift into them). The time of
a call is the median of repeated calls after one warm-up, synchronized on a GPU, measured once per
process for a device and thread count (a sweep's jobs and the planner's candidates share their
ops). Collectives are not run here: ``optbench.estimate.speed`` models them from their message sizes.

The ops of a step are timed **interleaved** (``OpTimes.prepare``): round after round, each op once,
in the order the step runs them, so each op runs after the ops it follows in the step, as the step
meets it. An op repeated back to back on the same inputs runs warmer than it does in the step: on
this project's CPU, over eleven alternating rounds, the eager tiny step was predicted a median 17%
short that way and 7% short interleaved, at the same cost (docs/estimate-speed.md).

Each op counts at its **median** round, not its fastest: a prediction is checked against a run's
median step, which sums the ops' typical times. Counting each op's fastest round put the tiny step
a median 7% short over eleven runs, its median round +1% (docs/estimate-speed.md). The fastest
round is kept too (``Seconds.fastest``): it is what the op takes when the host leaves the machine
alone, the steadier basis for *comparing* two steps, and the planner ranks by it
(``MachineCosts.fastest``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

from optbench.estimate.ops import OpCall, TensorSpec
from optbench.measure import synchronize

MIN_SECONDS = 0.004  # time each op for at least this long (or MAX_REPEATS calls) after its warm-up
MIN_REPEATS, MAX_REPEATS = 5, 50  # an op's median: of at least 5 rounds


class Seconds(float):
    """An op's seconds, its median round, carrying its fastest round as ``fastest``."""

    fastest: float

    def __new__(cls, median: float, fastest: float) -> Seconds:
        seconds = super().__new__(cls, median)
        seconds.fastest = fastest
        return seconds

    def __reduce__(self) -> tuple:
        return Seconds, (float(self), self.fastest)


def fastest(seconds: float) -> float:
    """The fastest round of an op timed here (``Seconds``); a plain float is its own."""
    return getattr(seconds, "fastest", seconds)


class NotRunnable(Exception):
    """An op whose arguments cannot be rebuilt as real tensors (a process group, a generator)."""


def real_args(call: OpCall, device: torch.device) -> tuple[tuple, dict]:
    """Real arguments for ``call``: fresh tensors of each TensorSpec's layout."""

    def build(value: Any) -> Any:
        if isinstance(value, TensorSpec):
            return real_tensor(value, device)
        if isinstance(value, tuple) and value[:1] == ("opaque",):
            raise NotRunnable(f"{call.name}: argument of type {value[1]}")
        if isinstance(value, tuple):
            return [build(v) for v in value]
        return value

    args = tuple(build(v) for v in call.args)
    kwargs = {k: build(v) for k, v in call.kwargs}
    return args, kwargs


def real_tensor(spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """A tensor of ``spec``'s layout over a storage just large enough (broadcast strides included)."""
    length = _storage_length(spec)
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        dtype = torch.float32 if spec.dtype.itemsize == 1 else spec.dtype
        base = torch.rand(length, device=device, dtype=dtype, generator=_generator(device))
        base = base.to(spec.dtype)  # float8 has no uniform_ kernel: cast
    elif spec.dtype == torch.bool:
        base = torch.ones(length, device=device, dtype=torch.bool)
    else:
        base = torch.zeros(length, device=device, dtype=spec.dtype)
    return base.as_strided(spec.shape, spec.stride)


def _storage_length(spec: TensorSpec) -> int:
    """Elements of the smallest storage that holds ``spec``'s layout (broadcast strides included)."""
    if not all(spec.shape):
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(spec.shape, spec.stride, strict=True))


_GENERATORS: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    """The benchmark's own random numbers: the global RNG a run draws its data from is left alone."""
    if device not in _GENERATORS:
        _GENERATORS[device] = torch.Generator(device=device).manual_seed(0)
    return _GENERATORS[device]


@contextlib.contextmanager
def _flushed_denormals() -> Iterator[None]:
    before = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if before:  # set_flush_denormal returns whether the CPU supports it; restore the default
            torch.set_flush_denormal(False)


def time_call(call: OpCall, *, device: torch.device) -> float:
    """Seconds of one ``call`` on real tensors on ``device``: the median of its repeats."""
    return _time_group([(call, *real_args(call, device))], device=device)[call]


# (device, threads, op) -> its seconds, or None when it cannot run here: each op is timed once per
# process, as cudnn.benchmark picks a kernel once per shape (a sweep's jobs run in one process and
# share most of their ops; timing them again would cost each job the same seconds for the same answer)
_TIMED: dict[tuple[str, int, OpCall], float | None] = {}

PREPARED_BYTES = 1 << 30  # the real inputs held at once while timing interleaved (a group's worth)


def _input_bytes(call: OpCall) -> int:
    def size(value: Any) -> int:
        if isinstance(value, TensorSpec):
            return _storage_length(value) * value.dtype.itemsize
        if isinstance(value, tuple) and value[:1] != ("opaque",):
            return sum(size(v) for v in value)
        return 0

    return sum(size(v) for v in call.args) + sum(size(v) for _, v in call.kwargs)


def time_interleaved(calls: list[OpCall], *, device: torch.device) -> dict[OpCall, float | None]:
    """Seconds of each of ``calls`` (None: it cannot run here), timed round after round, each call
    once per round in the given order, until each has ``MIN_REPEATS`` repeats and ``MIN_SECONDS``
    (or ``MAX_REPEATS``); the median repeat after one warm-up. At most ``PREPARED_BYTES`` of real
    inputs are held at once: longer lists are timed in consecutive groups."""
    out: dict[OpCall, float | None] = {}
    group: list[tuple[OpCall, tuple, dict]] = []
    held = 0
    for call in calls:
        try:
            need = _input_bytes(call)
            if group and held + need > PREPARED_BYTES:
                out.update(_time_group(group, device=device))
                group, held = [], 0
            group.append((call, *real_args(call, device)))
            held += need
        except NotRunnable:
            out[call] = None
    if group:
        out.update(_time_group(group, device=device))
    return out


def _time_group(group: list[tuple[OpCall, tuple, dict]], *, device: torch.device) -> dict[OpCall, float]:
    return time_rounds([(call, functools.partial(call.func, *args, **kwargs)) for call, args, kwargs in group],
                       device=device)


def time_rounds(entries: list[tuple[Hashable, Callable[[], Any]]], *, device: torch.device,
                lockstep: bool = False) -> dict[Hashable, float]:
    """Seconds of each entry (a key, and a function that runs it once), timed round after round:
    after one warm-up round, each entry once per round in the given order, until each has
    ``MIN_REPEATS`` repeats and ``MIN_SECONDS`` (or ``MAX_REPEATS``); its median repeat counts
    (a ``Seconds``, which also holds the fastest repeat).
    An entry that is done leaves the rounds; with ``lockstep`` every entry runs every round until
    all are done (times that are compared with each other then come from the same rounds).
    Runs without autograd (a function that needs it enables it) and with denormals flushed."""
    times: dict[Hashable, list[float]] = {key: [] for key, _ in entries}

    def done(key: Hashable) -> bool:
        took = times[key]
        return len(took) >= MIN_REPEATS and (sum(took) >= MIN_SECONDS or len(took) >= MAX_REPEATS)

    with torch.no_grad(), _flushed_denormals():
        for _, run in entries:  # the warm-up
            run()
        pending = entries
        while pending:
            for key, run in pending:
                synchronize(device)
                start = time.perf_counter()
                run()
                synchronize(device)
                times[key].append(time.perf_counter() - start)
            if lockstep:
                pending = [] if all(done(key) for key, _ in pending) else pending
            else:
                pending = [entry for entry in pending if not done(entry[0])]
    return {key: Seconds(statistics.median(took), min(took)) for key, took in times.items()}


class OpTimes:
    """Seconds per distinct op, measured once each on ``device`` (this machine) in this process."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[OpCall, float] = {}
        self.skipped: set[str] = set()

    def prepare(self, calls: list[OpCall]) -> None:
        """Time the ``calls`` not yet timed in this process interleaved, in the step's order
        (``time_interleaved``); a call asked for without it is timed on its own."""
        todo = [call for call in dict.fromkeys(calls) if self._key(call) not in _TIMED]
        if todo:
            for call, seconds in time_interleaved(todo, device=self.device).items():
                _TIMED[self._key(call)] = seconds

    def _key(self, call: OpCall) -> tuple[str, int, OpCall]:
        return str(self.device), torch.get_num_threads(), call

    def __call__(self, call: OpCall) -> float:
        if call not in self.seconds:
            key = self._key(call)
            if key not in _TIMED:
                try:
                    _TIMED[key] = time_call(call, device=self.device)
                except NotRunnable:
                    _TIMED[key] = None
            if _TIMED[key] is None:
                self.skipped.add(call.name)
            self.seconds[call] = _TIMED[key] or 0.0
        return self.seconds[call]


class MachineCosts:
    """Costs on this machine: each op benchmarked (``OpTimes``); a CPU's gloo collectives run on
    the cores the compute uses, so they do not overlap it."""

    def __init__(self, device: torch.device, *, threads: int) -> None:
        from optbench.provenance import cpu_name

        self.times = OpTimes(device)
        self.threads = threads
        self.statistic = "median"  # what a run's median step sums; "fastest" (``fastest()``): for comparing steps
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
        self.device = f"this machine: {name}" + (f", {threads} thread(s)" if device.type == "cpu" else "")
        self.method = ("per-op benchmark: each distinct op of the traced step timed on real tensors of its shapes "
                       "here, interleaved in the step's order")
        self.overlaps_communication = device.type == "cuda"

    def prepare(self, calls: list[OpCall]) -> None:
        """Benchmark a step's ops interleaved, in its order, before their seconds are asked for."""
        with _threads(self.threads):
            self.times.prepare(calls)

    def seconds(self, call: OpCall, cost: Any) -> float:
        with _threads(self.threads):
            seconds = self.times(call)
        return fastest(seconds) if self.statistic == "fastest" else float(seconds)

    def fastest(self) -> MachineCosts:
        """The same timings, each op at its fastest round: the planner's basis for ranking (a slow
        stretch of the host lengthens some rounds of some ops; the fastest round of each is the
        steadier comparison between two steps timed in the same benchmark)."""
        view = copy.copy(self)
        view.statistic = "fastest"
        return view


@contextlib.contextmanager
def _threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads != before:
            torch.set_num_threads(before)
