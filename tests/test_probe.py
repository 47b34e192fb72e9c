"""The probe measures real numbers on the tiny CPU job (2 gloo ranks, SP=2), reports them
beside the plan, and the GPU check refuses clearly where no GPU is visible. The probe's run
takes about a minute on 2 cores, so the tests reading it are in the slow tier."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import run_command
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.probe.__main__ import main as probe_main
from slurm_autosp.probe.__main__ import probe_config

REPO = Path(__file__).resolve().parents[1]
# What the forward keeps for backward against the plan's activations and loss inputs: the plan
# counts the traced graphs' saved tensors, the run also keeps a few small ones (token ids, scalars).
HELD_TOLERANCE = 0.10


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_autosp.probe",
            "cfg=configs/tiny_cpu.yaml",
            "cluster.backend=local",
            f"run.output_root={root}",
            "probe.steps=4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, proc.stdout


@pytest.mark.slow
def test_probe_runs_in_its_own_run_directory_and_writes_probe_json(probe_run):
    root, _ = probe_run
    assert not (root / "tiny_cpu").exists()
    report = json.loads((root / "tiny_cpu_probe" / "probe.json").read_text())
    assert report["world_size"] == 2 and report["sp_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]


@pytest.mark.slow
def test_all_to_all_bandwidth_is_its_message_size_over_its_time(probe_run):
    root, _ = probe_run
    report = json.loads((root / "tiny_cpu_probe" / "probe.json").read_text())
    a2a = [c for c in report["collectives"] if c["collective"] == "all_to_all"]
    # q / out: micro_batch 2 x 4 heads x 128 tokens per rank x head_dim 16 x 4 bytes; k / v: 2 heads
    assert sorted(c["nbytes"] for c in a2a) == [2 * 2 * 128 * 16 * 4, 2 * 4 * 128 * 16 * 4]
    for c in a2a:
        assert c["seconds"] > 0 and c["latency_s"] > 0
        assert c["algbw_gb_per_s"] == pytest.approx(c["nbytes"] / c["seconds"] / 1e9)
        assert c["busbw_gb_per_s"] == pytest.approx(c["algbw_gb_per_s"] / 2)  # (n-1)/n at n=2
        assert c["nominal_gb_per_s"] is None and c["nominal_source"] == "no nominal: gloo on CPU"


@pytest.mark.slow
def test_steps_are_timed_and_memory_held_for_backward_matches_the_plan(probe_run):
    root, _ = probe_run
    report = json.loads((root / "tiny_cpu_probe" / "probe.json").read_text())
    for rank in report["ranks"]:
        assert len(rank["seconds"]) == 4 and rank["step_s"] > 0 and not rank["oom"]
        assert rank["compile_s"] > rank["step_s"]  # the first step compiles
        assert rank["peak_bytes"] >= rank["start_bytes"] > 0
    held = next(row for row in report["memory"] if row["term"] == "held for backward")
    assert held["judged"] and abs(held["error"]) <= HELD_TOLERANCE, held
    assert report["verdict"]["plan_within"] is True
    assert report["verdict"]["bandwidth_within"] is None  # no nominal figure for gloo


@pytest.mark.slow
def test_table_and_verdict_reach_the_terminal_and_tensorboard(probe_run):
    root, stdout = probe_run
    assert "collectives (the slowest rank" in stdout and "steps per rank" in stdout, stdout
    verdict = next(line for line in stdout.splitlines() if line.startswith("verdict: "))
    assert "plan within ±10%: yes" in verdict and "slowest rank: " in verdict, verdict
    events = EventAccumulator(str(root / "tiny_cpu_probe" / "tensorboard"))
    events.Reload()
    assert {"probe/step_s", "probe/busbw_gb_per_s/all_to_all_q_attention_out"} <= set(
        events.Tags()["scalars"]
    )


NAME = 'exp #1 "a"=b'  # a YAML comment, quotes and '=': each cut a name read again as key=value


def test_the_probe_runs_under_the_whole_run_name_and_its_own_depth(tmp_path):
    cfg = load_config(
        ["cfg=configs/tiny_cpu.yaml", f"run.name='{NAME}'", f"run.output_root={tmp_path}"]
    )
    probe = probe_config(cfg)
    assert probe.run.name == f"{NAME}_probe" and probe.run.dir == tmp_path / f"{NAME}_probe"
    assert probe.model.num_hidden_layers == cfg.model.num_hidden_layers
    deep = load_config(["cfg=configs/llama8b_32k.yaml", "probe.layers=3"])
    assert probe_config(deep).model.num_hidden_layers == 3


def test_the_probe_job_script_keeps_a_run_name_with_spaces_hashes_and_quotes(tmp_path):
    """The sbatch script and the resolved config of the probe's dry run name the probe's own
    directory whole; nothing is written."""
    proc = run_command(
        probe_main,
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=slurm",
        "dry_run=true",
        f"run.name='{NAME}'",
        f"run.output_root={tmp_path}",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    quoted = "'exp #1 \"a\"=b_probe'"  # submitit's shlex quoting, which sbatch reads back
    assert f"#SBATCH --job-name={quoted}" in proc.stdout
    assert (
        f"#SBATCH --output='{tmp_path}/exp #1 \"a\"=b_probe/submitit/%j_0_log.out'" in proc.stdout
    )
    assert f"name: '{NAME}_probe'" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_probe_steps_and_layers_must_be_positive():
    with pytest.raises(ConfigError, match=r"probe.steps=0 must be >= 1\n  probe.layers=0 must"):
        load_config(["cfg=configs/tiny_cpu.yaml", "probe.steps=0", "probe.layers=0"])


def test_gpu_check_exits_with_a_clear_message_without_a_gpu():
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert proc.stderr.startswith("gpu_check: no GPU visible"), proc.stderr
