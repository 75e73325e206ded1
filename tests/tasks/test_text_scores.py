"""The statistics behind "it reads the climate": strided eval samples, a derangement for the
shuffled climate, the per-token gap's block-bootstrap interval."""

from __future__ import annotations

import numpy as np
import pytest

from optbench.errors import ConfigError
from optbench.tasks.text_scores import block_bootstrap, derangement, partners, strided, time_blocks


def test_strided_samples_span_the_split():
    assert strided(1000, 128).tolist()[:3] == [0, 8, 16] and strided(1000, 128)[-1] == 999
    assert len(set(strided(1000, 128).tolist())) == 128
    assert strided(10, 128).tolist() == list(range(10))  # fewer than asked: all


@pytest.mark.parametrize("count", [2, 3, 128, 1001])
def test_a_derangement_never_pairs_a_sample_with_itself(count):
    perm = derangement(count, seed=7)
    assert sorted(perm.tolist()) == list(range(count)) and not np.any(perm == np.arange(count))
    assert np.array_equal(perm, derangement(count, seed=7)) and (count < 4 or not np.array_equal(
        perm, derangement(count, seed=8)))


def test_a_shuffle_that_pairs_a_sample_with_itself_is_refused():
    assert partners(10, seed=0, offset=3).tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    for offset in (10, 20):
        with pytest.raises(ConfigError, match="pairs every one of the 10 eval samples with its own climate"):
            partners(10, seed=0, offset=offset)
    with pytest.raises(ConfigError, match="1 eval sample"):
        derangement(1, seed=0)


def test_the_bootstrap_interval_is_per_token_and_covers_the_truth():
    assert time_blocks(8, blocks=4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    tokens = np.array([10.0, 30.0, 10.0, 30.0])
    diffs = np.array([1.0, 3.0, 1.0, 3.0])  # 0.1 nats per token everywhere: per-token weighting gives 0.1
    result = block_bootstrap(diffs, tokens, seed=0, blocks=4)
    assert result["value"] == pytest.approx(0.1) and result["low"] == pytest.approx(0.1)
    assert result["high"] == pytest.approx(0.1) and result["stderr"] == pytest.approx(0.0, abs=1e-12)
    rng = np.random.default_rng(0)  # a true per-token gap of 0.05 in noise, strongly correlated in time
    covered = 0
    for trial in range(40):
        slow = np.repeat(rng.normal(0.0, 0.5, 16), 8)
        tokens = rng.integers(100, 200, 128).astype(float)
        diffs = tokens * (0.05 + slow + rng.normal(0.0, 0.2, 128))
        r = block_bootstrap(diffs, tokens, seed=trial)
        covered += r["low"] <= 0.05 <= r["high"]
        assert r["low"] < r["value"] < r["high"] and r["stderr"] > 0
    assert covered >= 32  # a 95% interval (16 blocks: somewhat narrow, never a point)
