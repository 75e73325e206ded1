"""``optbench <command>``: dispatch only; the work lives in the modules each command names."""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

from optbench.errors import ConfigError, Interrupted
from optbench.files import refuse_output

COMMANDS = {
    "train": "one measured training run, or a sweep with -m (Hydra overrides)",
    "estimate": "parameters, FLOPs/token, per-device peak memory and predicted step time of a config",
    "plan": "the fastest configurations that fit: micro-batch x activation checkpointing x precision x FSDP2/DDP (estimate's keys)",
    "data": "data tools: tokenizer (train a BPE), tokenize, synth (a climate NetCDF file), inspect (NetCDF files, Zarr stores), captions (paired text), embed (teacher embeddings)",
    "generate": "text from a trained task=climate_text model for a climate (true, shuffled, none); its numbers scored",
    "report": "review run/sweep outputs: speedups with confidence intervals, loss delta, memory, gates, plots",
    "compare": "A/B: run A -- B alternately with the same seed and data, then report",
    "validate": "the plan's phase 9: baseline vs the furthest phase that runs here, with the plan's gates",
}


# how a run may end on purpose before train.steps: printed as what they are (the exit status stays:
# 0 for an early stop, 124 for the time budget), never as "error:"
OUTCOMES = ("stopped_early", "time_limit")


