"""The hand-submittable sbatch script stays consistent with what submit generates, and runs."""

import os
import re
import socket
import subprocess
import time

import pytest
from in_process import run_command
from slurm_helpers import REPO, job_state

from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.config import ClusterConfig, ConfigError, load_config
from slurm_autosp.launch.executor import sbatch_script
from slurm_autosp.lifecycle.lock import RunLock, acquire_lock, read_lock

SCRIPT = (REPO / "sbatch" / "train.sbatch").read_text()


def directives(text):
    return {
        m.group(1): m.group(2) for m in re.finditer(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M)
    }


@pytest.fixture(scope="module")
def generated():
    cfg = load_config(["cfg=configs/llama8b_32k.yaml", "cluster.backend=slurm"])
    return sbatch_script(cfg)


def test_signal_requeue_and_log_options_match_submit(generated):
    ours, theirs = directives(SCRIPT), directives(generated)
    for option in ("signal", "requeue", "open-mode"):
        assert ours[option] == theirs[option], option
    assert ours["signal"] == f"USR2@{ClusterConfig().signal_delay_s}"


def test_both_end_every_rank_when_one_fails(generated):
    for script in (SCRIPT, generated):
        srun = next(line for line in script.splitlines() if line.startswith("srun "))
        assert " --kill-on-bad-exit=1 " in srun, srun


def test_a_kill_on_bad_exit_of_the_users_own_wins():
    cfg = load_config(
        ["cfg=configs/llama8b_32k.yaml", "cluster.backend=slurm", "cluster.srun_args=[-K0]"]
    )
    srun = next(line for line in sbatch_script(cfg).splitlines() if line.startswith("srun "))
    assert " -K0 " in srun and "--kill-on-bad-exit" not in srun, srun


def dry_run(tmp_path, *overrides):
    return run_command(
        submit_main,
        "dry_run=true",
        "cluster.backend=slurm",
        f"run.output_root={tmp_path}",
        *overrides,
    )


def test_sbatch_extra_cannot_replace_the_signal_a_jobs_stops_depend_on(tmp_path):
    """`B:USR2@300` would signal the batch shell alone, never the ranks, while admission still
    holds cluster.signal_delay_s to a stop and a save: refused before anything starts."""
    refused = dry_run(tmp_path, "cluster.sbatch_extra.signal=B:USR2@300")
    assert refused.returncode == 2, refused.stderr
    assert (
        "cluster.sbatch_extra.signal: the launcher sets #SBATCH --signal itself and the job "
        "depends on it (every rank stops and saves on USR2"
    ) in refused.stderr
    assert "remove it and set cluster.signal_delay_s instead" in refused.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_an_unrelated_sbatch_extra_option_goes_into_the_script(tmp_path):
    passed = dry_run(tmp_path, "cluster.sbatch_extra.constraint=a100")
    assert passed.returncode == 0, passed.stderr
    assert "#SBATCH --constraint=a100" in passed.stdout


@pytest.mark.parametrize(
    ("key", "option", "fix"),
    [
        ("time", "time", "cluster.time_min"),
        ("no_requeue", "no-requeue", "cluster.max_requeues=0"),
        ("ntasks-per-node", "ntasks-per-node", "cluster.gpus_per_node"),
        ("open-mode", "open-mode", "let every start append"),
        ("output", "output", "run.output_root and run.name"),
        ("sig", "signal", "cluster.signal_delay_s"),  # sbatch reads --sig as --signal
    ],
)
def test_each_option_the_launcher_sets_for_stops_and_logs_is_refused_naming_the_fix(
    key, option, fix
):
    with pytest.raises(ConfigError) as err:
        load_config([f"cluster.sbatch_extra.{key}=x"])
    assert f"cluster.sbatch_extra.{key}: the launcher sets #SBATCH --{option} itself" in str(
        err.value
    )
    assert fix in str(err.value)


def test_resource_defaults_match_the_shipped_8_gpu_profile(generated):
    ours, theirs = directives(SCRIPT), directives(generated)
    for option in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task"):
        assert ours[option] == theirs[option], option


def test_both_run_every_task_through_srun_into_the_same_training_job(generated):
    assert (
        "export SUBMITIT_EXECUTOR=slurm" in SCRIPT and "export SUBMITIT_EXECUTOR=slurm" in generated
    )
    assert re.search(r"^srun --unbuffered .*-m slurm_autosp run \"\$@\"$", SCRIPT, re.M)
    assert re.search(r"^srun --unbuffered .*-m submitit\.core\._submit ", generated, re.M)
    run_module = (REPO / "slurm_autosp" / "commands" / "run.py").read_text()
    assert "TrainingJob(cfg, LockClaim(" in run_module


def sbatch_train(tmp_path, *overrides, timeout_s=300):
    """Submit sbatch/train.sbatch for 2 CPU tasks, wait for the job to end; its output."""
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={REPO}",
            "--ntasks-per-node=2",
            "--gpus-per-node=0",
            "--cpus-per-task=1",
            "--time=10",
            f"--output={tmp_path}/slurm-%j.out",
            str(REPO / "sbatch" / "train.sbatch"),
            "cfg=configs/tiny_cpu.yaml",
            f"run.output_root={tmp_path}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s
    while job_state(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    still = job_state(job_id)
    if still:
        subprocess.run(["scancel", job_id])
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert not still, f"job {job_id} still {still} after {timeout_s} s:\n{log}"
    return log


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_hand_submitted_script_trains_on_slurm(tmp_path):
    log = sbatch_train(tmp_path, "train.steps=4")
    assert "step 4/4" in log, log
    assert (tmp_path / "tiny_cpu" / "checkpoints" / "latest").read_text() == "step_00000004"
    assert (tmp_path / "tiny_cpu" / "hf" / "model.safetensors").exists()
    assert not (tmp_path / "tiny_cpu" / "job.lock").exists()  # released at the end


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_every_rank_of_a_hand_submitted_job_exits_when_its_run_is_held(tmp_path):
    """Rank 0 cannot take the run: no rank waits for it in the process group's rendezvous."""
    run_dir = tmp_path / "tiny_cpu"
    run_dir.mkdir()
    holder = RunLock(str(os.getpid()), "local", socket.gethostname())  # this test: alive
    acquire_lock(run_dir, holder)
    log = sbatch_train(tmp_path, "train.steps=4", timeout_s=240)
    refusal = f"error: run.name=tiny_cpu: {run_dir} is being trained by {holder.describe()}"
    assert log.count(refusal) == 2, log  # both ranks
    assert "step 1/4" not in log
    assert not (run_dir / "config.yaml").exists()
    assert read_lock(run_dir) == holder
