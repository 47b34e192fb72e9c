"""One live job per run directory; a crashed job's lock does not block the run forever."""

import os
import subprocess

import pytest

from slurm_autosp.checkpoint.lock import live_holder, release_lock, write_lock
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.submit import prepare_run_dir


def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_second_live_job_on_the_same_run_is_refused_naming_the_holder(tmp_path):
    cfg = load_config([f"run.output_root={tmp_path}", "run.name=busy"])
    cfg.run.dir.mkdir(parents=True)
    write_lock(cfg.run.dir, str(os.getpid()), "local")
    with pytest.raises(
        ConfigError, match=rf"run\.name=busy: .*busy is being trained by job {os.getpid()} \(local"
    ):
        prepare_run_dir(cfg)


def test_lock_of_a_job_that_died_is_taken_over(tmp_path):
    cfg = load_config([f"run.output_root={tmp_path}", "run.name=crashed"])
    cfg.run.dir.mkdir(parents=True)
    write_lock(cfg.run.dir, str(dead_pid()), "local")
    assert live_holder(cfg.run.dir) is None
    prepare_run_dir(cfg)
    assert (cfg.run.dir / "config.yaml").exists()


def test_only_the_holder_releases_the_lock(tmp_path):
    write_lock(tmp_path, "41", "slurm")
    release_lock(tmp_path, "42")
    assert (tmp_path / "job.lock").exists()
    release_lock(tmp_path, "41")
    assert not (tmp_path / "job.lock").exists()
