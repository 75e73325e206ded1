"""``optbench <command>``: dispatch only; the work lives in the modules each command names."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from optbench.errors import ConfigError

COMMANDS = {
    "train": "one measured training run, or a sweep with -m (Hydra overrides)",
    "data": "data tools: tokenize",
}


def conf_dir() -> Path:
    """conf/ beside the package in a source checkout; the packaged copy (optbench.conf) in a wheel."""
    source = Path(__file__).resolve().parent.parent / "conf"
    if (source / "train.yaml").is_file():
        return source
    from importlib.resources import files

    return Path(str(files("optbench.conf")))


def fail(message: str, *, code: int = 2) -> None:
    """One line on stderr and the exit status; the traceback only with HYDRA_FULL_ERROR=1."""
    print(f"optbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_train(argv: list[str]) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from optbench.sweep import format_recap, run_job, sweep_exit_code
    from optbench.train import train

    started = False
    outcomes: list = []  # one JobOutcome per job of a multirun (see optbench.sweep)

    @hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")
    def job(cfg) -> str:
        nonlocal started
        started = True
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            return run_job(cfg, outcomes)  # records every outcome; the sweep goes on
        result = train(cfg)
        if HydraConfig.get().mode == RunMode.RUN:
            from optbench.outputs import format_summary

            print(format_summary(result.summary, result.run_dir), flush=True)
        if HydraConfig.get().mode == RunMode.RUN and result.exit_code:
            if result.traceback and os.environ.get("HYDRA_FULL_ERROR") == "1":
                print(result.traceback, file=sys.stderr)
            message = result.error if result.status == "failed" else f"{result.status}: {result.error}"
            fail(message, code=result.exit_code)
        return result.status

    sys.argv = ["optbench train", *argv]
    interrupted = False
    try:
        job()
    except KeyboardInterrupt:  # Ctrl-C stops a sweep; the jobs that ran are still listed
        if not outcomes:
            raise
        interrupted = True
    except SystemExit as exc:
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


def run_data(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="optbench data", description="data tools")
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenize", help="byte-level tokenize a text file into a uint16 token file")
    tok.add_argument("text", help="input text file")
    tok.add_argument("out", help="output token file (a .json sidecar is written beside it)")
    args = parser.parse_args(argv)
    if args.command == "tokenize":
        from optbench.data.tokens import tokenize_bytes

        meta = tokenize_bytes(args.text, args.out)
        print(f"wrote {meta['num_tokens']:,} tokens (vocab {meta['vocab_size']}, {meta['dtype']}) to {args.out}")


def usage() -> str:
    lines = ["usage: optbench <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    handlers = {"train": run_train, "data": run_data}
    if command not in handlers:
        fail(f"unknown command '{command}'; choose one of: {', '.join(COMMANDS)}")
    try:
        handlers[command](rest)
    except ConfigError as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        fail(str(exc))


if __name__ == "__main__":
    main()
