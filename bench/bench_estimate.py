"""make bench-estimate: how close is ``optbench estimate`` to the memory a run really uses?

For each model x precision x activation checkpointing (and DDP and FSDP2 over two local workers),
one short ``optbench train`` run (in this process, one after the other) records both numbers in its summary.json: ``memory.estimate_bytes``
(the FakeTensor trace of that very config, before the loop) and ``memory.peak_bytes`` (on a CPU:
torch's MemTracker following the real tensors of one whole steady-state step, step 2; on CUDA:
``torch.cuda.max_memory_allocated`` over the run; the largest rank's with DDP/FSDP2). The closed form (bytes/param + activations) is
printed beside them. Prints every error and the worst; exits 1 when the worst exceeds --max-error.

    python bench/bench_estimate.py [--models tiny,small] [--hf llama,gemma,...] [--max-error 0.01]

Hugging Face rows (``--hf``): tiny causal LMs of architectures optbench never names, written here with
``save_pretrained`` (random weights), each trained in its default configuration (fp32, AdamW, SDPA;
transformers' eager attention where it has no SDPA path), one bf16 + full checkpointing row.

On a GPU, cuBLAS's workspace (tens of MiB, allocated through the caching allocator) is part of
max_memory_allocated and of no trace: use --models small,134m there so it stays a small fraction.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optbench.config import to_config  # noqa: E402
from optbench.estimate.api import closed_form, count_model  # noqa: E402
from optbench.estimate.format import gib  # noqa: E402
from optbench.logs import quiet_imports  # noqa: E402
from optbench.run.train import train  # noqa: E402

# The CPU peak is MemTracker's on the last warm-up step (measure.warmup_steps - 1): with 3, step 2, a
# steady-state step. Step 1 is not one: DDP rebuilds its gradient buckets there (in the order the
# first backward produced gradients), so MemTracker sees them allocated inside the step, while on
# every later step they already exist.
RUN = ["train.steps=4", "measure.warmup_steps=3", "train.batch_size=8", "train.seq_len=128",
       "train.eval_batches=1", "log.progress=log"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from optbench.config import conf_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(conf_dir())):
        return hydra_compose(config_name="train", overrides=overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="default: tiny,small on a CPU, small,134m on CUDA")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--ac", default="none,full", help="activation checkpointing (ac=) presets")
    parser.add_argument("--max-error", type=float, default=0.01)
    parser.add_argument("--hf", default=",".join(HF_ARCHS), help="Hugging Face architectures ('' for none)")
    parser.add_argument("--no-scale", action="store_true", help="skip the 9.9b/13.1b/hf_llama3_8b stacked-vs-whole timing")
    parser.add_argument("--scale-limit", type=float, default=10.0, help="seconds per stacked 9.9b/13.1b/hf_llama3_8b estimate")
    args = parser.parse_args()
    import torch

    target = "cuda" if torch.cuda.is_available() else "cpu"
    models = args.models or ("small,134m" if target == "cuda" else "tiny,small")

    own = [(m, p, ac, "single") for m, p, ac in itertools.product(
        models.split(","), args.precisions.split(","), args.ac.split(","))]
    first = models.split(",")[0]  # and data parallelism over 2 local workers (gloo on a CPU)
    if target == "cpu" or torch.cuda.device_count() >= 2:
        own += [(first, "fp32", "none", "ddp"), (first, "bf16", "full", "fsdp2")]
    else:
        print("(DDP and FSDP2 rows need 2 GPUs; this machine has 1)")
    grid = [(f"{model} {precision} ac={ac}" + ("" if parallel == "single" else f" {parallel} x 2"),
             [f"model={model}", f"precision={precision}", f"ac={ac}", f"parallel={parallel}",
              "parallel.nproc_per_node=" + ("1" if parallel == "single" else "2")])
            for model, precision, ac, parallel in own]
    with tempfile.TemporaryDirectory() as hf_root:
        grid += hf_grid([a for a in args.hf.split(",") if a], Path(hf_root))
        worst = _rows(grid, target=target)
    print(f"worst estimate error: {worst[0]:.2%} ({worst[1]}); limit {args.max_error:.0%}")
    wrong = [] if args.no_scale else scale_rows(args.scale_limit)
    if worst[0] > args.max_error or wrong:
        raise SystemExit(1)


# tiny decoders of architectures optbench's code never names, each with its quirk: grouped or
# multi-query KV heads, tied embeddings, soft-capping and a sliding window, partial rotary, learned
# positions, ALiBi, parallel attention + MLP
HF_ARCHS = ("llama", "gemma", "gemma2", "phi", "opt", "bloom", "stablelm", "falcon")
NO_SDPA = ("gemma2", "bloom")  # transformers has no SDPA path for these: attention=math


def hf_config(name: str):
    import transformers as t

    shape = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=2048, max_position_embeddings=128)
    return {
        "llama": lambda: t.LlamaConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=1, **shape),
        "gemma": lambda: t.GemmaConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=1, head_dim=16,
                                       **shape),
        "gemma2": lambda: t.Gemma2Config(hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                         sliding_window=32, **shape),
        "phi": lambda: t.PhiConfig(hidden_size=64, intermediate_size=128, partial_rotary_factor=0.5,
                                   resid_pdrop=0.0, embd_pdrop=0.0, **shape),
        "opt": lambda: t.OPTConfig(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, **shape),
        "bloom": lambda: t.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=2048, hidden_dropout=0.0),
        "stablelm": lambda: t.StableLmConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                                             partial_rotary_factor=0.25, **shape),
        "falcon": lambda: t.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                                         alibi=False, vocab_size=2048, hidden_dropout=0.0),
    }[name]()


def hf_grid(archs: list[str], root: Path) -> list[tuple[str, list[str]]]:
    """(row name, overrides) per architecture, its directory written under ``root``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's, between the rows
    rows = []
    for arch in archs:
        torch.manual_seed(1)
        with quiet_imports():  # transformers' modeling code imports torchao, as in optbench's own build
            AutoModelForCausalLM.from_config(hf_config(arch)).save_pretrained(root / arch)
        base = ["model=hf", f"model.hf.config={root / arch}", *(["attention=math"] if arch in NO_SDPA else [])]
        rows.append((f"hf {arch} fp32 ac=none", base))
        if arch == "llama":
            rows.append((f"hf {arch} bf16 ac=full", [*base, "precision=bf16", "ac=full"]))
    return rows


