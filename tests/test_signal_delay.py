"""Never late: admission refuses a GPU job whose SLURM pre-timeout signal comes too late for it
to stop (at the end of its step, or within two layers of it: cluster.stop_at; in an
evaluation, at the end of its batch in flight) plus one synchronous save, naming the delay that would do, the save's size and write rate, and the
step time with where it came from (measured by the run or its probe, else estimated from
FLOPs); the delay it names is admitted."""

import math
import re
from pathlib import Path

import pytest
from in_process import run_command
from reference_run import prepared_dataset

from slurm_autosp.admission import admit
from slurm_autosp.commands.probe import main as probe_main
from slurm_autosp.commands.run import main as run_main
from slurm_autosp.commands.submit import main as submit_main
from slurm_autosp.config import StopAt, load_config
from slurm_autosp.lifecycle.run_dir import RunDir
from slurm_autosp.lifecycle.save_time import SignalDelayTooShort, StepTime
from slurm_autosp.memory_plan import build_plan
from slurm_autosp.metrics.flops import count_flops
from slurm_autosp.model import build_skeleton

LLAMA8B = "cfg=configs/llama8b_32k.yaml"
SAVE_S = 28.1  # ZeRO-1: rank 0 writes the bf16 weights and its optimizer shard, 28.1 GB at 1 GB/s
CONFIGS = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def refusal(*args: str) -> str:
    with pytest.raises(SignalDelayTooShort) as refused:
        admit(load_config(list(args)))
    return str(refused.value)


def named_delay(message: str) -> int:
    found = re.search(r"set cluster\.signal_delay_s=(\d+) or more", message)
    assert found, message
    return int(found.group(1))


def step_flops(args: list[str]) -> float:
    cfg = load_config(args)
    return count_flops(build_skeleton(cfg.model), cfg.data.seq_len, cfg.global_batch).per_step


def test_the_flops_estimate_refuses_a_short_delay_and_names_one_that_is_admitted(tmp_path):
    args = [LLAMA8B, f"run.output_root={tmp_path}"]
    message = refusal(*args, "cluster.signal_delay_s=60")
    # 9.28e15 FLOPs over 8 GPUs x 989 TFLOP/s x 25% = 4.7 s
    assert message.startswith(
        "cluster.signal_delay_s=60 cannot cover one step plus one synchronous save after "
        "SLURM's pre-timeout signal (USR2): set cluster.signal_delay_s=71 or more\n"
        "  step: 4.7 s, estimated: 9.28e+15 model FLOPs per step over 8 GPUs at an assumed "
        "25% MFU of 989 TFLOP/s (H100 dense bf16, assumed: set trace.peak_tflops_per_gpu for "
        "another GPU); no step measured yet in "
    ), message
    assert f"save: rank 0 writes 28.1 GB, {SAVE_S} s at checkpoint.write_gb_per_s=1\n" in message
    assert (
        "stop: at the end of the step in flight (cluster.stop_at=null), at the next layer "
        "boundary once a step measures 15 s or more\n"  # a quarter of the delay
    ) in message
    assert "needed: 1.25 x (stop + save) + 30 s = 71 s" in message
    # the plan comes with the refusal (its figure moves with torch's traced graph)
    assert re.search(r"verdict: fits: \d+\.\d of 80 GB", message), message
    admit(load_config([*args, "cluster.signal_delay_s=71"]))
    refusal(*args, "cluster.signal_delay_s=70")
    # a slower file system asks for more: 1.25 x (4.7 + 281.1) + 30 = 388 s
    slow = refusal(*args, "cluster.signal_delay_s=71", "checkpoint.write_gb_per_s=0.1")
    assert "rank 0 writes 28.1 GB, 281.1 s at checkpoint.write_gb_per_s=0.1" in slow
    assert named_delay(slow) == 388


def test_a_step_the_run_measured_is_what_the_delay_is_held_to(tmp_path):
    args = [LLAMA8B, f"run.output_root={tmp_path}", "cluster.stop_at=step"]
    run = RunDir(load_config(args).run.dir)
    run.root.mkdir(parents=True)
    StepTime(200.0, 3, step_flops(args), 8, "training").write(run.step_time)
    message = refusal(*args)  # the shipped 120 s covers the estimate (71 s), not 200 s
    assert (
        f"step: 200.0 s, measured by training: 200 s, the median of 3 timed steps "
        f"({run.step_time})\n"
    ) in message
    needed = named_delay(message)
    assert needed == math.ceil(1.25 * (200 + SAVE_S) + 30)
    admit(load_config([*args, f"cluster.signal_delay_s={needed}"]))


def test_the_probes_step_counts_until_the_run_has_its_own_scaled_to_the_run(tmp_path):
    """The probe ran 8 of the model's 32 layers: its step scales by the FLOPs per GPU."""
    args = [LLAMA8B, f"run.output_root={tmp_path}", "cluster.stop_at=step"]
    probe_args = [*args, "model.num_hidden_layers=8"]
    run = RunDir(load_config(args).run.dir)
    run.probe_run.root.mkdir(parents=True)
    StepTime(50.0, 2, step_flops(probe_args), 8, "the probe").write(run.probe_run.step_time)
    ratio = step_flops(args) / step_flops(probe_args)
    message = refusal(*args)
    assert (
        f"measured by the probe: 50 s, the median of 2 timed steps ({run.probe_run.step_time})"
        in message
    )
    assert f"x{ratio:.3g} for this job's FLOPs per GPU" in message
    assert named_delay(message) == math.ceil(1.25 * (50 * ratio + SAVE_S) + 30)

    run.root.mkdir()
    StepTime(10.0, 3, step_flops(args), 8, "training").write(run.step_time)
    admit(load_config(args))  # the run's own step wins: 1.25 x (10 + 28.1) + 30 = 78 s <= 120


