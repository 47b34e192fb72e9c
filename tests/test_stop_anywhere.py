"""A stop where `cluster.stop_at` is null, end to end on local processes, the signal sent to
every process of the job step as SLURM sends it: in a step that turned out longer than the
threshold, every rank stops at a layer boundary, saves and requeues, and the requeued job
resumes from the step before. The other moments of a job: test_fault_matrix.py."""

import re
import signal
import sys
import time
from pathlib import Path

import pytest
from local_job import Job, gone, signal_job_step

HANG_S = 120  # a stop that takes longer hangs
SIGNAL_DELAY_S = 16
LONG_STEP_S = 4  # a quarter of the signal delay


def submit(root: Path, name: str, *overrides: str) -> Job:
    cmd = [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=local",
        f"run.output_root={root}",
        f"run.name={name}",
        "train.log_every=1",
        "train.start_check=false",
        *overrides,
    ]
    return Job(cmd, root / name)


def stop_job_step(job: Job, signum: signal.Signals) -> tuple[set[int], float]:
    """`signum` to every process of the job step; returns the ranks and when it was sent."""
    ranks = job.ranks()
    assert len(ranks) == 2, job.output
    signal_job_step(ranks, signum)
    return ranks, time.monotonic()


@pytest.mark.slow
def test_a_null_stop_at_stops_at_a_layer_once_a_measured_step_is_long(tmp_path):
    """No plan (CPU ranks), cluster.stop_at null, a signal delay of 16 s (so steps of 4 s are
    long), steps of 8 layers at 8k tokens: step 2 measures long, so USR2 a third into step 3
    stops it at a layer boundary, not at its end."""
    job = submit(
        tmp_path,
        "long",
        f"cluster.signal_delay_s={SIGNAL_DELAY_S}",
        "model.num_hidden_layers=8",
        "data.seq_len=8192",
        "train.micro_batch=1",
        "train.steps=3",
    )
    logged = r"step 2/3 \|.*\| ([\d.]+) s/step"
    job.wait_for("step 2", lambda: re.search(logged, job.output), timeout=900)
    match = re.search(logged, job.output)
    assert match is not None
    step_s = float(match.group(1))
    assert step_s > LONG_STEP_S, f"steps of {step_s} s: this test needs steps over {LONG_STEP_S} s"
    time.sleep(step_s / 3)
    ranks, sent = stop_job_step(job, signal.SIGUSR2)
    job.wait_for("the ranks exited", lambda: gone(ranks), timeout=step_s + HANG_S)
    exited_s = time.monotonic() - sent
    print(f"ranks exited {exited_s:.2f} s after USR2; steps of {step_s} s")
    job.finish(timeout=900)
    long = (
        f"step 2 took over {LONG_STEP_S:g} s: a stop signal ends a step at its next layer boundary"
    )
    assert long in job.output
    assert exited_s < step_s / 2, f"{exited_s:.1f} s after USR2: the step ran to its end"
    assert "step 3 abandoned at a layer boundary" in job.output
    assert "stopping at step 2 on SIGUSR2" in job.output
    assert f"resumed from {job.checkpoints / 'step_00000002'} at step 2" in job.output
