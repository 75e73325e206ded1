"""The warm process optbench's local workers are forked from (``parallel.start_method=forkserver``).

With ``spawn`` every worker is a fresh interpreter that imports torch, torch._dynamo and optbench again:
seconds of CPU per worker before any work. A forkserver (multiprocessing's) imports them once and forks
each worker from that warm process. It stays up for the later launches of the same process (a sweep's
jobs, a test session) and is started again when it died or when what its imports may have read
differs: the environment (but for ``PER_LAUNCH_ENV``), ``sys.path``, the interpreter. What it preloads
only saves time: a module it lacks is imported by the worker, as spawn's would.

A forked worker would get three things from the server's start rather than from the launch; they are
handed over explicitly (``WorkerStart``) and applied first thing in the worker:

* the environment: exactly the launcher's at launch time, plus torch elastic's per-rank variables; torch's
  thread count is set from OMP_NUM_THREADS (the OpenMP runtime read the server's when it loaded);
* stdout and stderr: the launcher's fds 1 and 2 at launch time (sent over the server's socket) replace
  the ones the server inherited;
* signals: the server starts with SIGTERM/SIGINT/SIGHUP/SIGQUIT blocked, so a signal to the launcher's
  process group does not stop it under running workers (their exit statuses come through it; SIGKILL
  still ends it with the group). Each worker unblocks them (one that arrived meanwhile is delivered
  then), and a thread sends the worker SIGTERM when the launcher dies (spawn's workers get SIGINT
  through their parent-death signal instead: see ``_stop_when_the_launcher_dies``).
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from multiprocessing import reduction, resource_tracker
from typing import Any

log = logging.getLogger(__name__)

# what every run's workers import (the run's own FakeTensor estimate needs torch._dynamo); the
# entrypoint's module is added. Not the launcher's script ('__main__', multiprocessing's default): the
# server never runs it (one without an `if __name__ == "__main__"` guard would run in it); each worker
# imports it as spawn's do
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed._tools.fsdp2_mem_tracker", "torch.utils.tensorboard")
# what the server imports as well when the launching process has imported the key: a Hugging Face run's
# launcher has imported transformers' modeling code (its preflight built the model on the meta device),
# optbench's own model's has not. Once in the server instead of once in each worker: 1.2 CPU-s a worker
# here, torchao with it. Not where torch sees a CUDA device: torchao reads the device's compute
# capability while it is imported (torchao 0.18's prototype.mx_formats.kernels), which initializes CUDA
# in the server, and no worker forked from a process with CUDA initialized can use CUDA ("Cannot
# re-initialize CUDA in forked subprocess": the DDP-over-NCCL test's worker on an H200, 2026-11-30, its
# test session having imported it). There each worker imports it, as spawn's would; a GPU run's step
# outweighs 1.2 CPU-s
PRELOAD_IF_IMPORTED = {"transformers.modeling_utils": "optbench.preload_hf"}
# variables that change from one launch to the next: applied in each worker, never a reason to start
# the server again (the launcher adds its own). OMP_NUM_THREADS, which the OpenMP runtime read when the
# server loaded it, becomes torch's thread count in the worker; pytest's names the current test; the
# trackers set their own in the launching process when a run first logs to them (W&B's service
# address, MLflow's telemetry session), which no module the server imports reads (wandb and mlflow
# are imported by the run that logs, not by the server): a process that launched workers before its
# first tracked run (a sweep over logger=, a notebook, a test session) would start it again
PER_LAUNCH_ENV = ("OMP_NUM_THREADS", "PYTEST_CURRENT_TEST", "WANDB_SERVICE", "_MLFLOW_TELEMETRY_SESSION_ID")
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                     if hasattr(signal, name))

_lock = threading.Lock()
_started: dict[str, Any] = {"pid": None, "key": None, "env": {}}  # the server this process started
_retired: list[int] = []  # older servers, reaped once their last worker is gone


def ensure_server(entrypoint_module: str, *, per_launch: Collection[str] = ()) -> dict[str, str]:
    """The running forkserver, started now (first launch, dead, or its imports' inputs changed) with
    the current environment; returns the environment it was started with."""
    preload = preload_list(entrypoint_module)
    key = _key(per_launch)
    server = mp_forkserver._forkserver
    with _lock:
        _reap_retired()
        if server._forkserver_pid is not None and not _alive(server._forkserver_pid):
            _forget(server)  # started again below, as multiprocessing would
        elif server._forkserver_pid is not None and (_started["key"] != key or _started["pid"] != server._forkserver_pid):
            _retire(server)  # its imports may have read other values, or multiprocessing restarted it unmasked
        multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
        # the resource tracker first: ``ensure_running`` starts it when it is not running yet (a
        # command's first launch), and its start ends by unblocking SIGINT and SIGTERM in this thread
        # (CPython's bpo-33613), which would undo the mask below before the server inherits it
        resource_tracker.ensure_running()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited by the server
        try:
            server.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if server._forkserver_pid != _started["pid"]:
            log.debug("started the workers' forkserver (pid %s)", server._forkserver_pid)
            _started.update(pid=server._forkserver_pid, key=key, env=dict(os.environ))
        return dict(_started["env"])


def preload_list(entrypoint_module: str) -> list[str]:
    """What a server started now imports: ``PRELOAD``, what ``PRELOAD_IF_IMPORTED`` adds for this
    process (none where torch sees a CUDA device: nothing the server imports may initialize CUDA), the
    entrypoint's module; the collector off while they are imported, their objects frozen
    after (optbench.collector)."""
    import torch

    imported = [] if torch.cuda.is_available() else \
        [module for key, module in PRELOAD_IF_IMPORTED.items() if key in sys.modules]
    return ["optbench.preload_start", *PRELOAD, *imported, entrypoint_module, "optbench.preload_done"]


def launched(*, per_launch: Collection[str] = ()) -> None:
    """After a launch: torch's launch sets a few variables in this process (TORCHELASTIC_SIGNALS_TO_HANDLE,
    TORCHINDUCTOR_CACHE_DIR: their defaults); the server stays good for the environment as it left it."""
    with _lock:
        if _started["pid"] is not None and _started["pid"] == mp_forkserver._forkserver._forkserver_pid:
            _started["key"] = _key(per_launch)


def _key(per_launch: Collection[str]) -> tuple[Any, ...]:
    """What the server's imports may have read: the environment (but for what changes per launch),
    sys.path and the interpreter."""
    volatile = {*PER_LAUNCH_ENV, *per_launch}
    return sorted((k, v) for k, v in os.environ.items() if k not in volatile), list(sys.path), sys.executable


def server_pid() -> int | None:
    """The pid of the forkserver this process started (None before the first launch)."""
    return _started["pid"]


def _alive(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == 0
    except ChildProcessError:  # reaped by someone else
        return False


def _retire(server: Any) -> None:
    """Let the running server go without waiting for it (``ForkServer._stop`` waits for its last
    worker): closing its 'alive' pipe ends it once no worker of it is left; it is reaped later."""
    _retired.append(server._forkserver_pid)
    _forget(server)


def _forget(server: Any) -> None:
    """multiprocessing's server record emptied (what its ``ensure_running`` does with a dead one)."""
    os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    if hasattr(server, "_forkserver_authkey"):
        server._forkserver_authkey = None
    _started.update(pid=None, key=None, env={})


