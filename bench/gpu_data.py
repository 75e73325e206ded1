"""``bash bench/gpu_check.sh data``: a climate model trained on the card from a NetCDF file.

Writes an uncompressed synthetic datacube (``write_synthetic``, 1-degree grid, 8 steps per chunk),
then runs ``optbench train task=climate data=netcdf`` on it with each loader setting and prints,
per run: the data wait (share of the timed step time spent waiting for the next batch), samples/s
(batch size / median step time), the step time, and what the DataLoader really applied. Settings:
the default loader (``dataloader=baseline``: no worker processes, ``data.prefetch=2``, batches
gathered straight into page-locked memory on CUDA), no prefetch thread (``data.prefetch=0``), and
``dataloader=tuned`` (2 worker processes, batches in reused shared-memory slots, pinned by torch's
pinning thread). Before the runs, one batch of the default loader is checked to be page-locked
(``is_pinned``) on CUDA. ``--tiny`` runs the same at a tiny size on any device (the CPU test).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from optbench.config import compose, to_config  # noqa: E402
from optbench.data.netcdf.synth import write_synthetic  # noqa: E402

SETTINGS = {
    "default (no workers, prefetch 2)": ["dataloader=baseline"],
    "no prefetch thread": ["dataloader=baseline", "data.prefetch=0"],
    "dataloader=tuned (2 workers)": ["dataloader=tuned"],
}


def pinned_batch(overrides: list[str]) -> str:
    """Whether the default loader's batches are page-locked where they are built (CUDA only)."""
    from optbench.distributed import detect_machine
    from optbench.tasks import build_task
    from optbench.training.build import build_train_loader

    if not torch.cuda.is_available():
        return "no CUDA: pinned memory does not apply"
    cfg = to_config(compose(overrides))
    machine = detect_machine(cfg.train.device, parallel=cfg.parallel)
    task = build_task(cfg)
    batch = next(iter(build_train_loader(task.build_datasets()[0], cfg=cfg, machine=machine)))
    return f"a batch of the default loader is page-locked: {batch['frames'].is_pinned()}"


def run(name: str, overrides: list[str], *, out: Path) -> dict:
    from optbench.run.train import train

    started = time.perf_counter()
    run_dir = out / re.sub(r"[^A-Za-z0-9]+", "_", name)
    result = train(compose(overrides), run_dir=run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"name": name, "status": result.status, "error": result.error, "wall_s": time.perf_counter() - started}
    if result.status == "completed":
        tp = summary["throughput"]
        batch = summary["config"]["train"]["batch_size"]
        row.update(data_wait=tp["data_wait_frac"], step=tp["step_time_s"], samples_per_s=batch / tp["step_time_s"]["median"],
                   applied=summary["applied"]["dataloader"], timed=tp["timed_steps"])
    return row


def line(row: dict) -> str:
    if row["status"] != "completed":
        return f"| {row['name']} | {row['status']}: {row['error']} | | | |"
    step, applied = row["step"], row["applied"]
    return (f"| {row['name']} | {100 * row['data_wait']:.2f}% | {row['samples_per_s']:,.1f} | {1e3 * step['median']:.1f} ms "
            f"[{1e3 * step['p10']:.1f}-{1e3 * step['p90']:.1f}] over {row['timed']} | workers {applied['num_workers']}, "
            f"pin_memory {applied['pin_memory']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny file and model (the CPU test)")
    parser.add_argument("--models", nargs="+", default=["small", "base"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gb", type=float, default=0.9, help="size of the file (uncompressed float32)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    with tempfile.TemporaryDirectory(prefix="optbench-gpu-data-") as tmp:
        path = Path(tmp) / "data.nc"
        nlat, nlon = (16, 32) if args.tiny else (181, 360)
        steps = 24 if args.tiny else int(args.gb * 1e9 / (17 * nlat * nlon * 4))
        meta = write_synthetic(path, days=steps * 6 / 24, nlat=nlat, nlon=nlon, compress=False)
        models = ["tiny"] if args.tiny else args.models
        common = ["task=climate", "data=netcdf", f"data.paths=[{path}]", f"data.stats_cache={Path(tmp) / 'stats'}",
                  f"train.steps={4 if args.tiny else args.steps}", f"train.batch_size={2 if args.tiny else args.batch_size}",
                  f"measure.warmup_steps={1 if args.tiny else 5}", "log.progress=log", "train.eval_batches=0",
                  "measure.track_memory=false", f"precision={'bf16' if torch.cuda.is_available() else 'fp32'}"]
        print(f"{device}: {meta['steps']} steps x 17 channels on a {nlat}x{nlon} grid, {meta['raw_bytes'] / 1e9:.2f} GB "
              f"uncompressed NetCDF4; {os.cpu_count()} CPUs")
        print(pinned_batch([*common, f"model={models[0]}", "dataloader=baseline"]))
        rows = ["| loader | data wait | samples/s | step median [p10-p90], timed steps | applied |",
                "| --- | ---: | ---: | --- | --- |"]
        for model in models:
            rows.append(f"| **model={model}** | | | | |")
            for name in args.settings:
                extra = SETTINGS[name]
                rows.append(line(run(f"{model} {name}", [*common, f"model={model}", *extra], out=Path(tmp) / "runs")))
                print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    batch = 2 if args.tiny else args.batch_size
    (args.out / "data.md").write_text(f"{device}, batch {batch}, {os.cpu_count()} CPUs\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
