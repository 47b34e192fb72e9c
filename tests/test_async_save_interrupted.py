"""Asynchronous saves interrupted, end to end on local processes against the reference run:
SLURM's pre-timeout signal (USR2) while a save is being written waits for it (nothing says
when the kill comes), commits it, and the signal's own save follows; kill -9 of every rank
while a save is being written leaves the previous checkpoint as the one the next job resumes
from, and nothing partial is read. Each save is held in flight by stopping its writer
processes (SIGSTOP), so the interruption lands during the write, not before or after it.
On the tiny config: a signal to every process of the job step while the writers start, and
the last step's save while the previous one is still being written."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_job import Job, gone
from reference_run import REFERENCE_STEPS, assert_same_weights, hf_weights, reference_cmd
from slurm_helpers import final_result
from test_async_save import writers_of

EVERY = 15  # steps between saves: a signal sent while one is written lands before the next


class Interrupted(Job):
    """`submit` of the reference run on local processes, into root/interrupted."""

    def __init__(self, root: Path, *overrides: str):
        super().__init__(reference_cmd(root, "interrupted", overrides), root / "interrupted")

    def hold_next_save(self, committed: int) -> tuple[list[int], int]:
        """Once step `committed`'s save is the latest checkpoint, stop every rank's writer;
        returns them and the step of the next save, once that one is in flight."""
        self.wait_for(f"step {committed} saved", lambda: self.latest() == f"step_{committed:08d}")
        writers = writers_of(self.ranks())
        assert len(writers) == 2, self.output
        for writer in writers:
            os.kill(writer, signal.SIGSTOP)
        following = committed + EVERY
        partial = self.checkpoints / f".step_{following:08d}.partial"
        self.wait_for(f"step {following} in flight", partial.is_dir)
        return writers, following


@pytest.mark.slow
def test_saves_in_flight_at_a_signal_or_a_kill_are_never_resumed_from_and_the_run_ends_exact(
    tmp_path, uninterrupted_run, reference_overrides
):
    overrides = (*reference_overrides, f"checkpoint.every_steps={EVERY}", "cluster.max_requeues=1")
    job = Interrupted(tmp_path, *overrides)

    # USR2 while step 30's save is written: waited for and committed; the signal's save
    # follows and resumes
    writers, in_flight = job.hold_next_save(EVERY)
    subprocess.run(
        ["pkill", f"-{signal.SIGUSR2.name}", "-f", f"submitit.core._submit {job.folder}"],
        check=True,
    )
    waits = f"waits for the asynchronous save of step {in_flight}, still being written"
    job.wait_for("the signal's save waits", lambda: waits in job.output)
    for writer in writers:
        os.kill(writer, signal.SIGCONT)
    job.wait_for("the requeued job resumed", lambda: "resumed from" in job.output)
    [stopped] = {int(s) for s in re.findall(r"stopping at step (\d+) on SIGUSR2", job.output)}
    assert in_flight <= stopped < in_flight + EVERY
    assert f"checkpoint {job.checkpoints / f'step_{in_flight:08d}'} saved" in job.output
    assert "abandoning" not in job.output
    assert gone(writers)
    assert f"resumed from {job.checkpoints / f'step_{stopped:08d}'} at step {stopped}" in job.output

    # kill -9 of every rank while the requeued job's next save but one is written
    committed = (stopped // EVERY + 1) * EVERY
    writers, in_flight = job.hold_next_save(committed)
    ranks = job.ranks()
    for rank in ranks:
        os.kill(rank, signal.SIGKILL)
    job.proc.wait(timeout=120)
    assert job.proc.returncode != 0
    job.wait_for("the writers died with their ranks", lambda: gone(writers), timeout=30)
    assert job.latest() == f"step_{committed:08d}"

    again = Interrupted(tmp_path, *overrides)
    again.finish()
    partial = again.checkpoints / f".step_{in_flight:08d}.partial"
    assert f"removing {partial}, a save that never completed" in again.output
    assert f"resumed from {again.checkpoints / f'step_{committed:08d}'} at step {committed}" in (
        again.output
    )
    resumed = final_result(tmp_path / "interrupted")
    reference = final_result(uninterrupted_run)
    assert resumed.first_step == committed
    assert resumed.losses == reference.losses[committed:]  # bitwise
    assert len(reference.losses) == REFERENCE_STEPS
    assert_same_weights(hf_weights(tmp_path / "interrupted"), hf_weights(uninterrupted_run))


def tiny(root: Path, name: str, *overrides: str) -> Job:
    """`submit` of the tiny config on local processes into root/name."""
    cmd = [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=local",
        f"run.output_root={root}",
        f"run.name={name}",
        "train.start_check=false",
        *overrides,
    ]
    return Job(cmd, root / name)


def job_step(ranks: set[int]) -> set[int]:
    """The ranks and every process below them: what Slurm signals in a job step."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    step = set(ranks)
    while grown := {pid for pid, parent in parents.items() if parent in step} - step:
        step |= grown
    return step


@pytest.mark.slow
def test_a_signal_to_the_whole_job_step_while_its_writers_start_saves_and_requeues(tmp_path):
    """USR2 to every process of the job 0.3 s after the first save started its writers, still
    starting (importing torch): they write on, the ranks stop, save and requeue, and the
    requeued job resumes from the stop's save and ends."""
    job = tiny(tmp_path, "signalled", "train.steps=12", "checkpoint.every_steps=4")
    job.wait_for("the writers started", lambda: len(writers_of(job.ranks())) == 2)
    time.sleep(0.3)
    for pid in job_step(job.ranks()):
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            continue  # ended since it was listed
    job.finish()
    assert "the checkpoint writer died" not in job.output
    [stopped] = re.findall(r"stopping at step (\d+) on SIGUSR2", job.output)
    assert "requeueing (restart 1" in job.output
    resumed = job.checkpoints / f"step_{int(stopped):08d}"
    assert f"resumed from {resumed} at step {stopped}" in job.output
    assert job.latest() == "step_00000012"


@pytest.mark.slow
def test_the_last_steps_save_keeps_the_save_still_being_written(tmp_path):
    """Step 5's save is still being written when step 10, the last, is saved: waited for and
    committed, not thrown away; the run ends with both."""
    job = tiny(
        tmp_path,
        "ended",
        "train.steps=10",
        "checkpoint.every_steps=5",
        "checkpoint.keep=3",
    )
    job.finish()
    assert "abandoning" not in job.output
    assert sorted(p.name for p in job.checkpoints.glob("step_*")) == [
        "step_00000005",
        "step_00000010",
    ]
