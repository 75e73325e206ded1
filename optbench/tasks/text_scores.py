"""The statistics of "does the model read the climate" (``task=climate_text``, ``optbench generate``,
``make fusion-matrix``), in one place so that a run's eval, the generate command and the benchmark
compute them alike:

- ``strided``: the eval samples spread evenly over the eval split (not its first few, whose
  neighbours are strongly correlated);
- ``derangement``: a seeded random permutation without a fixed point — the sample whose climate
  each eval sample's text is scored against when the climate is shuffled (never its own);
- ``block_bootstrap``: a 95% percentile interval of a per-token ratio (summed NLL differences over
  summed target tokens) by resampling contiguous time blocks of eval samples with replacement, so
  that correlated neighbours move together; its standard deviation is the standard error.
"""

from __future__ import annotations

import math

import numpy as np

from optbench.errors import ConfigError

RESAMPLES = 2000
BLOCKS = 16  # time blocks the eval samples are cut into for the bootstrap


def strided(num_samples: int, count: int) -> np.ndarray:
    """``min(count, num_samples)`` distinct sample indices spread evenly over ``0..num_samples-1``
    (first and last included), in time order."""
    count = min(count, num_samples)
    if count <= 1:
        return np.zeros(count, dtype=np.int64)
    return np.unique(np.round(np.linspace(0, num_samples - 1, count)).astype(np.int64))


def derangement(count: int, *, seed: int) -> np.ndarray:
    """A random permutation of ``0..count-1`` with no fixed point (Sattolo's algorithm: a uniformly
    random single cycle), seeded."""
    if count < 2:
        raise ConfigError(f"{count} eval sample(s) cannot be compared with another sample's climate; raise "
                          "data.eval_fraction (or add time steps) so the eval split holds at least 2 samples")
    rng = np.random.default_rng([seed, 0x5A770])
    perm = np.arange(count)
    for i in range(count - 1, 0, -1):
        j = int(rng.integers(0, i))
        perm[i], perm[j] = perm[j], perm[i]
    assert not np.any(perm == np.arange(count)), "a derangement has no fixed point"
    return perm


def partners(count: int, *, seed: int, offset: int) -> np.ndarray:
    """Whose climate each of ``count`` eval samples gets when shuffled: a seeded derangement
    (``offset=0``) or the sample ``offset`` places further, cyclically, refused where that is the
    sample itself."""
    if offset == 0:
        return derangement(count, seed=seed)
    if count < 2 or offset % count == 0:
        raise ConfigError(f"task.shuffle_offset={offset} pairs every one of the {count} eval samples with its own "
                          "climate (a multiple of their number): the gap would be 0 by construction; use "
                          "task.shuffle_offset=0 (a random derangement) or another offset")
    return (np.arange(count) + offset) % count


def time_blocks(count: int, *, blocks: int = BLOCKS) -> np.ndarray:
    """The time block of each of ``count`` eval samples in time order (contiguous, near-equal)."""
    return np.minimum(np.arange(count) * min(blocks, count) // max(count, 1), blocks - 1)


def block_bootstrap(numerator: np.ndarray, denominator: np.ndarray, *, seed: int,
                    resamples: int = RESAMPLES, blocks: int = BLOCKS) -> dict[str, float]:
    """The ratio sum(numerator) / sum(denominator) over samples in time order (e.g. per-sample
    NLL differences over per-sample target tokens: a per-token gap) with its block-bootstrap 95%
    interval and standard error: blocks of contiguous samples are drawn with replacement."""
    numerator, denominator = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    value = float(numerator.sum() / max(denominator.sum(), 1e-12))
    block = time_blocks(len(numerator), blocks=blocks)
    count = int(block.max()) + 1 if len(block) else 0
    if count < 2:
        return {"value": value, "low": math.nan, "high": math.nan, "stderr": math.nan, "blocks": count}
    num = np.bincount(block, weights=numerator, minlength=count)
    den = np.bincount(block, weights=denominator, minlength=count)
    rng = np.random.default_rng([seed, 0xB007])
    draws = rng.integers(0, count, size=(resamples, count))
    stats = num[draws].sum(1) / np.maximum(den[draws].sum(1), 1e-12)
    low, high = np.percentile(stats, [2.5, 97.5])
    return {"value": value, "low": float(low), "high": float(high), "stderr": float(stats.std(ddof=1)),
            "blocks": count}
