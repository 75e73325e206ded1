"""``optbench train OVERRIDES [-m]``: compose the config with Hydra, run ``optbench.run.train.train``
(or, with ``-m``, every job of the sweep through ``optbench.run.sweep``), print the summary and end
with the run's exit status (``optbench.exits``). Before Hydra sees the command: only one of its mode
flags, and the run directory an override names is created here so that an unusable path is one line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from optbench.config.hydra_errors import held_stderr
from optbench.config.hydra_loader import composing_once_per_file
from optbench.config.hydra_mode import mode_read_without_composing
from optbench.errors import ConfigError
from optbench.exits import BAD_INPUT, INTERRUPTED, OK, fail, signal_exit, sweep_exit

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
    _refuse_unwritable(path, key=key.rstrip("="))
    return (path, top) if top is not None else None


def _refuse_unwritable(path: Path, *, key: str) -> None:
    """ConfigError when Hydra could not write its files into the existing directory ``path`` (a
    read-only filesystem, no permission, a file named ``.hydra``, a directory named ``train.log``):
    one line naming it, not the logging module's "Unable to configure handler 'file'"."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write into {path} ({key}): {exc.strerror}; choose another {key}") from None
    for name, is_dir, what in ((".hydra", True, "Hydra writes the run's config"), ("train.log", False, "the run writes its log")):
        if (path / name).exists() and (path / name).is_dir() != is_dir:
            kind = "a directory" if (path / name).is_dir() else "a file"
            raise ConfigError(f"{path / name} is {kind} where {what}; move it away, or choose another {key}")


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

        print(format_summary(result.record, result.run_dir), flush=True)
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


def _upgraded_or_help(argv: list[str]) -> list[str]:
    """The overrides under today's names (an old name runs under its new one, saying so); with
    ``--help``, the help (Hydra's would print the whole composed config), and exit."""
    from optbench.config.renames import upgrade_and_warn

    argv = upgrade_and_warn(argv)
    if "-h" in argv or "--help" in argv:
        from optbench.usage import hydra_help

        print(hydra_help("train"))
        raise SystemExit(OK)
    return argv


def main(argv: list[str]) -> None:
    """``optbench train OVERRIDES [-m]``: one run, or a sweep; ``--help`` imports neither torch nor
    the trainer (its config groups are read from conf/)."""
    argv = _upgraded_or_help(argv)
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from optbench.config import conf_dir
    from optbench.run.preemption import startup_interruption
    from optbench.run.sweep import format_recap, run_job
    from optbench.run.train import train

    _honour_startup_signal()  # received while importing (torch, Hydra)
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
        with held_stderr(lambda: started), mode_read_without_composing(), composing_once_per_file():
            # errors as one line; one composition; each config file parsed once
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
        # Hydra exits 1 for a config it could not compose (held_stderr printed it as one line), also for
        # a later job of a sweep (a multirun job never exits by itself): bad input too, so status 2
        if exc.code == 1 and (not started or outcomes):
            if outcomes:
                print(format_recap(outcomes), flush=True)
            raise SystemExit(BAD_INPUT) from None
        raise
    if outcomes:
        print(format_recap(outcomes), flush=True)
        raise SystemExit(INTERRUPTED if interrupted else sweep_exit(o.status for o in outcomes))
