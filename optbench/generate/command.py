"""``optbench generate RUN``: the text a trained ``task=climate_text`` model writes for a climate.

    optbench generate outputs/run                      # 8 eval samples, greedy, their true climate
    optbench generate outputs/run --time 2000-11-03T06:00:00 --climate true,shuffled,base
    optbench generate outputs/run --samples 64 --climate all --score --out generated.jsonl
    optbench generate outputs/run/checkpoints/step-00000300 --temperature 0.8 --top-k 20 --prompt "Area"

``RUN`` is a run directory (its newest checkpoint) or a checkpoint directory. The samples: ``--time``
(the sample whose text is of that time step: its last input step, or its target for forecast
captions), ``--sample N`` (eval sample N of the run's ``task.eval_samples``, in time order), or
``--samples K`` (K of them spread over the eval split; default 8). ``--climate``: ``true`` (the
sample's own; the control's all-zero climate for a ``task.text_only`` run), ``shuffled`` (another
eval sample's: the run's derangement), ``base`` (none: the decoder alone), a comma list, or
``all``. Decoding: greedy (``--temperature 0``, the default) or sampled (``--temperature T``,
``--top-k K``), at most ``--max-tokens`` new tokens after the ``--prompt`` prefix. Printed, and
with ``--out`` written as JSON lines, one per sample and climate: time, step, climate, prompt,
text, the true text (``reference``), the teacher-forced NLL of the true text and its token count,
and where the captions have a sidecar the numbers the text states (``numbers``) beside the
field's (``field``). ``--score``: the number score per quantity and climate (``score``), printed
and appended to ``--out`` as a last line ``{"kind": "score", ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from optbench.errors import ConfigError
from optbench.generate.load import load_run

CLIMATES = ("true", "shuffled", "base")


def build_parser() -> argparse.ArgumentParser:
    from optbench.usage import HelpFormatter, epilog

    parser = argparse.ArgumentParser(prog="optbench generate", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter, epilog=epilog("generate"))
    parser.add_argument("run", help="a run directory of optbench train, or one of its checkpoints")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--time", help="the time step the text is of (ISO 8601, or the step index)")
    which.add_argument("--sample", type=int, help="eval sample N (of task.eval_samples, in time order)")
    which.add_argument("--samples", type=int, default=8, help="K eval samples spread over the eval split (default 8)")
    parser.add_argument("--climate", default="true", help="true, shuffled, base, a comma list, or all (default true)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--max-tokens", type=int, help="new tokens at most (default: up to the model's length)")
    parser.add_argument("--prompt", default="", help="the text's beginning, given (default none)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--batch-size", type=int, default=32, help="samples decoded together")
    parser.add_argument("--out", help="write JSON lines here")
    parser.add_argument("--score", action="store_true", help="score the numbers the texts state against the field")
    parser.add_argument("--quiet", action="store_true", help="print only the score")
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
    chosen = list(CLIMATES) if value == "all" else [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in chosen if c not in CLIMATES]
    if bad or not chosen:
        raise ConfigError(f"--climate {value}: use true, shuffled, base, a comma list of them, or all")
    return chosen


# ------------------------------------------------------------------------------------- samples
def _eval_items(task, args) -> list[dict[str, Any]]:
    from optbench.tasks.text_scores import strided

    _, evaluation = task.build_datasets()
    if args.sample is not None:
        if not 0 <= args.sample < len(evaluation):
            raise ConfigError(f"--sample {args.sample}: the run has eval samples 0 .. {len(evaluation) - 1}")
        chosen = [args.sample]
    else:
        chosen = strided(len(evaluation), args.samples).tolist()
    return [{**item, "label": f"eval sample {i}"} for i, item in zip(chosen, evaluation.__getitems__(chosen),
                                                                       strict=True)]


def _time_item(task, when: str, *, seed: int) -> dict[str, Any]:
    """The sample whose text is of time ``when`` (any sample of the data), with the climate of a
    random eval sample as its shuffled one."""
    from optbench.data.captions import time_label
    from optbench.data.netcdf import ClimateWindows, Split
    from optbench.data.paired import _normalize_time

    layout, data = task.data.layout, task.data
    index = {time_label(t): i for i, t in enumerate(layout.times)}
    try:
        step = index.get(_normalize_time(int(when) if when.isdigit() else when))
    except ValueError:
        step = None
    window = int(data.eval.offsets[-1]) + 1
    sample = None if step is None else step - task.text_offset
    if sample is None or not 0 <= sample <= layout.num_steps - window:
        raise ConfigError(f"--time {when} is not the time of a sample's text in {', '.join(map(str, task.cfg.data.paths))} "
                          f"(from {time_label(layout.times[task.text_offset])} to "
                          f"{time_label(layout.times[layout.num_steps - window + task.text_offset])})")
    windows = ClimateWindows(data.eval.source, stats=data.stats, split=Split(0, layout.num_steps - window + 1),
                             history=task.history, offsets=data.eval.offsets)
    item = windows[sample]
    _, evaluation = task.build_datasets()
    others = [i for i in range(len(evaluation)) if int(evaluation.positions[i]) + data.eval.split.first != sample]
    other = evaluation[int(np.random.default_rng(seed).choice(others))]
    texts = task.table.lookup(torch.tensor([step]))
    return {**item, "tokens": texts["tokens"][0], "length": texts["length"][0], "frames_shuffled": other["frames"],
            "eval_index": torch.tensor(-1), "label": "at --time"}


# --------------------------------------------------------------------------------------- run
def _forward(task, model, batch, climate: str):
    if climate == "base":
        return lambda tokens: model(tokens)
    context = task.context(batch) if climate == "true" else task.shuffled_context(batch)
    return lambda tokens: model(tokens, context=context)


def _max_new(task, args, prompt_len: int) -> int:
    room = task.cfg.train.seq_len - prompt_len + 1
    if room < 1 or (args.max_tokens is not None and args.max_tokens > room):
        raise ConfigError(f"--max-tokens {args.max_tokens} after a prompt of {prompt_len} tokens exceeds the "
                          f"model's train.seq_len={task.cfg.train.seq_len}: at most {max(room, 0)} new tokens")
    return args.max_tokens if args.max_tokens is not None else room


def generate(loaded, items: list[dict[str, Any]], args, chosen: list[str]) -> list[dict[str, Any]]:
    """One record per item and climate (in item order, climates inner)."""
    from optbench.data.captions import time_label
    from optbench.generate.decode import decode, prompt_ids, text_of
    from optbench.generate.score import sample_nll

    task, model, codec = loaded.task, loaded.model, loaded.task.codec
    prompt = prompt_ids(codec, args.prompt)
    max_new = _max_new(task, args, len(prompt))
    generator = torch.Generator().manual_seed(args.seed)
    records = []
    for lo in range(0, len(items), args.batch_size):
        part = items[lo: lo + args.batch_size]
        batch = default_collate([{k: v for k, v in item.items() if k != "label"} for item in part])
        start = torch.tensor([prompt] * len(part))
        per = {}
        for climate in chosen:
            ids = decode(_forward(task, model, batch, climate), start, max_new=max_new, end=codec.end,
                         temperature=args.temperature, top_k=args.top_k, generator=generator)
            per[climate] = (ids, *sample_nll(task, model, batch, climate=climate))
        for row, item in enumerate(part):
            step = int(item["sample"]) + task.text_offset
            for climate in chosen:
                ids, nll, count = per[climate]
                records.append({"kind": "sample", "time": time_label(task.data.layout.times[step]), "step": step,
                                "sample": item["label"], "climate": climate, "prompt": args.prompt,
                                "text": args.prompt + text_of(codec, ids[row]), "reference": task.pairs.get(step),
                                "nll": float(nll[row]), "tokens": float(count[row])})
    return records


def add_numbers(records: list[dict[str, Any]], *, loaded, need: bool) -> list[dict[str, Any]] | None:
    """Each record's stated numbers beside the field's (where the captions have a sidecar); the
    facts per record (None without a sidecar: refused when ``need``)."""
    from optbench.generate.score import FieldFacts, stated

    task = loaded.task
    if task.spec is None:
        if need:
            raise ConfigError(f"--score: data.text={task.cfg.data.text} has no sidecar (.json beside it): the number "
                              "score needs captions written by `optbench data captions`, whose facts it recomputes")
        return None
    field = FieldFacts(list(task.cfg.data.paths), spec=task.spec)
    try:
        cache: dict[int, dict] = {}
        for step in sorted({r["step"] for r in records}):
            cache[step] = field.facts(step)
        facts = [cache[r["step"]] for r in records]
    finally:
        field.close()
    for record, fact in zip(records, facts, strict=True):
        record["numbers"] = stated(fact, record["text"])
        record["field"] = {key: f.value for key, f in fact.items()}
    return facts


def score(records: list[dict[str, Any]], facts: list[dict], chosen: list[str]) -> dict[str, Any]:
    """Per climate: the number score and the text loss (per token) of the true texts."""
    from optbench.generate.score import number_score

    out = {}
    for climate in chosen:
        pick = [i for i, r in enumerate(records) if r["climate"] == climate]
        tokens = sum(records[i]["tokens"] for i in pick)
        out[climate] = {"numbers": number_score([records[i] for i in pick], [facts[i] for i in pick]),
                        "loss": sum(records[i]["nll"] for i in pick) / max(tokens, 1.0), "samples": len(pick)}
    return out


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


def print_records(records: list[dict[str, Any]]) -> None:
    last = None
    for r in records:
        if (r["step"], r["sample"]) != last:
            last = (r["step"], r["sample"])
            print(f"{r['time']}  ({r['sample']})")
            if r["reference"] is not None:
                print(f"  {'field':<9} {r['reference']}")
        print(f"  {r['climate']:<9} {r['text']}")


def main(argv: list[str] | None = None) -> None:
    from optbench.files import write_atomic
    from optbench.generate.output import check_out

    args = build_parser().parse_args(argv)
    chosen = climates(args.climate)
    check_options(args)
    out = check_out(args.out) if args.out else None
    loaded = load_run(args.run)
    task = loaded.task
    items = [_time_item(task, args.time, seed=args.seed)] if args.time else _eval_items(task, args)
    records = generate(loaded, items, args, chosen)
    facts = add_numbers(records, loaded=loaded, need=args.score)
    if not args.quiet:
        print(f"{loaded.checkpoint} (step {loaded.step}), {'greedy' if args.temperature == 0 else 'sampled'}:")
        print_records(records)
    result = score(records, facts, chosen) if args.score else None
    if result is not None:
        print(format_score(result))
    if out is not None:
        lines = [*records, *([{"kind": "score", "score": result}] if result is not None else [])]
        write_atomic(out, "".join(json.dumps(r) + "\n" for r in lines))
        print(f"wrote {len(records)} texts to {args.out}")
