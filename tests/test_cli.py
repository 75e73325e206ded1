"""``optbench COMMAND --help`` for every command: what it does, its own options, two examples, then
where the config reference is; never Hydra's dump of the whole composed config (issue 27 item 12)."""

from __future__ import annotations

import pytest

from optbench.cli import COMMANDS
from optbench.cli import main as cli_main
from optbench.usage import CONFIG_REFERENCE, EXAMPLES

OWN_OPTIONS = {  # an option each command's help must name: its own, not another command's
    "train": "--cfg job", "estimate": "estimate.gpu=NAME", "data": "inspect", "report": "--baseline",
    "compare": "--repeats", "validate": "--all-phases", "plan": "estimate.global_batch=N",
    "generate": "--temperature", "export": "OUT",
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
    assert out.rstrip().endswith(CONFIG_REFERENCE)
    assert "defaults:" not in out and "_target_" not in out and len(out.splitlines()) < 60  # no config dump


def test_the_top_level_help_points_at_each_commands_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0 and "`optbench COMMAND --help`" in capsys.readouterr().out
