"""docs/cluster.md's commands, as far as a machine without GPUs or SLURM goes: its `bash` blocks
(the dry run, the plan, verify) run exactly as the page writes them, with the names of its
settings block; its `shell` blocks (install, probe, submit, follow, TensorBoard) name only
commands and options that exist."""

import os
import re
import subprocess
import sys

import pytest
from runbook import fenced, run_blocks
from slurm_helpers import REPO

PAGE = REPO / "docs" / "cluster.md"


def settings() -> dict[str, str]:
    """The settings block's names and values, as the page sets them."""
    block = next(block for block in fenced(PAGE, "sh") if "CONFIG=" in block)
    return dict(re.findall(r"^([A-Z_]+)=(\S+)", block, re.M))


@pytest.mark.slow
def test_the_cluster_runbooks_cluster_only_commands_exist():
    commands = subprocess.run(
        [sys.executable, "-m", "slurm_autosp", "--help"], cwd=REPO, capture_output=True, text=True
    ).stdout
    offered = set(re.findall(r"^  ([a-z-]+) ", commands, re.M))
    shell = "\n".join(fenced(PAGE, "shell"))
    named = set(re.findall(r"python -m slurm_autosp (\w[\w-]*)", shell))
    assert named and named <= offered, f"{named - offered} are not commands: {commands}"
    install = (REPO / "install.sh").read_text()
    for option in set(re.findall(r"\./install\.sh (?:.*?)(--[a-z-]+)", shell)):
        assert option in install, f"install.sh has no {option}"
    assert "python -m slurm_autosp.submit" in shell


@pytest.mark.slow
def test_the_cluster_runbook_dry_runs_plans_and_verifies_without_a_gpu(tmp_path):
    names = settings()
    assert set(names) == {"CONFIG", "RUNS", "PARTITION", "ACCOUNT", "QOS"}
    env = {**os.environ, **names, "RUNS": str(tmp_path / "runs")}
    commands = fenced(PAGE, "bash")
    assert len(commands) == 3, "the dry run, the plan and verify are fenced as ```bash"
    outputs = run_blocks(commands, env)

    dry_run, plan, verify = outputs
    for line in ("--partition=gpu", "--account=my_project", "--qos=normal", "--nodes=8"):
        assert f"#SBATCH {line}\n" in dry_run
    assert "world_size 64 = sp 8 x dp 8" in dry_run
    assert "# dry run: nothing submitted (64 ranks, backend slurm)" in dry_run
    page = PAGE.read_text()
    verdict = re.search(r"^verdict: .*$", plan, re.M)
    assert verdict and f"    {verdict.group(0)}\n" in page, "the page quotes the plan's verdict"
    assert "PASS: AutoSP sp_size=2 matches single-device fp32 training" in verify
