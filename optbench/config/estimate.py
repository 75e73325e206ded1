"""Schema of ``optbench estimate`` (the ``estimate:`` node of conf/estimate.yaml; ``optbench.estimate``)."""

from __future__ import annotations

from dataclasses import dataclass

from optbench.config.checks import one_of, positive
from optbench.errors import ConfigError

# ------------------------------------------------------------------------------------- estimate
ESTIMATE_GPUS = ("h100", "a100", "h200", "none")
ESTIMATE_FORMATS = ("table", "json", "markdown")


@dataclass
class EstimateConfig:
    """``optbench estimate``: the device the estimate is judged against and how it is printed.

    ``world_size`` null means the run's own (``parallel.nproc_per_node``; 1 for ``parallel=single``).
    ``gpu`` names the card (its memory and dense peak); ``device_gb`` (GiB) overrides its memory, or
    gives one for ``gpu=none``. ``headroom`` is the fraction of the device kept free for the CUDA
    context, NCCL and allocator fragmentation (MemTracker counts allocated bytes, like
    ``torch.cuda.max_memory_allocated``). ``search`` traces further steps (first just past where
    the first trace's peak puts the answer, then a bracketed search) for the largest micro-batch
    that fits. ``mfu`` is the utilisation tokens/s are predicted at. ``stacked`` (null: whenever
    the blocks allow) traces two or three short copies of the model and stacks their blocks
    (``optbench.estimate.tracer``); false traces the whole model (the same bytes, several times
    slower for 50 blocks)."""

    world_size: int | None = None
    gpu: str = "h100"
    device_gb: float | None = None
    headroom: float = 0.1
    format: str = "table"
    mfu: float = 0.4
    search: bool = True
    stacked: bool | None = None
    # GPU counts whose fit is traced beside the run's own (one: parallel=single; more: FSDP2 across
    # them); null: 1, 2 and 4 for a fused model (task=climate_text), none otherwise
    fits_on: list[int] | None = None
    # the predicted step (optbench.estimate.predict): on estimate.gpu's card (a roofline), or on
    # this machine (the per-op benchmark) with gpu=none; link_gbps states the collectives' bandwidth
    predict: bool = True
    # optbench train: the run's own trace before its loop (memory.estimate_bytes, the fit check of
    # run.check_memory, the predicted step); false skips it, for a quick run of a model whose trace
    # takes long (the summary then says the estimate was not made)
    in_run: bool = True
    link_gbps: float | None = None
    # optbench plan: samples per optimizer step over all ranks (null: the config's own) and how
    # many of the ranked configurations to print
    global_batch: int | None = None
    top: int = 5

    def __post_init__(self) -> None:
        if self.link_gbps is not None:
            positive(**{"estimate.link_gbps": self.link_gbps})
        if self.global_batch is not None:
            positive(**{"estimate.global_batch": self.global_batch})
        positive(**{"estimate.top": self.top})
        if self.fits_on is not None and any(n < 1 for n in self.fits_on):
            raise ConfigError(f"estimate.fits_on={self.fits_on}: GPU counts are 1 or more, e.g. estimate.fits_on=[1,2,4]")
        if self.world_size is not None and self.world_size < 1:
            raise ConfigError(
                f"estimate.world_size must be >= 1, got {self.world_size}; use the number of GPUs of the "
                "job, or null for parallel.nproc_per_node"
            )
        if self.gpu not in ESTIMATE_GPUS:
            raise ConfigError(
                f"estimate.gpu={self.gpu} is unknown; use {', '.join(ESTIMATE_GPUS)} "
                "(with estimate.device_gb=N for another card)"
            )
        if self.device_gb is not None:
            positive(**{"estimate.device_gb": self.device_gb})
        if not 0.0 <= self.headroom < 1.0:
            raise ConfigError(f"estimate.headroom must be in [0, 1), got {self.headroom}")
        one_of("estimate.format", self.format, ESTIMATE_FORMATS)
        if not 0.0 < self.mfu <= 1.0:
            raise ConfigError(f"estimate.mfu must be in (0, 1], got {self.mfu}")
