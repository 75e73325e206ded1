"""What ``optbench train`` records before its loop from its own config (``optbench.run.train``):
the traced memory (``memory.estimate_bytes``) and, once the config is known to fit, the predicted
step (``summary.json`` ``predicted``), both from one trace of the run's step."""

from __future__ import annotations

import logging
from typing import Any

import torch

from optbench.config import Config
from optbench.estimate.api import count_model, device_workspaces
from optbench.estimate.memtrace import NotTraceable
from optbench.estimate.roofline import HBM_BYTES_PER_S
from optbench.estimate.tracer import step_tracer

log = logging.getLogger(__name__)


def estimate_run(cfg: Config, *, world_size: int, device: torch.device) -> tuple[int | None, Any]:
    """What ``optbench train`` records before its loop: the traced steady-state peak per device for
    the run's own config and device type (``memory.estimate_bytes``; None when the step cannot be
    traced), and a callable the run calls once the config is known to fit, which returns the
    predicted step (``summary.json`` ``predicted``; None with ``estimate.predict=false``)."""
    from optbench.estimate.predict import traces_for

    predicting = cfg.estimate.predict
    try:
        with step_tracer(cfg, world_size=world_size, target=device.type,
                         workspaces=device_workspaces(device.type)) as trace:
            first = trace(cfg.train.batch_size, ops=predicting)
            ops = traces_for(cfg, trace, cfg.train.batch_size, first=first) if predicting else None
    except NotTraceable as exc:
        log.warning("memory.estimate_bytes and the prediction are null: %s", exc)
        why = {"error": f"not predicted: {exc}"} if predicting else None
        return None, lambda: why

    def predicted() -> dict[str, Any] | None:
        return None if ops is None else predict_run(cfg, ops=ops, world_size=world_size, device=device)

    return first.steady_peak().total, predicted


def predict_run(cfg: Config, *, ops: tuple, world_size: int, device: torch.device) -> dict[str, Any]:
    """The run's own step predicted: on a CPU by the per-op benchmark here (the ranks of a job
    measure their link on its own group), on a known GPU by its roofline. A prediction that cannot
    be made says why (``error``) and the run goes on: it is a report, not an optimization."""
    import torch.distributed as dist

    from optbench.estimate.links import group_link
    from optbench.estimate.predict import complete, on_gpu, on_this_machine
    from optbench.measure import gpu_peak_key

    counts = count_model(cfg)
    typical, heavy = ops
    if device.type == "cuda":
        key = gpu_peak_key(torch.cuda.get_device_name(device))
        if key not in HBM_BYTES_PER_S:
            return {"error": f"not predicted: no datasheet bandwidth for {torch.cuda.get_device_name(device)}"}
        prediction = on_gpu(cfg, key=key, world_size=world_size)
    else:
        link = group_link() if world_size > 1 and dist.is_initialized() else None
        prediction = on_this_machine(cfg, device=device, world_size=world_size, threads=torch.get_num_threads(),
                                     link=link)
    try:
        return complete(prediction, typical=typical, heavy=heavy, flops_per_token=counts.flops_per_token,
                        seq_len=counts.seq_len, trainable_params=counts.trainable,
                        device=device if device.type == "cpu" else None)
    except (RuntimeError, NotImplementedError) as exc:  # an op this machine cannot run as traced
        log.warning("the step time is not predicted: %s", exc)
        return {"error": f"not predicted: {type(exc).__name__}: {exc}".splitlines()[0]}
