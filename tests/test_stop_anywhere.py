"""A stop at any moment of a job, end to end on local processes, the signal sent to every
process of the job step as SLURM sends it: during an evaluation, in a step that turned out
longer than the threshold where `cluster.stop_at` is null, and while the first step compiles.
Each time every rank stops cleanly, saves and requeues, and the requeued job resumes from the
step before."""

import re
import signal
import sys
import time
from pathlib import Path

import pytest
from local_job import Job, gone, job_step, signal_job_step
from reference_run import assert_same_weights, hf_weights, prepared_dataset, tensorboard_losses
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

HANG_S = 120  # a stop that takes longer hangs


def submit(root: Path, name: str, *overrides: str) -> Job:
    cmd = [
        sys.executable,
        "-m",
        "slurm_autosp.submit",
        "cfg=configs/tiny_cpu.yaml",
        "cluster.backend=local",
        f"run.output_root={root}",
        f"run.name={name}",
        "train.log_every=1",
        "train.start_check=false",
        *overrides,
    ]
    return Job(cmd, root / name)


def eval_losses(run_dir: Path) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("eval/loss")]


def stop_job_step(job: Job, signum: signal.Signals) -> tuple[set[int], float]:
    """`signum` to every process of the job step; returns the ranks and when it was sent."""
    ranks = job.ranks()
    assert len(ranks) == 2, job.output
    signal_job_step(ranks, signum)
    return ranks, time.monotonic()


@pytest.mark.slow
def test_a_signal_during_an_evaluation_stops_every_rank_after_its_batch_in_flight(tmp_path):
    """USR2 a third into the evaluation after step 6 (100 batches): every rank leaves it after
    the same batch, reports nothing of it, saves step 6 and requeues; the requeued job trains
    steps 7 and 8 and evaluates after step 8 as the uninterrupted run does."""
    held_out = prepared_dataset(tmp_path / "held_out", [256 * 200 + 1])
    evaluating = (
        "train.steps=8",
        f"data.eval_path={held_out}",
        "train.eval_every=3",
        "train.eval_samples=200",
    )
    reference = submit(tmp_path, "reference", *evaluating)
    reference.finish()
    found = re.search(r"eval at step 6 \|.*\| ([\d.]+) s", reference.output)
    assert found, reference.output
    eval_s = float(found.group(1))

    job = submit(tmp_path, "stopped", *evaluating)
    job.wait_for("step 6", lambda: "step 6/8" in job.output)
    time.sleep(eval_s / 3)
    ranks, sent = stop_job_step(job, signal.SIGUSR2)
    job.wait_for("the ranks exited", lambda: gone(ranks), timeout=HANG_S)
    print(f"ranks exited {time.monotonic() - sent:.2f} s after USR2; evaluation {eval_s} s")
    job.finish()
    stopped = re.search(r"evaluation stopped after (\d+) of 100 batches", job.output)
    assert stopped and int(stopped.group(1)) < 100, job.output
    assert "stopping at step 6 on SIGUSR2" in job.output
    assert f"resumed from {job.checkpoints / 'step_00000006'} at step 6" in job.output

    losses = tensorboard_losses(tmp_path / "stopped")
    assert [step for step, _ in losses] == list(range(1, 9))
    assert losses == tensorboard_losses(tmp_path / "reference")  # bitwise
    assert_same_weights(hf_weights(tmp_path / "stopped"), hf_weights(tmp_path / "reference"))
    evaluated = eval_losses(tmp_path / "reference")
    assert [step for step, _ in evaluated] == [3, 6, 8]
    assert eval_losses(tmp_path / "stopped") == [evaluated[0], evaluated[2]]  # nothing partial


@pytest.mark.slow
def test_a_null_stop_at_stops_at_a_layer_once_a_measured_step_is_long(tmp_path):
    """No plan (CPU ranks), cluster.stop_at null, steps of 16 layers at 16k tokens that take
    over 30 s: step 2 measures long, so USR2 a third into step 3 stops it at a layer boundary,
    not at its end."""
    job = submit(
        tmp_path,
        "long",
        "model.num_hidden_layers=16",
        "data.seq_len=16384",
        "train.micro_batch=1",
        "train.steps=3",
    )
    logged = r"step 2/3 \|.*\| ([\d.]+) s/step"
    job.wait_for("step 2", lambda: re.search(logged, job.output), timeout=900)
    match = re.search(logged, job.output)
    assert match is not None
    step_s = float(match.group(1))
    assert step_s > 30, f"steps of {step_s} s: this test needs steps over the 30 s threshold"
    time.sleep(step_s / 3)
    ranks, sent = stop_job_step(job, signal.SIGUSR2)
    job.wait_for("the ranks exited", lambda: gone(ranks), timeout=step_s + HANG_S)
    exited_s = time.monotonic() - sent
    print(f"ranks exited {exited_s:.2f} s after USR2; steps of {step_s} s")
    job.finish(timeout=900)
    assert "step 2 took over 30 s: a stop signal ends a step at its next layer boundary" in (
        job.output
    )
    assert exited_s < step_s / 2, f"{exited_s:.1f} s after USR2: the step ran to its end"
    assert "step 3 abandoned at a layer boundary" in job.output
    assert "stopping at step 2 on SIGUSR2" in job.output
    assert f"resumed from {job.checkpoints / 'step_00000002'} at step 2" in job.output


def compiling_a_kernel(ranks: set[int]) -> bool:
    """Whether one of `ranks` runs g++ on a kernel (not the ISA probe, whose failure inductor
    takes for an ISA the CPU lacks)."""
    for pid in job_step(ranks) - ranks:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if Path(args[0].decode()).name == "g++":
                return "__avx_chk_kernel" not in Path(args[1].decode()).read_text()
        except (OSError, IndexError, UnicodeDecodeError):
            continue
    return False


@pytest.mark.slow
def test_a_signal_while_the_first_step_compiles_stops_after_that_step(tmp_path):
    """USR2 to the job step while g++ compiles a kernel of step 1 (a fresh compile cache): the
    compilers keep compiling, step 1 ends, every rank saves it and requeues, and the run ends
    with the uninterrupted run's losses and weights."""
    steps = ("train.steps=3",)
    reference = submit(tmp_path, "reference", *steps, f"compile.cache_dir={tmp_path / 'cache1'}")
    reference.finish()

    job = submit(tmp_path, "stopped", *steps, f"compile.cache_dir={tmp_path / 'cache2'}")
    job.wait_for("a kernel compiling", lambda: compiling_a_kernel(job.ranks()), timeout=600)
    ranks, sent = stop_job_step(job, signal.SIGUSR2)
    job.wait_for("the ranks exited", lambda: gone(ranks), timeout=600)
    print(f"ranks exited {time.monotonic() - sent:.2f} s after USR2")
    job.finish()
    assert "stopping at step 1 on SIGUSR2" in job.output
    assert f"resumed from {job.checkpoints / 'step_00000001'} at step 1" in job.output
    assert tensorboard_losses(tmp_path / "stopped") == tensorboard_losses(tmp_path / "reference")
    assert_same_weights(hf_weights(tmp_path / "stopped"), hf_weights(tmp_path / "reference"))
