"""The DataLoader knobs of the ``dataloader`` group, as torch will really apply them.

``pin_memory`` page-locks batches so host-to-GPU copies can be asynchronous; without CUDA there is
no such copy, and torch's DataLoader would only warn and ignore it. optbench does not pass it there
and records it as not applied, with the reason, in ``summary.json`` (``applied.dataloader``): the
run is what it says it is, and a sweep on a CPU still runs the tuned loader's worker processes.

A stop signal is the training process's to handle (``optbench.run.preemption``: a checkpoint at the
next step boundary), not its loader workers'. Ctrl-C reaches a terminal's whole foreground process
group and a cluster's SIGTERM every process of the job, workers included: a worker it ended made
torch's SIGCHLD handler fail the run mid-step ("DataLoader worker (pid N) is killed by signal:
Terminated"), with no checkpoint. ``TrainLoader``'s workers leave SIGTERM and SIGINT to the trainer:
a thread of each takes them (``signal.sigwaitinfo``, which says who sent one) and ends the worker
only for the trainer's own (torch ending a worker that did not stop, multiprocessing at exit); from
anyone else they change nothing, and the trainer ends its workers when it stops. Where Python has no
``sigwaitinfo`` (macOS), the workers keep the default.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from optbench.config import DataLoaderConfig

log = logging.getLogger(__name__)

PIN_MEMORY_NOT_APPLICABLE = "not applied: no CUDA device (pinned memory only speeds host-to-GPU copies)"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_WAITS = hasattr(signal, "sigwaitinfo")  # Linux; not macOS


class TrainLoader(DataLoader):
    """torch's DataLoader, its worker processes leaving the stop signals to the training process (the
    module's doc). The signals are held while ``__iter__`` starts the workers, so a worker starts with
    them blocked and none lands before its waiting thread takes them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("num_workers") and _WAITS:
            kwargs["worker_init_fn"] = functools.partial(leave_stop_signals_to, os.getpid(), kwargs.get("worker_init_fn"))
        super().__init__(*args, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        if not (self.num_workers and _WAITS):
            return super().__iter__()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def leave_stop_signals_to(trainer: int, then: Callable[[int], None] | None, worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: SIGTERM and SIGINT blocked in this thread (and the threads
    it starts), taken by a daemon thread that ends the process (status 128 + the signal) for one the
    ``trainer`` process sent and ignores any other; then ``then`` (the caller's own init), if any."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def wait() -> None:
        while True:
            received = signal.sigwaitinfo(STOP_SIGNALS)
            if received.si_pid == trainer:
                os._exit(128 + received.si_signo)

    threading.Thread(target=wait, name="optbench-loader-stop-signals", daemon=True).start()
    if then is not None:
        then(worker_id)


def loader_kwargs(cfg: DataLoaderConfig, *, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for torch.utils.data.DataLoader."""
    return {
        "num_workers": cfg.num_workers,
        "pin_memory": cfg.pin_memory and device.type == "cuda",
        "persistent_workers": cfg.persistent_workers,
        "prefetch_factor": cfg.prefetch_factor,
    }


def describe_loader(loader: DataLoader, *, cfg: DataLoaderConfig) -> dict[str, Any]:
    """What the training loader really uses, for summary.json ``applied.dataloader``: read back from
    the DataLoader object built (its own attributes), not from the config; "unknown" for an attribute
    this torch's DataLoader does not have."""
    def read(name: str) -> Any:
        return getattr(loader, name, "unknown")

    applied: dict[str, Any] = {
        "name": cfg.name,
        "num_workers": read("num_workers"),
        "pin_memory": read("pin_memory"),
        "persistent_workers": read("persistent_workers"),
        "prefetch_factor": read("prefetch_factor"),
    }
    if cfg.pin_memory and applied["pin_memory"] is False:
        applied["pin_memory_note"] = PIN_MEMORY_NOT_APPLICABLE
        log.info("dataloader.pin_memory=true %s", PIN_MEMORY_NOT_APPLICABLE)
    if applied["num_workers"]:
        log.info("Applied DataLoader with %s worker processes, prefetch_factor=%s, persistent_workers=%s",
                 applied["num_workers"], applied["prefetch_factor"], applied["persistent_workers"])
    return applied