def test_a_long_step_stops_within_two_layers_and_the_delay_covers_only_those(tmp_path):
    """A step past a short GraceTime (30 s) stops at layer boundaries unless configured not to:
    the delay covers two of its 32 layers' share of it, then the save."""
    args = [LLAMA8B, f"run.output_root={tmp_path}"]
    run = RunDir(load_config(args).run.dir)
    run.root.mkdir(parents=True)
    StepTime(2000.0, 3, step_flops(args), 8, "training").write(run.step_time)
    message = refusal(*args)  # the shipped 120 s
    assert "cannot cover two layers of a step plus one synchronous save" in message
    assert (
        "stop: at the next layer boundary (cluster.stop_at=layer), within 2 of 32 layers' "
        "share of the step: 125.0 s\n"
    ) in message
    needed = named_delay(message)
    assert needed == math.ceil(1.25 * (2 * 2000 / 32 + SAVE_S) + 30)
    admit(load_config([*args, f"cluster.signal_delay_s={needed}"]))
    # stopping at the step's end asks for the whole step
    step_stop = refusal(*args, f"cluster.signal_delay_s={needed}", "cluster.stop_at=step")
    assert named_delay(step_stop) == math.ceil(1.25 * (2000 + SAVE_S) + 30)


def test_a_stop_in_an_evaluation_waits_for_its_batch_and_the_delay_covers_one(tmp_path):
    """An evaluation batch is one micro-batch's forward, a share of the step the plan's traced
    FLOPs give (forward over forward, backward and recompute): longer than two of 32 layers
    of a long step, it is the stop the delay must cover."""
    held_out = prepared_dataset(tmp_path / "held_out", [40_000])
    args = [LLAMA8B, f"run.output_root={tmp_path}", f"data.eval_path={held_out}"]
    cfg = load_config(args)
    RunDir(cfg.run.dir).root.mkdir(parents=True)
    StepTime(2000.0, 3, step_flops(args), 8, "training").write(RunDir(cfg.run.dir).step_time)
    t = build_plan(cfg).configured.trace
    share = t.forward_flops / (t.forward_flops + t.backward_flops + t.recompute_flops)
    batch_s = 2000 / cfg.train.grad_accum * share
    assert batch_s > 2 * 2000 / 32
    message = refusal(*args)
    assert "cannot cover one evaluation batch plus one synchronous save" in message
    assert (
        "evaluation: a stop waits for the batch in flight, one micro-batch's forward: estimated "
        "as its share of the step, the plan's forward FLOPs over forward, backward and "
        f"recompute ({share:.0%}): {batch_s:,.1f} s\n"
    ) in message
    needed = named_delay(message)
    assert needed == math.ceil(1.25 * (batch_s + SAVE_S) + 30)
    admit(load_config([*args, f"cluster.signal_delay_s={needed}"]))


def test_llama8b_4m_stops_at_layers_saves_every_step_and_is_admitted_at_900_s(tmp_path):
    cfg = load_config(["cfg=configs/llama8b_4m.yaml", f"run.output_root={tmp_path}"])
    assert cfg.cluster.signal_delay_s == 900
    admitted = admit(cfg).cfg
    assert admitted.cluster.stop_at is StopAt.layer  # frozen by admission
    assert admitted.checkpoint.every_steps == 1
    assert cfg.cluster.stop_at is None  # into a new config: the loaded one is never edited


def test_cpu_and_builder_jobs_are_not_held_to_a_step_and_a_save(tmp_path):
    root = f"run.output_root={tmp_path}"
    admit(load_config(["cfg=configs/tiny_cpu.yaml", root, "cluster.signal_delay_s=1"]))
    admit(load_config([LLAMA8B, root, "model.builder=broken_model:build", "cluster.signal_delay_s=1"]))  # fmt: skip


@pytest.mark.parametrize("main", [submit_main, run_main], ids=["submit", "run"])
def test_submit_and_run_refuse_before_anything_is_written(main, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)  # run sets it; restored after
    args = [LLAMA8B, f"run.output_root={tmp_path / 'runs'}", "cluster.signal_delay_s=60"]
    proc = run_command(main, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {refusal(*args)}\n" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_dry_run_refuses_with_the_plan_and_the_probe_which_saves_nothing_is_not_refused(
    tmp_path,
):
    args = [LLAMA8B, f"run.output_root={tmp_path}", "cluster.signal_delay_s=60", "dry_run=true"]
    submitted = run_command(submit_main, *args)
    assert submitted.returncode == 2
    assert "error: cluster.signal_delay_s=60 cannot cover one step" in submitted.stderr
    assert "memory plan" in submitted.stderr and "verdict: fits" in submitted.stderr
    probed = run_command(probe_main, *args)
    assert probed.returncode == 0, probed.stderr
    assert "signal delay: cluster.signal_delay_s=60 CANNOT cover one step" in probed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_every_shipped_config_gives_its_job_time_for_a_step_and_a_save(config, tmp_path):
    proc = run_command(submit_main, f"cfg=configs/{config}", "dry_run=true", f"run.output_root={tmp_path}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "CANNOT cover" not in proc.stdout
