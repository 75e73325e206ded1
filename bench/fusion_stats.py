"""Statistics of ``bench/fusion_matrix.py``: baselines computed from the field, per-sample errors of
generated texts, paired block-bootstrap intervals, the verdict over seeds with Holm's correction.

Every number is per eval sample in time order (the samples ``optbench generate --samples K`` picks,
the same for every run of a file and mode), so every comparison is paired sample by sample.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from scipy import stats

MIN_GAP = 0.005  # nats/token: the smallest loss gap (shuffled - true climate) that counts as reading it
ALPHA = 0.05  # family-wise, Holm's step-down over every (file, mode, kind) gap test
BLOCK_DAYS = 5.0  # the block bootstrap's block length: at least 5 days of samples move together
RESAMPLES = 2000


def quantity_of(key: str) -> str:
    """The quantity a fact key states (``region:northwest`` -> regions)."""
    kind = key.split(":", 1)[0]
    return {"mean": "area mean", "region": "regions", "point": "points"}.get(kind, kind)


# ----------------------------------------------------------------------------------- baselines
class Field:
    """The facts of every step of a captions file (its sidecar's spec), and its input frames."""

    def __init__(self, data: Path, pairs: Path) -> None:
        import xarray as xr

        from optbench.data.captions import read_spec
        from optbench.generate.score import FieldFacts

        self.spec = read_spec(pairs)
        facts = FieldFacts([str(data)], spec=self.spec)
        try:
            self.steps = facts.layout.num_steps
            self.facts = [{k: f.value for k, f in facts.facts(s).items()} for s in range(self.steps)]
            self.times = np.asarray(facts.layout.times)
        finally:
            facts.close()
        with xr.open_dataset(data) as ds:
            arrays = [np.asarray(ds[v].values, dtype=np.float64).reshape(len(ds[v]), -1) for v in self.spec.variables]
        frames = np.concatenate(arrays, axis=1)
        self.frames = (frames - frames[: self.spec.train_steps].mean(0)) / (frames[: self.spec.train_steps].std(0) + 1e-6)
        hours = (self.times - self.times.astype("datetime64[D]")) / np.timedelta64(1, "h")
        self.hour = np.asarray(hours, dtype=np.int64)

    def train_range(self) -> range:
        """Steps whose text and inputs lie in the training split."""
        return range(self.spec.history, self.spec.train_steps)

    def inputs(self, step: int) -> np.ndarray:
        """The input window of the sample whose text is of ``step`` (flattened frames)."""
        last = step if self.spec.mode == "describe" else step - 1
        return self.frames[last - self.spec.history + 1: last + 1].ravel()

    def baselines(self, steps: list[int]) -> dict[str, dict[str, np.ndarray]]:
        """Per baseline, per fact key: its prediction for each of ``steps``."""
        train = list(self.train_range())
        keys = sorted({k for s in steps for k in self.facts[s]})
        value = {k: np.array([self.facts[s].get(k, np.nan) for s in train]) for k in keys}
        out = {"best constant (training mean)": {k: np.full(len(steps), np.nanmean(value[k])) for k in keys}}
        hours = self.hour[train]
        out["climatology (training mean for the hour of day)"] = {
            k: np.array([np.nanmean(value[k][hours == self.hour[s]]) if np.any(hours == self.hour[s])
                         else np.nanmean(value[k]) for s in steps]) for k in keys}
        if self.spec.mode == "forecast":
            out["persistence (the last input step's value)"] = {
                k: np.array([self.facts[s - 1].get(k, np.nan) for s in steps]) for k in keys}
        x_train = np.stack([self.inputs(s) for s in train])
        out["linear read-out of the input (ridge)"] = self.read_out(x_train, np.stack([self.inputs(s) for s in steps]),
                                                                    steps)
        return out

    def read_out(self, x_train: np.ndarray, x_eval: np.ndarray, steps: list[int]) -> dict[str, np.ndarray]:
        """Per fact key of ``steps``: the ridge read-out of features ``x_train`` (one row per step of
        ``train_range``) fitted to that fact, applied to ``x_eval`` (one row per step of ``steps``)."""
        train = list(self.train_range())
        keys = sorted({k for s in steps for k in self.facts[s]})
        return {k: ridge(x_train, np.array([self.facts[s].get(k, np.nan) for s in train]), x_eval) for k in keys}


def ridge(x: np.ndarray, y: np.ndarray, x_new: np.ndarray, *, lam: float = 1.0) -> np.ndarray:
    """Ridge regression with an intercept (features and target centred on the training samples;
    closed form over the samples: fine for more features than samples)."""
    ok = np.isfinite(y)
    x, y = x[ok], y[ok]
    centre, mean = x.mean(0), y.mean()
    x = x - centre
    gram = x @ x.T + lam * np.eye(len(x))
    alpha = np.linalg.solve(gram, y - mean)
    return (x_new - centre) @ (x.T @ alpha) + mean


# ----------------------------------------------------------------------------- sample errors
def errors(records: list[dict], quantity: str) -> tuple[np.ndarray, np.ndarray]:
    """Per generated text (in record order): the mean absolute error over the facts of
    ``quantity`` it states, and the share of them it states (0: a miss, error NaN)."""
    err, share = [], []
    for r in records:
        keys = [k for k in r["field"] if quantity_of(k) == quantity]
        said = [abs(r["numbers"][k] - r["field"][k]) for k in keys if k in r["numbers"]]
        err.append(float(np.mean(said)) if said else math.nan)
        share.append(len(said) / len(keys) if keys else math.nan)
    return np.array(err), np.array(share)


def baseline_errors(pred: dict[str, np.ndarray], records: list[dict], quantity: str) -> np.ndarray:
    out = []
    for i, r in enumerate(records):
        keys = [k for k in r["field"] if quantity_of(k) == quantity]
        out.append(float(np.mean([abs(pred[k][i] - r["field"][k]) for k in keys])) if keys else math.nan)
    return np.array(out)


def block_ids(times: list[str]) -> np.ndarray:
    """Each sample's block: ``BLOCK_DAYS`` days of samples move together in the bootstrap."""
    t = np.array(times, dtype="datetime64[s]")
    days = (t - t.min()) / np.timedelta64(1, "D")
    return (days // BLOCK_DAYS).astype(np.int64)


def paired_interval(a: np.ndarray, b: np.ndarray, blocks: np.ndarray, *, seed: int = 0) -> dict[str, float]:
    """mean(a) - mean(b) over the samples where both are finite, with a 95% block-bootstrap interval
    (blocks resampled with replacement, paired: a sample's a and b stay together)."""
    ok = np.isfinite(a) & np.isfinite(b)
    d, blk = (a - b)[ok], blocks[ok]
    if not len(d):
        return {"value": math.nan, "low": math.nan, "high": math.nan, "n": 0, "blocks": 0}
    ids = np.unique(blk, return_inverse=True)[1]
    count = int(ids.max()) + 1
    sums, sizes = np.bincount(ids, weights=d, minlength=count), np.bincount(ids, minlength=count)
    value = float(d.mean())
    if count < 2:
        return {"value": value, "low": math.nan, "high": math.nan, "n": int(len(d)), "blocks": count}
    draws = np.random.default_rng([seed, 0xF05]).integers(0, count, size=(RESAMPLES, count))
    boot = sums[draws].sum(1) / np.maximum(sizes[draws].sum(1), 1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return {"value": value, "low": float(low), "high": float(high), "n": int(len(d)), "blocks": count}


# --------------------------------------------------------------------------------- the verdict
def gap_test(gaps: list[float]) -> dict[str, float]:
    """Across seeds: mean and standard deviation of the loss gap, its 95% t interval, and the
    one-sided p-value of "mean gap > MIN_GAP" (a t-test over seeds: the variance between trainings)."""
    g = np.asarray(gaps, dtype=np.float64)
    n, mean = len(g), float(g.mean())
    sd = float(g.std(ddof=1)) if n > 1 else math.nan
    if n < 2 or sd == 0:
        p = 0.0 if n > 1 and mean > MIN_GAP else 1.0
        return {"mean": mean, "sd": sd, "low": mean, "high": mean, "p": p, "n": n}
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.975, n - 1)) * se
    p = float(stats.t.sf((mean - MIN_GAP) / se, n - 1))
    return {"mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "p": p, "n": n}


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error rate)."""
    m = len(pvalues)
    order = np.argsort(pvalues)
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
