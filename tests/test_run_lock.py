"""One live job per run directory, taken atomically; a crashed job's lock does not block the
run forever, and a holder that cannot be checked blocks it until --force."""

import multiprocessing
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from in_process import run_command

from slurm_autosp.cluster.scheduler import Liveness
from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.lifecycle.lock import (
    SUBMITTING,
    RunLock,
    acquire_lock,
    holder_liveness,
    read_lock,
    release_lock,
    superseded,
)
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.run_setup import prepare_run_dir

HOST = socket.gethostname()


def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return str(proc.pid)


def local(job_id, host=HOST):
    return RunLock(job_id, "local", host)


def run_config(tmp_path, name):
    cfg = load_config([f"run.output_root={tmp_path}", f"run.name={name}"])
    cfg.run.dir.mkdir(parents=True)
    return cfg


@pytest.fixture
def controller_down(tmp_path, monkeypatch):
    """A SLURM controller that does not answer: squeue (where installed) cannot reach it."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=down\nSlurmctldHost=localhost\nSlurmctldPort=1\nMessageTimeout=1\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(conf))


def test_second_live_job_on_the_same_run_is_refused_and_nothing_is_written(tmp_path):
    cfg = run_config(tmp_path, "busy")
    acquire_lock(cfg.run.dir, local(str(os.getpid())))
    with pytest.raises(
        ConfigError, match=rf"run\.name=busy: .*busy is being trained by job {os.getpid()} \(local"
    ):
        prepare_run_dir(cfg, local("1"))
    assert not (cfg.run.dir / "config.yaml").exists()


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_before_anything_is_written(
    tmp_path,
):
    cfg = run_config(tmp_path, "blocked")
    (cfg.run.dir / "checkpoints").write_text("a file where the checkpoint directory should be")
    with pytest.raises(
        ConfigError,
        match=rf"run\.output_root={tmp_path}: checkpoint directory .*blocked/checkpoints is not "
        "writable .*choose a writable run.output_root",
    ):
        prepare_run_dir(cfg, local(str(os.getpid())))
    assert read_lock(cfg.run.dir) is None and not (cfg.run.dir / "config.yaml").exists()


def test_a_checkpoint_directory_every_user_can_write_is_refused_naming_the_fix(tmp_path):
    cfg = run_config(tmp_path, "shared")
    (cfg.run.dir / "checkpoints").mkdir(mode=0o777)
    (cfg.run.dir / "checkpoints").chmod(0o777)
    with pytest.raises(
        ConfigError, match=r"writable by every user.*chmod o-w .*shared/checkpoints"
    ):
        prepare_run_dir(cfg, local(str(os.getpid())))
    assert read_lock(cfg.run.dir) is None
    (cfg.run.dir / "checkpoints").chmod(0o755)
    prepare_run_dir(cfg, local(str(os.getpid())))
    assert (cfg.run.dir / "config.yaml").exists()


def test_lock_of_a_job_that_died_is_taken_over(tmp_path):
    cfg = run_config(tmp_path, "crashed")
    acquire_lock(cfg.run.dir, local(dead_pid()))
    assert holder_liveness(read_lock(cfg.run.dir))[0] is Liveness.gone
    prepare_run_dir(cfg, local(str(os.getpid())))
    assert (cfg.run.dir / "config.yaml").exists()
    assert read_lock(cfg.run.dir) == local(str(os.getpid()))


def test_a_slurm_job_that_cannot_be_checked_counts_as_alive_until_forced(tmp_path, controller_down):
    acquire_lock(tmp_path, RunLock("41", "slurm", "login1"))
    liveness, why = holder_liveness(read_lock(tmp_path))
    assert liveness is Liveness.unknown and why.startswith("squeue failed")
    with pytest.raises(
        ConfigError,
        match=r"locked by job 41 \(slurm on login1\), which cannot be checked \(squeue failed.*--force",
    ):
        acquire_lock(tmp_path, RunLock("42", "slurm", "login1"))
    assert read_lock(tmp_path).job_id == "41"
    acquire_lock(tmp_path, RunLock("42", "slurm", "login1"), force=True)
    assert read_lock(tmp_path).job_id == "42"


def test_a_local_job_on_another_host_cannot_be_checked_from_here(tmp_path):
    acquire_lock(tmp_path, local("7", host="elsewhere"))
    with pytest.raises(ConfigError, match=r"job 7 \(local on elsewhere\), which cannot be checked"):
        acquire_lock(tmp_path, local("8"))


def test_a_lock_that_is_not_ours_is_refused_by_name_until_forced(tmp_path):
    lock = RunDir(tmp_path).lock
    lock.write_text("not json")
    with pytest.raises(ConfigError, match=rf"{lock} is not a lock this tool wrote"):
        acquire_lock(tmp_path, local("8"))
    acquire_lock(tmp_path, local("8"), force=True)
    assert read_lock(tmp_path) == local("8")


def test_the_submission_hands_its_lock_to_the_job_and_requeues_keep_it(tmp_path):
    submission = RunLock(str(os.getpid()), SUBMITTING, HOST)
    acquire_lock(tmp_path, submission)
    with pytest.raises(ConfigError, match="a submission in progress"):
        acquire_lock(tmp_path, RunLock("77", "slurm", HOST))  # another job: refused
    job = RunLock("77", "slurm", HOST)
    acquire_lock(tmp_path, job, handed_over_by=submission)
    assert read_lock(tmp_path) == job
    acquire_lock(tmp_path, job)  # the requeued job takes what it holds
    assert read_lock(tmp_path) == job
    # no temporary files left
    assert [p.name for p in tmp_path.iterdir()] == [RunDir(tmp_path).lock.name]


def test_only_the_holder_releases_the_lock(tmp_path):
    acquire_lock(tmp_path, RunLock("41", "slurm", HOST))
    release_lock(tmp_path, RunLock("42", "slurm", HOST))
    release_lock(tmp_path, local("41"))  # a process whose id is the job's number
    assert RunDir(tmp_path).lock.exists()
    release_lock(tmp_path, RunLock("41", "slurm", "node7"))  # the job, requeued elsewhere
    assert not RunDir(tmp_path).lock.exists()


def test_a_process_whose_id_equals_a_slurm_job_id_does_not_take_its_run(tmp_path, controller_down):
    """The lock's holder is matched by backend, host and id, not by the number alone: the
    Slurm job (which cannot be checked, so counts as alive) keeps its run."""
    job = RunLock(str(os.getpid()), "slurm", "login1")
    acquire_lock(tmp_path, job)
    for same_number in (
        local(str(os.getpid())),
        RunLock(str(os.getpid()), SUBMITTING, HOST),
    ):
        with pytest.raises(ConfigError, match=rf"locked by job {os.getpid()} \(slurm on login1"):
            acquire_lock(tmp_path, same_number)
        with pytest.raises(ConfigError, match="cannot be checked"):
            acquire_lock(tmp_path, RunLock("99", "slurm", HOST), handed_over_by=same_number)
    assert read_lock(tmp_path) == job
    requeued = RunLock(str(os.getpid()), "slurm", "node7")
    acquire_lock(tmp_path, requeued)  # the job itself, on another node after a requeue
    assert read_lock(tmp_path) == requeued


def test_a_local_job_of_another_host_is_not_this_hosts_process_of_the_same_id(tmp_path):
    acquire_lock(tmp_path, local(str(os.getpid()), host="elsewhere"))
    with pytest.raises(ConfigError, match="cannot be checked"):
        acquire_lock(tmp_path, local(str(os.getpid())))


def test_a_takeover_claim_left_by_a_taker_that_died_does_not_block_the_run(tmp_path):
    acquire_lock(tmp_path, local(dead_pid()))
    stale = RunDir(tmp_path).lock.stat()
    claim = RunDir(tmp_path).lock_takeover(stale.st_ino, stale.st_mtime_ns)
    claim.write_text("")
    os.utime(claim, (time.time() - 120, time.time() - 120))
    acquire_lock(tmp_path, local("9"))
    assert read_lock(tmp_path) == local("9")
    assert [p.name for p in tmp_path.iterdir()] == [RunDir(tmp_path).lock.name]


def _race(run_dir, start, job_id, wins):
    start.wait()
    try:
        acquire_lock(Path(run_dir), local(job_id, host="elsewhere"))
        wins.put(job_id)
    except ConfigError:
        pass


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_of_many_jobs_racing_for_a_run_exactly_one_takes_it(tmp_path, stale):
    if stale:
        acquire_lock(tmp_path, local(dead_pid()))
    context = multiprocessing.get_context("fork")
    start, wins = context.Barrier(8), context.Queue()
    racers = [
        context.Process(target=_race, args=(str(tmp_path), start, str(1000 + i), wins))
        for i in range(8)
    ]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=60)
    winners = []
    while not wins.empty():
        winners.append(wins.get())
    assert len(winners) == 1, winners
    assert read_lock(tmp_path).job_id == winners[0]


def test_submit_refuses_a_run_whose_holder_cannot_be_checked_and_names_force(tmp_path):
    cfg = run_config(tmp_path, "held")
    acquire_lock(cfg.run.dir, local("7", host="elsewhere"))
    proc = run_command(
        submit_main, "cfg=configs/tiny_cpu.yaml", f"run.output_root={tmp_path}", "run.name=held"
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run.name=held" in proc.stderr and "add --force to take the run over" in proc.stderr
    assert not (cfg.run.dir / "config.yaml").exists()
    assert read_lock(cfg.run.dir) == local("7", host="elsewhere")


@pytest.mark.slow
def test_a_later_start_of_the_same_job_fences_the_earlier_one(tmp_path):
    """SLURM requeued job 41 (restart 1) while its first start still ran, on a node it lost:
    the later start takes the lock; the earlier one is told why it may not write, and cannot
    take the lock back."""
    first, second = RunLock("41", "slurm", "node1", 0), RunLock("41", "slurm", "node2", 1)
    acquire_lock(tmp_path, first)
    assert superseded(tmp_path, first) == ""
    acquire_lock(tmp_path, second)
    assert read_lock(tmp_path) == second
    why = (
        "SLURM started job 41 again (restart 1) while this start (restart 0) still ran; that "
        "start trains the run now"
    )
    assert superseded(tmp_path, first) == why
    assert superseded(tmp_path, second) == ""
    with pytest.raises(ConfigError, match=r"started job 41 again \(restart 1\)"):
        acquire_lock(tmp_path, first)
    assert read_lock(tmp_path) == second
    # another job holding the run (taken with --force) fences it too
    acquire_lock(tmp_path, RunLock("42", "slurm", "node3"), force=True)
    assert (
        superseded(tmp_path, second)
        == f"{RunDir(tmp_path).lock} names job 42 (slurm on node3), not this job"
    )


def test_a_job_whose_lock_is_gone_no_longer_holds_the_run(tmp_path):
    """A job claims the lock before it writes; a lock removed since (by hand, or by another job
    taking the run over) fences it, rather than reading as "nobody says otherwise"."""
    job = RunLock("41", "slurm", "node1")
    acquire_lock(tmp_path, job)
    RunDir(tmp_path).lock.unlink()
    assert superseded(tmp_path, job) == (
        f"{RunDir(tmp_path).lock} is gone: this job no longer holds the run (the lock was "
        "removed, or another job is taking the run over)"
    )


def test_an_earlier_start_ending_leaves_the_later_starts_lock(tmp_path):
    """SLURM requeued job 41 while its first start still ran: the first start finishing (or
    failing) must not unlock the run under the start that trains it now."""
    first, second = RunLock("41", "slurm", "node1", 0), RunLock("41", "slurm", "node2", 1)
    acquire_lock(tmp_path, first)
    acquire_lock(tmp_path, second)
    release_lock(tmp_path, first)
    assert read_lock(tmp_path) == second
    release_lock(tmp_path, second)
    assert read_lock(tmp_path) is None
