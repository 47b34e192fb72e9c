"""The uninterrupted local reference run that resumed runs (local and on Slurm) must match bit
for bit; tests/conftest.py's `uninterrupted_run` fixture trains it once per session and stage."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE_STEPS = 160
REFERENCE_ARGS = [
    "cfg=configs/tiny_cpu.yaml",
    f"train.steps={REFERENCE_STEPS}",
    "train.log_every=1",
]


def train_reference(root: Path, zero_stage: int, overrides: tuple[str, ...] = ()) -> Path:
    """Train the reference under `zero_stage` (and `overrides`) into root/ref; returns the run
    directory."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_autosp.submit",
            *REFERENCE_ARGS,
            "cluster.backend=local",
            f"parallel.zero_stage={zero_stage}",
            f"run.output_root={root}",
            "run.name=ref",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return root / "ref"