def _stop_at_exit(grace_s: float = 10.0) -> None:
    """The server (and its workers' CPU time, which it reaped) ends with this process and is reaped
    here, not left to end alone once this process is gone; a server a stray worker keeps up is left."""
    server = mp_forkserver._forkserver
    with _lock:
        if server._forkserver_pid is not None and server._forkserver_pid == _started["pid"]:
            _retire(server)
        deadline = time.monotonic() + grace_s
        while _retired and time.monotonic() < deadline:
            _reap_retired()
            time.sleep(0.01)


atexit.register(_stop_at_exit)


def _reap_retired() -> None:
    for pid in list(_retired):
        try:
            done = os.waitpid(pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            done = True
        if done:
            _retired.remove(pid)


class WorkerStart:
    """What a worker forked from the server applies before anything else (see the module's doc):
    the launcher's environment at launch (``env``), the server's (``server_env``, to tell elastic's
    per-rank variables apart), and the launcher's stdout/stderr fds. Pickled while the worker process
    starts, the fds travel as duplicates (multiprocessing's DupFd)."""

    def __init__(self, env: dict[str, str], server_env: dict[str, str], stdout: int = 1, stderr: int = 2):
        self.env, self.server_env, self.stdout, self.stderr = env, server_env, stdout, stderr

    def __reduce__(self) -> tuple[Callable[..., WorkerStart], tuple[Any, ...]]:
        fds: tuple[Any, ...] = (self.stdout, self.stderr)
        if multiprocessing.context.get_spawning_popen() is not None:  # starting a process: send the fds
            fds = tuple(reduction.DupFd(fd) for fd in fds)
        return _rebuilt, (self.env, self.server_env, *fds)

    def apply(self) -> None:
        # what the server imported is never garbage: keep the collector off it, or its full passes
        # write into every inherited page and the worker copies the server's heap page by page
        gc.freeze()
        for fd, target, stream in ((self.stdout, 1, sys.stdout), (self.stderr, 2, sys.stderr)):
            if fd != target:
                if stream is not None:
                    stream.flush()
                os.dup2(fd, target)
                os.close(fd)
        elastic = {k: v for k, v in os.environ.items() if self.server_env.get(k) != v}
        os.environ.clear()
        os.environ.update(self.env)
        os.environ.update(elastic)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        _stop_when_the_launcher_dies()


def _rebuilt(env: dict[str, str], server_env: dict[str, str], stdout: Any, stderr: Any) -> WorkerStart:
    fds = [fd.detach() if hasattr(fd, "detach") else fd for fd in (stdout, stderr)]
    return WorkerStart(env, server_env, *fds)


def _stop_when_the_launcher_dies() -> None:
    """The worker's parent is the server, so a parent-death signal would come only when the server
    ends; watch the launcher's end of the start pipe instead, and send SIGTERM when it closes.

    Not SIGINT, spawn's parent-death signal: a SIGTERM to the whole group reaches the worker and
    its launcher at once, and the launcher may close the pipe while the worker's main thread is
    still inside a collective. Both signals are then pending when Python next checks, and Python
    runs their handlers in signal-number order: SIGINT (2) would be the first the run records
    (``optbench.run.preemption``), and a preempted run would read "stopped by SIGINT" (seen once in
    CI). With SIGTERM from the watcher, the signal the group was sent comes first, whichever it was.
    torch's parent-death SIGINT (its ``_wrap``) stays: it comes only if the server ends, and the
    server has the group's stop signals blocked (``ensure_server``; seen in CI once more, and under
    strace on every run, before a command's first launch kept them blocked)."""
    launcher = multiprocessing.parent_process()
    if launcher is None:
        return

    def watch() -> None:
        launcher.join()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="optbench-launcher-watch", daemon=True).start()


def run_worker(start: WorkerStart, entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A forked worker's entrypoint: the launch's environment, fds and signals, then ``entrypoint``."""
    start.apply()
    return entrypoint(*args)
