"""The Hydra callback that writes ``optbench report``'s report at the end of every sweep
(conf/train.yaml, ``hydra.callbacks.report``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from optbench.report.analysis import build_report
from optbench.report.format import render, write_outputs


def _track_report(config: Any, sweep_dir: Path) -> None:
    """The report to the sweep's trackers (``log.trackers``: MLflow's parent run, W&B's group)."""
    from omegaconf import OmegaConf

    from optbench.tracking import log_sweep_report

    log_cfg = OmegaConf.to_object(config.log)
    if not set(log_cfg.trackers) - {"tensorboard"}:
        return
    try:
        log_sweep_report(log_cfg, sweep_dir, [sweep_dir / f"report.{ext}" for ext in ("md", "csv", "json")])
    except Exception as exc:  # the report is on disk; the trackers missed it
        print(f"optbench: sweep report not sent to {', '.join(log_cfg.trackers)} ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)


class SweepReport(Callback):
    """Hydra callback (conf/train.yaml, ``hydra.callbacks.report``): at the end of every multirun
    sweep, write the report into the sweep dir and print its table.

    A report that cannot be made must never fail the sweep whose runs are already on disk: the
    reason is printed as one line with the command to retry, and the sweep's exit status stands.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        sweep_dir = self.sweep_dir or Path(str(config.hydra.sweep.dir))
        try:
            report = build_report([sweep_dir])
            write_outputs(report, sweep_dir)
            sys.stdout.write(render(report, "table"))
            print(f"optbench: sweep report written to {sweep_dir / 'report.md'}", flush=True)
            _track_report(config, sweep_dir)
        except Exception as exc:  # the sweep's runs stand; the report can be made again by hand
            print(f"optbench: sweep report not written ({type(exc).__name__}: {exc}); "
                  f"run `optbench report {sweep_dir}`", file=sys.stderr, flush=True)
