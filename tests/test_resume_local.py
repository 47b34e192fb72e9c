"""A run stopped by SLURM's signal on local processes saves, requeues itself and resumes exactly
where it stopped, on the reference's shuffled token file: stopped in its first epoch, it reads
after the resume what the uninterrupted run read, across the later epochs' new orders too.
Signalled again once it has been requeued `cluster.max_requeues` times, it stops with its
checkpoint saved; its newest checkpoint then damaged, submitting it again sets that one aside
(named in the log, status and TensorBoard), resumes from the one before and trains to the same
end. test_slurm's run is stopped by Slurm against the same reference."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reference_run import (
    REFERENCE_SAMPLES,
    REFERENCE_STEPS,
    SAMPLES_PER_STEP,
    assert_same_weights,
    hf_weights,
    reference_cmd,
    run_text,
    tensorboard_losses,
)
from slurm_helpers import final_result

REPO = Path(__file__).resolve().parents[1]
STEPS = REFERENCE_STEPS


def submit(root, overrides):
    """The reference's training as run "resumed", requeued at most once."""
    return subprocess.Popen(
        reference_cmd(root, "resumed", ("cluster.max_requeues=1", *overrides)),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def sigusr2_to(folder):
    """SLURM's pre-timeout signal, to the job's processes only (those of its submitit folder)."""
    subprocess.run(
        ["pkill", f"-{signal.SIGUSR2.name}", "-f", f"submitit.core._submit {folder}"], check=True
    )


def signalled_twice(root, overrides):
    """Submit the run; send USR2 once rank 0 logged step 7 and again at its first step after
    the resume. Returns submit's exit status and output."""
    proc = submit(root, overrides)
    folder = root / "resumed" / "submitit"
    signals, resumed, lines = 0, False, []
    for line in proc.stdout:
        lines.append(line)
        resumed = resumed or "resumed from" in line
        if re.search(r" step \d+/", line) and (
            (signals == 0 and f" step 7/{STEPS} " in line) or (signals == 1 and resumed)
        ):
            sigusr2_to(folder)
            signals += 1
    _, err = proc.communicate(timeout=600)
    assert signals == 2, "".join(lines) + err
    return proc.returncode, "".join(lines) + err


def stops(output, signal_name):
    """The steps the run stopped at, in order (a failed job's error repeats its log's tail)."""
    found = re.findall(rf"stopping at step (\d+) on {signal_name}", output)
    return sorted({int(step) for step in found})


@pytest.mark.slow
def test_signalled_run_requeues_stops_at_max_requeues_and_resumes_with_identical_losses(
    tmp_path, uninterrupted_run, reference_overrides
):
    run_dir, checkpoints = tmp_path / "resumed", tmp_path / "resumed" / "checkpoints"
    status, out = signalled_twice(tmp_path, reference_overrides)
    requeued, limited = stops(out, "SIGUSR2")
    assert 7 <= requeued < REFERENCE_SAMPLES // SAMPLES_PER_STEP  # inside the first epoch
    assert STEPS > 3 * REFERENCE_SAMPLES // SAMPLES_PER_STEP  # the reference reads 4 epochs
    assert f"resumed from {checkpoints / f'step_{requeued:08d}'} at step {requeued}" in out
    assert requeued < limited < STEPS
    assert status == 1 and "stopped by a signal after 1 requeues (cluster.max_requeues=1)" in out
    records = [json.loads(x) for x in (run_dir / "requeues.jsonl").read_text().splitlines()]
    assert [r["restart"] for r in records] == [1]

    damaged = checkpoints / f"step_{limited:08d}" / "trainer_state.json"
    damaged.write_text(damaged.read_text().replace('"step"', '"stop"'))
    again = submit(tmp_path, reference_overrides)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, out + err
    aside = checkpoints / f"damaged_step_{limited:08d}"
    assert f"moved aside to {aside}" in out and "trainer_state.json: size" in out
    assert f"resumed from {checkpoints / f'step_{requeued:08d}'} at step {requeued}" in out
    resumed = final_result(run_dir)
    assert resumed.first_step == requeued
    reference = final_result(uninterrupted_run)
    assert resumed.losses == reference.losses[requeued:]  # bitwise: same floats after the resume
    assert reference.losses[-1] < reference.losses[0] / 2, "the masked reference run learns"

    status_text = subprocess.run(
        [sys.executable, "-m", "slurm_autosp", "status", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        f"steps done: {STEPS} of {STEPS}" in status_text
        and "requeues: 1" in status_text
        and "not running" in status_text
    )
    assert f"last good checkpoint: {checkpoints / f'step_{STEPS:08d}'}" in status_text
    assert "engine fsdp2, 2 ranks" in status_text
    assert "damaged checkpoints set aside: 1" in status_text
    assert f"{aside}: trainer_state.json: size" in status_text
    assert f"step_{limited:08d} (now {aside.name})" in run_text(
        run_dir, "run/damaged_checkpoints/text_summary"
    )

    curve = tensorboard_losses(run_dir)  # all three starts
    assert [s for s, _ in curve] == list(range(1, STEPS + 1))  # no duplicated or missing steps
    assert curve == tensorboard_losses(uninterrupted_run)

    assert_same_weights(hf_weights(run_dir), hf_weights(uninterrupted_run))
