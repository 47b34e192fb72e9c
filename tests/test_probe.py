"""The probe measures real numbers on the tiny CPU job (2 gloo ranks, SP=2), reports them
beside the plan, stops on a signal with what it measured, records running out of memory as a
finding. A probe's run takes about a minute on 2 cores, so the tests that start one are in the
slow tier. The GPU check's tests are in test_gpu_check.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import oom_model
import pytest
from in_process import run_command
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slurm_autosp.commands.probe import main as probe_main
from slurm_autosp.config import ConfigError, load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_time import StepTime
from slurm_autosp.memory_plan import training_choices
from slurm_autosp.metrics.outside_allocator import OutsideAllocator
from slurm_autosp.probe.findings import RankResult, build_report, write_report
from slurm_autosp.probe.kernels import FAIL, PASS, KernelCheck
from slurm_autosp.probe.probe_job import probe_config
from slurm_autosp.probe.steps import OutOfMemory, StepMeasurement

REPO = Path(__file__).resolve().parents[1]
# What the forward keeps for backward against the plan's activations and loss inputs: the plan
# counts the traced graphs' saved tensors, the run also keeps a few small ones (token ids, scalars).
HELD_TOLERANCE = 0.10


# After SIGTERM: the step running ends, the ranks agree, rank 0 writes the report and every
# process exits. A tiny CPU step takes 0.05 s, writing the report a few seconds on 2 busy cores;
# on a machine loaded by other tests, no longer than the probe took to start (its imports and
# process group: the same kind of work as its exit), whichever is more.
STOP_BOUND_S = 30


def probe_command(root: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "slurm_autosp",
        "probe",
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=local",
        f"run.output_root={root}",
        *overrides,
    ]


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    proc = subprocess.run(
        probe_command(root, "probe.steps=4"),
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
    # every rank ran the kernels' exactness check on its own device before measuring
    assert report["kernels"] and all(k["ranks"] for k in report["kernels"])
    assert report["verdict"]["text"].startswith("verdict: kernel")


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


def _group_alive(pgid: int) -> list[int]:
    """The processes of group `pgid` still running (zombies excluded: nobody may reap them)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _wait_for_line(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} within {timeout_s} s:\n" + path.read_text(errors="replace"))


@pytest.mark.slow
def test_sigterm_stops_the_probe_at_its_next_step_and_it_writes_what_it_measured(tmp_path):
    """SIGTERM to the probe's process group, as `timeout` sends it (scancel and a time limit
    signal every process of the job alike): the ranks stop at their next step boundary, rank 0
    writes probe.json with the steps measured so far, and every process is gone within
    STOP_BOUND_S (or the probe's own start-up time, on a loaded machine), so the GPU is free
    for the next job."""
    steps = 100_000  # hours of steps: only the signal ends this probe
    log = tmp_path / "probe.out"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            probe_command(
                tmp_path, f"probe.steps={steps}", "parallel.sp_size=1", "compile.enabled=false"
            ),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for_line(log, f"probe: step 3 of {steps}", timeout_s=300)
        bound = max(STOP_BOUND_S, time.monotonic() - started)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)  # the follower dies at once (SIGTERM's default)
        deadline = time.monotonic() + bound
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(proc.pid), f"still running {bound:.0f} s after SIGTERM"
    finally:
        for pid in _group_alive(proc.pid):
            os.kill(pid, signal.SIGKILL)
    report = json.loads((tmp_path / "tiny_cpu_probe" / "probe.json").read_text())
    stopped = report["verdict"]["stopped"]
    assert stopped.startswith("stopped by SIGTERM after step "), stopped
    assert "STOPPED EARLY" in report["verdict"]["text"]
    for rank in report["ranks"]:
        assert 3 <= len(rank["seconds"]) < steps and rank["step_s"] > 0 and rank["oom"] is None


