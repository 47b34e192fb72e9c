"""A documentation page's commands, run as the page writes them: its fenced blocks, in order,
each in `bash -euo pipefail` from the repository's root."""

import re
import subprocess
import time
from pathlib import Path

from slurm_helpers import REPO


def fenced(page: Path, language: str) -> list[str]:
    """`page`'s code blocks fenced as `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", page.read_text(), re.M | re.S)


def run_blocks(commands: list[str], env: dict[str, str]) -> list[str]:
    """Each command's standard output; a command that fails fails the test, naming it."""
    outputs = []
    for command in commands:
        start = time.monotonic()
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        print(f"{time.monotonic() - start:5.1f} s  {command.splitlines()[0][:100]}")
        outputs.append(done.stdout)
    return outputs
