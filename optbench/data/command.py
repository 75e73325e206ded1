"""``optbench data TOOL``: write a synthetic climate NetCDF file (``synth``), check whether NetCDF/Zarr
files can be trained on (``inspect``), train a BPE tokenizer (``tokenizer``), tokenize text
(``tokenize``), caption climate fields (``captions``), compute teacher embeddings of text pairs
(``embed``, task=energy_flow's data). Each tool's options and what it prints; the
work is in the modules each names, imported when the tool runs."""

from __future__ import annotations

import argparse
import glob
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optbench.errors import ConfigError, Interrupted
from optbench.exits import fail, signal_exit
from optbench.files import refuse_output


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
    syn.add_argument("--seed", type=int, default=0, help="seed of the fields' noise; the same seed writes the same fields (default 0)")
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
                    "trained on, train a BPE tokenizer, tokenize text, caption climate fields, embed text pairs "
                    "with a local encoder (task=energy_flow). "
                    "`optbench data TOOL --help` for a tool's options.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_token_commands(sub)
    _add_climate_commands(sub)
    _add_embed_command(sub)
    return parser


def main(argv: list[str], *, check: Callable[..., Any]) -> None:
    """``optbench data TOOL ...``; ``check`` is what ``inspect`` asks of the files besides reading
    them (the CLI hands in the climate task's training check)."""
    args = data_parser().parse_args(argv)
    if args.command == "inspect":
        _inspect(args, check=check)
        return
    handlers = {"captions": _captions, "tokenizer": _tokenizer, "tokenize": _tokenize, "synth": _synth,
                "embed": _embed}
    handlers[args.command](args)


def _captions(args: argparse.Namespace) -> None:
    from optbench.data.captions import write_captions

    if len(args.files) < 2:
        fail("optbench data captions needs NetCDF files and an output file: optbench data captions data.nc captions.jsonl")
    *inputs, out = args.files
    sources = _expanded(inputs)
    refuse_output(Path(out), inputs=sources, writes="the captions (JSON lines)")
    if args.lines:
        lines = Path(args.lines)
        if lines.resolve() == Path(out).resolve() or (lines.exists() and Path(out).exists() and lines.samefile(out)):
            raise ConfigError(f"--lines {args.lines} is the captions' own output file {out}: one would overwrite the "
                              "other; give --lines a file of its own (e.g. captions.txt)")
        refuse_output(lines, inputs=sources, writes="the captions' texts (one per line)")
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


def _inspect(args: argparse.Namespace, *, check: Callable[..., Any]) -> None:
    from optbench.data.inspect import inspect_files

    usable, report = inspect_files(args.files, check=check, variables=args.variables,
                                   history=args.history)
    print(report)
    if not usable:
        fail(f"optbench cannot use {' '.join(args.files)} as they are (see 'usable by optbench' above)")


def _tokenize(args: argparse.Namespace) -> None:
    from optbench.data.pack import tokenize_bytes, tokenize_file

    refuse_output(Path(args.out), inputs=[], writes="a token file")  # an input: pack's own line (sidecar too)
    if args.tokenizer is None and args.eos is not None:
        fail("--eos needs --tokenizer (byte-level tokenization packs no documents)")
    try:
        if args.tokenizer is None:
            meta = tokenize_bytes(args.text, args.out)
            print(f"wrote {meta['num_tokens']:,} tokens (vocab {meta['vocab_size']}, {meta['dtype']}) to {args.out}")
            return
        meta = tokenize_file(args.text, args.out, tokenizer=args.tokenizer, documents=args.documents, eos=args.eos)
    except Interrupted as exc:  # SIGTERM: the temporary file is gone, an earlier output kept
        fail(f"interrupted: {exc}; {args.out} was not written (nothing partial left)", code=signal_exit(exc.signum))
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
          f"train on them: optbench train task=energy_flow model=energy_cpu data=embeddings data.path={out} "
          f"model.embed_dim={meta['width']}")
