"""The embedded default job runs end to end through submitit's local executor."""

import json
import os
import re
import time

import broken_model
import pytest
from local_submit import submit_local
from submitit.core.utils import pickle_load
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_time import StepTime
from slurm_autosp.verify.start_check import INJECT_ENV


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    proc = submit_local(f"run.output_root={root}", "train.steps=30", "train.log_every=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "tiny_cpu", proc.stdout


def test_two_rank_run_prints_falling_losses(tiny_run):
    _, stdout = tiny_run
    losses = [
        float(line.split("loss ")[1].split()[0])
        for line in stdout.splitlines()
        if "| loss " in line
    ]
    assert len(losses) == 30
    assert losses[-1] < losses[0] - 1.0, losses


def test_run_directory_holds_config_logs_and_events(tiny_run):
    run_dir, _ = tiny_run
    assert (run_dir / "config.yaml").read_text().count("tasks_per_node: 2") == 1
    logs = sorted(p.name for p in (run_dir / "submitit").glob("*_log.out"))
    assert len(logs) == 2 and logs[0].endswith("_0_log.out") and logs[1].endswith("_1_log.out")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 31))
    assert loss[-1].value < loss[0].value
    assert {"train/lr", "train/grad_norm", "throughput/tokens_per_s", "memory/peak_mib"} <= set(
        events.Tags()["scalars"]
    )


def test_the_job_proves_its_sp_exact_before_step_1(tiny_run):
    """Rank 0's log, TensorBoard's text and the run directory hold the start check: what it
    compared, its worst error and how long it took."""
    run_dir, stdout = tiny_run
    line = next(line for line in stdout.splitlines() if "exactness check:" in line)
    assert "exactness check: passed: llama shrunk to 2 layers, SP 2 x DP 1 on cpu" in line
    worst = float(re.search(r"worst relative error (\S+) \(limit 1e-05\)", line).group(1))
    assert worst <= 1e-5
    assert stdout.index("exactness check:") < stdout.index("| loss ")
    record = json.loads(RunDir(run_dir).start_check.read_text())
    assert record["passed"] and record["worst_error"] == pytest.approx(worst, rel=0.1)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("run/exactness_check/text_summary")[0].tensor_proto.string_val[0]
    assert text.decode().startswith("exactness check: passed")


def test_training_records_its_step_for_the_next_submissions_signal_delay(tiny_run):
    """Rank 0 records the median of the job's first three timed steps (its first compiles)."""
    run_dir, _ = tiny_run
    recorded = StepTime.read(RunDir(run_dir).step_time)
    assert recorded is not None
    assert (recorded.measured_by, recorded.steps, recorded.world_size) == ("training", 3, 2)
    assert 0 < recorded.seconds < 10 and recorded.flops_per_step > 0


def test_the_run_exports_weights_that_load(tiny_run):
    """ZeRO-1's export: rank 0 copies each tensor to its host as the export takes it."""
    run_dir, _ = tiny_run
    hf = RunDir(run_dir).hf_export
    assert (hf / "model.safetensors").exists() and not (
        hf / "model.safetensors.index.json"
    ).exists()
    assert AutoModelForCausalLM.from_pretrained(hf).config.architectures == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_a_failing_rank_reaches_the_terminal_with_its_rank(tmp_path):
    # started as from a background shell, whose SIGINT is ignored: the failing job is still
    # cancelled, so its controller (which holds our pipes) ends and the command returns
    proc = submit_local(
        f"run.output_root={tmp_path}",
        broken_model.BUILDER,
        env=broken_model.job_env(),
        timeout=180,
        ignore_sigint=True,
    )
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stderr
    assert broken_model.ERROR in proc.stderr
    controller = int(re.search(r"submitted job (\d+) \(local", proc.stdout).group(1))
    assert _gone(controller), f"job {controller}'s controller outlived the failed job"


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_tiled_and_offloaded_run_trains_the_same_steps(tiny_run, tmp_path):
    """compile.tile_tokens and compile.offload_activations reach training: the MLPs run in
    tiles (48 tokens: 3 per rank's 128, the last one short) and the losses are the untiled,
    resident run's (tile order changes only the summation order)."""
    run_dir, _ = tiny_run
    proc = submit_local(
        f"run.output_root={tmp_path}",
        "train.steps=30",
        "train.log_every=1",
        "compile.tile_tokens=48",
        "compile.offload_activations=true",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = next((tmp_path / "tiny_cpu" / "submitit").glob("*_0_log.out")).read_text()
    assert "MLP tiles of 48 tokens" in log and "activation offload:" in log
    reference, tiled = (
        pickle_load(sorted((d / "submitit").glob("*_0_result.pkl"))[-1])[1].losses
        for d in (run_dir, tmp_path / "tiny_cpu")
    )
    assert len(tiled) == 30
    assert all(
        abs(a - b) <= 1e-5 * abs(b) for a, b in zip(tiled[:3], reference[:3], strict=True)
    ), (
        tiled[:3],
        reference[:3],
    )
    assert tiled[-1] < tiled[0] - 1.0


@pytest.mark.slow
def test_ring_run_trains_the_ulysses_runs_steps(tiny_run, tmp_path):
    """parallel.ring_size=2 reaches training: the job's dims give the compiler a ring of 2 (Ulysses
    1) and the step its zigzag shards, and the losses are the Ulysses run's (exact in fp32; the
    ring sums the blocks in another order, and Adam amplifies that over 30 steps)."""
    run_dir, _ = tiny_run
    proc = submit_local(
        f"run.output_root={tmp_path}", "train.steps=30", "train.log_every=1", "parallel.ring_size=2"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = next((tmp_path / "tiny_cpu" / "submitit").glob("*_0_log.out")).read_text()
    assert "AutoSPBackend(sp_size=2, ring_size=2" in log
    reference, ring = (
        pickle_load(sorted((d / "submitit").glob("*_0_result.pkl"))[-1])[1].losses
        for d in (run_dir, tmp_path / "tiny_cpu")
    )
    assert len(ring) == 30
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ring[:3], reference[:3], strict=True)), (
        ring[:3],
        reference[:3],
    )
    assert ring[-1] < ring[0] - 1.0


@pytest.mark.slow
def test_a_job_whose_sp_is_wrong_stops_before_step_1_naming_the_mismatch(tmp_path):
    """The shard-boundary bug injected into the job's own check: every rank stops before any
    state exists, submit exits 3 (not a crash's 1) with verify's report, and the run directory
    holds the report and nothing trained."""
    proc = submit_local(
        f"run.output_root={tmp_path}",
        "train.steps=3",
        env={**os.environ, INJECT_ENV: "per_shard_shift"},
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "stopped before step 1:\nexactness check: FAILED" in proc.stderr
    assert "the label pair crossing each shard boundary is lost" in proc.stderr
    report = proc.stderr.split("stopped before step 1")[1].split("nothing was trained")[0]
    assert "Traceback" not in report and "FAIL: AutoSP does not match" in report
    run = RunDir(tmp_path / "tiny_cpu")
    assert json.loads(run.start_check.read_text())["passed"] is False
    assert not list(run.checkpoints.glob("step_*")) and not run.tensorboard.exists()
    assert "| loss " not in proc.stdout