@pytest.mark.slow
def test_running_out_of_memory_in_the_first_step_is_recorded_with_the_memory(tmp_path):
    """A one-rank probe's forward raises torch.OutOfMemoryError in step 1 (oom_model stands
    in for a GPU too small): no step is timed, yet probe.json is written with the error, the
    step and the memory when it struck, and the log says it ran out of memory. (Among several
    ranks it ends the job on every rank: tests/test_rank_failure.py.)"""
    proc = subprocess.run(
        probe_command(
            tmp_path,
            oom_model.BUILDER,
            "probe.steps=3",
            "cluster.tasks_per_node=1",
            "parallel.sp_size=1",
            "compile.enabled=false",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=oom_model.job_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ran out of memory at step 1: {oom_model.MESSAGE}" in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "tiny_cpu_probe" / "probe.json").read_text())
    assert report["step_s"] is None and report["tokens_per_s"] is None
    for rank in report["ranks"]:
        assert rank["seconds"] == [] and rank["step_s"] is None and rank["mfu"] is None
        oom = rank["oom"]
        assert oom["step"] == 1 and oom["message"] == oom_model.MESSAGE
        assert oom["peak_bytes"] >= oom["allocated_bytes"] > 0  # the rank's RSS on CPU
    assert report["verdict"]["oom_ranks"] == [0]
    assert "OUT OF MEMORY on rank(s) [0]" in report["verdict"]["text"]


def _out_of_memory_at_step_one(rank: int, kernel: KernelCheck) -> RankResult:
    oom = OutOfMemory(
        1, "CUDA out of memory. Tried to allocate 2.00 GiB", 70 * 2**30, 79 * 2**30, 0
    )
    steps = StepMeasurement([], [], None, 0, 79 * 2**30, 0, 1e15, None, "CPU", oom, "")
    return RankResult(rank, "node", [kernel], [], steps)


def test_a_report_with_no_timed_step_is_written_with_the_out_of_memory_error(tmp_path):
    """The report's own path, without processes: ranks that ran out of memory in their first
    step (nothing timed) still give a table, a verdict and probe.json; a kernel check that
    failed on one rank names it."""
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", f"run.output_root={tmp_path}"])
    exact = KernelCheck("documents", PASS, 1e-3, 2e-3, "bf16 vs fp32")
    wrong = KernelCheck("documents", FAIL, 5e-2, 2e-3, "bf16 vs fp32")
    ranks = [_out_of_memory_at_step_one(0, exact), _out_of_memory_at_step_one(1, wrong)]
    report = build_report(cfg, training_choices(cfg), ranks, None, on_gpu=False)
    table = write_report(report, tmp_path, tensorboard=False)
    assert "out of memory at step 1: CUDA out of memory" in table
    assert "slowest rank: none completed a step" in table
    assert "kernels exact: NO (documents on rank(s) [1])" in table
    written = json.loads((tmp_path / "probe.json").read_text())
    assert written["step_s"] is None and written["verdict"]["oom_ranks"] == [0, 1]
    assert written["ranks"][0]["oom"]["allocated_bytes"] == 70 * 2**30
    assert written["verdict"]["kernels_exact"] is False
    assert written["kernels"] == [
        {
            "name": "documents",
            "status": FAIL,
            "ranks": [1],
            "error": 5e-2,
            "tolerance": 2e-3,
            "detail": "bf16 vs fp32",
        }
    ]


def test_the_slowest_ranks_step_is_recorded_for_the_runs_signal_delay(tmp_path):
    """The report's own path, without processes: the probe records its step where the real
    run's admission reads it (RunDir.step_time, in the probe's run directory); a probe with no
    timed step records nothing."""
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", f"run.output_root={tmp_path}"])
    kernel = KernelCheck("documents", PASS, 1e-3, 2e-3, "bf16 vs fp32")

    def timed(rank: int, seconds: list[float]) -> RankResult:
        steps = StepMeasurement(seconds, [], None, 0, 0, 0, 3e12, None, "CPU", None, "")
        return RankResult(rank, "node", [kernel], [], steps)

    ranks = [timed(0, [9.0, 1.0, 1.2, 1.1]), timed(1, [9.0, 1.3, 1.4, 1.5])]
    write_report(build_report(cfg, training_choices(cfg), ranks, None, False), tmp_path, False)
    recorded = StepTime.read(RunDir(tmp_path).step_time)
    assert recorded == StepTime(1.4, 3, 3e12, 2, "the probe")

    silent = tmp_path / "oom"
    silent.mkdir()
    ranks = [_out_of_memory_at_step_one(0, kernel), _out_of_memory_at_step_one(1, kernel)]
    write_report(build_report(cfg, training_choices(cfg), ranks, None, False), silent, False)
    assert StepTime.read(RunDir(silent).step_time) is None
    assert OutsideAllocator.read(RunDir(silent).outside_allocator) is None  # CPU ranks


def test_the_busiest_ranks_memory_outside_the_allocator_is_recorded_for_the_runs_plan(tmp_path):
    """GPU ranks read the device's memory outside torch's allocator after their first step
    (StepMeasurement.outside_allocator_bytes); the probe records the largest in its run
    directory, where the real run's plan reads it (memory_plan.terms.outside_allocator)."""
    cfg = load_config(["cfg=configs/tiny_cpu.yaml", f"run.output_root={tmp_path}"])
    kernel = KernelCheck("documents", PASS, 1e-3, 2e-3, "bf16 vs fp32")

    def read(rank: int, outside: float) -> RankResult:
        steps = StepMeasurement([2.0, 1.0], [], None, 0, 0, 0, 3e12, None, "CPU", None, "", outside)
        return RankResult(rank, "node", [kernel], [], steps)

    ranks = [read(0, 1.5e9), read(1, 2.5e9)]
    write_report(build_report(cfg, training_choices(cfg), ranks, None, False), tmp_path, False)
    recorded = OutsideAllocator.read(RunDir(tmp_path).outside_allocator)
    assert recorded is not None
    assert (recorded.bytes, recorded.world_size, recorded.sp_size, recorded.ring_size) == (
        2.5e9,
        2,
        cfg.parallel.sp_size,
        1,
    )
