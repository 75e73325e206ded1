"""What ``optbench COMMAND --help`` says: what the command does, its own options, two examples a new
user can run as they are, then where it is described (the config reference for the commands that
take train's overrides). Nothing here imports torch or composes a config: help answers at once.

``train`` and ``estimate`` take Hydra overrides; Hydra's own ``--help`` prints the whole composed
config, so their help is written here (``--hydra-help`` still gives Hydra's). The other commands
are argparse parsers: they print their options themselves, with ``epilog(command)`` below them.
"""

from __future__ import annotations

import argparse
import textwrap

# where every group and key of the config is described: below the help of a command that takes
# train's overrides
CONFIG_REFERENCE = ("config reference: docs/training.md (every group and key)\n"
                    "  docs/optimizations.md (what each optimization does, the phases);\n"
                    "  `optbench train --cfg job OVERRIDES` prints the config the overrides compose,\n"
                    "  and trains nothing")

# where each command is described, below its help
REFERENCES = {
    "train": CONFIG_REFERENCE, "estimate": CONFIG_REFERENCE, "plan": CONFIG_REFERENCE, "validate": CONFIG_REFERENCE,
    "report": "reference: docs/report.md (what report writes, its gates and exit status)\n"
              "  docs/reading-output.md (reading its tables)",
    "compare": "reference: docs/report.md (compare's runs and report)\n"
               "  docs/training.md (the overrides of each side are optbench train's)",
    "generate": "reference: docs/climate-llm.md (climate_text models, generating, the score)",
    "export": "reference: docs/tracking.md#exporting-a-trained-model (the formats, what is refused)",
    "cache": "reference: docs/measuring.md#caches (what each cache holds)",
    "data": "reference: docs/climate-data.md (synth, inspect)\n"
            "  docs/climate-llm.md (captions), docs/tokenizers.md (tokenizer, tokenize)",
}

EXAMPLES = {
    "train": ["optbench train model=tiny train.steps=14",
              "optbench train -m 'phase=glob(*)' model=tiny train.steps=14   # the plan's phases, then report.md"],
    "estimate": ["optbench estimate model=9.9b",
                 "optbench estimate model=1b train.seq_len=2048 precision=bf16 estimate.gpu=h200"],
    "plan": ["optbench plan model=1b train.seq_len=2048 estimate.gpu=h100 estimate.world_size=8",
             "optbench plan model=hf_llama3_8b estimate.gpu=h200 estimate.world_size=8 estimate.global_batch=64"],
    "data": ["optbench data synth data.nc --days 30",
             "optbench data inspect data.nc"],
    "report": ["optbench report outputs/",
               "optbench report outputs/ --min-speedup 3.0 --max-loss-delta 0.001 --max-memory-ratio 3.33 "
               "--format markdown"],
    "compare": ["optbench compare model=tiny train.steps=14 compile=none -- model=tiny train.steps=14 compile=default",
                "optbench compare model=tiny ac=none -- model=tiny ac=full --repeats 2 "
                "--max-memory-ratio 0.8"],
    "generate": ["optbench generate outputs/runs/<date>/<time> --samples 8 --climate all --score",
                 "optbench generate outputs/runs/<date>/<time> --time 2000-03-08T18:00:00 --temperature 0.8 --top-k 20"],
    "export": ["optbench export outputs/runs/<date>/<time> exported/   # then AutoModelForCausalLM.from_pretrained('exported')",
               "optbench export outputs/runs/<date>/<time>/checkpoints/step-00000300 exported-300/"],
    "cache": ["optbench cache list",
              "optbench cache clear cpu_peak   # the next run measures this CPU's peak again"],
    "validate": ["optbench validate model=tiny train.steps=14 --repeats 2",
                 "optbench validate model=tiny train.steps=14 --repeats 2 candidate=2_ac --all-phases"],
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, except that a line of the description or epilog starting with spaces (an example,
    a continued line) is kept as written; other lines are wrapped to the terminal."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line if line.startswith(" ") or not line.strip()
                         else textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent)
                         for line in text.splitlines())


def epilog(command: str) -> str:
    """Examples, then where the command is described: below an argparse parser's options."""
    return "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[command]) + "\n\n" + REFERENCES[command]


