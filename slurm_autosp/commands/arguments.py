"""What our command lines share: help on request, and a bad configuration reported as one
error naming the key, with exit status 2, before anything starts."""

from __future__ import annotations

import sys

from slurm_autosp.config import ConfigError

HELP = ("-h", "--help", "help")

# The exit status of a refused job, whichever command refuses it (docs/refusals.md)
REFUSED = 2


def arguments(argv: list[str] | None, doc: str) -> list[str] | None:
    """The command's arguments; None once `doc` is printed because help was asked for."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in HELP for a in argv):
        print(doc)
        return None
    return argv


def config_error(err: ConfigError) -> int:
    print(f"error: {err}", file=sys.stderr)
    return REFUSED


def take_flag(argv: list[str], flag: str) -> tuple[list[str], bool]:
    """`argv` without `flag`, and whether it was there."""
    return [a for a in argv if a != flag], flag in argv
