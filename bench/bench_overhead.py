"""make bench: does optbench's training step cost anything over a minimal hand-written loop?

In one process, two identical models (same dims, same initial weights) are trained alternately:
  A  optbench: its DataLoader over synthetic data, ``train_step`` (autocast context, loss,
     backward, clipping, finite checks, optimizer), the scheduler step, the synchronized clock;
  B  hand-written: a pre-built batch, forward, cross-entropy, backward, clip, step, zero_grad.
Rounds alternate A and B so that machine noise hits both alike; the first round of each is warm-up.
Prints median tokens/s of each with p10-p90 spread and the ratio A/B (target >= 0.97).

    python bench/bench_overhead.py [--rounds 6] [--steps-per-round 2] [--dims tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optbench.build import build_model, build_train_loader, materialize  # noqa: E402
from optbench.config import to_config  # noqa: E402
from optbench.distributed import detect_machine  # noqa: E402
from optbench.metrics import StepClock, percentile  # noqa: E402
from optbench.optim.optimizers import build_optimizer, build_scheduler  # noqa: E402
from optbench.step import train_step  # noqa: E402
from optbench.tasks import build_task  # noqa: E402

DIMS = {
    # the reference dims: dim 512, 8 layers, 8 heads, ffn 2048, vocab 32000, batch 8 x 256
    "reference": ["model.dim=512", "model.layers=8", "model.heads=8", "model.ffn_dim=2048",
                  "model.vocab_size=32000", "train.batch_size=8", "train.seq_len=256"],
    "tiny": ["model=tiny", "train.batch_size=8", "train.seq_len=128"],
}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from optbench.config import conf_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return to_config(hydra_compose(config_name="train", overrides=overrides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--dims", choices=sorted(DIMS), default="reference")
    parser.add_argument("--min-ratio", type=float, default=0.97)
    args = parser.parse_args()

    cfg = compose([*DIMS[args.dims], "precision=fp32", "train.device=cpu", "train.steps=1000",
                   "train.warmup_steps=10"])
    machine = detect_machine("cpu")
    device = machine.device
    task = build_task(cfg)
    train_set, _ = task.build_datasets()

    model_a = build_model(cfg, task)
    materialize(model_a, device=device, seed=0)
    model_b = build_model(cfg, task)
    materialize(model_b, device=device, seed=0)
    opt_a = build_optimizer(model_a, cfg=cfg.optimizer, lr=cfg.train.lr)
    sched_a = build_scheduler(opt_a, cfg=cfg.train)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1)
    batches_a = iter(build_train_loader(train_set, cfg=cfg, machine=machine))
    fixed = next(iter(build_train_loader(train_set, cfg=cfg, machine=machine)))["tokens"]
    inputs_b, targets_b = fixed[:, :-1].contiguous(), fixed[:, 1:].contiguous()
    clock = StepClock(device)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len

    def step_a(step: int) -> float:
        clock.start()
        train_step(model_a, task=task, optimizer=opt_a, batches=batches_a, device=device, cfg=cfg,
                   step=step, with_aux=False)
        sched_a.step()
        return clock.stop()

    def step_b(step: int) -> float:
        start = time.perf_counter()
        logits = model_b(inputs_b)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets_b.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model_b.parameters(), 1.0)
        opt_b.step()
        opt_b.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"optbench": [], "hand-written": []}
    step = 0
    print(f"dims={args.dims} ({cfg.model.dim}x{cfg.model.layers}, vocab {cfg.model.vocab_size}, "
          f"batch {cfg.train.batch_size}x{cfg.train.seq_len}), fp32, {torch.get_num_threads()} threads; "
          f"{args.rounds} rounds x {args.steps_per_round} steps each, round 0 is warm-up", flush=True)
    for round_index in range(args.rounds):
        order = [("optbench", step_a), ("hand-written", step_b)]
        if round_index % 2:
            order.reverse()  # ABBA: neither side always runs first
        for name, fn in order:
            for _ in range(args.steps_per_round):
                elapsed = fn(step)
                if round_index > 0:
                    times[name].append(elapsed)
            step += 1
        print(f"  round {round_index}: done", flush=True)

    rates = {}
    for name, values in times.items():
        tps = [tokens_per_step / t for t in values]
        rates[name] = statistics.median(tps)
        print(f"{name:>13}: {rates[name]:,.0f} tokens/s median [p10 {percentile(tps, 10):,.0f} - "
              f"p90 {percentile(tps, 90):,.0f}] over {len(tps)} steps")
    ratio = rates["optbench"] / rates["hand-written"]
    verdict = "PASS" if ratio >= args.min_ratio else "FAIL"
    print(f"ratio optbench / hand-written tokens/s = {ratio:.3f} (target >= {args.min_ratio}) {verdict}")
    raise SystemExit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
