"""launch.watch: what a terminal is told about a job that runs on without it."""

import shlex

import submitit

from slurm_autosp.launch.watch import next_steps
from slurm_autosp.lifecycle.run_dir import RunDir


def test_the_commands_to_follow_a_job_keep_a_run_name_with_spaces_hashes_and_quotes(tmp_path):
    run_dir = tmp_path / """exp #1 "a"'s"""
    job = submitit.LocalJob(RunDir(run_dir).submitit, "1234")
    lines = dict(line.strip().split(":", 1) for line in next_steps(job, run_dir).splitlines())
    assert shlex.split(lines["follow"]) == [
        "python",
        "-m",
        "slurm_autosp",
        "status",
        str(run_dir),
        "--follow",
    ]
    assert shlex.split(lines["status"])[-1] == str(run_dir)
    assert shlex.split(lines["rank 0 log"]) == [str(RunDir(run_dir).submitit / "1234_0_log.out")]
    assert shlex.split(lines["TensorBoard"]) == [
        "tensorboard",
        "--logdir",
        str(run_dir / "tensorboard"),
    ]
