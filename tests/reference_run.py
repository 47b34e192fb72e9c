"""The uninterrupted local reference run that resumed runs (local and on Slurm) must match bit
for bit; tests/conftest.py's `uninterrupted_run` fixture trains it once per session and stage.

It reads a token file in a seeded shuffled order: 100 samples of 256 tokens, 2 a step, so an
epoch is 50 steps and the 160 steps run into a fourth epoch, each in its own order. A run
stopped in its first epoch must read, after the resume, what this one read."""

import subprocess
import sys
from pathlib import Path

from slurm_autosp.data import SyntheticSource, write_token_file

REPO = Path(__file__).resolve().parents[1]
REFERENCE_STEPS = 160
REFERENCE_SAMPLES = 100
SAMPLES_PER_STEP = 2
REFERENCE_ARGS = [
    "cfg=configs/tiny_cpu.yaml",
    f"train.steps={REFERENCE_STEPS}",
    "train.log_every=1",
]


def reference_data(folder: Path) -> tuple[str, ...]:
    """Write the reference's token file into `folder`; returns the overrides that read it."""
    tokens = folder / "stream.tokens"
    stream = SyntheticSource(vocab_size=256, seq_len=REFERENCE_SAMPLES * 256, seed=1).sample(0)
    write_token_file(tokens, stream.input_ids.numpy(), vocab_size=256)
    return ("data.source=tokens", f"data.path={tokens}", "data.shuffle=true")


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
