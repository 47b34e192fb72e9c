"""Against a real Slurm on localhost: one FSDP2 run preempted, then sent the pre-timeout signal,
ending with the same losses as an uninterrupted run; a failing rank ends its job. (Training
through sbatch on 4 ranks, with submit returning once queued: test_slurm_follow.)"""

import re
import subprocess
import time

import broken_model
import pytest
from reference_run import (
    REFERENCE_STEPS,
    REFERENCE_TRAINING,
    assert_same_weights,
    hf_weights,
    tensorboard_losses,
)
from slurm_helpers import (
    REPO,
    RunningSubmit,
    final_result,
    job_state,
    release_requeued,
    submit_cmd,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
STEPS = REFERENCE_STEPS


@pytest.fixture(scope="module")
def train(reference_overrides):
    """The reference run's training and data settings."""
    return [*REFERENCE_TRAINING, *reference_overrides]


def _urgent_job():
    """A job of the higher-priority partition needing every CPU: Slurm preempts the run
    (SIGTERM, GraceTime) and requeues it."""
    subprocess.run(
        [
            "sbatch",
            "-p",
            "urgent",
            "-n",
            "8",
            "--job-name=urgent",
            "--output=/dev/null",
            "--wrap",
            "sleep 2",
        ],
        check=True,
        capture_output=True,
    )


def _stop_and_restart(run, after_step, interrupt, signal_name):
    """Interrupt the job once rank 0 logged `after_step`; wait until it stopped with
    `signal_name` and Slurm started it again. Returns the step it stopped at."""
    run.wait_for_line(f"step {after_step}/{STEPS} ")
    interrupt(run.job_id)
    stopping = run.wait_for_line("stopping at step")
    assert signal_name in stopping
    release_requeued(run.job_id)
    stopped = int(re.search(r"stopping at step (\d+)", stopping).group(1))
    assert after_step <= stopped < STEPS
    return stopped


def test_preempted_and_pre_timeout_signalled_fsdp2_run_resumes_with_identical_losses(
    tmp_path, train, uninterrupted_run
):
    """Preempted after step 10 (SIGTERM; Slurm requeues it), then sent the pre-timeout signal
    10 steps into its second start (USR2; the job requeues itself): the run's every step
    (TensorBoard's curve, all three attempts) equals the uninterrupted local FSDP2 run's bit
    for bit, and so do the losses after the last resume (the result's float64s) and the
    exported weights: Slurm must not change a single bit (test_resume_local stops the same run
    on local processes)."""
    reference = uninterrupted_run
    run = RunningSubmit(
        "cluster.backend=slurm",
        "cluster.partition=debug",
        f"run.output_root={tmp_path}",
        *train,
    )
    preempted = _stop_and_restart(run, 10, lambda job_id: _urgent_job(), "SIGTERM")
    signalled = _stop_and_restart(
        run,
        preempted + 10,
        lambda job_id: subprocess.run(["scancel", "--signal=USR2", job_id], check=True),
        "SIGUSR2",
    )
    out = run.finish()
    checkpoints = tmp_path / "tiny_cpu" / "checkpoints"
    for stopped in (preempted, signalled):
        assert f"resumed from {checkpoints / f'step_{stopped:08d}'} at step {stopped}" in out
    result = final_result(tmp_path / "tiny_cpu")
    assert result.first_step == signalled
    assert result.losses == final_result(reference).losses[signalled:]
    curve = tensorboard_losses(tmp_path / "tiny_cpu")
    assert [step for step, _ in curve] == list(range(1, STEPS + 1))
    assert curve == tensorboard_losses(reference)
    assert_same_weights(hf_weights(tmp_path / "tiny_cpu"), hf_weights(reference))


def test_a_failing_rank_ends_the_whole_job(tmp_path):
    """Rank 1 fails building its model while rank 0 waits for it in a collective: srun ends
    rank 0 too, within seconds, instead of the job holding its nodes until the collective
    timeout (`cluster.collective_timeout_min`)."""
    proc = subprocess.run(
        submit_cmd(
            "cluster.backend=slurm",
            f"run.output_root={tmp_path}",
            broken_model.BUILDER,
            "follow=false",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=broken_model.job_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # returns once queued
    job_id = re.search(r"submitted job (\d+) \(slurm", proc.stdout).group(1)
    deadline = time.monotonic() + 180
    while job_state(job_id) and time.monotonic() < deadline:
        time.sleep(2)
    assert not job_state(job_id), f"job {job_id} still {job_state(job_id)} after rank 1 failed"
    logs = tmp_path / "tiny_cpu" / "submitit"
    assert broken_model.ERROR in (logs / f"{job_id}_1_log.err").read_text()
    assert "step 1/" not in (logs / f"{job_id}_0_log.out").read_text()
