"""`slurm-autosp COMMAND`: one name for every command, each run as `python -m` runs it."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import run_command

from slurm_autosp.commands import console, status

REPO = Path(__file__).resolve().parents[1]


def test_pyprojects_console_script_is_this_main():
    pyproject = (REPO / "pyproject.toml").read_text()  # tomllib is Python 3.11's
    section = re.search(r"^\[project\.scripts\]\n((?:[^\[\n].*\n)+)", pyproject, re.M)
    assert section is not None, "pyproject has no [project.scripts]"
    assert section.group(1).strip() == 'slurm-autosp = "slurm_autosp.commands.console:main"'


@pytest.mark.parametrize("name", list(console.COMMANDS))
def test_every_command_is_listed_and_runs_its_modules_main_with_its_help(name):
    assert f"  {name} " in console.usage()
    module = importlib.import_module(console.COMMANDS[name].module)
    via_console = run_command(console.main, name, "--help")
    direct = run_command(module.main, "--help")
    assert via_console.returncode == direct.returncode == 0
    assert via_console.stdout == direct.stdout and via_console.stdout.strip()


def test_arguments_and_the_exit_status_pass_through(tmp_path):
    missing = str(tmp_path / "no_such_run")
    via_console = run_command(console.main, "status", missing)
    direct = run_command(status.main, missing)
    assert via_console.returncode == direct.returncode == 2
    assert via_console.stderr == direct.stderr and missing in direct.stderr


def test_a_mistyped_command_exits_2_naming_it_and_the_closest_one():
    done = run_command(console.main, "sumbit", "cfg=configs/tiny_cpu.yaml")
    assert done.returncode == 2
    assert "no command 'sumbit'; did you mean submit?" in done.stderr
    assert all(f"  {name} " in done.stderr for name in console.COMMANDS)


def test_no_command_prints_the_usage_and_exits_2_and_help_answers_without_torch():
    assert run_command(console.main).returncode == 2
    script = (
        "import sys; from slurm_autosp.commands.console import main; "
        "status = main(['--help']); assert 'torch' not in sys.modules, 'torch imported'; "
        "sys.exit(status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(console.USAGE)
