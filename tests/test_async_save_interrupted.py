"""Asynchronous saves interrupted, end to end on local processes against the reference run:
SLURM's pre-timeout signal (USR2) while a save is being written abandons it atomically and the
signal's own save follows; kill -9 of every rank while a save is being written leaves the
previous checkpoint as the one the next job resumes from, and nothing partial is read. Each
save is held in flight by stopping its writer processes (SIGSTOP), so the interruption lands
during the write, not before or after it."""

import os
import re
import signal
import subprocess
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

    # USR2 while step 30's save is written: abandoned; the signal's save follows and resumes
    writers, in_flight = job.hold_next_save(EVERY)
    subprocess.run(
        ["pkill", f"-{signal.SIGUSR2.name}", "-f", f"submitit.core._submit {job.folder}"],
        check=True,
    )
    job.wait_for("the requeued job resumed", lambda: "resumed from" in job.output)
    [stopped] = {int(s) for s in re.findall(r"stopping at step (\d+) on SIGUSR2", job.output)}
    assert in_flight <= stopped < in_flight + EVERY
    assert f"abandoning the asynchronous save of step {in_flight}, not yet written" in job.output
    assert gone(writers)
    assert not (job.checkpoints / f".step_{in_flight:08d}.partial").exists()
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
