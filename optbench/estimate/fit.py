"""The largest micro-batch whose traced steady-state peak fits a device: a search over traced
micro-batches that uses the convexity of the peak in the micro-batch to bound the answer."""

from __future__ import annotations

import itertools
import math
from typing import Any

from optbench.estimate.memtrace import StepTrace


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


def largest_micro_batch(trace: Any, *, first: StepTrace, budget: int, max_traces: int = 5) -> dict[str, Any]:
    """The largest micro-batch whose steady peak fits ``budget`` bytes, by tracing more steps.

    The peak is a maximum, over the moments of the step, of memory that is affine in the
    micro-batch, so it is convex in the micro-batch. Convexity bounds the answer from the traced
    points (``_bounds``): while every traced point fits, the next trace is at the upper bound (the
    line through the last two points; where it fits, it is the answer); once one does not fit, at one
    past the chord's lower bound (the answer where the peak is affine between the two: then one
    trace settles it), and after a probe there fits, at the middle of the bounds. Doubling from 8
    samples took seven traces and stopped short on a 3.3M-parameter model; this takes three or four. ``exact`` is False when
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
    measure(2 * first.micro_batch if peaks[first.micro_batch] <= budget else first.micro_batch // 2)
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
