"""``optbench estimate`` and ``optbench plan``: compose the config with Hydra (every train override
works, ``-m`` gives one estimate per job), print what ``optbench.estimate.api.estimate`` or
``optbench.estimate.plan.plan`` finds. ``--help`` imports neither torch nor the estimate."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

from hydra.experimental.callback import Callback

from optbench.config.hydra_errors import held_stderr
from optbench.config.hydra_loader import composing_once_per_file
from optbench.config.hydra_mode import mode_read_without_composing
from optbench.errors import ConfigError
from optbench.exits import BAD_INPUT, OK, fail

_GC_HELD = False  # main turned the collector off for the imports (collect_from_here turns it back on)


class NoCallback(Callback):
    """conf/estimate.yaml's stand-in for ``optbench train``'s Hydra callbacks (the finished-run
    guard, the sweep's report): an estimate writes no run directory and trains nothing, so it has
    nothing to guard or review, and importing them (checkpoints, summaries, reports) would only
    cost time. Hydra's Callback: every hook does nothing."""

    def __init__(self, **_: Any) -> None:
        pass


def collect_from_here() -> None:
    """Cyclic garbage collection, held off by ``main`` while torch, transformers and Hydra are
    imported (their ~400,000 objects, each full collection of which costs about 0.1 s of CPU; an
    estimate of a tiny model spent 1.1 s of its 7-10 in the collector), resumes here with those
    objects frozen: kept, and no longer scanned. What the traces allocate is collected as before.
    Once per command: a sweep's later jobs would otherwise freeze what the earlier ones left behind."""
    global _GC_HELD
    if _GC_HELD:
        gc.freeze()
        gc.enable()
        _GC_HELD = False


def _lean(cfg: Any) -> None:
    """A Hugging Face model's estimate imports transformers' modeling code: without the packages it
    would import for nothing (``optbench.estimate.lean``)."""
    from omegaconf import OmegaConf

    if OmegaConf.select(cfg, "model.hf") is not None:
        from optbench.estimate.lean import transformers_without_unused

        transformers_without_unused()


def estimate_text(cfg: Any, *, header: bool = True) -> str:
    """``optbench estimate`` on a composed config: the text to print."""
    from optbench.config import to_config
    from optbench.estimate.api import estimate
    from optbench.estimate.format import render

    _lean(cfg)
    config = to_config(cfg)
    collect_from_here()
    return render(estimate(config), fmt=config.estimate.format, header=header)


def plan_text(cfg: Any) -> str:
    """``optbench plan`` on a composed config: the text to print."""
    import json

    from optbench.config import to_config
    from optbench.estimate.plan import format_plan, plan

    _lean(cfg)
    config = to_config(cfg)
    collect_from_here()
    result = plan(config)
    return json.dumps(result, indent=2) if config.estimate.format == "json" else \
        format_plan(result, top=config.estimate.top)


def main(argv: list[str], *, command: str = "estimate") -> None:
    """``optbench estimate|plan OVERRIDES``: one text per job, printed as it is made."""
    if "-h" in argv or "--help" in argv:  # Hydra's would print the whole composed train config
        from optbench.usage import hydra_help

        print(hydra_help(command))
        raise SystemExit(OK)
    global _GC_HELD
    _GC_HELD = gc.isenabled()
    gc.disable()  # until collect_from_here, after the imports
    try:
        _composed_and_run(argv, command=command)
    finally:
        if _GC_HELD:  # on every way out, bad input included (a caller in this process keeps collecting)
            gc.enable()


def _composed_and_run(argv: list[str], *, command: str) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from optbench.config import conf_dir
    from optbench.config.renames import upgrade_and_warn

    started = False

    @hydra.main(config_path=str(conf_dir()), config_name="estimate", version_base="1.3")
    def job(cfg) -> None:
        nonlocal started
        started = True
        hydra_cfg = HydraConfig.get()
        try:
            text = plan_text(cfg) if command == "plan" else \
                estimate_text(cfg, header=hydra_cfg.mode == RunMode.RUN or hydra_cfg.job.num == 0)
        except ConfigError as exc:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            fail(str(exc))
        print(text, flush=True)

    sys.argv = [f"optbench {command}", *upgrade_and_warn(argv)]
    try:
        with held_stderr(lambda: started), mode_read_without_composing(), composing_once_per_file():
            # errors as one line; one composition; each config file parsed once
            job()
    except SystemExit as exc:
        if not started and exc.code == 1:  # Hydra could not compose the config: bad input
            raise SystemExit(BAD_INPUT) from None
        raise