def fail(message: str, *, code: int = 2) -> None:
    """One line on stderr and the exit status; the traceback only with HYDRA_FULL_ERROR=1."""
    print(f"optbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


# Hydra's mode flags: only one may be given (Hydra itself would say so with a traceback)
_MODE_FLAGS = {"-m": "-m", "--multirun": "-m", "-c": "--cfg", "--cfg": "--cfg", "-i": "--info", "--info": "--info",
               "-r": "--run", "--run": "--run", "-sc": "--shell-completion", "--shell-completion": "--shell-completion"}


def check_hydra_flags(argv: list[str]) -> None:
    modes = sorted({_MODE_FLAGS[a.split("=")[0]] for a in argv if a.split("=")[0] in _MODE_FLAGS})
    if len(modes) > 1:
        raise ConfigError(
            f"{' and '.join(modes)} cannot be combined: give one (e.g. `optbench train --cfg job ARGS` prints "
            "the config of one run; `optbench train -m ARGS` runs the sweep)"
        )


def prepare_output_dir(argv: list[str]) -> tuple[Path, Path] | None:
    """Create the run (or sweep) directory an override names, as Hydra is about to, so that an
    unusable path (read-only, a file in the way, too long) is one line here, not Hydra's traceback.
    An override Hydra cannot parse is left to Hydra to report (nothing created). Returns the
    directory and the topmost one created, which ``remove_created`` takes away again when Hydra
    refuses the command before the run starts."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from optbench.files import os_error_message

    key = "hydra.sweep.dir=" if any(_MODE_FLAGS.get(a) == "-m" for a in argv) else "hydra.run.dir="
    given = [a for a in argv if a.removeprefix("+").startswith(key)]
    if not given:
        return None
    try:
        value = OverridesParser.create().parse_overrides([given[-1]])[0].value()
    except Exception:  # noqa: BLE001 - Hydra's own message says what is wrong with it
        return None
    if not isinstance(value, str) or "${" in value:
        return None
    path = Path(value)
    top = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(os_error_message(exc, f"create the directory {key.rstrip('=')} names")) from None
    return (path, top) if top is not None else None


def remove_created(created: tuple[Path, Path] | None) -> None:
    """Remove the directories ``prepare_output_dir`` created, from the deepest up, where still empty."""
    if created is None:
        return
    path, top = created
    for directory in [path, *path.parents]:
        try:
            directory.rmdir()
        except OSError:
            return
        if directory == top:
            return


def _single_run(result, *, printed: bool) -> str:
    """A run outside a sweep (or a job of ``--cfg`` style modes): its summary, then its exit status
    as one line."""
    if printed:
        from optbench.outputs import format_summary

        print(format_summary(result.summary, result.run_dir), flush=True)
    if printed and result.status in OUTCOMES:  # stopped on purpose: an outcome, not an error
        print(f"optbench: {result.status}: {result.error}", file=sys.stderr)
        if result.exit_code:
            raise SystemExit(result.exit_code)
    elif printed and result.exit_code:
        if result.traceback and os.environ.get("HYDRA_FULL_ERROR") == "1":
            print(result.traceback, file=sys.stderr)
        message = result.error if result.status == "failed" else f"{result.status}: {result.error}"
        fail(message, code=result.exit_code)
    if result.status == "interrupted":  # in a sweep, SIGTERM/SIGINT stops the sweep, not one job
        fail(f"{result.status}: {result.error}", code=result.exit_code)
    _honour_startup_signal(what=f"the run had ended {result.status} and its results are in {result.run_dir}")
    return result.status


def _honour_startup_signal(*, what: str = "nothing was trained") -> None:
    """A phase boundary of ``optbench train``: a SIGTERM received so far ends it in one line."""
    from optbench.run.preemption import startup_interruption

    stopped = startup_interruption()
    if stopped is not None:
        fail(f"interrupted: {stopped}; {what}", code=128 + stopped.signum)


def run_train(argv: list[str]) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from optbench.config import conf_dir
    from optbench.config.renames import upgrade_and_warn
    from optbench.run.preemption import startup_interruption
    from optbench.run.sweep import format_recap, run_job, sweep_exit_code
    from optbench.run.train import train

    _honour_startup_signal()  # received while importing (torch, Hydra)
    argv = upgrade_and_warn(argv)  # an old override name runs under its new one, saying so
    if "-h" in argv or "--help" in argv:  # Hydra's would print the whole composed config
        from optbench.usage import hydra_help

        print(hydra_help("train"))
        raise SystemExit(0)
    check_hydra_flags(argv)
    created = prepare_output_dir(argv)

    started = False
    outcomes: list = []  # one JobOutcome per job of a multirun (see optbench.run.sweep)

    @hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")
    def job(cfg) -> str:
        nonlocal started
        started = True
        _honour_startup_signal()  # received while Hydra composed the config (it would swallow an exception)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            return run_job(cfg, outcomes)  # records every outcome; the sweep goes on
        return _single_run(train(cfg), printed=HydraConfig.get().mode == RunMode.RUN)

    sys.argv = ["optbench train", *argv]
    interrupted = False
    try:
        job()
    except KeyboardInterrupt:  # Ctrl-C stops a sweep; the jobs that ran are still listed
        if not outcomes:
            raise
        interrupted = True
    except SystemExit as exc:
        if not started:  # Hydra refused the command (or a signal stopped it): nothing is left behind
            remove_created(created)
        stopped = startup_interruption()
        if stopped is not None and exc.code not in (0, 128 + stopped.signum):  # Hydra caught it: say what it was
            if outcomes:
                print(format_recap(outcomes), flush=True)
            fail(f"interrupted: {stopped}", code=128 + stopped.signum)
        # Hydra exits 1 for a config it could not compose (unknown key or group, wrong type), also
        # for a later job of a sweep (a multirun job never exits by itself): that is bad input
        # too, so it gets status 2; Hydra's own message stays as it printed it.
        if exc.code == 1 and (not started or outcomes):
            if outcomes:
                print(format_recap(outcomes), flush=True)
            raise SystemExit(2) from None
        raise
    if outcomes:
        print(format_recap(outcomes), flush=True)
        raise SystemExit(130 if interrupted else sweep_exit_code(outcomes))


def run_estimate(argv: list[str], *, command: str = "estimate") -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from optbench.config import conf_dir
    from optbench.config.renames import upgrade_and_warn
    from optbench.estimate.command import run as run_one

    def run(cfg, *, header: bool) -> str:
        if command == "plan":
            from optbench.estimate.plan import run as run_plan

            return run_plan(cfg)
        return run_one(cfg, header=header)

    if "-h" in argv or "--help" in argv:  # Hydra's would print the whole composed train config
        from optbench.usage import hydra_help

        print(hydra_help(command))
        raise SystemExit(0)
    started = False

    @hydra.main(config_path=str(conf_dir()), config_name="estimate", version_base="1.3")
    def job(cfg) -> None:
        nonlocal started
        started = True
        hydra_cfg = HydraConfig.get()
        try:
            text = run(cfg, header=hydra_cfg.mode == RunMode.RUN or hydra_cfg.job.num == 0)
        except ConfigError as exc:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            fail(str(exc))
        print(text, flush=True)

    sys.argv = [f"optbench {command}", *upgrade_and_warn(argv)]
    try:
        job()
    except SystemExit as exc:
        if not started and exc.code == 1:  # Hydra could not compose the config: bad input
            raise SystemExit(2) from None
        raise


def _add_token_commands(sub) -> None:
    """`optbench data tokenizer` and `optbench data tokenize`."""
    bpe = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a UTF-8 corpus (tokenizer.json)")
    bpe.add_argument("corpus", help="UTF-8 text file")
    bpe.add_argument("out", help="output tokenizer file, e.g. tok.json")
    bpe.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, the 256 bytes and <|endoftext|> included")
    bpe.add_argument("--min-frequency", type=int, default=2, help="fewest occurrences of a pair to merge (default 2)")
    tok = sub.add_parser("tokenize", help="tokenize a text file into a token file for data=tokens")
    tok.add_argument("text", help="input text file (UTF-8 with --tokenizer)")
    tok.add_argument("out", help="output token file (a .json sidecar is written beside it)")
    tok.add_argument("--tokenizer", help="a tokenizer.json or a model directory holding one (default: one token per byte)")
    tok.add_argument("--eos", help="the end-of-text token packed after each document (default: the tokenizer's own)")
    for parser_ in (bpe, tok):
        parser_.add_argument("--documents", choices=("paragraphs", "lines"), default="paragraphs",
                             help="documents are blocks between blank lines (default) or single lines")


def _add_climate_commands(sub: argparse._SubParsersAction) -> None:
    """`optbench data synth`, `optbench data inspect` and `optbench data captions`."""
    syn = sub.add_parser("synth", help="write a small, physically plausible CF climate dataset (NetCDF4)")
    syn.add_argument("out", help="output file, e.g. data.nc")
    syn.add_argument("--days", type=float, default=60, help="length in days (default 60)")
    syn.add_argument("--step-hours", type=float, default=6, help="time step in hours (default 6)")
    syn.add_argument("--nlat", type=int, default=32, help="latitudes (default 32)")
    syn.add_argument("--nlon", type=int, default=64, help="longitudes (default 64)")
    syn.add_argument("--levels", type=float, nargs="+", default=[1000, 850, 500, 250],
                     help="pressure levels in hPa (default 1000 850 500 250)")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--time-chunk", type=int, default=8, help="HDF5 chunk length along time (default 8)")
    syn.add_argument("--no-compress", action="store_true", help="store without gzip compression")
    ins = sub.add_parser("inspect", help="dims, variables, units, roles, chunking; can optbench use it?")
    ins.add_argument("files", nargs="+", help="NetCDF4/NetCDF3 files, Zarr stores or globs (joined along time)")
    ins.add_argument("--variables", nargs="+", help="variables (names or roles) to check, as data.variables")
    ins.add_argument("--history", type=int, default=2, help="as data.history (default 2)")
    cap = sub.add_parser("captions", help="describe every time step of NetCDF files in text (JSON lines for data.text)")
    cap.add_argument("files", nargs="+", help="NetCDF files or globs, then the output file (e.g. captions.jsonl)")
    cap.add_argument("--variables", nargs="+", help="variables (names or roles) to describe, as data.variables")
    cap.add_argument("--mode", choices=("describe", "forecast"), default="describe",
                     help="caption the last input step a sample shows (default) or its target step")
    cap.add_argument("--history", type=int, default=2, help="as data.history: the input steps of a sample (default 2)")
    cap.add_argument("--eval-fraction", type=float, default=0.1,
                     help="as data.eval_fraction: anomalies use the climatology of the steps before it (default 0.1)")
    cap.add_argument("--lines", help="also write the training steps' texts alone, one per line (for `optbench data tokenize`)")


def _add_embed_command(sub: argparse._SubParsersAction) -> None:
    """`optbench data embed` (task=energy_flow's teacher embeddings)."""
    emb = sub.add_parser("embed", help="teacher embeddings of text pairs with a local encoder (data=embeddings)")
    emb.add_argument("pairs", help="JSON lines, one {\"input\": ..., \"target\": ...} pair per line")
    emb.add_argument("out", help="output file: float32 (pairs, 2, width), memory-mapped in training (+ OUT.json)")
    emb.add_argument("--encoder", required=True, help="a local Hugging Face encoder directory (save_pretrained's)")


def data_parser() -> argparse.ArgumentParser:
    from optbench.usage import HelpFormatter, epilog

    parser = argparse.ArgumentParser(
        prog="optbench data", formatter_class=HelpFormatter, epilog=epilog("data"),
        description="Data tools: write a synthetic climate NetCDF file, check whether NetCDF/Zarr files can be "
                    "trained on, train a BPE tokenizer, tokenize text, caption climate fields. "
                    "`optbench data TOOL --help` for a tool's options.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_token_commands(sub)
    _add_climate_commands(sub)
    _add_embed_command(sub)
    return parser


def run_data(argv: list[str]) -> None:
    args = data_parser().parse_args(argv)
    handlers = {"captions": _captions, "tokenizer": _tokenizer, "tokenize": _tokenize, "synth": _synth,
                "inspect": _inspect, "embed": _embed}
    handlers[args.command](args)


def _captions(args: argparse.Namespace) -> None:
    from optbench.data.captions import write_captions

    if len(args.files) < 2:
        fail("optbench data captions needs NetCDF files and an output file: optbench data captions data.nc captions.jsonl")
    *inputs, out = args.files
    sources = _expanded(inputs)
    refuse_output(Path(out), inputs=sources, writes="the captions (JSON lines)")
    if args.lines:
        refuse_output(Path(args.lines), inputs=[*sources, Path(out)], writes="the captions' texts (one per line)")
    meta = write_captions(inputs, out, variables=args.variables, history=args.history, mode=args.mode,
                          eval_fraction=args.eval_fraction, lines=args.lines)
    lines = f"; {meta['train_texts']} training texts to {args.lines}" if args.lines else ""
    print(f"wrote {meta['captions']} captions of {', '.join(meta['variables'])} ({args.mode}; "
          f"{meta['mean_bytes']:.0f} bytes on average, at most {meta['max_bytes']}) to {out}{lines}")


def _expanded(patterns: list[str]) -> list[Path]:
    """The files the paths and globs name (as the data loader expands them)."""
    found = [Path(p) for pattern in patterns for p in sorted(glob.glob(pattern))]
    return found + [Path(p) for p in patterns if not glob.has_magic(p)]


def _tokenizer(args: argparse.Namespace) -> None:
    from optbench.data.tokenizer import train_bpe

    refuse_output(Path(args.out), inputs=[], writes="a tokenizer (JSON)")  # an input: the writer's own line
    meta = train_bpe(args.corpus, args.out, vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                     documents=args.documents)
    short = f" (asked {meta['asked']:,}: the corpus has no more pairs seen --min-frequency times)" \
        if meta["vocab_size"] < meta["asked"] else ""
    print(f"wrote a byte-level BPE of {meta['vocab_size']:,} tokens{short}, end of text "
          f"{meta['eos_token']} = {meta['eos_id']}, to {args.out}")


def _synth(args: argparse.Namespace) -> None:
    from optbench.data.netcdf.synth import write_synthetic

    refuse_output(Path(args.out), inputs=[], writes="a NetCDF4 file", kind="a NetCDF4/HDF5 file")
    meta = write_synthetic(args.out, days=args.days, step_hours=args.step_hours, nlat=args.nlat, nlon=args.nlon,
                           levels=tuple(args.levels), seed=args.seed, time_chunk=args.time_chunk,
                           compress=not args.no_compress)
    print(f"wrote {meta['steps']} steps x {meta['channels']} channels on a {meta['grid'][0]}x{meta['grid'][1]} "
          f"grid ({meta['bytes'] / 1e6:.1f} MB) to {args.out}")


def _inspect(args: argparse.Namespace) -> None:
    from optbench.data.inspect import inspect_files
    from optbench.tasks.climate import describe_training_data

    usable, report = inspect_files(args.files, check=describe_training_data, variables=args.variables,
                                   history=args.history)
    print(report)
    if not usable:
        fail(f"optbench cannot use {' '.join(args.files)} as they are (see 'usable by optbench' above)")


def _tokenize(args: argparse.Namespace) -> None:
    from optbench.data.pack import tokenize_bytes, tokenize_file

    refuse_output(Path(args.out), inputs=[], writes="a token file")  # an input: pack's own line (sidecar too)
    if args.tokenizer is None:
        if args.eos is not None:
            fail("--eos needs --tokenizer (byte-level tokenization packs no documents)")
        meta = tokenize_bytes(args.text, args.out)
        print(f"wrote {meta['num_tokens']:,} tokens (vocab {meta['vocab_size']}, {meta['dtype']}) to {args.out}")
        return
    meta = tokenize_file(args.text, args.out, tokenizer=args.tokenizer, documents=args.documents, eos=args.eos)
    print(f"wrote {meta['num_tokens']:,} tokens of {meta['documents']:,} documents ({meta['text_bytes'] / meta['num_tokens']:.2f} "
          f"bytes/token; vocab {meta['vocab_size']:,}, {meta['dtype']}, end of text {meta['eos_token']} = "
          f"{meta['eos_id']}) to {args.out}")


def _embed(args: argparse.Namespace) -> None:
    from optbench.data.embeddings import sidecar_path, write_embeddings

    out = Path(args.out)
    for written in (out, sidecar_path(out)):  # nothing already there is written over
        if written.exists() or written.is_symlink():
            fail(f"{written} exists: optbench data embed writes nothing over a file; give another output or remove it")
    meta = write_embeddings(args.pairs, out, encoder=args.encoder)
    print(f"wrote {meta['count']:,} pairs of {meta['width']}-wide embeddings to {out} (+ {sidecar_path(out).name}); "
          f"train on them: optbench train task=energy_flow data=embeddings data.path={out} model.embed_dim={meta['width']}")


def run_generate(argv: list[str]) -> None:
    from optbench.generate.command import main as generate_main

    generate_main(argv)


def run_report(argv: list[str]) -> None:
    from optbench.report.command import main as report_main

    report_main(argv)


def run_compare(argv: list[str]) -> None:
    from optbench.report.compare import main as compare_main

    compare_main(argv)


def run_validate(argv: list[str]) -> None:
    from optbench.validate.command import main as validate_main

    validate_main(argv)


def usage() -> str:
    lines = ["usage: optbench <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`optbench COMMAND --help`: what it does, its options and examples"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    handlers = {
        "train": run_train, "estimate": run_estimate, "plan": lambda rest: run_estimate(rest, command="plan"),
        "data": run_data, "generate": run_generate, "report": run_report,
        "compare": run_compare, "validate": run_validate,
    }
    if command not in handlers:
        fail(f"unknown command '{command}'; choose one of: {', '.join(COMMANDS)}")
    previous = None
    if command == "train":  # first: SIGTERM while importing torch or composing is recorded, then honoured
        import signal

        from optbench.run.preemption import install_startup_handler

        previous = signal.getsignal(signal.SIGTERM)
        install_startup_handler()
    try:
        handlers[command](rest)
    except ConfigError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(str(exc))
    except Interrupted as exc:  # SIGTERM before a run directory existed (imports, composing)
        fail(f"interrupted: {exc}; nothing was trained", code=128 + exc.signum)
    except OSError as exc:  # a file that cannot be read or written: its name, the reason, the fix
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        from optbench.files import os_error_message

        fail(os_error_message(exc))
    finally:
        if previous is not None:  # a caller in this process (a test, a script) gets its own handler back
            import signal

            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
