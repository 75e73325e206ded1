"""Where a run executes: the device, the ranks, the process group, and launching local workers.

A run executes in one of three ways:

* **one process** (``parallel=single``): no process group.
* **self-launched** (``parallel=ddp|fsdp2`` outside torchrun): the process the user started checks
  the config, then starts ``parallel.nproc_per_node`` local workers through torch.distributed's
  elastic launch API (what torchrun itself runs on, with a standalone c10d rendezvous on a free
  port), so the same command works in a terminal, in a Hydra multirun and in a SLURM job. Each
  worker runs the same per-rank code; rank 0 writes the outputs and its result is the run's.
* **under torchrun** (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment, one or many nodes,
  any rendezvous): this process is one rank of that job and uses torchrun's world as it is;
  ``parallel.nproc_per_node`` is torchrun's business then (recorded, not used).

The backend is gloo on CPU and nccl on CUDA (``parallel.backend=auto``); the NCCL environment preset
(``nccl=...``) is exported before ``init_process_group`` only where NCCL really runs, and
``applied.nccl`` says whether it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from optbench import forkserver
from optbench.config import NCCLConfig, ParallelConfig
from optbench.errors import IncompatibleError
from optbench.exits import signal_of
from optbench.provenance import cpu_name

log = logging.getLogger(__name__)

# set in self-launched workers, so they know optbench (not torchrun) started them
LOCAL_WORKER_ENV = "OPTBENCH_LOCAL_WORKER"
# seconds the launcher gives workers to reach a step boundary and checkpoint after SIGTERM/SIGINT
# before it kills them (torch's own default is 30 s; TORCH_ELASTIC_SHUTDOWN_TIMEOUT overrides)
SHUTDOWN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Machine:
    """What this process can use: the device type asked for, CUDA devices present, CPU threads,
    and its place in the job (``launcher``: none, optbench or torchrun; ``spawns_workers`` is true
    for the process that will start optbench's local workers, whose world is the planned one)."""

    device: torch.device
    cuda_available: bool
    cuda_devices: int
    cpu_threads: int
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"
    spawns_workers: bool = False

    def describe(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return f"cpu ({cpu_name()}, {self.cpu_threads} threads)"


def env_world() -> tuple[int, int, int, int] | None:
    """(rank, local_rank, world_size, local_world_size) from a torchrun/elastic environment."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return (
        int(os.environ["RANK"]),
        int(os.environ.get("LOCAL_RANK", "0")),
        world,
        int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


def env_rank() -> int:
    """This process's global rank (0 outside a distributed environment)."""
    world = env_world()
    return world[0] if world else 0


def detect_machine(requested: str, *, parallel: ParallelConfig | None = None) -> Machine:
    """``requested`` is train.device: auto (CUDA when present), cpu or cuda. With ``parallel``,
    the machine also knows its rank and world: torchrun's (or optbench's workers') environment, or
    the planned world of the workers this process is about to launch."""
    cuda = torch.cuda.is_available()
    if requested == "cuda" and not cuda:
        raise IncompatibleError(
            "train.device=cuda but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); use train.device=cpu or train.device=auto"
        )
    use_cuda = cuda and requested in ("auto", "cuda")
    world = env_world()
    rank, local_rank, world_size, local_world = world if world else (0, 0, 1, 1)
    launcher, spawns = "none", False
    if world is not None:
        launcher = "optbench" if os.environ.get(LOCAL_WORKER_ENV) == "1" else "torchrun"
    elif parallel is not None and parallel.name != "single":
        launcher, spawns = "optbench", True
        world_size = local_world = parallel.nproc_per_node
    if use_cuda:
        index = local_rank if world is not None else torch.cuda.current_device()
        device = torch.device("cuda", index if index < torch.cuda.device_count() else 0)
    else:
        device = torch.device("cpu")
    warning = oversubscription(local_world, device=device) if parallel is not None and rank == 0 else None
    if warning:
        log.warning("%s", warning)
    return Machine(
        device=device,
        cuda_available=cuda,
        cuda_devices=torch.cuda.device_count() if cuda else 0,
        cpu_threads=torch.get_num_threads(),
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world,
        launcher=launcher,
        spawns_workers=spawns,
    )


# ------------------------------------------------------------------------------ process group
def resolve_backend(requested: str, *, device: torch.device) -> str:
    """auto: nccl on CUDA, gloo on CPU. An explicit backend that cannot run here is an error."""
    backend = requested if requested != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise IncompatibleError(
            "parallel.backend=nccl needs CUDA devices but this run uses the CPU; use "
            "parallel.backend=auto (gloo on CPU) or parallel.backend=gloo"
        )
    available = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available}[backend]()
    if not available:
        raise IncompatibleError(
            f"parallel.backend={backend} is not available in this torch build ({torch.__version__}); "
            "use parallel.backend=auto"
        )
    return backend


def apply_nccl_env(cfg: NCCLConfig, *, backend: str) -> dict[str, Any]:
    """Export the preset's NCCL variables, only where NCCL runs (before init_process_group, where
    NCCL reads them). Returns what ``applied.nccl`` records; a preset that cannot apply says why."""
    if not cfg.env:
        return {"name": cfg.name, "applied": False, "reason": "the preset sets no variables", "env": {}}
    if backend != "nccl":
        return {
            "name": cfg.name, "applied": False, "env": dict(cfg.env),
            "reason": f"no NCCL process group ({backend} on {'CPU' if backend == 'gloo' else backend})",
        }
    overridden = {k: os.environ[k] for k in cfg.env if k in os.environ and os.environ[k] != cfg.env[k]}
    os.environ.update(cfg.env)
    log.info("Applied NCCL environment %s: %s", cfg.name, " ".join(f"{k}={v}" for k, v in cfg.env.items()))
    return {"name": cfg.name, "applied": True, "env": dict(cfg.env), "overridden": overridden}


def init_process_group(machine: Machine, *, parallel: ParallelConfig, nccl: NCCLConfig) -> dict[str, Any]:
    """Join the job's process group (one process: nothing to join). Returns
    ``{"parallel": ..., "nccl": ...}`` for ``applied``. Ranks other than 0 log warnings only."""
    if machine.launcher == "none":
        return {
            "parallel": {"backend": None, "launcher": "none"},
            "nccl": {"name": nccl.name, "applied": False, "reason": "one process: no process group",
                     "env": dict(nccl.env)},
        }
    backend = resolve_backend(parallel.backend, device=machine.device)
    nccl_applied = apply_nccl_env(nccl, backend=backend)
    if machine.device.type == "cuda":
        torch.cuda.set_device(machine.device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, device_id=machine.device if backend == "nccl" else None)
    if machine.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    log.info("Applied process group %s: rank %d of %d (%s)", backend, machine.rank, machine.world_size,
             machine.launcher)
    info = {
        "backend": backend,
        "launcher": machine.launcher,
        "nodes": machine.world_size // max(1, machine.local_world_size),
        "nproc_per_node": machine.local_world_size,
        "threads_per_rank": torch.get_num_threads() if machine.device.type == "cpu" else None,
        # how optbench's own workers were started (torchrun starts its own)
        "start_method": parallel.start_method if machine.launcher == "optbench" else None,
    }
    return {"parallel": info, "nccl": nccl_applied}


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def mean_across_ranks(values: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of a tensor every rank holds (itself in one process)."""
    if not is_distributed():
        return values
    reduced = values.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced / dist.get_world_size()


def max_across_ranks(values: list[float], *, device: torch.device) -> list[float]:
    """Element-wise max over ranks (one collective for several numbers)."""
    if not is_distributed():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# ----------------------------------------------------------------------------------- launching
@dataclass
class LaunchOutcome:
    """What the local workers left: every rank's return value, or why there are none (a signal
    reached the launching process, or a worker failed)."""

    values: dict[int, Any] | None
    signum: int | None = None
    failure: str | None = None
    worker_signal: int | None = None  # a worker exited with 128 + this (stopped by a signal it got)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_per_worker(nproc: int) -> int:
    return max(1, usable_cores() // nproc)


def oversubscription(nproc: int, *, device: torch.device) -> str | None:
    """A warning when ``nproc`` CPU workers would share fewer cores: their step times then measure
    the time-sharing of the cores, not the parallel strategy."""
    cores = usable_cores()
    if device.type != "cpu" or nproc <= cores:
        return None
    return (f"parallel.nproc_per_node={nproc} starts {nproc} gloo workers on {cores} CPU core"
            f"{'s' if cores != 1 else ''}: each gets 1 thread and they take turns on the cores, so step "
            f"times measure that contention, not the parallel strategy; use parallel.nproc_per_node<={cores}")


def launch_local_workers(entrypoint: Callable[..., Any], *args: Any, nproc: int,
                         start_method: str = "forkserver") -> LaunchOutcome:
    """Run ``entrypoint(*args)`` in ``nproc`` local worker processes through
    ``torch.distributed.launcher.api.elastic_launch`` (standalone c10d rendezvous on a free port,
    no restarts). ``start_method``: forkserver (forked from a warm process that keeps torch and
    optbench imported across launches, ``optbench.forkserver``) or spawn (a fresh interpreter each).
    Workers get this process's environment at launch, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* like under
    torchrun and, unless OMP_NUM_THREADS is set, an even share of the CPU cores. SIGTERM/SIGINT
    reaching this process are forwarded to the workers, which checkpoint at their next step boundary."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from optbench.files import LOCK_TOKEN_ENV, lock_token

    # the workers may use the run (and checkpoint) directory this process locked for them
    env = {LOCAL_WORKER_ENV: "1", LOCK_TOKEN_ENV: lock_token()}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads_per_worker(nproc))
    timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix="optbench-workers-") as log_dir, _environ(env), _kept_signal_handlers(), \
            _rendezvous_names_from_frames():
        if start_method == "forkserver":
            server_env = forkserver.ensure_server(entrypoint.__module__, per_launch=env)
            args = (forkserver.WorkerStart(dict(os.environ), server_env), entrypoint, *args)
            entrypoint = forkserver.run_worker
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"optbench-{uuid.uuid4().hex[:12]}",
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
            start_method=start_method, logs_specs=DefaultLogsSpecs(log_dir=log_dir),
            **_shutdown_timeout(LaunchConfig, timeout),
        )
        try:
            return LaunchOutcome(values=elastic_launch(config, entrypoint)(*args))
        except SignalException as exc:
            return LaunchOutcome(values=None, signum=int(exc.sigval))
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            message = failure.message  # the worker's exception, as torch elastic's error file recorded it
            if isinstance(message, dict):
                message = message.get("message", "")
            message = str(message).strip().removeprefix("RuntimeError: ")  # optbench's re-raise
            last_line = message.splitlines()[0] if message else f"exit code {failure.exitcode}"
            worker_signal = signal_of(failure.exitcode)
            return LaunchOutcome(values=None, failure=f"worker rank {rank} failed: {last_line}",
                                 worker_signal=worker_signal)
        finally:
            if start_method == "forkserver":
                forkserver.launched(per_launch=env)


