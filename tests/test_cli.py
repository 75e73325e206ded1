"""``optbench COMMAND --help`` for every command: what it does, its own options, two examples, then
where it is described (the config reference for commands that take train's overrides); never Hydra's
dump of the whole composed config (issue 27 item 12), and without importing torch (issue 47 item 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from optbench.cli import COMMANDS
from optbench.cli import main as cli_main
from optbench.usage import CONFIG_REFERENCE, EXAMPLES, REFERENCES
from tests.helpers import ROOT

OWN_OPTIONS = {  # an option each command's help must name: its own, not another command's
    "train": "--cfg job", "estimate": "estimate.gpu=NAME", "data": "inspect", "report": "--baseline",
    "compare": "--repeats", "validate": "--all-phases", "plan": "estimate.global_batch=N",
    "generate": "--temperature", "export": "OUT", "cache": "clear",
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_says_what_it_does_its_options_examples_and_the_config_reference(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert out.startswith(f"usage: optbench {command}") and OWN_OPTIONS[command] in out
    examples = out[out.index("examples:"):].splitlines()[1:3]
    assert examples == [f"  {line}" for line in EXAMPLES[command]] and len(examples) == 2
    assert all(line.strip().startswith(f"optbench {command} ") for line in examples)
    assert out.rstrip().endswith(REFERENCES[command])
    takes_overrides = command in ("train", "estimate", "plan", "validate")
    assert (CONFIG_REFERENCE in out) == takes_overrides  # `optbench train --cfg job` only where it applies
    assert "``" not in out  # no reStructuredText
    assert "defaults:" not in out and "_target_" not in out and len(out.splitlines()) < 60  # no config dump


def test_the_top_level_help_points_at_each_commands_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0 and "`optbench COMMAND --help`" in capsys.readouterr().out


HELP_IMPORTS = """
import contextlib, io, sys
from optbench.cli import COMMANDS, main
heavy = ("torch", "numpy", "xarray", "transformers", "matplotlib")
for argv in [[c, "--help"] for c in COMMANDS] + [["data", t, "--help"] for t in sys.argv[1:]]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
    print(" ".join(argv[:-1]), *[m for m in heavy if m in sys.modules])
"""


def test_help_of_every_command_imports_no_torch():
    """Help answers in about a second: it imports what it prints, not torch (one process, every
    command in turn: a heavy module, once imported, is named from the command that imported it)."""
    tools = ["tokenizer", "tokenize", "synth", "inspect", "captions"]
    out = subprocess.run([sys.executable, "-c", HELP_IMPORTS, *tools], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    assert out.splitlines() == [*COMMANDS, *(f"data {t}" for t in tools)]


def test_the_exit_table_agrees_with_what_a_finished_run_is():
    """A run that finished (``optbench.run.rerun.FINISHED``: never trained over) exits 0, nothing else
    does; a user error is 2 whatever status it left; a signal N is 128 + N, read back as N."""
    import signal

    from optbench.exits import BAD_INPUT, OK, RUN_STATUS, run_exit, signal_exit, signal_of
    from optbench.run.rerun import FINISHED

    assert {status for status in RUN_STATUS if run_exit(status) == OK} == set(FINISHED)
    assert run_exit("completed", user_error=True) == BAD_INPUT
    stopped = run_exit("interrupted", signum=signal.SIGTERM)
    assert stopped == signal_exit(signal.SIGTERM) and signal_of(stopped) == signal.SIGTERM
    assert signal_of(run_exit("failed")) is None


RUN_IMPORTS = """
import sys
from optbench.config import compose
from optbench.run.train import train
result = train(compose(sys.argv[2:]), run_dir=sys.argv[1])
print(result.status, *[m for m in ("torchao", "transformers") if m in sys.modules])
"""


def test_a_run_of_optbenchs_own_model_imports_neither_torchao_nor_transformers(tmp_path):
    """docs/optimizations.md: optbench imports torchao only in a run that uses it (a model=hf run
    imports it through transformers' quantizer integration, which the page says)."""
    args = ["model=tiny", "train.device=cpu", "train.steps=2", "train.batch_size=2", "train.seq_len=16",
            "measure.warmup_steps=1", "measure.track_memory=false", "log.progress=log", "estimate.predict=false"]
    out = subprocess.run([sys.executable, "-c", RUN_IMPORTS, str(tmp_path / "run"), *args], capture_output=True,
                         text=True, cwd=ROOT, check=True).stdout
    assert out.splitlines()[-1] == "completed"
