"""`python -m slurm_autosp.submit` of the shipped tiny_cpu config on local processes, as the
tests that train through the command run it."""

import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def submit_local(
    *overrides: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    ignore_sigint: bool = False,
) -> subprocess.CompletedProcess:
    """`ignore_sigint` starts it as a shell starts a background command (`cmd &`)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_autosp.submit",
            "cfg=configs/tiny_cpu.yaml",
            "cluster.backend=local",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if ignore_sigint
        else None,
    )
