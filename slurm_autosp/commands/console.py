"""slurm-autosp COMMAND [ARGUMENTS]: every command under one name (pyproject's console script).

Each command is a module of slurm_autosp.commands with `main(argv) -> exit status`, imported
only once chosen: help and a mistyped command answer at once, without importing torch.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass

from slurm_autosp.commands.arguments import HELP, REFUSED


@dataclass(frozen=True)
class Command:
    module: str  # whose main(argv) -> exit status runs it
    summary: str


COMMANDS = {
    "submit": Command(
        "slurm_autosp.commands.submit", "train: sbatch on SLURM, local processes elsewhere"
    ),
    "status": Command(
        "slurm_autosp.commands.status", "where a run stands; --follow re-attaches to its job"
    ),
    "summary": Command("slurm_autosp.commands.summary", "a run's TensorBoard data in the terminal"),
    "plan": Command(
        "slurm_autosp.commands.plan", "the per-GPU memory plan and whether the job fits"
    ),
    "verify": Command(
        "slurm_autosp.commands.verify", "one SP step on CPU ranks against one device"
    ),
    "probe": Command("slurm_autosp.commands.probe", "a short job measuring the nodes a run uses"),
    "gpu-check": Command("slurm_autosp.commands.gpu_check", "the first evidence on one GPU"),
    "data": Command("slurm_autosp.commands.data", "data prepare: text or chat to a dataset"),
    "run": Command(
        "slurm_autosp.commands.run", "one rank of a job, for hand-written sbatch scripts"
    ),
}

USAGE = "usage: slurm-autosp COMMAND [ARGUMENTS]   (slurm-autosp COMMAND --help for its own)"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "\n".join([USAGE, "", "commands:", *lines])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in HELP:
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else REFUSED
    name, arguments = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"error: no command {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return REFUSED
    return importlib.import_module(command.module).main(arguments)
