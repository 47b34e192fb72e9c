"""Long steps stopped part-way, end to end on local processes: a tiny Llama of 16 layers whose
step takes seconds (cluster.stop_at=layer, a save every 2 steps) gets SLURM's pre-timeout signal
(USR2) a third into a step while its last save is held in the writers (SIGSTOP, continued
right after the signal: the stop waits for that save rather than writing it again); after the
requeue, a preemption's SIGTERM a third into a step, with the kill 10 s later. Each time every
rank exits within a quarter of a step, the requeued job resumes from the step before, and the
run ends with the uninterrupted run's losses and weights, bit for bit."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from local_job import Job, gone
from reference_run import assert_same_weights, hf_weights, tensorboard_losses
from test_async_save import writers_of

STEPS = 8
LONG_STEPS = (
    "model.num_hidden_layers=16",
    "data.seq_len=4096",
    "train.micro_batch=1",
    "train.grad_accum=2",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.start_check=false",
    "cluster.stop_at=layer",
    "checkpoint.every_steps=2",
    "cluster.max_requeues=2",
)


def long_steps(root: Path, name: str) -> Job:
    cmd = [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=local",
        f"run.output_root={root}",
        f"run.name={name}",
        *LONG_STEPS,
    ]
    return Job(cmd, root / name)


def signal_a_third_into(
    job: Job, step: int, signum: signal.Signals
) -> tuple[set[int], float, float]:
    """Once step `step - 1` is logged, send `signum` to every rank a third into `step` (by the
    logged step's length); returns the ranks, when it was sent, and that length."""
    logged = rf"step {step - 1}/{STEPS} \|.*\| ([\d.]+) s/step"
    job.wait_for(f"step {step - 1}", lambda: re.search(logged, job.output))
    match = re.search(logged, job.output)
    assert match is not None
    seconds = float(match.group(1))
    ranks = job.ranks()
    assert len(ranks) == 2, job.output
    time.sleep(seconds / 3)
    sent = time.monotonic()
    for rank in ranks:
        os.kill(rank, signum)
    return ranks, sent, seconds


@pytest.mark.slow
def test_a_signal_a_third_into_a_long_step_stops_every_rank_within_a_quarter_step_exactly(
    tmp_path,
):
    reference = long_steps(tmp_path, "reference")
    reference.finish()

    job = long_steps(tmp_path, "stopped")
    # USR2 a third into step 5, step 4's save still in the writers: committed, not written again
    job.wait_for("step 2 saved", lambda: job.latest() == "step_00000002")
    writers = writers_of(job.ranks())
    assert len(writers) == 2, job.output
    for writer in writers:
        os.kill(writer, signal.SIGSTOP)
    ranks, sent, step_s = signal_a_third_into(job, 5, signal.SIGUSR2)
    for writer in writers:
        os.kill(writer, signal.SIGCONT)
    job.wait_for("the ranks exited", lambda: gone(ranks), timeout=60)
    exited_s = time.monotonic() - sent
    assert exited_s <= step_s / 4, f"{exited_s:.2f} s after USR2, steps of {step_s} s"
    job.wait_for("the requeued job resumed", lambda: "resumed from" in job.output)
    assert "step 5 abandoned at a layer boundary" in job.output
    assert f"checkpoint {job.checkpoints / 'step_00000004'} saved" in job.output
    assert "abandoning" not in job.output
    assert "stopping at step 4 on SIGUSR2" in job.output
    assert f"resumed from {job.checkpoints / 'step_00000004'} at step 4" in job.output
    assert gone(writers)

    # SIGTERM a third into step 7, SIGKILL 10 s later: step 6's save is written, nothing more
    ranks, sent, step_s = signal_a_third_into(job, 7, signal.SIGTERM)
    while not gone(ranks) and time.monotonic() < sent + 10:
        time.sleep(0.02)
    exited_s = time.monotonic() - sent
    for rank in ranks - {pid for pid in ranks if gone([pid])}:
        os.kill(rank, signal.SIGKILL)
    assert exited_s <= step_s / 4, f"{exited_s:.2f} s after SIGTERM, steps of {step_s} s"
    job.finish()
    assert "step 7 abandoned at a layer boundary" in job.output
    assert "stopping at step 6 on SIGTERM" in job.output
    assert f"resumed from {job.checkpoints / 'step_00000006'} at step 6" in job.output

    losses = tensorboard_losses(tmp_path / "stopped")
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))
    assert losses == tensorboard_losses(tmp_path / "reference")  # bitwise
    assert_same_weights(hf_weights(tmp_path / "stopped"), hf_weights(tmp_path / "reference"))
