"""``optbench <command>``: dispatch only; the work lives in the modules each command names."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from optbench.errors import ConfigError, Interrupted
from optbench.exits import BAD_INPUT, INTERRUPTED, OK, fail, signal_exit, sweep_exit

COMMANDS = {
    "train": "one measured training run, or a sweep with -m (Hydra overrides)",
    "estimate": "parameters, FLOPs/token, per-device peak memory and predicted step time of a config",
    "plan": "the fastest configurations that fit: micro-batch x activation checkpointing x precision x FSDP2/DDP (estimate's keys)",
    "data": "data tools: tokenizer (train a BPE), tokenize, synth (a climate NetCDF file), inspect (NetCDF files, Zarr stores), captions (paired text)",
    "generate": "text from a trained task=climate_text model for a climate (true, shuffled, none); its numbers scored",
    "report": "review run/sweep outputs: speedups with confidence intervals, loss delta, memory, gates, plots",
    "compare": "A/B: run A -- B alternately with the same seed and data, then report",
    "validate": "the plan's phase 9: baseline vs the furthest phase that runs here, with the plan's gates",
}


# how a run may end on purpose before train.steps: printed as what they are (the exit status stays:
# 0 for an early stop, 124 for the time budget), never as "error:"
OUTCOMES = ("stopped_early", "time_limit")


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
        fail(f"interrupted: {stopped}; {what}", code=signal_exit(stopped.signum))


def run_train(argv: list[str]) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from optbench.config import conf_dir
    from optbench.config.renames import upgrade_and_warn
    from optbench.run.preemption import startup_interruption
    from optbench.run.sweep import format_recap, run_job
    from optbench.run.train import train

    _honour_startup_signal()  # received while importing (torch, Hydra)
    argv = upgrade_and_warn(argv)  # an old override name runs under its new one, saying so
    if "-h" in argv or "--help" in argv:  # Hydra's would print the whole composed config
        from optbench.usage import hydra_help

        print(hydra_help("train"))
        raise SystemExit(OK)
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
        if stopped is not None and exc.code not in (OK, signal_exit(stopped.signum)):  # Hydra caught it: say what it was
            if outcomes:
                print(format_recap(outcomes), flush=True)
            fail(f"interrupted: {stopped}", code=signal_exit(stopped.signum))
        # Hydra exits 1 for a config it could not compose (unknown key or group, wrong type), also
        # for a later job of a sweep (a multirun job never exits by itself): that is bad input
        # too, so it gets status 2; Hydra's own message stays as it printed it.
        if exc.code == 1 and (not started or outcomes):
            if outcomes:
                print(format_recap(outcomes), flush=True)
            raise SystemExit(BAD_INPUT) from None
        raise
    if outcomes:
        print(format_recap(outcomes), flush=True)
        raise SystemExit(INTERRUPTED if interrupted else sweep_exit(o.status for o in outcomes))


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


def run_report(argv: list[str]) -> None:
    from optbench.report.command import main as report_main

    report_main(argv)


def run_compare(argv: list[str]) -> None:
    from optbench.report.command import compare_main

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
        raise SystemExit(OK if argv else BAD_INPUT)
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
