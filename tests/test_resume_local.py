"""A run stopped by SLURM's signal on local processes saves, requeues itself and resumes exactly
where it stopped, on the reference's shuffled token file: stopped in its first epoch, it reads
after the resume what the uninterrupted run read, across the later epochs' new orders too.
test_slurm's run is stopped by Slurm against the same reference."""

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reference_run import (
    REFERENCE_ARGS,
    REFERENCE_SAMPLES,
    REFERENCE_STEPS,
    SAMPLES_PER_STEP,
    assert_same_weights,
    hf_weights,
    tensorboard_losses,
)
from submitit.core.utils import pickle_load

REPO = Path(__file__).resolve().parents[1]
STEPS = REFERENCE_STEPS
ARGS = [*REFERENCE_ARGS, "cluster.backend=local"]


def submit_cmd(root, name, overrides=()):
    return [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        *ARGS,
        f"run.output_root={root}",
        f"run.name={name}",
        *overrides,
    ]


def final_result(run_dir):
    results = sorted((run_dir / "submitit").glob("*_0_result.pkl"))
    outcome, result = pickle_load(results[-1])
    assert outcome == "success", result
    return result


def sigusr2_to(folder):
    """SLURM's pre-timeout signal, to the job's processes only (those of its submitit folder)."""
    return lambda: subprocess.run(
        ["pkill", f"-{signal.SIGUSR2.name}", "-f", f"submitit.core._submit {folder}"], check=True
    )


def interrupt_after_step(root, name, step, send, overrides=()):
    """Run a job and call `send()` once rank 0 has logged `step`; returns submit's stdout."""
    proc = subprocess.Popen(
        submit_cmd(root, name, overrides),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"step {step}/" in line:
            send()
            break
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return "".join(lines) + out


@pytest.mark.slow
def test_signalled_run_requeues_and_resumes_with_identical_losses(
    tmp_path, uninterrupted_run, reference_overrides
):
    folder = tmp_path / "resumed" / "submitit"
    stdout = interrupt_after_step(tmp_path, "resumed", 7, sigusr2_to(folder), reference_overrides)
    uninterrupted = uninterrupted_run
    stopped = int(re.search(r"stopping at step (\d+) on SIGUSR2", stdout).group(1))
    assert 7 <= stopped < REFERENCE_SAMPLES // SAMPLES_PER_STEP  # inside the first epoch
    assert STEPS > 3 * REFERENCE_SAMPLES // SAMPLES_PER_STEP  # the reference reads 4 epochs
    assert (
        f"resumed from {tmp_path / 'resumed' / 'checkpoints' / f'step_{stopped:08d}'} at step {stopped}"
        in stdout
    )

    reference, resumed = final_result(uninterrupted), final_result(tmp_path / "resumed")
    assert resumed.first_step == stopped
    assert resumed.losses == reference.losses[stopped:]  # bitwise: same floats after the resume
    assert reference.losses[-1] < reference.losses[0] / 2, "the masked reference run learns"

    status = subprocess.run(
        [sys.executable, "-m", "slurm_autosp.status", str(tmp_path / "resumed")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        f"steps done: {STEPS} of {STEPS}" in status
        and "requeues: 1" in status
        and "not running" in status
    )
    assert (
        f"last good checkpoint: {tmp_path / 'resumed' / 'checkpoints' / f'step_{STEPS:08d}'}"
        in status
    )
    assert "engine fsdp2, 2 ranks" in status

    curve = tensorboard_losses(tmp_path / "resumed")
    assert [s for s, _ in curve] == list(range(1, STEPS + 1))  # no duplicated or missing steps
    assert curve == tensorboard_losses(uninterrupted)

    assert_same_weights(hf_weights(tmp_path / "resumed"), hf_weights(uninterrupted))