TRAIN = """usage: optbench train [OVERRIDE ...] [-m] [--cfg job]

One measured training run of the config the overrides compose (conf/train.yaml): tokens/s with
its spread, MFU, peak memory and the losses, into a run directory (summary.json, metrics.jsonl,
train.log, TensorBoard events). With -m, a sweep: one run per combination, each recorded whatever
its outcome (an optimization this machine cannot run is recorded as incompatible), then the
sweep's report.md (optbench report).

options:
  OVERRIDE                 Hydra override: group=option (model=tiny, phase=4_dataloader, compile=default)
                           or key=value (train.steps=14, train.batch_size=8, hydra.run.dir=outputs/runs/NAME)
  -m, --multirun           a sweep: a,b lists and glob(*) expand to one job per combination
  --cfg job                print the composed config and exit (nothing is trained)
  --info                   where Hydra looked for the config, and what it found
  --hydra-help             Hydra's own help (its flags)
  -h, --help               this help

exit status: 0 completed (or stopped early), 1 failed/diverged/out of memory, 2 bad input or an
incompatible combination (one line), 124 time limit (run.time_limit_s; the same command resumes),
128+N a signal; a sweep: 0 when every job completed or was incompatible."""

ESTIMATE = """usage: optbench estimate [OVERRIDE ...] [-m]

Before launch: parameters, FLOPs per token, the peak memory per device of one training step (traced
under FakeTensorMode, beside a closed form), whether it fits the GPU, the largest micro-batch that
does, and the tokens/s the throughput model predicts. Nothing is trained; every train override works.

options:
  OVERRIDE                 any train override (model=9.9b, precision=bf16, parallel=fsdp2, train.batch_size=8)
  estimate.gpu=NAME        h100 | a100 | h200 | none: the card's memory and dense peak (default h100)
  estimate.device_gb=G     GiB of device memory, instead of the card's
  estimate.world_size=N    GPUs of the job (default parallel.nproc_per_node)
  estimate.headroom=F      fraction of the device kept free for the CUDA context and NCCL (default 0.1)
  estimate.search=BOOL     look for the largest micro-batch that fits (default true)
  estimate.predict=BOOL    the predicted step time: a roofline on the card, or with estimate.gpu=none the
                           per-op benchmark on this machine (default true)
  estimate.link_gbps=G     GB/s per rank the collectives run at (default: the card's NVLink)
  estimate.mfu=F           the utilisation of the plain throughput line, without a prediction (default 0.4)
  estimate.format=FMT      table | json | markdown (one row per job, for a sweep with -m)
  -m, --multirun           one estimate per combination (parallel=single,fsdp2 ...)
  -h, --help               this help"""

PLAN = """usage: optbench plan [OVERRIDE ...]

The fastest configurations that fit, before launch: for the model and device of the overrides, every
micro-batch x activation checkpointing x precision x FSDP2/DDP/single with the gradient accumulation
that keeps the global batch, the memory traced as optbench estimate traces it (the largest
micro-batch that fits, bisected) and the step time predicted (a roofline on the named card, or the
per-op benchmark on this machine with estimate.gpu=none), ranked by predicted tokens/s.

options:
  OVERRIDE                 any train override (model=1b, train.seq_len=2048, ...) and estimate's keys
  estimate.gpu=NAME        h100 | a100 | h200 | none (this machine)
  estimate.world_size=N    GPUs of the job
  estimate.global_batch=N  samples per optimizer step over all ranks (default: the config's own)
  estimate.top=N           how many of the ranked configurations to print (default 5)
  -h, --help               this help"""

HELP = {"train": TRAIN, "estimate": ESTIMATE, "plan": PLAN}


def config_groups() -> str:
    """Every config group with its presets (group=option), as Hydra's own help lists them but
    without the typed schemas, which are not choices."""
    from optbench.config import conf_dir

    root = conf_dir()
    lines = ["config groups (group=option):"]
    for group in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        lines.append(textwrap.fill(f"{group.name}: {', '.join(options)}", 100, initial_indent="  ",
                                   subsequent_indent="    "))
    return "\n".join(lines)


def hydra_help(command: str) -> str:
    """The whole help of a Hydra command."""
    return f"{HELP[command]}\n\n{config_groups()}\n\n{epilog(command)}"
