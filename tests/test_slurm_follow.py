"""On SLURM, submit returns once the job is queued; status --follow re-attaches, asking the
scheduler at most every 30 s; Ctrl-C while following detaches and leaves the job running."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from slurm_helpers import REPO, job_state

from slurm_autosp.launch.watch import SCHEDULER_POLL_S

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def submit(tmp_path, *overrides):
    return [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=slurm",
        f"run.output_root={tmp_path}",
        *overrides,
    ]


@pytest.fixture
def counted_squeue(tmp_path):
    """PATH with an squeue that records each call and then runs the real one."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "squeue_calls"
    bin_dir.mkdir()
    real = subprocess.run(["which", "squeue"], capture_output=True, text=True).stdout.strip()
    (bin_dir / "squeue").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {real} "$@"\n')
    (bin_dir / "squeue").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return env, lambda: len(calls.read_text().splitlines()) if calls.exists() else 0


def test_submit_returns_once_queued_status_follow_reattaches_and_the_run_completes(
    tmp_path, counted_squeue
):
    """tiny_cpu on 4 ranks through sbatch: submit returns while the job runs, status --follow
    streams it to its end, and the run directory holds every rank's log, the config, the last
    checkpoint, the exported model and TensorBoard's files."""
    env, squeue_calls = counted_squeue
    run_dir = tmp_path / "tiny_cpu"
    started = time.monotonic()
    proc = subprocess.run(
        submit(tmp_path, "cluster.tasks_per_node=4", "train.steps=10", "train.log_every=1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = re.search(r"submitted job (\d+) \(slurm, 4 ranks", proc.stdout).group(1)
    assert job_state(job_id) in ("PENDING", "RUNNING"), proc.stdout  # returned while it runs
    assert f"per-rank logs in {run_dir / 'submitit'}" in proc.stdout
    assert "step 1/10" not in proc.stdout
    for hint in (
        f"follow:      python -m slurm_autosp status {run_dir} --follow",
        f"rank 0 log:  {run_dir / 'submitit' / f'{job_id}_0_log.out'}",
        f"cancel:      scancel {job_id}",
        f"TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}",
    ):
        assert hint in proc.stdout, proc.stdout
    before = squeue_calls()
    following = time.monotonic()
    followed = subprocess.run(
        [sys.executable, "-m", "slurm_autosp", "status", str(run_dir), "--follow"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    seconds = time.monotonic() - following
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert f"running: job {job_id} (slurm" in followed.stdout
    assert "step 10/10" in followed.stdout and f"job {job_id} finished" in followed.stdout
    # the status line's lock check, then at most one query per interval while following
    assert squeue_calls() - before <= 2 + seconds / SCHEDULER_POLL_S, (seconds, squeue_calls())
    assert time.monotonic() - started < 600
    assert len(list((run_dir / "submitit").glob(f"{job_id}_*_log.out"))) == 4
    assert (run_dir / "config.yaml").exists()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000010"
    assert (run_dir / "hf" / "model.safetensors").exists()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_ctrl_c_while_following_a_slurm_job_detaches_and_the_job_runs_on(tmp_path):
    proc = subprocess.Popen(
        submit(tmp_path, "follow=true", "train.steps=5000"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as a terminal starts it: pytest started in the background (`cmd &`) ignores SIGINT,
        # and its children would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    job_id = None
    for line in proc.stdout:
        if job_id is not None:
            break  # the first line of rank 0's log: submit is following the running job
        if m := re.search(r"submitted job (\d+)", line):
            job_id = m.group(1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    try:
        assert proc.returncode == 0, out + err
        assert f"detached: job {job_id} keeps running" in out and f"scancel {job_id}" in out
        assert job_state(job_id) == "RUNNING"
    finally:
        subprocess.run(["scancel", "--signal=KILL", job_id])  # no save: the job ends now
        subprocess.run(["scancel", job_id])
        deadline = time.monotonic() + 120
        while job_state(job_id) and time.monotonic() < deadline:
            time.sleep(1)