def _shutdown_timeout(launch_config: type, seconds: int) -> dict[str, int]:
    """LaunchConfig's ``shutdown_timeout`` (how long stopped workers get before SIGKILL) is newer than
    some supported torch builds (2.11 lacks it; there the grace period is torch's own 30 s)."""
    names = {f.name for f in dataclasses.fields(launch_config)}
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in names else {}


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the spawned workers, then put the old values back."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _method_name(depth: int = 2) -> str:
    """torch elastic's ``dynamic_rendezvous.get_method_name``, the same name read from the frame itself:
    the function ``depth`` frames above this one (``no_method_name`` past the outermost frame)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


@contextlib.contextmanager
def _rendezvous_names_from_frames() -> Iterator[None]:
    """The c10d rendezvous names every event it records after the method that recorded it, through
    ``get_method_name``, which calls ``inspect.stack()`` twice: a ``FrameInfo``, source line and
    position included, for every frame of the launcher's stack, and the name is built even when no
    event handler is set. A one-rank launch from a test's stack records 9 events and spent 0.16-0.22
    CPU-s on them (more under a deeper stack); ``_method_name`` gives the same names without
    it. Put back after the launch."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    own = dynamic_rendezvous.get_method_name
    dynamic_rendezvous.get_method_name = _method_name
    try:
        yield
    finally:
        dynamic_rendezvous.get_method_name = own


@contextlib.contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    """torch elastic installs its own SIGTERM/SIGINT/... handlers in the launching process and
    leaves them; put the previous ones back so a later job of a sweep behaves as the first."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {getattr(signal, n): signal.getsignal(getattr(signal, n)) for n in names if hasattr(signal, n)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def setup_worker_logging(rank: int) -> None:
    """Self-launched workers start without Hydra's logging: rank 0 logs to the console as the
    launching process does (train.log is attached by RunOutputs); other ranks only warn."""
    root = logging.getLogger()
    if rank == 0 and not root.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
