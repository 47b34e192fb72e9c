"""Fixtures shared across the suite."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPTS = REPO / "tests" / "slurm_cluster"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm (munge, slurmctld, slurmd from Debian's packages) on localhost,
    started by our own script and stopped after the session."""
    started = subprocess.run(
        ["bash", str(SLURM_SCRIPTS / "start.sh")], capture_output=True, text=True, timeout=900
    )
    if started.returncode != 0:
        pytest.fail(
            "could not start the local Slurm cluster (tests/slurm_cluster/start.sh needs root and "
            f"Debian's packages):\n{started.stdout}\n{started.stderr}"
        )
    yield
    subprocess.run(["bash", str(SLURM_SCRIPTS / "stop.sh")], capture_output=True, timeout=120)
