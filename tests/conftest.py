"""Fixtures and hooks only; the helpers tests share are in tests/helpers.py."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests need a CUDA device, ``@pytest.mark.multi_gpu`` ones two: without
    them they are skipped with the reason (select them on a GPU machine with ``-m "cuda or multi_gpu"``)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("multi_gpu") and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, this machine has {gpus}"))
        elif item.get_closest_marker("cuda") and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """The CPU peak cache is per machine; tests share one measured value per session."""
    cache = tmp_path_factory.getbasetemp() / "optbench-cache"
    monkeypatch.setenv("OPTBENCH_CACHE_DIR", str(cache))
    # the report's tables take the terminal's width: every test sees the width of a non-terminal
    # (120) unless it sets its own, whatever an earlier in-process command left behind
    monkeypatch.setenv("COLUMNS", "120")


@pytest.fixture(scope="session")
def finished(tmp_path_factory):
    """A completed 4-step run with checkpoints at steps 2 and 4 (``tests.helpers.SAVING``), trained
    once per worker; a test that changes it works on ``tests.helpers.copy_of`` it."""
    from optbench.run.train import train
    from tests.helpers import SAVING, compose_cfg

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(compose_cfg(SAVING), run_dir=run_dir)
    assert result.status == "completed", result.error
    return run_dir
