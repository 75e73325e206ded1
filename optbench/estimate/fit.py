"""The largest micro-batch whose traced steady-state peak fits a device: a search over traced
micro-batches that uses the convexity of the peak in the micro-batch to bound the answer."""

from __future__ import annotations

import itertools
import math
from typing import Any

from optbench.estimate.memtrace import StepTrace
from optbench.estimate.steps import OPTIMIZER_STEP


def _bounds(peaks: dict[int, int], budget: int) -> tuple[int, float]:
    """(a micro-batch known to fit, the largest that may fit) from the traced peaks, by convexity:
    a chord lies above the peak between its ends, a line through two points lies below it beyond
    them."""
    points = sorted(peaks.items())
    lo = max((b for b, peak in points if peak <= budget), default=0)
    above = [b for b, _ in points if b > lo]
    lower, upper = lo, (min(above) - 1 if above else math.inf)
    if lo and above:
        hi = min(above)
        lower = max(lo, min(hi - 1, lo + math.floor((budget - peaks[lo]) * (hi - lo) / (peaks[hi] - peaks[lo]))))
    for (b1, m1), (b2, m2) in itertools.pairwise(points):
        if m2 <= budget and m2 > m1:
            upper = min(upper, math.floor(b2 + (budget - m2) * (b2 - b1) / (m2 - m1)))
    return lower, upper


def _next_fits(peaks: dict[int, int], budget: int, micro_batch: int, measure: Any) -> bool:
    measure(micro_batch)
    return peaks[micro_batch] <= budget


def _first_probe(first: StepTrace, budget: int) -> int:
    """The micro-batch the search traces after ``first``: by where ``first``'s own peak says the
    answer lies, or twice (half) ``first``'s where it cannot say.

    At a peak in the forward or backward, the bytes that grow with the samples are there to read: the
    activations and temporaries of that moment, or the activations at the activation peak where they
    are more (a peak late in the backward holds few of them, and the forward's peak grows by more per
    sample: the smaller growth would put the probe far past the answer). The line through
    ``first``'s peak with that growth per sample reaches ``budget`` at the answer when the peak is
    affine. Where ``first`` fits, the probe is one past that answer, and the search's bounds
    (``_bounds``, from traced points only) settle it with this one trace: it does not fit and the
    chord from ``first`` ends one below it, or it fits (the line fell short) and the search goes on
    from the two traced points. Where ``first`` does not fit, the probe is the answer and one
    more trace closes it (one that fits and one past it).

    A peak in the optimizer step (the activations freed) says nothing of where the forward's peak
    overtakes it: twice (half) ``first``'s micro-batch. The probe only chooses where to look; what
    is reported rests on the traced points alone."""
    batch, peak = first.micro_batch, first.steady_peak()
    fits = peak.total <= budget
    growth = max(peak.components.get("activations", 0) + peak.components.get("temporaries", 0),
                 first.activation_peak) / batch
    if peak.phase == OPTIMIZER_STEP or growth <= 0:
        return 2 * batch if fits else batch // 2
    predicted = batch + math.floor((budget - peak.total) / growth)
    return max(batch + 1, predicted + 1) if fits else max(1, min(batch - 1, predicted))


def largest_micro_batch(trace: Any, *, first: StepTrace, budget: int, max_traces: int = 5) -> dict[str, Any]:
    """The largest micro-batch whose steady peak fits ``budget`` bytes, by tracing more steps.

    The peak is a maximum, over the moments of the step, of memory that is affine in the
    micro-batch, so it is convex in the micro-batch. Convexity bounds the answer from the traced
    points (``_bounds``): while every traced point fits, the next trace is at the upper bound (the
    line through the last two points; where it fits, it is the answer); once one does not fit, at one
    past the chord's lower bound (the answer where the peak is affine between the two: then one
    trace settles it), and after a probe there fits, at the middle of the bounds. The first probe is
    just past where ``first``'s peak puts the answer (``_first_probe``): one trace settles an affine
    peak from below, two from above. Doubling from 8 samples took seven traces and stopped short on a
    3.3M-parameter model; bracketing from twice the first took three or four. ``exact`` is False when
    ``max_traces`` ran out first: the answer is then a lower bound and ``upper_bound`` the largest
    micro-batch that may still fit."""
    peaks = {first.micro_batch: first.steady_peak().total}
    activation_peaks = {first.micro_batch: first.activation_peak}

    def measure(micro_batch: int) -> None:
        step = trace(micro_batch)
        peaks[micro_batch], activation_peaks[micro_batch] = step.steady_peak().total, step.activation_peak

    if peaks[first.micro_batch] > budget and first.micro_batch == 1:
        return {"max_micro_batch": 0, "exact": True, "upper_bound": 0, "bytes_per_sample": None,
                "peak_bytes_per_sample": None, "traced_peaks": {"1": peaks[1]}}
    measure(_first_probe(first, budget))
    secant = True
    for _ in range(max_traces):
        lower, upper = _bounds(peaks, budget)
        if lower >= upper:
            break
        if not any(peak > budget for peak in peaks.values()):  # the convex bound, where a fit is the answer
            measure(2 * max(peaks) if upper == math.inf else upper)
        else:  # past the chord's lower bound (the answer if the peak is affine there), then halves
            fits = _next_fits(peaks, budget, lower + 1 if secant else (lower + upper + 1) // 2, measure)
            secant = not fits
    lower, upper = _bounds(peaks, budget)
    ordered = sorted(peaks)
    big, small = ordered[-1], ordered[-2]
    return {
        "max_micro_batch": lower, "exact": lower >= upper,
        "upper_bound": None if upper == math.inf else upper,
        # what one more sample costs where the samples' own memory peaks (the activations held at the
        # end of the forward): the step's peak may be the end of the backward or the optimizer step,
        # where activations are freed and it grows by little (9.9b: 31 MiB per sample there)
        "bytes_per_sample": int((activation_peaks[big] - activation_peaks[small]) / (big - small)),
        "peak_bytes_per_sample": int((peaks[big] - peaks[small]) / (big - small)),
        "traced_peaks": {str(b): peaks[b] for b in ordered},
    }