def _rows(grid: list[tuple[str, list[str]]], *, target: str) -> tuple[float, str]:
    """Runs every row of the grid, printing estimate and measured side by side; the worst error."""
    worst = (0.0, "")
    print(f"{'config':<28}{'measured':>12}{'estimate':>12}{'bytes off':>10}{'error':>9}{'closed form':>13}{'error':>8}"
          "  measured by")
    for name, overrides in grid:
        overrides = [*overrides, *RUN]
        with tempfile.TemporaryDirectory() as run_dir:
            result = train(compose(overrides), run_dir=run_dir)
        if result.status != "completed":
            raise SystemExit(f"{' '.join(overrides)}: {result.status}: {result.error}")
        memory = result.summary["memory"]
        measured, estimated = memory["peak_bytes"], memory["estimate_bytes"]
        cfg = to_config(compose(overrides))
        closed = closed_form(cfg, counts=count_model(cfg), world_size=result.summary["world_size"],
                             micro_batch=cfg.train.batch_size, target=target)["total"]
        error = (estimated - measured) / measured
        closed_error = (closed - measured) / measured
        worst = max(worst, (abs(error), name))
        print(f"{name:<28}{gib(measured):>12}{gib(estimated):>12}{estimated - measured:>+10,}{error:>+9.2%}"
              f"{gib(closed):>13}{closed_error:>+8.1%}  {memory['peak_source'].split(';')[0]}", flush=True)
    return worst


# The plan's models as a user estimates them (the command, its process start included), stacked
# (the default) and with the whole model traced, one after the other: seconds, the peak and the
# micro-batch search's answer of each, and their difference (the stacked estimate must equal the
# whole trace within 0.5%; on the configs here it is byte-exact).
SCALE = [
    ["model=9.9b", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8"],
    ["model=13.1b", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8"],
    ["model=13.1b", "precision=bf16", "parallel=fsdp2", "estimate.world_size=8", "ac=full"],
    ["model=hf_llama3_8b", "parallel=fsdp2", "estimate.world_size=8"],
]


def scale_rows(limit_s: float) -> list[str]:
    """Prints the stacked vs whole estimate of each SCALE config, with the whole/stacked time ratio
    (side by side, so it holds on a busy machine); returns the configs whose stacked estimate is more
    than 0.5% off the whole trace or finds another largest micro-batch. The seconds are compared
    with ``limit_s`` and reported with the load, not failed on: a busy machine could fake either."""
    import json
    import os
    import subprocess
    import time

    print(f"\n{'optbench estimate ... (micro-batch search on)':<62}{'stacked':>10}{'whole':>9}{'ratio':>7}  "
          "peak (stacked = whole?)  largest micro-batch  how")
    wrong, slow = [], []
    for overrides in SCALE:
        runs = {}
        for stacked in ("null", "false"):
            command = [sys.executable, "-m", "optbench", "estimate", *overrides, "estimate.format=json",
                       f"estimate.stacked={stacked}"]
            started = time.perf_counter()
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[stacked] = (time.perf_counter() - started, json.loads(out))
        (fast, a), (whole_s, b) = runs["null"], runs["false"]
        peak_a, peak_b = a["memory"]["traced"]["total"], b["memory"]["traced"]["total"]
        off = (peak_a - peak_b) / peak_b
        search_a, search_b = (r["micro_batch_search"]["max_micro_batch"] for r in (a, b))
        how = a["memory"]["method"].rpartition("save; ")[2]
        print(f"{' '.join(overrides):<62}{fast:>9.1f}s{whole_s:>8.1f}s{whole_s / fast:>6.1f}x  {gib(peak_a)} "
              f"({'byte-exact' if peak_a == peak_b else f'{off:+.3%}'})  {search_a} (whole: {search_b})  {how}")
        if abs(off) > 0.005 or search_a != search_b:
            wrong.append(" ".join(overrides))
        if fast > limit_s:
            slow.append(" ".join(overrides))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"within 0.5% of the whole trace: {'all' if not wrong else 'MISSED by ' + ', '.join(wrong)}; "
          f"under {limit_s:.0f} s: {'all' if not slow else 'not ' + ', '.join(slow)} (load average {load})")
    return wrong


if __name__ == "__main__":
    main()
