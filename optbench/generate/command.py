"""``optbench generate RUN``: the text a trained ``task=climate_text`` model writes for a climate.

    optbench generate outputs/run                      # 8 eval samples, greedy, their true climate
    optbench generate outputs/run --time 2000-11-03T06:00:00 --climate true,shuffled,base
    optbench generate outputs/run --samples 64 --climate all --score --out generated.jsonl
    optbench generate outputs/run/checkpoints/step-00000300 --temperature 0.8 --top-k 20 --prompt "Area"
    optbench generate outputs/multirun/*/*/ --samples 48 --score --quiet --out-name generated.jsonl

``RUN`` is a run directory (its newest checkpoint) or a checkpoint directory; several RUNs (a
sweep's runs) are generated for one after the other in one process, each with the same options
(``--out-name NAME``: each RUN's lines in RUN/NAME; a run that fails stops the command, the files
written before it are kept). The samples: ``--time``
(the sample whose text is of that time step: its last input step, or its target for forecast
captions), ``--sample N`` (eval sample N of the run's ``task.eval_samples``, in time order), or
``--samples K`` (K of them spread over the eval split; default 8). ``--climate``: ``true`` (the
sample's own; the control's all-zero climate for a ``task.text_only`` run), ``shuffled`` (another
eval sample's: the run's derangement), ``train`` (a random training sample's, seeded by ``--seed``:
the input distribution the model was trained on, at the wrong time), ``base`` (none: the decoder
alone), a comma list, or ``all`` (true, shuffled and base). Decoding: greedy (``--temperature 0``,
the default) or sampled (``--temperature T``, ``--top-k K``), at most ``--max-tokens`` new tokens after the ``--prompt`` prefix. Printed, and
with ``--out`` written as JSON lines, one per sample and climate: time, step, climate, prompt,
text, the true text (``reference``), the teacher-forced NLL of the true text and its token count,
and where the captions have a sidecar the numbers the text states (``numbers``) beside the
field's (``field``). ``--score``: the number score per quantity and climate (``score``), printed
and appended to ``--out`` as a last line ``{"kind": "score", ...}``.

This module parses the options and prints; the work is ``optbench.generate.api`` (torch is imported
only once a command runs, not for ``--help``).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from optbench.errors import ConfigError

DESCRIPTION = ("The text a trained task=climate_text model writes for a climate: for eval samples or the sample "
               "of a time, with their true climate, another sample's (shuffled) or none (base), greedy or sampled; "
               "with --score, the numbers the texts state scored against the field.")
CLIMATES = ("true", "shuffled", "train", "base")
ALL = ("true", "shuffled", "base")  # --climate all


def build_parser() -> argparse.ArgumentParser:
    from optbench.usage import HelpFormatter, epilog

    parser = argparse.ArgumentParser(prog="optbench generate", description=DESCRIPTION,
                                     formatter_class=HelpFormatter, epilog=epilog("generate"))
    parser.add_argument("run", nargs="+", metavar="RUN",
                        help="a run directory of optbench train, or one of its checkpoints; several: each in turn")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--time", help="the time step the text is of (ISO 8601, or the step index)")
    which.add_argument("--sample", type=int, help="eval sample N (of task.eval_samples, in time order)")
    which.add_argument("--samples", type=int, default=8, help="K eval samples spread over the eval split (default 8)")
    parser.add_argument("--climate", default="true",
                        help="true, shuffled, train, base, a comma list, or all: true,shuffled,base (default true)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--max-tokens", type=int, help="new tokens at most (default: up to the model's length)")
    parser.add_argument("--prompt", default="", help="the text's beginning, given (default none)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--batch-size", type=int, default=32, help="samples decoded together")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", help="write JSON lines here (one RUN)")
    where.add_argument("--out-name", metavar="NAME", help="write each RUN's JSON lines to RUN/NAME (a file name)")
    parser.add_argument("--score", action="store_true", help="score the numbers the texts state against the field")
    parser.add_argument("--show", type=int, default=4,
                        help="print the texts of the first N samples (default 4; 0: none, -1: all)")
    parser.add_argument("--quiet", action="store_true", help="print no texts (--show 0)")
    return parser


def check_options(args) -> None:
    """One line for an option no generation can use (before the model is loaded)."""
    if args.samples is not None and args.samples < 1:
        raise ConfigError(f"--samples {args.samples}: give at least 1 (eval samples spread over the split)")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: give a finite temperature >= 0 (0: greedy)")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: give at least 1, or leave it out (up to the model's length)")
    if args.top_k < 0 or args.batch_size < 1:
        raise ConfigError(f"--top-k {args.top_k} --batch-size {args.batch_size}: give --top-k >= 0 (0: all tokens) "
                          "and --batch-size >= 1")


def climates(value: str) -> list[str]:
    chosen = list(ALL) if value == "all" else [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in chosen if c not in CLIMATES]
    if bad or not chosen:
        raise ConfigError(f"--climate {value}: use true, shuffled, train, base, a comma list of them, or all "
                          "(true,shuffled,base)")
    return chosen


def _cell(entry: dict[str, Any]) -> str:
    if entry["mae"] is None:
        return f"never stated (of {entry['n']})"
    sign = f", sign {entry['sign_accuracy']:.0%}" if entry["sign_accuracy"] is not None else ""
    return f"{entry['mae']:.2f} ({entry['stated']:.0%} stated{sign})"


def format_score(result: dict[str, Any]) -> str:
    chosen = list(result)
    quantities = list(next(iter(result.values()))["numbers"])
    width = max(len(q) for q in [*quantities, "text loss"]) + 2
    lines = [f"number score over {result[chosen[0]]['samples']} samples: MAE in the quantity's unit (C, K, hPa, "
             "m/s, g/kg), the share of texts that state it, and for anomaly/trend the share with the right sign",
             " " * width + "".join(f"{c:<36}" for c in chosen)]
    for q in quantities:
        lines.append(f"{q:<{width}}" + "".join(f"{_cell(result[c]['numbers'][q]):<36}" for c in chosen))
    lines.append(f"{'text loss':<{width}}" + "".join(f"{result[c]['loss']:<36.4f}" for c in chosen))
    return "\n".join(lines)


def _first_labels(records: list[dict[str, Any]], count: int) -> set[str]:
    labels: list[str] = []
    for r in records:
        if r["sample"] not in labels:
            labels.append(r["sample"])
    return set(labels[:count])


def print_records(records: list[dict[str, Any]]) -> None:
    last = None
    for r in records:
        if (r["step"], r["sample"]) != last:
            last = (r["step"], r["sample"])
            print(f"{r['time']}  ({r['sample']})")
            if r["reference"] is not None:
                print(f"  {'field':<9} {r['reference']}")
        print(f"  {r['climate']:<9} {r['text']}")


def outputs(args) -> list:
    """Where each RUN's lines go (``None``: printed only), every one checked before a model is loaded:
    ``--out PATH`` (one RUN) or ``--out-name NAME`` (RUN/NAME for each)."""
    from pathlib import Path

    from optbench.generate.output import check_out

    runs = args.run
    where = [Path(r).resolve() for r in runs]  # outputs/run and outputs/run/ are one run
    repeated = [r for r, w in zip(runs, where, strict=True) if where.count(w) > 1]
    if repeated:
        raise ConfigError(f"{repeated[0]} is given twice: give each RUN once")
    if args.out and len(runs) > 1:
        raise ConfigError(f"--out {args.out} with {len(runs)} RUNs: give --out-name NAME (e.g. generated.jsonl), "
                          "written in each RUN's directory")
    if args.out_name is not None and (not args.out_name or Path(args.out_name).name != args.out_name):
        raise ConfigError(f"--out-name {args.out_name}: give a file name (e.g. generated.jsonl), written in each "
                          "RUN's directory; --out PATH for one RUN")
    if args.out_name:
        return [check_out(str(Path(run) / args.out_name)) for run in runs]
    return [check_out(args.out) if args.out else None for _ in runs]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    chosen = climates(args.climate)
    check_options(args)
    outs = outputs(args)
    for run, out in zip(args.run, outs, strict=True):
        if len(args.run) > 1:
            print(f"== {run}", flush=True)
        generate_run(run, out, args, chosen)


def generate_run(run: str, out, args, chosen: list[str]) -> None:
    """One RUN's texts: printed, scored with ``--score``, written to ``out`` (a checked path) if given."""
    from optbench.files import write_atomic
    from optbench.generate.api import add_numbers, eval_items, generate, score, time_item
    from optbench.generate.load import load_run

    loaded = load_run(run)
    task = loaded.task
    items = [time_item(task, args.time, seed=args.seed)] if args.time else eval_items(task, args)
    if args.time is None and args.sample is None and len(items) < args.samples:
        print(f"--samples {args.samples}: the run has {len(items)} eval samples (task.eval_samples="
              f"{task.task_cfg.eval_samples} spread over its eval split); used all {len(items)}")
    records = generate(loaded, items, args, chosen)
    facts = add_numbers(records, loaded=loaded, need=args.score)
    show = 0 if args.quiet else args.show
    if show:
        shown = records if show < 0 else [r for r in records if r["sample"] in _first_labels(records, show)]
        print(f"{loaded.checkpoint} (step {loaded.step}), {'greedy' if args.temperature == 0 else 'sampled'}"
              + ("" if len(shown) == len(records) else f", the first {show} samples (--show N for more)") + ":")
        print_records(shown)
    result = score(records, facts, chosen) if args.score else None
    if result is not None:
        print(format_score(result))
    if out is not None:
        lines = [*records, *([{"kind": "score", "score": result}] if result is not None else [])]
        write_atomic(out, "".join(json.dumps(r) + "\n" for r in lines))
        print(f"wrote {len(records)} texts to {out}", flush=True)


def export_main(argv: list[str]) -> None:
    """``optbench export RUN OUT`` (the work is ``optbench.generate.export``)."""
    from optbench.usage import HelpFormatter, epilog

    parser = argparse.ArgumentParser(
        prog="optbench export", formatter_class=HelpFormatter, epilog=epilog("export"),
        description="Write a trained task=lm model in Hugging Face's save_pretrained format, loadable with "
                    "AutoModelForCausalLM.from_pretrained(OUT): a model=hf run as its own architecture, optbench's "
                    "own decoder as transformers' ArceeForCausalLM, the run's tokenizer beside it.")
    parser.add_argument("run", metavar="RUN",
                        help="a run directory of optbench train (its newest checkpoint), or a checkpoint")
    parser.add_argument("out", metavar="OUT", help="a new or empty directory")
    args = parser.parse_args(argv)
    from optbench.generate.export import export_run

    written = export_run(args.run, args.out)
    tokenizer = f", tokenizer from {written['tokenizer']}" if written["tokenizer"] else ", no tokenizer (the run had none)"
    print(f"exported step {written['step']} of {written['checkpoint']} as {written['architecture']} to {args.out}"
          f"{tokenizer}; load it with AutoModelForCausalLM.from_pretrained")
