"""optbench.collector: Python's collector off while the heavy imports run, on again after them, and
their objects frozen once per process; the workers' forkserver does so around its preload."""

from __future__ import annotations

import gc

from optbench import collector


def test_the_collector_is_off_inside_on_after_and_the_imports_frozen_once(monkeypatch):
    import types

    monkeypatch.setattr(collector, "_frozen", False)
    freezes = []  # the collector module's own gc.freeze calls (another thread of this worker may freeze too)
    proxy = types.SimpleNamespace(isenabled=gc.isenabled, disable=gc.disable, enable=gc.enable,
                                  freeze=lambda: (freezes.append(1), gc.freeze())[1])
    monkeypatch.setattr(collector, "gc", proxy)
    frozen = gc.get_freeze_count()
    try:
        with collector.imports_held():
            assert not gc.isenabled()
            kept = [[object()] for _ in range(1000)]  # what an import leaves: tracked containers
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept) and len(freezes) == 1
        with collector.imports_held():
            assert not gc.isenabled()
            kept.append([object()])
        assert gc.isenabled() and len(freezes) == 1  # frozen once per process
        gc.disable()  # a caller that holds it already decides when it resumes
        with collector.imports_held():
            pass
        assert not gc.isenabled() and len(freezes) == 1
    finally:
        gc.enable()


def probe() -> tuple[bool, int]:
    return gc.isenabled(), gc.get_freeze_count()


def test_a_forkserver_worker_collects_garbage():
    """The server imports between optbench.preload_start and optbench.preload_done: a worker forked
    from it has the collector on (a server left with it off would never collect in any worker)."""
    from optbench.distributed import launch_local_workers

    outcome = launch_local_workers(probe, nproc=1)
    assert outcome.values is not None, outcome.failure
    enabled, frozen = outcome.values[0]
    assert enabled and frozen > 100_000  # torch and the trainer, frozen in the server (and the worker)
