"""``optbench <command>``: dispatch only. Each command is its subsystem's ``command`` module
(``optbench.run.command`` for train, ``optbench.estimate.command`` for estimate and plan, ...),
imported when the command runs; what is left here is the command list, the usage line, and the
errors every command prints as one line (``optbench.exits``)."""

from __future__ import annotations

import os
import sys

from optbench.errors import ConfigError, Interrupted
from optbench.exits import BAD_INPUT, OK, fail, signal_exit

COMMANDS = {
    "train": "one measured training run, or a sweep with -m (Hydra overrides)",
    "estimate": "parameters, FLOPs/token, per-device peak memory and predicted step time of a config",
    "plan": "the fastest configurations that fit: micro-batch x activation checkpointing x precision x FSDP2/DDP (estimate's keys)",
    "data": "data tools: tokenizer (train a BPE), tokenize, synth (a climate NetCDF file), inspect (NetCDF files, Zarr stores), captions (paired text), embed (teacher embeddings)",
    "generate": "text from a trained task=climate_text model for a climate (true, shuffled, none); its numbers scored",
    "export": "a trained task=lm run in Hugging Face's save_pretrained format (AutoModelForCausalLM), tokenizer beside it",
    "report": "review run/sweep outputs: speedups with confidence intervals, loss delta, memory, gates, plots",
    "compare": "A/B: run A -- B alternately with the same seed and data, then report",
    "validate": "the plan's phase 9: baseline vs the furthest phase that runs here, with the plan's gates",
    "cache": "what optbench measured once and reuses (CPU peak, gloo link, NetCDF statistics): list, clear",
}


def run_train(argv: list[str]) -> None:
    from optbench.run.command import main as train_main

    train_main(argv)


def run_estimate(argv: list[str], *, command: str = "estimate") -> None:
    from optbench.estimate.command import main as estimate_main

    estimate_main(argv, command=command)


def run_data(argv: list[str]) -> None:
    from optbench.data.command import main as data_main

    data_main(argv, check=_training_check)


def _training_check(*args, **kwargs):
    """``optbench data inspect``'s check that a climate task can train on the files: a task is a
    layer above the data, so the command is handed this (torch is imported only when it runs)."""
    from optbench.tasks.climate import describe_training_data

    return describe_training_data(*args, **kwargs)


def run_generate(argv: list[str]) -> None:
    from optbench.generate.command import main as generate_main

    generate_main(argv)


def run_export(argv: list[str]) -> None:
    from optbench.generate.command import export_main

    export_main(argv)


def run_report(argv: list[str]) -> None:
    from optbench.report.command import main as report_main

    report_main(argv)


def run_compare(argv: list[str]) -> None:
    from optbench.report.command import compare_main

    compare_main(argv)


def run_validate(argv: list[str]) -> None:
    from optbench.validate.command import main as validate_main

    validate_main(argv)


def run_cache(argv: list[str]) -> None:
    from optbench.caches import main as cache_main

    cache_main(argv)


def usage() -> str:
    lines = ["usage: optbench <command> [args]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in COMMANDS.items()]
    lines += ["", "`optbench COMMAND --help`: what it does, its options and examples"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(OK if argv else BAD_INPUT)
    if argv[0] in ("--version", "-V"):
        from optbench.provenance import format_version

        print(format_version())
        raise SystemExit(OK)
    command, rest = argv[0], argv[1:]
    handlers = {
        "train": run_train, "estimate": run_estimate, "plan": lambda rest: run_estimate(rest, command="plan"),
        "data": run_data, "generate": run_generate, "export": run_export, "report": run_report,
        "compare": run_compare, "validate": run_validate, "cache": run_cache,
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
        fail(f"interrupted: {exc}; nothing was trained", code=signal_exit(exc.signum))
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
