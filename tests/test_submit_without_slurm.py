"""Without Slurm a dry run still renders the sbatch script, and a SLURM submit fails naming the key."""

import os
import shutil
import sys
from pathlib import Path

import pytest
from in_process import run_command

from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.config import Backend, load_config
from slurm_autosp.launch.executor import build_executor, sbatch_script

NO_SLURM_PATH = str(
    Path(sys.executable).parent
)  # the interpreter alone: Slurm may be in /usr/bin (the Slurm tests install it)


@pytest.fixture
def submit_without_slurm(monkeypatch):
    """submit's command, run with a PATH that holds no Slurm tool."""
    monkeypatch.setenv("PATH", NO_SLURM_PATH)
    assert shutil.which("srun") is None and shutil.which("sbatch") is None
    return lambda *args: run_command(submit_main, *args)


def test_dry_run_renders_the_sbatch_script_without_slurm(tmp_path, submit_without_slurm):
    proc = submit_without_slurm(
        "cfg=configs/llama70b_128k.yaml", "dry_run=true", f"run.output_root={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["# sbatch script (submitit would submit exactly this)", "#!/bin/bash"]
    assert f"#SBATCH --output={tmp_path}/llama70b_128k/submitit/%j_0_log.out" in lines
    assert "#SBATCH --nodes=8" in lines and "#SBATCH --job-name=llama70b_128k" in lines
    assert "export SUBMITIT_EXECUTOR=slurm" in lines
    assert any(
        line.startswith("srun --unbuffered --output ") and "-m submitit.core._submit" in line
        for line in lines
    )
    assert "# dry run: nothing submitted (64 ranks, backend slurm)" in lines
    assert list(tmp_path.iterdir()) == []


def test_slurm_submit_without_slurm_fails_naming_the_backend_before_writing_anything(
    tmp_path, submit_without_slurm
):
    proc = submit_without_slurm(
        "cfg=configs/tiny_cpu.yaml", "cluster.backend=slurm", f"run.output_root={tmp_path}"
    )
    assert proc.returncode == 2, proc.stderr
    assert "error: cluster.backend=slurm: sbatch and srun not found on PATH" in proc.stderr, (
        proc.stderr
    )
    assert "run on a login node of the cluster, or use cluster.backend=local" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def stub_slurm_tools(tmp_path, monkeypatch):
    """sbatch and srun that only exist: submitit builds its SLURM executor, nothing is submitted."""
    for tool in ("sbatch", "srun"):
        stub = tmp_path / "bin" / tool
        stub.parent.mkdir(exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 1\n")
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{NO_SLURM_PATH}")


@pytest.mark.usefixtures("stub_slurm_tools")
def test_dry_run_script_is_the_one_the_slurm_executor_submits(tmp_path):
    cfg = load_config(
        [
            "cfg=configs/llama70b_128k.yaml",
            f"run.output_root={tmp_path}",
            "cluster.mem_gb=480",
            "cluster.partition=gpu",
            "cluster.account=proj",
            "cluster.exclusive=true",
            "cluster.container_image=nvcr.io/nvidia/pytorch:24.05-py3",
        ]
    )
    slurm = build_executor(cfg, Backend.slurm)._executor
    submitted = slurm._make_submission_file_text(slurm._submitit_command_str, uid="job")
    assert sbatch_script(cfg) == submitted
    assert "#SBATCH --mem=480GB" in submitted and "#SBATCH --partition=gpu" in submitted
    assert "--container-image=nvcr.io/nvidia/pytorch:24.05-py3" in submitted
