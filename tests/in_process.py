"""Run a command's `main` inside the test process, as `python -m` would run it, capturing what
it prints: the interpreter start and the imports (5-9 s a command on 2 cores) are paid once per
session (a test changes PATH or the environment through monkeypatch). Tests that depend on
the process itself (signals, exit of other ranks) keep a subprocess."""

import contextlib
import io
import subprocess
from collections.abc import Callable


def run_command(main: Callable[[list[str]], int], *args: str) -> subprocess.CompletedProcess:
    """`main(args)`'s exit status and output, shaped like subprocess.run's result."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(list(args), status, out.getvalue(), err.getvalue())
